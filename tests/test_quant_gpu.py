"""Quantized and FP8 weights wired into the model, and on the GPU.

    python -m pytest -q tests/test_quant_gpu.py        (the `gpu` tests skip without CUDA)

On any machine: `quantization="fp8"` converts every Linear of a float load and nothing else;
a dummy model with `quantization="gguf"` gets random quantized weights in a Q4_K_M layout.
On CUDA: the quant_linear dispatcher at the 8B layer shapes on every path (GEMV, tiled,
scratch + cuBLAS) against dequantize-then-matmul, every kernel variant flag (GEMV: magic /
words / the lop3 kernel; FP8 decodes; tiled: weight_as_a) at those shapes against a bound tight enough to see
one wrong nibble, the tiled kernel at every row count 1..40 (rows independent of M, bit for
bit) and on the real model's weights, the GEMVs' split-K (both reductions, bit for bit
equal and the same on every run), CUDA-graph replay against eager, and the real default
model kept quantized on the GPU against the same engine on its dequantized float weights
(token for token, with the tie rule of test_engine_real), through the scratch path and
through the tiled kernel.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import sgl
from sgl.backend.layers.linear import Embedding, Linear
from sgl.backend.model_loader import load_model
from sgl.backend.quant import FORMATS, QuantizedWeight, cuda_gemv, linear, triton_gemv
from sgl.backend.quant.cuda_gemv import CudaGemvConfig
from sgl.backend.quant.factored import factor
from sgl.backend.quant.fp8 import Fp8Weight
from sgl.backend.quant.install import weight_bytes
from sgl.backend.quant.triton_fp8 import fp8_gemm, fp8_gemv
from sgl.backend.quant.triton_gemm import GemmConfig, gemm_config, qgemm
from sgl.backend.quant.triton_gemv import QGemvConfig, qgemv

SMALL = {"num_hidden_layers": 2}
CUDA = torch.device("cuda")


def _linears(model: torch.nn.Module) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


def test_fp8_load_converts_every_linear_and_keeps_table_and_head() -> None:
    floats, _ = load_model("smollm2-135m", device="cpu", dtype=torch.float32, model_config=SMALL,
                           seed=3, quantization="none")
    fp8, _ = load_model("smollm2-135m", device="cpu", dtype=torch.float32, model_config=SMALL,
                        seed=3, quantization="fp8")
    reference = _linears(floats)
    for name, module in _linears(fp8).items():
        assert module.weight is None and isinstance(module.qweight, Fp8Weight), name
        expected = Fp8Weight.quantize(reference[name].weight)
        assert torch.equal(module.qweight.weight.view(torch.uint8),
                           expected.weight.view(torch.uint8)), name
        assert torch.equal(module.qweight.scale, expected.scale), name
    assert fp8.model.embed_tokens.weight is not None and fp8.model.embed_tokens.qweight is None
    assert fp8.tie_word_embeddings and fp8.lm_head is fp8.model.embed_tokens  # tied: stays
    assert weight_bytes(fp8) < weight_bytes(floats)
    x = torch.randn(3, fp8.config.hidden_size)
    layer = fp8.model.layers[0].mlp.gate_up_proj
    torch.testing.assert_close(layer(x), F.linear(x, layer.qweight.dequantize()))


def test_fp8_load_converts_an_untied_head_and_keeps_the_table() -> None:
    """An untied LM head is a linear like the others: FP8 with per-channel scales, its
    logits those of its dequantized weight; the input embedding stays in the model's dtype."""
    untied = dict(SMALL, tie_word_embeddings=False)
    floats, _ = load_model("smollm2-135m", device="cpu", dtype=torch.float32,
                           model_config=untied, seed=3, quantization="none")
    fp8, _ = load_model("smollm2-135m", device="cpu", dtype=torch.float32, model_config=untied,
                        seed=3, quantization="fp8")
    head = fp8.lm_head
    assert head is not fp8.model.embed_tokens and head.weight is None
    assert isinstance(head.qweight, Fp8Weight)
    expected = Fp8Weight.quantize(floats.lm_head.weight)
    assert torch.equal(head.qweight.weight.view(torch.uint8), expected.weight.view(torch.uint8))
    assert torch.equal(head.qweight.scale, expected.scale)
    table = fp8.model.embed_tokens
    assert table.qweight is None and torch.equal(table.weight, floats.model.embed_tokens.weight)
    hidden = torch.randn(2, fp8.config.hidden_size)
    torch.testing.assert_close(fp8.compute_logits(hidden),
                               F.linear(hidden, expected.dequantize()))
    assert weight_bytes(fp8) < weight_bytes(floats) - floats.lm_head.weight.numel() * 3


