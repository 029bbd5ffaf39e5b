"""The scheduler: the one owner of request state. Each engine step is three calls::

    batch = scheduler.schedule()      # which requests compute which tokens (a ScheduleBatch)
    out = runner.run(batch)           # the device work (model_runner.py), a StepOutput
    scheduler.update(batch, out)      # every request and KV transition that follows

`schedule` (continuous batching):

1. Requests that are decoding get one token each. If the pool cannot hold one more slot per
   request even after evicting unlocked cache leaves, the requests with the least progress are
   retracted (their KV goes into the prefix cache; they wait and resume from a cache hit).
2. One loop fills the step's prompt-token budget (`chunked_prefill_size`): chunked prefills
   in progress continue, then waiting requests are admitted in policy order while tokens,
   rows and memory last. Memory counts free slots, evictable cached slots and a reserve for
   the future decode tokens of everything running. While requests wait, a prefill in
   progress takes at most half the budget, so a long prompt's chunks interleave with new
   short requests instead of holding them back for its whole length.

`update` (step_update.py, the second half of this class) appends sampled tokens, caches
computed prompts, applies stop conditions and jump-forward, streams, and finishes requests;
status changes and KV bookkeeping (kv_manager.py) happen in these two files and nowhere else.
The decisions it applies come from request_output.py.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from sgl.backend import request_output as ro
from sgl.backend.kv_manager import KVManager
from sgl.backend.penalties import PenaltyPool
from sgl.backend.req import Req, ReqStatus, ScheduleBatch, ScheduledReq
from sgl.backend.speculative import NgramDrafter, cut_to_grammar
from sgl.backend.step_io import FutureRing
from sgl.backend.step_update import StepUpdate, sync_only
from sgl.errors import EngineError

# Lpm: a waiting request whose prompt shares this many more tokens with a request admitted in
# the same round than with the cache waits one round, to hit the cache instead of recomputing.
IN_BATCH_PREFIX_DEFER = 32
# Lpm matching costs a tree walk per waiting request; beyond this queue length use fcfs.
LPM_MAX_QUEUE = 128
NEW_TOKEN_RATIO_INIT = 0.7
NEW_TOKEN_RATIO_MIN = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002
RESERVE_CAP = 4096  # tokens reserved per running request at most


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    chunked_prefill_size: int  # prompt tokens per step
    max_prefill_tokens: int  # hard cap on tokens of one step
    page_size: int
    policy: str  # "lpm" | "fcfs"
    conservativeness: float
    context_length: int
    eos_token_ids: frozenset[int] = frozenset()
    # The token rows of the largest CUDA decode graph (0: no graphs). A decode step with more
    # rows (many requests jumping at once) would run eagerly, several times slower, so jumped
    # tokens beyond it wait for the next steps (`_fit_rows`).
    max_step_rows: int = 0
    # Decoding requests ride in prefill steps (one extend step computes both). False
    # (`enable_deterministic_inference` on CUDA): a step prefills or decodes, never both, so a
    # decoded token's attention always runs the decode kernel, whatever arrives meanwhile; when
    # both wait, the steps take turns (prompts never starve the decoding requests, nor they
    # the prompts). (The CPU attends every row with one C op either way.)
    mix_decode_with_prefill: bool = True


@dataclass
class Counters:
    """Lifetime counters for `stats()`."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finished_requests: int = 0
    jump_forward_tokens: int = 0
    retractions: int = 0
    recent: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) for tokens/s


@dataclass
class _Budget:
    """One step's prefill budget while `schedule` fills it."""

    tokens: int  # prompt tokens left (chunked_prefill_size)
    step_tokens: int  # tokens in the step so far (capped by max_prefill_tokens)
    reserve: int  # future decode tokens of everything running


