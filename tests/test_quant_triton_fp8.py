"""The FP8 kernels (backend/quant/triton_fp8.py: the first GEMV with its three e4m3 decodes,
the word GEMV, tiled in both operand orders, dequantize) and Fp8Weight.quantize, against
dequantize-then-matmul; the two bit-trick decodes and the word kernel on every one of the
256 bytes. Helpers and the bound:
tests/test_quant_triton.py; the interpreter set-up: tests/triton_interp.py.
"""

from __future__ import annotations

import pytest
import torch
from triton_interp import (  # first: sets TRITON_INTERPRET before triton is imported
    DEVICE,
    NO_TRITON,
    rerun_interpreted,
    skip_unless_rerun_needed,
    triton_runs_here,
)
from test_quant_triton import assert_matches, assert_same_16_bit, fp8_weight, inputs

from sgl.backend.kernels.triton_compat import tl, triton
from sgl.backend.quant import fp8, linear
from sgl.backend.quant.fp8 import FP8_MAX, Fp8Weight
from sgl.backend.quant.triton_fp8 import (
    e4m3_f32,
    e4m3_f32_sext,
    fp8_dequant,
    fp8_gemm,
    fp8_gemv,
)
from sgl.backend.quant.triton_gemm import GemmConfig
from sgl.backend.quant.triton_gemv import QGemvConfig

TRITON_HERE = triton_runs_here(fp8_gemv.__globals__["_fp8_gemv_kernel"])
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason=NO_TRITON)


@triton.jit
def decode_all(B, OUT, SEXT: tl.constexpr):
    offs = tl.arange(0, 256)
    b = tl.load(B + offs).to(tl.int32)  # (int8 bytes: sign-extended)
    tl.store(OUT + offs, e4m3_f32_sext(b) if SEXT else e4m3_f32(b))


