"""What crosses between the host and the device in one step: named inputs and typed results.

    ScheduleBatch --runner._prepare--> StepInputs (host arrays, one per field)
                                        | pack(): ONE int64 host tensor (pinned on CUDA)
                                        v one host->device copy, unpack(): device views
                  --runner._execute--> StepResult (device tensors -> pinned host copies)
                  --handle.result()--> StepOutput (host lists) --> scheduler.update

A new per-step input is a new `StepInputs` field and a new output a new `StepResult` /
`StepOutput` field: packing, unpacking and the host copies iterate the fields.
Future tokens (`FutureRing`) are explained in model_runner.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

import numpy as np
import torch

A = TypeVar("A")  # np.ndarray on the host, torch.Tensor on the device


class FutureRing:
    """Hands out slots of the future-token buffer. Two steps are alive at most, so a ring
    of twice the batch size (plus one: slot 0 is never used, -0 is not negative) suffices."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._next = 0

    def next(self) -> int:
        self._next = self._next % (self.size - 1) + 1
        return self._next


# Every field starts on a 16-byte boundary (2 int64s). Triton specializes kernels on whether
# each pointer argument is 16-byte aligned: unaligned views would make the alignment of e.g.
# `positions` depend on the parity of the token count, and compile a new kernel variant
# (~1 s, in the middle of serving) the first time each combination appears.
ALIGN = 2


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class StepInputs(Generic[A]):
    """Every integer input of one step (T new tokens, B requests, S sampled rows, P score
    rows, W table writes). The first five fields are the decode CUDA graph's static
    inputs: for a (padded) decode batch of bs rows, `flat[:5 * aligned(bs)].view(5, -1)`."""

    input_ids: A  # [T] known ids; -k = the sample the device writes into future slot k
    positions: A  # [T]
    out_cache_loc: A  # [T] pool slot receiving each new token's KV
    req_pool_indices: A  # [B] row of req_to_token
    seq_lens: A  # [B] sequence length after the step
    extend_prefix_lens: A  # [B]
    extend_seq_lens: A  # [B]
    extend_start: A  # [B] offset of request b's first new token
    logits_indices: A  # [S + P] hidden rows whose logits are needed: samples, then score rows
    future_indices: A  # [S] future-token slot of each sample
    score_targets: A  # [P] the known next token each score row scores (prompt or jumped)
    table_index: A  # [W] flat index into req_to_token
    table_value: A  # [W] the slot written there

    def pack(self, pin: bool) -> tuple[torch.Tensor, tuple[int, ...]]:
        """One int64 host tensor holding every field (each padded to ALIGN), and the lengths."""
        arrays = [np.asarray(getattr(self, name), dtype=np.int64).reshape(-1) for name in _INPUT_FIELDS]
        parts = []
        for a in arrays:
            parts.append(a)
            if a.size % ALIGN:
                parts.append(np.zeros(ALIGN - a.size % ALIGN, dtype=np.int64))
        host = torch.from_numpy(np.concatenate(parts))
        if pin:
            pinned = torch.empty(host.shape, dtype=torch.int64, pin_memory=True)
            pinned.copy_(host)
            host = pinned
        return host, tuple(a.size for a in arrays)

    @classmethod
    def unpack(cls, flat: torch.Tensor, lengths: tuple[int, ...]) -> StepInputs[torch.Tensor]:
        """Views of a packed tensor (usually its device copy), field by field."""
        views, start = {}, 0
        for name, n in zip(_INPUT_FIELDS, lengths, strict=True):
            views[name] = flat[start : start + n]
            start += aligned(n)
        return cls(**views)


_INPUT_FIELDS = tuple(f.name for f in dataclasses.fields(StepInputs))  # packing order


