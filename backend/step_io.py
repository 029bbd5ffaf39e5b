"""What crosses between the host and the device in one step: named inputs and typed results.

    ScheduleBatch --flatten_batch--> StepInputs (host arrays, one per field) + StepPlan
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
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

import numpy as np
import torch

if TYPE_CHECKING:
    from sgl.backend.req import ScheduleBatch

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


_PAD = [0] * ALIGN  # (padding is at most ALIGN - 1 zeros)
# Steps with at most this many input integers are packed through one Python list, larger
# ones (prefills) field by field in numpy.
SMALL_PACK = 1024


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

    def pack(self, pin: bool, align: int = ALIGN) -> tuple[torch.Tensor, tuple[int, ...]]:
        """One int64 host tensor holding every field (each padded to `align`: 1 on the CPU,
        where nothing specializes on alignment), and the lengths."""
        fields = [getattr(self, name) for name in _INPUT_FIELDS]  # lists or 1-D arrays
        lengths = tuple(map(len, fields))
        if sum(lengths) <= SMALL_PACK:
            # (a decode step: one Python list and one conversion cost a fifth of a numpy
            # conversion and a pad per field, and they run on every step)
            flat: list[int] = []
            for f, n in zip(fields, lengths):
                flat += f if isinstance(f, list) else f.tolist()
                flat += _PAD[: -n % align]
            host = torch.from_numpy(np.array(flat, dtype=np.int64))
        else:
            parts = []
            for f, n in zip(fields, lengths):
                parts.append(np.asarray(f, dtype=np.int64))
                parts.append(np.zeros(-n % align, dtype=np.int64))
            host = torch.from_numpy(np.concatenate(parts))
        if pin:
            pinned = torch.empty(host.shape, dtype=torch.int64, pin_memory=True)
            pinned.copy_(host)
            host = pinned
        return host, lengths

    @classmethod
    def unpack(cls, flat: torch.Tensor, lengths: tuple[int, ...], align: int = ALIGN) -> StepInputs[torch.Tensor]:
        """Views of a packed tensor (usually its device copy), field by field, by one split
        (thirteen slices cost three times as much)."""
        if align == 1:
            return cls(*flat.split_with_sizes(lengths))
        sizes: list[int] = []
        for n in lengths:
            sizes += (n, -n % align)  # the field, then its padding
        return cls(*flat.split_with_sizes(sizes)[::2])


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


# -- laying a batch out as step inputs (model_runner.prepare) ------------------------------


@dataclass
class StepPlan:
    """Host-side shape of a step, read while building the ForwardBatch and the results."""

    seq_lens: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    num_tokens: int
    num_samples: int
    num_score_rows: int
    want_logprobs: bool
    top_logprobs_num: int
    score_top_logprobs_num: int
    has_placeholders: bool = False  # some input id is a future-token placeholder (< 0)

    @property
    def rows_in_order(self) -> bool:
        """Every token is sampled, in order (plain decode): the logits need no gather."""
        return self.num_samples == self.num_tokens and not self.num_score_rows


def flatten_batch(batch: ScheduleBatch) -> tuple[StepInputs[list[int]], StepPlan]:
    """The batch's tokens laid end to end, request by request (forward_batch.py)."""
    x: StepInputs[list[int]] = StepInputs(*([] for _ in _INPUT_FIELDS))
    score_rows: list[int] = []
    plan = StepPlan([], [], [], 0, 0, 0, False, 0, 0)
    for it in batch.items:
        r, n, prefix, start = it.req, it.extend_len, it.prefix_len, plan.num_tokens
        x.input_ids.extend(it.input_ids)
        if n == 1:  # (decode: most items of most steps)
            x.positions.append(prefix)
            plan.has_placeholders |= it.input_ids[0] < 0
        else:
            x.positions.extend(range(prefix, prefix + n))
        x.req_pool_indices.append(r.req_pool_idx)
        x.seq_lens.append(prefix + n)
        x.extend_prefix_lens.append(prefix)
        x.extend_seq_lens.append(n)
        x.extend_start.append(start)
        if it.samples:  # the last token's row, and one row per draft after it
            x.logits_indices.extend(range(start + n - 1 - len(it.draft_ids), start + n))
            x.future_indices.append(it.future_index)
        if r.logprob.return_logprob:
            plan.want_logprobs = True
            plan.top_logprobs_num = max(plan.top_logprobs_num, r.logprob.top_logprobs_num)
        first, count = it.score_span
        if count:
            plan.score_top_logprobs_num = max(plan.score_top_logprobs_num, r.logprob.top_logprobs_num)
            score_rows.extend(range(start + first - prefix, start + first - prefix + count))
            x.score_targets.extend(r.known_ids(first + 1, first + 1 + count))
        plan.num_tokens += n
    plan.num_samples, plan.num_score_rows = len(x.logits_indices), len(score_rows)
    plan.seq_lens, plan.prefix_lens, plan.extend_lens = (
        list(x.seq_lens), list(x.extend_prefix_lens), list(x.extend_seq_lens))
    x.logits_indices.extend(score_rows)  # sampled rows first, then score rows
    loc = batch.out_cache_loc  # (int64 from the allocator: no conversion, one call less)
    x.out_cache_loc = (loc if loc.dtype == torch.int64 else loc.to(torch.int64)).numpy()
    return x, plan


