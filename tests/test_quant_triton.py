"""The Triton kernels on quantized weights (backend/quant/triton_gemv.py, triton_gemm.py; the
tiled kernel's row tails in test_quant_triton_tiled.py, FP8 in test_quant_triton_fp8.py)
against dequantize-then-matmul, on random blocks of every GGUF format.

Without CUDA they run under Triton's interpreter (tests/triton_interp.py), in process when
this module is the first to import triton, else through `test_quant_triton_in_subprocess`.
Shapes are small and odd on purpose: N not a multiple of any tile, K several groups with a
ragged last step (explicit small configs), 1, 3 and 17 rows. Float32 activations are held to
float32 summation error, so a wrong nibble order or a wrong group's scale fails (the
`..._catches_...` tests prove the bound is tight enough for that).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from triton_interp import (  # first: sets TRITON_INTERPRET before triton is imported
    DEVICE,
    NO_TRITON,
    rerun_interpreted,
    skip_unless_rerun_needed,
    triton_runs_here,
)
from test_quant_formats import random_blocks

from sgl.backend.quant import FORMATS, QuantizedWeight, decode, linear
from sgl.backend.quant.factored import factor, unfactor
from sgl.backend.quant.fp8 import Fp8Weight, fp8_linear, fp8_linear_reference
from sgl.backend.quant.triton_fp8 import FP8_DECODES, fp8_gemv
from sgl.backend.quant.triton_gemm import gemm_config, qdequant, qgemm
from sgl.backend.quant.triton_gemv import QGemvConfig, qgemv

TRITON_HERE = triton_runs_here(qgemv.__globals__["_qgemv_kernel"])
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason=NO_TRITON)
FMTS = sorted(FORMATS)


# Formats of 256-weight super-blocks (the K-quants, IQ4_XS): their scales factor (factored.py)
K_QUANTS = tuple(sorted(f for f, (block, _, _) in FORMATS.items() if block == 256))


def qweight(fmt: str, n: int, k: int, seed: int = 0, factored: bool = False) -> QuantizedWeight:
    """A random `fmt` weight on DEVICE; `factored`: its scales in the factored form (the
    K-quants always factor; the others have no such form and stay plain)."""
    raw = torch.from_numpy(random_blocks(fmt, n, k, seed))
    w = QuantizedWeight.from_decoded(decode(fmt, raw, k), fmt)
    w = QuantizedWeight(w.codes.to(DEVICE), w.scale.to(DEVICE), w.zero.to(DEVICE), w.bits,
                        w.group_size, k, fmt)
    if factored:
        w = factor(w)
        assert bool(w.super_groups) == (fmt in K_QUANTS)
    return w


def shape_of(fmt: str) -> tuple[int, int]:
    """(N, K): N odd; K several groups (K-quants: two 256-blocks = 16 groups)."""
    return (37, 160) if FORMATS[fmt][0] == 32 else (21, 768)


def ragged_block_k(w: QuantizedWeight) -> int:
    """A K step (power-of-two groups) that does not divide K: several steps, a ragged last."""
    groups = w.in_features // w.group_size
    block_g = 1 << (groups.bit_length() - 1)
    while groups % block_g == 0:
        block_g //= 2
    return block_g * w.group_size


def inputs(m: int, k: int, n: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, b


def assert_matches(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                   b: torch.Tensor | None) -> None:
    """got == x @ w^T + b within summation-order error in got's dtype: the bound scales
    with |x| @ |w|^T (a result may cancel to ~0), eps 1e-5 in float32 and 1e-2 in 16 bits."""
    eps = 1e-5 if got.dtype == torch.float32 else 1e-2
    x, w = x.float(), w.float()
    bf = None if b is None else b.float()
    expected = F.linear(x, w, bf)
    bound = eps * (F.linear(x.abs(), w.abs()) + (0 if bf is None else bf.abs())) + 1e-5
    excess = (got.float() - expected).abs() - bound
    assert excess.max().item() <= 0, f"off by {excess.max().item():.3g} beyond the bound"


def assert_same_16_bit(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal on the GPU (both round to nearest); within one bf16 ulp under the interpreter,
    whose float32 -> bf16 cast truncates (seen in triton 3.9)."""
    if DEVICE.type == "cuda":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got.float(), expected.float(), rtol=2.0**-7, atol=0)


