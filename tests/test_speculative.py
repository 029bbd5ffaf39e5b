"""N-gram speculative decoding: drafts change the speed, never the answer.

The drafter proposes what followed an earlier occurrence of the request's last tokens; the
decode step verifies the drafts by sampling every position, and keeps a draft only where it
equals the sample decoding would have drawn there. So greedy and seeded outputs, logprobs,
stop conditions and grammar-constrained outputs are those of decoding without speculation.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pydantic import BaseModel

import sgl
from sgl.backend.quant import cpu_layer
from sgl.backend.spec_text import TextDrafter
from sgl.backend.speculative import NgramDrafter, SpecConfig, accepted_len

# -- the drafter ------------------------------------------------------------------------------


def _req(tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(prompt_ids=tokens[:3], output_ids=tokens[3:])


def test_drafter_proposes_what_followed_the_longest_matching_suffix() -> None:
    d = NgramDrafter(SpecConfig(num_draft_tokens=3, min_window=1, max_window=3))
    # suffix (7, 8) occurred at positions 1-2, followed by 9, 10, 11; the single token 8 also
    # occurred later (followed by 5) but the longer match wins.
    r = _req([1, 7, 8, 9, 10, 11, 8, 5, 7, 8])
    assert d.propose(r, 3) == [9, 10, 11]
    assert d.propose(r, 2) == [9, 10]


def test_drafter_indexes_incrementally_and_finds_nothing_without_a_repeat() -> None:
    d = NgramDrafter(SpecConfig(num_draft_tokens=4, min_window=2, max_window=4))
    r = _req([1, 2, 3, 4])
    assert d.propose(r, 4) == []
    r.output_ids += [1, 2]  # now the suffix (1, 2) repeats the start
    assert d.propose(r, 4) == [3, 4, 1, 2]
    r.output_ids[:] = [4]  # rolled back below the indexed length: rebuilt, still consistent
    assert d.propose(r, 4) == []


def test_accepted_len_stops_at_the_first_mismatch() -> None:
    assert accepted_len([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted_len([5, 6], [5, 6, 8]) == 2
    assert accepted_len([5], [4, 0]) == 0
    assert accepted_len([], [3]) == 0


# -- the engine: same outputs, fewer steps -------------------------------------------------------

DOC = ("Invoice 4471 from Harbor Supplies Ltd, 18 Quay Road, Bristol. Contact: Dana Whitfield, "
       "dana.whitfield@harbor-supplies.example, phone 0117 496 0321. Amount due: 1,284.50 GBP by "
       "14 March 2025.")
COPY_PROMPTS = [
    f"Copy this text exactly, then stop.\n\n{DOC}\n\nCopy:",
    f"{DOC}\n\nList the contact name, email and phone from the text above, one per line.",
    "Repeat the word list twice: apple, river, stone, cloud, lamp.",
]


class Invoice(BaseModel):
    number: int
    company: str
    contact: str
    email: str


@pytest.fixture(scope="module")
def engines():
    # On the CPU: its kernels compute every row the same way whatever the step's shape, so
    # "identical with and without drafts" is exact there. On CUDA in bf16 the GEMM paths and
    # tiles depend on the step's rows, which can flip a near-tie; the GPU's identity is checked
    # in float32 by tests/test_gpu_multi_token.py.
    plain = sgl.Engine(device="cpu")
    spec = sgl.Engine(device="cpu", speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    # every test below runs the default drafter: the text-level one (backend/spec_text.py)
    assert isinstance(spec._rt.scheduler.drafter, TextDrafter)
    yield plain, spec
    plain.close()
    spec.close()


def _run(engine: sgl.Engine, prompts: list[str] | list[list[int]],
         **kw) -> list[sgl.GenerateOutput]:
    """Outputs of `prompts`, texts or token ids, run concurrently."""
    async def go() -> list[sgl.GenerateOutput]:
        return list(await asyncio.gather(*(
            engine.generate(input_ids=p, **kw) if isinstance(p, list) else engine.generate(p, **kw)
            for p in prompts)))

    return asyncio.run(go())


def test_greedy_outputs_are_identical_and_drafts_are_accepted(engines) -> None:
    plain, spec = engines
    before = spec.stats()
    want = _run(plain, COPY_PROMPTS, max_new_tokens=64, temperature=0)
    got = _run(spec, COPY_PROMPTS, max_new_tokens=64, temperature=0)
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason
    after = spec.stats()
    assert after.spec_draft_tokens > before.spec_draft_tokens
    assert after.spec_accepted_tokens > before.spec_accepted_tokens, "copying never accepted a draft"
    # fewer steps than tokens: some steps produced several tokens
    assert after.steps - before.steps < sum(len(o.token_ids) for o in got)
    # rejected drafts gave their slots back: every slot is free or cached once all finished
    rejected = ((after.spec_draft_tokens - before.spec_draft_tokens)
                - (after.spec_accepted_tokens - before.spec_accepted_tokens))
    assert rejected > 0
    spec.check_integrity()
    assert after.kv_used_tokens == after.kv_cached_tokens


def test_one_stream_alone_is_identical(engines) -> None:
    plain, spec = engines
    a = _run(plain, COPY_PROMPTS[:1], max_new_tokens=80, temperature=0)[0]
    b = _run(spec, COPY_PROMPTS[:1], max_new_tokens=80, temperature=0)[0]
    assert b.token_ids == a.token_ids


def _served_rows(engine: sgl.Engine, prompts: list[str] | list[list[int]],
                 **kw) -> tuple[list[sgl.GenerateOutput], list[int]]:
    """The outputs of `prompts` (texts or token ids; the cache flushed first), and the rows of
    every step the one-call CPU decode step (quant/cpu_layer.py) served."""
    decoder = engine._rt.runner.model.model.cpu_decode
    assert decoder is not None, "the default model should get the one-call CPU step"
    served: list[int] = []
    run = decoder.run

    def counted(x, fb):  # type: ignore[no-untyped-def]
        out = run(x, fb)
        if out is not None:
            served.append(x.shape[0])
        return out

    engine.flush_cache()
    decoder.run = counted
    try:
        outs = _run(engine, prompts, **kw)
    finally:
        decoder.run = run
    return outs, served


def test_verify_rows_run_the_cpu_one_call_decode_step(engines) -> None:
    """On the CPU a verify step (a request's last token plus its drafts) is laid out as decode
    rows, one per token, and served by the quantized model's one-call decode step
    (quant/cpu_layer.py), not the op path at twice the cost per row; outputs stay identical."""
    plain, spec = engines
    before = spec.stats().prompt_tokens
    (got,), served = _served_rows(spec, COPY_PROMPTS[:1], max_new_tokens=48, temperature=0)
    # (the prompt is prefilled on the op path: more rows than the step takes)
    assert spec.stats().prompt_tokens - before > cpu_layer.MAX_ROWS
    assert got.token_ids == _run(plain, COPY_PROMPTS[:1], max_new_tokens=48, temperature=0)[0].token_ids
    assert any(rows > 1 for rows in served), "no multi-row verify step went through the C step"


def test_a_short_prefill_runs_the_cpu_one_call_decode_step(engines) -> None:
    """A prefill of at most MAX_ROWS tokens (a chat turn after its cached prefix) is laid out
    as decode rows too; a longer one keeps the op path."""
    plain, _ = engines
    short, long = list(range(100, 112)), list(range(100, 100 + cpu_layer.MAX_ROWS + 1))
    _, served = _served_rows(plain, [short], max_new_tokens=1, temperature=0)
    assert served == [len(short)]
    _, served = _served_rows(plain, [long], max_new_tokens=1, temperature=0)
    assert served == []


def test_seeded_sampling_is_identical(engines) -> None:
    plain, spec = engines
    kw = dict(max_new_tokens=48, temperature=0.8, top_p=0.95, seed=11)
    for a, b in zip(_run(plain, COPY_PROMPTS, **kw), _run(spec, COPY_PROMPTS, **kw)):
        assert b.token_ids == a.token_ids


def test_logprobs_and_stops_are_identical(engines) -> None:
    plain, spec = engines
    kw = dict(max_new_tokens=64, temperature=0, return_logprob=True, top_logprobs_num=2, stop=["GBP"])
    for a, b in zip(_run(plain, COPY_PROMPTS, **kw), _run(spec, COPY_PROMPTS, **kw)):
        assert b.token_ids == a.token_ids and b.text == a.text and b.matched_stop == a.matched_stop
        assert [t.token_id for t in b.logprobs.output] == b.token_ids
        assert len(b.logprobs.output_top) == len(b.token_ids)
        for x, y in zip(a.logprobs.output, b.logprobs.output):
            assert y.logprob == pytest.approx(x.logprob, abs=1e-3)


@pytest.mark.parametrize("jump", [True, False], ids=["jump_on", "jump_off"])
def test_constrained_outputs_are_identical(engines, jump: bool) -> None:
    """Drafts are cut where the grammar rejects them and each verify row samples under the
    grammar state after the drafts before it; jump-forward composes with verification."""
    plain, spec = engines
    prompt = f"{DOC}\n\nExtract the invoice as JSON."
    kw = dict(max_new_tokens=96, temperature=0, schema=Invoice, jump_forward=jump)
    a = _run(plain, [prompt], **kw)[0]
    b = _run(spec, [prompt], **kw)[0]
    assert b.token_ids == a.token_ids and b.text == a.text
    assert b.text.startswith('{') and '"number"' in b.text  # the schema was enforced


def test_a_regex_constrained_copy_is_identical(engines) -> None:
    plain, spec = engines
    prompt = f"{DOC}\n\nThe contact's email address is"
    kw = dict(max_new_tokens=40, temperature=0, regex=r" [a-z.]+@[a-z-]+\.example")
    a = _run(plain, [prompt], **kw)[0]
    b = _run(spec, [prompt], **kw)[0]
    assert b.token_ids == a.token_ids and b.text == a.text


def test_json_extraction_takes_fewer_steps_with_drafts(engines) -> None:
    """Copied values are drafted from their first token and the grammar's forced text is
    drafted too, so a JSON extraction verifies several tokens per step."""
    plain, spec = engines
    prompt = f"{DOC}\n\nExtract the invoice as JSON."
    kw = dict(max_new_tokens=96, temperature=0, schema=Invoice)
    p0, s0 = plain.stats(), spec.stats()
    a = _run(plain, [prompt], **kw)[0]
    b = _run(spec, [prompt], **kw)[0]
    p1, s1 = plain.stats(), spec.stats()
    assert b.token_ids == a.token_ids
    accepted = s1.spec_accepted_tokens - s0.spec_accepted_tokens
    drafts = s1.spec_draft_tokens - s0.spec_draft_tokens
    assert 0 < accepted <= drafts
    # each accepted draft saves at most one step (fewer where a jump takes over after it)
    saved = (p1.steps - p0.steps) - (s1.steps - s0.steps)
    assert 0 < saved <= accepted


def test_no_drafts_while_more_requests_decode_than_the_limit() -> None:
    """speculative_disable_by_batch_size: a step with more decoding requests than the limit
    proposes no drafts (plain decoding, overlappable); at or under it, drafts as before. The
    outputs are those of decoding without speculation either way."""
    prompts = COPY_PROMPTS[:2]
    plain = _run_engine(dict(), prompts)
    for limit, drafted in ((1, False), (2, True)):
        e = sgl.Engine(device="cpu", speculative_algorithm="ngram",
                       speculative_disable_by_batch_size=limit)
        try:
            proposed = []  # (decoding requests, drafts) of every decode step
            schedule = e._rt.scheduler._decode

            def spy(decoding, items, locs, _schedule=schedule):  # type: ignore[no-untyped-def]
                n = _schedule(decoding, items, locs)
                proposed.append((n, sum(len(it.draft_ids) for it in items)))
                return n

            e._rt.scheduler._decode = spy
            # both requests decode together: the prompts arrive as one batch
            got = _run(e, prompts, max_new_tokens=48, temperature=0)
        finally:
            e.close()
        assert [o.token_ids for o in got] == [o.token_ids for o in plain]
        together = [d for n, d in proposed if n == 2]
        assert together, "the two requests never decoded in one step"
        assert (sum(together) > 0) is drafted


def _run_engine(options: dict, prompts: list[str]) -> list[sgl.GenerateOutput]:
    e = sgl.Engine(device="cpu", **options)
    try:
        return _run(e, prompts, max_new_tokens=48, temperature=0)
    finally:
        e.close()


def test_the_token_id_drafter_is_still_available() -> None:
    from sgl.backend.runtime import _drafter

    cfg = sgl.EngineConfig(speculative_algorithm="ngram", speculative_ngram_match="tokens")
    assert type(_drafter(cfg, None)) is NgramDrafter
    # text mode without a tokenizer (dummy weights) falls back to the id lookup
    assert type(_drafter(cfg.replace(speculative_ngram_match="text"), None)) is NgramDrafter


def test_speculative_options_are_validated() -> None:
    with pytest.raises(sgl.InvalidConfigError, match="speculative_algorithm"):
        sgl.EngineConfig(speculative_algorithm="eagle")
    with pytest.raises(sgl.InvalidConfigError, match="speculative_num_draft_tokens"):
        sgl.EngineConfig(speculative_num_draft_tokens=0)
    with pytest.raises(sgl.InvalidConfigError, match="speculative_ngram_match"):
        sgl.EngineConfig(speculative_ngram_match="chars")
    with pytest.raises(sgl.InvalidConfigError, match="speculative_disable_by_batch_size"):
        sgl.EngineConfig(speculative_disable_by_batch_size=0)
    with pytest.raises(sgl.InvalidConfigError, match="max_match_window"):
        sgl.EngineConfig(speculative_ngram_min_match_window_size=4,
                         speculative_ngram_max_match_window_size=2)
