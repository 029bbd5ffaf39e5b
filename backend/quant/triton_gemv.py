"""Decode GEMV on quantized weights, dequantizing in registers (Triton, CUDA).

    qgemv(x [M, K], w: QuantizedWeight, bias [N] | None) -> [M, N]   (x's dtype)

(FP8 weights have their own kernels in quant/triton_fp8.py.)

At one row a decode step streams the weights once, so the kernel's job is to keep enough
code bytes in flight (Little's law: ~4 TB/s times ~1 us of latency is ~4 MB across the GPU,
~30 KB per SM) and to spend few instructions per weight:

- A program owns BLOCK_N output rows and walks K BLOCK_G groups at a time. The codes of a
  tile load as [BLOCK_N, BLOCK_G, lanes]: the group's bytes (16 per 4-bit group, one vector
  load per group row), or with `words` its bytes as int32 words (4 per 4-bit group). A 4-bit
  byte i holds code i (low nibble) and code i+16 (high), so the matching activations are
  gathers of x at g*32+i and g*32+16+i. Per weight: unpack, convert, one FMA into a
  per-group partial; the group's float32 scale and zero are applied once per group:
      y[n] += scale[n,g] * sum_i code[n,g,i] * x[g,i]  +  zero[n,g] * sum_i x[g,i]
  (the second sum is shared by all rows of the tile, so the zero costs nothing per weight).
  Factored scales (quant/factored.py, the K-quants on the GPU) are multiplied out per group.
- Codes become floats without integer-to-float conversions by default (`magic`): on Hopper
  I2F runs at 16 per clock per SM against 128 FMAs, an eighth; the code goes into the low
  mantissa bits of 2^23 and 2^23 is subtracted (exact for any code below 2^23). The
  conversion path stays as a config switch, so the device sweep can show what it costs.

The tiles and flags come from the GEMV_DEFAULTS table (FP8's too: quant/triton_fp8.py). Rows
of x are a grid axis, the fastest one (`row_grid`: each program re-reads its weight tile, from
L2; quant/linear.py's CUDA_ROUTES decides which row counts come here). `split_k` > 1 adds a
third axis of K slices, each program writing float32 partial sums that a second kernel, or
the program completing the tile, adds in a fixed order (quant/triton_split.py): wide tiles
(fewer re-reads of x) with a full grid.
Configs depend on the shape only: graph-safe, no host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl.backend.kernels.triton_compat import cdiv, is_interpreted, next_power_of_2, tl, triton
from sgl.backend.quant.triton_q4gemv import q4_lop3_kernel
from sgl.backend.quant.triton_split import (finish_split, gemv_program, k_slice, split_launch,
                                            store_rows)
from sgl.backend.quant.weight import QuantizedWeight

__all__ = ["GEMV_DEFAULTS", "QGemvConfig", "gemv_config", "groups_per_block", "int8_f32",
           "load_group_scales", "nibbles_f32", "nibbles_f32_hi16", "qgemv", "row_grid",
           "scale_args"]


class QGemvConfig(NamedTuple):
    block_n: int  # output rows per program
    block_k: int  # weights along K per step (a power-of-two number of groups)
    num_warps: int
    magic: bool = True  # codes -> float32 through the 2^23 mantissa (False: I2F conversions)
    words: bool = False  # load the codes as int32 words (4 bytes each), unpack with shifts
    num_stages: int = 3  # Triton's software pipelining depth of the K loop
    fp8_decode: str = "bits"  # FP8 only: "bits" | "sext" | "cvt" (quant/triton_fp8.py)
    split_k: int = 1  # K slices (a third grid axis, quant/triton_split.py); 1: no split
    split_reduce: str = "kernel"  # who adds the slices: "kernel" (a second one) | "last"
    unpack: str = "bytes"  # 4-bit codes: "bytes" (this module's kernel, `magic` and `words`
    # apply) | "lop3" (quant/triton_q4gemv.py: int32 words, one lop3 per code) | "mma"
    # (quant/triton_q4mma.py: bf16 weights on the tensor cores, all rows in one program)
    prefetch: bool = False  # lop3 only: load the next K step before this one's arithmetic


# The one-row defaults by weight kind (quant/linear.py's names: "q4" 4-bit codes, "q8" 8-bit
# codes, "fp8") and weight rows N: (largest N, config), the last entry covering the rest. Set
# from bench/quant_gemv_bench.py's sweep (session 6, H200): few rows per program and long K
# steps (more bytes in flight per program); for 8-bit codes the I2F conversion beat the 2^23
# trick there, for FP8 the hardware e4m3 conversion beat the integer decodes. 4-bit codes:
# the lop3 kernel (quant/triton_q4gemv.py) with bench/q4_gemv_sweep.py's winners (session
# 9, H200): 8 rows by 1-2K weights on 2 warps at N <= 8192, 16 rows by 1K on one warp above
# (small programs, many of them per SM); its prefetch and split-K lost everywhere. FP8:
# bench/fp8_gemv_sweep.py's winners (session 10, H200): the first kernel at N = 4096 (o_proj,
# down), the word kernel (quant/triton_fp8.py) on 4 rows above (qkv; gate_up and the head on
# one warp). Session 25: qkv (N <= 8192) on 4 rows by 512 on 4 warps, the one-row sweep's best
# with norms and early launches (`fp8_gemv_sweep.py --pdl on --norm`: 10.0 us against 10.8 for
# 4/1024/2): inside one engine the 8B FP8 single stream 360.9 -> 364.9 tok/s, both turns
# (`bench/gpu_ab.py --engine fp8 --variants fp8_inlate,fp8,fp8_qkv`; docs/benchmarks.md).
_Q = QGemvConfig
GEMV_DEFAULTS: dict[str, tuple[tuple[int, QGemvConfig], ...]] = {
    "q4": ((4096, _Q(8, 2048, 2, num_stages=1, unpack="lop3")),
           (8192, _Q(8, 1024, 2, num_stages=1, unpack="lop3")),
           (1 << 62, _Q(16, 1024, 1, num_stages=1, unpack="lop3"))),
    "q8": ((8192, _Q(4, 2048, 4, magic=False)), (1 << 62, _Q(4, 1024, 4, magic=False))),
    "fp8": ((4096, _Q(8, 1024, 4, fp8_decode="cvt")),
            (8192, _Q(4, 512, 4, num_stages=1, fp8_decode="words")),
            (1 << 62, _Q(4, 512, 1, num_stages=1, fp8_decode="words"))),
}


UNPACKS = ("bytes", "lop3", "mma")  # QGemvConfig.unpack


def gemv_config(kind: str, n: int, k: int, min_k: int) -> QGemvConfig:
    """The table's one-row config for an [n, k] weight of `kind` (shape-only), its K step
    capped at the weight's own K (rounded up to a power of two, at least `min_k`: small test
    shapes waste no lanes)."""
    cfg = next(c for limit, c in GEMV_DEFAULTS[kind] if n <= limit)
    return cfg._replace(block_k=min(cfg.block_k, max(min_k, next_power_of_2(k))))


@triton.jit
def load_group_scales(SCALE, ZERO, SUP_S, SUP_Z, rows64, gg, G, mask,
                      MASKED: tl.constexpr, SUPER: tl.constexpr):
    """(scale, zero) float32 [BLOCK_N, BLOCK_G] of rows `rows64` x groups `gg`. SUPER > 0:
    factored (quant/factored.py): int8 sub-scales times the float32 of their super-block."""
    off = rows64[:, None] * G + gg[None, :]  # [BLOCK_N, BLOCK_G]
    if MASKED:
        s = tl.load(SCALE + off, mask=mask, other=0).to(tl.float32)
        z = tl.load(ZERO + off, mask=mask, other=0).to(tl.float32)
    else:
        s = tl.load(SCALE + off).to(tl.float32)
        z = tl.load(ZERO + off).to(tl.float32)
    if SUPER > 0:
        sup = rows64[:, None] * (G // SUPER) + gg[None, :] // SUPER  # (repeats: L1 hits)
        if MASKED:
            s = s * tl.load(SUP_S + sup, mask=mask, other=0.0)
            z = z * tl.load(SUP_Z + sup, mask=mask, other=0.0)
        else:
            s = s * tl.load(SUP_S + sup)
            z = z * tl.load(SUP_Z + sup)
    return s, z


@triton.jit
def nibbles_f32(b):
    """int32 bytes -> (low nibbles, high nibbles) as float32, exactly, without integer-to-float
    conversions: the value goes into the low mantissa bits of 2^23 (0x4B000000), then 2^23
    is subtracted; two integer ops and one add per code."""
    lo = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    hi = (((b >> 4) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return lo, hi


@triton.jit
def nibbles_f32_hi16(b):
    """As nibbles_f32 with the high nibble as 16 * code (masked in place, not shifted: one
    integer op per code); the caller divides its activations by 16 (exact) once per tile."""
    lo = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    hi16 = ((b & 240) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return lo, hi16


@triton.jit
def int8_f32(b):
    """int8 codes read as bytes (int32 0..255) -> float32 exactly, the same way: b ^ 0x80 is
    the code + 128 (one integer op with the OR), 2^23 + 128 is subtracted."""
    return ((b ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


def scale_args(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(super_scale, super_zero, super_groups) kernel arguments (dummies when plain)."""
    if w.super_groups:
        assert w.super_scale is not None and w.super_zero is not None
        return w.super_scale, w.super_zero, w.super_groups
    return w.scale, w.zero, 0


