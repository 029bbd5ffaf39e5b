"""SiLU-and-multiply, the gate of a SwiGLU MLP: `[T, 2I] -> [T, I]`, out = silu(gate) * up.

The input is the fused gate_up projection: the first half of the last dim is the gate, the
second half the up projection (the layout of a concatenated [gate; up] weight).

The reference computes in the input dtype like transformers' LlamaMLP (`act(gate) * up`: the
SiLU rounded, then the product); the Triton kernel stays in fp32 and rounds once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)  # [T, I] each, views
    return F.silu(gate) * up