def test_dummy_model_with_gguf_gets_random_quantized_weights() -> None:
    model, _ = load_model("smollm2-135m", device="cpu", dtype=torch.float32, model_config=SMALL,
                          quantization="gguf")
    for name, module in model.named_modules():
        if isinstance(module, (Linear, Embedding)):
            q = module.qweight
            assert module.weight is None and isinstance(q, QuantizedWeight), name
            assert (q.bits, q.group_size) == ((4, 32) if isinstance(module, Linear) else (8, 16))
            w = q.dequantize()
            assert 0.01 < w.std().item() < 0.03, name  # like the float dummy init
    x = torch.randn(2, model.config.hidden_size)
    assert torch.isfinite(model.compute_logits(x)).all()


# -- CUDA -------------------------------------------------------------------------------------

# 8B qkv, o_proj, gate_up, down
LAYER_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def random_qweight(n: int, k: int, bits: int, group: int, seed: int = 0,
                   factored: bool = False) -> QuantizedWeight:
    """Random codes and random (not constant) scales and zeros per group, on the GPU;
    `factored`: K-quant-structured scales (fp16 per 256 weights x small integers) in the
    factored form."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    if bits == 4:
        codes = torch.randint(0, 256, (n, k // 2), generator=gen, device=CUDA).to(torch.uint8)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=gen, device=CUDA).to(torch.int8)
    groups = k // group
    if not factored:
        scale = torch.rand(n, groups, generator=gen, device=CUDA) * 0.01
        zero = torch.randn(n, groups, generator=gen, device=CUDA) * 0.02
        return QuantizedWeight(codes, scale, zero, bits, group, k, "random")
    per = 256 // group
    d = (torch.rand(n, groups // per, generator=gen, device=CUDA) * 1e-3).half().float()
    dmin = (torch.rand(n, groups // per, generator=gen, device=CUDA) * 1e-3).half().float()
    sc = torch.randint(-128, 128, (n, groups), generator=gen, device=CUDA).float()
    m = torch.randint(0, 64, (n, groups), generator=gen, device=CUDA).float()
    scale = d.repeat_interleave(per, dim=1) * sc
    zero = -dmin.repeat_interleave(per, dim=1) * m
    w = factor(QuantizedWeight(codes, scale, zero, bits, group, k, "random"))
    assert w.super_groups == per
    return w


def assert_bf16_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    expected = F.linear(x.float(), w.float())
    bound = 2e-2 * F.linear(x.float().abs(), w.float().abs()) + 1e-3
    excess = (got.float() - expected).abs() - bound
    assert excess.max().item() <= 0, f"off by {excess.max().item():.3g} beyond the bound"


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LAYER_SHAPES)
@pytest.mark.parametrize("bits,group,factored", [(4, 32, False), (8, 32, False), (8, 16, False),
                                                 (4, 32, True), (8, 16, True)])
@pytest.mark.parametrize("m", [1, 4, 16, 64, 300])
def test_gpu_quant_linear_8b_shapes(n: int, k: int, bits: int, group: int, factored: bool,
                                    m: int) -> None:
    w = random_qweight(n, k, bits, group, seed=m, factored=factored)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    assert_bf16_close(linear.quant_linear(x, w), x, w.dequantize())


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LAYER_SHAPES + [(128256, 4096)])
@pytest.mark.parametrize("m", [1, 4, 64, 300])
def test_gpu_fp8_linear_8b_shapes(n: int, k: int, m: int) -> None:
    w = Fp8Weight.quantize(torch.randn(n, k, device=CUDA, dtype=torch.bfloat16) * 0.02)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    assert_bf16_close(linear.quant_linear(x, w), x, w.dequantize())


def assert_tight(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
    """got == x @ w^T (+ bias) (w: the reference's weights in x's dtype) up to the output's
    rounding and float32 summation: 2^-8 of |y| in bf16 (2^-22 in float32) plus 1e-4 of
    |x| @ |w|.
    At K = 4096 a swapped nibble pair or a wrong group's scale moves y by ~1.5% of |x| @ |w|
    (assert_bf16_close's 2% bound would pass it)."""
    expected = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    rel = 2.0**-8 if got.dtype == torch.bfloat16 else 2.0**-22
    bound = rel * expected.abs() + 1e-4 * F.linear(x.float().abs(), w.float().abs()) + 1e-6
    excess = (got.float() - expected).abs() - bound
    assert excess.max().item() <= 0, f"off by {excess.max().item():.3g} beyond the bound"


GEMV_VARIANTS = [dict(), dict(magic=False), dict(words=True), dict(words=True, magic=False),
                 dict(unpack="lop3"), dict(unpack="lop3", prefetch=True)]  # (lop3: 4-bit only)
GEMV_TILES = [(8, 512, 4), (16, 2048, 8), (32, 1024, 8)]  # narrow, wide, the sweep's middle
ODD_SHAPE = (1000, 768)  # no tile divides N, the K steps end ragged: the masked loads


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LAYER_SHAPES + [ODD_SHAPE])
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 16)])
@pytest.mark.parametrize("variant", range(len(GEMV_VARIANTS)))
def test_gpu_qgemv_variants_8b_shapes(n: int, k: int, bits: int, group: int,
                                      variant: int) -> None:
    w = random_qweight(n, k, bits, group, seed=variant, factored=True)
    ref = w.dequantize(dtype=torch.float32)  # the GEMV dequantizes in float32 registers
    x = torch.randn(1, k, device=CUDA, dtype=torch.bfloat16)
    for tiles in GEMV_TILES:
        cfg = QGemvConfig(*tiles, **GEMV_VARIANTS[variant])
        assert_tight(qgemv(x, w, config=cfg), x, ref)


