"""Tiled products and dequantization on quantized weights (Triton, CUDA): more than one row.

    qgemm(x [M, K], w: QuantizedWeight, bias) -> [M, N]              (x's dtype)
    fp8_gemm(x [M, K], weight fp8 [N, K], scale [N], bias) -> [M, N]
    qdequant(w, dtype) -> [N, K]          fp8_dequant(weight, scale, dtype) -> [N, K]

`qgemm` / `fp8_gemm` serve decode batches (2 to a few hundred rows): a program owns a
[BLOCK_M, BLOCK_N] output tile and walks K; each step loads one tile of codes, dequantizes it
in registers to x's dtype (float32 scale/zero math, then one rounding) and feeds tensor cores
through `tl.dot`. The weight bytes are read once per BLOCK_M rows, the dequantization is paid
once per BLOCK_M rows too, so the kernel stays near the quantized bandwidth at small M and
near a tiled GEMM at large M.

4-bit codes hold k = g*32+i in the low nibble and g*32+16+i in the high one; rather than
interleaving the nibbles back into K order (a register shuffle), the step is two dots over
the half-tiles: x gathered at the low-nibble columns times the low codes, plus the same for
the high ones. Equal sums, no permutation.

`qdequant` / `fp8_dequant` write the float weight (prefill: many rows, where cuBLAS on a
dequantized scratch beats any tiled kernel of ours and the dequantization is a small part of
the step; quant/linear.py picks by rows).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl.backend.kernels.triton_compat import cdiv, is_interpreted, mma, tl, triton
from sgl.backend.quant.triton_gemv import (
    _rows,
    groups_per_block,
    int8_f32,
    load_group_scales,
    nibbles_f32,
    scale_args,
)
from sgl.backend.quant.weight import QuantizedWeight

__all__ = ["GemmConfig", "fp8_dequant", "fp8_gemm", "gemm_config", "qdequant", "qgemm"]


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int  # weights along K per step (a multiple of the group size)
    num_warps: int
    num_stages: int


def gemm_config(m: int, n: int, k: int, group_size: int = 32) -> GemmConfig:
    """Tiles from the shape only (graph-safe). BLOCK_M covers the rows in one tile up to 64
    (each weight tile is read and dequantized once); past that, 128-row tiles. Up to 64 rows
    the product is still weight streaming, so output tiles stay narrow where N is small, to
    give the 132 SMs a few programs each (N=4096: 256 programs at 16 columns); past that,
    wide compute tiles. Starting points, to be swept on the device
    (bench/quant_gemv_bench.py --sweep-tiled)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    if m <= 16:
        block_n, block_k = (16 if n <= 8192 else 32), 256
    elif m <= 64:
        block_n, block_k = (32 if n <= 8192 else 64), 128
    else:
        block_n, block_k = 128, 128  # 4-bit: two dots of K=64 per step (the nibble halves)
    warps = 4 if block_m * block_n <= 64 * 64 else 8
    return GemmConfig(block_m, block_n, max(block_k, group_size), warps, 3)


