"""The tiled Triton kernel on quantized weights (backend/quant/triton_gemm.py: `qgemm`, and its
`weight_as_a` operand order) against dequantize-then-matmul: every GGUF format, ragged K
steps, and row counts around the tile edges, 1..40 with 37 (the eager prefill that once went
wrong on the device) at the real models' inner dimensions; split-K (`GemmConfig.split_k`,
both reductions) in it and in FP8's tiled kernel; 4-bit tiles joined into one dot per K step
(`GemmConfig.join`). Helpers and the bound:
tests/test_quant_triton.py; the interpreter set-up: tests/triton_interp.py.
"""

from __future__ import annotations

import pytest
import torch
from triton_interp import (  # first: sets TRITON_INTERPRET before triton is imported
    NO_TRITON,
    rerun_interpreted,
    skip_unless_rerun_needed,
    triton_runs_here,
)
from test_quant_triton import (
    FMTS,
    K_QUANTS,
    assert_matches,
    fp8_weight,
    inputs,
    qweight,
    ragged_block_k,
    shape_of,
)

from sgl.backend.kernels.triton_compat import tile_counters
from sgl.backend.quant import linear
from sgl.backend.quant.triton_fp8 import fp8_gemm
from sgl.backend.quant.triton_gemm import GemmConfig, gemm_config, qgemm

TRITON_HERE = triton_runs_here(qgemm.__globals__["_qgemm_kernel"])
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason=NO_TRITON)


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [3, 17])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("factored", [False, True])
@pytest.mark.parametrize("weight_as_a", [False, True])
def test_qgemm_matches_dequantize_then_matmul(fmt: str, m: int, bias: bool,
                                              factored: bool, weight_as_a: bool) -> None:
    if factored and fmt not in K_QUANTS:
        pytest.skip("no factored form")
    n, k = shape_of(fmt)
    w = qweight(fmt, n, k, seed=m, factored=factored)
    x, b = inputs(m, k, n, torch.float32, bias, seed=m)
    cfg = gemm_config(m, n, k, w.group_size, linear.weight_kind(w))._replace(
        weight_as_a=weight_as_a)
    assert_matches(qgemm(x, w, b, config=cfg), x, w.dequantize(), b)
    cfg = GemmConfig(block_m=16, block_n=16, block_k=ragged_block_k(w), num_warps=1,
                     num_stages=1, weight_as_a=weight_as_a)
    assert_matches(qgemm(x, w, b, config=cfg), x, w.dequantize(), b)


# The real model's inner dims (SmolLM2: hidden 576 = 18 groups of 32, MLP 1536) and the 8B
# model's (4096, 14336); K-quants need whole 256-blocks (768: 3 of them).
TAIL_K = {"Q4_0": (576,), "Q4_1": (1536,), "Q8_0": (576,), "Q4_K": (4096,), "Q5_K": (768,),
          "Q6_K": (768,), "Q5_0": (576,), "Q5_1": (576,), "IQ4_NL": (576,), "Q2_K": (768,),
          "Q3_K": (768,), "IQ4_XS": (768,)}


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("weight_as_a", [False, True])
def test_qgemm_row_tails_37_and_real_inner_dims(fmt: str, weight_as_a: bool) -> None:
    """Row counts around the tile edges (37: the eager prefill that once went wrong on the
    device; 16/17, 33, 40, 65) at the real models' K, each with the rule's own tiles."""
    for k in TAIL_K[fmt]:  # (each K: several K steps with a ragged last one)
        w = qweight(fmt, 19, k, seed=k, factored=fmt in K_QUANTS)
        x, b = inputs(65, k, 19, torch.float32, bias=True, seed=k)
        ref = w.dequantize()
        for m in (2, 17, 37, 65):
            cfg = gemm_config(m, 19, k, w.group_size, linear.weight_kind(w))._replace(
                weight_as_a=weight_as_a)
            assert_matches(qgemm(x[:m], w, b, config=cfg), x[:m], ref, b)


@needs_triton
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])  # the default model's two formats
def test_qgemm_every_row_count_1_to_40(fmt: str) -> None:
    """Every M from 1 to 40 at SmolLM2's hidden size in float32 (the orientations take turns),
    and 16, 17, 37, 40 rows with bf16 activations in both."""
    w = qweight(fmt, 21, 576, seed=37)
    ref = w.dequantize()
    x, b = inputs(40, 576, 21, torch.float32, bias=True, seed=37)
    for m in range(1, 41):
        cfg = gemm_config(m, 21, 576)._replace(weight_as_a=m % 2 == 1)
        assert_matches(qgemm(x[:m], w, b, config=cfg), x[:m], ref, b)
    x, b = x.bfloat16(), b.bfloat16()
    for m in (16, 17, 37, 40):
        for weight_as_a in (False, True):
            cfg = gemm_config(m, 21, 576)._replace(weight_as_a=weight_as_a)
            assert_matches(qgemm(x[:m], w, b, config=cfg), x[:m], ref, b)


