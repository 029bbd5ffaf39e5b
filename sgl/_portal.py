"""The private event loop behind `Engine.generate_sync` / `stream_sync`, and the exit hook
that closes engines a program left open.

A daemon thread runs one asyncio loop; sync callers start coroutines on it and wait. Two
properties the general-purpose portals (anyio's runs on a non-daemon worker) do not give:

- A script that never calls `close()` still exits: the thread is a daemon, and the engine's
  exit hook (sgl/engine.py) closes what is left.
- Ctrl-C while waiting cancels the coroutine (which aborts its request) and waits, briefly,
  until that cleanup ran, then re-raises the KeyboardInterrupt in the caller.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import weakref
from typing import Any, Awaitable, Callable, Generic, TypeVar

from sgl.errors import EngineClosedError

__all__ = ["LoopThread", "Job", "SyncPortal", "close_at_exit"]

T = TypeVar("T")
logger = logging.getLogger("sgl.engine")

# How long an interrupted caller waits for the cancelled coroutine's cleanup (an abort is a
# queue put, so this is only a bound for a misbehaving coroutine).
CANCEL_WAIT_S = 5.0


class Job(Generic[T]):
    """A coroutine running on a LoopThread, awaited from another thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.done = threading.Event()
        self._task: asyncio.Task[T] | None = None

    def _started(self, task: asyncio.Task[T]) -> None:
        self._task = task
        task.add_done_callback(lambda _t: self.done.set())

    def result(self) -> T:
        """Wait for the outcome; Ctrl-C (or any exception raised while waiting) cancels the
        coroutine, waits for its cleanup, and propagates."""
        try:
            self.done.wait()
        except BaseException:
            self.cancel()
            raise
        assert self._task is not None
        if self._task.cancelled():  # only LoopThread.close cancels without the caller asking
            raise EngineClosedError("the engine was closed while this call ran")
        return self._task.result()

    def cancel(self, wait: float = CANCEL_WAIT_S) -> None:
        """Cancel the coroutine and wait up to `wait` seconds for it to finish its cleanup."""
        if self.done.is_set():
            return
        try:
            # FIFO with the call that created the task, so the task exists when this runs.
            self._loop.call_soon_threadsafe(lambda: self._task is not None and self._task.cancel())
        except RuntimeError:  # the loop is closed: nothing is running any more
            return
        self.done.wait(wait)


class LoopThread:
    """An asyncio event loop on its own daemon thread."""

    def __init__(self, name: str = "sgl-sync") -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(ready,), name=name, daemon=True)
        self._thread.start()
        ready.wait()

    def _main(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(ready.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def start(self, factory: Callable[[], Awaitable[T]]) -> Job[T]:
        """Run `factory()` (a coroutine, created on the loop thread) as a task."""
        job: Job[T] = Job(self.loop)

        def create() -> None:
            job._started(self.loop.create_task(_wrap(factory)))

        self.loop.call_soon_threadsafe(create)
        return job

    def call(self, factory: Callable[[], Awaitable[T]]) -> T:
        """Run `factory()` on the loop and return its result (or raise its exception)."""
        return self.start(factory).result()

    def close(self, timeout: float = 10.0) -> None:
        """Cancel what still runs, stop the loop and (unless called from it) join the thread."""
        try:
            self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._stop()))
        except RuntimeError:  # already closed
            return
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    async def _stop(self) -> None:
        tasks = [t for t in asyncio.all_tasks(self.loop) if t is not asyncio.current_task()]
        if tasks:
            # The engine closed first and ended its requests ("abort"); give the callers' tasks
            # a moment to hand those outputs back before cancelling whatever still runs.
            await asyncio.wait(tasks, timeout=1.0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.loop.stop()


async def _wrap(factory: Callable[[], Awaitable[Any]]) -> Any:
    return await factory()


# -- closing engines the program left open --------------------------------------------------


class SyncPortal:
    """An engine's LoopThread, started by the first sync call; `close()` stops it for good."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._loop: LoopThread | None = None
        self._closed = False

    def get(self) -> LoopThread:
        with self._lock:
            if self._closed:  # a loop started now would never be closed
                raise EngineClosedError("the engine is closed; create a new sgl.Engine")
            if self._loop is None:
                self._loop = LoopThread(self._name)
            return self._loop

    def close(self) -> None:
        with self._lock:
            loop, self._loop, self._closed = self._loop, None, True
        if loop is not None:
            loop.close()


_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()  # objects whose close() the exit hook calls
_hook_registered = False


def close_at_exit(obj: Any, close_parts: Callable[[], None]) -> weakref.finalize:
    """Make sure an engine is closed: `obj.close()` at interpreter exit while it lives, or
    `close_parts()` (which must not reference `obj`) once it is garbage-collected unclosed.
    `obj.close()` should `detach()` the returned finalizer.

    Why: an engine's threads are daemons (so they never block exit), and Python kills daemon
    threads at finalization wherever they are; one inside torch's C++ code then aborts the
    process ("terminate called without an active exception", exit 134). Closing first stops
    them cleanly. atexit runs after the program's own non-daemon threads were joined, so an
    engine they still use is not closed under them.
    """
    global _hook_registered
    _OPEN.add(obj)
    finalizer = weakref.finalize(obj, _close_in_background, close_parts)
    finalizer.atexit = False  # at exit the hook below closes live engines, in a known order
    if not _hook_registered:
        # Registered on the first engine, after the backend imported torch: atexit runs hooks
        # last-in first-out, so this one runs before torch's own.
        atexit.register(_close_open)
        _hook_registered = True
    return finalizer


def _close_in_background(close_parts: Callable[[], None]) -> None:
    # A finalizer runs wherever the garbage collector happens to run, possibly inside the
    # engine's own step: close from a thread of its own instead.
    threading.Thread(target=close_parts, name="sgl-close", daemon=True).start()


def _close_open() -> None:
    for obj in list(_OPEN):
        try:
            obj.close()
        except Exception:  # noqa: BLE001 - exiting anyway; say what failed
            logger.exception("closing %r at interpreter exit failed", obj)
