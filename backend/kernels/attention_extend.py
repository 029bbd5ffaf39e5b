"""Extend (prefill) attention over the token-indexed KV pool, ragged batch, causal.

The new k/v of this step are written to the pool *before* this kernel runs (the backend does
it), so every key, cached prefix or new, is read the same way: through
`req_to_token[req_pool_indices[b], :seq_lens[b]]`. For request b, new token i (0-based) sits at
sequence position `extend_prefix_lens[b] + i` and sees keys at positions 0 .. that position.
A decode row inside an EXTEND batch is just a request with `extend_seq_lens[b] == 1`.

Triton version, grid (query blocks, B, heads): each program owns BLOCK_M new tokens of one
request and one query head and runs an online softmax over key blocks in two loops:

    keys [0, prefix + block_start)         visible to every row of the block: no causal mask
    keys [prefix + block_start, kv_end)    the diagonal: causal mask per (row, key)

where kv_end = min(seq_len, prefix + block_end). Programs whose block starts past the request's
new tokens exit at once, so the grid is sized by the longest extend of the step.
"""

from __future__ import annotations

import torch


def extend_attention_reference(
    q: torch.Tensor,  # [T, heads, head_dim]: new tokens of all requests, concatenated
    k_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim] (new k already stored)
    v_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim_v]
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int32
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B]: prefix + new
    extend_prefix_lens: torch.Tensor,  # [B]
    extend_seq_lens: torch.Tensor,  # [B]
    extend_start: torch.Tensor,  # [B]: offset of request b's first token in q
    scale: float,
    max_extend_len: int | None = None,  # parity with the Triton version (its grid size)
) -> torch.Tensor:  # [T, heads, head_dim_v], q's dtype
    num_heads = q.shape[1]
    group = num_heads // k_buffer.shape[1]
    out = torch.zeros(q.shape[0], num_heads, v_buffer.shape[-1], dtype=q.dtype, device=q.device)
    rows, lens = req_pool_indices.tolist(), seq_lens.tolist()  # host sync: fine for a reference
    prefixes, ext_lens, starts = (
        extend_prefix_lens.tolist(), extend_seq_lens.tolist(), extend_start.tolist())
    for b in range(len(rows)):
        n, prefix, s = ext_lens[b], prefixes[b], starts[b]
        if n == 0:
            continue
        slots = req_to_token[rows[b], : lens[b]].long()
        # (index_select: it gathers a float8 pool on CUDA since torch 2.6)
        k = k_buffer.index_select(0, slots).float()  # [L, kv_heads, head_dim]
        v = v_buffer.index_select(0, slots).float()  # [L, kv_heads, head_dim_v]
        k = k.repeat_interleave(group, dim=1)  # [L, heads, head_dim]
        v = v.repeat_interleave(group, dim=1)  # [L, heads, head_dim_v]
        scores = torch.einsum("qhd,khd->hqk", q[s : s + n].float(), k) * scale  # [heads, n, L]
        q_pos = prefix + torch.arange(n, device=q.device)[:, None]  # [n, 1]
        k_pos = torch.arange(lens[b], device=q.device)[None, :]  # [1, L]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        out[s : s + n] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
