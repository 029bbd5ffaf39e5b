"""One entry point per op: the Triton kernel on CUDA tensors, the pure-torch reference elsewhere.

`SGL_KERNELS` (read here and nowhere else) overrides the choice:

    auto       (default) Triton when the tensor is on CUDA and triton is installed; on the
               CPU, linear layers with weights packed for oneDNN (`onednn_linear`)
    reference  always the pure-torch reference (debugging, bisecting a numerical difference)
    triton     always Triton; on the CPU that needs TRITON_INTERPRET=1 set before the kernel
               modules are imported (Triton's interpreter; slow, for tests only)

Every op here has the signature of its `<op>_reference` / `<op>_triton` pair.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Literal

import torch

from sgl.backend.kernels import (
    activation,
    attention_decode,
    attention_extend,
    gemv as _gemv,
    kv_store as _kv_store,
    onednn_linear,
    rmsnorm as _rmsnorm,
    rotary,
    token_bitmask,
)
from sgl.backend.kernels.triton_compat import HAS_TRITON

_HAS_XGRAMMAR = importlib.util.find_spec("xgrammar") is not None

Impl = Literal["triton", "reference"]


def _mode() -> str:
    mode = os.environ.get("SGL_KERNELS", "auto").strip().lower()
    if mode not in ("auto", "reference", "triton"):
        raise ValueError(f"SGL_KERNELS must be auto, reference or triton, got {mode!r}")
    return mode


def kernel_impl(device: torch.device) -> Impl:
    """Which implementation serves tensors on `device` (see the module docstring)."""
    mode = _mode()
    if mode == "reference":
        return "reference"
    if mode == "triton":
        if not HAS_TRITON:
            raise RuntimeError("SGL_KERNELS=triton but the `triton` package is not installed")
        return "triton"
    return "triton" if device.type == "cuda" and HAS_TRITON else "reference"


def pack_cpu_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` gets its linear weights packed for oneDNN at load time
    (the CPU's linear kernel, in `auto` mode; `F.linear` on the plain weight is its reference)."""
    return _mode() == "auto" and onednn_linear.available(device, dtype)


def _triton(x: torch.Tensor) -> bool:
    return kernel_impl(x.device) == "triton"


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    fn = _rmsnorm.rmsnorm_triton if _triton(x) else _rmsnorm.rmsnorm_reference
    return fn(x, weight, eps)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:  # (rmsnorm(x + residual), x + residual)
    fn = _rmsnorm.fused_add_rmsnorm_triton if _triton(x) else _rmsnorm.fused_add_rmsnorm_reference
    return fn(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] fp32
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    fn = rotary.rotary_embedding_triton if _triton(q) else rotary.rotary_embedding_reference
    return fn(positions, q, k, cos_sin_cache, inplace)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    fn = activation.silu_and_mul_triton if _triton(x) else activation.silu_and_mul_reference
    return fn(x)


def kv_store(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    fn = _kv_store.kv_store_triton if _triton(k) else _kv_store.kv_store_reference
    fn(k_buffer, v_buffer, k, v, out_cache_loc)


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_splits: int = 1,
) -> torch.Tensor:
    fn = (attention_decode.decode_attention_triton if _triton(q)
          else attention_decode.decode_attention_reference)
    return fn(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale,
              num_kv_splits)


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start: torch.Tensor,
    scale: float,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    fn = (attention_extend.extend_attention_triton if _triton(q)
          else attention_extend.extend_attention_reference)
    return fn(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
              extend_prefix_lens, extend_seq_lens, extend_start, scale, max_extend_len)


def apply_token_bitmask(
    logits: torch.Tensor,  # [rows, vocab]
    bitmask: torch.Tensor,  # [rows, ceil(vocab / 32)] int32, on logits' device
    indices: torch.Tensor | None = None,
) -> None:
    # On CUDA our own small Triton kernel rather than xgrammar's: same layout and rule, one
    # fewer dependency on the GPU path, and `indices` stays a device tensor (no host list).
    if _triton(logits):
        fn = token_bitmask.apply_token_bitmask_triton
    elif logits.device.type == "cpu" and _mode() == "auto" and _HAS_XGRAMMAR:
        fn = token_bitmask.apply_token_bitmask_xgrammar
    else:
        fn = token_bitmask.apply_token_bitmask_reference
    fn(logits, bitmask, indices)


def linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N]
    """y = x @ W^T (+ b). Our Triton GEMV for single-row decode (16-bit weights), where
    cuBLAS streams the weights below the copy bandwidth; F.linear (cuBLAS, or the CPU's)
    everywhere else. At 2-4 rows the GEMV measured slower than cuBLAS on the H200
    (bench/gemv_bench.py), so it serves one row only. The row count is static inside a CUDA
    graph, so the choice is fixed at capture."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows == 1 and weight.dtype in (torch.float16, torch.bfloat16)
            and x.dtype == weight.dtype and _triton(x)):
        return _gemv.gemv_triton(x, weight, bias)
    return _gemv.gemv_reference(x, weight, bias)


__all__ = [
    "Impl",
    "kernel_impl",
    "linear",
    "pack_cpu_linears",
    "rmsnorm",
    "fused_add_rmsnorm",
    "rotary_embedding",
    "silu_and_mul",
    "kv_store",
    "decode_attention",
    "extend_attention",
    "apply_token_bitmask",
]
