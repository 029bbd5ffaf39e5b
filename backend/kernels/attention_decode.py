"""Decode attention over the token-indexed KV pool: one query token per request.

Request b attends its query `q[b]` to the keys/values at pool slots
`req_to_token[req_pool_indices[b], :seq_lens[b]]` (no causal mask: the query is the last token,
its own k/v already stored). Grouped-query attention: query head h reads KV head h // group.

Triton version, flash-decoding in two stages:

    stage 1, grid (B, kv_heads, num_kv_splits): each program takes one KV head and *all* its
      query heads (so each K/V tile is loaded once per group, not once per query head), one
      slice of the sequence, and writes a partial (normalized acc, log-sum-exp) per head.
    stage 2: merges the splits' partials by their log-sum-exp. It runs in stage 1's launch:
      the last program of each (row, KV head) to finish merges its query heads' partials
      (triton_attention_decode.py); a kernel of its own, grid (B, heads), is the A/B's before.

With one split (batches that fill the GPU by themselves) stage 1 writes the output directly,
with the bits stage 2 would have given.

Splitting the KV length gives parallelism when batch * kv_heads is far below the number of SMs
(single-stream decode over long contexts). The split *count* is a launch parameter that must
not depend on the step's lengths (CUDA graphs): `decode_num_kv_splits` derives it from the batch
size and head count only. The split *length* is computed inside the kernel from `seq_lens`
(rounded up to whole tiles, so short sequences fill only the first splits).

Page size: the pool is indexed per token, so a paged allocator (page_size 16) just makes the
slot sequence contiguous within pages; the kernel gathers by slot either way.
"""

from __future__ import annotations

import torch


def decode_attention_reference(
    q: torch.Tensor,  # [B, heads, head_dim]
    k_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim_v]
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int32
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    num_kv_splits: int = 1,  # accepted for signature parity; the reference does not split
) -> torch.Tensor:  # [B, heads, head_dim_v], q's dtype
    batch, num_heads, _ = q.shape
    group = num_heads // k_buffer.shape[1]
    out = torch.zeros(batch, num_heads, v_buffer.shape[-1], dtype=q.dtype, device=q.device)
    lens = seq_lens.tolist()  # host sync: fine for a reference
    rows = req_pool_indices.tolist()
    for b in range(batch):
        if lens[b] == 0:
            continue  # no keys: output stays 0, as in the kernel
        slots = req_to_token[rows[b], : lens[b]].long()
        # (index_select: it gathers a float8 pool on CUDA since torch 2.6)
        k = k_buffer.index_select(0, slots).float()  # [L, kv_heads, head_dim]
        v = v_buffer.index_select(0, slots).float()  # [L, kv_heads, head_dim_v]
        k = k.repeat_interleave(group, dim=1)  # [L, heads, head_dim]
        v = v.repeat_interleave(group, dim=1)  # [L, heads, head_dim_v]
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale  # [heads, L]
        probs = scores.softmax(dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", probs, v).to(q.dtype)
    return out