CUDA_GEMV_CONFIGS = [CudaGemvConfig(1, 1, 1), CudaGemvConfig(1, 4, 4), CudaGemvConfig(2, 8, 2),
                     CudaGemvConfig(4, 2, 1), CudaGemvConfig(1, 2, 4), CudaGemvConfig(1, 8, 2),
                     CudaGemvConfig(2, 8, 1), CudaGemvConfig(1, 8, 2, 3)]  # (SHORT_K's cap)
# (bits, group, factored): Q4_K's form and Q4_1's; Q6_K's (factored groups of 16); Q8_0's
# (plain groups of 32: two 16-byte chunks per scale). Codes of the full 4- and 8-bit ranges.
CUDA_GEMV_FORMS = [(4, 32, False), (4, 32, True), (8, 16, True), (8, 32, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,bits,group,factored", [
    (n, k, *form) for n, k in LAYER_SHAPES + [(128256, 4096)] for form in CUDA_GEMV_FORMS]
    + [(1000, 768, 4, 32, True), (1000, 800, 4, 32, False), (48, 96, 4, 32, False),
       (16, 256, 4, 32, True), (1000, 768, 8, 16, True), (16, 256, 8, 16, True),
       (1000, 800, 8, 16, False), (1000, 800, 8, 32, False), (48, 96, 8, 32, False),
       (1000, 768, 8, 32, False)])
