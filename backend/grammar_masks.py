"""A step's grammar masks, filled on a thread while the step's forward runs.

    masks = grammar.fill_bitmasks_async(states, bitmask)   # runner.prepare, scheduler thread
    ...                                                     # the forward is launched / runs
    bitmask = masks.result()                                # runner, just before sampling

Why: the masks of step N+1 depend only on every matcher having accepted step N's tokens (the
scheduler's update), not on step N+1's forward. Filling them in `prepare` put the fill in
series with the forward: on the CPU the forward waited for it, on CUDA the device idled while
the host filled before launching. xgrammar's fill is C++ that releases the GIL, so one fill
thread runs it beside the forward (which itself releases the GIL in torch's kernels), and
xgrammar's `BatchGrammarMatcher` spreads the rows of a large batch over its own threads.

Cross-step overlap (the overlap loop, engine_loop.py): step N+1 is launched while step N is
still running, before its tokens are accepted. Its masks are then a `DeferredMaskFill`: the
states are listed in `prepare`, and the loop calls `start()` right after `update(N)`, so the
fill runs beside the scheduling of step N+2 and the device's forward of step N+1.

Safety: a fill is a write as far as threads go (xgrammar walks each matcher's parser forward
and back while it fills), so while a fill runs no other thread may touch its matchers: two
threads filling the same matchers at once segfault inside xgrammar within a few hundred tries.
The matchers change only in `Scheduler.update` (accepting tokens, jump-forward, rollback) and
in drafting, which runs only for synchronous steps (engine_loop.py). A fill starts after the
update before it and the next update waits for the step whose sampling waited for the fill.
A step whose forward fails before sampling may leave its fill running: its requests are
failed (no matcher is advanced again), and the next fill queues behind it on the same thread.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Callable

import torch

__all__ = ["DeferredMaskFill", "MaskFill"]


class MaskFill:
    """The [S, ceil(V/32)] int32 CPU bitmask of one step, being filled or already filled.
    `result()` is None when no row of the step is constrained (no mask to apply)."""

    def __init__(self, bitmask: torch.Tensor,
                 pending: concurrent.futures.Future[bool] | None = None,
                 constrained: bool = True) -> None:
        self.bitmask = bitmask
        self._pending = pending
        self._constrained = constrained

    @classmethod
    def start(cls, executor: concurrent.futures.Executor, fill: Callable[[], bool],
              bitmask: torch.Tensor) -> MaskFill:
        """Run `fill` (which writes `bitmask` and says whether any row is constrained) on
        `executor`."""
        return cls(bitmask, executor.submit(fill))

    @property
    def ready(self) -> bool:
        return self._pending is None or self._pending.done()

    def result(self, timeout: float | None = None) -> torch.Tensor | None:
        """Wait for the fill (re-raising its error) and return the mask, or None."""
        if self._pending is not None:
            self._constrained = self._pending.result(timeout)
            self._pending = None
        return self.bitmask if self._constrained else None


class DeferredMaskFill:
    """A step's masks whose fill may only start later (after the update before the step):
    `start()` begins it, once, on the thread that owns the matchers; `result()` waits for the
    start (from another thread: the CPU's device worker) and then for the fill."""

    def __init__(self, begin: Callable[[], MaskFill]) -> None:
        self._begin: Callable[[], MaskFill] | None = begin
        self._fill: MaskFill | None = None
        self._error: BaseException | None = None
        self._started = threading.Event()

    @property
    def started(self) -> bool:
        return self._started.is_set()

    def start(self) -> None:
        if self._begin is None:
            return
        begin, self._begin = self._begin, None
        try:
            self._fill = begin()
        except BaseException as exc:  # handed to whoever waits on result()
            self._error = exc
        self._started.set()

    def result(self, timeout: float | None = None) -> torch.Tensor | None:
        if not self._started.wait(timeout):
            raise TimeoutError("the step's grammar masks were never started")
        if self._error is not None:
            raise self._error
        assert self._fill is not None
        return self._fill.result(timeout)
