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

`QGemvConfig.split_reduce` picks who adds the slices:
- "kernel": the second kernel above (two launches per product; nothing shared between calls);
- "last": no second launch. Each program stores its partial, then counts itself in an int32
  counter of its output tile (an atomic add, acquire-release at GPU scope, after a barrier so
  the whole program's stores are released with it); the program that finds SPLIT - 1 arrivals
  before it reads back all SPLIT partials (past L1) and adds them in slice order, as the
  kernel does: the same bits whichever slice finishes last. It then puts the counter back
  to 0, so the next launch finds it so. The counters are `triton_compat.tile_counters`,
  shared with decode attention's merge (kernels/triton_attention_decode.py).

A slice is a whole number of the kernel's K steps and `split_plan` never makes an empty one
(5 steps asked in 4 slices become 3 slices of 2, 2 and 1 steps), so only the last slice of
the last step can be ragged: the kernels' EVEN flags keep their meaning.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl.backend.kernels.triton_compat import arrives_last, cdiv, tile_counters, tl, triton

__all__ = ["REDUCE_BLOCK", "SPLIT_REDUCES", "SplitLaunch", "check_split", "k_slice",
           "finish_split", "gemv_program", "reduce_partials", "split_launch", "split_plan",
           "store_rows", "sum_slices"]

REDUCE_BLOCK = 512  # outputs per program of the reduction (it reads SPLIT floats per output)


def split_plan(steps: int, split_k: int, step: int) -> tuple[int, int]:
    """(slices, K units per slice) for a K loop of `steps` steps of `step` units each (groups
    for the codes' kernel, weights for FP8's): at most `split_k` slices, none empty."""
    if steps <= 1 or split_k <= 1:
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
def k_slice(pid_s, TOTAL, SLICE, SPLIT: tl.constexpr):
    """[lo, hi) of K (in the kernel's unit: weights or groups) that slice `pid_s` owns: SLICE
    per slice (a whole number of K steps), the last one short; everything when unsplit."""
    if SPLIT == 1:
        lo, hi = 0, TOTAL
    else:
        lo = pid_s * SLICE
        hi = tl.minimum(TOTAL, lo + SLICE)
    return lo, hi


@triton.jit
def _store_y(y, B, Y, row, offs_n, mask_n, stride_ym, HAS_BIAS: tl.constexpr):
    """y [BLOCK] float32 of x's `row` plus the bias, in Y's dtype, into Y."""
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Y + row.to(tl.int64) * stride_ym + offs_n, y.to(Y.dtype.element_ty), mask=mask_n)


@triton.jit
def sum_slices(p, mask, stride_ps, SPLIT: tl.constexpr, COHERENT: tl.constexpr):
    """Sum over s of p[s * stride_ps], in slice order (the same bits on every run); COHERENT:
    read at L2 (.cg), past an L1 that may not have seen other programs' stores."""
    if COHERENT:
        acc = tl.load(p, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        acc = tl.load(p, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        if COHERENT:
            acc += tl.load(p + s * stride_ps, mask=mask, other=0.0, cache_modifier=".cg")
        else:
            acc += tl.load(p + s * stride_ps, mask=mask, other=0.0)
    return acc


@triton.jit
def store_rows(y, B, Y, P, CNT, row, pid_n, pid_s, n_blocks, offs_n, mask_n, N, stride_ym,
               stride_ps, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, LAST: tl.constexpr):
    """One program's float32 sums y [BLOCK_N] of x's `row`, block `pid_n` of N. SPLIT == 1:
    plus the bias, in Y's dtype, into Y. Else this K slice's part into P [SPLIT, M, N]; with
    LAST the program that completes the tile adds the slices into Y (module docstring), else
    `reduce_partials` does, after the kernel."""
    if SPLIT == 1:
        _store_y(y, B, Y, row, offs_n, mask_n, stride_ym, HAS_BIAS)
    else:
        p = P + row.to(tl.int64) * N + offs_n  # slice 0's
        tl.store(p + pid_s.to(tl.int64) * stride_ps, y, mask=mask_n)
        if LAST:
            cnt = CNT + row.to(tl.int64) * n_blocks + pid_n
            if arrives_last(cnt, SPLIT):
                acc = sum_slices(p, mask_n, stride_ps, SPLIT, True)
                tl.store(cnt, 0)  # (the tile is done: zero for the next launch)
                _store_y(acc, B, Y, row, offs_n, mask_n, stride_ym, HAS_BIAS)


@triton.jit
def _reduce_kernel(P, B, Y, N, stride_ps, stride_ym,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = sum_slices(P + row.to(tl.int64) * N + offs, mask, stride_ps, SPLIT, False)
    _store_y(acc, B, Y, row, offs, mask, stride_ym, HAS_BIAS)


SPLIT_REDUCES = ("kernel", "last")  # QGemvConfig.split_reduce
def check_split(split_k: int, split_reduce: str) -> None:
    if split_reduce not in SPLIT_REDUCES:
        raise ValueError(f"split_reduce {split_reduce!r}: use one of {list(SPLIT_REDUCES)}")
    if split_k < 1:
        raise ValueError(f"split_k {split_k}: it must be at least 1 (1 = no split)")


class SplitLaunch(NamedTuple):
    """A GEMV launch's split-K arguments (P, CNT, the slice length, SPLIT, LAST)."""

    split: int  # K slices: the grid's third axis
    slice_units: int  # K units (groups or weights) per slice, a whole number of steps
    partials: torch.Tensor  # [split, M, N] float32 (y itself, unused, when split == 1)
    slice_stride: int  # elements between two slices' partials, M * N
    counters: torch.Tensor  # the "last" reduction's tile counters (else a placeholder)
    last: bool  # the last slice of a tile adds them (else reduce_partials after the kernel)


def split_launch(y: torch.Tensor, steps: int, step: int, n_blocks: int, split_k: int,
                 split_reduce: str) -> SplitLaunch:
    """The split-K side of a launch writing y [M, N] with `n_blocks` blocks of N per row and
    a K loop of `steps` steps of `step` units. Shape-only; the buffers are allocated per call
    (graph-safe, as y is) except the counters (`tile_counters`). Unsplit, the integers are 0:
    unused, and constant so that they add no variants to Triton's specialization."""
    check_split(split_k, split_reduce)
    split, units = split_plan(steps, split_k, step)
    if split == 1:
        return SplitLaunch(1, 0, y, 0, y, False)
    partials = torch.empty(split, *y.shape, device=y.device, dtype=torch.float32)
    last = split_reduce == "last"
    counters = tile_counters(y.device, y.shape[0] * n_blocks) if last else partials
    return SplitLaunch(split, units, partials, y.numel(), counters, last)


def finish_split(launch: SplitLaunch, bias: torch.Tensor | None, y: torch.Tensor) -> None:
    """After the GEMV kernel: the second kernel's sum, when that is the launch's reduction."""
    if launch.split > 1 and not launch.last:
        reduce_partials(launch.partials, bias, y)


def reduce_partials(partials: torch.Tensor, bias: torch.Tensor | None,
                    y: torch.Tensor) -> None:
    """y [M, N] = sum over slices of partials [SPLIT, M, N] (in order) + bias, in y's dtype."""
    split, m, n = partials.shape
    # (rows on the first axis: CUDA's second stops at 65,535, N / REDUCE_BLOCK never nears it)
    _reduce_kernel[(m, cdiv(n, REDUCE_BLOCK))](
        partials, bias if bias is not None else partials, y, n, m * n, y.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split, BLOCK=REDUCE_BLOCK, num_warps=4,
    )
