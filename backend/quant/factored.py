"""Factored group scales of a QuantizedWeight (GPU form; quant/weight.py has the layout).

    factor(w)   -> w with int8 sub-scales and float32 super-scales per 256 weights, when
                   that reproduces every scale and zero exactly in float32; else w unchanged
    unfactor(w) -> the plain float32 form (the CPU kernel's)

Why: at one row a decode step streams the weight, and plain float32 scale and zero per group
of 32 are 2 of a 4-bit weight's 6 bits. The K-quants build their group scales as `d * sc`
(`d` a float per 256 weights, `sc` a 6-bit integer; zeros `-dmin * m`; Q6_K's `sc` is a
signed 8-bit integer per 16 weights), so the same values fit in one int8 per group plus one
float per 256 weights: 4.75 bits per 4-bit weight.

The factors are recovered from the float32 values, not from the file: this works after
`cat`/`promote` (a fused q|k|v of mixed formats) and for any source. For a super-block with
largest magnitude `a`, the true `d` is `a / c` for the integer `c` behind `a`, and float32
division returns it exactly (it is representable), so trying c = +-1..+-128 (the sign: a
negative `d` times -128 is positive) and keeping the first
candidate whose quotients are integers in int8 range with `d * q == value` bit for bit finds
a factorization for every K-quant block. Q4_0/Q4_1/Q8_0 scales (one fp16 per 32) do not
factor and stay plain.
"""

from __future__ import annotations

import torch

from sgl.backend.quant.weight import QuantizedWeight

__all__ = ["SUPER_BLOCK", "factor", "factor_values", "unfactor"]

SUPER_BLOCK = 256  # weights per super-block: the K-quants'


def factor_values(values: torch.Tensor, per: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """[N, G] float32 -> (sub [N, G] int8, super [N, G/per] float32) with
    `super.repeat_interleave(per) * sub == values` exactly, or None where no such exists."""
    n, g = values.shape
    blocks = values.view(n, g // per, per)  # [N, B, per]
    amax = blocks.abs().amax(dim=-1)  # [N, B]
    found = amax == 0  # an all-zero block: super 0, sub 0 (Q6_K's zeros, empty rows)
    sup = torch.zeros_like(amax)
    sub = torch.zeros(n, g // per, per, device=values.device, dtype=torch.int8)
    for c in (sign * i for i in range(1, 129) for sign in (1, -1)):  # (int8: -128 .. 127)
        if bool(found.all()):
            break
        # (a tensor divisor: CUDA divides by a Python scalar through its reciprocal, inexactly)
        cand = amax / torch.full_like(amax, float(c))  # [N, B]
        q = torch.round(blocks / cand[..., None])
        ok = ((q >= -128) & (q <= 127) & (cand[..., None] * q == blocks)).all(dim=-1) & ~found
        sup = torch.where(ok, cand, sup)
        # (the clamp keeps the cast defined for the rejected candidates)
        sub = torch.where(ok[..., None], q.clamp(-128, 127).to(torch.int8), sub)
        found |= ok
    if not bool(found.all()):
        return None
    return sub.view(n, g).contiguous(), sup.contiguous()


def factor(w: QuantizedWeight) -> QuantizedWeight:
    if w.super_groups:
        return w
    per = SUPER_BLOCK // w.group_size
    groups = w.in_features // w.group_size
    if groups % per:
        return w
    scale = factor_values(w.scale, per)
    zero = factor_values(w.zero, per) if scale is not None else None
    if scale is None or zero is None:
        return w
    return QuantizedWeight(w.codes, scale[0], zero[0], w.bits, w.group_size, w.in_features,
                           w.source_format, per, scale[1], zero[1])


def unfactor(w: QuantizedWeight) -> QuantizedWeight:
    if not w.super_groups:
        return w
    scale, zero = w.group_scales()
    return QuantizedWeight(w.codes, scale.contiguous(), zero.contiguous(), w.bits, w.group_size,
                           w.in_features, w.source_format)
