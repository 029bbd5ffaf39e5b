"""Tiled products and dequantization on QuantizedWeights (Triton, CUDA): more than one row.

    qgemm(x [M, K], w: QuantizedWeight, bias) -> [M, N]              (x's dtype)
    qdequant(w, dtype) -> [N, K]

(FP8 weights: quant/triton_fp8.py, which shares `GemmConfig` and the `GEMM_DEFAULTS` table.)

`qgemm` serves decode batches (2 to a few hundred rows): a program owns a [BLOCK_M, BLOCK_N]
output tile and walks K; each step loads one tile of codes, dequantizes it in registers to
x's dtype (float32 scale/zero math, then one rounding: the reference's bf16 weights exactly)
and feeds tensor cores through `tl.dot` with float32 accumulators (W4A16 / W8A16: the
activations are never quantized). The weight bytes are read once per BLOCK_M rows and the
dequantization is paid once per BLOCK_M rows too.

`GemmConfig.split_k` > 1 cuts K into slices on a third grid axis, as the GEMVs do
(quant/triton_split.py: float32 partials added in slice order by a second kernel or by the
tile's last slice): at a few dozen rows an 8B product has only N / BLOCK_N tiles (32-128 at
N = 4096), too few programs to keep the GPU's memory system busy.

Which operand the weight tile is (`GemmConfig.weight_as_a`) is a switch for the device to
decide: as the second operand (y = x W^T, the weight tile transposed) Hopper's wgmma must
read it from shared memory, so the dequantized tile takes a trip through it; as the first
(y^T = W x^T, the output tile stored transposed) wgmma can take it straight from registers,
and the rows of x become the MMA's N dimension, which may be as small as 8 (small batches
waste no tensor-core rows).

4-bit codes hold k = g*32+i in the low nibble and g*32+16+i in the high one. Two ways to feed
them to the tensor cores (`GemmConfig.join`):
- two dots per K step over the half-tiles: x gathered at the low-nibble columns times the low
  codes, plus the same for the high ones (no permutation of the codes);
- joined (the default from 17 rows on): the two halves interleaved back into K order in
  registers (join, permute, reshape: a byte's two codes sit in the same thread, and the dot
  operand's layout keeps them there, so nothing moves between threads), then one dot over
  x's columns as they lie. Under Triton 3.6 the two-dot step waits for the first dot's wgmma
  before issuing the second (`wgmma.wait_group 0` inside the loop); the joined step issues
  its wgmmas asynchronously and waits on them one K step later, so the dequantization of the
  next tile overlaps them. Per 8B step on the H200: 9.4 -> 8.1 ms at 64 rows (7.7 with the
  wide products' tiles retuned), and at 128 rows 11.4 ms against scratch + cuBLAS's 12.1 (at
  16 rows no change; at 256 scratch wins).

`qdequant` writes the float weight (prefill: many rows, where cuBLAS on a dequantized
scratch beats a tiled kernel of ours and the dequantization is a small part of the step;
quant/linear.py's CUDA table picks by rows).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl.backend.kernels.triton_compat import arrives_last, cdiv, is_interpreted, mma, tl, triton
from sgl.backend.quant.triton_gemv import (
    _rows,
    groups_per_block,
    int8_f32,
    load_group_scales,
    nibbles_f32,
    scale_args,
)
from sgl.backend.quant.triton_split import (SplitLaunch, finish_split, k_slice, split_launch,
                                            sum_slices)
from sgl.backend.quant.weight import QuantizedWeight

__all__ = ["GEMM_DEFAULTS", "GemmConfig", "gemm_config", "qdequant", "qgemm", "split_tile_launch",
           "store_split_tile", "store_tile"]


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int  # weights along K per step (a power-of-two number of groups)
    num_warps: int
    num_stages: int
    weight_as_a: bool = False  # the weight tile as the dot's first operand (module doc)
    split_k: int = 1  # K slices (a third grid axis, quant/triton_split.py); 1: no split
    split_reduce: str = "kernel"  # who adds the slices: "kernel" (a second one) | "last"
    join: bool = False  # 4-bit: both halves of a group in one tile and one dot (module doc)


# Tiles by weight kind (quant/linear.py's names: "q4", "q8", "fp8") and rows (shape-only:
# graph-safe), set from bench/quant_gemv_bench.py's sweep at 16, 64, 256 and 1,024 rows
# (session 6, H200), the split-K entries from bench/tiled_split_sweep.py (session 17, H200:
# per 8B step at 16 rows Q4 6,975 -> 5,847 us and FP8 3,904 -> 3,073, at 64 rows Q4 11,897 ->
# 9,521 and FP8 6,230 -> 5,158; at 128-256 rows no split beat scratch + cuBLAS), the joined
# 4-bit entries from the same sweep with `--join both` and `--warps 4,8` (session 18: at 64
# rows 9,402 -> 7,721 us, at 128 rows 11,416 against scratch's 12,144; 256 rows stay on
# scratch). Each entry:
# (largest M, config for N <= 8192, config for larger N); the last covers the rest.
# GemmConfig(block_m, block_n, block_k, num_warps, num_stages, weight_as_a, split_k,
# split_reduce, join). quant/linear.py's CUDA_ROUTES decides the rows this kernel serves.
_G = GemmConfig
GEMM_DEFAULTS: dict[str, tuple[tuple[int, GemmConfig, GemmConfig], ...]] = {
    "q4": ((16, _G(16, 64, 256, 4, 3, False, 4, "last"), _G(16, 64, 128, 4, 3, False, 2, "last")),
           (64, _G(64, 64, 128, 4, 3, False, 4, "last", True),
            _G(64, 64, 128, 4, 2, True, 2, "last", True)),
           (128, _G(128, 64, 128, 4, 2, True, 4, "last", True),
            _G(128, 128, 128, 8, 4, True, 1, "kernel", True)),
           (256, _G(128, 64, 128, 4, 2, True, 2, "last", True),
            _G(128, 128, 128, 8, 4, True, 2, "last", True)),
           (1 << 62, _G(128, 128, 128, 8, 3, True), _G(128, 128, 128, 8, 4, True))),
    "q8": ((16, _G(16, 32, 128, 4, 3), _G(16, 32, 64, 4, 4)),
           (64, _G(64, 32, 128, 4, 3), _G(64, 64, 64, 4, 3, True)),
           (256, _G(128, 64, 128, 8, 3), _G(128, 128, 64, 8, 3)),
           (1 << 62, _G(128, 128, 64, 8, 3), _G(128, 128, 64, 8, 3))),
    "fp8": ((16, _G(16, 32, 128, 4, 4, False, 4, "last"), _G(16, 32, 256, 4, 3)),
            (64, _G(64, 64, 128, 4, 4, False, 4, "last"), _G(64, 128, 128, 8, 3, True)),
            (256, _G(64, 64, 128, 4, 3, True), _G(128, 128, 64, 4, 3, True)),
            (1 << 62, _G(128, 128, 64, 4, 3, True), _G(128, 128, 64, 4, 3, True))),
}


def gemm_config(m: int, n: int, k: int, group_size: int = 32, kind: str = "q4") -> GemmConfig:
    """The table's tiles for an [m, k] x [n, k]^T product; BLOCK_K at least one group."""
    small, large = next((s, l) for limit, s, l in GEMM_DEFAULTS[kind] if m <= limit)  # noqa: E741
    cfg = small if n <= 8192 else large
    return cfg._replace(block_k=max(cfg.block_k, group_size))


