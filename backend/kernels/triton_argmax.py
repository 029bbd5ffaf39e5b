"""The Triton kernel of each row's argmax (`argmax.py` holds the reference and the rule): one
launch for the greedy token of every sampled row.

Why: torch's argmax over a 128,256-wide row took 27-28 us of the H200's time per decode step
(one block reduces the whole row), ~1% of an 8B single-stream step. Here a row is cut into
BLOCK-wide slices, one program each: a program reduces its slice to (key, first index of the
key's maximum), stores the pair, and counts itself in the row's counter
(`triton_compat.tile_counters`); the last program of the row reduces the pairs in slice order
and writes the index.

Keys: the float's bits as an int32 whose order is the floats' (negative values' magnitude
bits flipped), -0.0 made +0.0 first (they tie in torch's rule) and every NaN the largest key
(it wins over +inf). Ties keep the lowest index: within a slice by the minimum over the
lanes that hold the maximum, across slices by the same minimum over the pairs, whose indices
are global.
"""

from __future__ import annotations

import torch

from sgl.backend.kernels.triton_compat import (arrives_last, cdiv, next_power_of_2,
                                               tile_counters, tl, triton)

BLOCK = 4096  # a program's slice of a row: 32 programs for a 128,256-wide vocabulary
_NAN_KEY = tl.constexpr(0x7FFFFFFF)  # every NaN's key: above +inf's (0x7F800000)
_NO_KEY = tl.constexpr(-0x80000000)  # below every float's (a slice past the row's)


@triton.jit
def _argmax_kernel(X, Keys, Idx, Counters, Out, stride_x, vocab, slices,
                   BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row.to(tl.int64) * stride_x + offs, mask=offs < vocab,
                other=float("-inf")).to(tl.float32)
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)  # (-0.0 becomes +0.0)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(x != x, _NAN_KEY, key)
    best = tl.max(key, axis=0)
    first = tl.min(tl.where(key == best, offs, vocab), axis=0)
    tl.store(Keys + row * slices + part, best)
    tl.store(Idx + row * slices + part, first)
    counter = Counters + row
    if arrives_last(counter, slices):  # the last of the row: every slice's pair is stored
        tl.store(counter, 0)  # (for the next launch)
        s = tl.arange(0, BLOCK_S)
        keys = tl.load(Keys + row * slices + s, mask=s < slices, other=_NO_KEY,
                       cache_modifier=".cg")
        idx = tl.load(Idx + row * slices + s, mask=s < slices, other=vocab, cache_modifier=".cg")
        top = tl.max(keys, axis=0)
        tl.store(Out + row, tl.min(tl.where(keys == top, idx, vocab), axis=0).to(tl.int64))


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
    rows, vocab = logits.shape
    if vocab == 0 or logits.dtype == torch.float64:  # (torch's error; keys are 32-bit)
        return logits.argmax(dim=-1)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    slices = cdiv(vocab, BLOCK)
    keys = torch.empty(rows, slices, dtype=torch.int32, device=logits.device)
    idx = torch.empty(rows, slices, dtype=torch.int32, device=logits.device)
    counters = tile_counters(logits.device, rows)
    _argmax_kernel[(rows, slices)](
        logits, keys, idx, counters, out, logits.stride(0), vocab, slices,
        BLOCK=BLOCK, BLOCK_S=next_power_of_2(slices), num_warps=8,
    )
    return out
