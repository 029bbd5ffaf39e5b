"""KV store: scatter the new tokens' k and v into the pool buffers at their slots.

    k_buffer[out_cache_loc[t]] = k[t]   for every new token t (same for v)

The pool is token-indexed (`[num_slots, kv_heads, head_dim]`), so a paged pool (page_size > 1)
needs nothing special here: the allocator already picked slots page by page.
"""

from __future__ import annotations

import torch


def kv_store_reference(
    k_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim_v]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim_v]
    out_cache_loc: torch.Tensor,  # [T] int
) -> None:
    loc = out_cache_loc.long()
    k_buffer[loc] = to_pool_dtype(k, k_buffer.dtype)
    v_buffer[loc] = to_pool_dtype(v, v_buffer.dtype)


def to_pool_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to the pool's dtype (nearest even); into a float8 pool saturated to its
    largest finite value first (what torch 2.13 does by itself, older versions do not; NaN
    stays NaN), so an outlier is clipped rather than stored as NaN."""
    if dtype.itemsize == 1:  # float8
        big = torch.finfo(dtype).max
        x = x.clamp(-big, big)
    return x.to(dtype)
