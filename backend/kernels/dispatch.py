"""The kernel set: which implementation serves each op, chosen once when a model loads.

    kernels = resolve_kernels(mode, device, dtype)   # the runtime, once per engine
    kernels.rmsnorm(x, weight, eps)                  # the layers and the attention backend

Every op has a pure-torch `<op>_reference` in its module under `sgl.backend.kernels` and a
Triton `<op>_triton` of the same signature in `triton_<op>.py` beside it (the linear op:
`gemv.gemv_reference`, which is `F.linear`, and `triton_gemv.linear_triton`). The Triton
modules are imported only when a set picks them (or `_require_triton` checks them), so an
engine on the CPU never imports Triton. tests/test_kernels*.py compare every Triton kernel
against its reference, under Triton's interpreter when there is no GPU.

`mode` is the `SGL_KERNELS` setting (the engine config's `kernels`). The runtime reads it and
passes it here; this module never reads the environment:

    auto       (default) with a CUDA device and triton installed: the Triton kernels (linears:
               our GEMV for one-row 16-bit decode, cuBLAS otherwise), and attention_backend
               "auto" means the Triton backend. Elsewhere the references, with the CPU's
               fast paths: linear weights packed for oneDNN at load (`onednn_linear`;
               `F.linear` on the plain weight is their reference), in float32 the fused C
               ops of `sgl.backend.quant.cpu_ops` for the norms, SiLU*mul, rotary and KV
               store (where a C compiler and AVX2 exist), and xgrammar's bitmask kernel when
               xgrammar is installed; attention "auto" means the torch backend.
    reference  the pure-torch references on every device, nothing packed (debugging,
               bisecting a numerical difference); attention "auto" means the torch backend.
    triton     the Triton kernels on every device; on the CPU that needs TRITON_INTERPRET=1 set
               before the kernel modules are imported (Triton's interpreter: slow, tests only).

`batch_invariant` (the engine's `enable_deterministic_inference`) asks for kernels whose every
row has the same bits whatever else is in the call. On a Triton set the linear op becomes
`triton_matmul.linear_batch_invariant` (one tile configuration for every row count) and the
attention backend fixes its KV splits (attention/triton_backend.py); the other Triton ops are
row-wise already. On the CPU the set is unchanged: its C attention and its C kernel on GGUF
codes are row-wise by construction, and the runtime marks the quantized weights so that
prefill products stay on that kernel (quant/linear.py, `keep_rows_invariant`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from sgl.backend.kernels import (
    activation,
    argmax,
    attention_decode,
    attention_extend,
    gemv,
    kv_store,
    onednn_linear,
    rmsnorm,
    rotary,
    token_bitmask,
)
from sgl.errors import InvalidConfigError

_HAS_XGRAMMAR = importlib.util.find_spec("xgrammar") is not None


@functools.cache
def has_triton() -> bool:
    """Whether the `triton` package imports. It imports it (~0.2 s, ~70 MB): ask only where a
    CUDA device is in play, so that a CPU engine never pays for it."""
    from sgl.backend.kernels import triton_compat

    return triton_compat.HAS_TRITON

Mode = Literal["auto", "reference", "triton"]
MODES: tuple[str, ...] = ("auto", "reference", "triton")
Tensor = torch.Tensor


@dataclass(frozen=True)
class KernelSet:
    """The implementation of every op for one engine (see the module docstring)."""

    mode: Mode
    device: torch.device
    rmsnorm: Callable[[Tensor, Tensor, float], Tensor]  # (x, weight, eps)
    fused_add_rmsnorm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]  # [T, 2I] -> [T, I]
    rotary_embedding: Callable[[Tensor, Tensor, Tensor, Tensor, bool], tuple[Tensor, Tensor]]
    linear: Callable[[Tensor, Tensor, Tensor | None], Tensor]  # plain (unpacked) weights
    kv_store: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]
    # (positions, q, k, v, cos_sin, k_buffer, v_buffer, loc) -> q: the two above in one launch
    rotary_kv_store: Callable[..., Tensor]
    decode_attention: Callable[..., Tensor]
    extend_attention: Callable[..., Tensor]
    apply_token_bitmask: Callable[[Tensor, Tensor, Tensor | None], None]
    argmax: Callable[[Tensor], Tensor]  # [B, V] -> [B] int64: the sampler's greedy rows
    pack_linears: bool  # pack linear weights for oneDNN at load (the CPU's linear fast path)
    attention: Literal["torch", "triton"]  # the attention backend that "auto" means
    batch_invariant: bool = False  # rows keep their bits whatever else the call holds

    @classmethod
    def ops(cls) -> tuple[str, ...]:
        """Names of the op fields, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in _NOT_OPS)


_NOT_OPS = frozenset({"mode", "device", "pack_linears", "attention", "batch_invariant"})


