"""Matrix-vector products for decode at tiny batch: y = x @ W^T (+ b) with few rows of x.

    gemv(x [M, K], W [N, K], b [N] | None) -> y [M, N]     (M <= MAX_ROWS; nn.Linear layout)

At batch 1 a decode step is pure weight streaming: each weight byte is read once and used for
M multiply-adds. cuBLAS picks kernels tuned for larger M and reaches only 1.8-4.2 TB/s on
the H200 there (copy: ~4.3 TB/s), so the small projections (o_proj, 4096x4096) lose most.

Kernel layout: one program per block of BLOCK_N output rows; it walks K in steps of BLOCK_K,
loading a [BLOCK_N, BLOCK_K] tile of W with wide vector loads and the M matching slices of x
(tiny, L1/L2 resident). Products accumulate elementwise into M fp32 tiles of [BLOCK_N,
BLOCK_K]; the cross-lane reduction over K happens once, after the loop. No split-K: N >= 4096
for every projection we serve (k and v are fused into qkv), which already gives hundreds of
programs. The config depends on (M, N, K) only, never on data: the launch is graph-safe.

The kernel takes up to MAX_ROWS rows, but the linear op of the Triton kernel set
(`linear_triton`) sends it one row only: at 2-4 rows it measured slower than cuBLAS on the
H200 (bench/gemv_bench.py).

A module of its own, apart from the reference (gemv.py), so that a CPU engine never imports
Triton (~0.2 s and ~70 MB): the kernel set imports it only when it picks the Triton kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl.backend.kernels.gemv import gemv_reference
from sgl.backend.kernels.triton_compat import cdiv, next_power_of_2, tl, triton

MAX_ROWS = 4  # rows of x the kernel holds in registers (one fp32 accumulator tile each)


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int


def gemv_config(m: int, n: int, k: int) -> GemvConfig:
    """Tile sizes for an [m, k] x [n, k]^T product (shape-only; see the module docstring).

    M=1 picks come from a sweep on the H200 (bench/gemv_bench.py, graph-timed): long K steps
    (1024) everywhere; 16 rows x 8 warps where N is small (4096: o_proj, down), 4 rows where
    N is large (gate_up, LM head: many programs already), 8 rows in between (qkv). For M > 1
    the M fp32 accumulator tiles must fit the registers, so BLOCK_K shrinks as M grows.
    """
    if m == 1:
        if n <= 4096:
            cfg = GemvConfig(16, 1024, 8)
        elif n <= 8192:
            cfg = GemvConfig(8, 512, 4)
        else:
            cfg = GemvConfig(4, 1024, 4)
    else:
        cfg = GemvConfig(8 if n <= 8192 else 16, 512 if m <= 2 else 256, 4)
    block_k = min(cfg.block_k, max(64, next_power_of_2(k)))  # small K (tests): no wasted lanes
    return cfg._replace(block_k=block_k)


@triton.jit
def _gemv_kernel(
    X, W, B, Y,
    N, K,
    stride_xm, stride_wn, stride_ym,
    M: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    mask_n = offs_n < N
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    # One accumulator tile per row of x; the unused ones (M < 4) are dead code after compile.
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        if EVEN_K:
            if EVEN_N:
                w = tl.load(w_ptrs + k0)
            else:
                w = tl.load(w_ptrs + k0, mask=mask_n[:, None], other=0.0)
            x0 = tl.load(X + kk)
        else:
            mask_k = kk < K
            w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            x0 = tl.load(X + kk, mask=mask_k, other=0.0)
        w = w.to(tl.float32)
        acc0 += w * x0.to(tl.float32)[None, :]
        if M > 1:
            if EVEN_K:
                x1 = tl.load(X + stride_xm + kk)
            else:
                x1 = tl.load(X + stride_xm + kk, mask=kk < K, other=0.0)
            acc1 += w * x1.to(tl.float32)[None, :]
        if M > 2:
            if EVEN_K:
                x2 = tl.load(X + 2 * stride_xm + kk)
            else:
                x2 = tl.load(X + 2 * stride_xm + kk, mask=kk < K, other=0.0)
            acc2 += w * x2.to(tl.float32)[None, :]
        if M > 3:
            if EVEN_K:
                x3 = tl.load(X + 3 * stride_xm + kk)
            else:
                x3 = tl.load(X + 3 * stride_xm + kk, mask=kk < K, other=0.0)
            acc3 += w * x3.to(tl.float32)[None, :]
    if HAS_BIAS:
        b = tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    else:
        b = tl.zeros([BLOCK_N], dtype=tl.float32)
    out_ty = Y.dtype.element_ty
    tl.store(Y + offs_n, (tl.sum(acc0, axis=1) + b).to(out_ty), mask=mask_n)
    if M > 1:
        tl.store(Y + stride_ym + offs_n, (tl.sum(acc1, axis=1) + b).to(out_ty), mask=mask_n)
    if M > 2:
        tl.store(Y + 2 * stride_ym + offs_n, (tl.sum(acc2, axis=1) + b).to(out_ty), mask=mask_n)
    if M > 3:
        tl.store(Y + 3 * stride_ym + offs_n, (tl.sum(acc3, axis=1) + b).to(out_ty), mask=mask_n)


def gemv_triton(
    x: torch.Tensor,  # [..., K], at most MAX_ROWS rows
    weight: torch.Tensor,  # [N, K], rows contiguous
    bias: torch.Tensor | None = None,  # [N]
    config: GemvConfig | None = None,
) -> torch.Tensor:  # [..., N] in x's dtype
    n, k = weight.shape
    x2 = x.reshape(-1, k)  # [M, K]
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {m}")
    if weight.stride(-1) != 1:
        raise ValueError("gemv needs the weight's rows contiguous (nn.Linear layout)")
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)  # [M, N]
    if m > 0 and n > 0:
        cfg = config or gemv_config(m, n, k)
        _gemv_kernel[(cdiv(n, cfg.block_n),)](
            x2, weight, bias if bias is not None else weight, y,
            n, k,
            x2.stride(0), weight.stride(0), y.stride(0),
            M=m, HAS_BIAS=bias is not None,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0,
            num_warps=cfg.num_warps,
        )
    return y.reshape(*x.shape[:-1], n)


def linear_triton(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N]
    """The linear op of the Triton kernel set: this GEMV for single-row decode in 16 bits,
    where cuBLAS streams the weights below the copy bandwidth; F.linear (cuBLAS) for every
    other shape. At 2-4 rows the GEMV measured slower than cuBLAS on the H200
    (bench/gemv_bench.py), so it serves one row only. The row count is static inside a CUDA
    graph, so the choice is fixed at capture."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 1 and weight.dtype in (torch.float16, torch.bfloat16) and x.dtype == weight.dtype:
        return gemv_triton(x, weight, bias)
    return gemv_reference(x, weight, bias)
