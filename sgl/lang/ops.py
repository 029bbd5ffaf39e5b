"""Internal operations queued beside expressions: set a variable, fork, join, end.

Fork and join are queue operations, not blocking calls, so `s.fork(n)` and `forks.join()`
return at once in sync and async programs alike:

    parent queue:  ... gen("a") | Fork ─────────────┐ | ... | JoinGather(children)
    child queue:   Inherit (waits for Fork) ◄───────┘ | gen("tip") | ...

`Fork` runs when everything before it in the parent is done: it warms the prefix cache once
(so n children hit it instead of prefilling the same prefix n times) and copies the parent's
text, tokens, roles and variables into each child. `JoinGather` waits for the children and
gathers their new variables into lists on the parent (SGLang's "gather_variable");
`ConcatAndAppend` appends their text after the fork point ("concate_and_append").
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Sequence

from sgl.lang import ir

if TYPE_CHECKING:
    from sgl.lang.interpreter import StreamExecutor

__all__ = ["Op", "names_of", "SetVar", "Fork", "Inherit", "JoinGather", "ConcatAndAppend", "End"]


class Op:
    names: tuple[str, ...] = ()  # variables this op defines (known when enqueued)

    def on_enqueue(self, ex: StreamExecutor) -> None:
        """Called on the loop thread when queued, in submission order."""

    async def run(self, ex: StreamExecutor) -> None:
        raise NotImplementedError

    def abort(self, exc: BaseException) -> None:
        """The op was dropped because the program failed before reaching it."""


def names_of(expr: Any) -> tuple[str, ...] | list[str]:
    if isinstance(expr, Op):
        return expr.names
    if isinstance(expr, ir.SglExpr):
        return ir.defined_names(expr)
    return ()


class SetVar(Op):
    """`s["x"] = v`: ordered with the queue, so a later s["x"] never sees an older gen."""

    def __init__(self, name: str, value: Any) -> None:
        self.names, self.value = (name,), value

    async def run(self, ex: StreamExecutor) -> None:
        ex.variables[self.names[0]] = self.value


class End(Op):
    """The program body returned: after this op, the state is finished."""

    async def run(self, ex: StreamExecutor) -> None:
        ex.finished = True


class Fork(Op):
    def __init__(self, children: Sequence[StreamExecutor]) -> None:
        self.children = list(children)
        self.done = asyncio.Event()
        self.error: BaseException | None = None

    async def run(self, ex: StreamExecutor) -> None:
        try:
            if len(self.children) > 1 and ex.text_:
                await ex.backend.cache_prefix(ex.prompt())
            for child in self.children:
                ex.snapshot_into(child)
        except BaseException as exc:
            self.abort(exc)
            raise
        self.done.set()

    def abort(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()
        for child in self.children:
            child.loop.call_soon_threadsafe(child.fail, exc)


class Inherit(Op):
    """First op of a fork child: wait until the parent reached the fork point."""

    def __init__(self, fork: Fork) -> None:
        self.fork = fork

    async def run(self, ex: StreamExecutor) -> None:
        await self.fork.done.wait()
        if self.fork.error is not None:
            raise self.fork.error


class _Join(Op):
    def __init__(self, children: Sequence[StreamExecutor]) -> None:
        self.children = list(children)

    async def _wait_children(self) -> None:
        for child in self.children:
            await child.wait_idle()
            if child.error_ is not None:
                raise child.error_


class JoinGather(_Join):
    def on_enqueue(self, ex: StreamExecutor) -> None:
        # Declare the variables the join will define, so s["x"] after join() waits for it.
        names: set[str] = set()
        for child in self.children:
            names |= child.pending_names() | set(child.variables)
        self.names = tuple(sorted(names - set(ex.variables)))

    async def run(self, ex: StreamExecutor) -> None:
        await self._wait_children()
        existing = set(ex.variables)
        for child in self.children:
            for name in child.variables.keys() - existing:
                ex.variables.setdefault(name, []).append(child.variables[name])
                ex.meta_info.setdefault(name, []).append(child.meta_info.get(name))


class ConcatAndAppend(_Join):
    async def run(self, ex: StreamExecutor) -> None:
        await self._wait_children()
        # Text fallback of SGLang's KV concatenation: the engine has no "concatenate KV"
        # call, so the parent re-encodes the children's segments after its own prefix.
        ex.fill("".join(c.text_[c.fork_start_text_pos or 0 :] for c in self.children))
