"""The Triton kernel of decode attention; `attention_decode.py` holds the pure-torch reference it
is tested against, and the docstring there describes the op.

A module of its own so that a CPU engine, which only ever runs the reference, never imports
Triton (~0.2 s and ~70 MB): the kernel set imports this module only when it picks the Triton
kernels (kernels/dispatch.py).
"""

from __future__ import annotations

import torch

from sgl.backend.kernels.triton_compat import (is_interpreted, let_next_launch, mma,
                                               next_power_of_2, pdl_launch, tile_counters, tl,
                                               triton)

_LOG2E = 1.4426950408889634


def decode_num_kv_splits(
    batch_size: int, num_kv_heads: int, num_sms: int = 132, max_splits: int = 32
) -> int:
    """How many KV splits to launch: enough programs to fill ~2 waves of the SMs.

    Depends only on shapes that are fixed for a captured CUDA graph (batch size, heads).
    """
    programs = max(1, batch_size * num_kv_heads)
    return max(1, min(max_splits, -(-2 * num_sms // programs)))


@triton.jit
def _decode_kernel(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, MidO, MidLse, Out, Counters,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_r2t,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2 (exp2 is cheaper)
    group, head_dim, head_dim_v, num_splits, num_kv_heads,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    let_next_launch(PDL)  # the GEMV after may start loading its weights (triton_compat: PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    # Split length: an even share rounded up to whole BLOCK_N tiles, so a short sequence fills
    # only the first `used` splits; the others exit at once (cheap, and graph-safe). A row
    # without keys (a padded graph row) has one split, empty: its output is 0.
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, BLOCK_N)
    used = tl.maximum(tl.cdiv(seq_len, split_len), 1)
    if split < used:
        row = tl.load(ReqPoolIdx + b).to(tl.int64)
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)
        offs_h = tl.arange(0, BLOCK_H)  # rows: the query heads of this KV head (padded to >= 16)
        heads = kv_head * group + offs_h
        h_mask = offs_h < group
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        d_mask = offs_d < head_dim
        dv_mask = offs_dv < head_dim_v
        hv_mask = h_mask[:, None] & dv_mask[None, :]
        q = tl.load(
            Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=h_mask[:, None] & d_mask[None, :], other=0.0,
        )  # [BLOCK_H, BLOCK_D]

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (base-2 logits)
        l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(logit - m_i)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            n_mask = pos < end
            slots = tl.load(ReqToToken + row * stride_r2t + pos, mask=n_mask, other=0).to(tl.int64)
            k = tl.load(
                K + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                mask=n_mask[:, None] & d_mask[None, :], other=0.0,
            )  # [BLOCK_N, BLOCK_D]
            qk = mma(q, tl.trans(k), UPCAST, IEEE)
            qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
            # Every tile holds >= 1 valid key, so m_new is finite and no NaN appears.
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_dv[None, :],
                mask=n_mask[:, None] & dv_mask[None, :], other=0.0,
            )  # [BLOCK_N, BLOCK_DV]
            acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST, IEEE)
            m_i = m_new

        # An empty split (no keys) leaves l_i = 0, m_i = -inf: its part is 0 with lse = -inf.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        part = acc / l_safe[:, None]
        out = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
        if used == 1:  # the whole row in this program: its part is the output
            tl.store(out, part.to(Out.dtype.element_ty), mask=hv_mask)
        else:
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
            mid = MidO + b.to(tl.int64) * stride_mob + heads[:, None] * stride_moh + offs_dv[None, :]
            mid_lse = MidLse + b.to(tl.int64) * stride_mlb + heads * stride_mlh
            tl.store(mid + split * stride_mos, part, mask=hv_mask)
            tl.store(mid_lse + split, lse, mask=h_mask)
            # The program that completes the row's KV head merges its splits (module
            # docstring): the same bits whichever split finishes last.
            tl.debug_barrier()  # all of this program's stores before the release below
            cnt = Counters + b.to(tl.int64) * num_kv_heads + kv_head
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if arrived == used - 1:
                m = tl.full([BLOCK_H], float("-inf"), tl.float32)
                for s in range(0, used):  # (.cg: read at L2, past an L1 that missed the stores)
                    m = tl.maximum(m, tl.load(mid_lse + s, mask=h_mask, other=float("-inf"),
                                              cache_modifier=".cg"))
                m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: no -inf - -inf
                denom = tl.zeros([BLOCK_H], tl.float32)
                total = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
                for s in range(0, used):  # in split order: the same bits on every run
                    w = tl.exp2(tl.load(mid_lse + s, mask=h_mask, other=float("-inf"),
                                        cache_modifier=".cg") - m)  # empty splits weigh 0
                    denom += w
                    total += w[:, None] * tl.load(mid + s * stride_mos, mask=hv_mask, other=0.0,
                                                  cache_modifier=".cg")
                tl.store(cnt, 0)  # (the row is done: zero for the next launch)
                total = total / tl.where(denom > 0, denom, 1.0)[:, None]
                tl.store(out, total.to(Out.dtype.element_ty), mask=hv_mask)


def decode_attention_triton(
    q: torch.Tensor,  # [B, heads, head_dim]
    k_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim_v]
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int32
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    num_kv_splits: int = 1,
    out: torch.Tensor | None = None,  # [B, heads, head_dim_v]; preallocated for CUDA graphs
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k_buffer.shape[1], v_buffer.shape[-1]
    assert num_heads % num_kv_heads == 0, "heads must be a multiple of kv heads"
    assert q.stride(-1) == 1 and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    assert req_to_token.stride(-1) == 1
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(batch, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    # fp32 partials, used by rows that span several splits; allocated per call (under graph
    # capture they come from the graph's pool).
    mid_o = torch.empty(batch, num_heads, num_kv_splits, head_dim_v,
                        dtype=torch.float32, device=q.device)  # [B, heads, splits, head_dim_v]
    mid_lse = torch.empty(batch, num_heads, num_kv_splits,
                          dtype=torch.float32, device=q.device)  # [B, heads, splits]
    counters = tile_counters(q.device, batch * num_kv_heads)
    block_n = 64 if head_dim <= 128 else 32
    _decode_kernel[(batch, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, out,
        counters,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        scale * _LOG2E, group, head_dim, head_dim_v, num_kv_splits, num_kv_heads,
        BLOCK_H=max(16, next_power_of_2(group)),  # tl.dot needs >= 16 rows
        BLOCK_N=block_n,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        BLOCK_DV=max(16, next_power_of_2(head_dim_v)),
        UPCAST=is_interpreted(_decode_kernel),
        IEEE=q.dtype == torch.float32,
        PDL=pdl_launch(q.device, _decode_kernel),
        num_warps=4, num_stages=2,
    )
    return out
