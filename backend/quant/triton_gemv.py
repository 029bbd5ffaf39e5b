"""Decode GEMVs on quantized weights, dequantizing in registers (Triton, CUDA).

    qgemv(x [M, K], w: QuantizedWeight, bias [N] | None) -> [M, N]   (x's dtype)
    fp8_gemv(x [M, K], weight [N, K] float8_e4m3fn, scale [N] f32, bias) -> [M, N]

At one row a decode step streams the weights once, so the kernel's job is to read each code
byte exactly once with wide loads and spend as few instructions per weight as it can:

- QuantizedWeight (every GGUF format, quant/weight.py): a program owns BLOCK_N output rows and
  walks K BLOCK_G groups at a time. The codes of a tile load as [BLOCK_N, BLOCK_G, bytes per
  group] (16 bytes per 4-bit group: one vector load per group row). A 4-bit byte i holds
  code i (low nibble) and code i+16 (high), so the matching activations are two gathers
  [BLOCK_G, 16] of x at g*32+i and g*32+16+i. Per weight: unpack, convert, one FMA into a
  per-group partial; the group's float32 scale and zero are applied once per group:
      y[n] += scale[n,g] * sum_i code[n,g,i] * x[g,i]  +  zero[n,g] * sum_i x[g,i]
  (the second sum is shared by all rows of the tile, so the zero costs nothing per weight).
  Factored scales (quant/factored.py, the K-quants on the GPU) are multiplied out per group.
- FP8: per-output-channel scales factor out of the whole row: the kernel accumulates
  w_fp8 * x in fp32 and multiplies by scale[n] once at the end. The e4m3 bytes are decoded
  with integer ops by default (`e4m3_f32`), the hardware conversion is a config switch.

Rows of x are a second grid axis (each program re-reads its weight tile; the engine sends
only one-row products here: quant/linear.py routes more rows to the tiled kernels). Configs
depend on the shape only: graph-safe, no host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl.backend.kernels.triton_compat import cdiv, next_power_of_2, tl, triton
from sgl.backend.quant.weight import QuantizedWeight

__all__ = ["QGemvConfig", "e4m3_f32", "fp8_gemv", "fp8_gemv_config", "int8_f32",
           "load_group_scales", "nibbles_f32", "nibbles_f32_hi16", "qgemv", "qgemv_config",
           "scale_args"]


class QGemvConfig(NamedTuple):
    block_n: int  # output rows per program
    block_k: int  # weights along K per step (a multiple of the group size)
    num_warps: int
    fp8_bits: bool = True  # FP8 only: decode e4m3 with integer ops (see `e4m3_f32`)


def qgemv_config(n: int, k: int, group_size: int) -> QGemvConfig:
    """Tile sizes for one row against an [n, k] quantized weight (shape-only).

    Starting points by analogy with the bf16 GEMV's H200 sweep (kernels/gemv.py), not yet
    measured on the device (bench/quant_gemv_bench.py sweeps them): 512 weights per step
    is 256 code bytes per 4-bit row, so a 16-row tile moves 4 KB per step across 4 warps
    (two 16-byte loads per thread); fewer rows per program where N is large (many programs).
    """
    block_n = 16 if n <= 8192 else 8
    block_k = min(512, max(group_size, next_power_of_2(k)))
    return QGemvConfig(block_n, block_k, 4)


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
    conversions (16 per clock per SM on Hopper, an eighth of the FMA rate: at one row they,
    not the bytes, would bound the kernel): the value goes into the low mantissa bits of
    2^23 (0x4B000000), then 2^23 is subtracted; two integer ops and one add per code."""
    lo = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    hi = ((b >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
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
    """int8 codes read as bytes (uint8 -> int32, 0..255) -> float32 exactly, the same way:
    b ^ 0x80 is the code + 128 (one integer op with the OR), 2^23 + 128 is subtracted."""
    return ((b ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


def scale_args(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(super_scale, super_zero, super_groups) kernel arguments (dummies when plain)."""
    if w.super_groups:
        assert w.super_scale is not None and w.super_zero is not None
        return w.super_scale, w.super_zero, w.super_groups
    return w.scale, w.zero, 0


@triton.jit
def _qgemv_kernel(
    X, CODES, SCALE, ZERO, SUP_S, SUP_Z, B, Y,
    N, G,
    stride_xm, stride_cn, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, GBYTES: tl.constexpr, SUPER: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    EVEN_G: tl.constexpr, EVEN: tl.constexpr,
):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_g = tl.arange(0, BLOCK_G)  # [BLOCK_G]
    offs_i = tl.arange(0, GBYTES)  # [GBYTES] code bytes of one group
    mask_n = offs_n < N
    rows64 = offs_n.to(tl.int64)
    # [BLOCK_N, BLOCK_G, GBYTES]: the code bytes of a tile, contiguous per group (CODES is
    # always passed as uint8: 8-bit codes are decoded from their bytes by int8_f32)
    c_ptrs = (CODES + rows64[:, None, None] * stride_cn + offs_g[None, :, None] * GBYTES
              + offs_i[None, None, :])
    x_row = X + row.to(tl.int64) * stride_xm
    x_off = offs_g[:, None] * GROUP + offs_i[None, :]  # [BLOCK_G, GBYTES]: first code of a byte
    acc = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        mask_g = g0 + offs_g < G  # (all true when EVEN_G: only the masked loads read it)
        m2 = mask_n[:, None] & mask_g[None, :]
        if EVEN:  # no tile crosses the N or the G edge: unmasked loads
            raw = tl.load(c_ptrs + g0 * GBYTES)
            s, z = load_group_scales(SCALE, ZERO, SUP_S, SUP_Z, rows64, g0 + offs_g, G, m2,
                                     False, SUPER)
        else:
            raw = tl.load(c_ptrs + g0 * GBYTES, mask=m2[:, :, None], other=0)
            s, z = load_group_scales(SCALE, ZERO, SUP_S, SUP_Z, rows64, g0 + offs_g, G, m2,
                                     True, SUPER)
        x_ptrs = x_row + g0 * GROUP + x_off
        if EVEN_G:
            xa = tl.load(x_ptrs).to(tl.float32)
        else:
            xa = tl.load(x_ptrs, mask=mask_g[:, None], other=0.0).to(tl.float32)
        if BITS == 4:
            b = raw.to(tl.int32)
            if EVEN_G:  # the high nibbles' activations: 16 codes further along K
                xb = tl.load(x_ptrs + GBYTES).to(tl.float32)
            else:
                xb = tl.load(x_ptrs + GBYTES, mask=mask_g[:, None], other=0.0).to(tl.float32)
            lo, hi16 = nibbles_f32_hi16(b)
            xb16 = xb * 0.0625  # (hi16 is 16 * code)
            # [BLOCK_N, BLOCK_G]: each group's sum of code * x
            part = tl.sum(lo * xa[None, :, :] + hi16 * xb16[None, :, :], axis=2)
            xsum = tl.sum(xa + xb, axis=1)  # [BLOCK_G]
        else:
            part = tl.sum(int8_f32(raw.to(tl.int32)) * xa[None, :, :], axis=2)
            xsum = tl.sum(xa, axis=1)
        acc += part * s + z * xsum[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Y + row.to(tl.int64) * stride_ym + offs_n, y.to(Y.dtype.element_ty), mask=mask_n)


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
        cfg = config or qgemv_config(n, k, gs)
        block_g, groups = groups_per_block(cfg.block_k, gs), k // gs
        sup_s, sup_z, sup = scale_args(w)
        _qgemv_kernel[(cdiv(n, cfg.block_n), m)](
            x2, w.codes.view(torch.uint8), w.scale, w.zero, sup_s, sup_z,
            bias if bias is not None else sup_s, y,
            n, groups,
            x2.stride(0), w.codes.stride(0), y.stride(0),
            BITS=w.bits, GROUP=gs, GBYTES=gs // 2 if w.bits == 4 else gs, SUPER=sup,
            HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_G=block_g,
            EVEN_G=groups % block_g == 0, EVEN=n % cfg.block_n == 0 and groups % block_g == 0,
            num_warps=cfg.num_warps,
        )
    return y.reshape(*x.shape[:-1], n)


def fp8_gemv_config(n: int, k: int) -> QGemvConfig:
    """FP8 tiles: one byte per weight, so the bf16 GEMV's 2-byte tiles with twice the K
    span move the same bytes per step (a starting point, to be swept on the device)."""
    block_n = 16 if n <= 4096 else 8
    return QGemvConfig(block_n, min(1024, max(64, next_power_of_2(k))), 4)


@triton.jit
def e4m3_f32(b):
    """e4m3 bytes (as int32 0..255) -> float32 equal to the value times 2^-120, by moving the
    sign to bit 31 and exponent|mantissa to bits 20..26 (the float32 exponent field then
    holds e4m3's, whose bias is 120 smaller; e4m3 subnormals land on float32 subnormals,
    also exact). Four integer ops per weight, against two conversions on the hardware path
    (e4m3x2 -> f16x2, f16 -> f32: 16 per clock per SM on Hopper, under the ~16 weights per
    clock per SM that the bandwidth brings at one row). No NaN handling: quantize() never
    writes one."""
    return (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_gemv_kernel(
    X, W, SCALE, B, Y,
    N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BITS_CVT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    mask_n = offs_n < N
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_row = X + row.to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        if EVEN_K and EVEN_N:
            w = tl.load(w_ptrs + k0)
            xv = tl.load(x_row + kk)
        else:
            mask_k = kk < K
            w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            xv = tl.load(x_row + kk, mask=mask_k, other=0.0)
        if BITS_CVT:  # W is the weight's bytes (uint8)
            acc += e4m3_f32(w.to(tl.int32)) * xv.to(tl.float32)[None, :]
        else:
            acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if BITS_CVT:
        y = y * 1.329227995784916e36  # 2^120: e4m3_f32's values are the weights / 2^120
    y = y * tl.load(SCALE + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Y + row.to(tl.int64) * stride_ym + offs_n, y.to(Y.dtype.element_ty), mask=mask_n)


def fp8_gemv(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, rows contiguous
    scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
    config: QGemvConfig | None = None,
) -> torch.Tensor:  # [..., N] in x's dtype
    n, k = weight.shape
    x2 = _rows(x, k)  # [M, K]
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)  # [M, N]
    if m and n:
        cfg = config or fp8_gemv_config(n, k)
        _fp8_gemv_kernel[(cdiv(n, cfg.block_n), m)](
            x2, weight.view(torch.uint8) if cfg.fp8_bits else weight, scale,
            bias if bias is not None else scale, y,
            n, k,
            x2.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0, BITS_CVT=cfg.fp8_bits,
            num_warps=cfg.num_warps,
        )
    return y.reshape(*x.shape[:-1], n)


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
