"""The decode GEMV on GGUF codes on the tensor cores, in CUDA C compiled at run time (NVRTC,
through torch): a few rows of bf16 activations against a 4-bit or 8-bit GGUF weight in its
own layout.

    mma_gemv(x [M, K] bf16, w: QuantizedWeight, bias [N] | None) -> [M, N] bf16, M <= 8
    available() -> whether the kernel compiles and agrees with its reference here; cached

Why: the Triton lop3 GEMV (triton_q4gemv.py) does its multiply-adds on the CUDA cores, ~5
instructions per weight, and streams an 8B decode step's 4-bit weights at ~1.8 TB/s of the
H200's ~4.2 (its 8-bit path, the first kernel's, is slower still). Here they run on the tensor
cores (`mma.sync` m16n8k16, bf16 in, float32 accumulate): a `lop3` makes two codes bf16 at
once, `128 + code` (the nibble in the low mantissa bits of 128.0, exact), and an mma takes
eight per lane: ~2.2 SASS instructions per 4-bit weight at one row, 4.2 per 8-bit one (the
same per byte: bench/cuda_kernel_stats.py). bf16 x bf16 products are exact in float32, so
every product is `(128 + code) * x` exactly, as the lop3 kernel's `code * x` is; the offset
comes off per group with the group's activation sum:

    y[n] += scale[n,g] * sum_i (OFFSET + code[n,g,i]) * x[g,i]
            + (zero[n,g] - OFFSET scale[n,g]) * xsum[g]

4-bit codes: OFFSET 128. 8-bit codes (int8, any value): a byte is two nibbles, the low one as
is and the high one with its top bit inverted (one lop3 each, its table inverting the bits
that FLIP names), so that low + 16 high = code + 128; the low nibbles meet x and the high ones
16 x (exact: a power of two) in two mmas, and OFFSET is 128 + 17 * 128 = 2304.

The bytes are read where QuantizedWeight keeps them (no second copy, no repacking), 16 at a
time: a chunk. A 4-bit chunk is a group of 32 codes, byte i holding code i (low nibble) and
code i+16 (high); an 8-bit chunk is 16 codes, a Q6_K group or half a Q8_0 one (CH chunks per
scale).

Lanes and operands. Lane (gid = lane / 4, c = lane % 4) loads whole chunks with 16-byte
loads: of weight rows gid and gid + 8 of its tile, the chunks SPAN c .. SPAN c + SPAN - 1 of
each step of 4 SPAN chunks (a warp reads 64 SPAN contiguous bytes of each of its 16 rows).
An mma's operand A is 16 rows by 16 K slots, four slots per lane and row; lane c fills its
slots from its own chunk. 4-bit: word j (bytes 4j..4j+3) gives, one lop3 per pair of nibbles
at bits (s, 16 + s), the pairs s = 0: codes (4j, 4j+2), 4: (16+4j, 18+4j), 8: (4j+1, 4j+3),
12: (17+4j, 19+4j); the first mma of the word takes the first two, the second the others.
8-bit: word j holds codes 4j..4j+3; the low nibbles of (4j, 4j+2) and (4j+1, 4j+3) feed one
mma, their high nibbles the other.
Operand B's column n (the x pairs of the lanes with gid = n, two slots each) is non-zero only
in lane n / 2's slots: the lanes with gid / 2 == c "feed" their column with the x of their
own chunk, in the same slot order (`prmt` from 16-byte loads), the others give zeros. So
column n sums lane n / 2's chunk alone, and C's columns 2c, 2c+1 land in lane c: each lane
ends a sub-step holding its own chunk's sums for its two rows (and two rows of x, one per
column; with one row both hold row 0), applies that chunk's scale once, and the four lanes
of a quad add their partials with two shuffles at the end. The x sums come from the same B
through an mma with all-ones A. More rows of x ride in pairs: each pair its own B and mmas
on the same A registers (the unpacking is shared), up to four pairs.

A program is WARPS warps on TILES tiles of 16 rows; the warps take the steps in turn (K
split) and add their sums in shared memory. Each warp loads a step's codes and scales while
it computes the one before (two steps in registers, taken in turn). Persistent programs (a
few per SM taking tiles in turn, each loading its next tile's first step while it adds up the
one before) were measured in session 21 and dropped: an 8B step's products 1-13% slower at
one and two rows, both code widths, at their best (docs/benchmarks.md).

Measured on the H200 (bench/cuda_gemv_sweep.py, docs/benchmarks.md): an 8B decode step's
4-bit products (32 layers' four, the head as Q4) 2,004 us against the lop3 kernel's 2,407 at
one row; 2,162 against 4,183 at two rows, 2,878 against the tiled kernel's 5,648 at four
(one pass over the weight serves all the rows). Slower and dropped: 4-byte word loads per
group (the first version: 16 half-used sectors per load) and a cp.async pipeline of 2-8 steps
in shared memory per warp (1.5-1.7x slower than the register double buffer at every shape).

It launches early (programmatic dependent launch: `EARLY_LAUNCH`, below), loading its first
step's weights before waiting for the kernel that writes x, and lets the kernel after it
launch as soon as it has asked for them (`CudaGemvConfig.let_next_at_start`). Two ways to
put more of a warp's weights in flight before and during its K loop were measured inside one
engine in session 28 and dropped (docs/benchmarks.md): both register steps loaded before the
wait (the Q4 single stream at 0.954x the shipped rate), and L2 asked for later steps ahead of
their loads with `prefetch.global.L2` (0.80x one step ahead, 0.75x two).

Tried and dropped (session 24): SiLU x mul folded into the gate_up product (a lane's two rows
of an MMA a gate row and its up row, the Triton kernel's five instructions after the sums:
the same bits). Inside one engine the 8B single stream read 419.1 tok/s without it, 417.5
with it and 420.2 with it uncapped (`bench/gpu_ab.py`, three turns each): no gain. With the
small kernels launched early the activation's ~1.6 us overlapped the down product's first
loads already, and the fold's up-row addresses cost registers: at SHORT_K's cap two chunks a
step spilled 32 bytes in the loop, so the capped fold took one.

Compiled per (config, rows, code width, scale form, K), K a constant so that every row and
chunk offset is an immediate of its load: at first use, or ahead and in parallel when the
engine starts (`prepare`, before graph capture), and the machine code is kept on disk for the
next start (`_cubin`). Where NVRTC or the launch is missing, or the self-check disagrees,
`available()` is False and the Triton kernels serve (quant/linear.py). (Session 20 wrote the
ahead-of-time compile and the disk cache after its device time was spent: they ran on CI
with NVRTC replaced, not on a GPU; a cubin that does not load falls back to torch's own
compile-and-load, the path the device ran.)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch

from sgl.backend.quant.factored import factor
from sgl.backend.quant.weight import QuantizedWeight

__all__ = ["CUDA_GEMV_DEFAULTS", "CudaGemvConfig", "MAX_ROWS", "SHORT_K", "SOURCE", "available",
           "chunking", "config_for", "default_config", "fitted", "mma_gemv", "prepare", "serves",
           "supports"]

log = logging.getLogger(__name__)


MAX_ROWS = 8  # rows of x in one pass over the weight (four pairs of B columns)


class CudaGemvConfig(NamedTuple):
    tiles: int  # 16-row weight tiles per program
    warps: int  # warps per program, splitting K
    span: int = 1  # 16-byte chunks a lane loads per row and step (a warp: 64 span bytes a row)
    # programs an SM must hold at once (0: the compiler's choice): caps the registers per
    # thread at 64K / (32 warps min_blocks), more warps in flight against fewer registers
    min_blocks: int = 0
    # let the kernel after launch as a program starts (once its first step is asked for), not
    # once its K loop is done: the small kernel after then makes its reads before its wait and
    # lets the GEMV after it ask for its first weights while this one's last programs run.
    # Session 25, inside one engine: the 8B Q4 single stream 428.2 -> 440.4 tok/s
    # (`bench/gpu_ab.py --engine q4 --variants q4_letstart,q4`, every turn).
    let_next_at_start: bool = True


# Per code width, (largest rows of x, config), the last entry covering MAX_ROWS: set from
# bench/cuda_gemv_sweep.py on the H200 (sessions 19-20, `--rows 1,2,4,8 --kinds q4,q8g16`).
# 4-bit: one program per 16 rows on 8 warps, 32 bytes of a row per lane and step, was the best
# config or within 2% of it at every 8B shape at one and two rows and at four but for down;
# from five rows two tiles share each lane's x (8 rows: an 8B step's products 4,190 us against
# 5,256 with one tile), and from seven a lane takes one chunk per step (with two, registers
# spill). `config_for` caps one case further (SHORT_K).
# 8-bit: one chunk per step up to four rows (an 8B step's Q6_K-like products at one row 3,564
# us against 3,805 with two, the head 205 against 230), two tiles from five. (Its min_blocks 2
# changes no limit, 80 registers either way, but without it ptxas spilled 8 bytes in the main
# loop at one row once the scales were converted where used: session 22.)
CUDA_GEMV_DEFAULTS: dict[int, tuple[tuple[int, CudaGemvConfig], ...]] = {
    4: ((4, CudaGemvConfig(1, 8, 2)), (6, CudaGemvConfig(2, 8, 2)),
        (MAX_ROWS, CudaGemvConfig(2, 8, 1))),
    8: ((4, CudaGemvConfig(1, 8, 1, 2)), (MAX_ROWS, CudaGemvConfig(2, 8, 1))),
}
# One row of x against 4-bit codes with factored scales (Q4_K's) and K <= SHORT_K (all of an
# 8B layer's products but down) runs three programs per SM (min_blocks 3: 80 registers, and
# ptxas spills nothing there; with plain scales or two rows it spills 8-32 bytes). The 8B
# single stream: 393.4 tok/s against 374.2, the median of three turns each inside one engine
# (`bench/gpu_ab.py --engine q4 --variants q4,q4_cap`, session 23). Session 22 had read no
# gain across two engines, whose spread (~6%) hid it; at K = 14,336 the sweep had the cap
# slower (down 19.0 us against 14.7).
SHORT_K = 4096

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;

// bf16x2 (128 + a, 128 + b) from the nibbles a, b at bits 0 and 16 of w, with FLIP's bits
// (3 and 19, or none) inverted: one lop3, per bit `mask ? (magic ? ~w : w) : magic` of
// mask 0x000F000F and magic 0x43004300 | FLIP (0x4300: bf16 128.0, the nibble its mantissa)
template <u32 FLIP>
__device__ __forceinline__ u32 bf16_pair(u32 w) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0x6A;"
        : "=r"(r) : "r"(w), "r"(0x000F000Fu), "r"(0x43004300u | FLIP));
    return r;
}

// bf16x2 16 * v, exact (a power of two: the exponent moves; fma with -0 keeps +0 at +0)
__device__ __forceinline__ u32 times16(u32 v) {
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x41804180u), "r"(0x80008000u));
    return r;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// d += A (16 x 16, row) * B (16 x 8, col), bf16 in, float32 accumulate
__device__ __forceinline__ void mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// p as the compiler must keep it: one register, so that constant offsets from it fold into the
// loads' immediates instead of each load getting its own 64-bit address arithmetic
template <typename T>
__device__ __forceinline__ const T* pinned(const T* p) {
    asm("" : "+l"(p));
    return p;
}

// Launched early (programmatic dependent launch, EARLY_LAUNCH): the kernel before may
// still be writing x, and y may still be its memory; wait for it to finish before reading x
// or writing anything. A no-op in a normal launch.
__device__ __forceinline__ void wait_for_inputs() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the kernel after start (if it was launched early: the small kernels are, and wait for
// this one in their turn): once this one's programs have asked for their first weights
// (LET_NEXT_AT_START) or have done their K loops. A no-op otherwise.
__device__ __forceinline__ void let_next_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

__device__ __forceinline__ u16 to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

#if SUPER
typedef signed char scale_t;
#else
typedef float scale_t;
#endif

// The unit of work is a chunk: 16 bytes of one weight row's codes, 32 4-bit codes (one
// group) or 16 8-bit codes (one Q6_K group, half a Q8_0 one). CH chunks share a scale.
#if BITS == 4
#define XV 4              // x per chunk: 32 activations, four 16-byte vectors
#define OFFSET 128.0f     // what the bf16 codes carry beyond the code (module docstring)
#else
#define XV 2              // 16 activations
#define OFFSET 2304.0f
#endif
#define GS (G / CH)       // scale groups per row
#if SPAN % CH || (SUPER && SUPER % (SPAN / CH))
#error "a lane's chunks of a step must start a scale group and sit in one super-block"
#endif

// Compiled per weight shape: G (chunks along K) is a constant, so every row, tile and chunk
// offset below is an immediate of one load from one pointer per array.
//
// A step covers 4 SPAN chunks of K: lane c holds chunks SPAN c .. SPAN c + SPAN - 1 of its
// rows (SPAN 16-byte loads, contiguous), and the step's SPAN sub-steps each take one of them
// per lane. A warp thus reads 64 SPAN contiguous bytes of each of its rows per step.
//
// The scales stay as loaded until run_step uses them. Converted in load_step, the compiler put
// the int8 -> float conversions a few instructions after their loads, so a warp waited there
// for the step it had just asked for before computing the one it held (session 22, read from
// the machine code). Converted where used, the 8B down product at one row, seven steps a
// warp, went from 16.6 to 14.7 us (4-bit) and 27.8 to 24.1 (8-bit) in bench/cuda_gemv_sweep.py.
struct Step {
    uint4 w[TILES][2][SPAN];             // codes: tile, row (gid, gid+8), sub-step
    scale_t s[TILES][2][SPAN], z[TILES][2][SPAN];  // the group's scale and zero, as stored
#if SUPER
    float ss[TILES][2], sz[TILES][2];    // their super-block's factors (one per lane and step)
#endif
};

struct Lane {                 // a lane's operands at its first row, chunk SPAN c
    const uint4* codes;       // row row0 + gid
    const scale_t* scale;     // row row0 + gid, the group of chunk SPAN c
    const scale_t* zero;
#if SUPER
    const float* sup_s;       // row row0 + gid's super-block of chunk SPAN c
    const float* sup_z;
#endif
    const uint4* x;           // x[0, XV 8 SPAN c] (16 bytes = 8 activations)
    int x_row;                // x's row stride in 16 bytes
    int odd;                  // gid % 2: the row of a pair its B column carries
    int first;                // SPAN c: its first chunk in a step
    bool feeds;               // whether its B column (gid) is its own chunk's: gid / 2 == c
};

// Step `st`'s operands. TAIL (the last step when G % (4 SPAN)): chunks past G are read as
// chunk G - 1 (with zero x in run_step, they add nothing).
template <bool TAIL>
__device__ __forceinline__ void load_step(Step& st, const Lane& ln, int step) {
    // the lane's arrays at the step's start: one pointer each, the loads offset by immediates
    const int g0 = step * 4 * SPAN, q0 = g0 + ln.first;  // q0: the lane's first chunk
    const uint4* codes = pinned(ln.codes + g0);
    const scale_t* scale = pinned(ln.scale + g0 / CH);
    const scale_t* zero = pinned(ln.zero + g0 / CH);
#if SUPER
    const float* sup_s = pinned(ln.sup_s + g0 / CH / SUPER);  // (one super-block: #error above)
    const float* sup_z = pinned(ln.sup_z + g0 / CH / SUPER);
#endif
    #pragma unroll
    for (int t = 0; t < TILES; t++)
        #pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = 16 * t + 8 * h;
#if SUPER
            // the lane's chunks of a step, clamped or not, sit in the super-block of the first
            const int sso = TAIL ? min(q0, G - 1) / CH / SUPER - q0 / CH / SUPER : 0;
            st.ss[t][h] = __ldg(sup_s + row * (GS / SUPER) + sso);
            st.sz[t][h] = __ldg(sup_z + row * (GS / SUPER) + sso);
#endif
            #pragma unroll
            for (int i = 0; i < SPAN; i++) {
                // chunk q0 + i, or in TAIL clamped to the last one
                const int off = TAIL ? min(q0 + i, G - 1) - q0 : i;
                const int so = TAIL ? (q0 + off) / CH - q0 / CH : i / CH;
                st.w[t][h][i] = __ldg(codes + row * G + off);
                st.s[t][h][i] = __ldg(scale + row * GS + so);
                st.z[t][h][i] = __ldg(zero + row * GS + so);
            }
        }
}

// chunk i's scale and zero - OFFSET * scale, of row h of tile t
__device__ __forceinline__ float2 scales(const Step& st, int t, int h, int i) {
#if SUPER
    const float s = (float)st.s[t][h][i] * st.ss[t][h], z = (float)st.z[t][h][i] * st.sz[t][h];
#else
    const float s = st.s[t][h][i], z = st.z[t][h][i];
#endif
    return make_float2(s, fmaf(-OFFSET, s, z));
}

// the pairs of x that word j's codes meet, from x[32 g .. 32 g + 31] (xv: 4 x 8 activations)
__device__ __forceinline__ void x_pairs(u32 (&f)[4][4], const uint4 (&xv)[4]) {
    #pragma unroll
    for (int j = 0; j < 4; j++) {  // word j meets x[4j .. 4j+3] and x[16+4j .. 16+4j+3]
        const uint4 lo = xv[j / 2], hi = xv[2 + j / 2];
        const u32 l0 = j % 2 ? lo.z : lo.x, l1 = j % 2 ? lo.w : lo.y;
        const u32 h0 = j % 2 ? hi.z : hi.x, h1 = j % 2 ? hi.w : hi.y;
        f[j][0] = prmt(l0, l1, 0x5410);  // (x[4j], x[4j+2])
        f[j][1] = prmt(h0, h1, 0x5410);  // (x[16+4j], x[18+4j])
        f[j][2] = prmt(l0, l1, 0x7632);  // (x[4j+1], x[4j+3])
        f[j][3] = prmt(h0, h1, 0x7632);  // (x[17+4j], x[19+4j])
    }
}

// the pairs of x that word j of 8-bit codes meets, from x[16 q .. 16 q + 15] (xv: 2 x 8):
// (x[4j], x[4j+2]) and (x[4j+1], x[4j+3])
__device__ __forceinline__ void x_pairs8(u32 (&f)[4][2], const uint4 (&xv)[2]) {
    #pragma unroll
    for (int j = 0; j < 4; j++) {
        const uint4 v = xv[j / 2];
        const u32 l0 = j % 2 ? v.z : v.x, l1 = j % 2 ? v.w : v.y;
        f[j][0] = prmt(l0, l1, 0x5410);
        f[j][1] = prmt(l0, l1, 0x7632);
    }
}

// Rows of x ride in pairs: pair p's B columns 2c, 2c+1 carry x rows 2p and 2p+1 (an odd
// last row repeated), each pair its own mmas on the same A registers.
#define PAIRS ((ROWS + 1) / 2)

template <bool TAIL>
__device__ __forceinline__ void run_step(const Step& st, const Lane& ln, int step,
                                         float (&out)[TILES][2][ROWS]) {
    const u32 ones = 0x3F803F80u;  // bf16x2 (1, 1)
    const int g0 = step * 4 * SPAN;
    #pragma unroll
    for (int i = 0; i < SPAN; i++) {
        // per pair, the x pairs each word meets (module docstring); with 8-bit codes the
        // last two are 16 times the first two, for the high nibbles
        u32 f[PAIRS][4][4];
        #pragma unroll
        for (int p = 0; p < PAIRS; p++) {
            uint4 xv[XV] = {};  // the activations of the lane's chunk, in the lanes that feed it
            if (ln.feeds && (!TAIL || g0 + ln.first + i < G)) {
                const int row = ROWS == 1 ? 0 : min(2 * p + ln.odd, ROWS - 1);
                const uint4* xp = ln.x + row * ln.x_row + XV * (g0 + i);
                #pragma unroll
                for (int v = 0; v < XV; v++)
                    xv[v] = __ldg(xp + v);
            }
#if BITS == 4
            x_pairs(f[p], xv);
#else
            u32 h[4][2];
            x_pairs8(h, xv);
            #pragma unroll
            for (int j = 0; j < 4; j++) {
                f[p][j][0] = h[j][0], f[p][j][1] = h[j][1];
                f[p][j][2] = times16(h[j][0]), f[p][j][3] = times16(h[j][1]);
            }
#endif
        }
        float xs[PAIRS][4], acc[PAIRS][TILES][4];
        #pragma unroll
        for (int p = 0; p < PAIRS; p++) {
            xs[p][0] = xs[p][1] = xs[p][2] = xs[p][3] = 0.f;
            #pragma unroll
            for (int t = 0; t < TILES; t++)
                acc[p][t][0] = acc[p][t][1] = acc[p][t][2] = acc[p][t][3] = 0.f;
        }
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            #pragma unroll
            for (int p = 0; p < PAIRS; p++) {
                mma(xs[p], ones, ones, ones, ones, f[p][j][0], f[p][j][1]);
#if BITS == 4
                mma(xs[p], ones, ones, ones, ones, f[p][j][2], f[p][j][3]);
#endif
            }
            #pragma unroll
            for (int t = 0; t < TILES; t++) {
                const uint4 a = st.w[t][0][i], b = st.w[t][1][i];
                const u32 w0 = j == 0 ? a.x : j == 1 ? a.y : j == 2 ? a.z : a.w;
                const u32 w1 = j == 0 ? b.x : j == 1 ? b.y : j == 2 ? b.z : b.w;
#if BITS == 4
                // codes (4j, 4j+2) and (16+4j, 18+4j), then (4j+1, 4j+3) and (17+4j, 19+4j)
                const u32 lo0 = bf16_pair<0>(w0), lo1 = bf16_pair<0>(w1);
                const u32 lo2 = bf16_pair<0>(w0 >> 4), lo3 = bf16_pair<0>(w1 >> 4);
                const u32 hi0 = bf16_pair<0>(w0 >> 8), hi1 = bf16_pair<0>(w1 >> 8);
                const u32 hi2 = bf16_pair<0>(w0 >> 12), hi3 = bf16_pair<0>(w1 >> 12);
#else
                // the low nibbles of codes (4j, 4j+2) and (4j+1, 4j+3), then their high
                // nibbles with the sign bit inverted: code + 128 = low + 16 high
                const u32 lo0 = bf16_pair<0>(w0), lo1 = bf16_pair<0>(w1);
                const u32 lo2 = bf16_pair<0>(w0 >> 8), lo3 = bf16_pair<0>(w1 >> 8);
                const u32 hi0 = bf16_pair<0x80008u>(w0 >> 4), hi1 = bf16_pair<0x80008u>(w1 >> 4);
                const u32 hi2 = bf16_pair<0x80008u>(w0 >> 12);
                const u32 hi3 = bf16_pair<0x80008u>(w1 >> 12);
#endif
                #pragma unroll
                for (int p = 0; p < PAIRS; p++) {
                    mma(acc[p][t], lo0, lo1, lo2, lo3, f[p][j][0], f[p][j][1]);
                    mma(acc[p][t], hi0, hi1, hi2, hi3, f[p][j][2], f[p][j][3]);
                }
            }
        }
        // lane c holds its chunk's sums: acc[p][t] = {row gid x x-row 2p, gid x 2p+1,
        // gid+8 x 2p, gid+8 x 2p+1}
        #pragma unroll
        for (int t = 0; t < TILES; t++)
            #pragma unroll
            for (int h = 0; h < 2; h++) {
                const float2 sz = scales(st, t, h, i);
                #pragma unroll
                for (int r = 0; r < ROWS; r++)
                    out[t][h][r] = fmaf(sz.x, acc[r / 2][t][2 * h + r % 2],
                                        fmaf(sz.y, xs[r / 2][r % 2], out[t][h][r]));
            }
    }
}

// Lane `ln`'s operand pointers at row r (its tile's row0 + gid)
__device__ __forceinline__ void aim(Lane& ln, const u32* codes, const scale_t* scale,
                                    const scale_t* zero, const float* sup_s, const float* sup_z,
                                    long r, int c) {
    ln.codes = (const uint4*)codes + r * G + SPAN * c;
    ln.scale = scale + r * GS + SPAN * c / CH;
    ln.zero = zero + r * GS + SPAN * c / CH;
#if SUPER
    ln.sup_s = sup_s + r * (GS / SUPER) + SPAN * c / CH / SUPER;
    ln.sup_z = sup_z + r * (GS / SUPER) + SPAN * c / CH / SUPER;
#endif
}

// A tile is 16 TILES rows, row0 .. row0 + 16 TILES - 1; the last one starts at N - 16 TILES so
// that it stays inside the weight (its rows shared with the tile before it get the same
// values twice). A program's warps take a tile's steps in turn and add their sums in shared
// memory; a program takes one tile.
#if MIN_BLOCKS
#define BOUNDS __launch_bounds__(WARPS * 32, MIN_BLOCKS)
#else
#define BOUNDS __launch_bounds__(WARPS * 32)
#endif
extern "C" __global__ void BOUNDS mma_gemv(
        const u32* __restrict__ codes, const scale_t* __restrict__ scale,
        const scale_t* __restrict__ zero, const float* __restrict__ sup_s,
        const float* __restrict__ sup_z, const u16* __restrict__ x,
        const u16* __restrict__ bias, u16* __restrict__ y,
        int N, int stride_x, int stride_y, int has_bias) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, c = lane & 3;
    const int row0 = min((int)blockIdx.x * (16 * TILES), N - 16 * TILES);
    Lane ln;
    aim(ln, codes, scale, zero, sup_s, sup_z, row0 + gid, c);
    ln.x = (const uint4*)x + XV * SPAN * c;
    ln.x_row = stride_x / 8;
    ln.odd = gid & 1;
    ln.first = SPAN * c;
    ln.feeds = (gid >> 1) == c;
    const int full = G / (4 * SPAN);  // whole steps; one more (TAIL) holds the rest
    Step one, two;  // two steps in turn, each loaded while the other is computed
    if (warp < full)
        load_step<false>(one, ln, warp);  // (weights only: they never change)
#if LET_NEXT_AT_START
    let_next_launch();
#endif
    wait_for_inputs();
    __shared__ float part[WARPS][TILES * 16 * ROWS];
    float out[TILES][2][ROWS];
    #pragma unroll
    for (int t = 0; t < TILES; t++)
        #pragma unroll
        for (int h = 0; h < 2; h++)
            #pragma unroll
            for (int k = 0; k < ROWS; k++)
                out[t][h][k] = 0.f;
    if (warp < full) {
        for (int b = warp;;) {
            load_step<false>(two, ln, min(b + WARPS, full - 1));
            run_step<false>(one, ln, b, out);
            if ((b += WARPS) >= full)
                break;
            load_step<false>(one, ln, min(b + WARPS, full - 1));
            run_step<false>(two, ln, b, out);
            if ((b += WARPS) >= full)
                break;
        }
    }
    if (G % (4 * SPAN) && warp == full % WARPS) {
        Step st;
        load_step<true>(st, ln, full);
        run_step<true>(st, ln, full, out);
    }
#if !LET_NEXT_AT_START
    let_next_launch();
#endif
    // the four lanes of a quad held different chunks: add them
    #pragma unroll
    for (int t = 0; t < TILES; t++)
        #pragma unroll
        for (int h = 0; h < 2; h++)
            #pragma unroll
            for (int k = 0; k < ROWS; k++) {
                float v = out[t][h][k];
                v += __shfl_xor_sync(0xffffffffu, v, 1);
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                out[t][h][k] = v;
            }
    if (c == 0) {
        #pragma unroll
        for (int t = 0; t < TILES; t++)
            #pragma unroll
            for (int h = 0; h < 2; h++)
                #pragma unroll
                for (int k = 0; k < ROWS; k++)
                    part[warp][(16 * t + 8 * h + gid) * ROWS + k] = out[t][h][k];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < TILES * 16 * ROWS; i += WARPS * 32) {
        float v = 0.f;
        #pragma unroll
        for (int w = 0; w < WARPS; w++)
            v += part[w][i];
        const int n = row0 + i / ROWS, k = i % ROWS;
        if (has_bias)
            v += __uint_as_float((u32)bias[n] << 16);
        y[(long)k * stride_y + n] = to_bf16(v);
    }
}
"""



