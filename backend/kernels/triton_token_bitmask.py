"""The Triton kernel of grammar bitmask application; `token_bitmask.py` holds the pure-torch
reference it is tested against, and the docstring there describes the op.

A module of its own so that a CPU engine, which only ever runs the reference, never imports
Triton (~0.2 s and ~70 MB): the kernel set imports this module only when it picks the Triton
kernels (kernels/dispatch.py).
"""

from __future__ import annotations

import torch

from sgl.backend.kernels.triton_compat import cdiv, tl, triton


@triton.jit
def _bitmask_kernel(
    Logits, Bitmask, Indices, stride_l, stride_b, width,
    HAS_INDICES: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    if HAS_INDICES:
        row = tl.load(Indices + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < width
    words = tl.load(Bitmask + row * stride_b + offs // 32, mask=in_range, other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    # Store only where forbidden: allowed logits are never read or written.
    neg_inf = tl.full([BLOCK], float("-inf"), tl.float32).to(Logits.dtype.element_ty)
    tl.store(Logits + row * stride_l + offs, neg_inf, mask=in_range & ~allowed)


def apply_token_bitmask_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | None = None,
) -> None:
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1
    width = min(logits.shape[-1], 32 * bitmask.shape[-1])
    num_rows = logits.shape[0] if indices is None else indices.shape[0]
    if num_rows == 0 or width == 0:
        return
    block = 4096
    _bitmask_kernel[(num_rows, cdiv(width, block))](
        logits, bitmask, logits if indices is None else indices,
        logits.stride(0), bitmask.stride(0), width,
        HAS_INDICES=indices is not None, BLOCK=block,
    )