@triton.jit
def _load_x(ptrs, mask_g, EVEN_G: tl.constexpr):
    """[BLOCK_G, lanes] activations as float32 (groups past G read as 0)."""
    if EVEN_G:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=mask_g[:, None], other=0.0)
    return v.to(tl.float32)


@triton.jit
def _bytes_dot(raw, x_ptrs, mask_g, BITS: tl.constexpr, GBYTES: tl.constexpr,
               EVEN_G: tl.constexpr, MAGIC: tl.constexpr):
    """raw [BLOCK_N, BLOCK_G, GBYTES] code bytes -> (sum code * x per group [BLOCK_N,
    BLOCK_G], sum x per group [BLOCK_G])."""
    b = raw.to(tl.int32)  # (uint8: zero-extended, 0..255)
    xa = _load_x(x_ptrs, mask_g, EVEN_G)  # [BLOCK_G, GBYTES]
    if BITS == 4:
        xb = _load_x(x_ptrs + GBYTES, mask_g, EVEN_G)  # the high nibbles': 16 codes further
        if MAGIC:
            lo, hi16 = nibbles_f32_hi16(b)
            part = tl.sum(lo * xa[None, :, :] + hi16 * (xb * 0.0625)[None, :, :], axis=2)
        else:
            lo = (b & 15).to(tl.float32)
            hi = (b >> 4).to(tl.float32)
            part = tl.sum(lo * xa[None, :, :] + hi * xb[None, :, :], axis=2)
        xsum = tl.sum(xa + xb, axis=1)
    else:
        if MAGIC:
            c = int8_f32(b)
        else:
            c = ((b ^ 0x80) - 128).to(tl.float32)
        part = tl.sum(c * xa[None, :, :], axis=2)
        xsum = tl.sum(xa, axis=1)
    return part, xsum


