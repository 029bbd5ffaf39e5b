"""What the one-row kernels (triton_gemv.py's 4- and 8-bit codes, triton_fp8.py's FP8) share:
which program is which, how a program's rows are stored, and split-K.

Split-K (`QGemvConfig.split_k` > 1): a third grid axis cuts K into slices, so one program can
own more output rows (every program reads x once per K step whatever its BLOCK_N, so wider
tiles cut the re-reads of x) while the grid still has enough programs to fill the GPU at
N = 4096. Each program writes its slice's float32 row sums to a partials buffer
[SPLIT, M, N]; `reduce_partials` (a second, small kernel) adds them in slice order 0, 1, ...
and the bias, then casts to x's dtype. The order is fixed, so the result is the same on every
run (no float atomics: a greedy decode must not change from run to run). The buffer is a
fresh `torch.empty` per call, like the output: inside a CUDA graph it comes from the graph's
pool at capture and keeps its address on every replay.

A slice is a whole number of the kernel's K steps and `split_plan` never makes an empty one
(5 steps asked in 4 slices become 3 slices of 2, 2 and 1 steps), so only the last slice of
the last step can be ragged: the kernels' EVEN flags keep their meaning.
"""

from __future__ import annotations

import torch

from sgl.backend.kernels.triton_compat import cdiv, tl, triton

__all__ = ["REDUCE_BLOCK", "gemv_program", "new_partials", "reduce_partials", "split_plan",
           "store_rows"]

REDUCE_BLOCK = 512  # outputs per program of the reduction (it reads SPLIT floats per output)


def split_plan(steps: int, split_k: int, step: int) -> tuple[int, int]:
    """(slices, K units per slice) for a K loop of `steps` steps of `step` units each (groups
    for the codes' kernel, weights for FP8's): at most `split_k` slices, none empty."""
    if split_k < 1:
        raise ValueError(f"split_k {split_k}: it must be at least 1 (1 = no split)")
    if steps <= 1 or split_k == 1:
        return 1, max(steps, 1) * step
    per = cdiv(steps, min(split_k, steps))  # steps per slice
    return cdiv(steps, per), per * step


@triton.jit
def gemv_program(ROWS_FIRST: tl.constexpr):
    """(row of x, block of N, K slice) of this program (the grid: triton_gemv.row_grid, with
    the slices as the third axis)."""
    if ROWS_FIRST:  # several rows: the programs sharing a weight tile run together
        row, pid_n = tl.program_id(0), tl.program_id(1)
    else:
        pid_n, row = tl.program_id(0), tl.program_id(1)
    return row, pid_n, tl.program_id(2)


@triton.jit
def store_rows(y, B, Y, P, row, pid_s, offs_n, mask_n, N, stride_ym, stride_ps,
               HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """One program's float32 sums y [BLOCK_N] of x's `row`. SPLIT == 1: plus the bias, in
    Y's dtype, into Y. Else this K slice's part, as is, into P [SPLIT, M, N] (the reduction
    adds the bias once)."""
    if SPLIT == 1:
        if HAS_BIAS:
            y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(Y + row.to(tl.int64) * stride_ym + offs_n, y.to(Y.dtype.element_ty),
                 mask=mask_n)
    else:
        p = P + pid_s.to(tl.int64) * stride_ps + row.to(tl.int64) * N + offs_n
        tl.store(p, y, mask=mask_n)


@triton.jit
def _reduce_kernel(P, B, Y, N, stride_ps, stride_ym,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    p = P + row.to(tl.int64) * N + offs
    acc = tl.load(p, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):  # slice order: the same sum on every run
        acc += tl.load(p + s * stride_ps, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row.to(tl.int64) * stride_ym + offs, acc.to(Y.dtype.element_ty), mask=mask)


def new_partials(split: int, y: torch.Tensor) -> torch.Tensor:
    """The kernels' P argument for an output y [M, N]: float32 [split, M, N], or y itself as
    a placeholder when there is no split (the kernels never touch it then)."""
    if split == 1:
        return y
    return torch.empty(split, *y.shape, device=y.device, dtype=torch.float32)


def reduce_partials(partials: torch.Tensor, bias: torch.Tensor | None,
                    y: torch.Tensor) -> None:
    """y [M, N] = sum over slices of partials [SPLIT, M, N] (in order) + bias, in y's dtype."""
    split, m, n = partials.shape
    # (rows on the first axis: CUDA's second stops at 65,535, N / REDUCE_BLOCK never nears it)
    _reduce_kernel[(m, cdiv(n, REDUCE_BLOCK))](
        partials, bias if bias is not None else partials, y, n, m * n, y.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split, BLOCK=REDUCE_BLOCK, num_warps=4,
    )
