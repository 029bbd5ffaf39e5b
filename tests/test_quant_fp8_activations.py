"""W8A8 for FP8 weights (`activation_quantization="fp8"`, quant/fp8.py): each row of a
large product's input quantized to e4m3 with its own scale, multiplied on the FP8 tensor cores
(torch._scaled_mm, which also runs on the CPU, so the arithmetic is checked here on any
machine); the `gpu` tests check the routing and CUDA-graph replay on the device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sgl.backend.layers.linear import Linear
from sgl.backend.model_loader import load_model
from sgl.backend.quant import fp8, linear
from sgl.backend.quant.fp8 import (FP8_MAX, Fp8Weight, fp8_linear_reference, fp8_scaled_linear,
                                   fp8_scaled_linear_reference, quantize_rows,
                                   quantize_rows_reference, use_fp8_activations)
from sgl.backend.quant.policy import check_fp8_device, resolve_activation_quantization
from sgl.config import EngineConfig
from sgl.errors import InvalidConfigError

CUDA = torch.device("cuda")


def _weight(n: int, k: int, seed: int, device: torch.device | str = "cpu") -> Fp8Weight:
    gen = torch.Generator().manual_seed(seed)
    return Fp8Weight.quantize((torch.randn(n, k, generator=gen) * 0.02).to(device))


def test_quantize_rows_scales_each_row_by_its_amax() -> None:
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * torch.tensor(
        [[1.0], [1e-3], [0.0], [300.0], [7.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5, 1)
    amax = x.abs().amax(dim=1, keepdim=True)
    expected = torch.where(amax > 0, amax * torch.tensor(1 / FP8_MAX), torch.ones_like(amax))
    assert torch.equal(scale, expected)  # the zero row: scale 1, codes 0
    assert q[2].float().abs().max() == 0
    # each row's largest value lands on +-448 and every value within e4m3's half step (2^-4)
    assert torch.equal(q.float().abs().amax(dim=1)[[0, 1, 3, 4]], torch.full((4,), FP8_MAX))
    err = (q.float() * scale - x).abs()
    assert (err <= 2.0**-4 * x.abs() + 2.0**-9 * scale).all()


@pytest.mark.parametrize("m", [1, 3, 70])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rowwise", [True, False])
def test_scaled_linear_is_the_product_of_the_dequantized_operands(
        m: int, with_bias: bool, rowwise: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_scaled_linear = (q_x * s_x) @ (q_w * s_w)^T (+ b), up to float32 summation order and
    its bfloat16 output's rounding; a leading batch shape is kept. `rowwise=False`: the path of
    torch builds whose CPU `_scaled_mm` takes per-tensor scales only (2.11)."""
    if rowwise and not fp8._cpu_rowwise_scaled_mm():
        pytest.skip("this torch's CPU _scaled_mm takes per-tensor scales only")
    monkeypatch.setattr(fp8, "_cpu_rowwise_scaled_mm", lambda: rowwise)
    gen = torch.Generator().manual_seed(m)
    w = _weight(48, 256, seed=m)
    x = torch.randn(2, m, 256, generator=gen).to(torch.bfloat16)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16) if with_bias else None
    got = fp8_scaled_linear(x, w, bias)
    assert got.shape == (2, m, 48) and got.dtype == torch.bfloat16
    # (float32 x quantizes to the same codes and scales as its bfloat16 values)
    expected = fp8_scaled_linear_reference(x.float(), w, None if bias is None else bias.float())
    q, s = quantize_rows(x.reshape(-1, 256))
    magnitude = F.linear((q.float() * s).abs(), w.dequantize().abs()).view(2, m, 48)
    # the product's rounding to bfloat16, then (with a bias) the sum's
    rounding = 2.0**-8 * (expected.abs() + (0 if bias is None else (expected - bias.float()).abs()))
    assert ((got.float() - expected).abs() <= rounding + 1e-5 * magnitude + 1e-6).all()


def test_w8a8_is_close_to_the_weight_only_product_but_not_equal() -> None:
    """Rounding the input to e4m3 costs a few percent of the output (what the option trades
    for tensor-core speed), and it does change the output: the option is not a no-op."""
    gen = torch.Generator().manual_seed(7)
    w = _weight(256, 1024, seed=7)
    x = torch.randn(64, 1024, generator=gen)
    weight_only = fp8_linear_reference(x, w)
    w8a8 = fp8_scaled_linear(x, w).float()
    rel = (w8a8 - weight_only).norm() / weight_only.norm()
    assert 1e-3 < rel < 0.05, rel.item()


def test_use_fp8_activations_marks_the_linears_and_not_the_head() -> None:
    model, _ = load_model("smollm2-135m", device="cpu", dtype=torch.float32, seed=3,
                          model_config={"num_hidden_layers": 2, "tie_word_embeddings": False},
                          quantization="fp8")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert use_fp8_activations(model) == len(linears) > 0
    assert all(m.qweight.fp8_activations for m in linears)
    assert isinstance(model.lm_head.qweight, Fp8Weight) and not model.lm_head.qweight.fp8_activations


