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

`update` appends sampled tokens, caches computed prompts, applies stop conditions and
jump-forward, streams, and finishes requests; status changes and KV bookkeeping (kv_manager.py)
happen here and nowhere else. The decisions it applies come from request_output.py.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl._seq import common_prefix_len
from sgl.backend import request_output as ro
from sgl.backend.kv_manager import KVManager
from sgl.backend.penalties import PenaltyPool
from sgl.backend.req import Req, ReqStatus, ScheduleBatch, ScheduledReq
from sgl.backend.speculative import NgramDrafter, accepted_len, cut_to_grammar
from sgl.backend.step_io import FutureRing, StepOutput
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


class Scheduler:
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

    # -- requests in and out -----------------------------------------------------------------

    def add(self, r: Req) -> None:
        ro.attach_text_state(r, self.tokenizer)
        if _sync_only(r):
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
        decoding = self._make_room_for_decode(decoding)
        items: list[ScheduledReq] = []
        locs: list[torch.Tensor] = []
        if decoding:
            drafts = [self._draft(r) for r in decoding]
            lens = [_decode_len(r) + len(d) for r, d in zip(decoding, drafts)]
            slots = self.kv.extend(decoding, lens)
            assert slots is not None, "room for decode was ensured above"
            locs.append(slots)  # the decoding requests' slots, in `decoding` order
            items.extend(self._item(r, n, d) for r, n, d in zip(decoding, lens, drafts))
        if prefilling or self.waiting:
            self._fill_prefill_budget(prefilling, items, locs, len(decoding))
        if not items:
            return None
        self.new_token_ratio = max(NEW_TOKEN_RATIO_MIN, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return self._commit(items, locs)

    def _fill_prefill_budget(self, prefilling: list[Req], items: list[ScheduledReq],
                             locs: list[torch.Tensor], step_tokens: int) -> None:
        # (a pass over every running request: only worth it when someone waits for admission)
        reserve = sum(map(self._reserve_for, self.running)) if self.waiting else 0
        budget = _Budget(self.cfg.chunked_prefill_size, step_tokens, reserve)
        # Prompts being prefilled whose KV is not in the tree yet: a waiting request sharing a
        # long prefix with one of them waits for it (lpm), instead of computing it twice.
        in_flight = [r.prompt_ids for r in self.running if r.cached_len < len(r.prompt_ids) - 1]
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
                in_flight.append(r.prompt_ids)

    def _commit(self, items: list[ScheduledReq], locs: list[torch.Tensor]) -> ScheduleBatch:
        """Record the new slots in the table, advance the lengths, assign future slots."""
        out_cache_loc = torch.cat(locs) if len(locs) > 1 else locs[0]
        start = 0
        for it in items:
            r = it.req
            self.kv.write_row(r, r.kv_len, out_cache_loc[start : start + it.extend_len])
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
            ids = r.fill_ids()[prefix : prefix + known] + list(drafts)
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
                   in_flight: list[list[int]]) -> tuple[int, torch.Tensor] | bool | None:
        """Admit `r` for up to `room` tokens: (n, slots), False (deferred) or None (no memory)."""
        tokens = r.fill_ids()
        match = self.tree.match_prefix(tokens)
        cached = min(len(match.slots), len(tokens) - 1)
        if r.logprob.wants_prompt_logprobs:
            cached = min(cached, max(r.logprob.logprob_start_len - 1, 0))
        cached -= cached % self.cfg.page_size
        if self.cfg.policy == "lpm" and in_flight and self.tree.caches:
            if max(common_prefix_len(tokens, p) for p in in_flight) >= cached + IN_BATCH_PREFIX_DEFER:
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

    # -- update ------------------------------------------------------------------------------

    def update(self, batch: ScheduleBatch, out: StepOutput) -> None:
        """Apply a finished step's results to its requests."""
        k = p = kept = 0
        now = time.monotonic()
        for it in batch.items:
            r = it.req
            samples = None  # the item's sampled rows: one, or one per draft plus one
            dropped = False  # a jump made this sample obsolete while it was in flight
            if it.samples:
                rows = 1 + len(it.draft_ids)
                samples = [out.sample(k + j) for j in range(rows)]
                k += rows
                if r.pending_future == it.future_index:
                    r.pending_future = None
                if it.future_index in self._dropped:
                    self._dropped.discard(it.future_index)
                    dropped = True
            first, count = it.score_span
            if count and not r.finished:
                _record_scores(r, first, out.score_logprobs[p : p + count], out.score_top[p : p + count])
            p += count
            if r.finished or dropped:
                continue  # finished in the previous step, or jumped: this token is discarded
            if r.status is ReqStatus.RUNNING and it.prefix_len < len(r.prompt_ids):
                self.kv.cache_prompt(r)  # (not if retracted since this step was scheduled)
            if samples is None:
                if r.params.max_new_tokens == 0 and r.kv_len >= len(r.prompt_ids):
                    self._finish(r, "length")
                continue
            if r.first_token_at is None:
                r.first_token_at = now
            if it.draft_ids:
                kept += self._accept_drafts(r, it, samples)
                continue
            kept += 1
            self.counters.output_tokens += 1  # before appending: a caller may read stats once done
            self._append(r, *samples[0])
        self.counters.recent.append((now, kept))
        if len(self.counters.recent) > 256:
            del self.counters.recent[:128]

    def _accept_drafts(self, r: Req, it: ScheduledReq,
                       samples: list[tuple[int, float | None, list[tuple[float, int]] | None]]) -> int:
        """Keep the drafts the samples confirm, plus the sample after them; returns how many
        tokens were appended. Appending stops early where decoding would have done something
        else after a token: finish, or jump forward (the jump then owns what follows)."""
        assert self.drafter is not None
        a = accepted_len(it.draft_ids, [tok for tok, _, _ in samples])
        self.drafter.stats.steps += 1
        self.drafter.stats.proposed += len(it.draft_ids)
        self.drafter.stats.accepted += a
        # KV of the known tokens and of the kept drafts
        self.kv.truncate(r, it.prefix_len + it.extend_len - len(it.draft_ids) + a)
        appended = 0
        for sample in samples[: a + 1]:
            before = len(r.output_ids)
            appended += 1
            self.counters.output_tokens += 1
            self._append(r, *sample)
            if r.finished or len(r.output_ids) != before + 1:
                break
        return appended

    def _append(self, r: Req, tok: int, lp: float | None, top: list[tuple[float, int]] | None) -> None:
        r.output_ids.append(tok)
        if lp is not None:
            r.output_logprobs.append((lp, tok))
            if top is not None:
                r.output_top_logprobs.append(top)
        if r.constraint is not None and not r.constraint.accept_token(tok) and not r.constraint.is_terminated():
            # The mask forbids this token, so this is an engine bug, not the caller's: say so.
            reason = f"grammar rejected sampled token {tok} (constrained decoding failed)"
            self.abort(r, reason, error=EngineError(reason))
            return
        stop_tok = ro.is_stop_token(r, tok, self.cfg.eos_token_ids)
        delta = "" if stop_tok else self._push_text(r, [tok])  # may finish on a stop string
        if r.finished:
            return
        if r.stream:  # every token is streamed, with whatever text it completed (maybe none)
            lps = ro.token_logprobs(self.tokenizer, r.output_logprobs[-1:]) if lp is not None else None
            ro.emit(r, "chunk", ro.chunk(r, delta, [tok], lps))
        if stop_tok:
            r.matched_stop = tok
            self._finish(r, "stop")
        else:
            self._after_progress(r, jump=True)

    def _after_progress(self, r: Req, jump: bool) -> None:
        if r.constraint is not None and r.constraint.is_terminated():
            self._finish(r, "stop")
        elif ro.at_length_limit(r, self.cfg.context_length):
            self._finish(r, "length")
        elif jump and r.constraint is not None:
            self._jump_forward(r)

    def _push_text(self, r: Req, ids: list[int]) -> str:
        """Grow the request's text; finishes it on a stop string."""
        step = ro.next_text(r, ids)
        r.text += step.delta
        if step.matched is None:
            return step.delta
        r.matched_stop = step.matched
        if r.stream and step.delta:
            ro.emit(r, "chunk", ro.chunk(r, step.delta, ids))
        self._finish(r, "stop", text_done=True)
        return ""

    def _jump_forward(self, r: Req) -> None:
        """Append the grammar's forced text as the tokenizer's own tokens, in both modes.

        Planned after every sampled token whether jump-forward is on or off, so the tokens are
        the same; the mode only decides how many of them one decode step computes
        (`_decode_len`). Their logprobs come from the steps that compute them (score rows); a
        rollback then also recomputes the last kept token, whose row scores the first jumped
        token."""
        budget = r.params.max_new_tokens - len(r.output_ids)
        # With logprobs the request ends on a sampled token: the score rows of jumped tokens
        # run in the steps after the jump, so a jump must not reach the length limit.
        budget -= r.logprob.return_logprob
        plan = r.constraint.jump_forward(r.output_ids, max_new_tokens=budget)
        if plan is None or not plan.append_ids:
            return
        kept = len(r.prompt_ids) + len(r.output_ids) - plan.rollback
        # The row of the last kept token scores the first jumped token: recompute it when its
        # KV exists already (after a rollback, or a verify step that computed it).
        rescore = r.logprob.return_logprob and r.kv_len >= kept
        # Never cut into KV that belongs to the tree (only possible after a retraction).
        if kept - rescore < r.cached_len:
            return
        if r.pending_future is not None:
            # The overlap loop: the step in flight samples the token after the one just
            # appended, but the jump owns what follows, so that sample is dropped. Its step
            # still computes the KV of the last token (kept unless rolled back below).
            self._dropped.add(r.pending_future)
            r.pending_future = None
        r.constraint.apply(plan)
        if plan.rollback:
            assert plan.rollback <= len(r.output_ids)
            del r.output_ids[len(r.output_ids) - plan.rollback :]
            del r.output_logprobs[len(r.output_ids) :], r.output_top_logprobs[len(r.output_ids) :]
            if r.detokenizer is not None:
                r.detokenizer.rollback(plan.rollback)
        self.kv.truncate(r, min(r.kv_len, kept - rescore))
        r.output_ids.extend(plan.append_ids)
        r.jump_backlog = r.extend_len - 1
        if r.jump_forward:
            self.counters.jump_forward_tokens += len(plan.append_ids) - plan.rollback  # steps saved
        delta = self._push_text(r, plan.append_ids)
        if r.finished:
            return
        if r.stream:
            ro.emit(r, "chunk", ro.chunk(r, delta, list(plan.append_ids)))
        self._after_progress(r, jump=False)

    def _finish(self, r: Req, reason: str, error: BaseException | None = None, text_done: bool = False) -> None:
        self._release(r, cache=error is None)
        r.status = ReqStatus.FINISHED
        if _sync_only(r):
            self.num_sync_only -= 1
        if error is not None:
            r.finish_reason = "abort"
            ro.emit(r, "error", error)
            return
        if not text_done:
            r.text, tail, matched = ro.final_text(r, self.tokenizer)
            if matched is not None:
                r.matched_stop, reason = matched, "stop"
            if r.stream and tail:
                ro.emit(r, "chunk", ro.chunk(r, tail, []))
        r.finish_reason = reason  # type: ignore[assignment]
        c = self.counters
        c.prompt_tokens += len(r.prompt_ids)
        c.cached_tokens += r.num_cached_prompt_tokens
        c.finished_requests += 1
        output = ro.build_output(r, reason, self.tokenizer)
        if r.stream:
            ro.emit(r, "chunk", ro.final_chunk(r, output))
        ro.emit(r, "done", output)

    # -- accounting --------------------------------------------------------------------------

    def owned_slots(self) -> list[torch.Tensor]:
        """Slots owned by running requests (not by the tree), for the integrity check."""
        return [self.kv.req_slots(r)[r.cached_len :] for r in self.running]


def _sync_only(r: Req) -> bool:
    return r.constraint is not None and PenaltyPool.needs(r.params)


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


def _record_scores(r: Req, first: int, lps: list[float], tops: list[list[tuple[float, int]]]) -> None:
    """File the logprobs of score rows starting at position `first` under the prompt or the
    outputs, by where each row's target token lies."""
    fill = r.fill_ids()
    P = len(r.prompt_ids)
    for j, lp in enumerate(lps):
        t = first + 1 + j  # the scored token's position
        top = tops[j] if tops else None
        if t < P:
            if t - max(r.logprob.logprob_start_len, 1) != len(r.prompt_logprobs):
                continue  # recomputed after a retraction: already recorded
            r.prompt_logprobs.append((lp, fill[t]))
            if top is not None:
                r.prompt_top_logprobs.append(top)
        elif t - P == len(r.output_logprobs) and t < len(fill):
            r.output_logprobs.append((lp, fill[t]))
            if top is not None:
                r.output_top_logprobs.append(top)
