"""The Triton kernel of extend (prefill) attention; `attention_extend.py` holds the pure-torch
reference it is tested against, and the docstring there describes the op.

A module of its own so that a CPU engine, which only ever runs the reference, never imports
Triton (~0.2 s and ~70 MB): the kernel set imports this module only when it picks the Triton
kernels (kernels/dispatch.py).

The pool may be narrower than q (`kv_cache_dtype="fp8_e4m3"`): every K/V tile is widened to
q's dtype as it is loaded (exact: bfloat16, float16 and float32 hold every e4m3 value),
so the dots run in q's dtype as over a pool of that dtype; for a pool in q's dtype the cast is
a no-op and the bits are unchanged.
"""

from __future__ import annotations

import torch

from sgl.backend.kernels.triton_compat import cdiv, is_interpreted, mma, next_power_of_2, tl, triton

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_range(
    q, acc, m_i, l_i, K, V, ReqToToken, row, kv_head, q_pos, lo, hi,
    stride_ks, stride_kh, stride_vs, stride_vh, qk_scale, head_dim, head_dim_v,
    CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Fold keys at positions [lo, hi) into the online softmax state (m_i, l_i, acc)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < hi
        slots = tl.load(ReqToToken + row + pos, mask=n_mask, other=0).to(tl.int64)
        k = tl.load(
            K + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            mask=n_mask[:, None] & (offs_d[None, :] < head_dim), other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_D]; a float8 pool widened (exact), else a no-op
        qk = mma(q, tl.trans(k), UPCAST, IEEE) * qk_scale  # [BLOCK_M, BLOCK_N], base-2 logits
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        # Each row sees >= 1 key before its first fully masked tile (key `lo` of the diagonal
        # loop is <= every row's position), so m_new stays finite and p never turns NaN.
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_dv[None, :],
            mask=n_mask[:, None] & (offs_dv[None, :] < head_dim_v), other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST, IEEE)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqPoolIdx, SeqLens, PrefixLens, ExtendLens, ExtendStart,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_r2t,
    qk_scale, group, head_dim, head_dim_v,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    m_block = tl.program_id(0)
    b = tl.program_id(1)
    head = tl.program_id(2)
    extend_len = tl.load(ExtendLens + b).to(tl.int32)
    block_start = m_block * BLOCK_M
    if block_start >= extend_len:
        return
    kv_head = head // group
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    first_token = tl.load(ExtendStart + b).to(tl.int64)
    row = tl.load(ReqPoolIdx + b).to(tl.int64) * stride_r2t

    offs_m = block_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < extend_len
    q_pos = prefix + offs_m  # [BLOCK_M] sequence positions of this block's queries
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    tokens = first_token + offs_m.to(tl.int64)
    q = tl.load(
        Q + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & (offs_d[None, :] < head_dim), other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # Keys before `full_end` are visible to every row of the block. It is rounded down to whole
    # BLOCK_N tiles, so every row folds its keys in tiles at fixed positions (0, BLOCK_N, ...)
    # whatever the prefix: a token's output then has the same bits whether its prompt came in
    # one chunk or several, or after a cached prefix of any length (a fully masked tile leaves
    # the state exactly as it was).
    full_end = (prefix + block_start) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(seq_len, prefix + block_start + BLOCK_M)
    acc, m_i, l_i = _attend_range(
        q, acc, m_i, l_i, K, V, ReqToToken, row, kv_head, q_pos, 0, full_end,
        stride_ks, stride_kh, stride_vs, stride_vh, qk_scale, head_dim, head_dim_v,
        False, BLOCK_N, BLOCK_D, BLOCK_DV, UPCAST, IEEE,
    )
    acc, m_i, l_i = _attend_range(
        q, acc, m_i, l_i, K, V, ReqToToken, row, kv_head, q_pos, full_end, kv_end,
        stride_ks, stride_kh, stride_vs, stride_vh, qk_scale, head_dim, head_dim_v,
        True, BLOCK_N, BLOCK_D, BLOCK_DV, UPCAST, IEEE,
    )
    out = acc / l_i[:, None]
    tl.store(
        Out + tokens[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_mask[:, None] & (offs_dv[None, :] < head_dim_v),
    )


def extend_attention_triton(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim] (new k already stored)
    v_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim_v]
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int32
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B]
    extend_prefix_lens: torch.Tensor,  # [B]
    extend_seq_lens: torch.Tensor,  # [B]
    extend_start: torch.Tensor,  # [B]
    scale: float,
    max_extend_len: int | None = None,  # host int sizing the grid; computed (a sync) if None
    out: torch.Tensor | None = None,  # [T, heads, head_dim_v]
    *,
    config: tuple[int, int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, warps, stages)
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k_buffer.shape[1], v_buffer.shape[-1]
    assert num_heads % num_kv_heads == 0, "heads must be a multiple of kv heads"
    assert q.stride(-1) == 1 and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    assert req_to_token.stride(-1) == 1
    batch = req_pool_indices.shape[0]
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    if max_extend_len is None:
        max_extend_len = int(extend_seq_lens.max().item()) if batch > 0 else 0
    if num_tokens == 0 or batch == 0 or max_extend_len == 0:
        return out
    block_d = max(16, next_power_of_2(head_dim))
    # Measured on the H200 (bench/gpu_kernels.py sweep): 64x64 tiles, 3 stages are within ~10%
    # of the best config at every 8B shape tried, and fit the shared memory of older GPUs too.
    default = (64, 64, 4, 3) if block_d <= 128 else (64, 32, 4, 2)
    block_m, block_n, warps, stages = config or default
    _extend_kernel[(cdiv(max_extend_len, block_m), batch, num_heads)](
        q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, seq_lens,
        extend_prefix_lens, extend_seq_lens, extend_start,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0),
        scale * _LOG2E, num_heads // num_kv_heads, head_dim, head_dim_v,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_DV=max(16, next_power_of_2(head_dim_v)),
        UPCAST=is_interpreted(_extend_kernel),
        IEEE=q.dtype == torch.float32,
        num_warps=warps, num_stages=stages,
    )
    return out
