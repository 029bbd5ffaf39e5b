"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, normalized in float32 like the HF reference.

    `forward(x, residual)` first adds the residual stream and returns both the normed value
    and the new residual, so a decoder layer needs one call per norm instead of two ops.
    """

    def __init__(self, dim: int, eps: float, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            return self._forward_cuda(x, residual)
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            # F.rms_norm is one fused kernel; in float32 it equals the reference exactly.
            out = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        else:
            # Low precision: normalize in float32 (as HF does), then round once.
            xf = x.float()
            out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
            out = out * self.weight
        return out if residual is None else (out, residual)

    def _forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # One Triton launch for add + norm (the torch path is 4-6 elementwise kernels). The
        # residual sum is rounded to x's dtype before the norm reads it, as above; the norm
        # itself stays in float32 until the single final rounding (weight included).
        from sgl.backend.kernels import dispatch  # lazy: the CPU path never imports triton

        if residual is None:
            return dispatch.rmsnorm(x, self.weight, self.eps)
        return dispatch.fused_add_rmsnorm(x, residual, self.weight, self.eps)
