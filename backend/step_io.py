"""The host-side data of one model step: packed inputs, the prepared step, its results.

`ModelRunner._prepare` builds a `PreparedStep` (with all integer inputs in one `PackedInputs`
tensor) on the scheduler thread; `_execute` turns it into a `PendingResult` in device order;
`StepHandle.result()` waits for that and yields the `StepOutput` the output processor reads.
Future tokens (`FutureRing`) are explained in model_runner.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from sgl.backend.forward_batch import ForwardMode
from sgl.backend.req import ScheduleBatch


class FutureRing:
    """Hands out slots of the future-token buffer. Two steps are alive at most, so a ring
    of twice the batch size (plus one: slot 0 is never used, -0 is not negative) suffices."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._next = 0

    def next(self) -> int:
        self._next = self._next % (self.size - 1) + 1
        return self._next


@dataclass
class StepOutput:
    next_token_ids: list[int]  # one per sampling item, in batch order
    next_logprobs: list[float] | None = None
    next_top: list[list[tuple[float, int]]] | None = None
    prompt_logprobs: list[float] = field(default_factory=list)  # one per prompt row
    prompt_top: list[list[tuple[float, int]]] = field(default_factory=list)


# Order of the fields inside the packed host tensor. The first five are the per-token /
# per-request inputs a decode CUDA graph reads, so for a (padded) decode batch of size bs
# `packed[:5 * aligned(bs)].view(5, aligned(bs))[:, :bs]` is the graph's static input block.
PACKED_FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens",
                 "extend_prefix_lens", "extend_seq_lens", "extend_start", "logits_indices",
                 "future_indices", "prompt_targets", "table_index", "table_value")


# Every field starts on a 16-byte boundary (2 int64s). Triton specializes kernels on whether
# each pointer argument is 16-byte aligned: unaligned views would make the alignment of e.g.
# `positions` depend on the parity of the token count, and compile a new kernel variant
# (~1 s, in the middle of serving) the first time each combination appears.
ALIGN = 2


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PackedInputs:
    """All integer inputs of one step in one int64 host tensor (pinned on CUDA), so a step
    costs one host->device copy whatever its size. `views(t)` slices a copy of it by field."""

    def __init__(self, parts: Sequence[np.ndarray | list[int]], pin: bool) -> None:
        arrays = [np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]
        self.lengths = [a.size for a in arrays]
        padded = []
        for a in arrays:
            padded.append(a)
            if a.size % ALIGN:
                padded.append(np.zeros(ALIGN - a.size % ALIGN, dtype=np.int64))
        host = torch.from_numpy(np.concatenate(padded)) if padded else torch.empty(0, dtype=torch.int64)
        if pin:
            pinned = torch.empty(host.shape, dtype=torch.int64, pin_memory=True)
            pinned.copy_(host)
            host = pinned
        self.host = host

    def views(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for name, n in zip(PACKED_FIELDS, self.lengths):
            out[name] = t[start : start + n]
            start += aligned(n)
        return out


@dataclass
class PreparedStep:
    """Host data of one step (built on the scheduler thread)."""

    batch: ScheduleBatch
    mode: ForwardMode
    packed: PackedInputs
    has_placeholders: bool  # some input id is a future-token placeholder (< 0)
    graph_bs: int | None  # DECODE replayed by the CUDA graph of this (padded) batch size
    batch_size: int
    num_tokens: int
    seq_lens: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    num_samples: int
    num_prompt_rows: int
    sampling: Any  # the sampler's per-batch info
    top_logprobs_num: int
    prompt_top_logprobs_num: int
    want_logprobs: bool
    vocab_mask: torch.Tensor | None = None  # [S, ceil(V/32)] int32 grammar bitmask (CPU)
    # debug mode: (row, host slots of its first seq_len columns) for each request of the step
    table_check: list[tuple[int, torch.Tensor]] | None = None


class StepHandle:
    """A launched step; `result()` waits for it (CPU worker future or CUDA event)."""

    def __init__(self, get: Callable[[], StepOutput]) -> None:
        self._get = get
        self._value: StepOutput | None = None

    def result(self) -> StepOutput:
        if self._value is None:
            self._value = self._get()
        return self._value


class PendingResult:
    """Result tensors of a step, host copies under way; `wait()` turns them into a StepOutput.

    On CUDA every tensor here is a pinned host buffer filled by a non-blocking copy and
    `event` follows the copies; on the CPU they are the computed tensors and `event` is None.
    """

    def __init__(self, event: Any = None, **tensors: torch.Tensor | None) -> None:
        self.event = event
        self.tensors = tensors

    def wait(self) -> StepOutput:
        if self.event is not None:
            self.event.synchronize()  # the only place the host waits for the device
        t = self.tensors
        out = StepOutput(next_token_ids=t["tokens"].tolist() if t.get("tokens") is not None else [])
        if t.get("logprobs") is not None:
            out.next_logprobs = t["logprobs"].tolist()
            if t.get("top_ids") is not None:
                out.next_top = _pairs(t["top_vals"], t["top_ids"])
        if t.get("prompt_lp") is not None:
            out.prompt_logprobs = t["prompt_lp"].tolist()
            if t.get("prompt_top_ids") is not None:
                out.prompt_top = _pairs(t["prompt_top_vals"], t["prompt_top_ids"])
        return out


def _pairs(vals: torch.Tensor, ids: torch.Tensor) -> list[list[tuple[float, int]]]:
    return [list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist())]
