"""The fused CPU ops of a decode step (cpu_ops.c), built into the quantized kernel's library.

On the CPU a one-token decode step of a small model is mostly op dispatch, not arithmetic:
SmolLM2-135M ran ~6,800 torch ops per token (~230 per layer: RMSNorm decomposes into seven,
rotary into a dozen, the KV store into six, decode attention into a gather, a mask and SDPA),
at 2-10 us each. These ops do each chain in one ctypes call (~2-4 us with its arguments).

The norm, activation, rotary and KV-store ops have the signatures of the kernel set's ops
(kernels/dispatch.py): the CPU "auto" set takes them (`kernel_set_ops`). Inputs they
do not cover (another dtype, non-contiguous layouts, rotary out of place) go to the torch
reference, so a caller never needs to check. `decode_attention` is the torch attention
backend's fused path (attention/torch_backend.py): decode rows, and prompt chunks one query row
per token. On AVX-512 CPUs it runs a twin with the AVX2 loops' bits (cpu_ops.c).

The KV pool may hold float32, float16, bfloat16 or float8 e4m3 (`kv_dtype_supported`):
`kv_store` rounds the float32 k/v rows to nearest even exactly as the reference does (its
`.to()`, after saturating to e4m3's +-448), and `decode_attention` widens each stored
element back to float32 as it reads it.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Callable

import torch

from sgl.backend.kernels.activation import silu_and_mul_reference
from sgl.backend.kernels.kv_store import kv_store_reference
from sgl.backend.kernels.rmsnorm import fused_add_rmsnorm_reference, rmsnorm_reference
from sgl.backend.kernels.rotary import rotary_embedding_reference
from sgl.backend.quant import cpu_build, cpu_kernel

__all__ = ["available", "decode_attention", "decode_attention_supported", "fused_add_rmsnorm",
           "kernel_set_ops", "kv_dtype_supported", "kv_kind", "kv_store",
           "likely_available", "rmsnorm", "rotary_embedding", "silu_and_mul"]

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_F32 = torch.float32
# The pool element kinds of cpu_ops.c (KV_F32, KV_F16, KV_BF16, KV_E4M3).
_KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}
_F16C_KINDS = (torch.float16, torch.float8_e4m3fn)  # widened through F16C's conversion


def declare(lib: ctypes.CDLL) -> None:
    """Set the C signatures (called once by cpu_kernel when the library loads)."""
    lib.sgl_rmsnorm.argtypes = [_P, _P, _P, _F, _I64, _I64, _P, _P]
    lib.sgl_silu_mul.argtypes = [_P, _I64, _I64, _P]
    lib.sgl_rope.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _P, _I64]
    lib.sgl_kv_store.argtypes = [_P, _P, _P, _I64, _P, _I64, _P, _I64, _I64, _INT]
    lib.sgl_decode_attn.argtypes = [_P, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _P,
                                    _P, _F, _P, _INT, _INT]
    lib.sgl_decode_attn.restype = _INT
    for name in ("sgl_rmsnorm", "sgl_silu_mul", "sgl_rope", "sgl_kv_store"):
        getattr(lib, name).restype = None


def _lib() -> ctypes.CDLL:
    lib = cpu_kernel._library()
    assert lib is not None, "cpu_ops used where cpu_ops.available() is False"
    return lib


def available() -> bool:
    """The library is built and loaded (waits for a build in progress)."""
    return cpu_kernel.available()


def likely_available() -> bool:
    """Starts building the library in the background; whether it should build here. Ops
    chosen on this promise still fall back to the references if the build then fails."""
    cpu_kernel.start_build()
    return cpu_kernel.likely_available()


def _cpu_f32(*tensors: torch.Tensor) -> bool:
    """float32 CPU tensors, and the library loaded (the first call may wait for its build).
    (A plain loop: this runs ~180 times per decode step.)"""
    for t in tensors:
        if t.dtype is not _F32 or not t.is_cpu:
            return False
    return cpu_kernel._library() is not None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    if not (_cpu_f32(x, weight) and x.is_contiguous()):
        return rmsnorm_reference(x, weight, eps)
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    _lib().sgl_rmsnorm(x.data_ptr(), None, weight.data_ptr(), eps, x.numel() // hidden, hidden,
                       out.data_ptr(), None)
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    if not (_cpu_f32(x, residual, weight) and x.is_contiguous() and residual.is_contiguous()
            and x.shape == residual.shape):
        return fused_add_rmsnorm_reference(x, residual, weight, eps)
    hidden = x.shape[-1]
    out, summed = torch.empty_like(x), torch.empty_like(x)
    _lib().sgl_rmsnorm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps,
                       x.numel() // hidden, hidden, out.data_ptr(), summed.data_ptr())
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    if not (_cpu_f32(x) and x.is_contiguous() and x.shape[-1] % 2 == 0):
        return silu_and_mul_reference(x)
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=_F32)
    _lib().sgl_silu_mul(x.data_ptr(), x.numel() // (2 * inter), inter, out.data_ptr())
    return out


def _heads_layout(x: torch.Tensor) -> bool:
    """[T, heads, D] with contiguous heads (rows may be strided: views of a fused qkv)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor,
                     inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    half = cos_sin_cache.shape[-1] // 2
    if not (inplace and _cpu_f32(q, k, cos_sin_cache) and positions.dtype == torch.int64
            and positions.is_contiguous() and cos_sin_cache.is_contiguous()
            and _heads_layout(q) and _heads_layout(k) and 2 * half <= q.shape[2]
            and q.shape[2] == k.shape[2] and positions.numel() == q.shape[0] == k.shape[0]):
        return rotary_embedding_reference(positions, q, k, cos_sin_cache, inplace)
    lib, tokens, dim = _lib(), q.shape[0], q.shape[2]
    pos, cache = positions.data_ptr(), cos_sin_cache.data_ptr()
    if q.stride(0) == k.stride(0) and k.data_ptr() == q.data_ptr() + q[0].numel() * 4:
        # k's heads follow q's in every row (views of one qkv): one pass over both
        lib.sgl_rope(q.data_ptr(), tokens, q.stride(0), q.shape[1] + k.shape[1], dim, pos, cache,
                     half)
    else:
        lib.sgl_rope(q.data_ptr(), tokens, q.stride(0), q.shape[1], dim, pos, cache, half)
        lib.sgl_rope(k.data_ptr(), tokens, k.stride(0), k.shape[1], dim, pos, cache, half)
    return q, k