def resolve_kernels(mode: str, device: torch.device | str, dtype: torch.dtype, *,
                    batch_invariant: bool = False) -> KernelSet:
    """The kernel set of a model on `device` in `dtype` under `mode` (auto/reference/triton);
    `batch_invariant`: see the module docstring.

    Raises InvalidConfigError for an unknown mode, and for "triton" where Triton cannot run.
    """
    device = torch.device(device)
    normalized = mode.strip().lower()
    if normalized not in MODES:
        raise InvalidConfigError(
            f"kernels (SGL_KERNELS) must be 'auto', 'reference' or 'triton', got {mode!r}")
    if normalized == "triton":
        _require_triton(device)
    use_triton = normalized == "triton" or (
        normalized == "auto" and device.type == "cuda" and has_triton())
    ops = _triton_ops() if use_triton else _reference_ops()
    if use_triton and batch_invariant:
        from sgl.backend.kernels.triton_matmul import linear_batch_invariant

        ops["linear"] = linear_batch_invariant
    if normalized == "auto" and device.type == "cpu" and _HAS_XGRAMMAR:
        # Same layout and rule as the reference, about twice as fast on the CPU.
        ops["apply_token_bitmask"] = token_bitmask.apply_token_bitmask_xgrammar
    if normalized == "auto" and device.type == "cpu" and dtype == torch.float32:
        # The fused C ops of backend/quant/cpu_ops.c (norms, SiLU*mul, rotary, KV store): one
        # call each instead of 5-15 torch dispatches, most of a small model's decode step.
        from sgl.backend.quant import cpu_ops

        if cpu_ops.likely_available():  # (builds in the background; the ops fall back
            ops.update(cpu_ops.kernel_set_ops())  # to the references if the build fails)
    return KernelSet(
        mode=normalized,  # type: ignore[arg-type]
        device=device,
        pack_linears=normalized == "auto" and onednn_linear.available(device, dtype),
        attention="triton" if use_triton else "torch",
        batch_invariant=batch_invariant,
        **ops,
    )


def _require_triton(device: torch.device) -> None:
    if not has_triton():
        raise InvalidConfigError(
            "kernels='triton' (SGL_KERNELS) needs the `triton` package: install it, or use "
            "'auto' or 'reference'")
    from sgl.backend.kernels import triton_rmsnorm
    from sgl.backend.kernels.triton_compat import is_interpreted

    if device.type != "cuda" and not is_interpreted(triton_rmsnorm._rmsnorm_kernel):
        raise InvalidConfigError(
            f"kernels='triton' on device {str(device)!r} runs Triton's interpreter, which needs "
            "TRITON_INTERPRET=1 set before sgl's kernels are imported; or use 'auto' or "
            "'reference'")


# Looked up when a set is resolved, not at import: a test can swap a function for a spy.
def _reference_ops() -> dict[str, Callable[..., Any]]:
    return {
        "rmsnorm": rmsnorm.rmsnorm_reference,
        "fused_add_rmsnorm": rmsnorm.fused_add_rmsnorm_reference,
        "silu_and_mul": activation.silu_and_mul_reference,
        "rotary_embedding": rotary.rotary_embedding_reference,
        "linear": gemv.gemv_reference,
        "kv_store": kv_store.kv_store_reference,
        "rotary_kv_store": rotary.rotary_kv_store_reference,
        "decode_attention": attention_decode.decode_attention_reference,
        "extend_attention": attention_extend.extend_attention_reference,
        "apply_token_bitmask": token_bitmask.apply_token_bitmask_reference,
        "argmax": argmax.argmax_reference,
    }


def _triton_ops() -> dict[str, Callable[..., Any]]:
    from sgl.backend.kernels import (
        triton_activation,
        triton_argmax,
        triton_attention_decode,
        triton_attention_extend,
        triton_gemv,
        triton_kv_store,
        triton_rmsnorm,
        triton_rotary,
        triton_token_bitmask,
    )

    return {
        "rmsnorm": triton_rmsnorm.rmsnorm_triton,
        "fused_add_rmsnorm": triton_rmsnorm.fused_add_rmsnorm_triton,
        "silu_and_mul": triton_activation.silu_and_mul_triton,
        "rotary_embedding": triton_rotary.rotary_embedding_triton,
        "linear": triton_gemv.linear_triton,
        "kv_store": triton_kv_store.kv_store_triton,
        "rotary_kv_store": triton_rotary.rotary_kv_store_triton,
        "decode_attention": triton_attention_decode.decode_attention_triton,
        "extend_attention": triton_attention_extend.extend_attention_triton,
        # Our own small kernel rather than xgrammar's on CUDA: same layout and rule, one fewer
        # dependency on the GPU path, and `indices` stays a device tensor (no host list).
        "apply_token_bitmask": triton_token_bitmask.apply_token_bitmask_triton,
        "argmax": triton_argmax.argmax_triton,
    }


def apply_token_bitmask(
    logits: torch.Tensor,  # [rows, vocab]
    bitmask: torch.Tensor,  # [rows, ceil(vocab / 32)] int32, on logits' device
    indices: torch.Tensor | None = None,
) -> None:
    """The "auto" bitmask kernel for logits' device: the default of code built without a
    KernelSet (tests, `grammar.apply_bitmask`). The engine's sampler gets its KernelSet's
    `apply_token_bitmask` instead, so SGL_KERNELS reaches the grammar mask."""
    if logits.device.type == "cuda" and has_triton():
        from sgl.backend.kernels.triton_token_bitmask import apply_token_bitmask_triton

        fn = apply_token_bitmask_triton
    elif logits.device.type == "cpu" and _HAS_XGRAMMAR:
        fn = token_bitmask.apply_token_bitmask_xgrammar
    else:
        fn = token_bitmask.apply_token_bitmask_reference
    fn(logits, bitmask, indices)


__all__ = ["KernelSet", "MODES", "Mode", "apply_token_bitmask", "has_triton", "resolve_kernels"]
