"""OutputProcessor: turns step results into request progress and events for the callers.

For every request of a finished step it appends the sampled token, records logprobs, advances
the grammar, checks the stop conditions (stop token, EOS, stop string, grammar end, length),
emits stream deltas, plans jump-forward, and finishes requests (their KV goes to the radix
cache). It runs on the engine thread only.

Events reach a request's `sink(kind, payload)`: ("chunk", StreamChunk) for streams,
("done", GenerateOutput) at the end, ("error", exception) when it failed.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from sgl.backend.req import Req, ReqStatus, ScheduleBatch
from sgl.errors import EngineError
from sgl.outputs import GenerateOutput, Logprobs, StreamChunk, TokenLogprob, Usage

logger = logging.getLogger("sgl.engine")


class OutputProcessor:
    def __init__(self, scheduler, tokenizer, eos_token_ids: tuple[int, ...], context_length: int,
                 grammar=None, jump_forward_default: bool = True) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.context_length = context_length
        self.grammar = grammar
        self.jump_forward_default = jump_forward_default
        self.num_constrained = 0  # active requests with a grammar (the overlap loop syncs then)
        # lifetime counters for stats()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self.finished_requests = 0
        self.jump_forward_tokens = 0
        self.recent: list[tuple[float, int]] = []  # (time, tokens) for tokens/s

    # -- lifecycle ---------------------------------------------------------------------------

    def on_submit(self, r: Req) -> None:
        if r.constraint is not None:
            self.num_constrained += 1
        if r.stream or r.params.stop:
            from sgl.backend.detokenizer import IncrementalDetokenizer, StopChecker

            if self.tokenizer is not None:
                r.detokenizer = IncrementalDetokenizer(
                    self.tokenizer,
                    r.prompt_ids[-4:],
                    skip_special_tokens=r.params.skip_special_tokens,
                    spaces_between_special_tokens=r.params.spaces_between_special_tokens,
                )
            if r.params.stop:
                r.stop_checker = StopChecker(r.params.stop, r.params.no_stop_trim)

    def abort(self, r: Req, reason: str) -> None:
        """Abort at once, even if a step in flight includes the request: steps run in order,
        so its freed slots are handed out only to later steps, and the in-flight result for a
        finished request is discarded."""
        if r.finished:
            return
        r.aborted = True
        r.error = reason
        self._finish(r, "abort")

    def fail(self, r: Req, exc: BaseException | None, reason: str) -> None:
        if r.finished:
            return
        r.error = reason
        self._finish(r, "abort", error=exc)

    # -- step results ------------------------------------------------------------------------

    def process(self, batch: ScheduleBatch, handle: Any) -> None:
        try:
            out = handle.result()
        except Exception as exc:
            logger.error("model step failed; failing its %d requests: %r", len(batch.items), exc)
            err = EngineError(f"model step failed: {exc!r}")
            err.__cause__ = exc
            for it in batch.items:
                it.req.pending_future = None
                self.fail(it.req, err, f"model step failed: {exc!r}")
            return
        k = p = 0
        kept = 0  # sampled tokens appended (not those discarded for already finished requests)
        now = time.monotonic()
        for it in batch.items:
            r = it.req
            tok = lp = top = None
            if it.samples:
                tok = out.next_token_ids[k]
                if out.next_logprobs is not None:
                    lp = out.next_logprobs[k]
                    top = out.next_top[k] if out.next_top is not None else None
                k += 1
                if r.pending_future == it.future_index:
                    r.pending_future = None
            count = it.prompt_logprob_span[1]
            if count and not r.finished:
                r.prompt_logprobs.extend(
                    zip(out.prompt_logprobs[p : p + count], r.prompt_ids[it.prompt_logprob_span[0] + 1 :])
                )
                if out.prompt_top:
                    r.prompt_top_logprobs.extend(out.prompt_top[p : p + count])
            p += count
            if r.finished:
                continue  # finished in the previous step; this extra token is discarded
            if r.aborted:
                self._finish(r, "abort")
                continue
            if r.status is ReqStatus.RUNNING and it.prefix_len < len(r.prompt_ids):
                self.scheduler.cache_prompt(r)
            if tok is None:
                if r.params.max_new_tokens == 0 and r.kv_len >= len(r.prompt_ids):
                    self._finish(r, "length")
                continue
            if r.first_token_at is None:
                r.first_token_at = now
            kept += 1
            self.output_tokens += 1  # before _append: a caller may read stats once it is done
            self._append(r, tok, lp, top)
        self.recent.append((now, kept))
        if len(self.recent) > 256:
            del self.recent[:128]

    def _append(self, r: Req, tok: int, lp: float | None, top) -> None:
        r.output_ids.append(tok)
        if lp is not None:
            r.output_logprobs.append((lp, tok))
            if top is not None:
                r.output_top_logprobs.append(top)
        p = r.params
        if r.constraint is not None and not r.constraint.accept_token(tok) and not r.constraint.is_terminated():
            # The mask forbids this token, so this is an engine bug, not the caller's: say so.
            r.error = f"grammar rejected sampled token {tok} (constrained decoding failed)"
            self._finish(r, "abort", error=EngineError(r.error))
            return
        stop_tok = (tok in p.stop_token_ids or (tok in self.eos and not p.ignore_eos)) and (
            len(r.output_ids) >= p.min_new_tokens)
        delta = "" if stop_tok else self._push_text(r, [tok])  # may finish on a stop string
        if r.finished:
            return
        if r.stream:  # every token is streamed, with whatever text it completed (maybe none)
            lps = self._lp_objs(r.output_logprobs[-1:]) if lp is not None else None
            self._emit(r, "chunk", StreamChunk(text=delta, token_ids=[tok], index=r.sample_index, logprobs=lps))
        if stop_tok:
            r.matched_stop = tok
            self._finish(r, "stop")
        elif r.constraint is not None and r.constraint.is_terminated():
            self._finish(r, "stop")
        elif self._at_length_limit(r):
            self._finish(r, "length")
        elif r.constraint is not None and r.jump_forward:
            self._jump_forward(r)

    def _push_text(self, r: Req, ids: list[int]) -> str:
        """Feed ids to the detokenizer and stop checker; finishes the request on a stop string."""
        if r.detokenizer is None:
            return ""
        delta = r.detokenizer.push(ids)
        if r.stop_checker is not None:
            delta, matched = r.stop_checker.feed(delta)
            if matched is not None:
                r.text += delta
                r.matched_stop = matched
                if r.stream and delta:
                    self._emit(r, "chunk", StreamChunk(text=delta, token_ids=ids, index=r.sample_index))
                self._finish(r, "stop", text_done=True)
                return ""
        r.text += delta
        return delta

    def _jump_forward(self, r: Req) -> None:
        plan = r.constraint.jump_forward(r.output_ids, max_new_tokens=r.params.max_new_tokens - len(r.output_ids))
        if plan is None or not plan.append_ids:
            return
        # Never cut into KV that belongs to the radix tree (only possible after a retraction).
        if len(r.prompt_ids) + len(r.output_ids) - plan.rollback < r.cached_len:
            return
        r.constraint.apply(plan)
        if plan.rollback:
            self.scheduler.rollback(r, plan.rollback)
            if r.detokenizer is not None:
                r.detokenizer.rollback(plan.rollback)
        r.output_ids.extend(plan.append_ids)
        self.jump_forward_tokens += len(plan.append_ids) - plan.rollback  # net tokens gained
        delta = self._push_text(r, plan.append_ids)
        if r.finished:
            return
        if r.constraint.is_terminated():
            self._finish(r, "stop")
        elif self._at_length_limit(r):
            self._finish(r, "length")
        elif r.stream:
            self._emit(r, "chunk", StreamChunk(text=delta, token_ids=list(plan.append_ids), index=r.sample_index))

    def _at_length_limit(self, r: Req) -> bool:
        # Known tokens only: with the overlap loop a sample of the next step may be in flight.
        n = len(r.output_ids)
        return n >= r.params.max_new_tokens or len(r.prompt_ids) + n >= self.context_length

    # -- finishing ---------------------------------------------------------------------------

    def _finish(self, r: Req, reason: str, error: BaseException | None = None, text_done: bool = False) -> None:
        if r.finished:
            return
        self.scheduler.finish(r, cache=error is None)
        r.status = ReqStatus.FINISHED
        r.finish_reason = reason
        if r.constraint is not None:
            self.num_constrained -= 1
        if error is not None:
            self._emit(r, "error", error)
            return
        text = r.text
        if r.detokenizer is not None and not text_done:
            tail = r.detokenizer.flush()
            if r.stop_checker is not None:
                # held-back text may complete a stop string: it goes through the checker too
                tail, matched = r.stop_checker.feed(tail)
                if matched is not None:
                    r.matched_stop, reason = matched, "stop"
                else:
                    tail += r.stop_checker.flush()
            text += tail
            if r.stream and tail:
                self._emit(r, "chunk", StreamChunk(text=tail, token_ids=[], index=r.sample_index))
        elif r.detokenizer is None and self.tokenizer is not None:
            ids = r.output_ids
            if isinstance(r.matched_stop, int) and ids and ids[-1] == r.matched_stop:
                ids = ids[:-1]
            text = self.tokenizer.decode(ids, skip_special_tokens=r.params.skip_special_tokens)
        r.text = text
        prompt_len = len(r.prompt_ids)
        usage = Usage(prompt_tokens=prompt_len, completion_tokens=len(r.output_ids),
                      cached_tokens=r.num_cached_prompt_tokens)
        self.prompt_tokens += prompt_len
        self.cached_tokens += r.num_cached_prompt_tokens
        self.finished_requests += 1
        output = GenerateOutput(
            text=text,
            token_ids=list(r.output_ids),
            finish_reason=reason,  # type: ignore[arg-type]
            usage=usage,
            index=r.sample_index,
            logprobs=self._logprobs(r) if r.logprob.return_logprob else None,
            matched_stop=r.matched_stop,
            error=r.error if reason == "abort" else None,
            request_id=r.rid,
        )
        if r.stream:
            self._emit(r, "chunk", StreamChunk(text="", token_ids=[], index=r.sample_index,
                                               finish_reason=output.finish_reason, output=output))
        self._emit(r, "done", output)

    def _logprobs(self, r: Req) -> Logprobs:
        lps = Logprobs(output=self._lp_objs(r.output_logprobs),
                       output_top=[self._lp_objs(t) for t in r.output_top_logprobs])
        start = r.logprob.logprob_start_len
        if start >= 0:
            prompt = self._lp_objs(r.prompt_logprobs)
            prompt_top = [self._lp_objs(t) for t in r.prompt_top_logprobs]
            if start == 0 and r.prompt_ids:  # the first token has no logprob: keep lists aligned
                prompt.insert(0, TokenLogprob(r.prompt_ids[0], math.nan, self._tok_text(r.prompt_ids[0])))
                if prompt_top:
                    prompt_top.insert(0, [])
            lps.prompt = prompt
            lps.prompt_top = prompt_top
        return lps

    def _lp_objs(self, pairs) -> list[TokenLogprob]:
        return [TokenLogprob(int(t), float(v), self._tok_text(int(t))) for v, t in pairs]

    def _tok_text(self, tok: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([tok])  # the text it adds, not the raw BPE piece

    @staticmethod
    def _emit(r: Req, kind: str, payload: Any) -> None:
        if r.sink is None:
            return
        try:
            r.sink(kind, payload)
        except Exception:  # a broken consumer must not take the engine down
            logger.exception("output sink of request %s failed", r.rid)
