"""Req and ScheduleBatch: the CPU-side state of requests and of one scheduling decision.

A request's token sequence is `prompt_ids + output_ids`. Its KV lives in pool slots listed in
`req_to_token[req_pool_idx, :kv_len]`::

    seq:      | p0 p1 ... p(P-1) | o0 o1 ... o(k-1) |
    KV:       |<-- cached_len -->|<-- computed or scheduled -->|
              |<------------------- kv_len ------------------->|
    radix:    |<-- prefix locked via last_node (cached_len) -->|

* `cached_len`: leading tokens whose slots belong to the radix tree (locked through `last_node`).
  Slots `[cached_len, kv_len)` are owned by this request alone.
* `kv_len` advances when a step is *scheduled* (its slots are allocated then); with the overlap
  loop a step may still be computing, which is safe because steps execute in order.
* In decode the newest token has no KV yet: `kv_len == len(seq) - 1` between steps.
* Jump-forward appends forced tokens straight to `output_ids` (after rolling back the last few
  tokens when the tokenizer would merge them); their KV is computed by the following decode
  steps: all in one step with jump-forward on, one per step with it off (`jump_backlog`).
* Only prompt tokens are inserted into the radix tree while a request runs; outputs join the
  tree when it finishes or is retracted. So a jump-forward rollback never cuts cached KV.
* With the overlap loop a sampled token may be in flight: `pending_future` is the index in the
  runner's future-token buffer where the device will put it. At most one sample is in flight.

Status changes only through the scheduler: WAITING -> RUNNING -> FINISHED, and RUNNING ->
WAITING on retraction (KV freed into the radix cache, resumed later from a cache hit).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from sgl.outputs import FinishReason
from sgl.sampling import LogprobOptions, SamplingParams

if TYPE_CHECKING:
    from sgl.backend.detokenizer import IncrementalDetokenizer, StopChecker


class ReqStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()  # prefilling (possibly in chunks) or decoding
    FINISHED = enum.auto()


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    logprob: LogprobOptions = field(default_factory=LogprobOptions)
    stream: bool = False
    deadline: float | None = None  # time.monotonic() after which the request is aborted
    # Called with events for this request, in order (through EngineCore: on its event-delivery
    # thread, event_delivery.py).
    sink: Callable[[Any], None] | None = None
    constraint: Any = None  # a backend.grammar constraint state, or None
    jump_forward: bool = False
    sample_index: int = 0  # which of the n samples of a prompt

    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    # KV bookkeeping (see the module docstring)
    req_pool_idx: Optional[int] = None
    kv_len: int = 0
    cached_len: int = 0
    last_node: Any = None
    pending_future: Optional[int] = None
    # Uncomputed tokens beyond the next one that a jump appended: the request still decodes
    # while extend_len <= 1 + jump_backlog (a resumed retraction prefills instead).
    jump_backlog: int = 0
    # Prompt tokens served from the radix cache on first admission (for usage and stats).
    num_cached_prompt_tokens: int = 0
    admitted_once: bool = False
    num_retractions: int = 0

    finish_reason: Optional[FinishReason] = None
    matched_stop: int | str | None = None
    error: Optional[str] = None  # why it was aborted

    # Outputs being assembled on the engine thread
    detokenizer: Optional[IncrementalDetokenizer] = None
    stop_checker: Optional[StopChecker] = None
    text: str = ""
    output_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, int]] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)

    created_at: float = field(default_factory=time.monotonic)
    first_token_at: Optional[float] = None

    # -- derived lengths --------------------------------------------------------------------

    @property
    def seq_len(self) -> int:
        """Tokens in the sequence known or in flight (a pending sample counts)."""
        return len(self.prompt_ids) + len(self.output_ids) + (self.pending_future is not None)

    @property
    def output_len(self) -> int:
        return len(self.output_ids) + (self.pending_future is not None)

    @property
    def extend_len(self) -> int:
        """Tokens still to compute before the next sample (prefill remainder, or 1 in decode)."""
        return self.seq_len - self.kv_len

    def fill_ids(self) -> list[int]:
        """Known tokens: prompt + outputs. Excludes an in-flight sample."""
        return self.prompt_ids + self.output_ids

    def known_ids(self, start: int, stop: int) -> list[int]:
        """`fill_ids()[start:stop]` without copying the whole sequence (decode reads one id)."""
        num_prompt = len(self.prompt_ids)
        if stop <= start:
            return []
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : stop - num_prompt]
        if stop <= num_prompt:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[: stop - num_prompt]

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED


@dataclass
class ScheduledReq:
    """One request's part in a step."""

    req: Req
    extend_len: int  # tokens computed this step
    prefix_len: int  # == req.kv_len before this step
    samples: bool  # whether the step samples a token for it (last chunk, or decode)
    input_ids: list[int]  # known ids of the new tokens; placeholders (<0) for in-flight samples
    future_index: Optional[int] = None  # where the device writes the sampled token
    # score rows this step covers: (first sequence position scored, number of positions); the
    # logits at position p give the logprob of the known token p+1, a prompt token (prompt
    # logprobs) or an output token appended by jump-forward (its output logprob).
    score_span: tuple[int, int] = (0, 0)
    # speculative tokens appended to input_ids (after the known ones): every position from the
    # last known token on is sampled, and update keeps the drafts the samples confirm
    draft_ids: tuple[int, ...] = ()
    # index in output_ids of the token this step samples (the first, with drafts): counted
    # before the step's sample goes in flight, so the seed step and the min_new_tokens count
    # are the same with and without the overlap loop
    output_index: int = 0


@dataclass
class ScheduleBatch:
    """The scheduler's decision for one step."""

    items: list[ScheduledReq]
    out_cache_loc: Any  # int64 tensor [T], slots of the new tokens (CPU)
    is_decode: bool  # every item computes exactly one token
    has_constraints: bool = False
    has_drafts: bool = False  # some item verifies speculative tokens (the step runs in sync)
    # (row, start, slots): req_to_token updates the runner applies before this step runs
    table_writes: list[tuple[int, int, Any]] = field(default_factory=list)

    @property
    def reqs(self) -> list[Req]:
        return [it.req for it in self.items]

    @property
    def num_tokens(self) -> int:
        return sum(it.extend_len for it in self.items)
