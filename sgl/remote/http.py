"""HTTP plumbing shared by the remote backends: per-event-loop clients, SSE, error mapping.

An httpx.AsyncClient belongs to the event loop it first ran on, and programs run on several
loops (the caller's for `arun`, a background thread's for `run`), so each backend keeps one
client per loop.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from typing import Any, AsyncIterator, Callable, Generic, TypeVar

from sgl.errors import (
    ContextLengthError,
    EngineError,
    InvalidConfigError,
    InvalidRequestError,
    RequestTimeoutError,
    SglError,
)

__all__ = ["PerLoop", "raise_for_status", "sse_events", "remote_error"]

C = TypeVar("C")


class PerLoop(Generic[C]):
    """One client per running event loop, created by `factory` on first use."""

    def __init__(self, factory: Callable[[], C]) -> None:
        self._factory = factory
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, C] = weakref.WeakKeyDictionary()

    def get(self) -> C:
        loop = asyncio.get_running_loop()
        client = self._by_loop.get(loop)
        if client is None:
            client = self._by_loop[loop] = self._factory()
        return client

    async def aclose(self) -> None:
        """Close the current loop's client (the others close with their loops)."""
        client = self._by_loop.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()  # type: ignore[attr-defined]


def remote_error(status: int, body: Any, url: str) -> SglError:
    """An sgl exception for an HTTP error answer, keeping the server's message and field."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        message, param, code = str(err.get("message")), err.get("param"), err.get("code")
    else:
        message, param, code = (str(err) if err else str(body)[:500]), None, None
    where = f"{url} answered {status}: {message}"
    if status in (401, 403):
        return InvalidConfigError(f"{where} (check api_key)")
    if status == 504:
        return RequestTimeoutError(where)
    if 400 <= status < 500:
        cls = ContextLengthError if code == "context_length_exceeded" else InvalidRequestError
        return cls(where, field=param)
    return EngineError(where)


def raise_for_status(response: Any) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        body = response.text
    raise remote_error(response.status_code, body, str(response.url))


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """JSON payloads of `data: ...` lines until `data: [DONE]`; an in-band error raises."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if isinstance(event, dict) and "error" in event and "text" not in event:
            raise remote_error(500, event, "stream")
        yield event