@triton.jit
def _qgemm_kernel(
    X, CODES, SCALE, ZERO, SUP_S, SUP_Z, B, Y,
    M, N, G,
    stride_xm, stride_cn, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, GBYTES: tl.constexpr, SUPER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)  # fastest: the row blocks sharing a weight tile run together
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_g = tl.arange(0, BLOCK_G)
    offs_i = tl.arange(0, GBYTES)
    offs_j = tl.arange(0, BLOCK_G * GBYTES)  # [BLOCK_KB]: byte column of the tile
    mask_m, mask_n = offs_m < M, offs_n < N
    rows64 = offs_n.to(tl.int64)
    c_ptrs = (CODES + rows64[:, None, None] * stride_cn + offs_g[None, :, None] * GBYTES
              + offs_i[None, None, :])  # [BLOCK_N, BLOCK_G, GBYTES]
    # Column of K a byte's (low) code belongs to: group * GROUP + byte within the group.
    x_col = (offs_j // GBYTES) * GROUP + offs_j % GBYTES  # [BLOCK_KB]
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + x_col[None, :]  # [BLOCK_M, BLOCK_KB]
    dt = X.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        mask_g = g0 + offs_g < G
        m2 = mask_n[:, None] & mask_g[None, :]
        raw = tl.load(c_ptrs + g0 * GBYTES, mask=m2[:, :, None], other=0)
        s, z = load_group_scales(SCALE, ZERO, SUP_S, SUP_Z, rows64, g0 + offs_g, G, m2,
                                 True, SUPER)
        s, z = s[:, :, None], z[:, :, None]
        mask_x = mask_m[:, None] & (g0 + offs_j // GBYTES < G)[None, :]
        xa = tl.load(x_ptrs + g0 * GROUP, mask=mask_x, other=0.0)
        if BITS == 4:
            lo, hi = nibbles_f32(raw.to(tl.int32))
            w_lo = tl.reshape((lo * s + z).to(dt), (BLOCK_N, BLOCK_G * GBYTES))
            w_hi = tl.reshape((hi * s + z).to(dt), (BLOCK_N, BLOCK_G * GBYTES))
            xb = tl.load(x_ptrs + g0 * GROUP + GBYTES, mask=mask_x, other=0.0)
            acc += mma(xa, tl.trans(w_lo), UPCAST, IEEE)
            acc += mma(xb, tl.trans(w_hi), UPCAST, IEEE)
        else:
            w = tl.reshape((int8_f32(raw.to(tl.int32)) * s + z).to(dt), (BLOCK_N, BLOCK_G * GBYTES))
            acc += mma(xa, tl.trans(w), UPCAST, IEEE)
    _store_tile(acc, B, Y, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS)


@triton.jit
def _store_tile(acc, B, Y, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


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
        cfg = config or gemm_config(m, n, k, gs)
        block_g = groups_per_block(cfg.block_k, gs)
        sup_s, sup_z, sup = scale_args(w)
        _qgemm_kernel[(cdiv(m, cfg.block_m), cdiv(n, cfg.block_n))](
            x2, w.codes.view(torch.uint8), w.scale, w.zero, sup_s, sup_z,
            bias if bias is not None else sup_s, y,
            m, n, k // gs,
            x2.stride(0), w.codes.stride(0), y.stride(0),
            BITS=w.bits, GROUP=gs, GBYTES=gs // 2 if w.bits == 4 else gs, SUPER=sup,
            HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_G=block_g, UPCAST=is_interpreted(_qgemm_kernel),
            IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return y.reshape(*x.shape[:-1], n)


@triton.jit
def _fp8_gemm_kernel(
    X, W, SCALE, B, Y,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)  # fastest: the row blocks sharing a weight tile run together
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = k0 + offs_k < K
        xa = tl.load(x_ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        # e4m3 values are exact in bf16/fp16/fp32: the cast loses nothing.
        acc += mma(xa, tl.trans(w.to(X.dtype.element_ty)), UPCAST, IEEE)
    acc *= tl.load(SCALE + offs_n, mask=mask_n, other=0.0)[None, :]  # per output channel
    _store_tile(acc, B, Y, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS)


def fp8_gemm(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [..., N] in x's dtype
    n, k = weight.shape
    x2 = _rows(x, k)  # [M, K]
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m and n:
        cfg = config or gemm_config(m, n, k)
        _fp8_gemm_kernel[(cdiv(m, cfg.block_m), cdiv(n, cfg.block_n))](
            x2, weight, scale, bias if bias is not None else scale, y,
            m, n, k,
            x2.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, UPCAST=is_interpreted(_fp8_gemm_kernel),
            IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
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


@triton.jit
def _fp8_dequant_kernel(W, SCALE, OUT, N, K, stride_wn, stride_on,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows64 = offs_n.to(tl.int64)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    w = tl.load(W + rows64[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0.0)
    s = tl.load(SCALE + offs_n, mask=offs_n < N, other=0.0)
    out = (w.to(tl.float32) * s[:, None]).to(OUT.dtype.element_ty)
    tl.store(OUT + rows64[:, None] * stride_on + offs_k[None, :], out, mask=mask)


def fp8_dequant(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                rows: slice = slice(None)) -> torch.Tensor:
    """[n, K] = weight[rows] * scale[rows, None] in `dtype`."""
    w, s = weight[rows], scale[rows]
    n, k = w.shape
    out = torch.empty(n, k, device=w.device, dtype=dtype)
    if n and k:
        _fp8_dequant_kernel[(cdiv(n, 16), cdiv(k, 256))](
            w, s, out, n, k, w.stride(0), out.stride(0), BLOCK_N=16, BLOCK_K=256)
    return out
