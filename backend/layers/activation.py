"""SwiGLU activation over a fused gate|up projection."""

from __future__ import annotations

import torch
from torch import nn

from sgl.backend.kernels.dispatch import KernelSet


class SiluAndMul(nn.Module):
    """[T, 2 * inter] (gate | up) -> [T, inter] = silu(gate) * up, the set's `silu_and_mul`."""

    def __init__(self, *, kernels: KernelSet) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(gate_up)