BITS = (4, 8)  # the code widths the engine sends here (bench/gpu_bench.py's variants narrow it)
FORMS = ((4, 32), (8, 16), (8, 32))  # (bits, group size) the kernel reads


def serves(w: Any) -> bool:
    """Whether the kernel reads this weight: 4-bit codes in groups of 32 or 8-bit codes in
    groups of 16 or 32, plain float32 or factored scales, at least 16 rows."""
    return (isinstance(w, QuantizedWeight) and (w.bits, w.group_size) in FORMS
            and w.bits in BITS and w.scale.dtype in (torch.float32, torch.int8)
            and w.out_features >= 16)


def supports(x: torch.Tensor, w: Any) -> bool:
    """Whether the kernel serves this product: a weight it reads (`serves`) and CUDA bf16
    activations of 1..MAX_ROWS rows."""
    return (x.is_cuda and x.dtype == torch.bfloat16
            and 1 <= x.numel() // max(1, x.shape[-1]) <= MAX_ROWS and serves(w))


def config_for(rows: int, bits: int, k: int, factored: bool) -> CudaGemvConfig:
    """The default config of a product of `rows` rows of x against a `bits`-bit weight of K
    = `k`, its scales `factored` (super groups) or not: the table above, and SHORT_K."""
    cfg = next(cfg for limit, cfg in CUDA_GEMV_DEFAULTS[bits] if rows <= limit)
    if bits == 4 and rows == 1 and factored and k <= SHORT_K:
        return cfg._replace(min_blocks=3)
    return cfg


def default_config(rows: int, w: QuantizedWeight) -> CudaGemvConfig:
    """`config_for` a product of `rows` rows of x against `w`."""
    return config_for(rows, w.bits, w.in_features, w.super_groups > 0)


def fitted(cfg: CudaGemvConfig, n: int, chunks_per_group: int = 1) -> CudaGemvConfig:
    """`cfg` with at most n / 16 tiles (the last program starts at N - 16 tiles) and, where
    two 16-byte chunks share a scale (8-bit codes in groups of 32), an even span (a lane's
    chunks of a step start a scale group)."""
    span = cfg.span + cfg.span % chunks_per_group
    return cfg._replace(tiles=min(cfg.tiles, n // 16), span=span)


def chunking(w: QuantizedWeight) -> tuple[int, int]:
    """(16-byte chunks of codes per row, chunks per scale group) of a weight."""
    per_chunk = 32 if w.bits == 4 else 16  # codes in 16 bytes
    return w.in_features // per_chunk, w.group_size // per_chunk


def _defines(cfg: CudaGemvConfig, rows: int, super_groups: int, chunks: int, bits: int = 4,
             chunks_per_group: int = 1) -> str:
    return (f"#define TILES {cfg.tiles}\n#define WARPS {cfg.warps}\n#define SPAN {cfg.span}\n"
            f"#define MIN_BLOCKS {cfg.min_blocks}\n"
            f"#define LET_NEXT_AT_START {int(cfg.let_next_at_start)}\n"
            f"#define ROWS {rows}\n#define SUPER {super_groups}\n#define G {chunks}\n"
            f"#define BITS {bits}\n#define CH {chunks_per_group}\n")


Variant = tuple[CudaGemvConfig, int, int, int, int, int]  # _defines' arguments


def _variant(cfg: CudaGemvConfig, rows: int, w: QuantizedWeight) -> Variant:
    """What names the compiled kernel that serves `rows` rows of x against `w` with `cfg`
    (fitted to it)."""
    chunks, per_group = chunking(w)
    return cfg, rows, w.super_groups, chunks, w.bits, per_group


def _source(variant: Variant) -> str:
    return _defines(*variant) + SOURCE


# Compiled machine code, by (source, compute capability): this process's, and on disk in
# <cache>/kernels/cuda_gemv-<key>.cubin (model_loader.cache_dir) for the next start. A model
# needs a variant per weight shape and form and per row count 1..MAX_ROWS (an 8B Q4_K_M file:
# ~40 with the self-check's), each an NVRTC compile of ~0.1-0.5 s; `prepare` makes a first
# start's in parallel, the disk cache spares the later starts.
_cubins: dict[tuple[str, str], bytes] = {}


def _cubin(source: str, arch: str) -> bytes:
    """`source` compiled for sm_`arch` ("90"): from memory, from the disk cache, else with
    NVRTC (then written to the cache: atomically, and not at all where it is read-only).
    Thread-safe (NVRTC runs outside the GIL: `prepare` compiles in threads)."""
    if (source, arch) in _cubins:
        return _cubins[source, arch]
    key = hashlib.sha256(f"{arch}\0{torch.version.cuda}\0{source}".encode()).hexdigest()[:24]
    path = _cache_folder() / f"cuda_gemv-{key}.cubin"
    try:
        cubin = path.read_bytes()
    except OSError:
        cubin = _compile(source, arch)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
                tmp.write(cubin)
            os.replace(tmp.name, path)
        except OSError:
            pass
    _cubins[source, arch] = cubin
    return cubin


def _cache_folder() -> Path:
    from sgl.backend.model_loader import cache_dir

    return cache_dir() / "kernels"


def _compile(source: str, arch: str) -> bytes:
    from torch.cuda._utils import _nvrtc_compile

    out = _nvrtc_compile(source, "mma_gemv", arch)  # (extern "C": the name as written)
    code = out[0] if isinstance(out, tuple) else out  # (torch versions: (code, name) or code)
    return code.encode() if isinstance(code, str) else bytes(code)


def _arch(device: int) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


@functools.lru_cache(maxsize=None)
def _kernel(variant: Variant, device: int) -> Any:
    source = _source(variant)
    with torch.cuda.device(device):  # (the module is loaded into that device's context)
        try:
            from torch.cuda._utils import _cuda_load_module

            return _cuda_load_module(_cubin(source, _arch(device)), ["mma_gemv"])["mma_gemv"]
        except Exception as exc:  # a damaged cache file; a torch without these helpers
            log.info("the cached CUDA GEMV did not load (%s: %s); compiling it",
                     type(exc).__name__, exc)
            return torch.cuda._compile_kernel(source, "mma_gemv")


SELF_CHECK_ROWS = (1, 2, 5)  # (both 4-bit defaults' families, and rows in pairs and alone)


def prepare(weights: Iterable[QuantizedWeight], device: torch.device,
            threads: int | None = None) -> int:
    """Compile, in parallel, the variants that products of 1..MAX_ROWS bf16 rows against
    `weights` will launch on `device`, and the self-check's. Returns how many variants were
    wanted; nothing is launched (the compiled code waits in memory and on disk)."""
    wanted = [(w, rows) for w in _self_check_weights("cpu") for rows in SELF_CHECK_ROWS]
    wanted += [(w, rows) for w in weights if serves(w) for rows in range(1, MAX_ROWS + 1)]
    return compile_ahead([(default_config(rows, w), rows, w) for w, rows in wanted], device,
                         threads)


def compile_ahead(jobs: Iterable[tuple[CudaGemvConfig, int, QuantizedWeight]],
                  device: torch.device, threads: int | None = None) -> int:
    """Compile, in parallel, what `mma_gemv` will launch for each (config, rows of x, weight)
    on `device` (a weight stands for its shape and form). Returns how many variants."""
    arch = _arch(device.index if device.index is not None else torch.cuda.current_device())
    sources = {_source(_variant(fitted(cfg, w.out_features, chunking(w)[1]), rows, w))
               for cfg, rows, w in jobs}
    with ThreadPoolExecutor(threads or min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda source: _cubin(source, arch), sources))
    return len(sources)


def mma_gemv(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
             config: CudaGemvConfig | None = None) -> torch.Tensor:
    """x [..., K] bf16 (1..MAX_ROWS rows) @ w^T (+ bias) -> [..., N] bf16."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()  # 16-byte loads of x
    m, n = x2.shape[0], w.out_features
    y = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    cfg = fitted(config or default_config(m, w), n, chunking(w)[1])
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    kernel = _kernel(_variant(cfg, m, w), device)
    codes = w.codes.view(torch.int32)  # 4 words per 16-byte chunk
    sup_s = w.super_scale if w.super_groups else w.scale
    sup_z = w.super_zero if w.super_groups else w.zero
    b = bias if bias is not None else y
    args = [codes, w.scale, w.zero, sup_s, sup_z, x2, b, y, n, x2.stride(0), y.stride(0),
            int(bias is not None)]
    grid, block = (-(-n // (16 * cfg.tiles)), 1, 1), (32 * cfg.warps, 1, 1)
    stream = torch.cuda.current_stream(device)
    if _early(device):
        _launch_early(kernel, grid, block, args, stream)
    else:
        kernel(grid=grid, block=block, args=args, stream=stream)
    return y.view(*lead, n)


# Programmatic dependent launch (Hopper and later; kernels/triton_compat.py has the idea): the
# kernel may start while the one before it on the stream is still running (RMSNorm, SiLU x mul,
# decode attention let it as they start), loads its first step's weights, and waits
# (`wait_for_inputs`) before it reads x. Session 20 on the H200: single stream 348.8 -> 359.4
# tok/s (`gpu_bench --quant-engines q4_late,q4` names the two), and tests/test_quant_gpu.py's
# `early_launch` and engine tests passed.
EARLY_LAUNCH = True
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttrValue(ctypes.Union):  # CUlaunchAttributeValue: 64 bytes
    _fields_ = [("pad", ctypes.c_char * 64), ("align", ctypes.c_uint64),
                ("programmatic", ctypes.c_int)]


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttrValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


def _early(device: int) -> bool:
    from sgl.backend.kernels.triton_compat import PDL_SWITCH

    return EARLY_LAUNCH and PDL_SWITCH[0] and torch.cuda.get_device_capability(device)[0] >= 9


def _launch_early(kernel: Any, grid: tuple[int, int, int], block: tuple[int, int, int],
                  args: list[Any], stream: torch.cuda.Stream) -> None:
    """`kernel(grid, block, args, stream)` through cuLaunchKernelEx with the programmatic
    stream serialization attribute (torch's launcher takes no attributes)."""
    from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library

    values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a)
              for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p)
                                               for v in values])
    attr = _LaunchAttr(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value.programmatic = 1
    config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), 0,
                           stream.cuda_stream, ctypes.pointer(attr), 1)
    _check_cuda(_get_gpu_runtime_library().cuLaunchKernelEx(ctypes.byref(config), kernel.func,
                                                            params, None))


