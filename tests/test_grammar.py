"""Engine side of constraints (sgl.backend.grammar): compile cache, masks, jump-forward.

Uses the real default-model tokenizer (SmolLM2, read from the GGUF: no weights are loaded).
Jump-forward is checked by simulating decoding with stand-in "models" that pick tokens:
  * the ideal model emits exactly the tokenizer's tokens of a target text, so a lossless
    jump-forward must reproduce those tokens exactly, in fewer steps;
  * a random model picks uniformly among allowed tokens (seeded), to hit odd boundaries.
"""

from __future__ import annotations

import json
import random
import threading
from typing import Any, Callable

import pydantic
import pytest
import torch

from sgl.backend.grammar import (
    ConstraintState,
    GrammarBackend,
    _allows_only_stop,
    allocate_bitmask,
    apply_bitmask,
    bitmask_to_bool,
    fill_bitmasks,
)
from sgl.backend.grammar_jump import BoundaryCache, JumpPlan, plan_jump_forward
from sgl.constraints import build_constraint
from sgl.errors import InvalidConstraintError

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer: Any) -> Any:
    return default_tokenizer


@pytest.fixture(scope="module")
def backend(tokenizer: Any) -> GrammarBackend:
    return GrammarBackend(tokenizer, VOCAB)


@pytest.fixture(scope="module")
def vocab_text(tokenizer: Any) -> list[str]:
    return [tokenizer.decode([i], clean_up_tokenization_spaces=False) for i in range(len(tokenizer))]


def allowed_ids(state: ConstraintState) -> list[int]:
    mask = allocate_bitmask(1, VOCAB)
    fill_bitmasks([state], mask)
    return bitmask_to_bool(mask, VOCAB)[0].nonzero().flatten().tolist()


def decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


# -- compiling ----------------------------------------------------------------------------------


def test_compile_caches_by_kind_and_spec(backend: GrammarBackend) -> None:
    first = backend.compile("regex", "(yes|no)")
    assert backend.compile("regex", "(yes|no)") is first
    assert backend.compile("regex", "(yes|no)?") is not first