@triton.jit
def _words_dot(raw, x_ptrs, mask_g, BITS: tl.constexpr, GBYTES: tl.constexpr,
               EVEN_G: tl.constexpr, MAGIC: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_G: tl.constexpr, LANES: tl.constexpr):
    """As _bytes_dot with raw [BLOCK_N, BLOCK_G, LANES] int32 words: byte p of word q is
    byte 4q+p of the group, so x_ptrs (at the words' first codes, 4 apart) + p meets it."""
    part = tl.zeros([BLOCK_N, BLOCK_G, LANES], dtype=tl.float32)
    xs = tl.zeros([BLOCK_G, LANES], dtype=tl.float32)
    for p in tl.static_range(4):
        v = raw >> (8 * p)  # (arithmetic shift: the masks below drop the sign copies)
        xa = _load_x(x_ptrs + p, mask_g, EVEN_G)
        if BITS == 4:
            xb = _load_x(x_ptrs + p + GBYTES, mask_g, EVEN_G)
            if MAGIC:
                lo, hi16 = nibbles_f32_hi16(v)
                part += lo * xa[None, :, :] + hi16 * (xb * 0.0625)[None, :, :]
            else:
                part += ((v & 15).to(tl.float32) * xa[None, :, :]
                         + ((v >> 4) & 15).to(tl.float32) * xb[None, :, :])
            xs += xa + xb
        else:
            if MAGIC:
                c = int8_f32(v & 255)
            else:
                c = (((v & 255) ^ 0x80) - 128).to(tl.float32)
            part += c * xa[None, :, :]
            xs += xa
    return tl.sum(part, axis=2), tl.sum(xs, axis=1)


