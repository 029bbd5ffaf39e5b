"""Where program states execute when the caller has no event loop: one background loop thread.

Every program state belongs to one event loop. `await f.arun()` uses the caller's loop; sync
entry points (`f.run()`, `run_batch`) use a single daemon thread running its own loop, started
on first use. Sync program bodies run in ordinary threads and talk to the loop through
`run_blocking` (which refuses to block the loop's own thread instead of deadlocking, and
cancels what it waited for when the wait is interrupted, e.g. by Ctrl-C).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Coroutine, TypeVar

__all__ = ["background_loop", "run_blocking", "result_or_cancel", "run_on", "on_loop_thread"]

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def background_loop() -> asyncio.AbstractEventLoop:
    """The shared loop for sync callers, started on first use (a daemon thread)."""
    global _loop, _thread
    with _lock:
        if _loop is None or _loop.is_closed() or _thread is None or not _thread.is_alive():
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def main() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            thread = threading.Thread(target=main, name="sgl-lang-loop", daemon=True)
            thread.start()
            ready.wait()
            _loop, _thread = loop, thread
        return _loop


def _loop_thread_of(loop: asyncio.AbstractEventLoop) -> int | None:
    return getattr(loop, "_thread_id", None)  # set by asyncio while the loop runs


def on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    return _loop_thread_of(loop) == threading.get_ident()


def run_blocking(coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop,
                 timeout: float | None = None) -> T:
    """Run `coro` on `loop` from another thread and wait for its result."""
    if on_loop_thread(loop):
        coro.close()
        raise RuntimeError(
            "this call would block the event loop that runs the program; in async code use "
            "the awaitable form (await s.aget(name), await s.atext(), await f.arun(...))"
        )
    return result_or_cancel(asyncio.run_coroutine_threadsafe(coro, loop), timeout)


def result_or_cancel(fut: concurrent.futures.Future[T], timeout: float | None = None) -> T:
    """Wait for a coroutine started on another loop; if the wait itself ends early (Ctrl-C,
    a timeout), cancel the coroutine rather than leave it running for nobody."""
    try:
        return fut.result(timeout)
    except BaseException:
        fut.cancel()  # a no-op when the coroutine itself raised
        raise


async def run_on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """Await `coro` on `loop`, from whichever loop the caller runs on."""
    try:
        current = asyncio.get_running_loop()
    except RuntimeError:  # pragma: no cover - only called from coroutines
        current = None
    if current is loop:
        return await coro
    fut: Awaitable[T] = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))
    return await fut
