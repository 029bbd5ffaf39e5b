"""EngineCore: the engine's own thread, running the plain or the overlap loop.

Callers on any thread (usually the facade's event loop) talk to the core through three
thread-safe methods: `submit(reqs)`, `abort(rid, reason)` and `shutdown()`. Results go back
through each request's `sink` callback, called in order on the core's event-delivery thread
while the engine thread computes (event_delivery.py; see sgl/engine.py).

Why a thread and not an asyncio task: the model step is long CPU or GPU work; torch releases
the GIL inside its kernels, so a thread keeps the caller's event loop responsive, while a task
would block it for a whole step (docs/benchmarks.md has the event-loop latency measured).

The plain loop is the step as three calls: `schedule()`, `runner.run(batch)`,
`scheduler.update(batch, out)`. The overlap loop (`disable_overlap_schedule=False`; the
default on CUDA) splits the run into launch and result::

    iteration k:  schedule(k) -> launch(k) -> update(k-1)     # CPU work of k-1 hides behind k

A request that finishes in step k-1 is already in step k; its extra token is discarded and
its slots are freed when k-1 is processed (safe: steps execute in order, and the slots are
handed out again only to a later step).

Grammar-constrained steps overlap too, though their masks need the previous token accepted:
step k is launched *deferred* (its forward goes to the device, its masks and sampling wait)::

    iteration k:  schedule(k) -> prepare(k) -> resume(k-1) -> start forward(k) -> update(k-1)
                  -> masks(k).start
    device:       ... sample(k-1) | forward(k) ...... | sample(k) (enqueued by resume(k))

so the mask fill of step k runs beside the scheduling and preparing of step k+1 and the
device's forward of step k. Step k+1 is prepared *before* step k's sampling is enqueued, so
its forward is enqueued right behind that sampling: preparing after resuming left the device
idle for the preparation after every sampling (measured at batch 256 on the H200: ~1.5 ms a
step). The period of a step is then about update + schedule + prepare on the host (all Python
on one thread) when that is longer than the forward. If `update(k-1)` jumps forward a request that step k is already sampling,
that sample is dropped (Scheduler._jump_forward): the jump owns what follows. Steps with
speculative drafts still run synchronously: a draft follows the previous token, which must be
known.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from sgl.backend.event_delivery import EventDelivery
from sgl.backend.model_runner import ModelRunner, PreparedStep
from sgl.backend.req import Req, ScheduleBatch
from sgl.backend.scheduler import Scheduler
from sgl.backend.step_io import StepHandle
from sgl.errors import EngineClosedError, EngineError

logger = logging.getLogger("sgl.engine")

# After this long with nothing to run, the runner frees its between-step caches (on the CPU the
# decode stage, up to the pool's size); an idle gap shorter than this keeps them.
IDLE_RELEASE_S = 2.0
# Finished requests are dropped from the loop's table of requests (kept for aborts by id) once
# every this many loop iterations.
PURGE_STEPS = 64


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, *, overlap: bool,
                 integrity_check: Callable[[], None] | None = None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.overlap = overlap
        self.integrity_check = integrity_check
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._reqs: dict[str, list[Req]] = {}  # rid -> its n samples (for abort)
        self._deadlines: set[Req] = set()  # unfinished requests with a timeout
        self._calls_to_purge = PURGE_STEPS
        self._stopping = False
        # Submissions pass this gate; the loop closes it before its last drain of the inbox, so
        # a request is either drained and ended, or refused here: never left unread (a hang).
        self._gate = threading.Lock()
        self._accepting = True
        self.fatal_error: BaseException | None = None
        self.num_steps = 0
        self.idle_release_s = IDLE_RELEASE_S
        self._idle_since: float | None = None  # when the loop last ran out of work
        self._delivery = EventDelivery()  # requests' sinks run there (event_delivery.py)
        self._thread = threading.Thread(target=self._main, name="sgl-engine", daemon=True)
        self._thread.start()

    # -- thread-safe API -----------------------------------------------------------------------

    def submit(self, reqs: list[Req]) -> None:
        with self._gate:
            if self._stopping or not self._accepting:
                if self.fatal_error is not None:
                    raise EngineClosedError(f"the engine stopped after a crash ({self.fatal_error!r}); "
                                            "create a new sgl.Engine") from self.fatal_error
                raise EngineClosedError("the engine is closed; create a new sgl.Engine")
            for r in reqs:
                r.sink = self._delivery.wrap(r.sink)
            self._inbox.put(("submit", reqs))

    def abort(self, rid: str, reason: str = "aborted by the caller") -> None:
        self._inbox.put(("abort", (rid, reason)))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps and return its result (e.g. flush)."""
        if threading.current_thread() is self._thread:  # already there (a nested call)
            return fn()
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed back to the caller
                box["error"] = exc
            done.set()

        self._inbox.put(("call", run))
        while not done.wait(0.05):
            if not self._thread.is_alive():
                raise EngineClosedError("the engine stopped before running the call")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._inbox.put(("stop", None))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.runner.close()
        if not self._thread.is_alive():  # no step can run any more
            self.runner.free_memory()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the loop -------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            (self._overlap_loop if self.overlap else self._plain_loop)()
        except BaseException as exc:  # a bug in the loop itself: fail everything, loudly
            logger.exception("sgl engine loop crashed")
            self.fatal_error = exc
        finally:
            reason = "the engine crashed" if self.fatal_error else "the engine was closed"
            try:
                self._abort_everything(reason, self.fatal_error)
            finally:
                self._delivery.close()  # after the last event: the abort of everything

    def _plain_loop(self) -> None:
        while self._drain_inbox(block=not self.scheduler.has_work):
            batch = self.scheduler.schedule()
            if batch is None:
                self._idle()
                continue
            self._update(batch, self._launch(batch))

    def _overlap_loop(self) -> None:
        prev: tuple[ScheduleBatch, StepHandle] | None = None  # launched, its update still to do
        while self._drain_inbox(block=not self.scheduler.has_work and prev is None):
            if prev is not None and (prev[0].has_drafts or self.scheduler.needs_sync):
                self._update(*prev)  # drafts need the previous tokens known
                prev = None
            batch = self.scheduler.schedule()
            # With a step in flight, this one's masks wait for that step's update. This step is
            # prepared first (host work, beside the device's forward of the step in flight);
            # then the step in flight, if deferred, gets its sampling enqueued (its masks were
            # filled beside this schedule and prepare), and this step's forward right behind
            # it, so the device does not wait for a preparation between the two.
            step = self._prepare(batch, defer_masks=prev is not None) if batch is not None else None
            if prev is not None:
                prev[1].resume()
            handle = self._start(batch, step) if batch is not None else None
            if prev is not None:
                self._update(*prev)
            if handle is not None:
                handle.start_masks()  # the matchers now hold every token before this step
            prev = (batch, handle) if batch is not None and handle is not None else None
            if prev is None and batch is None:
                self._idle()
        if prev is not None:
            self._update(*prev)

    def _launch(self, batch: ScheduleBatch) -> StepHandle:
        return self._start(batch, self._prepare(batch))

    def _prepare(self, batch: ScheduleBatch, defer_masks: bool = False) -> PreparedStep | StepHandle:
        """The runner's host half of a step, or a failed handle if preparing it failed."""
        self.num_steps += 1
        try:
            return self.runner.prepare(batch, defer_masks)
        except Exception as exc:  # preparing the step failed: fail only this batch
            return self._failed(batch, exc)

    def _start(self, batch: ScheduleBatch, step: PreparedStep | StepHandle) -> StepHandle:
        if isinstance(step, StepHandle):
            return step
        try:
            return self.runner.start(step)
        except Exception as exc:  # enqueueing it failed: fail only this batch
            return self._failed(batch, exc)

    def _failed(self, batch: ScheduleBatch, exc: Exception) -> StepHandle:
        # Its req_to_token writes never ran; some belong to requests outside this batch.
        self.scheduler.kv.requeue_table_writes(batch.table_writes)
        return StepHandle.failed(exc)

    def _update(self, batch: ScheduleBatch, handle: StepHandle) -> None:
        try:
            out = handle.result()
        except Exception as exc:  # the step failed: fail only its requests
            logger.error("model step failed; failing its %d requests: %r", len(batch.items), exc)
            self.scheduler.fail_step(batch, exc)
            return
        self.scheduler.update(batch, out)

    def _idle(self) -> None:
        if self._idle_since is None:
            self._idle_since = time.monotonic()
        if self.integrity_check is not None and not self.scheduler.running:
            self.integrity_check()

    def _still_idle(self) -> None:
        """Called when a blocking wait for work timed out."""
        if (self._idle_since is not None
                and time.monotonic() - self._idle_since >= self.idle_release_s):
            self.runner.release_idle_memory()
            self._idle_since = None  # once per idle spell

    def _drain_inbox(self, block: bool) -> bool:
        """Apply pending submissions and aborts. Returns False when the loop must stop."""
        if not block and self._inbox.empty():  # (most steps: no exception raised and caught)
            return self._check_deadlines()
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            if block:
                self._still_idle()
            return self._check_deadlines()
        self._idle_since = None
        while True:
            kind, payload = msg
            if kind == "stop":
                return False
            if kind == "submit":
                for r in payload:
                    self._reqs.setdefault(r.rid, []).append(r)
                    if r.deadline is not None:
                        self._deadlines.add(r)
                    self.scheduler.add(r)
            elif kind == "abort":
                rid, reason = payload
                for r in self._reqs.get(rid, ()):
                    self.scheduler.abort(r, reason)
            elif kind == "call":
                payload()
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
        return self._check_deadlines()

    def _check_deadlines(self) -> bool:
        # Finished requests leave the abort table every PURGE_STEPS calls (a scan of every
        # request on every step cost ~10 us at one request); deadlines are checked each call.
        self._calls_to_purge -= 1
        if self._calls_to_purge <= 0:
            self._calls_to_purge = PURGE_STEPS
            for rid in [rid for rid, reqs in self._reqs.items() if all(r.finished for r in reqs)]:
                del self._reqs[rid]
        if self._deadlines:
            now = time.monotonic()
            for r in [r for r in self._deadlines if r.finished or now > r.deadline]:  # type: ignore[operator]
                self._deadlines.discard(r)
                if not r.finished:
                    self.scheduler.abort(r, "request timed out (timeout option exceeded)")
        return True

    def _abort_everything(self, reason: str, cause: BaseException | None) -> None:
        with self._gate:
            self._accepting = False
        err = None if cause is None else EngineError(f"{reason}: {cause!r}")
        if err is not None:
            err.__cause__ = cause
        for reqs in list(self._reqs.values()):
            for r in reqs:
                self._fail(r, err, reason)
        self._reqs.clear()
        # Anything still in the inbox never reached the scheduler: fail it as well.
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                for r in payload:
                    self._fail(r, err, reason)
            elif kind == "call":
                payload()

    def _fail(self, r: Req, err: EngineError | None, reason: str) -> None:
        # (no error: the engine was closed, so the request ends with finish_reason "abort")
        self.scheduler.abort(r, reason, error=err)
