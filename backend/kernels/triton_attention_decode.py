"""The Triton kernel of decode attention; `attention_decode.py` holds the pure-torch reference it
is tested against, and the docstring there describes the op.

A module of its own so that a CPU engine, which only ever runs the reference, never imports
Triton (~0.2 s and ~70 MB): the kernel set imports this module only when it picks the Triton
kernels (kernels/dispatch.py).

The pool may be narrower than q (`kv_cache_dtype="fp8_e4m3"`): every K/V tile is widened to
q's dtype as it is loaded (exact: bfloat16, float16 and float32 hold every e4m3 value),
so the dots run in q's dtype as over a pool of that dtype; for a pool in q's dtype the cast is
a no-op and the bits are unchanged.

One launch a layer (`rotary_decode_attention_triton`, what the attention backend runs in a
decode step) where the unfused op takes three (rotary + KV store, stage 1, stage 2):
- ROTARY: each stage-1 program rotates its query heads as it loads them. The new token's key
  is not in the pool yet: the programs' loops stop before the row's last position, and the
  program whose split holds it takes that key as one more step after its loop, from the new
  k (rotated) and v of its KV head rounded as the pool holds them; split 0's program stores
  them in the pool. So no program waits for another's store, and the op needs what every
  decode step has: each row's `out_cache_loc` is the slot of its last position.
- MERGE (more than one split): each program stores its partial, counts itself in its (row,
  KV head)'s counter (`triton_compat.tile_counters`), and the last to arrive merges all the
  splits' partials of its query heads, in split order (the same bits whichever program is
  last), instead of a second kernel.
Single-stream decode of the 8B shape, one layer: see docs/benchmarks.md (session 23).
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
def _rope(CosSin, Pos, b, offs_d, head_dim, stride_cs, d_mask):
    """Row b's rotation laid out over a whole head (neox style): each dim's partner (d + half
    in the first half, d - half in the second) and its cos and sin, float32, sin negated in
    the first half."""
    half = head_dim // 2
    first = offs_d < half
    partner = tl.where(first, offs_d + half, offs_d - half)
    cs = CosSin + tl.load(Pos + b).to(tl.int64) * stride_cs + tl.where(first, offs_d, partner)
    cos = tl.load(cs, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs + half, mask=d_mask, other=0.0).to(tl.float32)
    return partner, cos, tl.where(first, -sin, sin)


@triton.jit
def _rotated(X, offs, partner, mask, cos, sin):
    """X[offs] rotated (neox style, float32): x cos - x[d + half] sin in the first half,
    x cos + x[d - half] sin in the second (`sin` comes negated in the first half)."""
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(X + partner, mask=mask, other=0.0).to(tl.float32)
    return x * cos + xp * sin


@triton.jit
def _decode_stage1(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, MidO, MidLse, Out,
    Pos, NewK, NewV, CosSin, Loc, Counters,  # ROTARY's and MERGE's (else unused)
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_r2t,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    stride_nkb, stride_nkh, stride_nvb, stride_nvh, stride_cs,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2 (exp2 is cheaper)
    group, head_dim, head_dim_v, num_splits,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
    DIRECT: tl.constexpr, ROTARY: tl.constexpr, MERGE: tl.constexpr, PDL: tl.constexpr,
):
    # DIRECT (one split): each program holds whole rows and writes the output itself, with the
    # bits stage 2 would give (its merge of a single split multiplies by 1 and divides by 1).
    if DIRECT or MERGE:
        let_next_launch(PDL)  # the GEMV after may start loading its weights (triton_compat)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    # Split length: an even share rounded up to whole BLOCK_N tiles, so a short sequence fills
    # only the first splits and the rest exit at once (cheap, and graph-safe).
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)  # rows: the query heads of this KV head (padded to >= 16)
    heads = kv_head * group + offs_h
    h_mask = offs_h < group
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < head_dim
    dv_mask = offs_dv < head_dim_v
    q_rows = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_mask = h_mask[:, None] & d_mask[None, :]
    if ROTARY:
        partner, cos, sin = _rope(CosSin, Pos, b, offs_d, head_dim, stride_cs, d_mask)
        q = _rotated(q_rows, offs_d[None, :], partner[None, :], q_mask, cos[None, :],
                     sin[None, :]).to(Q.dtype.element_ty)  # [BLOCK_H, BLOCK_D]
        last = seq_len - 1  # the new token's position: its key is not in the pool yet
        pool_end = tl.minimum(end, last)
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)  # [BLOCK_H, BLOCK_D]
        pool_end = end

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(logit - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for n0 in range(start, pool_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < pool_end
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

    if ROTARY:
        # The new token's k and v as the pool holds them: k rotated and rounded to the
        # model's dtype, then (both) to the pool's, as rotary_kv_store stores them.
        partner, cos, sin = _rope(CosSin, Pos, b, offs_d, head_dim, stride_cs, d_mask)
        new_k = _rotated(NewK + b.to(tl.int64) * stride_nkb + kv_head * stride_nkh, offs_d,
                         partner, d_mask, cos, sin)
        new_k = new_k.to(NewK.dtype.element_ty).to(K.dtype.element_ty)  # [BLOCK_D]
        new_v = tl.load(NewV + b.to(tl.int64) * stride_nvb + kv_head * stride_nvh + offs_dv,
                        mask=dv_mask, other=0.0).to(V.dtype.element_ty)  # [BLOCK_DV]
        if split == 0:
            loc = tl.load(Loc + b).to(tl.int64)  # int64: slot * stride can pass 2**31
            tl.store(K + loc * stride_ks + kv_head * stride_kh + offs_d, new_k, mask=d_mask)
            tl.store(V + loc * stride_vs + kv_head * stride_vh + offs_dv, new_v, mask=dv_mask)
        if (start <= last) & (last < end):  # this split's last key: the loop's step, for one
            k_row = new_k.to(q.dtype).to(tl.float32)[None, :]
            qk = tl.sum(q.to(tl.float32) * k_row, axis=1) * qk_scale  # [BLOCK_H]
            m_new = tl.maximum(m_i, qk)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new)
            l_i = l_i * alpha + p
            p = p.to(q.dtype).to(tl.float32)  # (the loop's products take p in v's dtype)
            acc = acc * alpha[:, None] + p[:, None] * new_v.to(q.dtype).to(tl.float32)[None, :]
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
            tl.debug_barrier()  # all of this program's stores before the release below
            counter = Counters + b * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:  # the last: every split's partial is stored
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
    splits' partials merged by their log-sum-exp, BLOCK_C splits a load (a round trip each),
    in split order. Read past L1: other SMs wrote them."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, BLOCK_C)
    offs_dv = tl.arange(0, BLOCK_DV)
    g_mask = offs_g < group
    heads = head0 + offs_g
    lse_rows = MidLse + b * stride_mlb + heads[:, None] * stride_mlh  # [BLOCK_G, 1]
    o_rows = MidO + b * stride_mob + heads[:, None, None] * stride_moh  # [BLOCK_G, 1, 1]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for c0 in range(0, used, BLOCK_C):
        lse = tl.load(lse_rows + c0 + offs_c[None, :],
                      mask=g_mask[:, None] & (c0 + offs_c < used)[None, :],
                      other=float("-inf"), cache_modifier=".cg")  # [BLOCK_G, BLOCK_C]
        m = tl.maximum(m, tl.max(lse, axis=1))
    m = tl.where(m == float("-inf"), 0.0, m)  # no split with keys (seq_len 0)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    dv_mask = (offs_dv < head_dim_v)[None, None, :]
    for c0 in range(0, used, BLOCK_C):
        c_mask = g_mask[:, None] & (c0 + offs_c < used)[None, :]  # [BLOCK_G, BLOCK_C]
        lse = tl.load(lse_rows + c0 + offs_c[None, :], mask=c_mask, other=float("-inf"),
                      cache_modifier=".cg")
        w = tl.exp2(lse - m[:, None])  # empty splits weigh exp2(-inf) = 0
        parts = tl.load(o_rows + (c0 + offs_c)[None, :, None] * stride_mos
                        + offs_dv[None, None, :], mask=c_mask[:, :, None] & dv_mask,
                        other=0.0, cache_modifier=".cg")  # [BLOCK_G, BLOCK_C, BLOCK_DV]
        denom += tl.sum(w, axis=1)
        acc += tl.sum(parts * w[:, :, None], axis=1)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=g_mask[:, None] & (offs_dv < head_dim_v)[None, :])


@triton.jit
def _decode_stage2(
    MidO, MidLse, Out,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    head_dim_v, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, PDL: tl.constexpr,
):
    let_next_launch(PDL)  # the GEMV after may start loading its weights (triton_compat: PDL)
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
    """Decode attention over keys already in the pool: stage 1, then stage 2's kernel."""
    return _decode(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale,
                   num_kv_splits, out, None, merge=False)


