"""Quantized and FP8 weights wired into the model, and on the GPU.

    python -m pytest -q tests/test_quant_gpu.py        (the `gpu` tests skip without CUDA)

On any machine: `quantization="fp8"` converts every Linear of a float load and nothing else;
a dummy model with `quantization="gguf"` gets random quantized weights in a Q4_K_M layout.
On CUDA: the quant_linear dispatcher at the 8B layer shapes on every path (GEMV, tiled,
scratch + cuBLAS) against dequantize-then-matmul, CUDA-graph replay against eager, and the
real default model kept quantized on the GPU against the same engine on its dequantized
float weights (token for token, with the tie rule of test_engine_real).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import sgl
from sgl.backend.layers.linear import Embedding, Linear
from sgl.backend.model_loader import load_model
from sgl.backend.quant import QuantizedWeight, linear
from sgl.backend.quant.factored import factor
from sgl.backend.quant.fp8 import Fp8Weight
from sgl.backend.quant.install import weight_bytes

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
    assert weight_bytes(fp8) < weight_bytes(floats)
    x = torch.randn(3, fp8.config.hidden_size)
    layer = fp8.model.layers[0].mlp.gate_up_proj
    torch.testing.assert_close(layer(x), F.linear(x, layer.qweight.dequantize()))


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


@pytest.mark.gpu
def test_gpu_move_factors_k_quant_scales_exactly() -> None:
    from test_quant_formats import random_blocks

    from sgl.backend.quant import decode

    for fmt, factored in (("Q4_K", True), ("Q6_K", True), ("Q4_1", False)):
        raw = torch.from_numpy(random_blocks(fmt, 40, 512, seed=1))
        host = QuantizedWeight.from_decoded(decode(fmt, raw, 512), fmt)
        dev = host.to(CUDA)
        assert bool(dev.super_groups) == factored and dev.codes.is_cuda
        assert torch.equal(dev.dequantize().cpu(), host.dequantize())
        assert torch.equal(dev.to("cpu").scale, host.scale)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64])
def test_gpu_quantized_linears_replay_in_cuda_graphs(m: int) -> None:
    weights = [random_qweight(6144, 4096, 4, 32), random_qweight(4096, 4096, 8, 16),
               random_qweight(6144, 4096, 4, 32, factored=True),
               Fp8Weight.quantize(torch.randn(4096, 4096, device=CUDA) * 0.02)]
    static_x = torch.randn(m, 4096, device=CUDA, dtype=torch.bfloat16)
    for w in weights:
        linear.quant_linear(static_x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [linear.quant_linear(static_x, w) for w in weights]
    static_x.copy_(torch.randn(m, 4096, device=CUDA, dtype=torch.bfloat16))
    graph.replay()
    for w, out in zip(weights, outs):
        assert torch.equal(out, linear.quant_linear(static_x, w))


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
@pytest.mark.parametrize("quantization", ["gguf", "fp8"])
async def test_gpu_quantized_engine_graphs_equal_eager(quantization: str) -> None:
    """bf16: the CUDA-graph decode (replayed kernels) gives the eager engine's tokens."""
    _, graphs, _ = await _greedy(dict(quantization=quantization), prompts=4, new_tokens=32)
    _, eager, _ = await _greedy(dict(quantization=quantization, disable_cuda_graph=True),
                                prompts=4, new_tokens=32)
    assert graphs == eager
