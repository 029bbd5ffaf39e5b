"""The 4-bit decode GEMV with its codes unpacked in registers, one lop3 per code (Triton, CUDA):
`QGemvConfig(unpack="lop3")`, served through triton_gemv.qgemv.

Why a second kernel: compiled for sm_90, the first one (triton_gemv._qgemv_kernel) spends
about 9 instructions per weight (per-byte extraction, conversions, a layout conversion of x
through shared memory every K step, cross-lane sums per group) where streaming at the
memory's speed leaves room for about 3. This one spends, per weight:

    lop3   f = (word & (15 << s)) | 0x4B000000   the float 2^23 + code * 2^s, no conversion
    ffma   t = f * xs - 2^23 * xs                xs = x * 2^-s: t = code * x, one rounding
    fadd   part += t

The FMA is exact up to its one rounding: f * xs is formed exactly inside it, and 2^23 * xs is
a power-of-two multiple of xs, so the sum is code * x, rounded once, as float32's own product
(x * 2^-s is exact too, short of |x| < 2^-114, where it would leave float32's normal range).
The nibble is masked where it lies in its word (s = 0, 4, 8, 12, on the word and on the word
shifted right by 16: every mask stays inside the 23 mantissa bits), so no shift per code;
the x side (x * 2^-s and -2^23 * xs) is computed once per program step and shared by all the
rows a thread holds.

Layout: the program's codes tile loads as [BLOCK_N, BLOCK_G * 4] int32 words (a group's 16
bytes are 4 words, one 128-bit load), reshaped to [BLOCK_N, BLOCK_G, 4] so that a thread owns
whole groups. Word q of group g, byte p holds codes g*32 + 4q + p (low nibble) and
g*32 + 16 + 4q + p (high): the group's 32 activations load as one [BLOCK_G, 32] tile and are
split in registers (reshape, permute, split) into the eight [BLOCK_G, 4] slices (p, nibble)
the words meet. Per group, the word sums reduce in-thread and take the group's scale and
zero as in the first kernel:
    y[n] += scale[n,g] * sum_i code[n,g,i] * x[g,i]  +  zero[n,g] * sum_i x[g,i]

Only 4-bit codes in groups of 32 (every 4-bit GGUF format here); plain or factored scales;
rows of x, split-K and the bias exactly as the first kernel (quant/triton_split.py).
`QGemvConfig.prefetch` loads the next K step before the current one's arithmetic (the loop
peeled once, its operands carried in registers).

Measured (H200, docs/benchmarks.md, session 9): with the per-step work (the x split, scales,
sums) ~5 instructions per weight in all; 0.64-0.80x the first kernel's time at the 8B shapes,
1.3-2.6 TB/s of the 4.75-bit bytes, best on small programs (8-16 rows, 1-2 warps); the
prefetch lost there (10-25%), as did Triton's num_stages (no effect) and split-K.
"""

from __future__ import annotations

from sgl.backend.kernels.triton_compat import tl, triton
from sgl.backend.quant.triton_split import gemv_program, k_slice, store_rows

__all__ = ["q4_lop3_kernel"]

MAGIC = tl.constexpr(0x4B000000)  # float32 2^23: with a code c in its low mantissa bits, 2^23 + c
TWO23 = tl.constexpr(8388608.0)  # 2^23


