"""The engine's kernel set: resolved once at load from SGL_KERNELS, held by every layer and the
attention backend, and on the CPU made of the very `*_reference` functions that
tests/test_kernels*.py check the Triton kernels against (in "reference" mode; "auto" swaps in
the fused C ops of backend/quant/cpu_ops.c where they build, each tested against those same
references in tests/test_quant_cpu_ops.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import pytest
import torch
from test_engine_core import make_engine

from sgl.backend.attention.torch_backend import TorchAttentionBackend
from sgl.backend.kernels import (
    activation,
    dispatch,
    gemv,
    onednn_linear,
    rmsnorm,
    rotary,
    triton_compat,
)
from sgl.backend.models.llama import _KERNEL_LAYERS
from sgl.backend.quant import cpu_ops
from sgl.errors import InvalidConfigError

# (module, function) of every reference a CPU forward pass calls
SPIED = [
    (rmsnorm, "rmsnorm_reference"),
    (rmsnorm, "fused_add_rmsnorm_reference"),
    (activation, "silu_and_mul_reference"),
    (rotary, "rotary_embedding_reference"),
    (gemv, "gemv_reference"),
]


def test_kernel_set_resolves_each_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    reference = dispatch._reference_ops()
    for mode in ("reference", " Reference "):  # the environment's spelling is normalized
        ks = dispatch.resolve_kernels(mode, cpu, torch.float32)
        assert ks.mode == "reference" and not ks.pack_linears and ks.attention == "torch"
        assert all(getattr(ks, op) is reference[op] for op in ks.ops())
    auto = dispatch.resolve_kernels("auto", cpu, torch.float32)
    assert auto.attention == "torch"
    assert auto.pack_linears == onednn_linear.available(cpu, torch.float32)
    fused = cpu_ops.kernel_set_ops() if cpu_ops.likely_available() else {}
    assert all(getattr(auto, op) is fused.get(op, reference[op]) for op in auto.ops()
               if op != "apply_token_bitmask")  # xgrammar's on the CPU, when installed
    # bfloat16 on the CPU: the C ops are float32 only, so the references serve
    cpu_bf16 = dispatch.resolve_kernels("auto", cpu, torch.bfloat16)
    assert all(getattr(cpu_bf16, op) is reference[op] for op in cpu_bf16.ops()
               if op != "apply_token_bitmask")
    on_gpu = dispatch.resolve_kernels("auto", cuda, torch.bfloat16)
    ops = dispatch._triton_ops() if triton_compat.HAS_TRITON else reference
    assert all(getattr(on_gpu, op) is ops[op] for op in on_gpu.ops())
    assert on_gpu.attention == ("triton" if triton_compat.HAS_TRITON else "torch")
    assert not on_gpu.pack_linears
    assert dispatch.resolve_kernels("reference", cuda, torch.bfloat16).attention == "torch"
    with pytest.raises(InvalidConfigError, match="'auto', 'reference' or 'triton'.*'bogus'"):
        dispatch.resolve_kernels("bogus", cpu, torch.float32)
    monkeypatch.setenv("SGL_KERNELS", "reference")  # the environment is the runtime's to read
    assert dispatch.resolve_kernels("auto", cpu, torch.float32).mode == "auto"


def test_kernel_set_pairs_every_triton_kernel_with_its_reference() -> None:
    """Each op's Triton kernel sits in `triton_<module>` beside its reference's module (apart,
    so that the CPU, which runs the references, never imports Triton)."""
    reference, triton = dispatch._reference_ops(), dispatch._triton_ops()
    assert set(reference) == set(triton) == set(dispatch.KernelSet.ops())
    for op in dispatch.KernelSet.ops():
        ref_module = reference[op].__module__
        assert triton[op].__module__ == ref_module.replace(".kernels.", ".kernels.triton_"), op
        assert reference[op].__name__.endswith("_reference"), op
        assert triton[op].__name__.endswith("_triton"), op


def _spy(calls: Counter[str], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return fn(*args, **kwargs)

    return counted


@pytest.mark.parametrize("mode", ["auto", "reference"])
def test_cpu_engine_runs_the_reference_functions(mode: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    calls: Counter[str] = Counter()
    for module, name in SPIED:
        monkeypatch.setattr(module, name, _spy(calls, name, getattr(module, name)))
    fused = mode == "auto" and cpu_ops.available()
    if fused:  # the C ops: spied under the reference names they replace
        for name in ("rmsnorm", "fused_add_rmsnorm", "silu_and_mul", "rotary_embedding"):
            monkeypatch.setattr(cpu_ops, name,
                                _spy(calls, f"{name}_reference", getattr(cpu_ops, name)))
    monkeypatch.setenv("SGL_KERNELS", mode)
    with make_engine() as engine:
        rt = engine._rt
        out = engine.generate_sync(input_ids=[1, 2, 3], max_new_tokens=4, temperature=0)
        model, forwards = rt.runner.model, rt.core.num_steps  # one forward pass per step
    assert len(out.token_ids) == 4 and forwards >= 4
    assert rt.kernels.mode == mode and model.kernels is rt.kernels
    layers = [m for m in model.modules() if isinstance(m, _KERNEL_LAYERS)]
    assert len(layers) > 10 and all(m.kernels is rt.kernels for m in layers)
    # Norms per forward: 2 layers x 2 plus the final one; all fused with the residual add but
    # the very first (the fused reference calls the plain one inside; the C op does not).
    assert calls["rmsnorm_reference"] == (1 if fused else 5) * forwards
    assert calls["fused_add_rmsnorm_reference"] == 4 * forwards
    assert calls["silu_and_mul_reference"] == 2 * forwards
    assert calls["rotary_embedding_reference"] == 2 * forwards
    # auto packs every linear for oneDNN (its fast path); reference runs F.linear itself
    # (4 linears per layer: qkv, o, gate_up, down; plus the LM head).
    assert calls["gemv_reference"] == (0 if mode == "auto" else (2 * 4 + 1) * forwards)
    assert isinstance(rt.runner.attn_backend, TorchAttentionBackend)


def test_engine_rejects_an_unknown_kernel_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGL_KERNELS", "fastest")
    with pytest.raises(InvalidConfigError, match="SGL_KERNELS.*'fastest'"):
        make_engine()


def test_triton_attention_needs_the_triton_kernel_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the set is the references: the Triton backend would silently run them."""
    monkeypatch.setenv("SGL_KERNELS", "auto")
    with pytest.raises(InvalidConfigError, match="attention_backend='triton'"):
        make_engine(attention_backend="triton")


def test_model_built_without_a_set_runs_the_references() -> None:
    from test_models import TINY, _hf_configs

    from sgl.backend.models.registry import get_model_class, resolve_architecture

    cfg = _hf_configs()["llama"]
    model = get_model_class(resolve_architecture(cfg))(cfg, device=torch.device("cpu"),
                                                       dtype=torch.float32)
    assert model.kernels.mode == "reference" and TINY["num_hidden_layers"] == 2
    assert model.model.norm.kernels.rmsnorm is rmsnorm.rmsnorm_reference
