"""The Triton kernel of decode attention; `attention_decode.py` holds the pure-torch reference it
is tested against, and the docstring there describes the op.

A module of its own so that a CPU engine, which only ever runs the reference, never imports
Triton (~0.2 s and ~70 MB): the kernel set imports this module only when it picks the Triton
kernels (kernels/dispatch.py).

The pool may be narrower than q (`kv_cache_dtype="fp8_e4m3"`): every K/V tile is widened to
q's dtype as it is loaded (exact: bfloat16, float16 and float32 hold every e4m3 value),
so the dots run in q's dtype as over a pool of that dtype; for a pool in q's dtype the cast is
a no-op and the bits are unchanged.

With more than one split (MERGE, the default: `MERGE_IN_STAGE1`), stage 1 merges too: each
program stores its partial and counts itself in its (row, KV head)'s counter
(`triton_compat.tile_counters`), and the last to arrive merges every split's partials of its
query heads, in split order (the same bits whichever program is last), instead of a second
kernel: one launch a layer instead of two. (Session 23 also folded rotary + KV store into
stage 1, measured it and dropped it: docs/benchmarks.md.)
"""

from __future__ import annotations

import torch

from sgl.backend.kernels.triton_compat import (INPUTS_FIRST, arrives_last, is_interpreted,
                                               launch_options, let_next_launch, mma,
                                               next_power_of_2, prefetch_l2, tile_counters, tl,
                                               triton, wait_for_inputs)

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
def _split_range(SeqLens, ReqPoolIdx, b, split, num_splits, BLOCK_N: tl.constexpr):
    """Row b's length and table row, and the keys [start, end) of its split `split`."""
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    # Split length: an even share rounded up to whole BLOCK_N tiles, so a short sequence fills
    # only the first splits and the rest exit at once (cheap, and graph-safe).
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    return seq_len, row, split_len, start, end


