"""ProgramState (the `s` of a program) and ProgramStateGroup (what `s.fork(n)` returns).

Sync and async forms of each read:

    sync program / caller            async program / caller
    s["x"], s.get_var("x")          await s.aget("x")
    s.text(), s.messages()          await s.atext(), await s.amessages()
    s.get_meta_info("x")            await s.aget_meta_info("x")
    s.sync(), s.error()             await s.wait(), await s.aerror()
    s.text_iter(var)                async for t in s.text_async_iter(var)

Appending (`s += ...`), roles, `var_scope`, `fork` and `join` never block, so they are the
same in both. A sync read from the loop thread itself (inside an `async def` program) returns
at once when its value is ready and otherwise raises, naming the awaitable form: it cannot
wait without blocking the loop that produces the value.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

from sgl.lang import ir
from sgl.lang.interpreter import StreamExecutor
from sgl.lang.loop import on_loop_thread, run_blocking, run_on
from sgl.lang.ops import ConcatAndAppend, Fork, Inherit, JoinGather, SetVar

__all__ = ["ProgramState", "ProgramStateGroup"]


class ProgramState:
    def __init__(self, stream_executor: StreamExecutor) -> None:
        self.stream_executor = stream_executor
        self.ret_value: Any = None  # what the program function returned (SGLang attribute)

    # -- appending (never blocks) ---------------------------------------------------------

    def __iadd__(self, other: Any) -> ProgramState:
        self.stream_executor.submit(ir.as_expr(other))
        return self

    def _role(self, role: str, expr: Any = None) -> Any:
        if expr is not None:
            self += ir.SglExprList([ir.SglRoleBegin(role), ir.as_expr(expr), ir.SglRoleEnd(role)])
            return None
        return self._role_scope(role)

    @contextlib.contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self += ir.SglRoleBegin(role)
        yield
        self += ir.SglRoleEnd(role)

    def system(self, expr: Any = None) -> Any:
        """`s.system("...")` appends a system turn; `with s.system():` wraps appends in one."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything appended inside the block becomes variable `name`."""
        self += ir.SglVarScopeBegin(name)
        yield
        self += ir.SglVarScopeEnd(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.submit(SetVar(name, value))

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def fork(self, size: int = 1, position_ids_offset: Sequence[int] | None = None) -> ProgramStateGroup:
        """`size` copies of this state at this point; they share its prefix (and its KV)."""
        parent = self.stream_executor
        children = [
            StreamExecutor(parent.backend, parent.loop, parent.arguments, parent.default_params,
                           stream=parent.stream, chat_template=parent.chat_template,
                           inherited=False)
            for _ in range(int(size))
        ]
        fork = Fork(children)
        for child in children:
            child.submit(Inherit(fork))
        parent.submit(fork)
        return ProgramStateGroup([ProgramState(c) for c in children], self)

    @contextlib.contextmanager
    def copy(self, position_ids_offset: Sequence[int] | None = None) -> Iterator[ProgramState]:
        """`with s.copy() as c:` a fork of one, joined back when the block ends (SGLang)."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    # -- reading --------------------------------------------------------------------------

    def _blocking(self, make: Callable[[], Any], ready: Callable[[], bool], value: Callable[[], Any],
                  awaitable_name: str) -> Any:
        ex = self.stream_executor
        if on_loop_thread(ex.loop):
            if ready():
                return value()
            raise RuntimeError(
                f"the value is not ready and waiting here would block the event loop; in an "
                f"async program use `{awaitable_name}`"
            )
        if ex.loop.is_closed():
            # The state outlived its loop (e.g. `asyncio.run(f.arun())` returned): nothing
            # can run on that loop any more, so a ready value is read directly.
            if ready():
                return value()
            raise RuntimeError("the event loop that ran this program is closed; the value was "
                               "never produced")
        return run_blocking(make(), ex.loop)

    def get_var(self, name: str) -> Any:
        ex = self.stream_executor
        return self._blocking(lambda: ex.get_var(name), lambda: ex.var_ready(name),
                              lambda: ex.read_var(name), f"await s.aget({name!r})")

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    def get_meta_info(self, name: str, timeout: float | None = None) -> Any:
        ex = self.stream_executor
        if on_loop_thread(ex.loop) or ex.loop.is_closed():  # no timeout needed: never waits
            return self._blocking(lambda: ex.get_meta_info(name), lambda: ex.var_ready(name),
                                  lambda: ex.meta_info.get(name), f"await s.aget_meta_info({name!r})")
        return run_blocking(ex.get_meta_info(name), ex.loop, timeout)

    def sync(self) -> None:
        """Wait until everything appended so far has run. Called from outside a streaming
        program (`run(stream=True)` returns while the body still runs in its own thread), it
        waits for the body to finish too: otherwise what the body has yet to append is missed."""
        ex = self.stream_executor
        if ex.stream and threading.get_ident() != ex.body_thread_id:
            done = lambda: ex.idle and (ex.finished or ex.error_ is not None)  # noqa: E731
        else:
            done = lambda: ex.idle  # noqa: E731
        self._blocking(lambda: ex.until(done), done, lambda: None, "await s.wait()")

    def text(self) -> str:
        self.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, Any]]:
        self.sync()
        return list(self.stream_executor.messages_)

    def token_ids(self) -> list[int] | None:
        """The state's token sequence (what the next gen sends), or None for text backends."""
        self.sync()
        tokens = self.stream_executor.tokens
        return None if tokens is None else list(tokens.ids)

    def error(self) -> BaseException | None:
        self.sync()
        return self.stream_executor.error_

    # -- async reads ----------------------------------------------------------------------

    async def aget(self, name: str) -> Any:
        ex = self.stream_executor
        return await run_on(ex.loop, ex.get_var(name))

    async def aget_meta_info(self, name: str) -> Any:
        ex = self.stream_executor
        return await run_on(ex.loop, ex.get_meta_info(name))

    async def wait(self) -> None:
        ex = self.stream_executor
        await run_on(ex.loop, ex.wait_idle())

    async def atext(self) -> str:
        await self.wait()
        return self.stream_executor.text_

    async def amessages(self) -> list[dict[str, Any]]:
        await self.wait()
        return list(self.stream_executor.messages_)

    async def aerror(self) -> BaseException | None:
        await self.wait()
        return self.stream_executor.error_

    # -- streaming ------------------------------------------------------------------------

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Yield text as it is produced: of the whole state, or of variable `var_name`."""
        ex, pos = self.stream_executor, 0
        while True:
            chunk, final = run_blocking(ex.next_text(var_name, pos), ex.loop)
            pos += len(chunk)
            if chunk:
                yield chunk
            if final:
                return

    async def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False
                              ) -> AsyncIterator[Any]:
        ex, pos = self.stream_executor, 0
        while True:
            chunk, final = await run_on(ex.loop, ex.next_text(var_name, pos))
            pos += len(chunk)
            if chunk:
                yield (chunk, ex.meta_info.get(var_name)) if return_meta_data else chunk
            if final:
                return

    def partial_iter(self, var_name: str) -> Iterator[Any]:
        """For a streamed `gen(var_name, schema=Model)`: the object complete so far after each
        piece of text (sgl.partial; fields not yet complete are None), the last one whole."""
        track = self._partial_tracker(var_name)
        for chunk in self.text_iter(var_name):
            value = track(chunk)
            if value is not None:
                yield value

    async def partial_async_iter(self, var_name: str) -> AsyncIterator[Any]:
        """`partial_iter` for async code."""
        track = self._partial_tracker(var_name)
        async for chunk in self.text_async_iter(var_name):
            value = track(chunk)
            if value is not None:
                yield value

    def _partial_tracker(self, var_name: str) -> Callable[[str], Any]:
        """Feeds text pieces; returns the partial object when it changed, else None."""
        from sgl.partial import parse_partial

        state: dict[str, Any] = {"text": "", "last": None}

        def feed(chunk: str) -> Any:
            state["text"] += chunk
            model = self.stream_executor.partial_model(var_name)
            value = parse_partial(state["text"], model) if model is not None else None
            if value is None or value == state["last"]:
                return None
            state["last"] = value
            return value

        return feed

    def __repr__(self) -> str:
        ex = self.stream_executor
        return f"ProgramState({ex.text_!r})"


class ProgramStateGroup:
    """The states of `s.fork(n)`: index them, `+=` to all, then `join()`."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState | None = None) -> None:
        self.states = states
        self.src_state = src_state

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        # `forks[i] += x` rebinds forks[i] to the same state; anything else is a mistake.
        if value is not self.states[i]:
            raise TypeError("assign to a fork with +=, not =")

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"got {len(other)} values for {len(self.states)} forks")
            for state, item in zip(self.states, other):
                state += item
        elif callable(other) and not isinstance(other, ir.SglExpr):
            for i, state in enumerate(self.states):
                state += other(i)
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Bring the forks back: gather their new variables as lists (default) or append
        their text after the fork point ("concate_and_append")."""
        if self.src_state is None:
            raise ValueError("this group has no source state to join into")
        children = [s.stream_executor for s in self.states]
        if mode == "gather_variable":
            self.src_state.stream_executor.submit(JoinGather(children))
        elif mode == "concate_and_append":
            self.src_state.stream_executor.submit(ConcatAndAppend(children))
        else:
            raise ValueError(f"invalid join mode {mode!r}; use 'gather_variable' or 'concate_and_append'")