@triton.jit
def _weight_tile(CODES, SCALE, ZERO, SUP_S, SUP_Z, c_ptrs, rows64, offs_g, g0, G, mask_n,
                 dt: tl.constexpr, BITS: tl.constexpr, GBYTES: tl.constexpr,
                 SUPER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                 JOIN: tl.constexpr):
    """The dequantized weights of one K step in x's dtype: (low codes, high codes) for 4 bits,
    [BLOCK_N, BLOCK_G * GBYTES] each; with JOIN (and for 8 bits) one tile [BLOCK_N,
    BLOCK_G * GROUP] in K order, returned twice."""
    mask_g = g0 + offs_g < G
    m2 = mask_n[:, None] & mask_g[None, :]
    raw = tl.load(c_ptrs + g0 * GBYTES, mask=m2[:, :, None], other=0)  # [BLOCK_N, BLOCK_G, GB]
    s, z = load_group_scales(SCALE, ZERO, SUP_S, SUP_Z, rows64, g0 + offs_g, G, m2, True, SUPER)
    s, z = s[:, :, None], z[:, :, None]
    if BITS == 4:
        lo, hi = nibbles_f32(raw.to(tl.int32))
        w_lo = (lo * s + z).to(dt)  # [BLOCK_N, BLOCK_G, GBYTES]
        w_hi = (hi * s + z).to(dt)
        if JOIN:  # k = g * GROUP + half * GBYTES + byte: a byte's two codes in one thread
            w_lo = tl.reshape(tl.permute(tl.join(w_lo, w_hi), (0, 1, 3, 2)),
                              (BLOCK_N, BLOCK_G * 2 * GBYTES))
            w_hi = w_lo
        else:
            w_lo = tl.reshape(w_lo, (BLOCK_N, BLOCK_G * GBYTES))
            w_hi = tl.reshape(w_hi, (BLOCK_N, BLOCK_G * GBYTES))
    else:
        w_lo = tl.reshape((int8_f32(raw.to(tl.int32)) * s + z).to(dt),
                          (BLOCK_N, BLOCK_G * GBYTES))
        w_hi = w_lo
    return w_lo, w_hi


