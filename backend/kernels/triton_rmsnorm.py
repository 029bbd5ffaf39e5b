"""The Triton kernel of RMSNorm (plain and fused with the residual add); `rmsnorm.py` holds the
pure-torch reference it is tested against, and the docstring there describes the op.

A module of its own so that a CPU engine, which only ever runs the reference, never imports
Triton (~0.2 s and ~70 MB): the kernel set imports this module only when it picks the Triton
kernels (kernels/dispatch.py).
"""

from __future__ import annotations

import torch

from sgl.backend.kernels.triton_compat import (INPUTS_FIRST, launch_options, let_next_launch,
                                               next_power_of_2, tl, triton, wait_for_inputs)


@triton.jit
def _rmsnorm_kernel(
    X, R, W, Out, ResOut,
    stride_x, stride_r, stride_o, stride_ro,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr,
    INPUTS_FIRST: tl.constexpr,
):
    # One program per row; the whole row fits in one block (hidden <= 16k).
    let_next_launch(PDL)  # the GEMV after may start loading its weights (triton_compat: PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    # the weight, a parameter that no kernel writes, comes in before the wait (triton_compat:
    # INPUTS_FIRST): a decode step streams the model's weights through L2, so the norm's 8 KB
    # are rarely there, and their trip then overlaps the tail of the kernel before
    if INPUTS_FIRST:
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    wait_for_inputs(WAIT)  # (launched early itself: the kernel before may still be running)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(ResOut.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + offs, summed, mask=mask)
        x = summed.to(tl.float32)  # normalize the rounded sum, as the reference does
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    if not INPUTS_FIRST:
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (x * rstd * w).to(Out.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)  # [rows, hidden]
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty_like(x2)
    rows = x2.shape[0]
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
        res_out = torch.empty_like(x2)
    else:
        r2, res_out = x2, out  # unused by the kernel (HAS_RESIDUAL=False)
    if rows > 0:
        block = next_power_of_2(hidden)
        _rmsnorm_kernel[(rows,)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, INPUTS_FIRST=INPUTS_FIRST[0],
            **launch_options(x2.device, _rmsnorm_kernel), num_warps=4 if block <= 2048 else 8,
        )
    out = out.reshape(x.shape)
    return out, (res_out.reshape(x.shape) if residual is not None else None)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    normed, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return normed, summed