def test_gpu_cuda_gemv_matches_dequantize_then_matmul(n: int, k: int, bits: int, group: int,
                                                      factored: bool) -> None:
    """The tensor-core GEMV (cuda_gemv) on 4-bit and 8-bit codes at every 8B shape, the head,
    and shapes off its 16-row tiles (N) and off its steps (K: 800, 96, 768), one to eight
    rows with a bias, against the tight bound; row 0 of every row count equals the one-row
    product bit for bit (each MMA column sums on its own)."""
    assert cuda_gemv.available()
    w = random_qweight(n, k, bits, group, seed=n + k, factored=factored)
    ref = w.dequantize(dtype=torch.float32)
    x = torch.randn(cuda_gemv.MAX_ROWS, k, device=CUDA, dtype=torch.bfloat16)
    bias = torch.randn(n, device=CUDA, dtype=torch.bfloat16)
    configs = [cfg for cfg in CUDA_GEMV_CONFIGS if 16 * cfg.tiles <= n]
    cuda_gemv.compile_ahead([(cfg, m, w) for cfg in configs for m in (1, 2, 3, 5, 8)],
                            x.device)  # (35 compiles in parallel, not one after the other)
    for cfg in configs:
        one = cuda_gemv.mma_gemv(x[:1], w, bias, config=cfg)
        for m in (2, 3, 5, 8):
            got = cuda_gemv.mma_gemv(x[:m], w, bias, config=cfg)
            assert_tight(got, x[:m], ref, bias)
            assert torch.equal(one[0], got[0]), (cfg, m)


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 16)])
def test_gpu_quant_linear_routes_one_to_eight_rows_to_the_cuda_gemv(
        bits: int, group: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """quant_linear sends 1..MAX_ROWS bf16 rows to the CUDA GEMV with its default configs (the
    table by rows) and gives its answer, within the tight bound; with linear.CUDA_GEMV off,
    the Triton route's (from three rows the tiled kernel: bf16 weight tiles, the loose
    bound)."""
    w = random_qweight(4096, 4096, bits, group, factored=True)
    ref = w.dequantize(dtype=torch.float32)
    for m in range(1, cuda_gemv.MAX_ROWS + 1):
        x = torch.randn(m, 4096, device=CUDA, dtype=torch.bfloat16)
        got = linear.quant_linear(x, w)
        assert torch.equal(got, cuda_gemv.mma_gemv(x, w)), m
        assert_tight(got, x, ref)
        monkeypatch.setattr(linear, "CUDA_GEMV", False)
        assert_bf16_close(linear.quant_linear(x, w), x, ref)
        monkeypatch.setattr(linear, "CUDA_GEMV", True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_cuda_gemv_early_launch_reads_the_inputs_of_the_kernel_before(
        m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda_gemv.EARLY_LAUNCH: the GEMV may start while the RMSNorm that writes its input is
    running (it lets the next kernel launch as it starts) and must wait before reading x: in a
    CUDA graph of RMSNorm -> GEMV, each replay on new hidden states gives the products of the
    normalized rows, bit for bit those of the normal launch."""
    from sgl.backend.kernels.triton_rmsnorm import rmsnorm_triton

    monkeypatch.setattr(cuda_gemv, "EARLY_LAUNCH", True)
    w = random_qweight(28672, 4096, 4, 32, factored=True)
    norm = torch.rand(4096, device=CUDA, dtype=torch.bfloat16) + 0.5
    hidden = torch.randn(m, 4096, device=CUDA, dtype=torch.bfloat16)
    cuda_gemv.mma_gemv(rmsnorm_triton(hidden, norm), w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_gemv.mma_gemv(rmsnorm_triton(hidden, norm), w)
    for _ in range(3):
        hidden.copy_(torch.randn(m, 4096, device=CUDA, dtype=torch.bfloat16) * 3)
        graph.replay()
        monkeypatch.setattr(cuda_gemv, "EARLY_LAUNCH", False)
        expected = cuda_gemv.mma_gemv(rmsnorm_triton(hidden, norm), w)
        monkeypatch.setattr(cuda_gemv, "EARLY_LAUNCH", True)
        assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LAYER_SHAPES + [ODD_SHAPE])
@pytest.mark.parametrize("decode", ["bits", "sext", "cvt", "words"])
def test_gpu_fp8_gemv_decodes_8b_shapes(n: int, k: int, decode: str) -> None:
    w = Fp8Weight.quantize(torch.randn(n, k, device=CUDA) * 0.02)
    ref = w.dequantize(torch.float32)  # e4m3 times the row's float32 scale, not rounded
    x = torch.randn(1, k, device=CUDA, dtype=torch.bfloat16)
    tiles = GEMV_TILES + ([(2, 1024, 1), (4, 2048, 2), (16, 512, 2)] if decode == "words" else [])
    for tile in tiles:
        cfg = QGemvConfig(*tile, fp8_decode=decode)
        assert_tight(fp8_gemv(x, w.weight, w.scale, config=cfg), x, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LAYER_SHAPES)
@pytest.mark.parametrize("kind", ["q4", "q8g16", "fp8"])
@pytest.mark.parametrize("weight_as_a", [False, True])
@pytest.mark.parametrize("m", [2, 16, 37, 64, 256])
def test_gpu_tiled_kernels_8b_shapes(n: int, k: int, kind: str, weight_as_a: bool,
                                     m: int) -> None:
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    if kind == "fp8":
        w8 = Fp8Weight.quantize(torch.randn(n, k, device=CUDA) * 0.02)
        cfg = gemm_config(m, n, k, kind="fp8")._replace(weight_as_a=weight_as_a)
        # (e4m3 is exact in bf16; the row scale multiplies the float32 sum)
        assert_tight(fp8_gemm(x, w8.weight, w8.scale, config=cfg), x,
                     w8.dequantize(torch.float32))
        return
    bits, group = (4, 32) if kind == "q4" else (8, 16)
    w = random_qweight(n, k, bits, group, seed=m, factored=True)
    cfg = gemm_config(m, n, k, group, linear.weight_kind(w))._replace(weight_as_a=weight_as_a)
    assert_tight(qgemm(x, w, config=cfg), x, w.dequantize(dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("weight_as_a", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_tiled_rows_do_not_depend_on_the_row_count(weight_as_a: bool,
                                                       dtype: torch.dtype) -> None:
    """For one config, row r of an M-row product is bit for bit the same for every M > r
    (1..40: every tail of a 16-, 32- and 64-row tile, 37 included): a masked row or a tail
    tile that leaks into the others shows here, on any data."""
    w = random_qweight(4096, 4096, 4, 32, seed=37, factored=True)
    w8 = Fp8Weight.quantize(torch.randn(4096, 4096, device=CUDA) * 0.02)
    x = torch.randn(40, 4096, device=CUDA, dtype=dtype)
    for block_m in (16, 32, 64):
        cfg = GemmConfig(block_m, 64, 128, 4, 3, weight_as_a)
        full = qgemm(x, w, config=cfg)
        full8 = fp8_gemm(x, w8.weight, w8.scale, config=cfg)
        assert_tight(full, x, w.dequantize(dtype=dtype))
        for m in range(1, 40):
            assert torch.equal(qgemm(x[:m], w, config=cfg), full[:m]), (block_m, m)
            assert torch.equal(fp8_gemm(x[:m], w8.weight, w8.scale, config=cfg), full8[:m])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_tiled_kernel_on_the_real_models_weights(dtype: torch.dtype) -> None:
    """The default model's (or SGL_TEST_MODEL's) quantized weights, every Linear of the
    first and last layers and the head: the tiled kernel at every row count 1..40, both
    orientations, against the reference."""
    model, _ = load_model(_model(), device="cuda", dtype=dtype, quantization="gguf")
    layers = [m for m in model.modules() if hasattr(m, "qweight") and m.qweight is not None]
    chosen = [m.qweight for m in layers[:5] + layers[-5:]
              if isinstance(m.qweight, QuantizedWeight)]
    assert chosen
    for w in chosen:
        n, k = w.shape
        ref = w.dequantize(dtype=dtype)
        x = torch.randn(40, k, device=CUDA, dtype=dtype)
        for m in range(1, 41):
            for weight_as_a in (False, True):
                cfg = gemm_config(m, n, k, w.group_size, linear.weight_kind(w))._replace(
                    weight_as_a=weight_as_a)
                assert_tight(qgemm(x[:m], w, config=cfg), x[:m], ref)


@pytest.mark.gpu
def test_gpu_move_factors_k_quant_scales_exactly() -> None:
    from test_quant_formats import random_blocks

    from sgl.backend.quant import decode

    for fmt, factored in (("Q4_K", True), ("Q6_K", True), ("Q4_1", False), ("Q3_K", True),
                          ("IQ4_XS", True), ("Q5_0", False)):
        raw = torch.from_numpy(random_blocks(fmt, 40, 512, seed=1))
        host = QuantizedWeight.from_decoded(decode(fmt, raw, 512), fmt)
        dev = host.to(CUDA)
        assert bool(dev.super_groups) == factored and dev.codes.is_cuda
        assert torch.equal(dev.dequantize().cpu(), host.dequantize())
        assert torch.equal(dev.to("cpu").scale, host.scale)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_gpu_every_format_multiplies_as_its_reference(fmt: str) -> None:
    """Each GGUF format, moved to the GPU as the loader moves it, through quant_linear at the
    row counts of each route (1-8 rows: the CUDA GEMV; 17 and 300: Triton), with bf16
    activations, against float32 dequantize-then-matmul."""
    from test_quant_formats import random_blocks

    from sgl.backend.quant import decode

    raw = torch.from_numpy(random_blocks(fmt, 48, 1024, seed=3))
    w = QuantizedWeight.from_decoded(decode(fmt, raw, 1024), fmt).to(CUDA)
    ref = w.dequantize(dtype=torch.float32)
    for m in (1, 2, 5, 8, 17, 300):
        x = torch.randn(m, 1024, device=CUDA, dtype=torch.bfloat16)
        assert_bf16_close(linear.quant_linear(x, w), x, ref)


# Split-K (QGemvConfig.split_k, quant/triton_split.py): slices x reductions on wide tiles.
SPLIT_CONFIGS = [QGemvConfig(32, 512, 4, split_k=s, split_reduce=r, unpack=u, prefetch=p)
                 for s, u, p in ((2, "bytes", False), (8, "bytes", False), (4, "lop3", True))
                 for r in ("kernel", "last")]  # (pairs: kernel, last; lop3: 4-bit codes only)


def split_case(kind: str, n: int, k: int, seed: int = 0):
    """(gemv(x, config) -> y, the float32 reference weight) of a random `kind` weight."""
    if kind == "fp8":
        w8 = Fp8Weight.quantize(torch.randn(n, k, device=CUDA) * 0.02)
        return (lambda x, cfg: fp8_gemv(x, w8.weight, w8.scale, config=cfg),
                w8.dequantize(torch.float32))
    bits, group = (4, 32) if kind == "q4" else (8, 16)
    w = random_qweight(n, k, bits, group, seed=seed, factored=True)
    return (lambda x, cfg: qgemv(x, w, config=cfg)), w.dequantize(dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LAYER_SHAPES + [ODD_SHAPE])
@pytest.mark.parametrize("kind", ["q4", "q8g16", "fp8"])
def test_gpu_split_k_gemv_8b_shapes(n: int, k: int, kind: str) -> None:
    """Both reductions at 2 and 8 slices against the reference (tight bound), one row; the
    two reductions bit for bit equal (the same partials added in the same order), and the
    same bits on every run (no float atomics). More rows: the test after the next."""
    run, ref = split_case(kind, n, k, seed=n)
    x = torch.randn(1, k, device=CUDA, dtype=torch.bfloat16)
    for i in range(0, len(SPLIT_CONFIGS), 2):
        by_kernel, by_last = SPLIT_CONFIGS[i], SPLIT_CONFIGS[i + 1]
        y = run(x, by_kernel)
        assert_tight(y, x, ref)
        for _ in range(3):
            assert torch.equal(run(x, by_last), y), by_last
            assert torch.equal(run(x, by_kernel), y), by_kernel


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["q4", "fp8"])
def test_gpu_split_k_last_slice_reduction_under_load(kind: str) -> None:
    """The one-launch reduction reads the other programs' partials once the tile's counter
    says they are all stored: on the LM head's 128,256 rows (8,016 tiles x 8 slices racing
    for their counters), 20 runs each equal bit for bit to the two-launch reduction."""
    n, k = 128256, 4096
    run, ref = split_case(kind, n, k, seed=1)
    x = torch.randn(1, k, device=CUDA, dtype=torch.bfloat16)
    cfg = QGemvConfig(16, 512, 4, split_k=8, split_reduce="kernel")
    expected = run(x, cfg)
    assert_tight(expected, x, ref)
    last = cfg._replace(split_reduce="last")
    for i in range(20):
        assert torch.equal(run(x, last), expected), i


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["q4", "fp8"])
def test_gpu_split_k_tiles_last_slice_reduction_under_load(kind: str) -> None:
    """The tiled kernels' one-launch reduction (GemmConfig.split_k): gate_up's 28,672 rows at
    16 rows of x (448 tiles x 4 slices racing for their counters), 20 runs each equal bit for
    bit to the two-launch reduction, and that within the tight bound."""
    n, k = 28672, 4096
    x = torch.randn(16, k, device=CUDA, dtype=torch.bfloat16)
    cfg = GemmConfig(16, 64, 128, 4, 3, False, split_k=4, split_reduce="kernel")
    if kind == "fp8":
        w8 = Fp8Weight.quantize(torch.randn(n, k, device=CUDA) * 0.02)
        run = lambda c: fp8_gemm(x, w8.weight, w8.scale, config=c)  # noqa: E731
        ref = w8.dequantize(torch.float32)
    else:
        w = random_qweight(n, k, 4, 32, seed=2, factored=True)
        run = lambda c: qgemm(x, w, config=c)  # noqa: E731
        ref = w.dequantize(dtype=torch.bfloat16)
    expected = run(cfg)
    assert_tight(expected, x, ref)
    last = cfg._replace(split_reduce="last")
    for i in range(20):
        assert torch.equal(run(last), expected), i


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["q4", "fp8"])
def test_gpu_split_k_rows_do_not_depend_on_the_row_count(kind: str) -> None:
    """Row r of an M-row split product is bit for bit the same for M = r+1..5, and M = 5 is
    within the tight bound."""
    run, ref = split_case(kind, 4096, 4096, seed=5)
    x = torch.randn(5, 4096, device=CUDA, dtype=torch.bfloat16)
    for cfg in SPLIT_CONFIGS:
        full = run(x, cfg)
        assert_tight(full, x, ref)
        for m in range(1, 5):
            assert torch.equal(run(x[:m], cfg), full[:m]), (cfg, m)


TILED_ROUTES = {kind: ((1, "gemv"), (1024, "gemm")) for kind in ("q4", "q8", "fp8")}


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 37, 64])
@pytest.mark.parametrize("tiled", [False, True])
def test_gpu_quantized_linears_replay_in_cuda_graphs(m: int, tiled: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if tiled:
        monkeypatch.setattr(linear, "CUDA_ROUTES", TILED_ROUTES)
    assert_replays_equal_eager(m, replays=1)


def assert_replays_equal_eager(m: int, replays: int) -> None:
    """quant_linear on four weights (4-bit plain and factored, 8-bit/16, FP8) captured in one
    CUDA graph: each replay, on new inputs, gives the eager results bit for bit."""
    weights = [random_qweight(6144, 4096, 4, 32), random_qweight(4096, 4096, 8, 16),
               random_qweight(6144, 4096, 4, 32, factored=True),
               Fp8Weight.quantize(torch.randn(4096, 4096, device=CUDA) * 0.02)]
    static_x = torch.randn(m, 4096, device=CUDA, dtype=torch.bfloat16)
    for w in weights:
        linear.quant_linear(static_x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [linear.quant_linear(static_x, w) for w in weights]
    for _ in range(replays):
        static_x.copy_(torch.randn(m, 4096, device=CUDA, dtype=torch.bfloat16))
        graph.replay()
        for w, out in zip(weights, outs):
            assert torch.equal(out, linear.quant_linear(static_x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("split", ["kernel", "last"])
def test_gpu_split_k_gemvs_replay_in_cuda_graphs(m: int, split: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """As above with every GEMV default cutting K into 4 slices: the partials come from the
    graph's pool; with "last" the tile counters, zeroed again by every launch, serve the next
    replay (three replays, each equal to eager)."""
    monkeypatch.setattr(linear, "CUDA_ROUTES", {k: ((2, "gemv"),) for k in ("q4", "q8", "fp8")})
    monkeypatch.setattr(linear, "CUDA_GEMV", False)  # the Triton GEMV's split-K
    for kind in ("q4", "q8", "fp8"):
        monkeypatch.setitem(triton_gemv.GEMV_DEFAULTS, kind, (
            (1 << 62, QGemvConfig(32, 512, 4, split_k=4, split_reduce=split)),))
    assert_replays_equal_eager(m, replays=3)


def _model() -> str | None:
    return os.environ.get("SGL_TEST_MODEL") or None


async def _greedy(options: dict[str, object], prompts: int = 6,
                  new_tokens: int = 48) -> tuple[list[list[int]], list[list[int]], int]:
    from test_engine_real import build_prompts

    # (the default model, or SGL_TEST_MODEL: a device without network has the file there)
    async with sgl.Engine(_model(), device="cuda", max_total_tokens=8192, **options) as engine:
        batch = build_prompts(engine)[:prompts]
        outs = [await engine.generate(p, max_new_tokens=new_tokens, temperature=0)
                for p in batch]
        return batch, [o.token_ids for o in outs], engine.stats().weights_bytes


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_gguf_engine_matches_the_float_path() -> None:
    """float32 activations on both sides, so the only difference is where the dequantized
    weights are computed (in the kernels vs once at load): token for token or at a tie."""
    from test_engine_real import assert_same_or_tie

    prompts, floats, float_bytes = await _greedy(dict(quantization="none", dtype="float32"))
    _, quant, quant_bytes = await _greedy(dict(quantization="gguf", dtype="float32"))
    assert quant_bytes < float_bytes // 4  # the file's precision, on the GPU
    if quant != floats:
        from sgl.backend.reference import load_reference_model

        model = load_reference_model(_model())
        for prompt, expected, got in zip(prompts, floats, quant):
            assert_same_or_tie(model, prompt, expected, got)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_gguf_engine_through_the_tiled_kernel_matches_the_float_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As above with every multi-row product (the prompts' eager prefills, 37 tokens among
    them on the default model) through the tiled kernel instead of the scratch."""
    from test_engine_real import assert_same_or_tie

    prompts, floats, _ = await _greedy(dict(quantization="none", dtype="float32"))
    monkeypatch.setattr(linear, "CUDA_ROUTES", TILED_ROUTES)
    _, quant, _ = await _greedy(dict(quantization="gguf", dtype="float32"))
    if quant != floats:
        from sgl.backend.reference import load_reference_model

        model = load_reference_model(_model())
        for prompt, expected, got in zip(prompts, floats, quant):
            assert_same_or_tie(model, prompt, expected, got)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("quantization", ["gguf", "fp8"])
async def test_gpu_quantized_engine_graphs_equal_eager(quantization: str) -> None:
    """bf16: the CUDA-graph decode (replayed kernels) gives the eager engine's tokens."""
    _, graphs, _ = await _greedy(dict(quantization=quantization), prompts=4, new_tokens=32)
    _, eager, _ = await _greedy(dict(quantization=quantization, disable_cuda_graph=True),
                                prompts=4, new_tokens=32)
    assert graphs == eager


FP8_TINY = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=4608, vocab_size=8192,
                max_position_embeddings=2048, eos_token_id=0, tie_word_embeddings=False)


