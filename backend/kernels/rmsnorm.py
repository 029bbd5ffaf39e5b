"""RMSNorm, plain and fused with the residual add of a pre-norm transformer block.

    rmsnorm(x, w)                   = x / sqrt(mean(x**2) + eps) * w
    fused_add_rmsnorm(x, r, w) -> (rmsnorm(x + r, w), x + r)

Statistics are computed in fp32. The residual sum is rounded to the input dtype *before* the
norm reads it, like Hugging Face's Llama (which adds in the model dtype), so the stream of
residuals is bit-identical between the fused and the unfused path.

Rounding: the reference is transformers' LlamaRMSNorm exactly (the normalized value is rounded
to x's dtype, then multiplied by the weight in that dtype). The Triton kernel keeps the weight
product in fp32 and rounds once; in 16-bit dtypes the two differ by at most that one rounding
(within the kernel tests' tolerance), in float32 not at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu":
        # Fast path: F.rms_norm is one fused kernel on the CPU (the formula below is four
        # passes) and in float32 it equals the formula bit for bit
        # (tests/test_kernels_reference.py).
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()  # [..., hidden]
    normed = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * weight).to(x.dtype)  # the weight applied in x's dtype, as transformers


def fused_add_rmsnorm_reference(
    x: torch.Tensor,  # [..., hidden]
    residual: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, x + residual)
    if x.dtype == residual.dtype:  # torch adds 16-bit tensors in fp32 and rounds once: the same
        summed = x + residual
    else:
        summed = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm_reference(summed, weight, eps), summed