@dataclass
class StepOutput:
    """A step's results on the host, read by `Scheduler.update`."""

    next_token_ids: list[int] = field(default_factory=list)  # one per sampled item, in batch order
    next_logprobs: list[float] | None = None
    next_top: list[list[tuple[float, int]]] | None = None  # (logprob, id) pairs per sample
    score_logprobs: list[float] = field(default_factory=list)  # one per score row
    score_top: list[list[tuple[float, int]]] = field(default_factory=list)

    def sample(self, k: int) -> tuple[int, float | None, list[tuple[float, int]] | None]:
        """The k-th sampled token with its logprob and top logprobs (None when not asked)."""
        lp = self.next_logprobs[k] if self.next_logprobs is not None else None
        top = self.next_top[k] if self.next_top is not None else None
        return self.next_token_ids[k], lp, top


@dataclass
class StepResult:
    """A step's result tensors: computed ones on the CPU; on CUDA, pinned host buffers that
    non-blocking copies fill before `event` completes (`to_host` starts them)."""

    tokens: torch.Tensor | None = None  # [S] int64
    logprobs: torch.Tensor | None = None  # [S] float32
    top_ids: torch.Tensor | None = None  # [S, k]
    top_vals: torch.Tensor | None = None  # [S, k]
    score_logprobs: torch.Tensor | None = None  # [P]
    score_top_ids: torch.Tensor | None = None  # [P, k]
    score_top_vals: torch.Tensor | None = None  # [P, k]
    event: Any = None  # a CUDA event recorded after the copies, or None

    def to_host(self) -> StepResult:
        """Start copying every tensor into pinned host memory; the event marks completion."""
        host = StepResult()
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            if isinstance(t, torch.Tensor):
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                setattr(host, f.name, h)
        host.event = torch.cuda.Event()
        host.event.record()
        return host

    def wait(self) -> StepOutput:
        if self.event is not None:
            self.event.synchronize()  # the only place the host waits for the device
        out = StepOutput()
        if self.tokens is not None:
            out.next_token_ids = self.tokens.tolist()
        if self.logprobs is not None:
            out.next_logprobs = self.logprobs.tolist()
            if self.top_ids is not None:
                out.next_top = _pairs(self.top_vals, self.top_ids)
        if self.score_logprobs is not None:
            out.score_logprobs = self.score_logprobs.tolist()
            if self.score_top_ids is not None:
                out.score_top = _pairs(self.score_top_vals, self.score_top_ids)
        return out


class StepHandle:
    """A launched step; `result()` waits for it once (CPU worker future or CUDA event) and
    re-raises whatever made the step fail.

    A step launched before the update of the step ahead of it, with grammar masks, is
    *deferred* (cross-step overlap, engine_loop.py): its forward is enqueued, but its masks may
    only be filled once that update has run. The loop then calls `start_masks()` (after the
    update) and, on CUDA, `resume()` (before launching the next step: it waits for the masks and
    enqueues the sampling). `result()` does whatever of both is still to do."""

    def __init__(self, get: Callable[[], StepOutput] | None, masks: Any = None,
                 finish: Callable[[], Callable[[], StepOutput]] | None = None) -> None:
        assert (get is None) == (finish is not None), "a deferred step gets its result from finish"
        self._get = get
        self._value: StepOutput | None = None
        self._masks = masks  # a grammar_masks.DeferredMaskFill, started by start_masks()
        self._finish = finish  # CUDA: enqueues the sampling, returns the waiting `get`

    @classmethod
    def failed(cls, exc: BaseException) -> StepHandle:
        def fail() -> StepOutput:
            raise exc

        return cls(fail)

    def start_masks(self) -> None:
        if self._masks is not None:
            self._masks.start()

    def resume(self) -> None:
        if self._finish is not None:
            self.start_masks()
            finish, self._finish = self._finish, None
            try:
                self._get = finish()
            except Exception as exc:  # enqueueing the sampling failed: the step fails
                self._get = StepHandle.failed(exc)._get

    def result(self) -> StepOutput:
        if self._value is None:
            self.start_masks()
            self.resume()
            assert self._get is not None
            self._value = self._get()
        return self._value


def _pairs(vals: torch.Tensor | None, ids: torch.Tensor) -> list[list[tuple[float, int]]]:
    assert vals is not None
    return [list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist())]
