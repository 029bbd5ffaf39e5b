"""Caller-side request plumbing of `sgl.Engine`: reading prompts, checking the timeout, and
the sink that carries engine-thread events back to the caller's event loop."""

from __future__ import annotations

import asyncio
import math
from typing import Any, Mapping, Sequence

from sgl.errors import InvalidRequestError

__all__ = ["split_prompts", "check_timeout", "is_ids", "is_messages", "make_sink"]


def split_prompts(prompt: Any, input_ids: Any) -> tuple[list[Any], bool]:
    """(prompts, single): one prompt (text, ids or chat messages) or a list of them."""
    if prompt is not None and input_ids is not None:
        raise InvalidRequestError("give either prompt or input_ids, not both", field="input_ids")
    if input_ids is not None:
        prompt = input_ids
    if prompt is None:
        raise InvalidRequestError("a prompt (text, token ids or chat messages) is required", field="prompt")
    if isinstance(prompt, str) or is_ids(prompt) or is_messages(prompt):
        return [prompt], True
    field = "input_ids" if input_ids is not None else "prompt"
    if isinstance(prompt, Sequence) and len(prompt) == 0:
        raise InvalidRequestError("the prompt is empty (an empty list)", field=field)
    if isinstance(prompt, Sequence) and any(isinstance(t, (int, float)) for t in prompt):
        i, bad = next((i, t) for i, t in enumerate(prompt) if isinstance(t, bool) or not isinstance(t, int))
        raise InvalidRequestError(f"token ids must be integers; got {bad!r} at position {i}", field=field)
    if isinstance(prompt, Sequence) and len(prompt) > 0:
        return list(prompt), False
    raise InvalidRequestError(f"cannot read a prompt from {type(prompt).__name__}: pass text, token "
                              "ids, chat messages, or a non-empty list of them", field="prompt")


def check_timeout(timeout: Any) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout) or timeout <= 0:
        raise InvalidRequestError(f"timeout={timeout!r}: must be a positive number of seconds (or None)",
                                  field="timeout")


def is_ids(x: Any) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, str) and len(x) > 0 and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def is_messages(x: Any) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, str) and len(x) > 0 and all(
        isinstance(m, Mapping) and "role" in m for m in x)


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
