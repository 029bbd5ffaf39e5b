"""The scheduler's second half: applying a finished step's results (`Scheduler.update`).

Sampled tokens are appended (or drafts accepted), computed prompts cached, stop conditions,
grammar acceptance and jump-forward applied, text streamed, requests finished. This and
scheduler.py are the only places request status and KV bookkeeping change.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sgl.backend import request_output as ro
from sgl.backend.penalties import PenaltyPool
from sgl.backend.req import Req, ReqStatus, ScheduleBatch, ScheduledReq
from sgl.backend.speculative import accepted_len
from sgl.backend.step_io import StepOutput
from sgl.errors import EngineError

if TYPE_CHECKING:
    from typing import Any

    from sgl.backend.kv_manager import KVManager
    from sgl.backend.speculative import NgramDrafter


def sync_only(r: Req) -> bool:
    """Requests that keep the overlap loop synchronous: constrained ones with penalties (a
    sample dropped by a jump, see `_jump_forward`, would count as generated)."""
    return r.constraint is not None and PenaltyPool.needs(r.params)


class StepUpdate:
    """Mixed into `Scheduler` (scheduler.py), which owns the state these methods change."""

    if TYPE_CHECKING:  # the Scheduler's state read and written here
        cfg: Any
        kv: KVManager
        tokenizer: Any
        counters: Any
        drafter: NgramDrafter | None
        num_sync_only: int
        _dropped: set[int]

        def abort(self, r: Req, reason: str, error: BaseException | None = None) -> None: ...
        def _release(self, r: Req, cache: bool) -> None: ...

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
                samples = [out.sample(k + j) for j in range(rows)] if rows > 1 else [out.sample(k)]
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
        if r.detokenizer is None:  # (no stream, stop string or regex: decoded once at the end)
            return ""
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
        if sync_only(r):
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