@triton.jit
def _magic(v, MASK: tl.constexpr, ASM: tl.constexpr):
    """float32 2^23 + (v & MASK), MASK within the low 23 bits. ASM: one lop3 (and-or); the
    compiler otherwise emits an and and an or (lop3 takes one immediate)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
            [v, tl.full(v.shape, MASK, tl.int32), tl.full(v.shape, MAGIC, tl.int32)],
            dtype=tl.float32, is_pure=True, pack=1)
    return ((v & MASK) | MAGIC).to(tl.float32, bitcast=True)


@triton.jit
def _nibble_dot(part, v, x, SHIFT: tl.constexpr, ASM: tl.constexpr):
    """part + code * x for the nibble at bit SHIFT of the words v [BLOCK_N, BLOCK_G, 4],
    x [BLOCK_G, 4] float32 (module docstring: exact products)."""
    xs = x * (1.0 / (1 << SHIFT))
    f = _magic(v, 15 << SHIFT, ASM)
    return part + tl.fma(f, xs[None, :, :], (xs * -TWO23)[None, :, :])


@triton.jit
def _group_x(xg, BLOCK_G: tl.constexpr):
    """[BLOCK_G, 32] activations of whole groups -> the eight [BLOCK_G, 4] slices word q meets:
    (byte p, low/high nibble) -> x[g, 16*high + 4q + p], returned low p=0..3, high p=0..3."""
    x5 = tl.permute(tl.reshape(xg, (BLOCK_G, 2, 4, 2, 2)), (0, 2, 4, 3, 1))  # [g,q,p0,p1,h]
    lo, hi = tl.split(x5)  # [g, q, p0, p1]
    lo_a, lo_b = tl.split(lo)  # p1 = 0, 1: [g, q, p0]
    hi_a, hi_b = tl.split(hi)
    lo0, lo1 = tl.split(lo_a)  # p = 0, 1
    lo2, lo3 = tl.split(lo_b)  # p = 2, 3
    hi0, hi1 = tl.split(hi_a)
    hi2, hi3 = tl.split(hi_b)
    return lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3


@triton.jit
def _load_step(c_ptrs, x_ptrs, SCALE, ZERO, SUP_S, SUP_Z, rows64, mask_n, offs_g, offs_w, g0,
               G, SUPER: tl.constexpr, EVEN: tl.constexpr):
    """One K step's operands: codes [BLOCK_N, BLOCK_G * 4] int32, x [BLOCK_G, 32] (x's dtype),
    and the groups' scale and zero [BLOCK_N, BLOCK_G] float32 (factored ones multiplied out)."""
    gg = g0 + offs_g
    s_off = rows64[:, None] * G + gg[None, :]  # [BLOCK_N, BLOCK_G]
    if EVEN:  # no tile crosses the N or the G edge
        raw = tl.load(c_ptrs + g0 * 4)
        xg = tl.load(x_ptrs + g0 * 32)
        s = tl.load(SCALE + s_off).to(tl.float32)
        z = tl.load(ZERO + s_off).to(tl.float32)
        if SUPER > 0:
            sup = rows64[:, None] * (G // SUPER) + gg[None, :] // SUPER
            s = s * tl.load(SUP_S + sup)
            z = z * tl.load(SUP_Z + sup)
    else:
        mask_w = g0 + offs_w // 4 < G
        m2 = mask_n[:, None] & (gg < G)[None, :]
        raw = tl.load(c_ptrs + g0 * 4, mask=mask_n[:, None] & mask_w[None, :], other=0)
        xg = tl.load(x_ptrs + g0 * 32, mask=(gg < G)[:, None], other=0.0)
        s = tl.load(SCALE + s_off, mask=m2, other=0).to(tl.float32)
        z = tl.load(ZERO + s_off, mask=m2, other=0).to(tl.float32)
        if SUPER > 0:
            sup = rows64[:, None] * (G // SUPER) + gg[None, :] // SUPER
            s = s * tl.load(SUP_S + sup, mask=m2, other=0.0)
            z = z * tl.load(SUP_Z + sup, mask=m2, other=0.0)
    return raw, xg, s, z


@triton.jit
def _step_sums(raw, xg, s, z, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
               ASM: tl.constexpr):
    """[BLOCK_N] float32: the step's sum over its groups of scale * sum code * x + zero * sum x."""
    words = tl.reshape(raw, (BLOCK_N, BLOCK_G, 4))  # a thread's groups stay whole
    upper = words >> 16  # bytes 2 and 3 (the masks below drop the sign copies)
    lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3 = _group_x(xg.to(tl.float32), BLOCK_G)
    part = tl.zeros([BLOCK_N, BLOCK_G, 4], dtype=tl.float32)
    part = _nibble_dot(part, words, lo0, 0, ASM)
    part = _nibble_dot(part, words, hi0, 4, ASM)
    part = _nibble_dot(part, words, lo1, 8, ASM)
    part = _nibble_dot(part, words, hi1, 12, ASM)
    part = _nibble_dot(part, upper, lo2, 0, ASM)
    part = _nibble_dot(part, upper, hi2, 4, ASM)
    part = _nibble_dot(part, upper, lo3, 8, ASM)
    part = _nibble_dot(part, upper, hi3, 12, ASM)
    xsum = tl.sum(lo0 + lo1 + lo2 + lo3 + hi0 + hi1 + hi2 + hi3, axis=1)  # [BLOCK_G]
    return tl.sum(tl.sum(part, axis=2) * s + z * xsum[None, :], axis=1)


@triton.jit
def q4_lop3_kernel(
    X, CODES, SCALE, ZERO, SUP_S, SUP_Z, B, Y, P, CNT,
    N, G, SLICE_G,
    stride_xm, stride_cn, stride_ym, stride_ps,
    SUPER: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr, EVEN: tl.constexpr, ROWS_FIRST: tl.constexpr,
    SPLIT: tl.constexpr, LAST: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
):
    # CODES: int32 words, 4 per group of 32 codes; stride_cn in words
    row, pid_n, pid_s = gemv_program(ROWS_FIRST)
    g_lo, g_hi = k_slice(pid_s, G, SLICE_G, SPLIT)  # (never empty: split_plan)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    offs_w = tl.arange(0, BLOCK_G * 4)  # words of a step, 4 per group
    mask_n = offs_n < N
    rows64 = offs_n.to(tl.int64)
    c_ptrs = CODES + rows64[:, None] * stride_cn + offs_w[None, :]  # [BLOCK_N, BLOCK_G * 4]
    x_ptrs = (X + row.to(tl.int64) * stride_xm + offs_g[:, None] * 32
              + tl.arange(0, 32)[None, :])  # [BLOCK_G, 32]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if PREFETCH:  # the next step's loads are issued before this step's arithmetic
        raw, xg, s, z = _load_step(c_ptrs, x_ptrs, SCALE, ZERO, SUP_S, SUP_Z, rows64, mask_n,
                                   offs_g, offs_w, g_lo, G, SUPER, EVEN)
        for g0 in range(g_lo + BLOCK_G, g_hi, BLOCK_G):
            raw2, xg2, s2, z2 = _load_step(c_ptrs, x_ptrs, SCALE, ZERO, SUP_S, SUP_Z, rows64,
                                           mask_n, offs_g, offs_w, g0, G, SUPER, EVEN)
            acc += _step_sums(raw, xg, s, z, BLOCK_N, BLOCK_G, ASM)
            raw, xg, s, z = raw2, xg2, s2, z2
        acc += _step_sums(raw, xg, s, z, BLOCK_N, BLOCK_G, ASM)
    else:
        for g0 in range(g_lo, g_hi, BLOCK_G):
            raw, xg, s, z = _load_step(c_ptrs, x_ptrs, SCALE, ZERO, SUP_S, SUP_Z, rows64,
                                       mask_n, offs_g, offs_w, g0, G, SUPER, EVEN)
            acc += _step_sums(raw, xg, s, z, BLOCK_N, BLOCK_G, ASM)
    store_rows(acc, B, Y, P, CNT, row, pid_n, pid_s, tl.cdiv(N, BLOCK_N), offs_n, mask_n, N,
               stride_ym, stride_ps, HAS_BIAS, SPLIT, LAST)
