"""Repetition, frequency and presence penalties: per-row token counts kept on the device.

- Frequency and presence count generated tokens only (OpenAI semantics, as SGLang);
  repetition covers the prompt and the generated tokens (HF / vLLM semantics).
- Counts live in a `PenaltyPool` indexed by the engine's request-pool row, so they survive
  batch changes; a step reads the rows of its penalised requests through a `PenaltyBatch`.
- Nothing here waits for the device: counts are rebuilt from host ids through pinned memory
  and an async copy, and updated after sampling with a device-side scatter-add.

The sampler (`sampler.py`) owns a pool, builds a `PenaltyBatch` per batch, and calls
`PenaltyBatch.apply` on the logits before temperature.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from sgl.sampling import SamplingParams

__all__ = ["PenaltyPool", "PenaltyBatch", "PenaltyStart", "apply_penalties"]

# Arguments of one PenaltyPool.start call: row, params, prompt ids, output ids.
PenaltyStart = tuple[int, SamplingParams, Sequence[int], Sequence[int]]


class PenaltyPool:
    """Generated-token counts per request row, kept on the device between steps.

    Rows are the engine's request-pool indices (the row of `req_to_token`), so the batch may
    change every step without reshuffling: a step gathers the rows of its penalised requests,
    and after sampling one scatter-add records the new tokens. Memory: rows x V x 5 bytes
    (int32 counts + bool prompt mask), allocated when the first penalised request starts.

    Contract: `start(row, ...)` when a penalised request takes a row (or its outputs changed
    other than by sampling); `add(rows, ids)` after every sampled token. `Sampler` does both.
    """

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device | str) -> None:
        self.num_rows, self.vocab_size, self.device = num_rows, vocab_size, torch.device(device)
        self.counts: Tensor | None = None  # [rows, V] int32: generated-token counts
        self.prompt_seen: Tensor | None = None  # [rows, V] bool: token occurs in the prompt

    @staticmethod
    def needs(p: SamplingParams) -> bool:
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0

    def start(self, row: int, params: SamplingParams, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = ()) -> None:
        """Rebuild `row` from host ids. Runs in device order and never waits for the device:
        the ids travel in one async copy each, and every write is a kernel with its value as
        an argument (a Python-scalar `__setitem__` on an index tensor would copy it, a sync)."""
        if self.counts is None:
            if not self.needs(params):
                return  # nothing penalised yet; a penalised request zeroes its row when it starts
            shape = (self.num_rows, self.vocab_size)
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
        assert self.prompt_seen is not None
        self.counts[row].zero_()
        self.prompt_seen[row].zero_()
        if params.repetition_penalty != 1.0 and len(prompt_ids):
            ids = self._ids_to_device(prompt_ids, clamp=True)  # [N] int64
            self.prompt_seen[row].index_fill_(0, ids, True)
        if len(output_ids):
            ids = self._ids_to_device(output_ids)  # [M] int64
            self.counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def _ids_to_device(self, ids: Sequence[int], clamp: bool = False) -> Tensor:
        """Host ids -> [N] int64 on the pool's device. On CUDA the host tensor is pinned, so the
        copy is truly async; the caching host allocator keeps the buffer until it completes."""
        host = torch.tensor(list(ids), dtype=torch.int64, pin_memory=self.device.type == "cuda")
        if clamp:
            host.clamp_(0, self.vocab_size - 1)  # on the host, before the copy
        return host.to(self.device, non_blocking=True)

    def add(self, rows: Tensor, token_ids: Tensor) -> None:
        """rows [N] int64, token_ids [N] int64, on the pool's device; no host sync."""
        if self.counts is not None:
            ones = torch.ones_like(token_ids, dtype=torch.int32)
            self.counts.index_put_((rows, token_ids), ones, accumulate=True)


class PenaltyBatch(NamedTuple):
    """The penalised rows of one batch."""

    pool: PenaltyPool
    idx: Tensor  # [P] int64: batch rows with a penalty
    rows: Tensor  # [P] int64: their PenaltyPool rows
    values: Tensor  # [3, P] float32: repetition, frequency, presence

    def apply(self, logits: Tensor, starts: Sequence[PenaltyStart] = ()) -> None:
        """Penalise logits [B, V] in place, after replaying this step's pending `starts`."""
        for start in starts:
            self.pool.start(*start)
        counts, seen = self.pool.counts, self.pool.prompt_seen
        assert counts is not None and seen is not None, "PenaltyPool.start was not called"
        logits[self.idx] = apply_penalties(logits[self.idx], counts[self.rows], seen[self.rows], *self.values)


def apply_penalties(
    logits: Tensor, counts: Tensor, prompt_seen: Tensor | None,
    repetition: Tensor, frequency: Tensor, presence: Tensor,
) -> Tensor:  # fmt: skip
    """logits [P, V], counts [P, V] (generated tokens), prompt_seen [P, V] bool, penalties [P].

    Repetition (CTRL / HF): a seen token's positive logit is divided by the penalty and a
    negative one multiplied, so a penalty > 1 always makes it less likely. Then OpenAI's
    `logit -= frequency * count + presence * (count > 0)` over generated tokens."""
    c = counts.to(logits.dtype)  # [P, V]
    generated = counts > 0  # [P, V]
    seen = generated if prompt_seen is None else generated | prompt_seen
    rep = repetition.unsqueeze(1)  # [P, 1]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency.unsqueeze(1) * c - presence.unsqueeze(1) * generated.to(logits.dtype)