# -- QuantizedWeight: GEMV (one row), tiled GEMM (more), dequantize ---------------------------


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("factored", [False, True])
def test_qgemv_matches_dequantize_then_matmul(fmt: str, m: int, bias: bool,
                                              factored: bool) -> None:
    if factored and fmt not in K_QUANTS:
        pytest.skip("no factored form")
    n, k = shape_of(fmt)
    w = qweight(fmt, n, k, seed=m, factored=factored)
    x, b = inputs(m, k, n, torch.float32, bias, seed=m)
    assert_matches(qgemv(x, w, b), x, w.dequantize(), b)
    # Several K steps with a ragged last one, and a ragged last row block.
    cfg = QGemvConfig(block_n=8, block_k=ragged_block_k(w), num_warps=1)
    assert_matches(qgemv(x, w, b, config=cfg), x, w.dequantize(), b)
    # No tile on an edge (24 rows, K steps that divide K): the unmasked loads.
    even = qweight(fmt, 24, k, seed=m, factored=factored)
    groups = k // even.group_size
    cfg = QGemvConfig(block_n=8, block_k=(groups & -groups) * even.group_size, num_warps=1)
    b24 = None if b is None else torch.randn(24, device=DEVICE)
    assert_matches(qgemv(x, even, b24, config=cfg), x, even.dequantize(), b24)


# The GEMV's variant flags (QGemvConfig): I2F conversions instead of the 2^23 trick, int32
# word loads instead of bytes, and both; the lop3 kernel for 4-bit codes (8-bit codes ignore
# the flag: the first kernel serves them).
GEMV_VARIANTS = {"i2f": dict(magic=False), "words": dict(words=True),
                 "words_i2f": dict(words=True, magic=False), "lop3": dict(unpack="lop3")}


@needs_triton
def test_gemv_rows_fastest_grid_and_its_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several rows run row-fastest (weight tiles shared through L2) unless the weight blocks
    overflow CUDA's second grid axis; the kernels give the same products either way."""
    from sgl.backend.quant import triton_fp8, triton_gemv

    assert triton_gemv.row_grid(3, 10) == ((3, 10), True)
    assert triton_gemv.row_grid(1, 10) == ((10, 1), False)
    assert triton_gemv.row_grid(2, 70000) == ((70000, 2), False)
    w = qweight("Q4_1", 37, 160)
    _, w8 = fp8_weight(37, 160)
    x, b = inputs(3, 160, 37, torch.float32, bias=True)
    for forced in (False, True):
        if forced:
            fallback = lambda m, nb: ((nb, m), False)  # noqa: E731
            monkeypatch.setattr(triton_gemv, "row_grid", fallback)
            monkeypatch.setattr(triton_fp8, "row_grid", fallback)
        assert_matches(qgemv(x, w, b), x, w.dequantize(), b)
        assert_matches(fp8_gemv(x, w8.weight, w8.scale, b), x, w8.dequantize(), b)


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("variant", sorted(GEMV_VARIANTS))
@pytest.mark.parametrize("factored", [False, True])
def test_qgemv_variants_match_dequantize_then_matmul(fmt: str, variant: str,
                                                     factored: bool) -> None:
    if factored and fmt not in K_QUANTS:
        pytest.skip("no factored form")
    flags = GEMV_VARIANTS[variant]
    n, k = shape_of(fmt)
    w = qweight(fmt, n, k, seed=5, factored=factored)
    x, b = inputs(2, k, n, torch.float32, bias=True, seed=5)
    cfg = QGemvConfig(block_n=8, block_k=ragged_block_k(w), num_warps=1, **flags)
    assert_matches(qgemv(x, w, b, config=cfg), x, w.dequantize(), b)
    even = qweight(fmt, 24, k, seed=6, factored=factored)  # the unmasked loads
    groups = k // even.group_size
    cfg = QGemvConfig(8, (groups & -groups) * even.group_size, 1, **flags)
    assert_matches(qgemv(x, even, None, config=cfg), x, even.dequantize(), None)
    xb = x.bfloat16()  # 16-bit activations through the same variant
    assert_matches(qgemv(xb, w, None, config=cfg._replace(block_k=ragged_block_k(w))), xb,
                   w.dequantize(), None)


