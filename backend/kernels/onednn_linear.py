"""Linear layers on the CPU through oneDNN, with each weight packed once at load time.

    pack(weight [N, K]) -> packed [N, K]                 (opaque oneDNN layout, same values)
    packed_linear(x [..., K], packed, bias [N] | None) -> [..., N]

Reference: `F.linear(x, weight, bias)` (`gemv.gemv_reference`), which torch serves on the CPU
with MKL's sgemm on the plain [N, K] layout. sgemm repacks the weight into its blocked layout
on every call; at decode sizes (a few to a few dozen rows) that repacking costs more than the
multiply-adds. oneDNN's matmul takes the weight already in its own layout (the reorder
`torch.compile` applies when it freezes a CPU model). All projections of one SmolLM2-135M
forward pass (30 layers + head, float32, 2-core AVX-512; bench/cpu_linear.py): 1 row 44 -> 21
ms, 4 rows 62 -> 17 ms, 32 rows 108 -> 50 ms, 512 rows 828 -> 670 ms.

Results equal the reference up to float32 summation order (the kernels block K differently).
Packing copies the weight: callers drop the plain tensor afterwards.
"""

from __future__ import annotations

import functools

import torch

# The row count oneDNN picks its packed layout for; one layout serves every row count (the
# kernels do not depend on it for correctness), and 32 measured best from 1 row to 512.
PACK_ROWS_HINT = 32
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _op_works(dtype: torch.dtype) -> bool:
    """Whether this torch build has the oneDNN ops and they run here (probed once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(8, 4, dtype=dtype)
        y = packed_linear(torch.ones(2, 4, dtype=dtype), pack(w), None)
    except (RuntimeError, AttributeError):  # op missing from this build, or CPU not supported
        return False
    return bool((y == 4).all())


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in DTYPES and _op_works(dtype)


def pack(weight: torch.Tensor) -> torch.Tensor:  # [N, K] -> [N, K] oneDNN layout
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)


def packed_linear(
    x: torch.Tensor,  # [..., K]
    packed: torch.Tensor,  # [N, K] from pack()
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def plain_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """`packed_linear` on a plain [N, K] weight used once (a weight dequantized for one
    prefill product): oneDNN reorders it itself. At 512 rows on SmolLM2's shapes it runs in
    0.43-0.47x the time of F.linear's sgemm, the reorder included (2-core AVX-512 VM)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight.contiguous(), bias, "none", [], "")
