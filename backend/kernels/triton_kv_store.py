"""The Triton kernel of the KV store; `kv_store.py` holds the pure-torch reference it is tested
against, and the docstring there describes the op.

A module of its own so that a CPU engine, which only ever runs the reference, never imports
Triton (~0.2 s and ~70 MB): the kernel set imports this module only when it picks the Triton
kernels (kernels/dispatch.py).
"""

from __future__ import annotations

import torch

from sgl.backend.kernels.triton_compat import (launch_options, let_next_launch, next_power_of_2,
                                               tl, triton, wait_for_inputs)


@triton.jit
def store_heads(X, Buf, t, slot, stride_xt, stride_xh, stride_bs, stride_bh, num_heads, dim,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token t's [num_heads, dim] rows of X into pool row `slot` of Buf, in Buf's dtype (also
    the rotary kernel's store of v: triton_rotary.py). Into a float8 pool the cast is
    `kv_store.to_pool_dtype`'s rounding: on sm_89+ Triton converts with
    `cvt.rn.satfinite.e4m3x2` (nearest even, saturated at +-448, NaN kept), from the float32
    value for bf16 and fp32 sources (bf16 -> fp32 is exact) and straight from float16, so each
    value is rounded once (tests/triton_compile_check.py checks the PTX)."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < num_heads) & (offs_d < dim)
    x = tl.load(X + t * stride_xt + offs_h * stride_xh + offs_d, mask=mask)
    tl.store(Buf + slot * stride_bs + offs_h * stride_bh + offs_d, x.to(Buf.dtype.element_ty),
             mask=mask)


@triton.jit
def _kv_store_kernel(
    K, V, KBuf, VBuf, Loc,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    num_heads, head_dim, head_dim_v,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PDL: tl.constexpr, WAIT: tl.constexpr,
):
    # One program per new token: copy its [kv_heads, head_dim] rows of k and v.
    let_next_launch(PDL)  # the next kernel may start (triton_compat: PDL)
    wait_for_inputs(WAIT)  # (launched early itself: the kernel before may still be running)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)  # int64: slot * stride can pass 2**31 in big pools
    store_heads(K, KBuf, t, slot, stride_kt, stride_kh, stride_kbs, stride_kbh, num_heads,
                head_dim, BLOCK_H, BLOCK_D)
    store_heads(V, VBuf, t, slot, stride_vt, stride_vh, stride_vbs, stride_vbh, num_heads,
                head_dim_v, BLOCK_H, BLOCK_DV)


def kv_store_triton(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    # The kernel addresses the last dim with unit stride (views from a fused qkv split are).
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    head_dim_v = v.shape[-1]
    _kv_store_kernel[(num_tokens,)](
        k, v, k_buffer, v_buffer, out_cache_loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        num_heads, head_dim, head_dim_v,
        BLOCK_H=next_power_of_2(num_heads),
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_DV=next_power_of_2(head_dim_v), **launch_options(k.device, _kv_store_kernel),
    )
