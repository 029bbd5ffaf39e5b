"""SiLU-and-multiply, the gate of a SwiGLU MLP: `[T, 2I] -> [T, I]`, out = silu(gate) * up.

The input is the fused gate_up projection: the first half of the last dim is the gate, the
second half the up projection (the layout of a concatenated [gate; up] weight).

The reference computes in the input dtype like transformers' LlamaMLP (`act(gate) * up`: the
SiLU rounded, then the product); the Triton kernel stays in fp32 and rounds once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl.backend.kernels.triton_compat import cdiv, tl, triton


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)  # [T, I] each, views
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_xt, stride_ot, inter, BLOCK: tl.constexpr):
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
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block
        )
    return out.reshape(*x.shape[:-1], inter)
