"""The engine on the real default model (SmolLM2-135M-Instruct, float32, CPU) against
transformers' `generate` on the same dequantized weights: greedy outputs token for token.

Where a token differs, the test demands that the reference itself was at a floating-point tie
there (its two best logits within 1e-4); any other difference is a bug.

Pinned to the CPU in float32 whatever device the machine has (on a GPU the engine's default
would be bfloat16, which no float32 reference matches); tests/test_gpu_real.py checks the GPU
with these prompts and helpers.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

import sgl

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

NEW_TOKENS = 64
TIE = 1e-4
CPU_FP32 = dict(device="cpu", dtype="float32")

CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 10.",
]
TEXTS = [
    "def fibonacci(n):",
    "The history of the Roman Empire began",
    "Ingredients for a simple pancake recipe:\n1.",
    "Q: How many legs does a spider have?\nA:",
]


def build_prompts(engine: sgl.Engine) -> list[list[int]]:
    """The chats (through the model's template) and the plain texts, as token ids."""
    chats = [engine.encode(engine.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False)
             for c in CHATS]
    return chats + [engine.encode(t) for t in TEXTS]


def greedy_outputs(model, prompts: list[list[int]]) -> list[list[int]]:  # noqa: ANN001
    """transformers' own greedy `generate` for each prompt, on the model's device."""
    outs = []
    with torch.inference_mode():
        for p in prompts:
            gen = model.generate(torch.tensor([p], device=model.device), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=2, pad_token_id=2)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def engine_tokenizer():
    engine = sgl.Engine(max_total_tokens=16384, **CPU_FP32)
    try:
        yield engine, engine.tokenizer
    finally:
        engine.close()


@pytest.fixture(scope="module")
def prompts(engine_tokenizer) -> list[list[int]]:
    return build_prompts(engine_tokenizer[0])


@pytest.fixture(scope="module")
def reference(prompts):
    """transformers' LlamaForCausalLM on our dequantized weights, and its greedy outputs."""
    from sgl.backend.reference import load_reference_model

    model = load_reference_model()
    return model, greedy_outputs(model, prompts)


def assert_same_or_tie(model, prompt: list[int], expected: list[int], got: list[int], tie: float = TIE) -> None:
    if got == expected:
        return
    pos = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + expected[:pos]], device=model.device)).logits[0, -1]
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < tie, (
        f"greedy outputs differ at token {pos} and the reference was not at a tie there "
        f"(gap {gap:.2e}): expected {expected[pos:pos + 5]}, got {got[pos:pos + 5]}"
    )


def distractors(n: int = 16) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(8, 300))] for _ in range(n)]


@pytest.mark.parametrize(
    "options",
    [dict(disable_overlap_schedule=False), dict(disable_radix_cache=True), dict(disable_overlap_schedule=True)],
    ids=["radix+overlap", "no-radix", "no-overlap"],
)
async def test_greedy_matches_transformers(prompts, reference, options) -> None:
    model, expected = reference
    engine = sgl.Engine(max_total_tokens=16384, **CPU_FP32, **options)
    try:
        greedy = dict(temperature=0, max_new_tokens=NEW_TOKENS)
        # alone, one request at a time
        for p, exp in zip(prompts, expected):
            out = await engine.generate(input_ids=p, **greedy)
            assert_same_or_tie(model, p, exp, out.token_ids)
        # together with 16 concurrent requests of different lengths
        others = [engine.generate(input_ids=d, temperature=0, max_new_tokens=random.Random(i).randint(8, 80))
                  for i, d in enumerate(distractors())]
        outs = await asyncio.gather(*(engine.generate(input_ids=p, **greedy) for p in prompts), *others)
        for p, exp, out in zip(prompts, expected, outs):
            assert_same_or_tie(model, p, exp, out.token_ids)
        engine.check_integrity()
        stats = engine.stats()
        assert stats.running == 0 and stats.kv_used_tokens == stats.kv_cached_tokens
    finally:
        engine.close()


async def test_text_chat_and_stream_agree(engine_tokenizer) -> None:
    """Chat messages use the model's template; streamed text concatenates to the final text."""
    engine, _ = engine_tokenizer
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = await engine.generate(msgs, temperature=0, max_new_tokens=20)
    assert "Paris" in out.text
    text = ""
    final = None
    async for chunk in engine.stream("Write a short poem about the moon:", temperature=0.8, seed=3,
                                     max_new_tokens=48):
        text += chunk.text
        if chunk.output is not None:
            final = chunk.output
    assert final is not None and text == final.text and final.text


async def test_stop_strings_are_trimmed(engine_tokenizer) -> None:
    engine, _ = engine_tokenizer
    base = await engine.generate("Count: one, two, three, four,", temperature=0, max_new_tokens=24)
    stop = base.text.strip().split()[1]  # a word the model does produce
    out = await engine.generate("Count: one, two, three, four,", temperature=0, max_new_tokens=24, stop=stop)
    assert out.finish_reason == "stop" and out.matched_stop == stop
    assert stop not in out.text and base.text.startswith(out.text)
    kept = await engine.generate("Count: one, two, three, four,", temperature=0, max_new_tokens=24, stop=stop,
                                 no_stop_trim=True)
    assert kept.text.endswith(stop)
