"""The 4-bit decode GEMV on the tensor cores (Triton, CUDA): `QGemvConfig(unpack="mma")`,
served through triton_gemv.qgemv.

Why: the lop3 kernel (quant/triton_q4gemv.py) spends ~5 instructions per weight on the CUDA
cores and is issue-bound at 1.3-2.6 TB/s. Here the multiply-adds go to the tensor cores: a
program dequantizes its [BLOCK_N, BLOCK_K] weight tile to bf16 in registers and makes it
the first operand of `tl.dot`, the rows of x the second, padded with zero columns to XCOLS
(y^T = W x^T, "swap AB": the weights fill the MMA's M dimension, x its small N). Per 4
weights (2 code bytes b0 b1, one inline-asm call):

    prmt           b0 -> bits 0-7, b1 -> bits 16-23 (one register)
    shr            the high nibbles down to bits 0-3 and 16-19
    2 x lop3       (v & 0x000F000F) | 0x43004300: two bf16 128 + code, exactly
    2 x fma.bf16x2 (128 + code) * s - 128 * s: code * s, rounded once to bf16

1.5 instructions per weight. -128 * s is exact in bf16 (a power of two times the bf16
scale), so the FMA's one rounding is that of code * s: the weight is the reference's up to
bf16 rounding of the scale and of the product. The asm is elementwise (each output element
from its own byte and scale): Triton moves the dot operand's layout up through it to the
code load, and the codes take the trip through shared memory as bytes (2 bytes a thread
per load, in the MMA's operand layout).

Compiled for sm_90 (Triton 3.9's ptxas; SASS by nvdisasm, K loop counted, 1 row, factored
scales): ~4.0-4.1 instructions per weight at 64-128 rows by 256-512 weights on 4-8 warps
(wgmma), against the lop3 kernel's 5.4-5.9 at its shipped tiles. Of the 4: 1.5 the
dequantization above, ~0.4 the codes' shared-memory trip (LDS), ~0.5 the groups' scales
(int8 times the super-scale, to bf16, -128 s; Triton recomputes them in the operand layout,
so in each of the 4 threads that share a row), ~0.4 the wgmma (m64n16k16: 8 weights a
thread) and its descriptors, ~0.3 the x tile (zero columns rewritten every step) and the
zeros' sums. Not yet the <= 2 that 4 TB/s needs; the device sweep says what it is worth.

The group's zero is not folded into the weights (that would take a subtraction more per
pair): per group and row of x it is zero[n,g] * sum_i x[g,i], float32, on the CUDA cores
(1/32 of an FMA per weight and row):
    y[n] = sum_k bf16(code * bf16(scale)) x[k]  +  sum_g zero[n,g] * sum_i x[g,i]

Every row of x (ROWS, up to XCOLS) is served by one program, which reads its weight tile
once. The 4-bit byte i of a group holds code i (low nibble) and i+16 (high): the step is two
dots over the half-tiles, the low codes against x's columns g*32 + i, the high ones against
g*32 + 16 + i (as triton_gemm.py does). Only 4-bit codes in groups of 32; plain or factored
scales; split-K and the bias as the other GEMVs (quant/triton_split.py).

x enters the dot as bf16 (float16 or float32 activations are rounded to it): this kernel is
for bf16 models. Checked: the interpreter runs the same math in plain Triton (ASM=False),
against float32 dequantize-then-matmul in tests/test_quant_triton.py (held to the 16-bit
bound); the compiled path for sm_90 in tests/triton_compile_check.py (the bf16x2 FMAs and
the wgmma in the PTX). The asm's bit work is checked only on the device (the sweep compares
every config with the reference before timing it).
"""

from __future__ import annotations

from sgl.backend.kernels.triton_compat import tl, triton
from sgl.backend.quant.triton_gemv import load_group_scales
from sgl.backend.quant.triton_split import k_slice, store_rows

__all__ = ["q4_mma_kernel"]

MAGIC2 = tl.constexpr(0x43004300)  # two bf16 128.0: with a code in the low mantissa bits, 128 + c
LOW2 = tl.constexpr(0x000F000F)  # the low nibble of each 16-bit half


