"""Each row's argmax, the greedy token of a sampling step: `[B, V] -> [B]` int64.

The rule is `torch.argmax(dim=-1)`'s: the first index of the row's maximum, a NaN counting as
the maximum (the first NaN wins), column 0 for a row that is all -inf. The Triton kernel
(triton_argmax.py) keeps the same rule bit for bit; on the CPU numpy's vectorized reduction
computes it: torch's took ~100 us per 49k-wide row (5 ms a step at 32 rows), numpy's ~5.
"""

from __future__ import annotations

import numpy as np
import torch


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
    if not logits.is_cpu or logits.dtype not in (torch.float32, torch.float64):
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.numpy().argmax(axis=-1).astype(np.int64, copy=False))
