"""SwiGLU activation over a fused gate|up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * inter] (gate | up) -> [T, inter] = silu(gate) * up."""
    if gate_up.is_cuda:
        from sgl.backend.kernels import dispatch  # lazy: the CPU path never imports triton

        return dispatch.silu_and_mul(gate_up)  # one fused kernel, fp32 inside
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
