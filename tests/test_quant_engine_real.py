"""The real default model kept quantized (Q4_1 layers, Q8_0 tied table) against the same
engine on the dequantized weights (the float path): greedy outputs token for token, with the
tie rule of test_engine_real (where they differ, the float reference must be at a tie)."""

from __future__ import annotations

import pytest
from test_engine_real import CHATS, TEXTS, assert_same_or_tie, build_prompts

import sgl

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

NEW_TOKENS = 48
PROMPTS = 6


async def greedy(options: dict[str, object]) -> tuple[list[list[int]], sgl.EngineStats]:
    async with sgl.Engine(device="cpu", max_total_tokens=8192, **options) as engine:
        prompts = build_prompts(engine)[:PROMPTS]
        outs = [await engine.generate(p, max_new_tokens=NEW_TOKENS, temperature=0)
                for p in prompts]
        return [o.token_ids for o in outs], engine.stats()


async def assert_float_path_or_ties(floats: list[list[int]], got: list[list[int]]) -> None:
    """`got` equals the float path's greedy tokens, or differs only where the reference model
    sees a tie."""
    if got == floats:
        return
    from sgl.backend.reference import load_reference_model

    model = load_reference_model()
    async with sgl.Engine(device="cpu", quantization="none", max_total_tokens=1024) as engine:
        prompts = build_prompts(engine)[:PROMPTS]
    for prompt, expected, tokens in zip(prompts, floats, got):
        assert_same_or_tie(model, prompt, expected, tokens)


async def test_quantized_engine_matches_the_float_path() -> None:
    assert len(CHATS) + len(TEXTS) >= PROMPTS
    floats, float_stats = await greedy(dict(quantization="none"))
    quant, quant_stats = await greedy({})  # the CPU default: quantized
    # The quantized engine really holds the file's precision: ~115 MB against 538 MB.
    assert quant_stats.weights_bytes < float_stats.weights_bytes // 4
    await assert_float_path_or_ties(floats, quant)


async def test_without_the_cpu_kernels_the_default_engine_serves_float_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the C library cannot run (no compiler, an x86 CPU without AVX2), `sgl.Engine()` loads
    float32 weights (quantized products would dequantize every weight each time) and serves
    the float path's greedy outputs through the torch ops alone."""
    from sgl.backend.quant import cpu_kernel

    floats, float_stats = await greedy(dict(quantization="none"))  # with the C ops
    monkeypatch.setattr(cpu_kernel, "_resolved", [None])
    monkeypatch.setattr(cpu_kernel, "_why", ["a test's stand-in for a machine without a compiler"])
    cpu_kernel.likely_available.cache_clear()  # (cached as True by the engines before)
    try:
        plain, plain_stats = await greedy({})
    finally:
        cpu_kernel.likely_available.cache_clear()  # (and False now: recomputed once restored)
    assert plain_stats.weights_bytes == float_stats.weights_bytes  # float32, as asked by none
    await assert_float_path_or_ties(floats, plain)
