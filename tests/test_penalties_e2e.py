"""Frequency, presence and repetition penalties end to end: `sgl.Engine` on the real default
model (CPU, float32, greedy, EOS ignored) against a greedy loop written here over transformers'
logits on the very same weights (`sgl.backend.reference`), penalised by hand.

Which tokens each penalty counts (as `backend/penalties.py` documents, and this loop repeats):
- frequency and presence: generated tokens only, OpenAI's definition
  `logit -= frequency * count + presence * (count > 0)`; SGLang's penaltylib does the same
  (`BatchedFrequencyPenalizer` / `BatchedPresencePenalizer` accumulate output tokens only).
- repetition: prompt and generated tokens, CTRL's rule as HF's
  `RepetitionPenaltyLogitsProcessor` and vLLM apply it: a seen token's logit is divided by the
  penalty when positive, multiplied when not. SGLang's penalizer did the same over input and
  output tokens until recently; its current `BatchedRepetitionPenalizer` counts output only.
- order: repetition first, then frequency and presence (as vLLM), all before greedy argmax.

Greedy outputs must agree token for token. Where they differ the reference must have been at a
tie there (its two best penalised logits within 1e-4: float32 sums in a different order may
swap them); the rest of the sequence is then not comparable. Every case is checked to change
the reference's output against no penalty, so an engine that ignored the penalty (or stopped
counting generated tokens) fails.
"""

from __future__ import annotations

import asyncio
from typing import Iterator, NamedTuple

import pytest
import torch

import sgl

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

NEW_TOKENS = 32
TIE = 1e-4


class Penalty(NamedTuple):
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0

    def params(self) -> dict[str, float]:
        return dict(repetition_penalty=self.repetition, frequency_penalty=self.frequency,
                    presence_penalty=self.presence)


CASES = {
    "frequency 0.5": Penalty(frequency=0.5),
    "frequency 1.5": Penalty(frequency=1.5),
    "frequency -0.5": Penalty(frequency=-0.5),
    "presence 1.5": Penalty(presence=1.5),
    "presence -1.0": Penalty(presence=-1.0),
    "repetition 1.3": Penalty(repetition=1.3),
    "repetition 0.8": Penalty(repetition=0.8),
    "all three": Penalty(repetition=1.2, frequency=0.4, presence=0.4),
}
TEXTS = ["The cat sat on the mat. The cat sat on the mat. The cat"]
CHATS = ["Write a short poem about the sea."]


class Reference(NamedTuple):
    tokens: list[int]
    gaps: list[float]  # per step: the best penalised logit minus the second best


@pytest.fixture(scope="module")
def engine() -> Iterator[sgl.Engine]:
    e = sgl.Engine(device="cpu", dtype="float32", max_total_tokens=16384)
    try:
        yield e
    finally:
        e.close()


@pytest.fixture(scope="module")
def prompts(engine: sgl.Engine) -> list[list[int]]:
    chats = [engine.encode(engine.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False)
             for c in CHATS]
    return [engine.encode(t) for t in TEXTS] + chats


@pytest.fixture(scope="module")
def model():  # noqa: ANN201 - a transformers causal LM
    from sgl.backend.reference import load_reference_model

    return load_reference_model()


