"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from sgl.backend.kernels.dispatch import KernelSet


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, statistics in float32 like transformers.

    `forward(x, residual)` first adds the residual stream and returns both the normed value
    and the new residual, so a decoder layer needs one call per norm instead of two ops (one
    kernel launch on the GPU). The kernels are the set's `rmsnorm` / `fused_add_rmsnorm`.
    """

    def __init__(self, dim: int, eps: float, *, kernels: KernelSet, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.kernels.rmsnorm(x, self.weight, self.eps)
        return self.kernels.fused_add_rmsnorm(x, residual, self.weight, self.eps)