@needs_triton
def test_marked_fp8_weights_run_w8a8_from_its_min_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA dispatch (here under the interpreter): a weight marked for W8A8 keeps the
    weight-only kernels below W8A8_MIN_ROWS (bit for bit an unmarked weight's product) and
    runs the W8A8 product from there on; an unmarked weight never quantizes its input."""
    import dataclasses

    monkeypatch.setattr(linear, "use_triton", lambda x: True)
    _, w = fp8_weight(32, 64, seed=2)
    marked = dataclasses.replace(w, fp8_activations=True)
    x, _ = inputs(fp8.W8A8_MIN_ROWS, 64, 32, torch.float32, bias=False, seed=2)
    below = x[:fp8.W8A8_MIN_ROWS - 1]
    assert torch.equal(fp8.fp8_linear(below, marked), fp8.fp8_linear(below, w))
    if not fp8._cpu_rowwise_scaled_mm() and DEVICE == "cpu":
        pytest.skip("this torch's CPU _scaled_mm takes per-tensor scales only")
    assert torch.equal(fp8.fp8_linear(x, marked), fp8.fp8_scaled_linear(x, w))
    assert_matches(fp8.fp8_linear(x, w), x, w.dequantize(), None)  # (unmarked: weight-only)
    assert not torch.equal(fp8.fp8_linear(x, w), fp8.fp8_linear(x, marked))


@needs_triton
@pytest.mark.parametrize("sext", [False, True])
def test_e4m3_integer_decodes_are_exact_for_every_byte(sext: bool) -> None:
    """All 256 bytes but the two NaNs, subnormals included: the decode * 2^120 == torch's
    value, bit for bit (the products by 2^120 in float64 are exact)."""
    raw = torch.arange(256, dtype=torch.int32, device=DEVICE).to(torch.uint8)
    out = torch.empty(256, device=DEVICE)
    decode_all[(1,)](raw.view(torch.int8) if sext else raw, out, sext)
    values = raw.view(torch.float8_e4m3fn).float()
    finite = ~values.isnan()
    assert finite.sum() == 254
    subnormal = finite & (raw & 0x78 == 0) & (raw & 0x07 != 0)
    assert subnormal.sum() == 14 and (out[subnormal] != 0).all()  # not flushed
    assert torch.equal((out.double() * 2.0**120)[finite], values.double()[finite])


def test_fp8_quantize_scales_and_rounding() -> None:
    dense, w = fp8_weight(13, 70)
    amax = dense.abs().amax(dim=1)
    expected = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    assert torch.equal(w.scale, expected)
    assert torch.equal(w.weight[6].float(), torch.zeros(70, device=DEVICE))
    # e4m3 keeps 3 mantissa bits: round to nearest is within 2^-4 relative (normal range)
    # and every row's largest value is exact (it maps onto 448).
    err = (w.dequantize() - dense).abs()
    assert (err <= dense.abs() * 2.0**-4 + w.scale[:, None] * 2.0**-9).all()
    top = dense.abs().argmax(dim=1)
    rows = torch.arange(13, device=DEVICE)
    torch.testing.assert_close(w.dequantize()[rows, top], dense[rows, top], rtol=1e-6, atol=0)
    assert w.nbytes == 13 * 70 + 13 * 4
    with pytest.raises(ValueError, match="inconsistent"):
        Fp8Weight(w.weight, w.scale[:5])


@needs_triton
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_kernels_match_dequantize_then_matmul(m: int, bias: bool) -> None:
    n, k = 37, 200
    _, w = fp8_weight(n, k, seed=m)
    x, b = inputs(m, k, n, torch.float32, bias, seed=m)
    ref = w.dequantize()
    if m <= 3:  # (the GEMV serves one row; more run as a grid axis, slowly when interpreted)
        assert_matches(fp8_gemv(x, w.weight, w.scale, b), x, ref, b)
        _, even = fp8_weight(32, 256, seed=m)  # no tile on an edge: the unmasked loads
        xe, be = inputs(m, 256, 32, torch.float32, bias, seed=m)
        for decode in ("bits", "sext", "cvt", "words"):  # integer ops, the hardware's, words
            cfg = QGemvConfig(8, 64, 1, fp8_decode=decode)
            assert_matches(fp8_gemv(x, w.weight, w.scale, b, config=cfg), x, ref, b)
            assert_matches(fp8_gemv(xe, even.weight, even.scale, be, config=cfg), xe,
                           even.dequantize(), be)
    assert_matches(fp8_gemm(x, w.weight, w.scale, b), x, ref, b)
    for weight_as_a in (False, True):
        cfg = GemmConfig(16, 16, 64, 1, 1, weight_as_a)
        assert_matches(fp8_gemm(x, w.weight, w.scale, b, config=cfg), x, ref, b)
    xb = x.bfloat16()
    yb = fp8_gemm(xb, w.weight, w.scale, None if b is None else b.bfloat16())
    assert yb.dtype == torch.bfloat16
    assert_matches(yb, xb, ref, b)
    assert torch.equal(fp8_dequant(w.weight, w.scale, torch.float32), ref)
    with pytest.raises(ValueError, match="fp8_decode 'e5m2'"):
        fp8_gemv(x[:1], w.weight, w.scale, config=QGemvConfig(8, 64, 1, fp8_decode="e5m2"))
    assert_same_16_bit(fp8_dequant(w.weight, w.scale, torch.bfloat16, slice(3, 9)),
                       w.dequantize(torch.bfloat16)[3:9])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_word_gemv_decodes_every_byte_exactly(dtype: torch.dtype) -> None:
    """Row r of the weight holds byte r once (the NaNs as zeros), x is ones: y[r] is byte r's
    value times the scale, exactly (one nonzero product; e4m3 values are exact in bf16 too),
    whichever byte of its int32 word the byte sits in (r % 4), bf16 x read as pairs."""
    raw = torch.zeros(256, 64, dtype=torch.uint8)
    rows = torch.arange(256)
    raw[rows, rows % 64] = rows.to(torch.uint8)
    raw[0x7F] = raw[0xFF] = 0
    weight = raw.view(torch.float8_e4m3fn).to(DEVICE)
    scale = torch.full((256,), 0.5, device=DEVICE)
    x = torch.ones(1, 64, device=DEVICE, dtype=dtype)
    y = fp8_gemv(x, weight, scale, config=QGemvConfig(16, 64, 1, fp8_decode="words"))
    expected = weight.float().nan_to_num(0.0)[rows, rows % 64] * 0.5
    assert torch.equal(y.float()[0], expected.to(dtype).float())


@needs_triton
@pytest.mark.parametrize("split", [1, 2])
def test_fp8_word_gemv_bf16_rows_offsets_and_splits(split: int) -> None:
    """The word kernel with bf16 x: as pairs (aligned rows), one value per load (a row that
    starts 2 bytes into a word), two rows, ragged N and K, split-K with either reduction."""
    n, k = 37, 200
    _, w = fp8_weight(n, k, seed=split)
    ref = w.dequantize()
    wide = torch.randn(2, k + 1, device=DEVICE).bfloat16()
    for x in (wide[:, :k].contiguous(), wide[:1, 1:], wide[:, 1:]):
        for reduce in ("kernel", "last"):
            cfg = QGemvConfig(8, 64, 1, fp8_decode="words", split_k=split, split_reduce=reduce)
            assert_matches(fp8_gemv(x, w.weight, w.scale, config=cfg), x, ref, None)


@skip_unless_rerun_needed(TRITON_HERE)
def test_quant_triton_fp8_in_subprocess() -> None:
    """Triton was imported before this module could ask for its interpreter: rerun here."""
    rerun_interpreted(__file__)