def penalised(logits: torch.Tensor, prompt: list[int], out: list[int], p: Penalty) -> torch.Tensor:
    """logits [V] float32 -> penalised copy, by the formulas in the module docstring."""
    vocab = logits.shape[0]
    counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=vocab)[:vocab]  # [V]
    in_prompt = torch.zeros(vocab, dtype=torch.bool)
    in_prompt[torch.tensor(prompt, dtype=torch.int64).clamp(0, vocab - 1)] = True
    seen = in_prompt | (counts > 0)
    x = logits.clone()
    x[seen] = torch.where(x[seen] > 0, x[seen] / p.repetition, x[seen] * p.repetition)
    return x - p.frequency * counts.to(x.dtype) - p.presence * (counts > 0).to(x.dtype)


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], cases: list[Penalty]) -> list[Reference]:  # noqa: ANN001
    """One greedy loop per case, run as rows of one batch (they share the prompt, so no
    padding is needed): the model's logits, then each row's penalties, then argmax."""
    outs: list[list[int]] = [[] for _ in cases]
    gaps: list[list[float]] = [[] for _ in cases]
    past, step_ids = None, torch.tensor([prompt] * len(cases))  # [R, L]
    for _ in range(NEW_TOKENS):
        res = model(input_ids=step_ids, past_key_values=past, use_cache=True)
        past = res.past_key_values
        for row, p in enumerate(cases):
            logits = penalised(res.logits[row, -1].float(), prompt, outs[row], p)  # [V]
            top2 = logits.topk(2).values
            gaps[row].append(float(top2[0] - top2[1]))
            outs[row].append(int(logits.argmax()))
        step_ids = torch.tensor([[o[-1]] for o in outs])  # [R, 1]
    return [Reference(o, g) for o, g in zip(outs, gaps)]


@pytest.fixture(scope="module")
def references(model, prompts: list[list[int]]) -> dict[tuple[int, str], Reference]:  # noqa: ANN001
    """Reference outputs for every (prompt, case), plus the unpenalised one under "none"."""
    names = ["none", *CASES]
    refs = {}
    for i, prompt in enumerate(prompts):
        for name, ref in zip(names, reference_greedy(model, prompt, [CASES.get(n, Penalty()) for n in names])):
            refs[i, name] = ref
    return refs


def assert_same_or_tie(ref: Reference, got: list[int], what: str) -> None:
    assert len(got) == NEW_TOKENS, f"{what}: {len(got)} tokens, expected {NEW_TOKENS}"
    if got == ref.tokens:
        return
    pos = next(i for i, (a, b) in enumerate(zip(ref.tokens, got)) if a != b)
    assert ref.gaps[pos] < TIE, (
        f"{what}: greedy tokens differ at {pos} and the reference was not at a tie there "
        f"(gap {ref.gaps[pos]:.2e}): expected {ref.tokens[pos:pos + 6]}, got {got[pos:pos + 6]}")


def test_every_case_changes_the_output(references: dict[tuple[int, str], Reference],
                                       prompts: list[list[int]]) -> None:
    """Without this the comparison below could pass on an engine that ignores penalties."""
    for i in range(len(prompts)):
        for name in CASES:
            assert references[i, name].tokens != references[i, "none"].tokens, (
                f"prompt {i}: {name} does not change greedy output; pick another prompt or value")
    # Frequency counts repeats, presence does not: the same value must not give the same text.
    for i in range(len(prompts)):
        assert references[i, "frequency 1.5"].tokens != references[i, "presence 1.5"].tokens


GREEDY = dict(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


async def test_penalties_one_request_at_a_time(engine: sgl.Engine, prompts: list[list[int]],
                                               references: dict[tuple[int, str], Reference]) -> None:
    for i, prompt in enumerate(prompts):
        plain = await engine.generate(input_ids=prompt, **GREEDY)
        assert_same_or_tie(references[i, "none"], plain.token_ids, f"prompt {i}, no penalty")
        for name, p in CASES.items():
            out = await engine.generate(input_ids=prompt, **GREEDY, **p.params())
            assert_same_or_tie(references[i, name], out.token_ids, f"prompt {i}, {name}")


async def test_penalties_in_one_batch_with_unpenalised_requests(
    engine: sgl.Engine, prompts: list[list[int]], references: dict[tuple[int, str], Reference],
) -> None:
    """Every case of every prompt at once, between unpenalised requests: each row keeps its own
    counts (a row's counts leaking into another would change that row's tokens)."""
    jobs, keys = [], []
    for i, prompt in enumerate(prompts):
        for name, p in [("none", Penalty()), *CASES.items()]:
            jobs.append(engine.generate(input_ids=prompt, **GREEDY, **p.params()))
            keys.append((i, name))
    outs = await asyncio.gather(*jobs)
    for key, out in zip(keys, outs):
        assert_same_or_tie(references[key], out.token_ids, f"prompt {key[0]}, {key[1]}, batched")
    engine.check_integrity()