@triton.jit
def _qgemm_kernel(
    X, CODES, SCALE, ZERO, SUP_S, SUP_Z, B, Y, P, CNT,
    M, N, G, SLICE_G,
    stride_xm, stride_cn, stride_ym, stride_ps,
    BITS: tl.constexpr, GROUP: tl.constexpr, GBYTES: tl.constexpr, SUPER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, W_AS_A: tl.constexpr,
    SPLIT: tl.constexpr, LAST: tl.constexpr, JOIN: tl.constexpr,
):
    pid_m = tl.program_id(0)  # fastest: the row blocks sharing a weight tile run together
    pid_n = tl.program_id(1)
    g_lo, g_hi = k_slice(tl.program_id(2), G, SLICE_G, SPLIT)  # this program's groups of K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_g = tl.arange(0, BLOCK_G)
    offs_i = tl.arange(0, GBYTES)
    mask_m, mask_n = offs_m < M, offs_n < N
    rows64 = offs_n.to(tl.int64)
    c_ptrs = (CODES + rows64[:, None, None] * stride_cn + offs_g[None, :, None] * GBYTES
              + offs_i[None, None, :])  # [BLOCK_N, BLOCK_G, GBYTES]
    if JOIN or BITS == 8:  # one tile in K order: x's columns as they lie
        offs_j = tl.arange(0, BLOCK_G * GROUP)  # [TILE_K]
        x_grp = offs_j // GROUP
        x_col = offs_j
    else:  # column of K a byte's low code belongs to: group * GROUP + byte within the group
        offs_j = tl.arange(0, BLOCK_G * GBYTES)  # [TILE_K]: byte column of the tile
        x_grp = offs_j // GBYTES
        x_col = x_grp * GROUP + offs_j % GBYTES
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + x_col[None, :]  # [BLOCK_M, TILE_K]
    dt = X.dtype.element_ty
    if W_AS_A:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T tile
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, BLOCK_G):
        w_lo, w_hi = _weight_tile(CODES, SCALE, ZERO, SUP_S, SUP_Z, c_ptrs, rows64, offs_g, g0,
                                  G, mask_n, dt, BITS, GBYTES, SUPER, BLOCK_N, BLOCK_G, JOIN)
        mask_x = mask_m[:, None] & (g0 + x_grp < G)[None, :]
        xa = tl.load(x_ptrs + g0 * GROUP, mask=mask_x, other=0.0)
        if W_AS_A:
            acc += mma(w_lo, tl.trans(xa), UPCAST, IEEE)
        else:
            acc += mma(xa, tl.trans(w_lo), UPCAST, IEEE)
        if BITS == 4 and not JOIN:  # the high nibbles: x 16 columns further
            xb = tl.load(x_ptrs + g0 * GROUP + GBYTES, mask=mask_x, other=0.0)
            if W_AS_A:
                acc += mma(w_hi, tl.trans(xb), UPCAST, IEEE)
            else:
                acc += mma(xb, tl.trans(w_hi), UPCAST, IEEE)
    store_split_tile(acc, B, Y, P, CNT, offs_m, offs_n, mask_m, mask_n, stride_ym, stride_ps,
                     HAS_BIAS, W_AS_A, SPLIT, LAST)