Q4_FMTS = ("Q4_0", "Q4_1", "Q4_K")  # 4-bit codes in groups of 32: what the mma kernel serves


@needs_triton
@pytest.mark.parametrize("fmt", Q4_FMTS)
@pytest.mark.parametrize("factored", [False, True])
def test_qgemv_mma_matches_dequantize_then_matmul(fmt: str, factored: bool) -> None:
    """The tensor-core GEMV (quant/triton_q4mma.py): bf16 activations, 1-3 rows in one
    program, ragged and whole tiles, split-K; its weights are bf16(code * bf16(scale)), so
    it is held to the 16-bit bound."""
    if factored and fmt not in K_QUANTS:
        pytest.skip("no factored form")
    n, k = shape_of(fmt)
    w = qweight(fmt, n, k, seed=7, factored=factored)
    cfg = QGemvConfig(16, ragged_block_k(w), 4, unpack="mma")
    for m, bias in ((1, True), (3, False)):
        x, b = inputs(m, k, n, torch.bfloat16, bias, seed=m)
        assert_matches(qgemv(x, w, b, config=cfg), x, w.dequantize(), b)
    even = qweight(fmt, 32, k, seed=8, factored=factored)  # the unmasked loads
    groups = k // even.group_size
    x, _ = inputs(2, k, 32, torch.bfloat16, False, seed=9)
    for split in (1, 2):
        cfg = QGemvConfig(16, (groups & -groups) * 32, 4, unpack="mma", split_k=split,
                          split_reduce="last")
        assert_matches(qgemv(x, even, None, config=cfg), x, even.dequantize(), None)


def bf16_exact_q4(n: int, k: int, seed: int) -> QuantizedWeight:
    """A plain Q4_1-layout weight whose every product is exact in the kernels' arithmetic:
    scales of 4 significant bits times 4-bit codes fit bf16's 8, zeros of 5 bits; with bf16
    x each code * scale * x is exact in float32 (see test below)."""
    w = qweight("Q4_1", n, k, seed=seed)
    g = torch.Generator().manual_seed(seed)
    shape = w.scale.shape
    scale = torch.randint(1, 16, shape, generator=g).float() / 256  # m / 2^8, m < 16
    zero = torch.randint(-16, 16, shape, generator=g).float() / 64
    return dataclasses.replace(w, scale=scale.to(DEVICE), zero=zero.to(DEVICE))


@needs_triton
@pytest.mark.parametrize("unpack", ["mma", "lop3"])
def test_qgemv_is_exact_up_to_the_output_rounding_on_bf16_exact_weights(unpack: str) -> None:
    """Where the weights and x are exact in bf16 products, a 4-bit GEMV differs from the
    float64 reference only by float32 summation order and the bf16 output's rounding: a
    bound of one bf16 ulp, 2^-7 of the result (the interpreter's cast truncates), plus float32
    noise. The 16-bit bound of `assert_matches` (1e-2 of |x| @ |w|) lets a 1% error in every
    scale through; this one does not."""
    n, k = 48, 256
    w = bf16_exact_q4(n, k, seed=3)
    cfg = QGemvConfig(16, 128, 4, unpack=unpack)
    dense = w.dequantize(dtype=torch.float32).double()

    def excess(weight: QuantizedWeight, x: torch.Tensor) -> float:
        expected = F.linear(x.double(), dense)
        loose = F.linear(x.double().abs(), dense.abs())
        got = qgemv(x, weight, config=cfg).double()
        return ((got - expected).abs() - 2.0**-7 * expected.abs() - 1e-6 * loose).max().item()

    for rows in (3, 17):  # 17: more rows than one mma launch serves (MMA_MAX_ROWS)
        x, _ = inputs(rows, k, n, torch.bfloat16, bias=False, seed=4)
        assert excess(w, x) <= 0
    off = dataclasses.replace(w, scale=w.scale * 1.01)  # every scale 1% off
    assert excess(off, x) > 0