def test_concurrent_compiles_of_one_spec_compile_once(backend: GrammarBackend) -> None:
    spec = json.dumps({"type": "object", "properties": {"threaded": {"type": "integer"}}})
    misses = backend.cache_misses
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(backend.compile("json_schema", spec)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert backend.cache_misses == misses + 1


@pytest.mark.parametrize(
    ("kind", "spec", "words"),
    [
        ("regex", "a(b", "regex"),
        ("regex", "(?=x)x", "Lookahead"),
        ("json_schema", '{"type": "nonsense"}', "nonsense"),
        ("json_schema", "{not json", "JSON"),
        ("ebnf", "root ::= missing_rule", "missing_rule"),
        ("ebnf", 'root ::= "unterminated', "EBNF"),
        ("sql", "SELECT", "kind"),
    ],
)
def test_invalid_specs_raise_a_clear_error(
    backend: GrammarBackend, kind: str, spec: str, words: str
) -> None:
    with pytest.raises(InvalidConstraintError) as info:
        backend.compile(kind, spec)
    message = str(info.value)
    assert words in message
    assert "/project/cpp" not in message  # xgrammar's source location is noise to users
    # Failures are not cached and the backend keeps serving valid specs.
    with pytest.raises(InvalidConstraintError):
        backend.compile(kind, spec)
    assert backend.compile("regex", "[0-9]+").kind == "regex"


def test_front_end_specs_compile(backend: GrammarBackend) -> None:
    class Item(pydantic.BaseModel):
        name: str
        price: float
        tags: list[str] = []

    for options in ({"schema": Item}, {"dtype": float}, {"dtype": str}, {"choices": ["a+b", "c"]},
                    {"grammar": "json"}):
        spec = build_constraint(**options)
        assert backend.compile(spec.kind, spec.text).kind == spec.kind


# -- matcher and masks --------------------------------------------------------------------------


def test_mask_allows_exactly_the_prefix_tokens(backend: GrammarBackend, vocab_text: list[str]) -> None:
    words = ["cat", "dog", "cow"]
    state = backend.new_state(backend.compile("regex", "(cat|dog|cow)"))
    expected = {i for i, t in enumerate(vocab_text) if t and any(w.startswith(t) for w in words)}
    assert set(allowed_ids(state)) == expected
    assert state.accept_token(vocab_text.index("c"))
    expected = {i for i, t in enumerate(vocab_text) if t and any(w.startswith(t) for w in ["at", "ow"])}
    assert set(allowed_ids(state)) == expected


def test_termination_allows_only_eos(backend: GrammarBackend, tokenizer: Any) -> None:
    state = backend.new_state(backend.compile("regex", "(cat|dog)"))
    for token in tokenizer.encode("cat"):
        assert state.accept_token(token)
    assert state.is_completed() and not state.is_terminated()
    assert state.allowed_only_eos()
    assert allowed_ids(state) == list(backend.stop_token_ids)
    assert not state.accept_token(tokenizer.encode(" dog")[0])
    assert state.accept_token(backend.stop_token_ids[0])
    assert state.is_terminated()
    assert allowed_ids(state) == list(backend.stop_token_ids)


def test_rollback_restores_the_mask(backend: GrammarBackend, tokenizer: Any) -> None:
    state = backend.new_state(backend.compile("regex", "[a-z]+ [0-9]+"))
    before = allowed_ids(state)
    ids = tokenizer.encode("hello 42")
    for token in ids:
        assert state.accept_token(token)
    state.rollback(len(ids))
    assert state.num_accepted == 0 and allowed_ids(state) == before
    with pytest.raises(ValueError):
        state.rollback(1)


def test_batch_fill_mixes_constrained_and_free_rows(backend: GrammarBackend, tokenizer: Any) -> None:
    compiled = backend.compile("regex", "[0-9]{1,3}")
    states: list[ConstraintState | None] = [None if i % 3 == 0 else backend.new_state(compiled)
                                            for i in range(12)]  # 8 constrained: threaded path
    bitmask = allocate_bitmask(12, VOCAB)
    bitmask.zero_()  # stale content must be overwritten
    assert backend.fill_bitmasks(states, bitmask)  # threaded path: 8 constrained rows
    allowed = bitmask_to_bool(bitmask, VOCAB)
    sequential = allocate_bitmask(12, VOCAB)
    fill_bitmasks(states, sequential)
    assert torch.equal(sequential, bitmask)
    digit = tokenizer.encode("7")[0]
    for row, state in enumerate(states):
        if state is None:
            assert bool(allowed[row].all())
        else:
            assert bool(allowed[row, digit]) and int(allowed[row].sum()) < 50
    assert not fill_bitmasks([None, None], allocate_bitmask(2, VOCAB))

    logits = torch.zeros(12, VOCAB)
    apply_bitmask(logits, bitmask)
    assert torch.equal(torch.isfinite(logits), allowed)


# -- jump-forward -------------------------------------------------------------------------------


class Address(pydantic.BaseModel):
    city: str
    zip: str


class Person(pydantic.BaseModel):
    name: str
    age: int
    admin: bool
    tags: list[str]
    address: Address


TARGET = Person(name="Ada Lovelace", age=36, admin=True, tags=["math", "poet"],
                address=Address(city="London", zip="W1"))


def simulate(
    tokenizer: Any,
    state: ConstraintState,
    pick: Callable[[list[int], list[int]], int],
    *,
    jump: bool,
    max_steps: int = 400,
) -> tuple[list[int], int, list[tuple[int, int, JumpPlan]]]:
    """Decode with a stand-in model; returns (output ids, forward passes, jumps).

    Each loop iteration is one forward pass: a decode step, or an extend step after a jump
    (whose logits give the next token, like a decode step would).
    """
    out: list[int] = []
    jumps: list[tuple[int, int, JumpPlan]] = []
    steps = 0
    while not state.is_terminated() and steps < max_steps:
        if jump:
            plan = plan_jump_forward(tokenizer, state, out)
            if plan is not None:
                del out[len(out) - plan.rollback:]
                start = len(out)
                out.extend(plan.append_ids)
                state.apply(plan)
                jumps.append((start, len(out), plan))
        steps += 1
        token = pick(out, allowed_ids(state))
        assert state.accept_token(token)
        if token not in state.stop_token_ids:
            out.append(token)
    assert state.is_terminated(), "did not finish"
    assert state.num_accepted == len(out) + 1  # + the stop token
    return out, steps, jumps


@pytest.mark.parametrize("indent", [2, None])
def test_jump_forward_is_lossless_for_an_ideal_model(tokenizer: Any, indent: int | None) -> None:
    backend = GrammarBackend(tokenizer, VOCAB, json_indent=indent)
    spec = build_constraint(schema=Person)
    compiled = backend.compile(spec.kind, spec.text)
    target_text = json.dumps(TARGET.model_dump(), indent=indent,
                             separators=(",", ": ") if indent else (", ", ": "))
    target_ids = tokenizer.encode(target_text)
    eos = backend.stop_token_ids[0]

    def ideal(out: list[int], allowed: list[int]) -> int:
        assert out == target_ids[: len(out)], "a jump changed the tokenizer's tokens"
        token = target_ids[len(out)] if len(out) < len(target_ids) else eos
        assert token in allowed
        return token

    plain, plain_steps, _ = simulate(tokenizer, backend.new_state(compiled), ideal, jump=False)
    jumped, jump_steps, jumps = simulate(tokenizer, backend.new_state(compiled), ideal, jump=True)
    assert plain == jumped == target_ids
    assert spec.parse(decode(tokenizer, jumped)) == TARGET
    assert jumps and jump_steps <= 0.7 * plain_steps, (jump_steps, plain_steps)


def check_jump_boundaries(tokenizer: Any, out: list[int], jumps: list) -> None:
    """Around each jump, the tokens are the tokenizer's tokens for that text."""
    for start, end, plan in jumps:
        region = out[start - plan.boundary_kept : end]
        assert tokenizer.encode(decode(tokenizer, region)) == region, plan
        # The held-back boundary token (or the grammar's end) follows the jump: the appended
        # tokens never end inside the forced text mid-merge.
        assert decode(tokenizer, list(plan.append_ids)) in decode(tokenizer, region)


# Short strings, bounded numbers and arrays: a random stand-in model finishes it quickly.
SMALL_RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "label": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["alpha", "beta"]},
        "point": {"type": "object", "properties": {"x": {"type": "number"},
                                                   "ok": {"type": "boolean"}},
                  "required": ["x", "ok"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["id", "label", "kind", "point", "flags"],
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_jump_forward_with_a_random_model(backend: GrammarBackend, tokenizer: Any, seed: int) -> None:
    schema = SMALL_RECORD
    compiled = backend.compile("json_schema", json.dumps(schema))
    eos = backend.stop_token_ids[0]

    def random_model(rng: random.Random) -> Callable[[list[int], list[int]], int]:
        def pick(out: list[int], allowed: list[int]) -> int:
            # Prefer stopping when allowed, and short tokens, so numbers stay finite.
            return eos if eos in allowed else rng.choice(allowed)
        return pick

    plain, plain_steps, _ = simulate(tokenizer, backend.new_state(compiled),
                                     random_model(random.Random(seed)), jump=False)
    out, steps, jumps = simulate(tokenizer, backend.new_state(compiled),
                                 random_model(random.Random(seed)), jump=True)
    for ids in (plain, out):
        value = json.loads(decode(tokenizer, ids))
        assert set(value) == set(schema["required"]) and value["kind"] in ("alpha", "beta")
        assert 0 <= value["id"] <= 999 and len(value["label"]) <= 6
    check_jump_boundaries(tokenizer, out, jumps)
    assert len(jumps) >= 4
    # Forced text saved passes: each jump covers at least one token in one pass.
    assert steps < len(out) + 1


def test_cached_boundaries_plan_what_fresh_ones_plan(backend: GrammarBackend, tokenizer: Any) -> None:
    """A backend's states share one BoundaryCache (re-tokenized jump boundaries): planning
    through it, warm from earlier requests, must give the plans an empty cache gives."""
    compiled = backend.compile("json_schema", json.dumps(SMALL_RECORD))
    eos = backend.stop_token_ids[0]
    cache = BoundaryCache()
    for seed in range(6):
        rng = random.Random(seed)
        state = backend.new_state(compiled)
        state.boundaries = cache
        out: list[int] = []
        while not state.is_terminated() and len(out) < 300:
            fresh = plan_jump_forward(tokenizer, state, out, cache=BoundaryCache())
            plan = state.jump_forward(out)
            assert (plan is None) == (fresh is None)
            if plan is not None:
                assert plan == fresh  # (rollback, ids, forced text, boundary kept, accepted)
                del out[len(out) - plan.rollback:]
                out.extend(plan.append_ids)
                state.apply(plan)
            allowed = allowed_ids(state)
            token = eos if eos in allowed else rng.choice(allowed)
            assert state.accept_token(token)
            if token != eos:
                out.append(token)
    assert cache.hits > 0 and cache.misses > 0


@pytest.mark.parametrize("vocab", [64, 70, 100])
def test_only_stop_check_reads_the_mask_as_the_unpacked_reference(vocab: int) -> None:
    """`_allows_only_stop` compares mask words in numpy; it must answer as unpacking the mask
    to booleans does, bits past the vocabulary and stop ids outside it included."""

    class Fixed:  # a matcher whose mask is given
        def __init__(self, words: list[int]) -> None:
            self.words = words

        def fill_next_token_bitmask(self, mask: torch.Tensor, row: int) -> None:
            mask[row] = torch.tensor(self.words, dtype=torch.int64).to(torch.int32)

    rng = random.Random(vocab)
    words = -(-vocab // 32)
    for _ in range(300):
        stops = rng.sample(range(vocab + 8), rng.randint(0, 3))
        bits = {t for t in stops if t < words * 32 and rng.random() < 0.7}
        bits |= {rng.randrange(words * 32) for _ in range(rng.randint(0, 2))}
        packed = [0] * words
        for t in bits:
            packed[t // 32] |= 1 << (t % 32)
        packed = [w - (1 << 32) if w >= 1 << 31 else w for w in packed]  # as int32
        mask = torch.tensor(packed, dtype=torch.int64).to(torch.int32).reshape(1, -1)
        allowed = bitmask_to_bool(mask, vocab)[0].nonzero().flatten().tolist()
        want = bool(allowed) and set(allowed) <= set(stops)
        assert _allows_only_stop(Fixed(packed), vocab, stops) == want, (sorted(bits), stops)


def test_jump_never_crosses_a_possible_end(backend: GrammarBackend, tokenizer: Any) -> None:
    state = backend.new_state(backend.compile("regex", "hello world(, again and again)?"))
    plan = state.jump_forward([])
    assert plan is not None and plan.forced_text == "hello world"
    # The boundary token (" world") is held back: the model may extend it.
    assert decode(tokenizer, list(plan.append_ids)) == "hello"
    assert state.num_accepted == 0  # planning does not change the state
    state.apply(plan)
    with pytest.raises(ValueError, match="stale"):
        state.apply(plan)


def test_jump_to_the_end_keeps_the_last_token(backend: GrammarBackend, tokenizer: Any) -> None:
    state = backend.new_state(backend.compile("regex", r"The answer is: [0-9]"))
    plan = state.jump_forward([])
    # The boundary token " " is held back: a tokenizer may merge it with the digit.
    assert plan is not None and decode(tokenizer, list(plan.append_ids)) == "The answer is:"
    ended = backend.new_state(backend.compile("regex", r"[0-9] is the answer\."))
    ended.accept_token(tokenizer.encode("4")[0])
    plan = ended.jump_forward(tokenizer.encode("4"))
    assert plan is not None and plan.rollback == 0
    assert decode(tokenizer, list(plan.append_ids)) == " is the answer."  # nothing held back
    ended.apply(plan)
    assert ended.allowed_only_eos()


@pytest.mark.parametrize(
    ("prefix", "split"),
    [
        ("", ["in", "form"]),
        ("one two three four five", [" in", "form"]),
        # The window's first token ("f") changes too: the window must widen to " i".
        ("one two three four", [" i", "n", "f", "o", "r", "m"]),
    ],
)
def test_jump_rolls_back_a_split_the_tokenizer_would_merge(
    backend: GrammarBackend, tokenizer: Any, vocab_text: list[str], prefix: str, split: list[str]
) -> None:
    text = (prefix + " " if prefix else "") + "information retrieval system"
    state = backend.new_state(backend.compile("regex", "(x|" + text + ")"))
    # The tokenizer writes one token for " information"; decode it split (unnaturally).
    output = tokenizer.encode(prefix) + [vocab_text.index(piece) for piece in split]
    for token in output:
        assert state.accept_token(token)
    plan = state.jump_forward(output)
    assert plan is not None and plan.rollback == len(split)
    output = output[: len(output) - plan.rollback] + list(plan.append_ids)
    assert output == tokenizer.encode(text)  # the split is gone, ending included
    state.apply(plan)
    assert state.allowed_only_eos()


def test_jump_respects_the_token_budget(backend: GrammarBackend, tokenizer: Any) -> None:
    compiled = backend.compile("regex", r"The quick brown fox jumps over the lazy dog [0-9]")
    assert backend.new_state(compiled).jump_forward([], max_new_tokens=0) is None
    plan = backend.new_state(compiled).jump_forward([], max_new_tokens=3)
    assert plan is not None and plan.net_new_tokens == 3
    full = backend.new_state(compiled).jump_forward([])
    assert full is not None and full.net_new_tokens > 3


def test_short_forced_strings_do_not_jump(backend: GrammarBackend) -> None:
    state = backend.new_state(backend.compile("regex", r"ab[0-9]+"))
    assert state.jump_forward([]) is None  # "ab": under min_chars


def test_jump_planner_codec_equals_the_tokenizers(default_tokenizer) -> None:
    """The planner and the text drafter encode and decode through the fast tokenizer's backend
    (backend/tokenizer.py; cheaper, on the engine thread): same ids and text as the
    transformers calls they stand for, including special tokens, byte pieces of split UTF-8
    characters, and whitespace runs."""
    from sgl.backend.tokenizer import decode_ids, encode_text

    tok = default_tokenizer
    assert getattr(tok, "backend_tokenizer", None) is not None  # else the test checks nothing
    texts = ['{"name": "Maria Lopez", "age": 34}', '\n  "street": "Main', "héllo wörld ✓ 日本 😀",
             "<|im_end|> x <|im_start|>", '  \n\t  "tags": [', "it's  two  spaces .", "a" * 80]
    for text in texts:
        assert encode_text(tok, text) == tok.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 8))]
        want = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert decode_ids(tok, ids) == want
