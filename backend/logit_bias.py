"""logit_bias: every request's {token id: bias} as one sparse add per sampling step.

Built once per batch composition on the scheduler thread (`logit_bias_tensors`, beside the
sampler's other per-batch tensors); applied in `process_logits` after the grammar mask,
min_new_tokens and the penalties, before temperature and the top-k / top-p / min-p filters,
as one `index_add_` over the flattened logits whatever the number of biased rows::

    logits [B, V] -> view [B * V]; flat index of (row b, token t) = b * V + t

A masked logit (-inf) stays -inf whatever its bias, so a bias never unbans a token that the
grammar or min_new_tokens forbids.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from sgl.sampling import SamplingParams

__all__ = ["logit_bias_tensors", "apply_logit_bias"]


def logit_bias_tensors(params: Sequence[SamplingParams], vocab_size: int,
                       device: torch.device) -> tuple[Tensor, Tensor] | None:
    """(flat indices [L] int64, biases [L] float32) for the batch's rows in order, or None when
    no row has a bias. Ids were checked against the vocabulary at submission."""
    flat = [(b * vocab_size + t, bias) for b, p in enumerate(params) if p.logit_bias
            for t, bias in sorted(p.logit_bias.items()) if t < vocab_size]
    if not flat:
        return None
    idx, vals = zip(*flat)
    return _to(torch.tensor(idx, dtype=torch.int64), device), _to(torch.tensor(vals, dtype=torch.float32), device)


def apply_logit_bias(logits: Tensor, bias: tuple[Tensor, Tensor]) -> None:
    """logits [B, V] += the sparse bias, in place. Indices are unique (one dict per row), so the
    add is exact and its order does not matter."""
    idx, vals = bias
    logits.view(-1).index_add_(0, idx, vals)


def _to(t: Tensor, device: torch.device) -> Tensor:
    """Host -> device without a host sync (as the sampler's own per-batch tensors)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
