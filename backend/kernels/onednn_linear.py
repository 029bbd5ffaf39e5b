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


# oneDNN compiles and keeps a primitive per product shape (up to 1,024, ~0.6 MB each on
# SmolLM2's shapes), and prompts make every row count up to the chunk size: 300 products of
# random row counts grew a process by 720 MB. Past PAD_ABOVE rows (decode steps stay exact
# sizes) the rows are padded to a multiple of ROW_BUCKET: a 512-token chunk size then gives
# at most 14 row counts per weight shape.
PAD_ABOVE = 64
ROW_BUCKET = 32


def packed_linear(
    x: torch.Tensor,  # [..., K]
    packed: torch.Tensor,  # [N, K] from pack()
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N]
    return _bucketed(x, packed, bias)


def plain_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """`packed_linear` on a plain [N, K] weight used once (a weight dequantized for one
    prefill product): oneDNN reorders it itself. At 512 rows on SmolLM2's shapes it runs in
    0.43-0.47x the time of F.linear's sgemm, the reorder included (2-core AVX-512 VM)."""
    return _bucketed(x, weight.contiguous(), bias)


def _bucketed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    pad = -rows % ROW_BUCKET if rows > PAD_ABOVE else 0
    if not pad:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    x2 = torch.cat([x.reshape(rows, k), x.new_zeros(pad, k)])
    y = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
    return y[:rows].view(*x.shape[:-1], y.shape[-1])
