"""Rotary position embedding, neox / rotate-half style (Hugging Face Llama layout).

For each head vector x with its first `rotary_dim` dims split in halves x1, x2:

    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin          (dims >= rotary_dim pass through)

`cos_sin_cache` is `[max_position, rotary_dim]`: cos in the first half of the last dim, sin in
the second (`make_cos_sin_cache` builds it, in float32 like transformers, then in the model's
dtype as the model keeps it). q and k are rotated in one launch.

Rounding: the reference is transformers' `apply_rotary_pos_emb` exactly: cos and sin rounded
to x's dtype, products and sums in x's dtype. The Triton kernel computes in fp32 and rounds
once; in 16-bit dtypes they differ within the kernel tests' tolerance, in float32 not at all.
"""

from __future__ import annotations

import torch

from sgl.backend.kernels.triton_compat import next_power_of_2, tl, triton


def rope_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:  # [rotary_dim // 2] fp32
    """One frequency per rotated pair, in float32 with transformers' formula (so the angles,
    and the model's outputs, match its Llama bit for bit)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / base**exponents


def make_cos_sin_cache(
    max_position: int,
    rotary_dim: int,
    base: float = 10000.0,
    inv_freq: torch.Tensor | None = None,  # [rotary_dim // 2]; pass one for scaled ropes
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [max_position, rotary_dim]: cos | sin
    """Angles position * frequency in float32, cos and sin in float32, then cast to `dtype`:
    transformers' arithmetic. Computed on the CPU whatever `device` is (one set of values)."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(rotary_dim, base)
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.to(device="cpu", dtype=torch.float32))  # [P, half]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device=device, dtype=dtype)


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      inplace: bool) -> torch.Tensor:
    half = cos.shape[-1]  # x [T, heads, D]; cos, sin [T, 1, half] in x's dtype
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    out1 = x1 * cos - x2 * sin  # [T, heads, half]
    out2 = x2 * cos + x1 * sin
    if inplace:  # both halves are computed before either is written
        x1.copy_(out1)
        x2.copy_(out2)
        return x
    if 2 * half == x.shape[-1]:
        return torch.cat([out1, out2], dim=-1)
    return torch.cat([out1, out2, x[..., 2 * half :]], dim=-1)


def rotary_embedding_reference(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [T, rotary_dim/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    if cos.dtype != q.dtype or q.dtype != k.dtype:  # (the model keeps the cache in its dtype)
        return (_rotate_reference(q, cos.to(q.dtype), sin.to(q.dtype), inplace),
                _rotate_reference(k, cos.to(k.dtype), sin.to(k.dtype), inplace))
    return _rotate_reference(q, cos, sin, inplace), _rotate_reference(k, cos, sin, inplace)


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
    # Both halves are read before either is written, so Out may alias X (in-place).
    tl.store(o_ptr, (x1 * cos - x2 * sin).to(Out.dtype.element_ty), mask=mask)
    tl.store(o_ptr + half, (x2 * cos + x1 * sin).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Pos, Q, K, QOut, KOut, Cache,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
    num_q_heads, num_k_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # One program per token: load its cos/sin row once, rotate all q and k heads with it.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    cos = tl.load(Cache + pos * stride_cache + offs_r, mask=offs_r < half, other=0.0)
    sin = tl.load(Cache + pos * stride_cache + half + offs_r, mask=offs_r < half, other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    _rotate_heads(Q, QOut, t, stride_qt, stride_qh, stride_qot, stride_qoh, num_q_heads, half,
                  cos, sin, BLOCK_HQ, BLOCK_R)
    _rotate_heads(K, KOut, t, stride_kt, stride_kh, stride_kot, stride_koh, num_k_heads, half,
                  cos, sin, BLOCK_HK, BLOCK_R)


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
            BLOCK_R=next_power_of_2(half),
        )
    return q_out, k_out
