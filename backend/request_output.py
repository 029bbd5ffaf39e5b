"""What a request's progress means for its caller: text, stop decisions, and the events.

Helpers for `Scheduler.update`. They decide and build; the scheduler applies (appends
tokens, finishes requests, releases KV). The only state they advance is the request's own
incremental text (`detokenizer`, `stop_checker`), which exists to be fed in order.

Events reach a request's `sink(kind, payload)` in order (event_delivery.py): ("chunk", StreamChunk)
for streams, ("done", GenerateOutput) at the end, ("error", exception) when it failed.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from sgl.backend.req import Req
from sgl.outputs import GenerateOutput, Logprobs, StreamChunk, TokenLogprob, Usage

logger = logging.getLogger("sgl.engine")


@dataclass(frozen=True)
class TextStep:
    delta: str  # text released to the caller
    matched: str | None  # the stop string that ended it, if any


def attach_text_state(r: Req, tokenizer: Any) -> None:
    """Streams, stop strings and stop regexes need text as it grows; others are decoded once
    at the end."""
    if not (r.stream or r.params.stop or r.params.stop_regex):
        return
    from sgl.backend.detokenizer import IncrementalDetokenizer, StopChecker

    if tokenizer is not None:
        r.detokenizer = IncrementalDetokenizer(
            tokenizer, r.prompt_ids[-4:], skip_special_tokens=r.params.skip_special_tokens,
            spaces_between_special_tokens=r.params.spaces_between_special_tokens,
        )  # fmt: skip
    if r.params.stop:
        r.stop_checker = StopChecker(r.params.stop, r.params.no_stop_trim)
    if r.params.stop_regex:
        from sgl.backend.stop_regex import RegexStopChecker, StopChain

        regexes = RegexStopChecker(r.params.stop_regex, r.params.no_stop_trim)
        r.stop_checker = regexes if r.stop_checker is None else StopChain(r.stop_checker, regexes)


def next_text(r: Req, ids: list[int]) -> TextStep:
    """Feed new ids to the request's detokenizer and stop checker."""
    if r.detokenizer is None:
        return TextStep("", None)
    delta = r.detokenizer.push(ids)
    if r.stop_checker is None:
        return TextStep(delta, None)
    return TextStep(*r.stop_checker.feed(delta))


def is_stop_token(r: Req, tok: int, eos: frozenset[int]) -> bool:
    p = r.params
    return (tok in p.stop_token_ids or (tok in eos and not p.ignore_eos)) and (
        len(r.output_ids) >= p.min_new_tokens)


def at_length_limit(r: Req, context_length: int) -> bool:
    # Known tokens only: with the overlap loop a sample of the next step may be in flight.
    n = len(r.output_ids)
    return n >= r.params.max_new_tokens or len(r.prompt_ids) + n >= context_length


def final_text(r: Req, tokenizer: Any) -> tuple[str, str, str | None]:
    """(whole text, tail not yet streamed, a stop string or regex the tail completed)."""
    if r.detokenizer is not None:
        tail, matched = r.detokenizer.flush(), None
        if r.stop_checker is not None:
            # held-back text may complete a stop string: it goes through the checker too
            tail, matched = r.stop_checker.feed(tail)
            if matched is None:
                tail += r.stop_checker.flush()
                matched = r.stop_checker.matched  # a chain's flush may complete a regex
        return r.text + tail, tail, matched
    if tokenizer is None:
        return r.text, "", None
    ids = r.output_ids
    if isinstance(r.matched_stop, int) and ids and ids[-1] == r.matched_stop:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=r.params.skip_special_tokens), "", None


def build_output(r: Req, reason: str, tokenizer: Any) -> GenerateOutput:
    usage = Usage(prompt_tokens=len(r.prompt_ids), completion_tokens=len(r.output_ids),
                  cached_tokens=r.num_cached_prompt_tokens)
    return GenerateOutput(
        text=r.text, token_ids=list(r.output_ids), finish_reason=reason,  # type: ignore[arg-type]
        usage=usage, index=r.sample_index,
        logprobs=build_logprobs(r, tokenizer) if r.logprob.return_logprob else None,
        matched_stop=r.matched_stop, error=r.error if reason == "abort" else None, request_id=r.rid,
    )  # fmt: skip


def token_logprobs(tokenizer: Any, pairs: list[tuple[float, int]]) -> list[TokenLogprob]:
    return [TokenLogprob(int(t), float(v), token_text(tokenizer, int(t))) for v, t in pairs]


def build_logprobs(r: Req, tokenizer: Any) -> Logprobs:
    objs = lambda pairs: token_logprobs(tokenizer, pairs)  # noqa: E731
    lps = Logprobs(output=objs(r.output_logprobs), output_top=[objs(t) for t in r.output_top_logprobs])
    start = r.logprob.logprob_start_len
    if start >= 0:
        lps.prompt = objs(r.prompt_logprobs)
        lps.prompt_top = [objs(t) for t in r.prompt_top_logprobs]
        if start == 0 and r.prompt_ids:  # the first token has no logprob: keep lists aligned
            first = r.prompt_ids[0]
            lps.prompt.insert(0, TokenLogprob(first, math.nan, token_text(tokenizer, first)))
            if lps.prompt_top:
                lps.prompt_top.insert(0, [])
    return lps


def token_text(tokenizer: Any, tok: int) -> str | None:
    return None if tokenizer is None else tokenizer.decode([tok])  # the text it adds, not the BPE piece


def chunk(r: Req, text: str, ids: list[int], logprobs: list[TokenLogprob] | None = None) -> StreamChunk:
    return StreamChunk(text=text, token_ids=ids, index=r.sample_index, logprobs=logprobs)


def final_chunk(r: Req, output: GenerateOutput) -> StreamChunk:
    return StreamChunk(text="", token_ids=[], index=r.sample_index, finish_reason=output.finish_reason,
                       output=output)


def emit(r: Req, kind: str, payload: Any) -> None:
    if r.sink is None:
        return
    try:
        r.sink(kind, payload)
    except Exception:  # a broken consumer must not take the engine down
        logger.exception("output sink of request %s failed", r.rid)
