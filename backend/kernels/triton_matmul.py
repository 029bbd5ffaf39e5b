"""A batch-invariant linear: y = x @ W^T (+ b) whose every row has the same bits whatever the
other rows of the call are (`enable_deterministic_inference`).

    linear_batch_invariant(x [..., K], W [N, K], b [N] | None) -> y [..., N]

Why it exists. The default linear op routes by row count: our GEMV at one row, cuBLAS above,
and cuBLAS itself picks tiles and split-K per shape. Each choice sums a row's K products in
another order, so a token's logits carry last-bit differences that depend on what else is in
its step: a request decoded alone, in a batch of 64, or verifying four draft tokens gets
slightly different numbers, and a near-tie can flip a greedy token.

How it is invariant, by construction:

- One tile configuration (`TILE`) for every row count: the launch grid grows with M, nothing
  inside a program changes. No split-K: one program owns an output tile for the whole K.
- A program walks K in fixed `BLOCK_K` steps from 0, accumulating `tl.dot` of the step's tiles
  in float32, so an output element's sum is the same sequence of the same tensor-core
  instructions whatever row of the tile it is on and however many rows the call has.
- The bias is added once, after the loop, then the result is rounded to x's dtype.

Rows past M are loaded as zeros and never stored; they cannot change a valid row (a tile's
rows never mix in a matrix product).

The price: at one row a 64-row tile does 64x the multiply-adds of a GEMV, and at large M
these mid-sized tiles reach less of the tensor cores than cuBLAS's per-shape ones. On the
H200 an 8B step's products take 1.44x / 1.50x / 1.92x the default op's time at 1 / 128 /
2,048 rows (`bench/det_linear.py`; engine figures: `bench/gpu_bench.py --only rates,quant
--quant-engines bf16,det`, docs/operations.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl.backend.kernels.triton_compat import cdiv, is_interpreted, mma, tl, triton


class MatmulTile(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The one configuration per dtype. Changing it changes the bits (not their invariance). The
# 16-bit one is the best all-round candidate of `python bench/det_linear.py` on the H200 (an 8B
# step's products against the default op at 1 / 128 / 2,048 rows): 64x64x128, 4 warps, 3
# stages 1.44x / 1.50x / 1.92x; 64x32x128 1.30x / 1.67x / 3.17x; 64x64x64 1.62x / 1.58x /
# 2.03x; 128x64x64 2.32x / 2.02x / 1.70x.
TILE = {
    torch.bfloat16: MatmulTile(64, 64, 128, 4, 3),
    torch.float16: MatmulTile(64, 64, 128, 4, 3),
    torch.float32: MatmulTile(32, 32, 32, 4, 2),
}


@triton.jit
def _matmul_kernel(
    X, W, B, Y,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    # M fastest: the programs that read one weight tile run together, so the tile comes from
    # DRAM once and from L2 for the other row blocks.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # (Unmasked weight loads where the shape allows: the weights are the stream to keep
        # fast. A mask never changes a loaded value, only which lanes load.)
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs + k0)
            else:
                w = tl.load(w_ptrs + k0, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + offs_k) < K
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += mma(x, tl.trans(w), UPCAST, IEEE)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def linear_batch_invariant(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K], rows contiguous (nn.Linear layout)
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N] in x's dtype
    n, k = weight.shape
    x2 = x.reshape(-1, k)  # [M, K]
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("the batch-invariant linear needs the weight's rows contiguous")
    if x2.dtype != weight.dtype:
        raise ValueError(f"x is {x2.dtype} but the weight is {weight.dtype}")
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)  # [M, N]
    if m > 0 and n > 0:
        tile = TILE[weight.dtype]
        _matmul_kernel[(cdiv(m, tile.block_m), cdiv(n, tile.block_n))](
            x2, weight, bias if bias is not None else weight, y,
            m, n, k,
            x2.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            EVEN_N=n % tile.block_n == 0, EVEN_K=k % tile.block_k == 0,
            UPCAST=is_interpreted(_matmul_kernel), IEEE=weight.dtype == torch.float32,
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )
    return y.reshape(*x.shape[:-1], n)