@triton.jit
def _qgemv_kernel(
    X, CODES, SCALE, ZERO, SUP_S, SUP_Z, B, Y, P, CNT,
    N, G, SLICE_G,
    stride_xm, stride_cn, stride_ym, stride_ps,
    BITS: tl.constexpr, GROUP: tl.constexpr, GBYTES: tl.constexpr, SUPER: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    EVEN_G: tl.constexpr, EVEN: tl.constexpr, MAGIC: tl.constexpr, WORDS: tl.constexpr,
    LANES: tl.constexpr, ROWS_FIRST: tl.constexpr, SPLIT: tl.constexpr, LAST: tl.constexpr,
):
    row, pid_n, pid_s = gemv_program(ROWS_FIRST)
    g_lo, g_hi = k_slice(pid_s, G, SLICE_G, SPLIT)  # this program's groups of K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_g = tl.arange(0, BLOCK_G)  # [BLOCK_G]
    offs_i = tl.arange(0, LANES)  # [LANES] code bytes (or int32 words) of one group
    mask_n = offs_n < N
    rows64 = offs_n.to(tl.int64)
    # [BLOCK_N, BLOCK_G, LANES]: the codes of a tile, contiguous per group (CODES is uint8,
    # or int32 with WORDS; stride_cn in those units)
    c_ptrs = (CODES + rows64[:, None, None] * stride_cn + offs_g[None, :, None] * LANES
              + offs_i[None, None, :])
    x_row = X + row.to(tl.int64) * stride_xm
    # [BLOCK_G, LANES]: K of each lane's first (low-nibble) code: bytes 1 apart, words 4
    x_off = offs_g[:, None] * GROUP + offs_i[None, :] * (GBYTES // LANES)
    acc = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, BLOCK_G):
        mask_g = g0 + offs_g < G  # (all true when EVEN_G: only the masked loads read it)
        m2 = mask_n[:, None] & mask_g[None, :]
        if EVEN:  # no tile crosses the N or the G edge: unmasked loads
            raw = tl.load(c_ptrs + g0 * LANES)
            s, z = load_group_scales(SCALE, ZERO, SUP_S, SUP_Z, rows64, g0 + offs_g, G, m2,
                                     False, SUPER)
        else:
            raw = tl.load(c_ptrs + g0 * LANES, mask=m2[:, :, None], other=0)
            s, z = load_group_scales(SCALE, ZERO, SUP_S, SUP_Z, rows64, g0 + offs_g, G, m2,
                                     True, SUPER)
        x_ptrs = x_row + g0 * GROUP + x_off
        if WORDS:
            part, xsum = _words_dot(raw, x_ptrs, mask_g, BITS, GBYTES, EVEN_G, MAGIC,
                                    BLOCK_N, BLOCK_G, LANES)
        else:
            part, xsum = _bytes_dot(raw, x_ptrs, mask_g, BITS, GBYTES, EVEN_G, MAGIC)
        acc += part * s + z * xsum[None, :]
    store_rows(tl.sum(acc, axis=1), B, Y, P, CNT, row, pid_n, pid_s, tl.cdiv(N, BLOCK_N),
               offs_n, mask_n, N, stride_ym, stride_ps, HAS_BIAS, SPLIT, LAST)