class Scheduler(StepUpdate):
    def __init__(self, cfg: SchedulerConfig, kv: KVManager, tree: Any, futures: FutureRing,
                 tokenizer: Any, drafter: NgramDrafter | None = None) -> None:
        self.cfg = cfg
        self.kv = kv
        self.tree = tree  # a prefix_cache.PrefixCache
        self.futures = futures
        self.tokenizer = tokenizer
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted, not finished (prefilling or decoding)
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT * cfg.conservativeness
        # Unfinished requests that keep the overlap loop synchronous: constrained ones with
        # penalties (a dropped in-flight sample, see _jump_forward, would count as generated).
        self.num_sync_only = 0
        # Future slots of in-flight samples that a jump made obsolete: update discards them.
        self._dropped: set[int] = set()
        self.counters = Counters()
        self.drafter = drafter  # n-gram speculation when set (speculative.py)
        self._prefilled_last = False  # the last step was prefill-only (mix_decode_with_prefill off)

    # -- requests in and out -----------------------------------------------------------------

    def add(self, r: Req) -> None:
        ro.attach_text_state(r, self.tokenizer)
        if sync_only(r):
            self.num_sync_only += 1
        r.status = ReqStatus.WAITING
        self.waiting.append(r)

    def abort(self, r: Req, reason: str, error: BaseException | None = None) -> None:
        """End `r` now with finish_reason "abort", even if a step in flight includes it:
        steps run in order, so its freed slots go only to later steps, and the in-flight
        result for a finished request is discarded. With `error`, the caller gets it raised."""
        if not r.finished:
            r.error = reason
            self._finish(r, "abort", error=error)

    def fail_step(self, batch: ScheduleBatch, exc: BaseException) -> None:
        err = EngineError(f"model step failed: {exc!r}")
        err.__cause__ = exc
        for it in batch.items:
            it.req.pending_future = None
            self._dropped.discard(it.future_index)
            self.abort(it.req, f"model step failed: {exc!r}", error=err)

    @property
    def needs_sync(self) -> bool:
        """Whether the next step must wait for this one's tokens: drafts need them known."""
        return bool(self.num_sync_only) or (self.drafter is not None and bool(self.running))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- schedule ----------------------------------------------------------------------------

    def schedule(self) -> ScheduleBatch | None:
        decoding: list[Req] = []
        prefilling: list[Req] = []
        for r in self.running:
            decodes = 1 <= r.extend_len <= 1 + r.jump_backlog and r.kv_len >= len(r.prompt_ids)
            (decoding if decodes else prefilling).append(r)
        items: list[ScheduledReq] = []
        locs: list[torch.Tensor] = []
        separate = not self.cfg.mix_decode_with_prefill
        if separate and (prefilling or self.waiting) and not (decoding and self._prefilled_last):
            self._fill_prefill_budget(prefilling, items, locs, 0)
        self._prefilled_last = bool(items)
        if not items:  # (separate steps: decoding's turn, or no prompt could be admitted)
            step_tokens = self._decode(decoding, items, locs)
            if not separate and (prefilling or self.waiting):
                self._fill_prefill_budget(prefilling, items, locs, step_tokens)
        if not items:
            return None
        self.new_token_ratio = max(NEW_TOKEN_RATIO_MIN, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return self._commit(items, locs)

    def _decode(self, decoding: list[Req], items: list[ScheduledReq],
                locs: list[torch.Tensor]) -> int:
        """Every decoding request's next tokens (with drafts), as far as memory allows;
        returns how many requests decode."""
        decoding = self._make_room_for_decode(decoding)
        if decoding:
            drafting = self.drafter is not None and self.drafter.cfg.drafts_at(len(decoding))
            drafts = [self._draft(r) for r in decoding] if drafting else [()] * len(decoding)
            lens = [_decode_len(r) + len(d) for r, d in zip(decoding, drafts)]
            if 0 < self.cfg.max_step_rows < sum(lens):
                lens, drafts = _fit_rows(decoding, lens, drafts, self.cfg.max_step_rows)
            slots = self.kv.extend(decoding, lens)
            assert slots is not None, "room for decode was ensured above"
            locs.append(slots)  # the decoding requests' slots, in `decoding` order
            items.extend(self._item(r, n, d) for r, n, d in zip(decoding, lens, drafts))
        return len(decoding)

    def _fill_prefill_budget(self, prefilling: list[Req], items: list[ScheduledReq],
                             locs: list[torch.Tensor], step_tokens: int) -> None:
        # (a pass over every running request: only worth it when someone waits for admission)
        reserve = sum(map(self._reserve_for, self.running)) if self.waiting else 0
        budget = _Budget(self.cfg.chunked_prefill_size, step_tokens, reserve)
        # Prompts being prefilled whose KV is not in the tree yet: a waiting request sharing a
        # long prefix with one of them waits for it (lpm), instead of computing it twice.
        in_flight = _InFlightPrompts(r.prompt_ids for r in self.running if r.cached_len < len(r.prompt_ids) - 1)
        for r in prefilling + self._ordered_waiting():
            room = min(budget.tokens, self.cfg.max_prefill_tokens - budget.step_tokens)
            if room <= 0:
                break
            continuing = r.status is ReqStatus.RUNNING
            if continuing:  # a chunked prefill continues
                if r.extend_len == 0:
                    continue  # computed, nothing to sample (max_new_tokens=0): finishes in update
                share = room // 2 if self.waiting and room > 1 else room
                n = min(r.extend_len, share)
                slots = self.kv.extend([r], [n]) if self.kv.available() >= n else None
            else:
                if len(self.running) >= self.cfg.max_running_requests:
                    break
                admitted = self._try_admit(r, room, budget.reserve, in_flight)
                if admitted is False:
                    continue  # deferred for an in-batch prefix hit
                n, slots = admitted if admitted is not None else (0, None)
            if slots is None:
                break  # out of memory: later requests would not fit either (keeps fcfs order)
            locs.append(slots)
            items.append(self._item(r, n))
            budget.tokens -= n
            budget.step_tokens += n
            if not continuing:
                budget.reserve += self._reserve_for(r)
                in_flight.add(r.prompt_ids)

    def _commit(self, items: list[ScheduledReq], locs: list[torch.Tensor]) -> ScheduleBatch:
        """Record the new slots in the table, advance the lengths, assign future slots."""
        out_cache_loc = torch.cat(locs) if len(locs) > 1 else locs[0]
        slots = out_cache_loc.numpy()  # (a numpy slice per request costs a tenth of a tensor's)
        start = 0
        for it in items:
            r = it.req
            self.kv.write_row(r, r.kv_len, slots[start : start + it.extend_len])
            start += it.extend_len
            r.kv_len += it.extend_len
            if it.samples:
                it.future_index = self.futures.next()
                r.pending_future = it.future_index
        return ScheduleBatch(
            items=items, out_cache_loc=out_cache_loc,
            is_decode=all(it.extend_len == 1 and it.prefix_len >= len(it.req.prompt_ids) for it in items),
            has_constraints=any(it.req.constraint is not None for it in items),
            has_drafts=any(it.draft_ids for it in items),
            table_writes=self.kv.take_table_writes(),
        )  # fmt: skip

    def _item(self, r: Req, n: int, drafts: tuple[int, ...] = ()) -> ScheduledReq:
        prefix, known = r.kv_len, n - len(drafts)
        if r.pending_future is not None:
            assert n == 1, "a request with an in-flight sample can only decode"
            ids = [-r.pending_future]
        else:
            ids = r.known_ids(prefix, prefix + known) + list(drafts)
        samples = prefix + known == r.seq_len and r.params.max_new_tokens > 0
        return ScheduledReq(r, n, prefix, samples, ids, score_span=_score_span(r, prefix, known),
                            draft_ids=drafts, output_index=r.output_len)

    def _draft(self, r: Req) -> tuple[int, ...]:
        """Speculative tokens to verify after `r`'s next token (n-gram lookup), or ()."""
        # Drafts follow the request's last known token, so only when this step computes all of
        # its pending tokens (after a jump, with jump-forward on, that is several).
        if (self.drafter is None or r.pending_future is not None or _decode_len(r) != r.extend_len
                or PenaltyPool.needs(r.params)):
            return ()
        room = min(r.params.max_new_tokens - len(r.output_ids), self.cfg.context_length - r.seq_len) - 1
        drafts = self.drafter.propose(r, min(self.drafter.cfg.num_draft_tokens, room))
        stops = self.cfg.eos_token_ids | frozenset(r.params.stop_token_ids or ())
        for i, token in enumerate(drafts):
            if token in stops:  # a stop ends the request: verify up to it, not across it
                drafts = drafts[:i]
                break
        if drafts and r.constraint is not None:
            drafts = cut_to_grammar(r.constraint, drafts)
        return tuple(drafts)

    def _ordered_waiting(self) -> list[Req]:
        queue = list(self.waiting)
        if self.cfg.policy == "lpm" and 1 < len(queue) <= LPM_MAX_QUEUE and self.tree.caches:
            lengths = {id(r): len(self.tree.match_prefix(r.fill_ids()).slots) for r in queue}
            queue.sort(key=lambda r: -lengths[id(r)])  # stable: fcfs among equals
        return queue

    def _try_admit(self, r: Req, room: int, reserve: int,
                   in_flight: _InFlightPrompts) -> tuple[int, torch.Tensor] | bool | None:
        """Admit `r` for up to `room` tokens: (n, slots), False (deferred) or None (no memory)."""
        tokens = r.fill_ids()
        match = self.tree.match_prefix(tokens)
        cached = min(len(match.slots), len(tokens) - 1)
        if r.logprob.wants_prompt_logprobs:
            cached = min(cached, max(r.logprob.logprob_start_len - 1, 0))
        cached -= cached % self.cfg.page_size
        if self.cfg.policy == "lpm" and in_flight and self.tree.caches:
            if in_flight.shares_head(tokens, cached + IN_BATCH_PREFIX_DEFER):
                return False
        n = min(len(tokens) - cached, room)
        need = (len(tokens) - cached) + self._reserve_for(r) + reserve
        slots = self.kv.admit(r, match, cached, n, need)
        if slots is None:
            return None
        self.waiting.remove(r)
        r.status = ReqStatus.RUNNING
        if not r.admitted_once:
            r.admitted_once = True
            r.num_cached_prompt_tokens = min(cached, len(r.prompt_ids))
        self.running.append(r)
        return n, slots

    def _reserve_for(self, r: Req) -> int:
        remaining = max(r.params.max_new_tokens - r.output_len, 0)
        return int(min(remaining, RESERVE_CAP) * self.new_token_ratio)

    def _make_room_for_decode(self, decoding: list[Req]) -> list[Req]:
        """Retract decoding requests until the new slots (pages) of the rest fit."""
        page = self.cfg.page_size
        while decoding and not self.kv.make_room(sum(-(-_decode_len(r) // page) * page for r in decoding)):
            victim = min(decoding, key=lambda r: (r.output_len, -len(r.prompt_ids)))
            decoding.remove(victim)
            self.retract(victim)
        return decoding

    def retract(self, r: Req) -> None:
        """Free a running request's KV into the prefix cache and put it back in the queue."""
        self._release(r, cache=True)
        r.jump_backlog = 0  # resumed by a prefill from the cache
        r.status = ReqStatus.WAITING
        r.num_retractions += 1
        self.counters.retractions += 1
        self.waiting.appendleft(r)
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT * self.cfg.conservativeness

    def _release(self, r: Req, cache: bool) -> None:
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        self.kv.release(r, cache)
        if self.drafter is not None:
            self.drafter.forget(r)

    # -- accounting --------------------------------------------------------------------------

    def owned_slots(self) -> list[torch.Tensor]:
        """Slots owned by running requests (not by the tree), for the integrity check."""
        return [self.kv.req_slots(r)[r.cached_len :] for r in self.running]


class _InFlightPrompts:
    """Prompts being prefilled whose KV is not in the tree yet, asked for each waiting request
    of a round whether one of them shares its first k tokens (k = its cached length + 32).

    Comparing each request with each prompt was quadratic: 256 chat prompts sharing a template
    made ~32k comparisons, 0.15-0.2 s of one schedule call on the CPU. A round asks few
    distinct k (requests with the same cached prefix ask the same), so the k-token heads of
    the prompts are kept in one set per k asked: a hash lookup per request."""

    def __init__(self, prompts: Iterable[list[int]]) -> None:
        self._prompts = list(prompts)
        self._heads: dict[int, set[tuple[int, ...]]] = {}  # k -> the prompts' k-token heads

    def __bool__(self) -> bool:
        return bool(self._prompts)

    def add(self, prompt: list[int]) -> None:
        self._prompts.append(prompt)
        for k, heads in self._heads.items():
            if len(prompt) >= k:
                heads.add(tuple(prompt[:k]))

    def shares_head(self, tokens: list[int], k: int) -> bool:
        """Whether a prompt starts with `tokens[:k]` (i.e. shares at least k tokens with it)."""
        if len(tokens) < k:
            return False
        heads = self._heads.get(k)
        if heads is None:
            heads = self._heads[k] = {tuple(p[:k]) for p in self._prompts if len(p) >= k}
        return tuple(tokens[:k]) in heads


def _fit_rows(decoding: list[Req], lens: list[int], drafts: list[tuple[int, ...]],
              cap: int) -> tuple[list[int], list[tuple[int, ...]]]:
    """Trim a decode step to `cap` token rows: every request keeps its one row; jumped tokens
    and drafts fill the rest in running order, and a request that does not fit whole computes
    what fits of its jumped tokens (the rest stays pending, computed by the next steps exactly
    as with jump-forward off: the same tokens) and drops its drafts (they follow its last
    pending token)."""
    spare = cap - len(decoding)
    fitted_lens, fitted_drafts = [], []
    for r, n, d in zip(decoding, lens, drafts):
        if n - 1 <= spare:
            fitted_lens.append(n)
            fitted_drafts.append(d)
            spare -= n - 1
        else:
            k = max(1, min(_decode_len(r), 1 + spare))
            fitted_lens.append(k)
            fitted_drafts.append(())
            spare -= k - 1
    return fitted_lens, fitted_drafts


def _decode_len(r: Req) -> int:
    """Tokens a decoding request computes this step: its jumped tokens all at once with
    jump-forward on, one per step with it off (the same tokens, so the same answer)."""
    return r.extend_len if r.jump_forward else 1


def _score_span(r: Req, prefix: int, n: int) -> tuple[int, int]:
    """Positions of this chunk whose logits score a known next token: prompt tokens from
    `logprob_start_len` (prompt logprobs), and output tokens that no sample scored (appended by
    jump-forward) when output logprobs are asked for."""
    first, last = prefix, prefix + n  # positions p in [first, last) score token p+1
    P = len(r.prompt_ids)
    if r.logprob.return_logprob:
        known = P + len(r.output_ids) - 1  # the last known token is scored by its own sample
        unscored = P + len(r.output_logprobs) - 1  # first output target without a logprob
        if not r.logprob.wants_prompt_logprobs:
            first = max(first, unscored)
        else:
            first = max(first, r.logprob.logprob_start_len - 1, 0)
        last = min(last, known)
    elif r.logprob.wants_prompt_logprobs:
        first = max(first, r.logprob.logprob_start_len - 1, 0)
        last = min(last, P - 1)
    else:
        return (0, 0)
    return (first, last - first) if last > first else (0, 0)
