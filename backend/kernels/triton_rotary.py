"""The Triton kernel of rotary position embedding; `rotary.py` holds the pure-torch reference it
is tested against, and the docstring there describes the op.

A module of its own so that a CPU engine, which only ever runs the reference, never imports
Triton (~0.2 s and ~70 MB): the kernel set imports this module only when it picks the Triton
kernels (kernels/dispatch.py).
"""

from __future__ import annotations

import torch

from sgl.backend.kernels.triton_compat import (INPUTS_FIRST, launch_options, let_next_launch,
                                               next_power_of_2, tl, triton, wait_for_inputs)
from sgl.backend.kernels.triton_kv_store import kv_store_triton, store_heads


@triton.jit
def _rotate_heads(
    X, Out, t, stride_xt, stride_xh, stride_ot, stride_oh, num_heads, half, cos, sin,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_r = tl.arange(0, BLOCK_R)[None, :]
    mask = (offs_h < num_heads) & (offs_r < half)
    x_ptr = X + t * stride_xt + offs_h * stride_xh + offs_r
    o_ptr = Out + t * stride_ot + offs_h * stride_oh + offs_r
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half, mask=mask, other=0.0).to(tl.float32)
    # Rounded to X's dtype, then to Out's (a no-op unless Out is a narrower pool): a float8
    # pool gets the rotated k of the model's dtype rounded once more, the bits the unfused
    # path (and the torch backend) store, not a rounding of the fp32 value straight.
    out1 = (x1 * cos - x2 * sin).to(X.dtype.element_ty).to(Out.dtype.element_ty)
    out2 = (x2 * cos + x1 * sin).to(X.dtype.element_ty).to(Out.dtype.element_ty)
    # Both halves are read before either is written, so Out may alias X (in-place).
    tl.store(o_ptr, out1, mask=mask)
    tl.store(o_ptr + half, out2, mask=mask)


@triton.jit
def _cos_sin(Cache, pos, stride_cache, half, BLOCK_R: tl.constexpr):
    """cos and sin of position `pos`, [1, BLOCK_R] float32 each (0 past `half`)."""
    offs_r = tl.arange(0, BLOCK_R)
    cos = tl.load(Cache + pos * stride_cache + offs_r, mask=offs_r < half, other=0.0)
    sin = tl.load(Cache + pos * stride_cache + half + offs_r, mask=offs_r < half, other=0.0)
    return cos.to(tl.float32)[None, :], sin.to(tl.float32)[None, :]


@triton.jit
def _rotary_kernel(
    Pos, Q, K, QOut, KOut, Cache,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
    num_q_heads, num_k_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr,
    PDL: tl.constexpr, WAIT: tl.constexpr,
):
    # One program per token: load its cos/sin row once, rotate all q and k heads with it.
    let_next_launch(PDL)  # the next kernel may start (triton_compat: PDL)
    wait_for_inputs(WAIT)  # (launched early itself: the kernel before may still be running)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    cos, sin = _cos_sin(Cache, pos, stride_cache, half, BLOCK_R)
    _rotate_heads(Q, QOut, t, stride_qt, stride_qh, stride_qot, stride_qoh, num_q_heads, half,
                  cos, sin, BLOCK_HQ, BLOCK_R)
    _rotate_heads(K, KOut, t, stride_kt, stride_kh, stride_kot, stride_koh, num_k_heads, half,
                  cos, sin, BLOCK_HK, BLOCK_R)


@triton.jit
def _token_inputs(Pos, Loc, Cache, t, stride_cache, half, BLOCK_R: tl.constexpr):
    """Token t's pool slot (int64: slot * stride can pass 2**31 in big pools) and cos/sin."""
    pos = tl.load(Pos + t).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    cos, sin = _cos_sin(Cache, pos, stride_cache, half, BLOCK_R)
    return slot, cos, sin


@triton.jit
def _rotary_kv_store_kernel(
    Pos, Q, K, V, Cache, KBuf, VBuf, Loc,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    num_q_heads, num_k_heads, half, head_dim_v,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_DV: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr,
    INPUTS_FIRST: tl.constexpr,
):
    # One program per token: q rotated in place, k rotated into its pool slot, v copied there.
    let_next_launch(PDL)  # the next kernel may start (triton_compat: PDL)
    t = tl.program_id(0).to(tl.int64)
    if INPUTS_FIRST:  # the step's inputs and the cos/sin table: no kernel of it writes them
        slot, cos, sin = _token_inputs(Pos, Loc, Cache, t, stride_cache, half, BLOCK_R)
    wait_for_inputs(WAIT)  # (launched early itself: the kernel before may still be running)
    if not INPUTS_FIRST:
        slot, cos, sin = _token_inputs(Pos, Loc, Cache, t, stride_cache, half, BLOCK_R)
    _rotate_heads(Q, Q, t, stride_qt, stride_qh, stride_qt, stride_qh, num_q_heads, half,
                  cos, sin, BLOCK_HQ, BLOCK_R)
    # (the token's pool row as a one-row output: token stride 0, the pool's head stride)
    _rotate_heads(K, KBuf + slot * stride_kbs, t, stride_kt, stride_kh, 0, stride_kbh,
                  num_k_heads, half, cos, sin, BLOCK_HK, BLOCK_R)
    store_heads(V, VBuf, t, slot, stride_vt, stride_vh, stride_vbs, stride_vbh, num_k_heads,
                head_dim_v, BLOCK_HK, BLOCK_DV)


def _output_like(x: torch.Tensor, rotary_dim: int, inplace: bool) -> torch.Tensor:
    if inplace:
        return x
    # Dims past rotary_dim are not written by the kernel: start from a copy when there are any.
    return x.clone() if rotary_dim < x.shape[-1] else torch.empty_like(x)


def rotary_embedding_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "head_dim must be contiguous"
    rotary_dim = cos_sin_cache.shape[-1]
    half = rotary_dim // 2
    q_out = _output_like(q, rotary_dim, inplace)
    k_out = _output_like(k, rotary_dim, inplace)
    num_tokens = q.shape[0]
    if num_tokens > 0:
        _rotary_kernel[(num_tokens,)](
            positions, q, k, q_out, k_out, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos_sin_cache.stride(0),
            q.shape[1], k.shape[1], half,
            BLOCK_HQ=next_power_of_2(q.shape[1]),
            BLOCK_HK=next_power_of_2(k.shape[1]),
            BLOCK_R=next_power_of_2(half), **launch_options(q.device, _rotary_kernel),
        )
    return q_out, k_out


def rotary_kv_store_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> torch.Tensor:
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim < k.shape[-1]:  # dims past rotary_dim pass through: the two kernels
        q, k = rotary_embedding_triton(positions, q, k.clone(), cos_sin_cache, inplace=True)
        kv_store_triton(k_buffer, v_buffer, k, v, out_cache_loc)
        return q
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim contiguous"
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    if q.shape[0] > 0:
        _rotary_kv_store_kernel[(q.shape[0],)](
            positions, q, k, v, cos_sin_cache, k_buffer, v_buffer, out_cache_loc,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos_sin_cache.stride(0),
            k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
            q.shape[1], k.shape[1], rotary_dim // 2, v.shape[-1],
            BLOCK_HQ=next_power_of_2(q.shape[1]),
            BLOCK_HK=next_power_of_2(k.shape[1]),
            BLOCK_R=next_power_of_2(rotary_dim // 2),
            BLOCK_DV=next_power_of_2(v.shape[-1]), INPUTS_FIRST=INPUTS_FIRST[0],
            **launch_options(q.device, _rotary_kv_store_kernel),
        )
    return q
