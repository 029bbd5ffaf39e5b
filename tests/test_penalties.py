"""Penalties: the penalty formula and PenaltyPool's per-row counts, on small CPU tensors (and
the same rows built on a GPU, without a host sync, where one exists)."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import pytest
import torch

from sgl.backend.penalties import PenaltyPool, PenaltyStart, apply_penalties
from sgl.sampling import SamplingParams

SP = SamplingParams
VOCAB = 12
REP, FREQ, PLAIN = SP(repetition_penalty=1.5), SP(frequency_penalty=0.5), SP()
# Out-of-range prompt ids are clamped; repeated ids count once in the prompt, every time in the output.
STARTS: list[PenaltyStart] = [
    (1, REP, [3, 3, 7, 40, -2], [5, 5, 2]),
    (3, FREQ, [4, 6], [9, 9, 9, 0]),  # no repetition penalty: the prompt is not recorded
    (1, REP, [8], [11]),  # the row changes hands: nothing of the first start survives
    (2, PLAIN, [1], [6]),  # after allocation an unpenalised start still resets its row
]


def test_apply_penalties_matches_the_definition() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    counts = torch.tensor([[0, 2, 1, 0, 0]], dtype=torch.int32)
    prompt = torch.tensor([[False, False, False, True, False]])
    out = apply_penalties(logits.clone(), counts, prompt, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]))
    expected = [2.0, -1.0 * 2 - 0.5 * 2 - 0.25, 0.5 / 2 - 0.5 - 0.25, 3.0 / 2, -2.0]
    assert torch.allclose(out[0], torch.tensor(expected))


def reference_rows(starts: Sequence[PenaltyStart], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What `start` must leave: a plain loop over the ids, last start of a row wins."""
    counts = torch.zeros(rows, VOCAB, dtype=torch.int32)
    seen = torch.zeros(rows, VOCAB, dtype=torch.bool)
    for row, params, prompt, output in starts:
        counts[row], seen[row] = 0, False
        for t, n in Counter(output).items():
            counts[row, t] = n
        if params.repetition_penalty != 1.0:
            for t in prompt:
                seen[row, min(max(t, 0), VOCAB - 1)] = True
    return counts, seen


def run_starts(pool: PenaltyPool, starts: Sequence[PenaltyStart]) -> None:
    for start in starts:
        pool.start(*start)


def test_pool_is_not_allocated_until_a_penalised_request_starts() -> None:
    pool = PenaltyPool(num_rows=4, vocab_size=VOCAB, device="cpu")
    pool.start(0, PLAIN, [1, 2], [3])
    assert pool.counts is None and pool.prompt_seen is None
    pool.add(torch.tensor([0]), torch.tensor([3]))  # a no-op while unallocated
    assert pool.counts is None


def test_start_rebuilds_rows_from_the_ids() -> None:
    pool = PenaltyPool(num_rows=4, vocab_size=VOCAB, device="cpu")
    run_starts(pool, STARTS)
    counts, seen = reference_rows(STARTS, 4)
    assert pool.counts is not None and pool.prompt_seen is not None
    assert torch.equal(pool.counts, counts) and torch.equal(pool.prompt_seen, seen)
    pool.add(torch.tensor([1, 1, 3]), torch.tensor([11, 4, 9]))  # duplicate rows accumulate
    assert pool.counts[1, 11] == 2 and pool.counts[1, 4] == 1 and pool.counts[3, 9] == 4


@pytest.mark.gpu
def test_start_on_cuda_matches_cpu_without_a_host_sync() -> None:
    cpu = PenaltyPool(num_rows=4, vocab_size=VOCAB, device="cpu")
    gpu = PenaltyPool(num_rows=4, vocab_size=VOCAB, device="cuda")
    run_starts(cpu, STARTS)
    rows, ids = torch.tensor([1, 3], device="cuda"), torch.tensor([11, 9], device="cuda")  # [2]
    torch.cuda.set_sync_debug_mode("error")  # any .item(), .tolist() or blocking copy raises
    try:
        run_starts(gpu, STARTS)
        gpu.add(rows, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu.add(torch.tensor([1, 3]), torch.tensor([11, 9]))
    assert gpu.counts is not None and gpu.prompt_seen is not None
    assert torch.equal(gpu.counts.cpu(), cpu.counts) and torch.equal(gpu.prompt_seen.cpu(), cpu.prompt_seen)