@needs_triton
def test_the_mma_bound_catches_a_swapped_nibble_order() -> None:
    w = qweight("Q4_K", 16, 256, factored=True)
    x, _ = inputs(2, 256, 16, torch.bfloat16, bias=False)
    cfg = QGemvConfig(16, 128, 4, unpack="mma")
    assert_matches(qgemv(x, w, config=cfg), x, w.dequantize(), None)
    swapped = dataclasses.replace(w, codes=((w.codes << 4) | (w.codes >> 4)).contiguous())
    with pytest.raises(AssertionError, match="beyond the bound"):
        assert_matches(qgemv(x, swapped, config=cfg), x, w.dequantize(), None)


def test_an_unknown_unpack_is_refused() -> None:
    w = qweight("Q4_0", 8, 64)
    with pytest.raises(ValueError, match="unpack 'nibbles'"):
        qgemv(torch.randn(1, 64, device=w.codes.device), w,
              config=QGemvConfig(8, 64, 1, unpack="nibbles"))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_activations_give_their_dtype(dtype: torch.dtype) -> None:
    for fmt in ("Q4_K", "Q6_K"):
        n, k = shape_of(fmt)
        w = qweight(fmt, n, k)
        for m, fn in ((1, qgemv), (17, qgemm)):
            x, b = inputs(m, k, n, dtype, bias=True)
            y = fn(x, w, b)
            assert y.dtype == dtype and y.shape == (m, n)
            assert_matches(y, x, w.dequantize(), b)


@needs_triton
def test_leading_dims_and_strided_rows() -> None:
    w = qweight("Q4_1", 24, 96)
    x = torch.randn(2, 3, 200, device=DEVICE)[..., :96]  # rows strided, K contiguous
    for fn in (qgemv, qgemm):
        y = fn(x, w)
        assert y.shape == (2, 3, 24)
        assert_matches(y.view(6, 24), x.reshape(6, 96), w.dequantize(), None)
    with pytest.raises(ValueError, match="features"):
        qgemv(torch.randn(1, 64, device=DEVICE), w)


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("factored", [False, True])
def test_qdequant_equals_the_reference(fmt: str, factored: bool) -> None:
    n, k = shape_of(fmt)
    w = qweight(fmt, n, k, factored=factored)
    assert torch.equal(qdequant(w, torch.float32), w.dequantize())
    assert_same_16_bit(qdequant(w, torch.bfloat16), w.dequantize(dtype=torch.bfloat16))
    assert torch.equal(qdequant(w, torch.float32, slice(5, 20)), w.dequantize()[5:20])


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_factored_scales_are_exact_and_smaller(fmt: str) -> None:
    n, k = shape_of(fmt)
    plain = qweight(fmt, n, k)
    w = factor(plain)
    assert w.super_groups == 256 // w.group_size
    assert w.scale.dtype == w.zero.dtype == torch.int8
    assert torch.equal(w.dequantize(), plain.dequantize())  # bit for bit
    back = unfactor(w)
    assert torch.equal(back.scale, plain.scale) and torch.equal(back.zero, plain.zero)
    # bits per weight, codes + int8 sub-scale pairs + float32 super pairs per 256 weights
    # against codes + float32 pairs (Q4_K 4.75 / 6, Q5_K 8.75 / 10, Q6_K 9.25 / 12)
    g = w.group_size
    smaller = (w.bits + 16 / g + 64 / 256) / (w.bits + 64 / g)
    assert w.nbytes / plain.nbytes == pytest.approx(smaller)
    # Moving off the GPU form gives the C kernel's plain float32 layout; merging unfactors.
    assert w.to("cpu").super_groups == 0
    merged = QuantizedWeight.cat([w, qweight("Q6_K", 5, k, factored=True)])
    assert merged.super_groups == 0 and merged.group_size == 16
    assert torch.equal(merged.dequantize()[:n], plain.dequantize())


