"""The CPU linear kernel (oneDNN on packed weights) against its reference, F.linear, and the
transform that packs a model (layers/linear.py:pack_for_cpu).

The kernel tests skip where this torch build has no oneDNN linear, but the first test asserts
it is there on x86-64 (CI's platform), so a regression cannot silently turn packing off.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sgl.backend.kernels import dispatch, onednn_linear
from sgl.backend.layers.linear import (
    Embedding,
    Linear,
    MergedLinear,
    pack_for_cpu,
    unpacked_state_dict,
)

CPU = torch.device("cpu")
KERNELS = dispatch.resolve_kernels("reference", CPU, torch.float32)  # the layers' unpacked path
needs_onednn = pytest.mark.skipif(not onednn_linear.available(CPU, torch.float32),
                                  reason="this torch build has no oneDNN linear")


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@pytest.mark.skipif(platform.machine() != "x86_64", reason="oneDNN packing is asserted on x86-64 only")
def test_onednn_linear_is_available_on_x86_64() -> None:
    """CI runs on x86-64: float32 packing must work there (every x86-64 CPU torch supports
    runs oneDNN's float32 matmul), and bfloat16 too where the CPU has native bf16 dot products."""
    assert onednn_linear.available(CPU, torch.float32), (
        "oneDNN linear unavailable on x86-64: the CPU engine would silently lose weight packing")
    if cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        assert onednn_linear.available(CPU, torch.bfloat16)


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 3, 32, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_reference(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 72, generator=gen)  # sizes off every block multiple
    b = torch.randn(200, generator=gen) if bias else None
    x = torch.randn(rows, 72, generator=gen)
    got = onednn_linear.packed_linear(x, onednn_linear.pack(w), b)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_packed_linear_takes_leading_dims_and_strided_input() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=gen)
    packed = onednn_linear.pack(w)
    x3 = torch.randn(2, 5, 40, generator=gen)
    torch.testing.assert_close(onednn_linear.packed_linear(x3, packed), F.linear(x3, w),
                               atol=1e-5, rtol=1e-5)
    xt = torch.randn(40, 6, generator=gen).t()  # [6, 40], not contiguous
    torch.testing.assert_close(onednn_linear.packed_linear(xt, packed), F.linear(xt, w),
                               atol=1e-5, rtol=1e-5)


@needs_onednn
@pytest.mark.skipif(not onednn_linear.available(CPU, torch.bfloat16), reason="no bf16 oneDNN")
def test_packed_linear_bfloat16() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=gen).bfloat16()
    x = torch.randn(7, 96, generator=gen).bfloat16()
    got = onednn_linear.packed_linear(x, onednn_linear.pack(w))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), atol=0.1, rtol=0.02)


@needs_onednn
def test_pack_for_cpu_swaps_weights_in_place_and_packs_the_head_as_a_copy() -> None:
    kw = {"kernels": KERNELS, "device": CPU, "dtype": torch.float32}
    model = torch.nn.ModuleDict({
        "qkv": MergedLinear(16, {"q": 8, "k": 4, "v": 4}, bias=True, **kw),
        "out": Linear(16, 16, bias=False, **kw),
        "embed": Embedding(50, 16, **kw),
    })
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(3, 16, generator=gen)
    ids = torch.tensor([0, 7, 49])
    before = {"qkv": model["qkv"](x), "out": model["out"](x), "head": model["embed"].project(x),
              "lookup": model["embed"](ids)}
    num_params = sum(p.numel() for p in model.parameters())
    plain_state = {k: v.clone() for k, v in model.state_dict().items()}

    pack_for_cpu(model, model["embed"], tied=True)

    assert model["qkv"].weight.is_mkldnn and model["out"].weight.is_mkldnn
    assert model["qkv"].weight.shape == (16, 16) and model["qkv"].bias is not None
    assert sum(p.numel() for p in model.parameters()) == num_params  # replaced, not added
    assert not model["embed"].weight.is_mkldnn  # the lookup still needs the plain table
    assert model["embed"].packed_projection is not None
    after = {"qkv": model["qkv"](x), "out": model["out"](x), "head": model["embed"].project(x),
             "lookup": model["embed"](ids)}
    for name, want in before.items():
        torch.testing.assert_close(after[name], want, atol=1e-5, rtol=1e-5, msg=name)
    unpacked = unpacked_state_dict(model)  # what copying the model elsewhere reads
    assert unpacked.keys() == plain_state.keys()
    for name, value in plain_state.items():
        assert not unpacked[name].is_mkldnn
        torch.testing.assert_close(unpacked[name], value, atol=0, rtol=0, msg=name)
    pack_for_cpu(model, None)  # packing twice leaves packed weights alone
    torch.testing.assert_close(model["out"](x), before["out"], atol=1e-5, rtol=1e-5)


@needs_onednn
def test_untied_head_is_packed_in_place() -> None:
    head = Embedding(50, 16, kernels=KERNELS, device=CPU, dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16, generator=torch.Generator().manual_seed(3)))
    x = torch.randn(4, 16)
    want = head.project(x)
    pack_for_cpu(torch.nn.Module(), head, tied=False)
    assert head.weight.is_mkldnn and head.packed_projection is None  # no second copy
    torch.testing.assert_close(head.project(x), want, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_kernel_set_packs_on_cpu_in_auto_mode_only() -> None:
    assert dispatch.resolve_kernels("auto", CPU, torch.float32).pack_linears
    assert not dispatch.resolve_kernels("auto", torch.device("cuda"), torch.bfloat16).pack_linears
    assert not dispatch.resolve_kernels("auto", CPU, torch.float16).pack_linears
    assert not dispatch.resolve_kernels("reference", CPU, torch.float32).pack_linears


@needs_onednn
@pytest.mark.parametrize("mode", ["auto", "reference"])
def test_engine_packs_its_cpu_model_unless_reference(mode: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from test_engine_core import make_engine

    monkeypatch.setenv("SGL_KERNELS", mode)
    with make_engine() as engine:  # (closing it frees the weights: look inside)
        model = engine._rt.runner.model
        out = engine.generate_sync(input_ids=[1, 2, 3], max_new_tokens=4, temperature=0)
        assert engine._rt.kernels.pack_linears == (mode == "auto")
        assert model.model.layers[0].self_attn.qkv_proj.weight.is_mkldnn == (mode == "auto")
        head = model.lm_head  # untied in this model: packed in place
        assert (head.weight.is_mkldnn or head.packed_projection is not None) == (mode == "auto")
    assert len(out.token_ids) == 4