@triton.jit
def _tile_offsets(offs_m, offs_n, mask_m, mask_n, stride_ym, TRANSPOSED: tl.constexpr):
    """(offsets, mask) of an output tile of a row-major [M, N] (rows `stride_ym` apart) in the
    accumulator's orientation: [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] when TRANSPOSED."""
    if TRANSPOSED:
        off = offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
        mask = mask_n[:, None] & mask_m[None, :]
    else:
        off = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
    return off, mask


@triton.jit
def store_tile(acc, B, Y, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS: tl.constexpr,
               TRANSPOSED: tl.constexpr):
    """Add the bias and store an output tile: acc [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M]
    when TRANSPOSED (the weight was the dot's first operand)."""
    if HAS_BIAS:
        b = tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if TRANSPOSED:
            acc += b[:, None]
        else:
            acc += b[None, :]
    off, mask = _tile_offsets(offs_m, offs_n, mask_m, mask_n, stride_ym, TRANSPOSED)
    tl.store(Y + off, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def store_split_tile(acc, B, Y, P, CNT, offs_m, offs_n, mask_m, mask_n, stride_ym, stride_ps,
                     HAS_BIAS: tl.constexpr, TRANSPOSED: tl.constexpr, SPLIT: tl.constexpr,
                     LAST: tl.constexpr):
    """`store_tile` for a program of a split-K launch (grid axis 2: its K slice). SPLIT == 1:
    store_tile. Else the slice's float32 tile into P [SPLIT, M, N] (rows `stride_ym` apart,
    as in Y); with LAST the program that completes the tile (the tile's counter in CNT, as
    triton_split.store_rows does for a row) adds the slices in order into Y, else
    `reduce_partials` does after the kernel."""
    if SPLIT == 1:
        store_tile(acc, B, Y, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS, TRANSPOSED)
    else:
        pid_s = tl.program_id(2)
        store_tile(acc, B, P + pid_s.to(tl.int64) * stride_ps, offs_m, offs_n, mask_m, mask_n,
                   stride_ym, False, TRANSPOSED)
        if LAST:
            cnt = CNT + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            if arrives_last(cnt, SPLIT):
                off, mask = _tile_offsets(offs_m, offs_n, mask_m, mask_n, stride_ym, TRANSPOSED)
                total = sum_slices(P + off, mask, stride_ps, SPLIT, True)
                tl.store(cnt, 0)  # (the tile is done: zero for the next launch)
                store_tile(total, B, Y, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS,
                           TRANSPOSED)


def split_tile_launch(y: torch.Tensor, cfg: GemmConfig, steps: int,
                      step: int) -> tuple[tuple[int, int, int], SplitLaunch]:
    """(grid, SplitLaunch) of a tiled launch writing y [M, N] with a K loop of `steps` steps
    of `step` units (quant/triton_split.py's split_launch, one counter per output tile)."""
    m, n = y.shape
    m_blocks, n_blocks = cdiv(m, cfg.block_m), cdiv(n, cfg.block_n)
    # (split_launch sizes the counters for M x n_blocks: at least the m_blocks x n_blocks tiles)
    sk = split_launch(y, steps, step, n_blocks, cfg.split_k, cfg.split_reduce)
    return (m_blocks, n_blocks, sk.split), sk


def qgemm(
    x: torch.Tensor,  # [..., K]
    w: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [N]
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [..., N] in x's dtype
    n, k, gs = w.out_features, w.in_features, w.group_size
    x2 = _rows(x, k)  # [M, K]
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)  # [M, N]
    if m and n:
        cfg = config or gemm_config(m, n, k, gs, "q4" if w.bits == 4 else "q8")
        block_g, groups = groups_per_block(cfg.block_k, gs), k // gs
        sup_s, sup_z, sup = scale_args(w)
        grid, sk = split_tile_launch(y, cfg, cdiv(groups, block_g), block_g)
        _qgemm_kernel[grid](
            x2, w.codes.view(torch.uint8), w.scale, w.zero, sup_s, sup_z,
            bias if bias is not None else sup_s, y, sk.partials, sk.counters,
            m, n, groups, sk.slice_units,
            x2.stride(0), w.codes.stride(0), y.stride(0), sk.slice_stride,
            BITS=w.bits, GROUP=gs, GBYTES=gs // 2 if w.bits == 4 else gs, SUPER=sup,
            HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_G=block_g, UPCAST=is_interpreted(_qgemm_kernel),
            IEEE=x.dtype == torch.float32, W_AS_A=cfg.weight_as_a,
            SPLIT=sk.split, LAST=sk.last, JOIN=cfg.join, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        finish_split(sk, bias, y)
    return y.reshape(*x.shape[:-1], n)


# -- dequantize to a float scratch (prefill) -------------------------------------------------

DEQUANT_ROWS, DEQUANT_GROUPS = 16, 8  # tile of the dequantize kernels: rows x groups


@triton.jit
def _qdequant_kernel(
    CODES, SCALE, ZERO, SUP_S, SUP_Z, OUT, N, G, stride_cn, stride_on,
    BITS: tl.constexpr, GROUP: tl.constexpr, GBYTES: tl.constexpr, SUPER: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    offs_i = tl.arange(0, GBYTES)
    rows64 = offs_n.to(tl.int64)
    m2 = (offs_n < N)[:, None] & (offs_g < G)[None, :]
    m3 = m2[:, :, None]
    raw = tl.load(CODES + rows64[:, None, None] * stride_cn + offs_g[None, :, None] * GBYTES
                  + offs_i[None, None, :], mask=m3, other=0)
    s, z = load_group_scales(SCALE, ZERO, SUP_S, SUP_Z, rows64, offs_g, G, m2, True, SUPER)
    s, z = s[:, :, None], z[:, :, None]
    # [BLOCK_N, BLOCK_G, GBYTES]: where a byte's (low) code goes in the output row
    o_ptrs = (OUT + rows64[:, None, None] * stride_on + offs_g[None, :, None] * GROUP
              + offs_i[None, None, :])
    dt = OUT.dtype.element_ty
    if BITS == 4:
        lo, hi = nibbles_f32(raw.to(tl.int32))
        tl.store(o_ptrs, (lo * s + z).to(dt), mask=m3)
        tl.store(o_ptrs + GBYTES, (hi * s + z).to(dt), mask=m3)
    else:
        tl.store(o_ptrs, (int8_f32(raw.to(tl.int32)) * s + z).to(dt), mask=m3)


def qdequant(w: QuantizedWeight, dtype: torch.dtype, rows: slice = slice(None)) -> torch.Tensor:
    """[n, K] weights of `rows` (a contiguous slice) in `dtype`: `w.dequantize` on the GPU."""
    start, stop, _ = rows.indices(w.out_features)
    n, gs = max(0, stop - start), w.group_size
    groups = w.in_features // gs
    out = torch.empty(n, w.in_features, device=w.codes.device, dtype=dtype)
    if n:
        sup_s, sup_z, sup = scale_args(w)
        _qdequant_kernel[(cdiv(n, DEQUANT_ROWS), cdiv(groups, DEQUANT_GROUPS))](
            w.codes[start:stop].view(torch.uint8), w.scale[start:stop], w.zero[start:stop],
            sup_s[start:stop], sup_z[start:stop], out, n, groups,
            w.codes.stride(0), out.stride(0),
            BITS=w.bits, GROUP=gs, GBYTES=gs // 2 if w.bits == 4 else gs, SUPER=sup,
            BLOCK_N=DEQUANT_ROWS, BLOCK_G=DEQUANT_GROUPS,
        )
    return out
