"""Float16 scale and zero on the CPU (QuantizedWeight.half_scales, backend/quant/weight.py):
kept only where every value converts exactly (the formats whose file stores them as float16),
and every C path that reads them (the float kernel at one and many rows, its dequantize, the
integer-activation kernel, the one-call decode step in test_cpu_layer.py) gives the same bits
as the same weight with float32 scale and zero."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_quant_kernels import needs_kernel, weight

from sgl.backend.quant import QuantizedWeight, cpu_int8, cpu_kernel
from sgl.backend.quant.linear import quant_linear

FILE_F16 = ["Q4_0", "Q4_1", "Q8_0"]  # block scale (and Q4_1's min) stored as float16


@pytest.mark.parametrize("fmt", FILE_F16)
def test_file_float16_formats_keep_float16_scales(fmt: str) -> None:
    w = weight(fmt, 37, 96)
    half = w.half_scales()
    assert half.f16_scales and half.scale.dtype == half.zero.dtype == torch.float16
    assert torch.equal(half.dequantize(), w.dequantize())
    assert half.nbytes < w.nbytes
    assert half.float_scales().scale.dtype == torch.float32
    assert torch.equal(half.float_scales().dequantize(), w.dequantize())


@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_products_stay_float32(fmt: str) -> None:
    """d * sc is generally not a float16 value: converting would change the weights."""
    w = weight(fmt, 21, 512)
    assert w.half_scales() is w


def test_an_overflowing_zero_stays_float32() -> None:
    """Q4_0's zero is -8 * d: float16 holds d = 16384 exactly but not -131072."""
    w = weight("Q4_0", 5, 64)
    big = dataclasses.replace(w, scale=torch.full_like(w.scale, 16384.0),
                              zero=torch.full_like(w.zero, -131072.0))
    assert big.half_scales() is big


def test_mixed_scale_dtypes_concatenate_as_float32() -> None:
    a, b = weight("Q4_1", 8, 64, seed=1).half_scales(), weight("Q4_1", 8, 64, seed=2)
    merged = QuantizedWeight.cat([a, b])
    assert merged.scale.dtype == torch.float32
    assert torch.equal(merged.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def _pair(fmt: str, rows: int, cols: int, seed: int) -> tuple[QuantizedWeight, QuantizedWeight]:
    w = weight(fmt, rows, cols, seed)
    half = w.half_scales()
    assert half.f16_scales
    return w, half


@needs_kernel
@pytest.mark.parametrize("fmt", FILE_F16)
@pytest.mark.parametrize("rows", [1, 3, 9, 33])  # one row (fours + tail), 8-row passes, BLAS
@pytest.mark.parametrize("bias", [False, True])
def test_float_kernel_gives_the_same_bits(fmt: str, rows: int, bias: bool) -> None:
    w, half = _pair(fmt, 37, 96, rows)  # 37 features: blocks of 16, fours and a tail
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    b = torch.randn(37, generator=gen) if bias else None
    assert torch.equal(quant_linear(x, half, b), quant_linear(x, w, b))
    if rows <= 32:
        assert torch.equal(cpu_kernel.qlinear(x, half, b), cpu_kernel.qlinear(x, w, b))


@needs_kernel
@pytest.mark.parametrize("fmt", FILE_F16)
def test_c_dequantize_gives_the_same_bits(fmt: str) -> None:
    w, half = _pair(fmt, 37, 96, 0)
    assert torch.equal(cpu_kernel.dequantize(half), w.dequantize())
    assert torch.equal(cpu_kernel.dequantize(half, slice(5, 30)), w.dequantize(slice(5, 30)))


@needs_kernel
@pytest.mark.parametrize("fmt", FILE_F16)
@pytest.mark.parametrize("rows", [1, 5])  # the one-row tiles and the laid-out lanes
def test_int8_kernel_gives_the_same_bits(fmt: str, rows: int) -> None:
    w, half = _pair(fmt, 37, 96 + 32, rows)  # an odd group count: the trailing group
    x = torch.randn(rows, 96 + 32, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(cpu_int8.int8_linear(x, half, None), cpu_int8.int8_linear(x, w, None))


@pytest.mark.slow
def test_real_model_loads_float16_scales_on_the_cpu() -> None:
    """SmolLM2's Q4_1 body and Q8_0 table: every quantized weight float16-scaled."""
    from sgl.backend.model_loader import load_model

    model, _ = load_model(None, device=torch.device("cpu"), dtype=torch.float32,
                          quantization="gguf")
    weights = [m.qweight for m in model.modules()
               if isinstance(getattr(m, "qweight", None), QuantizedWeight)]
    assert weights and all(w.f16_scales for w in weights)