@triton.jit
def _dequant(raw, s, o, ASM: tl.constexpr):
    """raw [BLOCK_N, BKB] code bytes (uint8), s and o the same shape, bf16: the byte's group's
    scale and -128 times it -> (low codes, high codes) * scale, bf16 [BLOCK_N, BKB], each
    4 bytes' columns in the order b0 b2 b1 b3 (module docstring)."""
    if ASM:
        # $2: two code bytes (a 16-bit register); $3: their scales as a bf16 pair, $4: -128
        # times them. Out: $0 the two low codes times the scales, $1 the high ones.
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, u;"
            " cvt.u32.u16 t, $2; prmt.b32 t, t, 0, 0x4140;"  # byte 0 -> bits 0-7, 1 -> 16-23
            " shr.b32 u, t, 4;"
            " lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;"  # 128 + code, two bf16
            " lop3.b32 u, u, 0x000F000F, 0x43004300, 0xEA;"
            " fma.rn.bf16x2 $0, t, $3, $4; fma.rn.bf16x2 $1, u, $3, $4; }",
            "=r,=r,h,r,r", [raw, s, o],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
    sf = s.to(tl.float32)
    c = raw.to(tl.int32)
    lo = ((c & 15).to(tl.float32) * sf).to(tl.bfloat16)  # (exact in float32: one rounding)
    hi = ((c >> 4).to(tl.float32) * sf).to(tl.bfloat16)
    return lo, hi


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b (float32). UPCAST: the interpreter's (triton_compat.mma: its tl.dot takes
    bf16 bit patterns for numbers)."""
    if UPCAST:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a, b, acc)


@triton.jit
def q4_mma_kernel(
    X, CODES, SCALE, ZERO, SUP_S, SUP_Z, B, Y, P, CNT,
    N, G, SLICE_G,
    stride_xm, stride_cn, stride_ym, stride_ps,
    SUPER: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr, EVEN: tl.constexpr, ROWS: tl.constexpr, ROWS2: tl.constexpr,
    XCOLS: tl.constexpr,
    SPLIT: tl.constexpr, LAST: tl.constexpr, ASM: tl.constexpr, UPCAST: tl.constexpr,
):
    # CODES: uint8, 16 bytes per group of 32 codes; stride_cn in bytes
    BKB: tl.constexpr = BLOCK_G * 16  # code bytes of a row per K step
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    g_lo, g_hi = k_slice(pid_s, G, SLICE_G, SPLIT)  # (never empty: split_plan)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    offs_j = tl.arange(0, BKB)  # byte column of a step
    offs_c = tl.arange(0, XCOLS)  # x's rows as the dot's columns (ROWS of them real)
    mask_n = offs_n < N
    rows64 = offs_n.to(tl.int64)
    c_ptrs = CODES + rows64[:, None] * stride_cn + offs_j[None, :]  # [BLOCK_N, BKB]
    k_lo = (offs_j // 16) * 32 + offs_j % 16  # [BKB] K of byte column j's low code
    mask_c = offs_c < ROWS
    xt_ptrs = X + offs_c[None, :].to(tl.int64) * stride_xm + k_lo[:, None]  # [BKB, XCOLS]
    # the zero's side: x's rows by whole groups, [ROWS2, BLOCK_G, 32] (ROWS2: ROWS rounded up
    # to a power of two)
    offs_r = tl.arange(0, ROWS2)
    mask_r = offs_r < ROWS
    xz_ptrs = (X + offs_r[:, None, None].to(tl.int64) * stride_xm
               + offs_g[None, :, None] * 32 + tl.arange(0, 32)[None, None, :])
    acc = tl.zeros([BLOCK_N, XCOLS], dtype=tl.float32)  # y^T, columns past ROWS stay 0
    zacc = tl.zeros([BLOCK_N, ROWS2], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, BLOCK_G):
        gg = g0 + offs_g
        m2 = mask_n[:, None] & (gg < G)[None, :]
        if EVEN:  # no tile crosses the N or the G edge
            raw = tl.load(c_ptrs + g0 * 16)
            s, z = load_group_scales(SCALE, ZERO, SUP_S, SUP_Z, rows64, gg, G, m2, False, SUPER)
            xa = tl.load(xt_ptrs + g0 * 32, mask=mask_c[None, :], other=0.0)
            xb = tl.load(xt_ptrs + g0 * 32 + 16, mask=mask_c[None, :], other=0.0)
            xz = tl.load(xz_ptrs + g0 * 32, mask=mask_r[:, None, None], other=0.0)
            xz = xz.to(tl.float32)
        else:
            mask_j = (g0 + offs_j // 16) < G
            raw = tl.load(c_ptrs + g0 * 16, mask=mask_n[:, None] & mask_j[None, :], other=0)
            s, z = load_group_scales(SCALE, ZERO, SUP_S, SUP_Z, rows64, gg, G, m2, True, SUPER)
            mx = mask_j[:, None] & mask_c[None, :]
            xa = tl.load(xt_ptrs + g0 * 32, mask=mx, other=0.0)
            xb = tl.load(xt_ptrs + g0 * 32 + 16, mask=mx, other=0.0)
            xz = tl.load(xz_ptrs + g0 * 32,
                         mask=mask_r[:, None, None] & (gg < G)[None, :, None], other=0.0)
            xz = xz.to(tl.float32)
        sb = s.to(tl.bfloat16)
        ob = (s * -128.0).to(tl.bfloat16)  # -128 * sb exactly (a power of two)
        sb = tl.reshape(tl.broadcast_to(sb[:, :, None], (BLOCK_N, BLOCK_G, 16)), (BLOCK_N, BKB))
        ob = tl.reshape(tl.broadcast_to(ob[:, :, None], (BLOCK_N, BLOCK_G, 16)), (BLOCK_N, BKB))
        lo, hi = _dequant(raw, sb, ob, ASM)
        acc = _dot(lo, xa.to(tl.bfloat16), acc, UPCAST)
        acc = _dot(hi, xb.to(tl.bfloat16), acc, UPCAST)
        xsum = tl.sum(xz, axis=2)  # [ROWS2, BLOCK_G]
        zacc += tl.sum(z[:, None, :] * xsum[None, :, :], axis=2)
    n_blocks = tl.cdiv(N, BLOCK_N)
    for r in tl.static_range(ROWS):
        y = (tl.sum(tl.where(offs_c[None, :] == r, acc, 0.0), axis=1)
             + tl.sum(tl.where(offs_r[None, :] == r, zacc, 0.0), axis=1))
        row = tl.full((), r, tl.int32)
        store_rows(y, B, Y, P, CNT, row, pid_n, pid_s, n_blocks, offs_n, mask_n, N, stride_ym,
                   stride_ps, HAS_BIAS, SPLIT, LAST)
