"""The quantized linear op (backend/quant/linear.py and its C kernel) against its reference,
dequantize-then-F.linear, on random weights of every format and odd shapes; and the layers
that dispatch on a QuantizedWeight (Linear, Embedding as input table and tied head)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_quant_formats import random_blocks

from sgl.backend.kernels import dispatch
from sgl.backend.layers.linear import Embedding, Linear
from sgl.backend.quant import FORMATS, QuantizedWeight, cpu_kernel, decode, linear
from sgl.backend.quant.linear import quant_linear, quant_linear_reference

CPU = torch.device("cpu")
KERNELS = dispatch.resolve_kernels("reference", CPU, torch.float32)
needs_kernel = pytest.mark.skipif(not cpu_kernel.available(),
                                  reason="no C compiler or no AVX2/FMA: the reference serves")


def weight(fmt: str, rows: int, cols: int, seed: int = 0) -> QuantizedWeight:
    raw = torch.from_numpy(random_blocks(fmt, rows, cols, seed))
    return QuantizedWeight.from_decoded(decode(fmt, raw, cols), fmt)


def assert_close_to_sum_order(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                              b: torch.Tensor | None) -> None:
    """got == x @ w^T + b up to float32 summation order: the error bound scales with the sum
    of the terms' magnitudes (|x| @ |w|^T), not with the result, which may cancel to ~0."""
    expected = F.linear(x, w, b)
    bound = 1e-5 * (F.linear(x.abs(), w.abs()) + (0 if b is None else b.abs())) + 1e-6
    excess = (got - expected).abs() - bound
    assert excess.max().item() <= 0, f"off by {excess.max().item():.3g} beyond the bound"


def test_kernel_is_built_on_x86_64_with_avx2() -> None:
    """CI's machines have a compiler and AVX2: the kernel must not silently fall back."""
    import platform
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    flags = info.read_text() if info.exists() else ""
    if platform.machine() != "x86_64" or " avx2" not in flags or " fma" not in flags:
        pytest.skip("not an AVX2/FMA x86-64 machine")
    assert cpu_kernel.available()


@needs_kernel
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 40])  # across the 8-row passes and the
@pytest.mark.parametrize("bias", [False, True])          # dequantize-then-BLAS switch
def test_quant_linear_matches_dequantize_then_matmul(fmt: str, rows: int, bias: bool) -> None:
    out_features = 37 if FORMATS[fmt][0] == 32 else 21  # not a multiple of any block
    in_features = 96 if FORMATS[fmt][0] == 32 else 512
    w = weight(fmt, out_features, in_features, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    assert_close_to_sum_order(quant_linear(x, w, b), x, w.dequantize(), b)
    assert torch.equal(quant_linear_reference(x, w, b), F.linear(x, w.dequantize(), b))


@needs_kernel
@pytest.mark.parametrize("fmt", sorted(FORMATS))  # 4-bit and 8-bit codes, groups of 32 and 16
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9])  # one row (fours + tail), tiles of 4 and 5
def test_avx512_loops_give_the_bits_of_the_avx2_ones(fmt: str, rows: int) -> None:
    w = weight(fmt, 37, 512, seed=rows)  # 37 features: fours, a tail, blocks of 16
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    if not cpu_kernel.use_avx512(True):
        pytest.skip("no AVX-512 on this CPU: the AVX2 loops serve")
    try:
        wide = cpu_kernel.qlinear(x, w, None)
        assert not cpu_kernel.use_avx512(False)
        narrow = cpu_kernel.qlinear(x, w, None)
    finally:
        cpu_kernel.use_avx512(True)
    assert torch.equal(wide, narrow)
    assert_close_to_sum_order(wide, x, w.dequantize(), None)


@needs_kernel
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("any_scales", [False, True])
def test_the_kernel_multiplies_the_references_weights(fmt: str, wide: bool,
                                                      any_scales: bool) -> None:
    """Each weight is rebuilt as `dequantize` rebuilds it (code * scale, then + zero, in
    float32), so a product with a one-hot row is the reference weight itself, bit for bit.
    `any_scales`: float32 scales and zeros of full precision, where code * scale rounds and
    one fused multiply-add would give other bits (the files' own scales make it exact)."""
    in_features = 96 if FORMATS[fmt][0] == 32 else 512
    w = weight(fmt, 38, in_features, seed=7)
    if any_scales:
        gen = torch.Generator().manual_seed(8)
        w = dataclasses.replace(w.float_scales(), scale=torch.randn(w.scale.shape, generator=gen),
                                zero=torch.randn(w.zero.shape, generator=gen))
        assert not w.f16_scales
    ks = torch.arange(0, in_features, 5)
    x = torch.zeros(len(ks), in_features)
    x[torch.arange(len(ks)), ks] = 1.0
    if wide and not cpu_kernel.use_avx512(True):
        pytest.skip("no AVX-512 on this CPU")
    try:
        cpu_kernel.use_avx512(wide)
        assert torch.equal(cpu_kernel.qlinear(x, w, None), w.dequantize()[:, ks].t())
    finally:
        cpu_kernel.use_avx512(True)


