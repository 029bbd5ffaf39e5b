"""The linear op on a QuantizedWeight: one dispatcher, a reference, the CPU kernel.

    quant_linear(x [..., K], w, bias [N] | None) -> [..., N]      (x's dtype)
    quant_linear_reference(...)                                  same signature

Decode and small batches (up to `GEMV_MAX_ROWS` rows) run the C kernel straight on the codes:
each weight byte is read once per pass of 8 rows. Larger batches (prefill chunks) dequantize
the weight into a float32 scratch tile and run one float matmul: there the multiply-adds, not
the weight bytes, decide the time, and BLAS does them far better. A GPU kernel for the same
class would be one more branch here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl.backend.quant import cpu_kernel
from sgl.backend.quant.weight import QuantizedWeight

__all__ = ["GEMV_MAX_ROWS", "quant_linear", "quant_linear_reference"]

# Above this many rows the dequantize-then-BLAS path wins (the C kernel re-reads the weight
# once per 8 rows).
GEMV_MAX_ROWS = 16


def quant_linear_reference(x: torch.Tensor, w: QuantizedWeight,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w.dequantize(dtype=x.dtype), bias)


def quant_linear(x: torch.Tensor, w: QuantizedWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.device.type != "cpu" or not cpu_kernel.available():
        return quant_linear_reference(x, w, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)  # [M, K]
    if x2.shape[0] > GEMV_MAX_ROWS:
        y = F.linear(x2.float(), cpu_kernel.dequantize(w), None if bias is None else bias.float())
    else:
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        b = None if bias is None else bias.float().contiguous()
        y = cpu_kernel.qlinear(x2, w, b)
    return y.to(x.dtype).view(*lead, w.out_features)
