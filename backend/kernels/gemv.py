"""The linear op's reference: y = x @ W^T (+ b), nn.Linear's layout (`F.linear`).

The Triton kernel set's linear (`triton_gemv.linear_triton`) runs a GEMV of its own for
one-row decode in 16 bits; that module's docstring describes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gemv_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:  # [..., K] x [N, K] -> [..., N]
    return F.linear(x, weight, bias)
