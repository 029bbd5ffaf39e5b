"""FP8 (e4m3, one float32 scale per output channel) products on the GPU (Triton, CUDA).

    fp8_gemv(x [M, K], weight fp8 [N, K], scale [N] f32, bias) -> [M, N]   (one row: decode)
    fp8_gemm(x [M, K], weight, scale, bias) -> [M, N]                      (tiled: batches)
    fp8_dequant(weight, scale, dtype) -> [N, K]                            (scratch: prefill)
    fp8_quantize_rows(x [M, K]) -> (e4m3 [M, K], scale [M, 1] f32)         (W8A8's inputs)

The per-channel scale factors out of a whole output row, so every kernel accumulates
w_fp8 * x in float32 and multiplies by scale[n] once at the end. Weight-only: activations stay
in x's dtype (no `torch._scaled_mm`, which would quantize them).

Configs: the "fp8" entries of triton_gemv.GEMV_DEFAULTS and triton_gemm.GEMM_DEFAULTS; the
GEMV's `split_k` cuts K into slices as the codes' GEMV does (quant/triton_split.py).
How the GEMV turns e4m3 bytes into float32 is a config switch (`fp8_decode`), since which is
fastest is a question of instruction rates the device answers (bench/quant_gemv_bench.py,
bench/fp8_gemv_sweep.py):
- "words": the second GEMV kernel (`_fp8_words_kernel`, below; the default above N = 4096);
- "bits": the byte's sign to bit 31 and exponent|mantissa to bits 20..26, four integer ops
  (`e4m3_f32`);
- "sext": the byte loaded as int8 (sign-extended by the load's conversion), then one shift
  and one AND (`e4m3_f32_sext`): the sign-extension copies land in bits 27..31, the AND keeps
  bit 31 and clears the rest;
- "cvt": Triton's conversion (the hardware e4m3x2 -> f16x2 plus f16 -> f32).
The two bit tricks give the value times 2^-120 (the float32 exponent field then holds e4m3's,
whose bias is 120 smaller), exact for normal and subnormal bytes alike (e4m3 subnormals land
on float32 subnormals of the same value, and the accumulation keeps them: float32 FMAs do not
flush by default); the kernel multiplies the row sum by 2^120. No NaN handling: quantize()
never writes one.
"""

from __future__ import annotations

import torch

from sgl.backend.kernels.triton_compat import (cdiv, is_interpreted, let_next_launch, mma,
                                               pdl_launch, tl, triton, wait_for_inputs)
from sgl.backend.quant.triton_gemm import (GemmConfig, gemm_config, split_tile_launch,
                                           store_split_tile)
from sgl.backend.quant.triton_gemv import QGemvConfig, _rows, gemv_config, row_grid
from sgl.backend.quant.triton_split import (finish_split, gemv_program, k_slice, split_launch,
                                            store_rows)

__all__ = ["FP8_DECODES", "e4m3_f32", "e4m3_f32_sext", "e4m3x4_f32", "fp8_dequant", "fp8_gemm",
           "fp8_gemv", "fp8_quantize_rows"]

FP8_DECODES = {"cvt": 0, "bits": 1, "sext": 2, "words": 3}  # QGemvConfig.fp8_decode
# When the one-row GEMVs let the kernel after them launch (triton_compat: PDL): "loop", once
# their K loop is done; "start", once their first step's weights are asked for; "" never (it
# launches as the last program exits). That kernel (RMSNorm, rotary + KV store, SiLU x mul)
# then makes its reads before its wait (the norm's weight, the step's inputs) and lets the
# GEMV after it launch in turn, which asks for its own first weights: memory stays busy across
# the handover. Session 25, inside one engine, the 8B FP8 single stream: "loop" 374.8 tok/s
# against 360.3 for "" (every turn), and 376.4 against 361.4 for "start" (every turn), though
# the 4-bit CUDA GEMV gained from its own "start" (cuda_gemv.CudaGemvConfig.let_next_at_start;
# why the two differ was not measured). A list: bench variants change it (read at each launch,
# so at graph capture).
LET_NEXT = ["loop"]
_LET_NEXT_CODES = {"": 0, "loop": 1, "start": 2}  # the kernels' LET_NEXT


