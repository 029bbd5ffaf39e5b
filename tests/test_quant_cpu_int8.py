"""Integer-activation products (backend/quant/cpu_int8.c, `activation_quantization="int8"`):
the C kernel against its pure-torch reference (same quantized input bit for bit, same result up
to float32 summation order) on random blocks of every format and odd shapes; the error against
the float product within the bound the input rounding allows; the routing in quant_linear; the
one-call decode step bitwise equal to the op path with the option on; and the option's checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_attention_torch import Step
from test_cpu_layer import _decode_both_ways, _pool, _prefill, tiny_quantized
from test_quant_kernels import weight

from sgl.backend.quant import FORMATS, QuantizedWeight, cpu_kernel, cpu_layer
from sgl.backend.quant.cpu_int8 import (int8_linear, int8_linear_reference, kernel_order,
                                        quantize_rows, quantize_rows_reference,
                                        use_int8_activations)
from sgl.backend.quant.linear import INT8_MAX_ROWS, quant_linear
from sgl.config import EngineConfig
from sgl.errors import InvalidConfigError

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(),
                                  reason="no C compiler or no AVX2/FMA: no int8 kernel")

ROWS = [1, 2, 3, 4, 5, 8, 17, 40, 70]  # the tile shapes (1 row; 2-feature tiles of 1..4 rows)
# and a second 64-row chunk


def plain_weight(bits: int, group: int, n: int, k: int, seed: int) -> QuantizedWeight:
    """Random codes of any (bits, group) with nonzero zeros, for shapes no GGUF block makes
    (an odd number of 16- or 32-groups: the kernel's trailing group)."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    zero = torch.randn(n, k // group, generator=gen) * 0.05
    return QuantizedWeight(codes, scale, zero, bits, group, k, "test")


def cases() -> list[tuple[str, QuantizedWeight]]:
    """Every GGUF format (odd N), plus the odd group counts of both code widths."""
    out = []
    for fmt in sorted(FORMATS):
        n, k = (37, 96) if FORMATS[fmt][0] == 32 else (21, 512)
        out.append((fmt, weight(fmt, n, k, seed=len(fmt))))
    out.append(("4-bit/32, 3 groups", plain_weight(4, 32, 19, 96, 1)))
    out.append(("8-bit/16, 3 groups", plain_weight(8, 16, 19, 48, 2)))
    out.append(("8-bit/16, 36 groups", plain_weight(8, 16, 23, 576, 3)))
    return out


CASES = cases()


def sum_order_bound(x: torch.Tensor, w: QuantizedWeight, b: torch.Tensor | None) -> torch.Tensor:
    """1e-5 of the sum of the magnitudes of the reference's terms: how far float32 summation
    order can move the result (the result itself may cancel to ~0)."""
    m, k = x.shape
    gs = w.group_size
    qx, dx, xsum = quantize_rows_reference(x, gs)
    codes = w.integer_codes().long().view(w.out_features, k // gs, gs)
    idot = torch.einsum("mgi,ngi->mng", qx.long().abs().view(m, k // gs, gs), codes.abs())
    scale, zero = w.group_scales()
    terms = ((idot.float() * dx[:, None, :] * scale.abs()[None]).sum(-1)
             + xsum.abs() @ zero.abs().t())  # [M, N]
    return 1e-5 * (terms + (0 if b is None else b.abs())) + 1e-6


@needs_kernel
@pytest.mark.parametrize("name,w", CASES, ids=[c[0] for c in CASES])
def test_quantized_input_equals_the_reference_bit_for_bit(name: str, w: QuantizedWeight) -> None:
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 3, 40):
        x = torch.randn(rows, w.in_features, generator=gen) * 3
        x[0, : w.group_size] = 0.0  # an all-zero group: scale 0, codes 0
        qx, dx, xsum = quantize_rows(x, w.bits, w.group_size)
        ref_q, ref_d, ref_sum = quantize_rows_reference(x, w.group_size)
        assert torch.equal(qx, kernel_order(ref_q, w.bits, w.group_size)), name
        assert torch.equal(dx, ref_d), name
        assert torch.allclose(xsum, ref_sum, rtol=1e-5, atol=1e-5), name
        assert ref_q.abs().max() <= 127 and (ref_q.abs() == 127).any()  # max-abs maps to 127


@needs_kernel
@pytest.mark.parametrize("name,w", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_its_reference(name: str, w: QuantizedWeight, rows: int,
                                      bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, w.in_features, generator=gen)
    b = torch.randn(w.out_features, generator=gen) if bias else None
    got, expected = int8_linear(x, w, b), int8_linear_reference(x, w, b)
    excess = (got - expected).abs() - sum_order_bound(x, w, b)
    assert excess.max().item() <= 0, f"{name}: off by {excess.max().item():.3g} beyond the bound"


@needs_kernel
@pytest.mark.parametrize("name,w", CASES, ids=[c[0] for c in CASES])
def test_error_against_the_float_product_is_the_input_rounding(name: str,
                                                                w: QuantizedWeight) -> None:
    """Each input value moves by at most half its group's step dx / 2, so the scale term moves
    by at most sum_k |scale * code| * dx / 2; the zero term is exact. (A kernel that got a
    group's order or scale wrong would be off by far more.)"""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(17, w.in_features, generator=gen)
    m, k, gs = x.shape[0], w.in_features, w.group_size
    _, dx, _ = quantize_rows_reference(x, gs)
    scale, _ = w.group_scales()
    codes = w.integer_codes().float().abs().view(w.out_features, k // gs, gs).sum(-1)  # [N, G]
    bound = (dx / 2) @ (scale.abs() * codes).t() * 1.001 + 1e-4  # [M, N]
    error = (int8_linear(x, w, None) - F.linear(x, w.dequantize())).abs()
    assert (error <= bound).all(), f"{name}: error {error.max():.3g} beyond the rounding bound"
    assert error.max() > 0  # (it is an approximation: identical would mean float ran)


@needs_kernel
def test_thread_count_does_not_change_the_bits() -> None:
    w = weight("Q4_1", 150, 576)
    x = torch.randn(70, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = int8_linear(x, w, None)
        torch.set_num_threads(3)
        assert torch.equal(int8_linear(x, w, None), alone)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_quant_linear_routes_marked_weights_by_rows() -> None:
    w = weight("Q4_1", 40, 96)
    marked = dataclasses.replace(w, int8_activations=True)
    for rows in (1, 16, INT8_MAX_ROWS):
        x = torch.randn(2, rows, 96)  # [batch, seq, K]: leading dims are flattened
        flat = x.reshape(-1, 96)
        if flat.shape[0] > INT8_MAX_ROWS:
            continue
        assert torch.equal(quant_linear(x, marked).reshape(-1, 40), int8_linear(flat, w, None))
    x = torch.randn(INT8_MAX_ROWS + 1, 96)  # prefill: the float path (exact up to sum order)
    assert torch.equal(quant_linear(x, marked), quant_linear(x, w))
    x = torch.randn(3, 96)  # an unmarked weight never quantizes its input
    assert not torch.equal(quant_linear(x, w), int8_linear(x, w, None))


@needs_kernel
@pytest.mark.parametrize("name", ["llama-tied", "llama-8bit", "qwen2-bias"])
def test_one_call_step_with_int8_equals_the_op_path_bitwise(name: str) -> None:
    """The decode step reads the mark per weight: with it, the one-call step and the op path
    (quant_linear -> int8_linear) run the same kernel on the same blocks, so the same bits; a
    step that ignored the mark would compute float products and differ."""
    model = tiny_quantized(name)
    assert use_int8_activations(model) == len(
        [m for m in model.modules() if isinstance(getattr(m, "qweight", None), QuantizedWeight)])
    model.model.cpu_decode = cpu_layer.CpuDecodeStep.build(model.model)
    assert model.model.cpu_decode is not None
    model.model.cpu_decode.thread_choice.threads = lambda cap: cap  # (no timing trial)
    pool = _pool(model)
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 37, 12]
    _prefill(model, pool, [torch.randint(0, 96, (n,), generator=gen).tolist() for n in lengths])
    for step in range(3):
        _decode_both_ways(model, pool, [Step(i, lengths[i] + step, [(7 * step + i) % 96])
                                        for i in range(3)])


@pytest.mark.parametrize("options,field", [
    (dict(device="cuda"), "device='cpu'"),
    (dict(quantization="none"), "quantization='none'"),
    (dict(quantization="fp8", device="cuda"), "CPU kernel"),
    (dict(dtype="bfloat16"), "float32"),
])
def test_config_refuses_int8_where_it_cannot_apply(options: dict[str, str], field: str) -> None:
    with pytest.raises(InvalidConfigError, match="activation_quantization") as info:
        EngineConfig(activation_quantization="int8", **options)
    assert field in str(info.value)


def test_resolution_refuses_int8_on_float_weights() -> None:
    """"auto" quantization that resolves to float weights (a dummy model without
    quantization="gguf") is refused before loading, not silently run on floats."""
    from sgl.backend.runtime import resolve_device

    with pytest.raises(InvalidConfigError, match="not kept quantized"):
        resolve_device(EngineConfig(model="smollm2-135m", device="cpu",
                                    activation_quantization="int8"))
    resolved = resolve_device(EngineConfig(model="smollm2-135m", device="cpu",
                                           quantization="gguf", activation_quantization="int8"))
    assert resolved.quantization == "gguf"
    assert EngineConfig().activation_quantization == "auto"
    default = resolve_device(EngineConfig(model="smollm2-135m", device="cpu", quantization="gguf"))
    assert default.activation_quantization == "none"  # (float activations on the CPU)


def test_a_model_folder_is_refused(tmp_path: pytest.TempPathFactory) -> None:
    from sgl.backend.quant.policy import check_activation_quantization

    folder = tmp_path / "model"  # type: ignore[operator]
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    config = EngineConfig(model=str(folder), device="cpu", activation_quantization="int8")
    with pytest.raises(InvalidConfigError, match="model folder"):
        check_activation_quantization(config)


@needs_kernel
@pytest.mark.anyio
async def test_engine_runs_int8_on_a_dummy_quantized_model() -> None:
    import sgl

    async with sgl.Engine(model="smollm2-135m", device="cpu", quantization="gguf",
                          activation_quantization="int8", max_total_tokens=512,
                          model_config={"num_hidden_layers": 2}) as engine:
        out = await engine.generate([1, 2, 3, 4], max_new_tokens=4, temperature=0)
        assert len(out.token_ids) == 4
        marks = [m.qweight.int8_activations for m in engine._rt.runner.model.modules()
                 if isinstance(getattr(m, "qweight", None), QuantizedWeight)]
        assert marks and all(marks)  # every projection and the tied head