def rotary_decode_attention_triton(
    positions: torch.Tensor,  # [B] int
    q: torch.Tensor,  # [B, heads, head_dim], not rotated (left as it is)
    k: torch.Tensor,  # [B, kv_heads, head_dim], not rotated: stored rotated at out_cache_loc
    v: torch.Tensor,  # [B, kv_heads, head_dim_v]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    k_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim_v]
    out_cache_loc: torch.Tensor,  # [B] int: each row's new slot, its last key's
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int32
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    num_kv_splits: int = 1,
) -> torch.Tensor:  # [B, heads, head_dim_v]
    """`rotary_kv_store` then `decode_attention`, in one launch (module docstring)."""
    if cos_sin_cache.shape[-1] < q.shape[-1]:  # partial rotary: the two ops
        from sgl.backend.kernels.triton_rotary import rotary_kv_store_triton

        q = rotary_kv_store_triton(positions, q, k, v, cos_sin_cache, k_buffer, v_buffer,
                                   out_cache_loc)
        return decode_attention_triton(q, k_buffer, v_buffer, req_to_token, req_pool_indices,
                                       seq_lens, scale, num_kv_splits)
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    new = (positions, k, v, cos_sin_cache, out_cache_loc)
    return _decode(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale,
                   num_kv_splits, None, new, merge=MERGE_IN_STAGE1[0])


