"""Caller-side request plumbing of `sgl.Engine`: reading prompts, checking argument names, the
timeout and the engine's request limits, and the sink that carries engine-thread events back
to the caller's event loop. Everything here raises before a request is queued."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from sgl._regex_bound import max_regex_bytes
from sgl.errors import ContextLengthError, InvalidRequestError, InvalidSamplingParamsError
from sgl.sampling import LogprobOptions, SamplingParams, suggest_name

if TYPE_CHECKING:
    from sgl.config import EngineConfig

__all__ = ["split_prompts", "check_timeout", "check_flag", "check_kwarg_names", "check_limits",
           "check_min_tokens", "check_lengths", "is_ids", "is_messages", "make_sink"]

# generate()'s own keyword arguments: named in "did you mean" hints for unknown ones.
GENERATE_ARGS = ("input_ids", "return_logprob", "logprob_start_len", "top_logprobs_num", "timeout",
                 "stream")


def split_prompts(prompt: Any, input_ids: Any) -> tuple[list[Any], bool]:
    """(prompts, single): one prompt (text, ids or chat messages) or a list of them."""
    if prompt is not None and input_ids is not None:
        raise InvalidRequestError("give either prompt or input_ids, not both", field="input_ids")
    if input_ids is not None:
        return _split_ids(input_ids)
    if prompt is None:
        raise InvalidRequestError("a prompt (text, token ids or chat messages) is required", field="prompt")
    _refuse_bytes(prompt, "prompt")
    if isinstance(prompt, str) or is_ids(prompt) or is_messages(prompt):
        return [prompt], True
    if not isinstance(prompt, Sequence):
        raise InvalidRequestError(f"cannot read a prompt from {type(prompt).__name__}: pass text, token "
                                  "ids, chat messages, or a non-empty list of them", field="prompt")
    if len(prompt) == 0:
        raise InvalidRequestError("the prompt is empty (an empty list)", field="prompt")
    if all(isinstance(t, (int, float)) for t in prompt):  # token ids, one of them not an int
        _check_ids(prompt, "prompt")
    for i, item in enumerate(prompt):  # a batch: each item is one prompt
        _refuse_bytes(item, f"prompt[{i}]")
        if not (isinstance(item, str) or is_messages(item) or _is_list(item)):
            raise InvalidRequestError(f"prompt[{i}] is {_short(item)}: each prompt of a list must be text, "
                                      "a list of token ids or a list of chat messages", field="prompt")
        if _is_list(item) and any(isinstance(t, (int, float)) for t in item):
            _check_ids(item, f"prompt[{i}]")
    return list(prompt), False


def _split_ids(input_ids: Any) -> tuple[list[Any], bool]:
    """input_ids: a list of ints (one prompt) or a list of such lists (a batch)."""
    _refuse_bytes(input_ids, "input_ids")
    if not _is_list(input_ids):
        raise InvalidRequestError(f"input_ids must be a list of token ids (or a list of such lists), not "
                                  f"{type(input_ids).__name__}", field="input_ids")
    if len(input_ids) == 0:
        raise InvalidRequestError("input_ids is empty", field="input_ids")
    if not any(_is_list(x) for x in input_ids):
        _check_ids(input_ids, "input_ids")
        return [input_ids], True
    for i, ids in enumerate(input_ids):
        if not _is_list(ids):
            raise InvalidRequestError(f"input_ids[{i}] is {_short(ids)}: a batch of input_ids is a list of "
                                      "lists of token ids", field="input_ids")
        if len(ids) == 0:
            raise InvalidRequestError(f"input_ids[{i}] is empty", field="input_ids")
        _check_ids(ids, f"input_ids[{i}]")
    return list(input_ids), False


def _check_ids(ids: Sequence[Any], where: str) -> None:
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            field = "input_ids" if where.startswith("input_ids") else "prompt"
            raise InvalidRequestError(f"token ids must be integers; got {_short(t)} at position {i} of "
                                      f"{where}", field=field)


def _refuse_bytes(value: Any, where: str) -> None:
    # bytes are a Sequence of ints: without this check b"Hi" would be read as token ids 72, 105.
    if isinstance(value, (bytes, bytearray, memoryview)):
        field = "input_ids" if where.startswith("input_ids") else "prompt"
        raise InvalidRequestError(f"{where} is {type(value).__name__}: decode it to str first (e.g. "
                                  "data.decode('utf-8')), or pass token ids as a list of ints", field=field)


def _is_list(x: Any) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, (str, bytes, bytearray, memoryview))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_timeout(timeout: Any) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout) or timeout <= 0:
        raise InvalidRequestError(f"timeout={timeout!r}: must be a positive number of seconds (or None)",
                                  field="timeout")


def check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name}={_short(value)}: must be True or False", field=name)


def check_kwarg_names(kwargs: Mapping[str, Any], constraint_keys: Iterable[str]) -> None:
    """Refuse a keyword argument generate() does not take, suggesting the name it resembles."""
    known = SamplingParams.field_names() | set(constraint_keys)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        name = unknown[0]
        raise InvalidSamplingParamsError(
            f"unknown argument(s) {unknown}{suggest_name(name, known | set(GENERATE_ARGS))}; generate() "
            f"takes the sampling parameters {sorted(SamplingParams.field_names())}, the constraints "
            f"{sorted(constraint_keys)} and {list(GENERATE_ARGS)}", field=name)


def check_limits(params: SamplingParams, lp: LogprobOptions, config: EngineConfig) -> None:
    """The engine's per-request bounds (EngineConfig "request limits"), each naming its option."""

    def over(field: str, found: str, value: int, option: str) -> None:
        limit = getattr(config, option)
        if value > limit:
            raise InvalidSamplingParamsError(
                f"{found}, above this engine's limit ({option}={limit}); lower it, or start the engine "
                f"with a higher {option} (sgl.Engine({option}=...) or `sgl serve "
                f"--{option.replace('_', '-')}`)", field=field)

    over("n", f"n={params.n}", params.n, "max_n")
    over("top_logprobs_num", f"top_logprobs_num={lp.top_logprobs_num}", lp.top_logprobs_num,
         "max_top_logprobs_num")
    over("stop", f"stop has {len(params.stop)} strings", len(params.stop), "max_stop_strings")
    longest = max((len(s) for s in params.stop), default=0)
    over("stop", f"a stop string has {longest} characters", longest, "max_stop_string_len")
    over("stop_token_ids", f"stop_token_ids has {len(params.stop_token_ids)} ids",
         len(params.stop_token_ids), "max_stop_token_ids")
    over("stop_regex", f"stop_regex has {len(params.stop_regex)} patterns", len(params.stop_regex),
         "max_stop_regexes")
    longest = max((len(s) for s in params.stop_regex), default=0)
    over("stop_regex", f"a stop regex has {longest} characters", longest, "max_stop_regex_len")