def qgemv(
    x: torch.Tensor,  # [..., K]
    w: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [N]
    config: QGemvConfig | None = None,
) -> torch.Tensor:  # [..., N] in x's dtype
    n, k, gs = w.out_features, w.in_features, w.group_size
    x2 = _rows(x, k)  # [M, K]
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)  # [M, N]
    if m and n:
        cfg = config or gemv_config("q4" if w.bits == 4 else "q8", n, k, gs)
        if cfg.unpack not in UNPACKS:
            raise ValueError(f"unpack {cfg.unpack!r}: use one of {list(UNPACKS)}")
        block_g, groups = groups_per_block(cfg.block_k, gs), k // gs
        if cfg.unpack == "mma" and w.bits == 4:  # (its own launches: all rows per program)
            _q4_mma(x2, w, bias, y, cfg, block_g)
            return y.reshape(*x.shape[:-1], n)
        gbytes = gs // 2 if w.bits == 4 else gs
        # (every group's bytes are a multiple of 4 and rows start 4-aligned: int32 views)
        codes = w.codes.view(torch.int32) if cfg.words else w.codes.view(torch.uint8)
        sup_s, sup_z, sup = scale_args(w)
        n_blocks = cdiv(n, cfg.block_n)
        grid, rows_first = row_grid(m, n_blocks)
        sk = split_launch(y, cdiv(groups, block_g), block_g, n_blocks, cfg.split_k,
                          cfg.split_reduce)
        even = n % cfg.block_n == 0 and groups % block_g == 0
        if cfg.unpack == "lop3" and w.bits == 4:
            words = w.codes.view(torch.int32)  # [N, K/8]: 4 words per group
            q4_lop3_kernel[(*grid, sk.split)](
                x2, words, w.scale, w.zero, sup_s, sup_z,
                bias if bias is not None else sup_s, y, sk.partials, sk.counters,
                n, groups, sk.slice_units,
                x2.stride(0), words.stride(0), y.stride(0), sk.slice_stride,
                SUPER=sup, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_G=block_g,
                EVEN=even, ROWS_FIRST=rows_first, SPLIT=sk.split, LAST=sk.last,
                ASM=not is_interpreted(q4_lop3_kernel), PREFETCH=cfg.prefetch,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            )
            finish_split(sk, bias, y)
            return y.reshape(*x.shape[:-1], n)
        _qgemv_kernel[(*grid, sk.split)](
            x2, codes, w.scale, w.zero, sup_s, sup_z,
            bias if bias is not None else sup_s, y, sk.partials, sk.counters,
            n, groups, sk.slice_units,
            x2.stride(0), codes.stride(0), y.stride(0), sk.slice_stride,
            BITS=w.bits, GROUP=gs, GBYTES=gbytes, SUPER=sup,
            HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_G=block_g,
            EVEN_G=groups % block_g == 0, EVEN=even,
            MAGIC=cfg.magic, WORDS=cfg.words, LANES=gbytes // 4 if cfg.words else gbytes,
            ROWS_FIRST=rows_first, SPLIT=sk.split, LAST=sk.last, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        finish_split(sk, bias, y)
    return y.reshape(*x.shape[:-1], n)


MMA_MAX_ROWS = 16  # rows of x one mma launch serves (the dot's columns); more: in chunks
MMA_MIN_COLS = 16  # the dot's columns at least (rows of x padded with zeros)


def _q4_mma(x2: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None, y: torch.Tensor,
            cfg: QGemvConfig, block_g: int) -> None:
    """y [M, N] = x2 [M, K] @ w^T + bias through quant/triton_q4mma.py, every row of x (at
    most MMA_MAX_ROWS at a time) in one program per block of N."""
    # (imported here: triton_q4mma takes load_group_scales from this module)
    from sgl.backend.quant.triton_q4mma import q4_mma_kernel

    n, groups = w.out_features, w.in_features // w.group_size
    sup_s, sup_z, sup = scale_args(w)
    n_blocks = cdiv(n, cfg.block_n)
    for r0 in range(0, x2.shape[0], MMA_MAX_ROWS):
        xr, yr = x2[r0:r0 + MMA_MAX_ROWS], y[r0:r0 + MMA_MAX_ROWS]
        rows = xr.shape[0]
        sk = split_launch(yr, cdiv(groups, block_g), block_g, n_blocks, cfg.split_k,
                          cfg.split_reduce)
        q4_mma_kernel[(n_blocks, sk.split)](
            xr, w.codes.view(torch.uint8), w.scale, w.zero, sup_s, sup_z,
            bias if bias is not None else sup_s, yr, sk.partials, sk.counters,
            n, groups, sk.slice_units,
            xr.stride(0), w.codes.stride(0), yr.stride(0), sk.slice_stride,
            SUPER=sup, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_G=block_g,
            EVEN=n % cfg.block_n == 0 and groups % block_g == 0, ROWS=rows,
            ROWS2=next_power_of_2(rows),
            XCOLS=max(MMA_MIN_COLS, next_power_of_2(rows)), SPLIT=sk.split, LAST=sk.last,
            ASM=not is_interpreted(q4_mma_kernel), UPCAST=is_interpreted(q4_mma_kernel),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        finish_split(sk, bias, yr)


def row_grid(m: int, n_blocks: int) -> tuple[tuple[int, int], bool]:
    """(grid, rows first) of a GEMV launch. Several rows: the row is the fastest grid axis,
    so the programs reading one weight tile run back to back and all but the first find it
    in L2 (with the row axis second, gate_up's 66 MB of codes would stream from DRAM once
    per row); CUDA's second axis stops at 65,535, past which the rows go second."""
    if m > 1 and n_blocks <= 65535:
        return (m, n_blocks), True
    return (n_blocks, m), False


def groups_per_block(block_k: int, group_size: int) -> int:
    """The weight groups one K step of a kernel covers: a power of two (the kernels' group
    axis is a tl.arange), else ValueError."""
    g = block_k // group_size
    if block_k % group_size or g & (g - 1):
        raise ValueError(f"block_k {block_k} must be a power-of-two number of "
                         f"{group_size}-weight groups")
    return g


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x as [M, K] with a unit stride along K (the kernels index rows by stride)."""
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {k}")
    x2 = x.reshape(-1, k)  # [M, K]
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