def test_weights_that_do_not_factor_stay_plain() -> None:
    w = qweight("Q4_K", 6, 256)
    bumped = w.scale.clone()
    bumped[2, 3] = bumped[2, 3].nextafter(torch.tensor(1.0, device=DEVICE))  # not d * int
    odd = QuantizedWeight(w.codes, bumped, w.zero, 4, 32, 256, "Q4_K")
    assert factor(odd) is odd
    assert factor(qweight("Q4_0", 6, 256)).super_groups == 0


@needs_triton
def test_the_bound_catches_a_swapped_nibble_order_and_a_wrong_group() -> None:
    """The tolerance above is tight enough to see the two classic layout bugs."""
    w = qweight("Q4_K", 21, 512)
    x, _ = inputs(3, 512, 21, torch.float32, bias=False)
    assert_matches(qgemv(x, w), x, w.dequantize(), None)
    swapped = QuantizedWeight(((w.codes << 4) | (w.codes >> 4)).contiguous(), w.scale, w.zero,
                              4, 32, 512, "Q4_K")
    words = QGemvConfig(8, 256, 1, words=True)
    for run in (lambda v: qgemv(x, v), lambda v: qgemv(x, v, config=words)):
        with pytest.raises(AssertionError, match="beyond the bound"):
            assert_matches(run(swapped), x, w.dequantize(), None)
    shifted = QuantizedWeight(w.codes, w.scale.roll(1, dims=1).contiguous(), w.zero, 4, 32, 512,
                              "Q4_K")
    for weight_as_a in (False, True):
        cfg = gemm_config(3, 21, 512)._replace(weight_as_a=weight_as_a)
        with pytest.raises(AssertionError, match="beyond the bound"):
            assert_matches(qgemm(x, shifted, config=cfg), x, w.dequantize(), None)