@functools.cache
def _has_f16c() -> bool:
    """The library converts float16 here: the portable build always (cpu_portable.h), the
    AVX2 one where the CPU has F16C (every AVX2 CPU does; checked, not assumed)."""
    if cpu_build.portable():
        return True
    flags = cpu_build.cpu_flags()
    return flags is not None and "f16c" in flags


def kv_dtype_supported(dtype: torch.dtype) -> bool:
    """Whether the C store and attention take a pool of this dtype."""
    return dtype in _KV_KINDS and (dtype not in _F16C_KINDS or _has_f16c())


def kv_kind(dtype: torch.dtype) -> int:
    """cpu_ops.c's element kind of a pool dtype (`kv_dtype_supported` first)."""
    return _KV_KINDS[dtype]


def _kv_pool_ok(k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    return (k_buffer.dtype == v_buffer.dtype and kv_dtype_supported(k_buffer.dtype)
            and k_buffer.is_cpu and v_buffer.is_cpu and k_buffer.is_contiguous()
            and v_buffer.is_contiguous())


def kv_store(k_buffer: torch.Tensor, v_buffer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out_cache_loc: torch.Tensor) -> None:
    if not (_cpu_f32(k, v) and _kv_pool_ok(k_buffer, v_buffer)
            and _heads_layout(k) and _heads_layout(v)
            and k.shape == v.shape and k.shape[1:] == k_buffer.shape[1:] == v_buffer.shape[1:]
            and out_cache_loc.dtype == torch.int64 and out_cache_loc.is_contiguous()):
        kv_store_reference(k_buffer, v_buffer, k, v, out_cache_loc)
        return
    width = k.shape[1] * k.shape[2]
    _lib().sgl_kv_store(k_buffer.data_ptr(), v_buffer.data_ptr(), k.data_ptr(), k.stride(0),
                        v.data_ptr(), v.stride(0), out_cache_loc.data_ptr(), k.shape[0], width,
                        _KV_KINDS[k_buffer.dtype])


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, table_rows: torch.Tensor, lens: torch.Tensor,
                     scale: float, q_rows: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One query row per request against its KV, read in place from the pool.

    q [T, heads, D] (heads contiguous, rows may be strided); request b's query is row
    `q_rows[b]` (b when None), its keys the first `lens[b]` slots of
    `req_to_token[table_rows[b]]`; buffers [slots, kv_heads, D] in any dtype of
    `kv_dtype_supported` (widened to float32 as read). Returns `out` [T, heads, D]
    with those rows written (a new tensor when `out` is None). The caller checks the
    layouts (`decode_attention_supported`).
    """
    tokens, heads, dim = q.shape
    if out is None:
        out = torch.empty(tokens, heads, dim, dtype=_F32)
    batch = table_rows.shape[0]
    failed = _lib().sgl_decode_attn(
        q.data_ptr(), q.stride(0), None if q_rows is None else q_rows.data_ptr(), batch, heads,
        k_buffer.shape[1], dim, k_buffer.data_ptr(), v_buffer.data_ptr(),
        req_to_token.data_ptr(), req_to_token.stride(0), table_rows.data_ptr(), lens.data_ptr(),
        scale, out.data_ptr(), torch.get_num_threads(), _KV_KINDS[k_buffer.dtype])
    if failed:
        raise MemoryError("decode attention: could not allocate its work buffer")
    return out


def decode_attention_supported(q: torch.Tensor, k_buffer: torch.Tensor,
                               req_to_token: torch.Tensor) -> bool:
    """Whether `decode_attention` covers these layouts (float32 q; a CPU pool of a
    `kv_dtype_supported` dtype; int32 table)."""
    return (_cpu_f32(q) and kv_dtype_supported(k_buffer.dtype) and k_buffer.is_cpu
            and _heads_layout(q) and k_buffer.is_contiguous()
            and req_to_token.dtype == torch.int32 and req_to_token.is_contiguous()
            and q.shape[1] % k_buffer.shape[1] == 0 and q.shape[2] == k_buffer.shape[2])


def kernel_set_ops() -> dict[str, Callable[..., Any]]:
    """The kernel-set ops these replace on the CPU (kernels/dispatch.py, mode "auto")."""
    return {"rmsnorm": rmsnorm, "fused_add_rmsnorm": fused_add_rmsnorm,
            "silu_and_mul": silu_and_mul, "rotary_embedding": rotary_embedding,
            "kv_store": kv_store}
