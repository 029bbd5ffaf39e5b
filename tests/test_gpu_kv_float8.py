"""A float8 e4m3 KV cache on a CUDA device (`kv_cache_dtype="fp8_e4m3"`): the Triton path
(stores rounding into the pool, attention widening what it loads, decode in CUDA graphs)
against the torch attention over the same kind of pool, and the pool's size.

Marked `gpu` (skipped without CUDA). Tiny random-weight Llama in float32, as
tests/test_gpu_engine.py, so that the two attention paths agree token for token: both store
the same float8 codes (the float32 k rounded once), and they differ only in summation order.
tests/test_deterministic.py runs its batch-invariance test over a float8 pool too.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_gpu_engine import GREEDY, TINY, copy_weights, engine, prompts
from test_gpu_multi_token import _always_draft

import sgl

pytestmark = pytest.mark.gpu


async def two_rounds(e: sgl.Engine, ps: list[list[int]]) -> tuple[list[list[int]], int]:
    """A staggered batch, then a second one that extends the first's prompts (radix-cache
    hits: their KV is read back from the float8 pool); (token ids, cached prompt tokens)."""
    first = await asyncio.gather(*(e.generate(input_ids=p, max_new_tokens=4 + 3 * i, **GREEDY)
                                   for i, p in enumerate(ps)))
    longer = [p + [11, 12, 13] for p in ps[:4]] + [ps[0]]
    second = await asyncio.gather(*(e.generate(input_ids=p, max_new_tokens=9, **GREEDY)
                                    for p in longer))
    return ([o.token_ids for o in (*first, *second)],
            sum(o.usage.cached_tokens for o in second))


def test_float8_kv_cache_on_cuda_serves_as_the_torch_attention_over_it() -> None:
    ps = prompts(10, seed=4)
    triton = engine("cuda", kv_cache_dtype="fp8_e4m3")
    torch_attention = engine("cuda", kv_cache_dtype="fp8", attention_backend="torch")
    spec = engine("cuda", kv_cache_dtype="fp8_e4m3", speculative_algorithm="ngram",
                  speculative_num_draft_tokens=3)
    try:
        assert triton._rt.cuda_graph_sizes, "no decode graphs were captured"
        for e in (triton, torch_attention, spec):
            assert e._rt.kv_pool.k_buffer[0].dtype == torch.float8_e4m3fn
        copy_weights(triton, torch_attention)
        copy_weights(triton, spec)
        _always_draft(spec)  # every decode step verifies drafts (in the graphs)
        got, cached = asyncio.run(two_rounds(triton, ps))
        want, _ = asyncio.run(two_rounds(torch_attention, ps))
        assert got == want
        assert cached >= sum(len(p) - 1 for p in ps[:4]), cached  # the second round's hits
        drafted, _ = asyncio.run(two_rounds(spec, ps))
        assert drafted == want
        assert spec.stats().spec_verify_steps > 0
        for e in (triton, torch_attention, spec):
            e.check_integrity()
    finally:
        triton.close()
        torch_attention.close()
        spec.close()


def test_float8_kv_cache_halves_bf16_bytes_per_token() -> None:
    stats = {}
    for kv in ("auto", "fp8_e4m3"):
        with sgl.Engine(model_config=TINY, load_format="dummy", device="cuda", dtype="bfloat16",
                        max_total_tokens=4096, kv_cache_dtype=kv) as e:
            out = e.generate_sync(input_ids=prompts(1)[0], max_new_tokens=8, **GREEDY)
            assert len(out.token_ids) == 8
            e.check_integrity()
            stats[kv] = e.stats()
    per_token = 2 * 2 * 2 * 32  # K and V x layers x kv heads x head_dim (128 / 4 heads)
    assert stats["auto"].kv_bytes_per_token == 2 * per_token
    assert stats["fp8_e4m3"].kv_bytes_per_token == per_token


def test_other_narrower_kv_dtypes_are_still_refused_on_cuda() -> None:
    with pytest.raises(sgl.InvalidConfigError, match="use 'auto' or 'fp8_e4m3'"):
        sgl.Engine(model_config=TINY, load_format="dummy", device="cuda", dtype="bfloat16",
                   kv_cache_dtype="float16")