@triton.jit
def _prefetch_first_tile(K, V, ReqToToken, row, start, end, kv_head, stride_ks, stride_kh,
                         stride_vs, stride_vh, stride_r2t, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for the keys and values of the split's first tile: LINES 128-byte lines a row."""
    pos = start + tl.arange(0, BLOCK_N)
    slots = tl.load(ReqToToken + row * stride_r2t + pos, mask=pos < end, other=0).to(tl.int64)
    lines = tl.arange(0, LINES)[None, :]
    prefetch_l2(K + slots[:, None] * stride_ks + kv_head * stride_kh + lines * (BLOCK_D // LINES))
    prefetch_l2(V + slots[:, None] * stride_vs + kv_head * stride_vh + lines * (BLOCK_DV // LINES))


@triton.jit
def _decode_stage1(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, MidO, MidLse, Out,
    Counters,  # MERGE's (else unused)
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_r2t,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2 (exp2 is cheaper)
    group, head_dim, head_dim_v, num_splits,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
    DIRECT: tl.constexpr, MERGE: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr,
    INPUTS_FIRST: tl.constexpr, LINES: tl.constexpr,
):
    # DIRECT (one split): each program holds whole rows and writes the output itself, with the
    # bits stage 2 would give (its merge of a single split multiplies by 1 and divides by 1).
    if DIRECT or not MERGE:  # (MERGE: once every program has finished its loop, below)
        let_next_launch(PDL)  # the GEMV (direct) or stage 2 after may start (triton_compat)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Before the wait (triton_compat.INPUTS_FIRST): the step's inputs, and an L2 prefetch of
    # the first tile's keys and values, whose trip from memory then overlaps the kernel before
    # (rotary + KV store, which writes the new token's row: that row is read after the wait).
    if INPUTS_FIRST:
        seq_len, row, split_len, start, end = _split_range(SeqLens, ReqPoolIdx, b, split,
                                                           num_splits, BLOCK_N)
        if LINES:
            _prefetch_first_tile(K, V, ReqToToken, row, start, end, kv_head, stride_ks,
                                 stride_kh, stride_vs, stride_vh, stride_r2t, BLOCK_N, BLOCK_D,
                                 BLOCK_DV, LINES)
    wait_for_inputs(WAIT)  # (launched early itself: the kernel before may still be running)
    if not INPUTS_FIRST:
        seq_len, row, split_len, start, end = _split_range(SeqLens, ReqPoolIdx, b, split,
                                                           num_splits, BLOCK_N)

    offs_h = tl.arange(0, BLOCK_H)  # rows: the query heads of this KV head (padded to >= 16)
    heads = kv_head * group + offs_h
    h_mask = offs_h < group
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < head_dim
    dv_mask = offs_dv < head_dim_v
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
        ).to(q.dtype)  # [BLOCK_N, BLOCK_D]; a float8 pool widened (exact), else a no-op
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
        ).to(q.dtype)  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST, IEEE)
        m_i = m_new

    # An empty split (start >= end) leaves l_i = 0, m_i = -inf: it stores lse = -inf, acc = 0,
    # and the merge gives it zero weight.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    hv_mask = h_mask[:, None] & dv_mask[None, :]
    out = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
    if DIRECT:
        tl.store(out, (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=hv_mask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        mid_o = MidO + b.to(tl.int64) * stride_mob + heads[:, None] * stride_moh
        mid_lse = MidLse + b.to(tl.int64) * stride_mlb + heads * stride_mlh
        tl.store(mid_o + split * stride_mos + offs_dv[None, :], acc / l_safe[:, None],
                 mask=hv_mask)
        tl.store(mid_lse + split, lse, mask=h_mask)
        if MERGE:
            # The GEMV after may start loading its weights once every program is here (from
            # the start: Q4 3% slower in session 23 across engines; inside one in session 28,
            # Q4 0.989x, FP8 1.005-1.010x: within noise, not kept)
            let_next_launch(PDL)
            counter = Counters + b * tl.num_programs(1) + kv_head
            if arrives_last(counter, num_splits):  # every split's partial is stored
                tl.store(counter, 0)  # (for the next launch)
                used = tl.cdiv(seq_len, tl.maximum(split_len, 1))  # the splits with keys
                _merge_splits(MidO, MidLse, Out, b.to(tl.int64), kv_head * group, group, used,
                              stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
                              stride_ob, stride_oh, head_dim_v, BLOCK_G, BLOCK_C, BLOCK_DV)


@triton.jit
def _merge_splits(MidO, MidLse, Out, b, head0, group, used,
                  stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob,
                  stride_oh, head_dim_v,
                  BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Stage 2 for the query heads head0 .. head0 + group - 1 of row b: the first `used`
    splits' partials merged by their log-sum-exp, BLOCK_C splits a load (one round trip for
    their lse and partials), in split order, online (each chunk rescales the sums so far, as
    the loop over keys does). Read past L1: other SMs wrote them."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, BLOCK_C)
    offs_dv = tl.arange(0, BLOCK_DV)
    g_mask = offs_g < group
    heads = head0 + offs_g
    lse_rows = MidLse + b * stride_mlb + heads[:, None] * stride_mlh  # [BLOCK_G, 1]
    o_rows = MidO + b * stride_mob + heads[:, None, None] * stride_moh  # [BLOCK_G, 1, 1]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of the lse
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    dv_mask = (offs_dv < head_dim_v)[None, None, :]
    for c0 in range(0, used, BLOCK_C):
        c_mask = g_mask[:, None] & (c0 + offs_c < used)[None, :]  # [BLOCK_G, BLOCK_C]
        lse = tl.load(lse_rows + c0 + offs_c[None, :], mask=c_mask, other=float("-inf"),
                      cache_modifier=".cg")
        parts = tl.load(o_rows + (c0 + offs_c)[None, :, None] * stride_mos
                        + offs_dv[None, None, :], mask=c_mask[:, :, None] & dv_mask,
                        other=0.0, cache_modifier=".cg")  # [BLOCK_G, BLOCK_C, BLOCK_DV]
        m_new = tl.maximum(m, tl.max(lse, axis=1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # (padded heads: no keys)
        rescale = tl.exp2(m - m_new)  # the chunks before (none yet: exp2(-inf) = 0)
        w = tl.exp2(lse - m_new[:, None])  # empty splits weigh exp2(-inf) = 0
        denom = denom * rescale + tl.sum(w, axis=1)
        acc = acc * rescale[:, None] + tl.sum(parts * w[:, :, None], axis=1)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=g_mask[:, None] & (offs_dv < head_dim_v)[None, :])


@triton.jit
def _decode_stage2(
    MidO, MidLse, Out,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    head_dim_v, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr,
):
    let_next_launch(PDL)  # the GEMV after may start loading its weights (triton_compat: PDL)
    wait_for_inputs(WAIT)  # (launched early itself: stage 1 may still be running)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_mask = offs_s < num_splits
    dv_mask = offs_dv < head_dim_v
    lse = tl.load(MidLse + b * stride_mlb + h * stride_mlh + offs_s, mask=s_mask,
                  other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (seq_len 0): avoid -inf - -inf
    w = tl.exp2(lse - m)  # empty splits weigh exp2(-inf) = 0
    denom = tl.sum(w, axis=0)
    parts = tl.load(
        MidO + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_dv[None, :],
        mask=s_mask[:, None] & dv_mask[None, :], other=0.0,
    )  # [BLOCK_S, BLOCK_DV]
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_dv, out.to(Out.dtype.element_ty),
             mask=dv_mask)


# [0] False: the splits are merged by stage 2's kernel, after stage 1 (as before session 23:
# the before of bench/gpu_bench.py's A/B runs)
MERGE_IN_STAGE1 = [True]


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
    # One split: stage 1 writes the output itself (no partials, no merge). Else fp32 partials,
    # allocated per call (under graph capture they come from the graph's pool).
    direct = num_kv_splits == 1
    merge = MERGE_IN_STAGE1[0] and not direct
    if direct:
        mid_o = mid_lse = out  # (unused)
        mid_strides = (0,) * 5
    else:
        mid_o = torch.empty(batch, num_heads, num_kv_splits, head_dim_v,
                            dtype=torch.float32, device=q.device)  # [B, heads, splits, head_dim_v]
        mid_lse = torch.empty(batch, num_heads, num_kv_splits,
                              dtype=torch.float32, device=q.device)  # [B, heads, splits]
        mid_strides = (*mid_o.stride()[:3], *mid_lse.stride()[:2])
    counters = tile_counters(q.device, batch * num_kv_heads) if merge else out
    block_n = 64 if head_dim <= 128 else 32
    block_d = max(16, next_power_of_2(head_dim))
    block_s = next_power_of_2(num_kv_splits)
    block_g = next_power_of_2(group)
    options = launch_options(q.device, _decode_stage1)
    # Launched early, it prefetches its first tile's rows (128-byte lines, LINES a row) while
    # the kernel before runs; launched normally (or interpreted: no PTX) there is no one to
    # overlap.
    lines = max(1, block_d * k_buffer.element_size() // 128) if options["WAIT"] else 0
    _decode_stage1[(batch, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, out,
        counters,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        *mid_strides, out.stride(0), out.stride(1),
        scale * _LOG2E, group, head_dim, head_dim_v, num_kv_splits,
        BLOCK_H=max(16, next_power_of_2(group)),  # tl.dot needs >= 16 rows
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=max(16, next_power_of_2(head_dim_v)),
        BLOCK_G=block_g,
        BLOCK_C=max(1, min(block_s, 32 // block_g)),  # splits a merge load takes
        UPCAST=is_interpreted(_decode_stage1),
        IEEE=q.dtype == torch.float32,
        DIRECT=direct, MERGE=merge, INPUTS_FIRST=INPUTS_FIRST[0], LINES=lines, **options,
        num_warps=4, num_stages=2,
    )
    if direct or merge:
        return out
    _decode_stage2[(batch, num_heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        head_dim_v, num_kv_splits,
        BLOCK_S=block_s,
        BLOCK_DV=next_power_of_2(head_dim_v),
        **launch_options(q.device, _decode_stage2), num_warps=4,
    )
    return out
