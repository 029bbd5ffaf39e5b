"""The linear op on a QuantizedWeight: one dispatcher, a reference, the CPU kernel.

    quant_linear(x [..., K], w, bias [N] | None) -> [..., N]      (x's dtype)
    quant_linear_reference(...)                                  same signature

Decode and small batches (up to `GEMV_MAX_ROWS` rows) run the C kernel straight on the codes:
each weight byte is read once per pass of 8 rows. Larger batches (prefill chunks, decode
steps of many requests) dequantize the weight into float32 and multiply it with BLAS: there
the multiply-adds, not the weight bytes, decide the time, and BLAS does them far better. A
weight over `TILE_BYTES` as float32 is done a tile of output features at a time, so the
scratch stays bounded (SmolLM2's tied 49k-row head is 113 MB as float32, which a 32-request
decode step would otherwise allocate and fill every step). A GPU kernel for the same class
would be one more branch here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl.backend.quant import cpu_kernel
from sgl.backend.quant.weight import QuantizedWeight

__all__ = ["GEMV_MAX_ROWS", "TILE_BYTES", "quant_linear", "quant_linear_reference"]

# Above this many rows the dequantize-then-BLAS path wins (the C kernel re-reads the weight
# once per 8 rows).
GEMV_MAX_ROWS = 16
# Float32 bytes of one dequantized tile of the weight on that path: a weight up to this size
# is dequantized whole (every layer of a small model), a larger one (an LM head) in tiles of
# this size. Few tiles per call: each costs two parallel regions, which stall when another
# process holds a core.
TILE_BYTES = 16 << 20


def quant_linear_reference(x: torch.Tensor, w: QuantizedWeight,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w.dequantize(dtype=x.dtype), bias)


def quant_linear(x: torch.Tensor, w: QuantizedWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    if (x.dim() == 2 and x.dtype == torch.float32 and x.shape[0] <= GEMV_MAX_ROWS
            and not x.is_cuda and x.is_contiguous() and bias is None and cpu_kernel.available()):
        return cpu_kernel.qlinear(x, w, None)  # a decode step's case, with nothing to convert
    if x.device.type != "cpu" or not cpu_kernel.available():
        return quant_linear_reference(x, w, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)  # [M, K]
    if x2.shape[0] > GEMV_MAX_ROWS:
        y = _tiled_linear(x2.float(), w, None if bias is None else bias.float())
    else:
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        b = None if bias is None else bias.float().contiguous()
        y = cpu_kernel.qlinear(x2, w, b)
    return y.to(x.dtype).view(*lead, w.out_features)


def _tiled_linear(x: torch.Tensor, w: QuantizedWeight,
                  bias: torch.Tensor | None) -> torch.Tensor:  # [M, K] -> [M, N]
    tile = max(64, TILE_BYTES // (4 * w.in_features))  # output features per tile
    if tile >= w.out_features:
        return F.linear(x, cpu_kernel.dequantize(w), bias)
    y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    for start in range(0, w.out_features, tile):
        rows = slice(start, min(start + tile, w.out_features))
        y[:, rows] = x @ cpu_kernel.dequantize(w, rows).t()  # [M, tile]
    if bias is not None:
        y += bias
    return y