def one_row_per_token(x: StepInputs[Any]) -> None:
    """Lay a step out as decode graph rows: every token attends, on its request's table row,
    to the keys up to its own position (cuda_graph.py). The per-request fields the graph does
    not read stay as they are."""
    x.req_pool_indices = np.repeat(np.asarray(x.req_pool_indices, dtype=np.int64),
                                   np.asarray(x.extend_seq_lens, dtype=np.int64)).tolist()
    x.seq_lens = [p + 1 for p in x.positions]


def pad_decode_rows(x: StepInputs[Any], pad: int) -> None:
    """Padded CUDA-graph rows: id 0 at position 0, KV written to the reserved slot 0,
    attending through the reserved req_to_token row 0 over one key (slot 0). Harmless."""
    x.input_ids = x.input_ids + [0] * pad
    x.positions = x.positions + [0] * pad
    x.out_cache_loc = np.concatenate([x.out_cache_loc, np.zeros(pad, dtype=np.int64)])
    x.req_pool_indices = x.req_pool_indices + [0] * pad
    x.seq_lens = x.seq_lens + [1] * pad


def writes_overlap(writes: list[tuple[int, int, Any]]) -> bool:
    """Whether two writes of one batch cover the same req_to_token position."""
    rows = [row for row, _, _ in writes]
    if len(set(rows)) == len(rows):  # (most steps: one write per row)
        return False
    spans: dict[int, list[tuple[int, int]]] = {}
    for row, col, slots in writes:
        spans.setdefault(row, []).append((col, col + slots.shape[0]))
    for row_spans in spans.values():
        if len(row_spans) > 1:
            row_spans.sort()
            if any(a_end > b_start for (_, a_end), (b_start, _) in zip(row_spans, row_spans[1:])):
                return True
    return False


def last_write_wins(index: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep only the last write to each `req_to_token` position, in list order.

    One batch can carry two writes to the same position: after a request's prefill,
    `cache_prompt` queues a rewrite of its row's prefix onto the tree's slots; if the request
    finishes before another step runs, the row is freed and the next request that gets it
    queues its own slots for the same columns, in the same batch. The host mirror applies
    writes in order (the last wins), but `index_copy_` on CUDA keeps an arbitrary one of
    duplicate indices, so the device row could point at the previous owner's slots: wrong
    keys, run to run nondeterministic, and only where the radix cache rewrote a row.
    """
    if index.size < 2:
        return index, values
    # np.unique on the reversed index: `first` is each position's last write in list order.
    unique, first = np.unique(index[::-1], return_index=True)
    if unique.size == index.size:
        return index, values
    keep = np.sort(index.size - 1 - first)
    return index[keep], values[keep]


def check_table_rows(table: torch.Tensor, expected: list[tuple[int, torch.Tensor]]) -> None:
    """Debug mode: the device `req_to_token` rows a step reads equal the host mirror's."""
    for row, want in expected:
        got = table[row, : want.shape[0]].to("cpu", torch.int64)
        if not torch.equal(got, want):
            col = int((got != want).nonzero()[0])
            raise AssertionError(
                f"req_to_token row {row} column {col} holds slot {int(got[col])} on the device "
                f"but {int(want[col])} on the host: a table write was lost or reordered")