@pytest.mark.parametrize("options", [{}, dict(quantization="none"), dict(quantization="gguf")])
def test_fp8_activations_need_fp8_weights(options: dict[str, str]) -> None:
    with pytest.raises(InvalidConfigError, match="activation_quantization") as info:
        EngineConfig(activation_quantization="fp8", **options)
    assert "quantization='fp8'" in str(info.value)
    EngineConfig(activation_quantization="fp8", quantization="fp8", device="cuda")  # accepted


def test_fp8_weights_need_an_sm89_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 weights (their Triton e4m3 kernels, W8A8's FP8 tensor cores) are refused on a GPU
    older than compute capability 8.9 with what to use instead, before anything loads."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    check_fp8_device("fp8", cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    with pytest.raises(InvalidConfigError, match="capability 8.9 or later .* this one is 8.0: "
                                                 "use quantization='none'"):
        check_fp8_device("fp8", cuda)
    check_fp8_device("gguf", cuda)  # (4/8-bit codes: any GPU Triton runs on)
    check_fp8_device("fp8", torch.device("cpu"))  # (refused elsewhere: resolve_quantization)


def test_auto_activations_are_w8a8_under_fp8_weights_only() -> None:
    """"auto" (the default) resolves to SGLang's W8A8 under quantization="fp8" and to float
    activations under every other weight kind; an explicit choice is kept."""
    assert EngineConfig().activation_quantization == "auto"
    assert resolve_activation_quantization("auto", "fp8") == "fp8"
    for quantization in ("none", "gguf"):
        assert resolve_activation_quantization("auto", quantization) == "none"
    assert resolve_activation_quantization("none", "fp8") == "none"
    assert resolve_activation_quantization("int8", "gguf") == "int8"


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, fp8.W8A8_MIN_ROWS - 1, fp8.W8A8_MIN_ROWS, 65, 300])
def test_gpu_marked_weights_quantize_from_w8a8_min_rows(m: int) -> None:
    """Below W8A8_MIN_ROWS a marked weight runs the weight-only kernels (bit for bit what an
    unmarked one gives); from there on, the W8A8 product."""
    import dataclasses

    w = _weight(4096, 4096, seed=m, device=CUDA)
    marked = dataclasses.replace(w, fp8_activations=True)
    x = torch.randn(m, 4096, device=CUDA, dtype=torch.bfloat16)
    got = linear.quant_linear(x, marked)
    if m < fp8.W8A8_MIN_ROWS:
        assert torch.equal(got, linear.quant_linear(x, w))
    else:
        assert torch.equal(got, fp8_scaled_linear(x, w))
        expected = fp8_scaled_linear_reference(x, w).float()
        assert ((got.float() - expected).abs() <= 2.0**-7 * expected.abs() + 1e-3).all()


@pytest.mark.gpu
def test_gpu_w8a8_replays_in_cuda_graphs() -> None:
    import dataclasses

    w = dataclasses.replace(_weight(6144, 4096, seed=1, device=CUDA), fp8_activations=True)
    static = torch.randn(256, 4096, device=CUDA, dtype=torch.bfloat16)
    linear.quant_linear(static, w)  # warm up (cuBLASLt picks its kernel) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear.quant_linear(static, w)
    for seed in range(3):
        static.copy_(torch.randn(256, 4096, device=CUDA, dtype=torch.bfloat16,
                                 generator=torch.Generator(CUDA).manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, linear.quant_linear(static, w)), seed


@pytest.mark.gpu
def test_gpu_engine_with_fp8_activations_serves_a_large_batch() -> None:
    """80 requests decode in 80-row steps (W8A8 products, inside the decode graphs) and every
    one ends as asked."""
    import sgl

    engine = sgl.Engine(model="smollm2-135m", load_format="dummy", device="cuda",
                        quantization="fp8", activation_quantization="fp8", random_seed=1)
    try:
        outs = engine.generate_sync(input_ids=[[5 + i, 17, 3 + i] for i in range(80)],
                                    max_new_tokens=12, temperature=0, ignore_eos=True)
    finally:
        engine.close()
    assert [len(o.token_ids) for o in outs] == [12] * 80


@pytest.mark.gpu
@pytest.mark.parametrize("k", [576, 1000, 4096, 14336])
def test_gpu_row_quantization_kernel_equals_the_torch_ops(k: int) -> None:
    """The fused kernel (one read for the amax, one to quantize) gives the reference's scales
    and bytes: zero rows, rows of one large value, ties of the e4m3 rounding included."""
    gen = torch.Generator(CUDA).manual_seed(k)
    x = torch.randn(37, k, device=CUDA, generator=gen).to(torch.bfloat16)
    x[3] = 0
    x[5, 7] = 3e4
    x[6] = torch.arange(k, device=CUDA) % 17 * 0.5  # many values on e4m3 half steps
    q, s = quantize_rows(x)
    q_ref, s_ref = quantize_rows_reference(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
