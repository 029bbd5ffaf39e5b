"""The generation driver: runs the prompts of one HTTP request on the engine and measures them.

Both protocols describe a request as a list of `Job`s (one per prompt). Every job runs as an
`engine.stream`, also for non-streaming requests, so that time to first token and inter-token
latency are measured for all traffic, and there is one code path to abort. Outputs are
addressed by *slot* = (prompt index) * n + (sample index), the order both APIs return them in.

Two engine behaviours shape this module:
- `engine.stream` validates on its first step: the caller primes the iterator before it sends
  HTTP headers, so a bad request still gets a 4xx (see `prime`).
- With a constraint, a text that does not validate (e.g. JSON cut off by max_tokens) is still
  an ordinary output with its finish_reason; only reading `output.parsed` would raise.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.responses import Response

from sgl.outputs import GenerateOutput, StreamChunk
from sgl.sampling import LogprobOptions

from sgl.backend.server.metrics import Metrics

if TYPE_CHECKING:
    from sgl.backend.server.protocol import ApiError

__all__ = ["Job", "Driver", "ClientGone", "run_or_abort"]

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected; its request was aborted."""


@dataclass
class Job:
    prompt: Any  # text, token ids or chat messages
    params: dict[str, Any]  # engine sampling kwargs (SGLang names)
    logprob: LogprobOptions = field(default_factory=LogprobOptions)
    timeout: float | None = None

    @property
    def n(self) -> int:
        return int(self.params.get("n", 1) or 1)


@dataclass
class _Timing:
    start: float
    last: float | None = None
    emitted: int = 0  # characters of text already handed out


class Driver:
    def __init__(self, engine: Any, metrics: Metrics) -> None:
        self.engine, self.metrics = engine, metrics

    def stream(self, jobs: list[Job], start: float | None = None) -> AsyncIterator[tuple[int, StreamChunk]]:
        """(slot, chunk) pairs of every sample of every job; each slot ends with a chunk
        carrying `finish_reason` and the full `output`."""
        start = time.monotonic() if start is None else start
        parts: list[tuple[int, Job]] = []
        base = 0
        for job in jobs:
            parts.append((base, job))
            base += job.n
        streams = [self._one(slot, job, start) for slot, job in parts]
        return streams[0] if len(streams) == 1 else _merge(streams)

    async def run(self, jobs: list[Job]) -> list[GenerateOutput]:
        """Every output of every job, in slot order (no streaming to the client)."""
        finals: dict[int, GenerateOutput] = {}
        async for slot, chunk in self.stream(jobs):
            if chunk.output is not None:
                finals[slot] = chunk.output
        return [finals[i] for i in sorted(finals)]

    async def _one(self, base: int, job: Job, start: float) -> AsyncIterator[tuple[int, StreamChunk]]:
        timing: dict[int, _Timing] = {}
        lp = job.logprob
        agen = self.engine.stream(job.prompt, **job.params, return_logprob=lp.return_logprob,
                                  logprob_start_len=lp.logprob_start_len,
                                  top_logprobs_num=lp.top_logprobs_num, timeout=job.timeout)
        try:
            while True:
                try:
                    chunk = await agen.__anext__()
                except StopAsyncIteration:
                    return
                self._observe(timing.setdefault(chunk.index, _Timing(start)), chunk)
                yield base + chunk.index, chunk
        finally:
            await agen.aclose()

    def _observe(self, t: _Timing, chunk: StreamChunk) -> None:
        now = time.monotonic()
        t.emitted += len(chunk.text)
        if chunk.token_ids:
            if t.last is None:
                self.metrics.ttft.observe(now - t.start)
            else:
                self.metrics.itl.observe(now - t.last)
            t.last = now
        out = chunk.output
        if out is not None:
            self.metrics.e2e.observe(now - t.start)
            self.metrics.count_output(out.usage.prompt_tokens, out.usage.completion_tokens,
                                      out.usage.cached_tokens, aborted=out.finish_reason == "abort")


async def _merge(streams: list[AsyncIterator[tuple[int, StreamChunk]]]
                 ) -> AsyncIterator[tuple[int, StreamChunk]]:
    """Interleave several streams as their chunks arrive; closing this closes all of them."""
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    async def pump(s: AsyncIterator[tuple[int, StreamChunk]]) -> None:
        try:
            async for item in s:
                await queue.put(("item", item))
            await queue.put(("end", None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(("error", exc))

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    remaining = len(tasks)
    try:
        while remaining:
            kind, payload = await queue.get()
            if kind == "error":
                raise payload
            if kind == "end":
                remaining -= 1
            else:
                yield payload
    finally:
        for task in tasks:  # cancelling a pump closes its engine stream, which aborts it
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    # After the body has been read, the server's next message is the disconnect (uvicorn).
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_or_abort(receive: Callable[[], Awaitable[dict[str, Any]]], work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first; then cancel it (which aborts the
    engine requests and frees their KV) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientGone()
    finally:
        watcher.cancel()
        task.cancel()


def failed_before_start(exc: Exception, metrics: Metrics, route: str,
                        to_error: Callable[[Exception], ApiError]) -> Response:
    """Answer, and count, a request that failed before its first byte was sent: 499 when the
    client went away, else `to_error(exc)` as JSON (4xx counted invalid, 5xx an error)."""
    if isinstance(exc, ClientGone):
        metrics.count_request(route, "disconnected")
        return Response(status_code=499)
    err = to_error(exc)
    metrics.count_request(route, "invalid" if err.status < 500 else "error")
    return err.response()
