"""SglFunction: a decorated program, and how it runs.

    f.run(...)            sync: the body runs in the calling thread (a sync body) or on the
                          background loop (an async body); returns the finished state.
    await f.arun(...)     async: the state lives on the caller's loop; a sync body runs in a
                          worker thread, an async body runs as a coroutine (no thread).
    f.run_batch([...])    many programs; per-program errors are kept in state.error().
    await f.arun_batch()  the same, awaited.

Errors: `run`/`arun` raise `sgl.errors.ProgramError` when the body or one of its gens fails;
`__cause__` is the original exception with the program's traceback, `.state` the state.
`run_batch`/`arun_batch` do not raise for a failed program (SGLang semantics): check
`state.error()`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import os
import threading
from typing import Any, Callable, Sequence

from sgl.errors import InvalidRequestError, ProgramError
from sgl.lang import context
from sgl.lang.interpreter import StreamExecutor
from sgl.lang.loop import background_loop, on_loop_thread, result_or_cancel, run_blocking
from sgl.lang.ops import End
from sgl.lang.params import RUN_DEFAULTS
from sgl.lang.state import ProgramState

__all__ = ["SglFunction"]

_SAMPLING_ARGS = tuple(RUN_DEFAULTS)


class SglFunction:
    def __init__(self, func: Callable[..., Any], num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        self.is_async = inspect.iscoroutinefunction(func)
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError(f"program {func.__name__} must take the state as its first parameter")
        self.arg_names = [p.name for p in params[1:]]
        self.arg_defaults = [p.default for p in params[1:] if p.default is not p.empty]
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> SglFunction:
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.__name__} has no argument(s) {unknown}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    # -- single program -------------------------------------------------------------------

    def run(self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any) -> ProgramState:
        defaults, kwargs = _split_sampling(kwargs)
        loop = background_loop()
        if on_loop_thread(loop):
            raise RuntimeError("f.run() called from inside a program; use `await f.arun()`")
        state = self._new_state(backend, loop, kwargs, defaults, stream)
        body = self._start_body(state, args, kwargs)
        if stream:
            return state
        try:
            body()
        except KeyboardInterrupt:  # Ctrl-C: stop the program's gens, then let it propagate
            _interrupt(state.stream_executor)
            raise
        self._raise_if_failed(state)
        return state

    async def arun(self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any
                   ) -> ProgramState:
        defaults, kwargs = _split_sampling(kwargs)
        state = self._new_state(backend, asyncio.get_running_loop(), kwargs, defaults, stream)
        task = asyncio.ensure_future(self._run_async(state, args, kwargs))
        if stream:
            return state
        await task
        self._raise_if_failed(state)
        return state

    def _new_state(self, backend: Any, loop: asyncio.AbstractEventLoop, kwargs: dict[str, Any],
                   defaults: dict[str, Any], stream: bool) -> ProgramState:
        resolved = context.resolve_backend(backend)
        arguments = {**kwargs, **self.bind_arguments}
        ex = StreamExecutor(resolved, loop, arguments, defaults, stream=stream,
                            num_api_spec_tokens=self.num_api_spec_tokens)
        return ProgramState(ex)

    def _call_args(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        return tuple(args), {**kwargs, **self.bind_arguments}

    def _start_body(self, state: ProgramState, args: Sequence[Any], kwargs: dict[str, Any]
                    ) -> Callable[[], None]:
        """Start the body from a sync caller; the returned callable waits for the end."""
        ex = state.stream_executor
        if self.is_async:
            fut = asyncio.run_coroutine_threadsafe(self._run_async(state, args, kwargs), ex.loop)
            return lambda: result_or_cancel(fut)
        if ex.stream:  # the caller iterates while the body runs: run the body in a thread
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sgl-program")
            f = pool.submit(self._run_sync_body, state, args, kwargs)
            pool.shutdown(wait=False)
            return lambda: f.result()
        return lambda: self._run_sync_body(state, args, kwargs)

    def _run_sync_body(self, state: ProgramState, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Run a sync body in this (non-loop) thread, then wait for its queued work."""
        ex = state.stream_executor
        ex.body_thread_id = threading.get_ident()
        call_args, call_kwargs = self._call_args(args, kwargs)
        try:
            state.ret_value = self.func(state, *call_args, **call_kwargs)
        except KeyboardInterrupt:
            raise  # Ctrl-C in run()'s own thread: run() stops the program (see _interrupt)
        except BaseException as exc:  # noqa: BLE001 - recorded on the state, raised by run()
            ex.loop.call_soon_threadsafe(ex.fail, exc, True)
        else:
            ex.submit(End())
        run_blocking(ex.wait_idle(), ex.loop)

    async def _run_async(self, state: ProgramState, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Run the body on the state's loop (async body) or in a worker thread (sync body)."""
        ex = state.stream_executor
        if not self.is_async:
            await asyncio.get_running_loop().run_in_executor(
                _body_pool(), self._run_sync_body, state, args, kwargs)
            return
        call_args, call_kwargs = self._call_args(args, kwargs)
        try:
            state.ret_value = await self.func(state, *call_args, **call_kwargs)
        except Exception as exc:  # noqa: BLE001 - recorded on the state, raised by arun()
            ex.fail(exc, True)
        else:
            ex.submit(End())
        await ex.wait_idle()

    def _raise_if_failed(self, state: ProgramState) -> None:
        error = state.stream_executor.error_
        if error is not None:
            err = ProgramError(f"program {self.__name__} failed: {type(error).__name__}: {error}")
            err.state = state  # type: ignore[attr-defined]
            raise err from error

    # -- batches --------------------------------------------------------------------------

    def run_batch(self, batch_kwargs: Sequence[Any], *, backend: Any = None,
                  num_threads: str | int = "auto", progress_bar: bool = False,
                  **sampling: Any) -> list[ProgramState]:
        from sgl.lang.batch import run_batch

        return run_blocking(
            run_batch(self, batch_kwargs, backend, num_threads, progress_bar, sampling),
            background_loop())

    async def arun_batch(self, batch_kwargs: Sequence[Any], *, backend: Any = None,
                         num_threads: str | int = "auto", progress_bar: bool = False,
                         **sampling: Any) -> list[ProgramState]:
        from sgl.lang.batch import run_batch

        return await run_batch(self, batch_kwargs, backend, num_threads, progress_bar, sampling)

    def __repr__(self) -> str:
        return f"SglFunction({self.__name__})"


def _interrupt(ex: StreamExecutor, wait: float = 5.0) -> None:
    """Ctrl-C in a sync run(): end the program as failed, cancel its running gen (which aborts
    that request in the engine) and drop the queued ones, waiting briefly until that ran.

    The recorded error is a ProgramError, not the KeyboardInterrupt: waiters re-raise it
    inside the loop's tasks, and a KeyboardInterrupt raised there would stop the loop."""

    async def stop() -> None:
        worker = ex._worker
        ex.fail(ProgramError("the program was interrupted (KeyboardInterrupt)"), cancel_running=True)
        if worker is not None:
            await asyncio.wait([worker], timeout=wait)

    try:
        asyncio.run_coroutine_threadsafe(stop(), ex.loop).result(wait + 1.0)
    except Exception:  # noqa: BLE001 - the loop is gone or the wait timed out: nothing left to stop
        pass


def _split_sampling(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate run()'s sampling defaults from the program's own arguments."""
    defaults = dict(RUN_DEFAULTS)
    program_kwargs = {}
    for key, value in kwargs.items():
        if key in _SAMPLING_ARGS:
            defaults[key] = value
        else:
            program_kwargs[key] = value
    return defaults, program_kwargs


_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _body_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for sync bodies started from async code (arun); sized for blocking waits."""
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(
            max(64, (os.cpu_count() or 4) * 8), thread_name_prefix="sgl-program")
    return _POOL


def check_batch_arguments(fn: SglFunction, batch: Sequence[Any]) -> list[dict[str, Any]]:
    """SGLang accepts dicts, or tuples of positional values mapped onto argument names."""
    out = []
    required = len(fn.arg_names) - len(fn.arg_defaults)
    for item in batch:
        if isinstance(item, dict):
            out.append(dict(item))
        elif isinstance(item, (list, tuple)) and required <= len(item) <= len(fn.arg_names):
            out.append(dict(zip(fn.arg_names, item)))
        else:
            raise InvalidRequestError(
                f"run_batch item {item!r} does not match {fn.__name__}({', '.join(fn.arg_names)})")
    return out