_available: dict[int, bool] = {}  # available()'s answers, per device, once known


def available(device: torch.device | None = None) -> bool:
    """Whether the kernel compiles and gives the reference's answer on this GPU (`device`, by
    default the current one): checked once per device, outside CUDA graph capture (a capture
    before the answer is known gets False: the engine's eager warm-up comes first); False
    without CUDA or NVRTC. (Asked for every eager one- or two-row product: a known answer is
    one dict lookup.)"""
    index = device.index if device is not None else None
    if index in _available:
        return _available[index]
    if not (torch.cuda.is_available() and hasattr(torch.cuda, "_compile_kernel")):
        return False
    if index is None:
        index = torch.cuda.current_device()
        if index in _available:
            return _available[index]
    if torch.cuda.is_current_stream_capturing():
        return False
    with torch.cuda.device(index):
        _available[index] = _self_check(torch.device("cuda", index))
    return _available[index]


def _self_check_weights(device: torch.device | str) -> list[QuantizedWeight]:
    """Small weights of every form: 4-bit codes with factored K-quant scales over whole steps,
    and with plain scales and K ending inside a step; 8-bit codes of the full int8 range in
    groups of 16 with factored scales (Q6_K's form), and in groups of 32 with plain ones and a
    tail (Q8_0's)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def weight(n: int, k: int, per: int, bits: int = 4, group: int = 32) -> QuantizedWeight:
        if bits == 4:
            codes = torch.randint(0, 256, (n, k // 2), device=device, dtype=torch.uint8,
                                  generator=gen)
        else:
            codes = torch.randint(-128, 128, (n, k), device=device, generator=gen,
                                  dtype=torch.int32).to(torch.int8)
        # the K-quants' structure: float16 d per `per` groups times a 6-bit integer per group
        groups = k // group
        d = (torch.rand(n, groups // per, device=device, generator=gen) * 1e-3).half()
        d = d.float().repeat_interleave(per, dim=1)
        sc = torch.randint(0, 64, (n, groups), device=device, generator=gen).float()
        return QuantizedWeight(codes, d * sc, -d * (63 - sc), bits, group, k, "selfcheck")

    return [factor(weight(48, 1024, 8)), weight(40, 96, 1), factor(weight(48, 512, 16, 8, 16)),
            weight(40, 224, 1, 8, 32)]


def _self_check(device: torch.device) -> bool:
    """Both defaults (1, 2 and 5 rows) on `_self_check_weights` against float32
    dequantize-then-matmul."""
    try:
        gen = torch.Generator(device=device).manual_seed(1)
        for w in _self_check_weights(device):
            x = torch.randn(5, w.in_features, device=device, dtype=torch.bfloat16,
                            generator=gen)
            want = x.float() @ w.dequantize(dtype=torch.float32).t()
            for rows in SELF_CHECK_ROWS:
                got = mma_gemv(x[:rows], w).float()
                bound = 1e-2 * float(want.abs().max())
                if not torch.allclose(got, want[:rows], rtol=1e-2, atol=bound):
                    log.warning("the CUDA GEMV disagrees with its reference on %s (%d-bit "
                                "codes, %d rows); Triton serves", device, w.bits, rows)
                    return False
        return True
    except Exception as exc:  # no NVRTC, an older torch, a driver without the target
        log.info("the CUDA GEMV is not available on %s (%s: %s); Triton serves",
                 device, type(exc).__name__, exc)
        return False