@needs_kernel
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("wide", [True, False])  # AVX-512 tiles where the CPU has them; AVX2
def test_a_rows_bits_do_not_depend_on_the_batch(fmt: str, wide: bool) -> None:
    """Verify rows and jumped tokens share a step with other rows, and speculation promises
    the outputs of plain decoding: every row of a 1..32-row product (tiles of 1-4 rows, tails
    of 1-3 features) must equal that row computed alone, bit for bit."""
    in_features = 96 if FORMATS[fmt][0] == 32 else 512
    w = weight(fmt, 38, in_features, seed=5)  # 38 features: blocks of 16, tiles of 4, a tail of 2
    x = torch.randn(32, in_features, generator=torch.Generator().manual_seed(5))
    if wide and not cpu_kernel.use_avx512(True):
        pytest.skip("no AVX-512 on this CPU")
    try:
        cpu_kernel.use_avx512(wide)
        alone = torch.cat([cpu_kernel.qlinear(x[i:i + 1], w, None) for i in range(32)])
        for rows in (2, 3, 5, 8, 32):
            assert torch.equal(cpu_kernel.qlinear(x[:rows], w, None), alone[:rows]), rows
    finally:
        cpu_kernel.use_avx512(True)


@needs_kernel
def test_c_dequantize_equals_the_reference() -> None:
    for fmt in FORMATS:
        w = weight(fmt, 19, 256)
        assert torch.equal(cpu_kernel.dequantize(w), w.dequantize()), fmt
        for rows in (slice(0, 5), slice(5, 19), slice(18, 19)):  # tiles
            assert torch.equal(cpu_kernel.dequantize(w, rows), w.dequantize(rows)), (fmt, rows)


@needs_kernel
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("bias", [False, True])
def test_many_rows_run_tile_by_tile(fmt: str, bias: bool,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Above GEMV_MAX_ROWS the weight is dequantized a tile of output features at a time:
    with the smallest tile (64 features), 150 features are three tiles, the last partial."""
    monkeypatch.setattr(linear, "TILE_BYTES", 1)
    seen: list[slice] = []
    real = cpu_kernel.dequantize

    def spy(w: QuantizedWeight, rows: slice = slice(None)) -> torch.Tensor:
        seen.append(rows)
        return real(w, rows)

    monkeypatch.setattr(cpu_kernel, "dequantize", spy)
    in_features = 96 if FORMATS[fmt][0] == 32 else 512
    w = weight(fmt, 150, in_features, seed=3)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(linear.GEMV_MAX_ROWS + 7, in_features, generator=gen)
    b = torch.randn(150, generator=gen) if bias else None
    assert_close_to_sum_order(quant_linear(x, w, b), x, w.dequantize(), b)
    assert seen == [slice(0, 64), slice(64, 128), slice(128, 150)]


@needs_kernel
@pytest.mark.parametrize("rows", [65, 96, 130])
def test_prefill_products_reach_onednn_in_few_row_counts(rows: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Past GEMV_MAX_ROWS the dequantized product runs through oneDNN with its rows padded to
    a multiple of onednn_linear.ROW_BUCKET (oneDNN keeps a primitive per shape: unpadded, every
    prompt length grew the process), and the padding rows never reach the output."""
    from sgl.backend.kernels import onednn_linear

    if not onednn_linear.available(torch.device("cpu"), torch.float32):
        pytest.skip("no oneDNN in this torch build")
    seen: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(onednn_linear.torch.ops.mkldnn, "_linear_pointwise", spy)
    w = weight("Q4_1", 48, 96, seed=5)
    gen = torch.Generator().manual_seed(5)
    x, b = torch.randn(rows, 96, generator=gen), torch.randn(48, generator=gen)
    got = quant_linear(x, w, b)
    assert got.shape == (rows, 48)
    assert_close_to_sum_order(got, x, w.dequantize(), b)
    assert seen == [-(-rows // onednn_linear.ROW_BUCKET) * onednn_linear.ROW_BUCKET]


@needs_kernel
def test_leading_dims_bfloat16_and_empty_batches() -> None:
    w = weight("Q4_1", 48, 64)
    x = torch.randn(2, 3, 64)
    assert_close_to_sum_order(quant_linear(x, w).view(6, 48), x.view(6, 64), w.dequantize(), None)
    xb = x.bfloat16()
    got = quant_linear(xb, w)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 48)
    assert quant_linear(torch.randn(0, 64), w).shape == (0, 48)


def test_reference_serves_when_the_kernel_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    w = weight("Q6_K", 5, 256)
    x = torch.randn(2, 256)
    assert torch.equal(linear.quant_linear(x, w), F.linear(x, w.dequantize()))


def test_layers_dispatch_on_the_quantized_weight() -> None:
    w = weight("Q8_0", 40, 64)
    lin = Linear(64, 40, bias=False, kernels=KERNELS, device=CPU, dtype=torch.float32)
    lin.weight, lin.qweight = None, w
    x = torch.randn(3, 64)
    assert_close_to_sum_order(lin(x), x, w.dequantize(), None)
    emb = Embedding(40, 64, kernels=KERNELS, device=CPU, dtype=torch.float32)
    emb.weight, emb.qweight = None, w
    ids = torch.tensor([[0, 39], [5, 5]])
    assert torch.equal(emb(ids), w.dequantize()[ids])
    assert_close_to_sum_order(emb.project(x), x, w.dequantize(), None)
    assert list(emb.parameters()) == []  # one quantized table, no float copy
