"""Compiling constraints off the caller's thread, with a time limit and a cache bounded in bytes.

    compiler = ConstraintCompiler(xgr.GrammarCompiler(info, cache_enabled=False), json_indent=2)
    compiled = await compiler.compile_async("json_schema", text, timeout=10.0)  # loop runs on
    compiled = compiler.compile("regex", "[0-9]+")                            # blocks caller

Why a worker: compiling a hostile grammar takes seconds to minutes (a schema nested 700 deep:
83 s, 1.7 GB), and `Engine.generate` used to do it on the caller's event loop, freezing every
other request and the server's /health. xgrammar releases the GIL while it compiles, so a
thread is enough to keep the loop running. A thread cannot be killed, though: when a request
gives up (`timeout`) the compile finishes in the background and its result is cached. Hence
few workers (two: at most two hostile compiles burn CPU at once) and cheap front-line limits
(source size, schema depth: `sgl.constraints`) that turn most hostile grammars away before
they get here. A queued compile whose every waiter gave up is cancelled, so a flood of
distinct grammars cannot pile up work that nobody waits for. xgrammar objects cannot cross
process boundaries, so a process pool is not an option.

The cache: `(kind, spec) -> CompiledConstraint`, LRU, bounded by the grammars' own
`memory_size_bytes` (a 5,000-value enum compiles to ~27 MB; a small schema to 5-40 KB), not by
a count. Besides it, a weak map finds every grammar still in use by a request, so an evicted
grammar that is still alive is never compiled twice. Concurrent compiles of one spec share a
single job. Failures are not cached: a retry compiles again.

Thread safety: every public method may be called from any thread; the workers only touch the
job they run and, under the lock, the cache.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import re
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

import xgrammar as xgr

from sgl.backend.grammar_forcing import forced_text_bound
from sgl.backend.grammar_json import json_schema_grammar
from sgl.errors import InvalidConstraintError, RequestTimeoutError

__all__ = ["CompiledConstraint", "ConstraintCompiler", "ConstraintKind"]

ConstraintKind = Literal["regex", "json_schema", "ebnf"]
_WHAT = {"regex": "regex", "json_schema": "JSON schema", "ebnf": "EBNF grammar"}

# xgrammar prefixes its C++ errors with "[time] /path/file.cc:line: "; users need the rest.
_XGR_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")


@dataclass(frozen=True)
class CompiledConstraint:
    """A compiled grammar, shareable by every request with the same (kind, spec).

    `forced_bound` is how many bytes one parser stack frame can force (see grammar_forcing),
    or None when that is unbounded or unknown: jump-forward is then never tried, because
    xgrammar's forced-text walk could run forever.
    """

    kind: ConstraintKind
    spec: str
    grammar: xgr.CompiledGrammar
    forced_bound: int | None = None
    memory_bytes: int = 0


@dataclass(eq=False)
class _Job:
    key: tuple[str, str]
    future: concurrent.futures.Future[CompiledConstraint] = field(
        default_factory=concurrent.futures.Future)
    waiters: int = 1
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None


class ConstraintCompiler:
    """Compiles (kind, spec) pairs on `workers` daemon threads; see the module docstring."""

    def __init__(
        self,
        compiler: xgr.GrammarCompiler,
        *,
        json_indent: int | None = 2,
        cache_bytes: int = 256 << 20,
        workers: int = 2,
    ) -> None:
        self._compiler = compiler
        self.json_indent = json_indent
        self.cache_limit_bytes = cache_bytes
        self._workers = workers
        self._threads: list[threading.Thread] = []
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledConstraint] = OrderedDict()
        self._cache_bytes = 0
        self._live: weakref.WeakValueDictionary[tuple[str, str], CompiledConstraint] = (
            weakref.WeakValueDictionary())
        self._jobs: dict[tuple[str, str], _Job] = {}
        self.cache_hits = 0
        self.cache_misses = 0

    # -- public -------------------------------------------------------------------------------

    def compile(self, kind: str, spec: str, timeout: float | None = None) -> CompiledConstraint:
        """Compile on a worker and wait here (blocking); InvalidConstraintError if invalid."""
        found, job = self._lookup_or_submit(kind, spec)
        if found is not None:
            return found
        assert job is not None
        try:
            return job.future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise self._give_up(job, timeout) from None
        except BaseException:
            self._leave(job)
            raise

    async def compile_async(
        self, kind: str, spec: str, timeout: float | None = None
    ) -> CompiledConstraint:
        """Compile on a worker while the caller's event loop keeps running."""
        found, job = self._lookup_or_submit(kind, spec)
        if found is not None:
            return found
        assert job is not None
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def wake(_: object) -> None:
            try:
                loop.call_soon_threadsafe(_resolve, waiter)
            except RuntimeError:  # the loop closed meanwhile: nobody is waiting any more
                pass

        job.future.add_done_callback(wake)
        try:
            await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise self._give_up(job, timeout) from None
        except BaseException:  # cancelled by the caller
            self._leave(job)
            raise
        return job.future.result()  # raises the compile's InvalidConstraintError

    def lookup(self, kind: str, spec: str) -> CompiledConstraint | None:
        """The compiled constraint if it is cached or still in use, else None (no compile)."""
        with self._lock:
            return self._find((kind, spec))

    def clear_cache(self) -> None:
        """Forget every cached grammar (requests using one keep it until they finish)."""
        with self._lock:
            self._cache.clear()
            self._cache_bytes = 0

    @property
    def cache_bytes(self) -> int:
        """Bytes of compiled grammars the cache holds (xgrammar's `memory_size_bytes`)."""
        return self._cache_bytes

    @property
    def cache_entries(self) -> int:
        return len(self._cache)

    # -- jobs ---------------------------------------------------------------------------------

    def _lookup_or_submit(
        self, kind: str, spec: str
    ) -> tuple[CompiledConstraint | None, _Job | None]:
        if kind not in _WHAT:
            raise InvalidConstraintError(
                f"unknown constraint kind {kind!r}; expected regex, json_schema or ebnf", field=kind)
        if not isinstance(spec, str):
            raise InvalidConstraintError(
                f"{kind} must be a string, got {type(spec).__name__}", field=kind)
        key = (kind, spec)
        with self._lock:
            found = self._find(key)
            if found is not None:
                self.cache_hits += 1
                return found, None
            job = self._jobs.get(key)
            if job is not None:  # someone is compiling it already: share the result
                job.waiters += 1
                self.cache_hits += 1
                return None, job
            self.cache_misses += 1
            job = self._jobs[key] = _Job(key)
            if len(self._threads) < self._workers:
                thread = threading.Thread(target=self._work, name="sgl-grammar-compile",
                                          daemon=True)  # never keeps a script from exiting
                self._threads.append(thread)
                thread.start()
        self._queue.put(job)
        return None, job

    def _find(self, key: tuple[str, str]) -> CompiledConstraint | None:
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            return found
        found = self._live.get(key)
        if found is not None:
            self._store(found)  # in use again: worth keeping
        return found

    def _leave(self, job: _Job) -> bool:
        """One waiter stops waiting; cancel the job if it had not started and nobody is left.
        Returns whether the compile had started."""
        with self._lock:
            job.waiters -= 1
            if job.waiters <= 0 and job.future.cancel():
                self._jobs.pop(job.key, None)
            return job.started_at is not None

    def _give_up(self, job: _Job, timeout: float | None) -> Exception:
        started = self._leave(job)
        waited = (job.started_at or time.monotonic()) - job.queued_at
        kind = job.key[0]
        if not started:
            return RequestTimeoutError(
                f"the grammar compiler was busy with other grammars for {waited:.1f} s, past "
                f"grammar_compile_timeout={timeout:g} s; retry later")
        return InvalidConstraintError(
            f"grammar compilation took longer than grammar_compile_timeout={timeout:g} s "
            f"({waited:.1f} s of it waiting for a free compile worker): simplify the "
            f"{_WHAT[kind]} or raise grammar_compile_timeout. It keeps compiling in the "
            f"background and is cached if it finishes", field=kind)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if not job.future.set_running_or_notify_cancel():
                continue  # every waiter gave up before it started
            job.started_at = time.monotonic()
            try:
                compiled = self._compile_uncached(*job.key)
            except BaseException as exc:
                with self._lock:
                    self._jobs.pop(job.key, None)
                job.future.set_exception(exc)
                continue
            with self._lock:  # one step, so no request starts a second compile in between
                self._jobs.pop(job.key, None)
                self._live[job.key] = compiled
                self._store(compiled)
            job.future.set_result(compiled)

    # -- cache --------------------------------------------------------------------------------

    def _store(self, compiled: CompiledConstraint) -> None:
        """Insert or refresh under the lock; evict least recently used past the byte limit."""
        key = (compiled.kind, compiled.spec)
        if key in self._cache:
            self._cache.move_to_end(key)
            return
        if compiled.memory_bytes > self.cache_limit_bytes:
            return  # larger than the whole cache: its requests keep it alive while they run
        self._cache[key] = compiled
        self._cache_bytes += compiled.memory_bytes
        while self._cache_bytes > self.cache_limit_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= evicted.memory_bytes

    # -- xgrammar -----------------------------------------------------------------------------

    def _compile_uncached(self, kind: str, spec: str) -> CompiledConstraint:
        try:
            if kind == "regex":
                grammar = xgr.Grammar.from_regex(spec)
            elif kind == "json_schema":
                # xgrammar's converter, with its string rules made strict (grammar_json.py)
                grammar = json_schema_grammar(spec, indent=self.json_indent)
            else:
                grammar = xgr.Grammar.from_ebnf(spec)
            compiled = self._compiler.compile_grammar(grammar)
        except Exception as exc:  # RuntimeError / ValueError / xgr.InvalidJSONError
            reason = _XGR_PREFIX.sub("", str(exc)).strip().splitlines()[0] if str(exc) else ""
            raise InvalidConstraintError(
                f"invalid {_WHAT[kind]}: {reason or type(exc).__name__}. Spec: {_preview(spec)}",
                field=kind,
            ) from exc
        size = int(compiled.memory_size_bytes) + len(spec)
        bound = forced_text_bound(grammar)
        return CompiledConstraint(kind, spec, compiled, bound, size)  # type: ignore[arg-type]


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _preview(text: str, limit: int = 120) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
