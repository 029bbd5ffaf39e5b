"""Rotary position embedding, neox / rotate-half style (Hugging Face Llama layout).

For each head vector x with its first `rotary_dim` dims split in halves x1, x2:

    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin          (dims >= rotary_dim pass through)

`cos_sin_cache` is `[max_position, rotary_dim]`: cos in the first half of the last dim, sin in
the second (`make_cos_sin_cache` builds it, in float32 like transformers, then in the model's
dtype as the model keeps it). q and k are rotated in one launch.

`rotary_kv_store` is the op the attention backend runs on the GPU: q rotated in place, k rotated
and stored with v into the KV pool at the new tokens' slots (the KV store of kv_store.py), in
one launch instead of two; k itself is left as it was (attention reads keys from the pool).

Rounding: the reference is transformers' `apply_rotary_pos_emb` exactly: cos and sin rounded
to x's dtype, products and sums in x's dtype. The Triton kernel computes in fp32 and rounds
once; in 16-bit dtypes they differ within the kernel tests' tolerance, in float32 not at all.
"""

from __future__ import annotations

import torch


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


def rotary_kv_store_reference(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, heads, head_dim]: rotated in place
    k: torch.Tensor,  # [T, kv_heads, head_dim]: its rotation goes to the pool only
    v: torch.Tensor,  # [T, kv_heads, head_dim_v]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    k_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim_v]
    out_cache_loc: torch.Tensor,  # [T] int
) -> torch.Tensor:  # q
    from sgl.backend.kernels.kv_store import kv_store_reference

    q, k = rotary_embedding_reference(positions, q, k.clone(), cos_sin_cache, True)
    kv_store_reference(k_buffer, v_buffer, k, v, out_cache_loc)
    return q
