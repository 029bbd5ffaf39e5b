"""The Triton kernel of SiLU-and-multiply; `activation.py` holds the pure-torch reference it is
tested against, and the docstring there describes the op.

A module of its own so that a CPU engine, which only ever runs the reference, never imports
Triton (~0.2 s and ~70 MB): the kernel set imports this module only when it picks the Triton
kernels (kernels/dispatch.py).
"""

from __future__ import annotations

import torch

from sgl.backend.kernels.triton_compat import (cdiv, launch_options, let_next_launch, tl, triton,
                                               wait_for_inputs)


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_xt, stride_ot, inter, BLOCK: tl.constexpr,
                         PDL: tl.constexpr, WAIT: tl.constexpr):
    let_next_launch(PDL)  # the GEMV after may start loading its weights (triton_compat: PDL)
    wait_for_inputs(WAIT)  # (launched early itself: the kernel before may still be running)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(X + t * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + t * stride_xt + inter + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up  # silu(g) = g * sigmoid(g), in fp32
    tl.store(Out + t * stride_ot + offs, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])  # [T, 2I]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)  # [T, I]
    if x2.shape[0] > 0:
        block = 1024
        _silu_and_mul_kernel[(x2.shape[0], cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block,
            **launch_options(x2.device, _silu_and_mul_kernel),
        )
    return out.reshape(*x.shape[:-1], inter)