def test_configs_are_shape_only_and_valid() -> None:
    from sgl.backend.quant.triton_gemm import gemm_config
    from sgl.backend.quant.triton_gemv import gemv_config

    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    for n, k in ((6144, 4096), (4096, 14336), (128256, 4096), (37, 160), (21, 768)):
        for gs in (16, 32):
            c = gemv_config("q4" if gs == 32 else "q8", n, k, gs)
            assert c == gemv_config("q4" if gs == 32 else "q8", n, k, gs)
            assert pow2(c.block_n) and pow2(c.block_k // gs)
            assert c.block_k % gs == 0
            for m in (2, 16, 17, 64, 65, 256):
                t = gemm_config(m, n, k, gs)
                assert t.block_k % gs == 0 and pow2(t.block_k // gs)
                assert min(t.block_m, t.block_n) >= 16 and t.block_m >= min(m, 128) // 2
        f = gemv_config("fp8", n, k, 64)
        assert pow2(f.block_n) and pow2(f.block_k) and f.fp8_decode in FP8_DECODES
        assert f.fp8_decode != "words" or f.block_k % 16 == 0  # (whole 16-byte vectors)
        for m in (2, 16, 256):
            t = gemm_config(m, n, k, kind="fp8")
            assert pow2(t.block_k) and min(t.block_m, t.block_n) >= 16


def test_cuda_routes_are_a_valid_table() -> None:
    """Every weight kind has a route; limits increase; one row is the GEMV; the paths are
    the three the dispatcher knows; rows past the table go to the scratch."""
    assert set(linear.CUDA_ROUTES) == {"q4", "q8", "fp8"}
    for kind, routes in linear.CUDA_ROUTES.items():
        limits = [limit for limit, _ in routes]
        assert limits == sorted(set(limits)) and limits[0] >= 1, kind
        assert {path for _, path in routes} <= {"gemv", "gemm", "scratch"}, kind
        assert linear.cuda_route(1, kind) == "gemv"
        assert linear.cuda_route(limits[-1] + 1, kind) == "scratch"


# -- FP8 --------------------------------------------------------------------------------------


def fp8_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, Fp8Weight]:
    g = torch.Generator().manual_seed(seed)
    dense = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3).to(DEVICE)
    dense[n // 2] = 0.0  # a zero row: scale 1, not a division by zero
    return dense, Fp8Weight.quantize(dense)


# -- the dispatcher's row rule (CUDA's, run here under the interpreter) -----------------------


@needs_triton
@pytest.mark.parametrize("rows", [1, 4, 9])
def test_dispatch_by_rows(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_ROUTES: 1 row -> GEMV, up to 4 -> tiled (as set here), more -> dequantized slices
    + matmul (the slices small here, so the N-sliced path runs); equal results on every
    path."""
    from sgl.backend.quant import fp8 as fp8_module
    from sgl.backend.quant import triton_fp8, triton_gemm, triton_gemv

    monkeypatch.setattr(linear, "use_triton", lambda x: True)
    routes = ((1, "gemv"), (4, "gemm"))
    monkeypatch.setattr(linear, "CUDA_ROUTES", {"q4": routes, "q8": routes, "fp8": routes})
    monkeypatch.setattr(linear, "SCRATCH_ELEMENTS", 10 * 160)  # 10 weight rows per slice
    calls: list[str] = []
    for mod, name in ((triton_gemv, "qgemv"), (triton_gemm, "qgemm"), (triton_gemm, "qdequant"),
                      (triton_fp8, "fp8_gemv"), (triton_fp8, "fp8_gemm"),
                      (triton_fp8, "fp8_dequant")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **kw:
                            calls.append(_n) or _r(*a, **kw))
    w = qweight("Q4_0", 37, 160)
    x, b = inputs(rows, 160, 37, torch.float32, bias=True)
    assert_matches(linear.quant_linear(x, w, b), x, w.dequantize(), b)
    _, w8 = fp8_weight(37, 160)
    assert_matches(fp8_linear(x, w8, b), x, w8.dequantize(), b)
    assert fp8_module.fp8_linear is fp8_linear
    kind = {1: ("qgemv", "fp8_gemv"), 4: ("qgemm", "fp8_gemm"), 9: ("qdequant", "fp8_dequant")}
    assert set(calls) == set(kind[rows])
    if rows == 9:
        assert calls.count("qdequant") == 4  # 37 rows in slices of 10


@needs_triton
def test_a_quantized_model_forward_through_the_triton_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole (small, random Q4_K_M-layout) model, prefill of 5 tokens then one decode
    token: the CUDA path's kernels (tiled, then GEMV, through the layers, the 8-bit/16 tied
    head, odd N and K of 5 and 11 groups) give the CPU path's logits."""
    from test_attention_torch import FakePool, Step, make_forward_batch

    from sgl.backend.attention.torch_backend import TorchAttentionBackend
    from sgl.backend.forward_batch import ForwardMode
    from sgl.backend.model_loader import load_model

    small = {"num_hidden_layers": 2, "vocab_size": 1000, "hidden_size": 160,
             "intermediate_size": 352, "num_attention_heads": 5, "num_key_value_heads": 1}
    model, cfg = load_model("smollm2-135m", device="cpu", dtype=torch.float32,
                            model_config=small, quantization="gguf")
    runs = []
    for triton_path in (False, True):
        monkeypatch.setattr(linear, "use_triton", lambda x, _t=triton_path: _t)
        pool = FakePool(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim, max_context=32)
        backend = TorchAttentionBackend()
        prefill = make_forward_batch(pool, backend, [Step(0, 0, [3, 9, 4, 17, 5])],
                                     ForwardMode.EXTEND)
        first = model.compute_logits(model(prefill)[-1:])
        decode = make_forward_batch(pool, backend, [Step(0, 5, [11])], ForwardMode.DECODE)
        runs.append(torch.cat([first, model.compute_logits(model(decode))]))
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-4, atol=1e-4)


def test_reference_paths_on_the_cpu() -> None:
    """CPU tensors (no Triton path there): FP8 runs its reference, exactly."""
    _, w8 = fp8_weight(9, 32)
    w8 = Fp8Weight(w8.weight.cpu(), w8.scale.cpu())
    x = torch.randn(2, 32)
    assert torch.equal(fp8_linear(x, w8), fp8_linear_reference(x, w8))
    assert torch.equal(linear.quant_linear(x, w8), fp8_linear_reference(x, w8))


@skip_unless_rerun_needed(TRITON_HERE)
def test_quant_triton_in_subprocess() -> None:
    """Triton was imported before this module could ask for its interpreter: rerun here."""
    rerun_interpreted(__file__)