def tiny_tokens(early: bool, quantization: str, new_tokens: list[int],
                **options: object) -> list[list[int]]:
    """Greedy tokens of a dummy FP8_TINY-shaped engine, one request per entry of
    `new_tokens` (all at once), with every early launch on or off (the Triton kernels' PDL
    switch and cuda_gemv.EARLY_LAUNCH)."""
    import asyncio

    from sgl.backend.kernels.triton_compat import PDL_SWITCH

    shipped = PDL_SWITCH[0], cuda_gemv.EARLY_LAUNCH
    PDL_SWITCH[0] = cuda_gemv.EARLY_LAUNCH = early
    try:
        e = sgl.Engine(model_config=FP8_TINY, load_format="dummy", device="cuda",
                       quantization=quantization, max_total_tokens=8192, **options)
        try:
            head = e._rt.runner.model.lm_head.qweight  # (untied: the head is quantized too)
            assert isinstance(head, Fp8Weight if quantization == "fp8" else QuantizedWeight)

            async def run() -> list[list[int]]:
                outs = await asyncio.gather(*(
                    e.generate(input_ids=[1 + i, 7, 300 + 5 * i], max_new_tokens=n,
                               temperature=0, ignore_eos=True)
                    for i, n in enumerate(new_tokens)))
                return [o.token_ids for o in outs]

            return asyncio.run(run())
        finally:
            e.close()
    finally:
        PDL_SWITCH[0], cuda_gemv.EARLY_LAUNCH = shipped


@pytest.mark.gpu
@pytest.mark.parametrize("quantization,new_tokens", [("fp8", [12, 12, 12]), ("gguf", [12, 5])])
def test_gpu_engine_early_launches_change_no_token(quantization: str,
                                                   new_tokens: list[int]) -> None:
    """Early launches (PDL, kernels/triton_compat.py; cuda_gemv.EARLY_LAUNCH) change when
    the GEMVs start, never what they read: a dummy model decodes the same greedy tokens with
    early launches in its CUDA graphs, without them, and eagerly. FP8 (untied FP8 head; both
    GEMV kernels: N <= 4096 and above) and random 4-bit weights (two requests, then one: the
    CUDA GEMV at two rows and at one)."""
    early = tiny_tokens(True, quantization, new_tokens)
    assert tiny_tokens(False, quantization, new_tokens) == early
    assert tiny_tokens(True, quantization, new_tokens, disable_cuda_graph=True) == early