# [0] False: the fused op merges its splits in stage 2's kernel, as decode_attention does (the
# before of bench/gpu_bench.py's A/B runs)
MERGE_IN_STAGE1 = [True]


def _decode(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
            req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
            scale: float, num_kv_splits: int, out: torch.Tensor | None,
            new: tuple[torch.Tensor, ...] | None, merge: bool) -> torch.Tensor:
    """The launches of both ops: `new` (positions, k, v, cos_sin_cache, out_cache_loc) asks
    for ROTARY; `merge` for MERGE where there is more than one split."""
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
    # One split: stage 1 writes the output itself (no partials, no stage 2). Else fp32 partials,
    # allocated per call (under graph capture they come from the graph's pool).
    direct = num_kv_splits == 1
    merge = merge and not direct
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
    if new is not None:
        positions, new_k, new_v, cos_sin, loc = new
        new_strides = (*new_k.stride()[:2], *new_v.stride()[:2], cos_sin.stride(0))
    else:
        positions = new_k = new_v = cos_sin = loc = out  # (unused)
        new_strides = (0,) * 5
    pdl = pdl_launch(q.device, _decode_stage2)
    block_n = 64 if head_dim <= 128 else 32
    block_s = next_power_of_2(num_kv_splits)
    block_g = next_power_of_2(group)
    _decode_stage1[(batch, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, out,
        positions, new_k, new_v, cos_sin, loc, counters,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        *mid_strides, out.stride(0), out.stride(1), *new_strides,
        scale * _LOG2E, group, head_dim, head_dim_v, num_kv_splits,
        BLOCK_H=max(16, next_power_of_2(group)),  # tl.dot needs >= 16 rows
        BLOCK_N=block_n,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        BLOCK_DV=max(16, next_power_of_2(head_dim_v)),
        BLOCK_G=block_g,
        BLOCK_C=max(1, min(block_s, 32 // block_g)),  # splits a merge load takes
        UPCAST=is_interpreted(_decode_stage1),
        IEEE=q.dtype == torch.float32,
        DIRECT=direct, ROTARY=new is not None, MERGE=merge, PDL=pdl and (direct or merge),
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
        PDL=pdl, num_warps=4,
    )
    return out
