"""A step's grammar masks, filled on a thread while the step's forward runs.

    masks = grammar.fill_bitmasks_async(states, bitmask)   # runner._prepare, scheduler thread
    ...                                                     # the forward is launched / runs
    bitmask = masks.result()                                # runner, just before sampling

Why: the masks of step N+1 depend only on every matcher having accepted step N's tokens (the
scheduler's update), not on step N+1's forward. Filling them in `_prepare` put the fill in
series with the forward: on the CPU the forward waited for it, on CUDA the device idled while
the host filled before launching. xgrammar's fill is C++ that releases the GIL, so one fill
thread runs it beside the forward (which itself releases the GIL in torch's kernels), and
xgrammar's `BatchGrammarMatcher` spreads the rows of a large batch over its own threads.

Safety: the fill only reads the matchers; they change only in `Scheduler.update` (accepting
tokens, jump-forward, rollback), which runs after the step's result was waited for, and the
runner waits for the masks before sampling. A step whose forward fails before sampling may
leave its fill running: its requests are failed (no matcher is advanced again), and the next
fill queues behind it on the same thread.

What this does not do yet: fill step N+1's masks while step N+1's forward runs AND step N's
tokens are accepted meanwhile (cross-step overlap); constrained steps still run the loop
synchronously. docs/architecture.md ("Grammar masks and the overlap loop") has that design.
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable

import torch

__all__ = ["MaskFill"]


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