def check_vocab(params: SamplingParams, vocab: int) -> None:
    """Token ids the sampling parameters name must exist in the model's vocabulary."""
    bad_stop = [t for t in params.stop_token_ids if t >= vocab]
    if bad_stop:
        raise InvalidSamplingParamsError(f"stop_token_ids {bad_stop[:5]} are outside the vocabulary "
                                         f"[0, {vocab})", field="stop_token_ids")
    bad_bias = sorted(t for t in params.logit_bias or () if t >= vocab)
    if bad_bias:
        raise InvalidSamplingParamsError(f"logit_bias names token ids {bad_bias[:5]} outside the vocabulary "
                                         f"[0, {vocab})", field="logit_bias")


def check_min_tokens(params: SamplingParams, kind: str, spec: str, source: str) -> None:
    """Refuse a min_new_tokens that a regex constraint can never reach (it would end first,
    and min_new_tokens forbids ending: the request could only fail on the engine thread)."""
    if params.min_new_tokens == 0 or kind != "regex":
        return
    most = max_regex_bytes(spec)
    if most is not None and params.min_new_tokens > most:
        raise InvalidSamplingParamsError(
            f"min_new_tokens={params.min_new_tokens} can never be reached: the constraint ({source[:80]}) "
            f"matches at most {int(most)} bytes, so its text ends within {int(most)} tokens; lower "
            f"min_new_tokens to at most {int(most)}, or loosen the constraint", field="min_new_tokens")


def check_lengths(prompt_len: int, params: SamplingParams, lp: LogprobOptions, context: int,
                  pool: int) -> None:
    """The prompt and max_new_tokens against the context window and the KV pool."""
    if prompt_len >= context:
        raise ContextLengthError(f"the prompt has {prompt_len} tokens; the context window is {context}: "
                                 f"shorten it to at most {context - 1} tokens", field="prompt")
    if prompt_len + params.max_new_tokens > context:
        raise ContextLengthError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
            f"context window of {context}; lower max_new_tokens to at most {context - prompt_len}",
            field="max_new_tokens")
    if prompt_len + params.max_new_tokens > pool:
        raise ContextLengthError(
            f"prompt + max_new_tokens ({prompt_len + params.max_new_tokens} tokens) exceeds the KV "
            f"pool ({pool} tokens); raise max_total_tokens or shorten the request", field="max_new_tokens")
    if lp.logprob_start_len >= prompt_len:
        raise InvalidRequestError(f"logprob_start_len={lp.logprob_start_len} is beyond the prompt "
                                  f"({prompt_len} tokens)", field="logprob_start_len")


def is_ids(x: Any) -> bool:
    return _is_list(x) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def is_messages(x: Any) -> bool:
    """A list of chat messages (dicts); their roles and contents are checked by sgl._chat."""
    return _is_list(x) and len(x) > 0 and all(isinstance(m, Mapping) for m in x)


def make_sink(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, q: asyncio.Queue | None):
    """A callback for the engine thread that hands events to the caller's event loop."""

    def deliver(kind: str, payload: Any) -> None:
        if kind == "chunk":
            if q is not None:
                q.put_nowait(("chunk", payload))
            return
        if kind == "error":
            if q is not None:
                q.put_nowait(("error", payload))
            if not fut.done():
                fut.set_exception(payload)
                fut.exception()  # mark retrieved: a stream may never await this future
            return
        if not fut.done():
            fut.set_result(payload)

    def sink(kind: str, payload: Any) -> None:
        try:
            loop.call_soon_threadsafe(deliver, kind, payload)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    return sink