@needs_triton
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q4_K"])  # the formats of 4-bit codes
@pytest.mark.parametrize("factored", [False, True])
@pytest.mark.parametrize("weight_as_a", [False, True])
def test_joined_4bit_tiles_match_dequantize_then_matmul(fmt: str, factored: bool,
                                                        weight_as_a: bool) -> None:
    """`GemmConfig.join`: a group's low and high codes interleaved back into K order in
    registers, one dot per K step over x's columns as they lie (instead of a dot per half over
    gathered columns): 17 rows over two row blocks, a ragged last K step, bf16 and float32
    activations, unsplit and split in three with the last slice adding."""
    if factored and fmt not in K_QUANTS:
        pytest.skip("no factored form")
    n, k = shape_of(fmt)
    w = qweight(fmt, n, k, seed=11, factored=factored)
    ref = w.dequantize()
    for dtype in (torch.float32, torch.bfloat16):
        x, b = inputs(17, k, n, dtype, bias=True, seed=12)
        for split in (1, 3):
            cfg = GemmConfig(16, 16, ragged_block_k(w), 1, 1, weight_as_a, split_k=split,
                             split_reduce="last", join=True)
            assert_matches(qgemm(x, w, b, config=cfg), x, ref, b)


SPLIT_KINDS = ["Q4_1", "Q8_0", "Q4_K/factored", "Q6_K/factored", "fp8"]


def split_case(kind: str, seed: int):
    """(run(x, bias, config) -> y, reference weight, K step, N) at a shape whose K loop has a
    ragged last step and N no multiple of the tile: group-32 formats 13 groups in steps of 4,
    K-quants 1280 in steps of 512, FP8 200 in steps of 32; N = 37 or 21."""
    if kind == "fp8":
        _, w8 = fp8_weight(37, 200, seed=seed)
        return (lambda x, b, cfg: fp8_gemm(x, w8.weight, w8.scale, b, config=cfg),
                w8.dequantize(), 32, 37)
    fmt, _, factored = kind.partition("/")
    n, k, block_k = (21, 1280, 512) if fmt in K_QUANTS else (37, 13 * 32, 128)
    w = qweight(fmt, n, k, seed=seed, factored=bool(factored))
    return (lambda x, b, cfg: qgemm(x, w, b, config=cfg)), w.dequantize(), block_k, n


@needs_triton
@pytest.mark.parametrize("kind", SPLIT_KINDS)
@pytest.mark.parametrize("weight_as_a", [False, True])
def test_split_k_tiles_match_dequantize_then_matmul(kind: str, weight_as_a: bool) -> None:
    """2, 3 and 4 slices (uneven ones among them) of a ragged K loop, 19 rows over two row
    blocks, a bias added once: each reduction matches the reference, and the tile's last
    slice gives bit for bit what the second kernel gives (both add the same float32 partials
    in slice order); the tile counters are all back at 0 after the launch."""
    run, ref, block_k, n = split_case(kind, seed=len(kind))
    k = ref.shape[1]
    x, b = inputs(19, k, n, torch.float32, bias=True, seed=5)
    for split in (2, 3, 4):
        cfg = GemmConfig(16, 16, block_k, 1, 1, weight_as_a, split_k=split)
        by_kernel = run(x, b, cfg)
        assert_matches(by_kernel, x, ref, b)
        by_last = run(x, b, cfg._replace(split_reduce="last"))
        assert torch.equal(by_last, by_kernel), split
        assert not tile_counters(x.device, 1).any()


@needs_triton
def test_split_k_tile_rows_do_not_depend_on_the_row_count() -> None:
    """Row r of an M-row split product is the same bits for every M > r: a partials buffer or
    a tile counter indexed with the wrong row stride or block would mix rows."""
    run, ref, block_k, n = split_case("Q4_K/factored", seed=3)
    x, b = inputs(18, ref.shape[1], n, torch.float32, bias=True, seed=6)
    cfg = GemmConfig(16, 16, block_k, 1, 1, True, split_k=2, split_reduce="last")
    full = run(x, b, cfg)
    for m in (1, 5, 16, 17):
        assert torch.equal(run(x[:m], b, cfg), full[:m]), m


@skip_unless_rerun_needed(TRITON_HERE)
def test_quant_triton_tiled_in_subprocess() -> None:
    """Triton was imported before this module could ask for its interpreter: rerun here."""
    rerun_interpreted(__file__)
