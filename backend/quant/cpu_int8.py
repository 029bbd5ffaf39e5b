"""Integer-activation products on the CPU (cpu_int8.c): `activation_quantization="int8"`.

    int8_linear(x [M, K] float32, w, bias [N] | None) -> [M, N] float32       (the C kernel)
    int8_linear_reference(x, w, bias)                                        same, pure torch
    quantize_rows(x, bits, group_size) -> (qx [M, K] int8, dx [M, G], xsum [M, G])   (C)
    quantize_rows_reference(x, group_size)                 same, pure torch, qx in x's order
    kernel_order(qx, bits, group_size)                     x's order -> the C kernel's order

A projection's input is quantized per group of the weight (32 values, 16 for 16-wide 8-bit
groups) to int8 with one float32 scale, `dx = max|x| / 127`, rounded to nearest (ties to
even), as ggml's Q8_0; each group's dot product with the weight's codes is then exact in
int32 and scaled once: `y = sum_g scale * dx * idot(code, qx) + zero * sum(x)`. The zero term
keeps the exact float group sums. This trades a small, bounded error (half a step of the
activation's int8 grid per value) for AVX2's byte multiply-adds, 32 per instruction.

The reference does the same arithmetic with torch ops: its qx and dx equal the C kernel's bit
for bit, its integer dots are exact, and its result differs from the kernel's only by the
float32 summation order of the scaled group terms (tests/test_quant_cpu_int8.py).
"""

from __future__ import annotations

import ctypes

import torch

from sgl.backend.quant import cpu_kernel
from sgl.backend.quant.weight import QuantizedWeight, mark_weights

__all__ = ["declare", "int8_linear", "int8_linear_reference", "kernel_order", "quantize_rows",
           "quantize_rows_reference", "use_int8_activations"]

_PTR, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def declare(lib: ctypes.CDLL) -> None:
    """Set the C signatures (called once by cpu_kernel when the library loads)."""
    lib.sgl_q8_quantize.argtypes = [_INT, _INT, _PTR, _I64, _I64, _PTR, _PTR, _INT]
    lib.sgl_q8_quantize.restype = None
    lib.sgl_q8_floats.argtypes = [_INT, _INT, _I64, _I64]
    lib.sgl_q8_floats.restype = _I64
    lib.sgl_q8_linear.argtypes = [_INT, _INT, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _INT, _I64,
                                  _PTR, _PTR, _INT]
    lib.sgl_q8_linear.restype = _INT


def _lib() -> ctypes.CDLL:
    lib = cpu_kernel._library()
    assert lib is not None, "the CPU kernel library is not available"
    return lib


def quantize_rows(x: torch.Tensor, bits: int,
                  group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 contiguous -> the C kernel's quantized input for a `bits`-bit weight:
    (qx [M, K] int8 in the kernel's order, dx [M, G], xsum [M, G] float32)."""
    m, k = x.shape
    g = k // group_size
    lib = _lib()
    buf = torch.empty(lib.sgl_q8_floats(bits, group_size, m, k), dtype=torch.float32)
    xsum = torch.empty(m, g, dtype=torch.float32)
    lib.sgl_q8_quantize(bits, group_size, x.data_ptr(), m, k, buf.data_ptr(), xsum.data_ptr(),
                        torch.get_num_threads())
    qx = buf.view(torch.int8)[:m * k].view(m, k).clone()
    dx_at = (m * k + 31) // 32 * 8  # (cpu_int8.c, act_layout)
    return qx, buf[dx_at:dx_at + m * g].view(m, g).clone(), xsum


def kernel_order(qx: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """[M, K] int8 in x's order -> the order the C kernel stores it in: for 4-bit weights each
    pair of 32-groups as [g0 0-15, g1 0-15, g0 16-31, g1 16-31] (the low and high nibbles of
    the pair's codes, one load each); an odd last group, and 8-bit weights, unchanged."""
    if bits != 4:
        return qx
    m, k = qx.shape
    paired = k // 64 * 64
    head = qx[:, :paired].reshape(m, -1, 2, 2, 16).transpose(2, 3)  # [M, pair, half, group, 16]
    return torch.cat([head.reshape(m, paired), qx[:, paired:]], dim=1)


def quantize_rows_reference(x: torch.Tensor,
                            group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same quantization in torch ops (the same float32 operations, so the same bits)."""
    m, k = x.shape
    groups = x.float().view(m, k // group_size, group_size)  # [M, G, gs]
    dx = groups.abs().amax(-1) / 127.0  # [M, G]
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    qx = torch.round(groups * inv[..., None]).to(torch.int8)  # |q| <= 127 by construction
    return qx.view(m, k), dx, groups.sum(-1)


def int8_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None,
                threads: int | None = None) -> torch.Tensor:
    """[M, K] float32 contiguous -> [M, N] float32 (needs `cpu_kernel.available()`), on
    `threads` threads (torch's count by default)."""
    m = x.shape[0]
    y = torch.empty(m, w.out_features, dtype=torch.float32)
    failed = _lib().sgl_q8_linear(
        w.bits, w.group_size, x.data_ptr(), m, w.in_features, w.codes.data_ptr(),
        w.scale.data_ptr(), w.zero.data_ptr(), int(w.f16_scales), w.out_features,
        None if bias is None else bias.data_ptr(), y.data_ptr(),
        threads or torch.get_num_threads())
    if failed:
        raise MemoryError(f"int8 linear: no memory for the quantized input of {m} rows")
    return y


def int8_linear_reference(x: torch.Tensor, w: QuantizedWeight,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's arithmetic in torch: quantize x as the C does, integer dots per group
    (int64, exact), then the float scaling and the exact zero term. [M, K] -> [M, N]."""
    m, k = x.shape
    gs = w.group_size
    qx, dx, xsum = quantize_rows_reference(x, gs)
    codes = w.integer_codes().long().view(w.out_features, k // gs, gs)  # [N, G, gs]
    idot = torch.einsum("mgi,ngi->mng", qx.long().view(m, k // gs, gs), codes)  # [M, N, G]
    scale, zero = w.group_scales()
    y = (idot.float() * dx[:, None, :] * scale[None]).sum(-1) + xsum @ zero.t()  # [M, N]
    return y if bias is None else y + bias


def use_int8_activations(model: torch.nn.Module) -> int:
    """Mark every quantized CPU weight of `model` (Linears, and the tied table whose head runs
    quant_linear) for integer activations; returns how many. After loading, before the model
    is described for the one-call decode step (which reads the mark)."""
    return mark_weights(model, lambda w: w.codes.device.type == "cpu" and not w.super_groups,
                        int8_activations=True)