@triton.jit
def e4m3_f32(b):
    """e4m3 bytes (int32 0..255) -> float32 equal to the value times 2^-120."""
    return (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_f32_sext(b):
    """e4m3 bytes sign-extended (int32 -128..127) -> the same as e4m3_f32, in two ops:
    0x87F00000 (as int32) keeps the sign and the 7 exponent|mantissa bits."""
    return ((b << 20) & -2014314496).to(tl.float32, bitcast=True)


@triton.jit
def _load_w(w_ptrs, k0, K, offs_k, mask_n, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """A K step's weights [BLOCK_N, BLOCK_K] of the first kernel (0 past N and K)."""
    if EVEN_N and EVEN_K:
        return tl.load(w_ptrs + k0)
    return tl.load(w_ptrs + k0, mask=mask_n[:, None] & (k0 + offs_k < K)[None, :], other=0.0)


@triton.jit
def _bytes_step(acc, w, x_row, k0, K, offs_k, EVEN: tl.constexpr, DECODE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K] + a K step's products, w decoded as DECODE says."""
    if EVEN:
        xv = tl.load(x_row + k0 + offs_k)
    else:
        xv = tl.load(x_row + k0 + offs_k, mask=k0 + offs_k < K, other=0.0)
    if DECODE == 1:  # W is the weight's bytes (uint8)
        wf = e4m3_f32(w.to(tl.int32))
    elif DECODE == 2:  # W is the weight's bytes as int8
        wf = e4m3_f32_sext(w.to(tl.int32))
    else:  # W is float8e4nv
        wf = w.to(tl.float32)
    return acc + wf * xv.to(tl.float32)[None, :]


@triton.jit
def _fp8_gemv_kernel(
    X, W, SCALE, B, Y, P, CNT,
    N, K, SLICE_K,
    stride_xm, stride_wn, stride_ym, stride_ps,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, DECODE: tl.constexpr,
    ROWS_FIRST: tl.constexpr, SPLIT: tl.constexpr, LAST: tl.constexpr, PDL: tl.constexpr,
    LET_NEXT: tl.constexpr,
):
    row, pid_n, pid_s = gemv_program(ROWS_FIRST)
    k_lo, k_hi = k_slice(pid_s, K, SLICE_K, SPLIT)  # this program's weights of K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    mask_n = offs_n < N
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_row = X + row.to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_first = k_lo
    if PDL:  # launched early: the first weights load before waiting for x (triton_compat)
        w = _load_w(w_ptrs, k_lo, K, offs_k, mask_n, EVEN_N, EVEN_K)
        let_next_launch(LET_NEXT == 2)
        wait_for_inputs(PDL)
        acc = _bytes_step(acc, w, x_row, k_lo, K, offs_k, EVEN_K, DECODE)
        k_first = k_lo + BLOCK_K
    for k0 in range(k_first, k_hi, BLOCK_K):
        w = _load_w(w_ptrs, k0, K, offs_k, mask_n, EVEN_N, EVEN_K)
        acc = _bytes_step(acc, w, x_row, k0, K, offs_k, EVEN_K, DECODE)
    let_next_launch(LET_NEXT == 1)
    y = tl.sum(acc, axis=1)
    if DECODE != 0:
        y = y * 1.329227995784916e36  # 2^120: the bit tricks' values are the weights / 2^120
    y = y * tl.load(SCALE + offs_n, mask=mask_n, other=0.0)
    store_rows(y, B, Y, P, CNT, row, pid_n, pid_s, tl.cdiv(N, BLOCK_N), offs_n, mask_n, N,
               stride_ym, stride_ps, HAS_BIAS, SPLIT, LAST)


@triton.jit
def e4m3x4_f32(words, ASM: tl.constexpr):
    """int32 words of four e4m3 bytes -> their four values as float32 (byte 0 first), exact.
    ASM: two hardware conversions e4m3x2 -> f16x2 per word, then f16 -> f32 per value (the
    compiler's HADD2.F32); otherwise (the interpreter) the integer decode of e4m3_f32, times
    2^120 (a power of two: exact)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 l, h, a0, a1, b0, b1; .reg .b32 a, b;"
            " mov.b32 {l, h}, $4;"
            " cvt.rn.f16x2.e4m3x2 a, l; cvt.rn.f16x2.e4m3x2 b, h;"
            " mov.b32 {a0, a1}, a; mov.b32 {b0, b1}, b;"
            " cvt.f32.f16 $0, a0; cvt.f32.f16 $1, a1; cvt.f32.f16 $2, b0; cvt.f32.f16 $3, b1; }",
            "=r,=r,=r,=r,r", [words], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1)
    two120 = 1.329227995784916e36
    return (e4m3_f32(words & 255) * two120, e4m3_f32((words >> 8) & 255) * two120,
            e4m3_f32((words >> 16) & 255) * two120, e4m3_f32((words >> 24) & 255) * two120)


@triton.jit
def _words_x(X, X32, inner, k0, K, EVEN_K: tl.constexpr, X_PAIRS: tl.constexpr):
    """The activations the words `inner` ([BLOCK_N (broadcast), BLOCK_V, 4] word indices from
    k0 / 4) meet, as four float32 tensors of that shape (byte 0..3 of each word).
    X_PAIRS: bf16 x read as int32 words of two values (X32), widened by a shift and a mask;
    otherwise one load per byte position in x's dtype."""
    if X_PAIRS:
        pair = X32 + k0 // 2 + inner * 2  # x[4w], x[4w+1]; the next word: x[4w+2], x[4w+3]
        if EVEN_K:
            xa = tl.load(pair)
            xb = tl.load(pair + 1)
        else:
            mask = k0 + inner * 4 < K
            xa = tl.load(pair, mask=mask, other=0)
            xb = tl.load(pair + 1, mask=mask, other=0)
        return ((xa << 16).to(tl.float32, bitcast=True),
                (xa & -65536).to(tl.float32, bitcast=True),
                (xb << 16).to(tl.float32, bitcast=True),
                (xb & -65536).to(tl.float32, bitcast=True))
    at = X + k0 + inner * 4
    if EVEN_K:
        return (tl.load(at).to(tl.float32), tl.load(at + 1).to(tl.float32),
                tl.load(at + 2).to(tl.float32), tl.load(at + 3).to(tl.float32))
    mask = k0 + inner * 4 < K
    return (tl.load(at, mask=mask, other=0.0).to(tl.float32),
            tl.load(at + 1, mask=mask, other=0.0).to(tl.float32),
            tl.load(at + 2, mask=mask, other=0.0).to(tl.float32),
            tl.load(at + 3, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _load_words(w_ptrs, inner, mask_n, k0, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """A K step's weight words [BLOCK_N, BLOCK_V, 4] (0 past N and K)."""
    if EVEN_N and EVEN_K:
        return tl.load(w_ptrs + k0 // 4)
    return tl.load(w_ptrs + k0 // 4, mask=mask_n[:, None, None] & (k0 + inner * 4 < K), other=0)


@triton.jit
def _words_step(acc, w, X, X32, inner, k0, K, EVEN_K: tl.constexpr, X_PAIRS: tl.constexpr,
                ASM: tl.constexpr):
    """acc [BLOCK_N, BLOCK_V, 4] + the products of one K step (one FMA per weight)."""
    x0, x1, x2, x3 = _words_x(X, X32, inner, k0, K, EVEN_K, X_PAIRS)
    f0, f1, f2, f3 = e4m3x4_f32(w, ASM)
    return tl.fma(f3, x3, tl.fma(f2, x2, tl.fma(f1, x1, tl.fma(f0, x0, acc))))


@triton.jit
def _fp8_words_kernel(
    X, W, SCALE, B, Y, P, CNT,
    N, K, SLICE_K,
    stride_xm, stride_wn, stride_ym, stride_ps,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, X_PAIRS: tl.constexpr, ASM: tl.constexpr,
    ROWS_FIRST: tl.constexpr, SPLIT: tl.constexpr, LAST: tl.constexpr, PDL: tl.constexpr,
    LET_NEXT: tl.constexpr,
):
    """The FP8 GEMV on int32 words (`fp8_decode="words"`). W: the weight's bytes as int32
    words [N, K / 4] (stride_wn in words). A thread owns 16-byte vectors of a row (four
    words, one 128-bit load), the tile being [BLOCK_N, BLOCK_K / 16, 4] words; every weight
    costs half a hardware e4m3x2 conversion, one f16 -> f32 and one FMA into a float32
    partial of that word position (acc has BLOCK_K / 4 lanes per row, a quarter of the first
    kernel's [BLOCK_N, BLOCK_K]: fewer registers). The activations load in the weights' own
    shape (the row axis a broadcast: repeated addresses, L1 hits), so no step converts a
    layout through shared memory; with X_PAIRS as bf16 pairs, widened in registers."""
    row, pid_n, pid_s = gemv_program(ROWS_FIRST)
    k_lo, k_hi = k_slice(pid_s, K, SLICE_K, SPLIT)  # (multiples of BLOCK_K: of 16; not empty)
    BLOCK_V: tl.constexpr = BLOCK_K // 16
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # word indices of a step from k0 / 4, broadcast over the rows: [BLOCK_N, BLOCK_V, 4]
    inner = ((offs_n * 0)[:, None, None] + tl.arange(0, BLOCK_V)[None, :, None] * 4
             + tl.arange(0, 4)[None, None, :])
    w_ptrs = W + offs_n.to(tl.int64)[:, None, None] * stride_wn + inner
    x_row = X + row.to(tl.int64) * stride_xm
    x32 = X.to(tl.pointer_type(tl.int32), bitcast=True) + row.to(tl.int64) * (stride_xm // 2)
    acc = tl.zeros([BLOCK_N, BLOCK_V, 4], dtype=tl.float32)
    k_first = k_lo
    if PDL:  # launched early: the first weights load before waiting for x (triton_compat)
        w = _load_words(w_ptrs, inner, mask_n, k_lo, K, EVEN_N, EVEN_K)
        let_next_launch(LET_NEXT == 2)
        wait_for_inputs(PDL)
        acc = _words_step(acc, w, x_row, x32, inner, k_lo, K, EVEN_K, X_PAIRS, ASM)
        k_first = k_lo + BLOCK_K
    for k0 in range(k_first, k_hi, BLOCK_K):
        w = _load_words(w_ptrs, inner, mask_n, k0, K, EVEN_N, EVEN_K)
        acc = _words_step(acc, w, x_row, x32, inner, k0, K, EVEN_K, X_PAIRS, ASM)
    let_next_launch(LET_NEXT == 1)
    y = tl.sum(tl.sum(acc, axis=2), axis=1) * tl.load(SCALE + offs_n, mask=mask_n, other=0.0)
    store_rows(y, B, Y, P, CNT, row, pid_n, pid_s, tl.cdiv(N, BLOCK_N), offs_n, mask_n, N,
               stride_ym, stride_ps, HAS_BIAS, SPLIT, LAST)


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
        cfg = config or gemv_config("fp8", n, k, 64)
        if cfg.fp8_decode not in FP8_DECODES:
            raise ValueError(f"fp8_decode {cfg.fp8_decode!r}: use one of {sorted(FP8_DECODES)}")
        mode = FP8_DECODES[cfg.fp8_decode]
        if mode == 3 and (k % 4 or cfg.block_k % 16):  # (rows of whole words only)
            cfg, mode = cfg._replace(fp8_decode="cvt"), 0
        n_blocks = cdiv(n, cfg.block_n)
        grid, rows_first = row_grid(m, n_blocks)
        sk = split_launch(y, cdiv(k, cfg.block_k), cfg.block_k, n_blocks, cfg.split_k,
                          cfg.split_reduce)
        pdl = pdl_launch(x.device, _fp8_gemv_kernel)
        early = {"launch_pdl": True} if pdl else {}  # (triton_compat: PDL)
        let_next = _LET_NEXT_CODES[LET_NEXT[0]] if pdl else 0
        if mode == 3:
            words = weight.view(torch.int32)  # [N, K / 4]
            pairs = (x2.dtype == torch.bfloat16 and x2.data_ptr() % 4 == 0
                     and x2.stride(0) % 2 == 0)  # every row's pairs 4-byte aligned
            _fp8_words_kernel[(*grid, sk.split)](
                x2, words, scale, bias if bias is not None else scale, y, sk.partials,
                sk.counters, n, k, sk.slice_units,
                x2.stride(0), words.stride(0), y.stride(0), sk.slice_stride,
                HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0, X_PAIRS=pairs,
                ASM=not is_interpreted(_fp8_words_kernel), ROWS_FIRST=rows_first,
                SPLIT=sk.split, LAST=sk.last, PDL=pdl, LET_NEXT=let_next,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **early,
            )
            finish_split(sk, bias, y)
            return y.reshape(*x.shape[:-1], n)
        w = weight.view(torch.uint8) if mode == 1 else weight.view(torch.int8) if mode == 2 \
            else weight
        _fp8_gemv_kernel[(*grid, sk.split)](
            x2, w, scale, bias if bias is not None else scale, y, sk.partials, sk.counters,
            n, k, sk.slice_units,
            x2.stride(0), weight.stride(0), y.stride(0), sk.slice_stride,
            HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0, DECODE=mode,
            ROWS_FIRST=rows_first, SPLIT=sk.split, LAST=sk.last, PDL=pdl,
            LET_NEXT=let_next, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **early,
        )
        finish_split(sk, bias, y)
    return y.reshape(*x.shape[:-1], n)


@triton.jit
def _fp8_gemm_kernel(
    X, W, SCALE, B, Y, P, CNT,
    M, N, K, SLICE_K,
    stride_xm, stride_wn, stride_ym, stride_ps,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, W_AS_A: tl.constexpr,
    SPLIT: tl.constexpr, LAST: tl.constexpr,
):
    pid_m = tl.program_id(0)  # fastest: the row blocks sharing a weight tile run together
    pid_n = tl.program_id(1)
    k_lo, k_hi = k_slice(tl.program_id(2), K, SLICE_K, SPLIT)  # this program's part of K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    if W_AS_A:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T tile
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        mask_k = k0 + offs_k < K
        xa = tl.load(x_ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        w = w.to(X.dtype.element_ty)  # (e4m3 values are exact in bf16/fp16/fp32)
        if W_AS_A:
            acc += mma(w, tl.trans(xa), UPCAST, IEEE)
        else:
            acc += mma(xa, tl.trans(w), UPCAST, IEEE)
    s = tl.load(SCALE + offs_n, mask=mask_n, other=0.0)  # per output channel
    if W_AS_A:
        acc *= s[:, None]
    else:
        acc *= s[None, :]
    store_split_tile(acc, B, Y, P, CNT, offs_m, offs_n, mask_m, mask_n, stride_ym, stride_ps,
                     HAS_BIAS, W_AS_A, SPLIT, LAST)


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
        cfg = config or gemm_config(m, n, k, kind="fp8")
        grid, sk = split_tile_launch(y, cfg, cdiv(k, cfg.block_k), cfg.block_k)
        _fp8_gemm_kernel[grid](
            x2, weight, scale, bias if bias is not None else scale, y, sk.partials, sk.counters,
            m, n, k, sk.slice_units,
            x2.stride(0), weight.stride(0), y.stride(0), sk.slice_stride,
            HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, UPCAST=is_interpreted(_fp8_gemm_kernel),
            IEEE=x.dtype == torch.float32, W_AS_A=cfg.weight_as_a,
            SPLIT=sk.split, LAST=sk.last, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        finish_split(sk, bias, y)
    return y.reshape(*x.shape[:-1], n)


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


@triton.jit
def _round_to_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still float32.
    Adding 2^23 times the value's e4m3 step (2^(e - 3); 2^-9 below e4m3's smallest normal
    2^-6) and subtracting it again makes float32's own rounding do it. (Triton's float32 ->
    e4m3 conversion goes through float16 and so rounds twice: 41.99999 became 44, not 40.)"""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = ((e + 20 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3 + 23)
    r = (tl.abs(v) + magic) - magic
    sign = (bits >> 31) << 31  # (arithmetic shift: the sign bit alone)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows_kernel(X, Q, S, K, stride_x, stride_q, FP8_MAX: tl.constexpr,
                          RECIPROCAL: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row per program: its amax in a first pass over x, then x / scale rounded to e4m3
    (exactly representable then, so the conversion to the fp8 type is exact)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(X + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    m = tl.max(amax, axis=0)
    scale = tl.where(m > 0, m * RECIPROCAL, 1.0)
    tl.store(S + row, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        v = tl.load(X + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.clamp(tl.math.div_rn(v, scale), -FP8_MAX, FP8_MAX))
        tl.store(Q + row * stride_q + k0 + offs, q.to(tl.float8e4nv), mask=mask)


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_rows in one kernel (one read of x for the amax, one to quantize; no float32
    temporaries): the same scales and bytes as its torch reference."""
    from sgl.backend.quant.fp8 import FP8_MAX

    m, k = x.shape
    q = torch.empty(m, k, device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    if m and k:
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                    RECIPROCAL=1.0 / FP8_MAX, BLOCK_K=1024, num_warps=4)
    return q, scale
