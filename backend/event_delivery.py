"""Request events handed to their sinks by a thread of their own, not the engine thread.

A sink (sgl/_requests.py) wakes the caller's event loop with `call_soon_threadsafe`, whose
self-pipe write releases the GIL: the woken loop thread takes it and runs its callbacks (a
stream's consumer, up to its next await) while the engine thread waits to get the GIL back.
Called on the engine thread, that put ~0.15 ms per streamed token on the engine's critical
path (2-core CPU, single stream). Queued here instead, an event reaches its sink as soon as
the engine thread releases the GIL for a long stretch: during the model step (a C call or a
wait for the device), or while it waits for work. So the caller's handling overlaps the
step, and the events of all requests still arrive in the order they were emitted.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

logger = logging.getLogger("sgl.engine")

Sink = Callable[[str, Any], None]


class EventDelivery:
    """`wrap(sink)` returns a sink that queues; `close()` delivers what is queued, then stops."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Sink, str, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="sgl-events", daemon=True)
        self._thread.start()

    def wrap(self, sink: Sink | None) -> Sink | None:
        if sink is None:
            return None
        put = self._queue.put

        def queued(kind: str, payload: Any) -> None:
            put((sink, kind, payload))

        return queued

    def close(self, timeout: float = 30.0) -> None:
        """Deliver every queued event, then end the thread (the engine thread calls this last,
        once nothing can emit any more)."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            sink, kind, payload = item
            try:
                sink(kind, payload)
            except Exception:  # a broken consumer must not stop the delivery of the others
                logger.exception("a request's output sink failed")
