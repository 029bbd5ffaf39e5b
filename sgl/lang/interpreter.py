"""The executor of one program state: an ordered queue of expressions run by an asyncio task.

`s += expr` enqueues (from any thread) and returns at once; a task on the state's loop runs the
queue in order, calling the backend for gens and selects. Reads (`s["x"]`, `s.text()`) wait
on the loop until what they depend on is done. Everything that mutates the state runs on the
loop thread, so there are no locks: other threads only enqueue (`call_soon_threadsafe`, FIFO)
and wait for results (`run_coroutine_threadsafe`).

Waiting uses one broadcast event per state, replaced after each change: waiters re-check
their condition after every operation. `_pending[name]` counts queued operations that will
define `name`, so `s["x"]` waits for the *last* queued gen of "x", never returning a stale value.

On failure the queue is dropped, the error is kept (`error_`) and every waiter wakes and
raises it: a failed program never hangs its reader.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from typing import Any, Mapping

from sgl.errors import InvalidRequestError
from sgl.lang import ir
from sgl.lang.backend import Backend, Prompt
from sgl.lang.chat import ChatTemplate
from sgl.lang.choices import resolve_choices_method
from sgl.lang.loop import on_loop_thread
from sgl.lang.ops import Op, names_of
from sgl.lang.params import resolve_gen
from sgl.lang.tokens import TokenSequence
from sgl.lang.tools import SglToolCall


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and hasattr(tp, "model_fields") and hasattr(tp, "model_validate")

__all__ = ["StreamExecutor"]


class StreamExecutor:
    def __init__(
        self,
        backend: Backend,
        loop: asyncio.AbstractEventLoop,
        arguments: Mapping[str, Any],
        default_params: Mapping[str, Any],
        *,
        stream: bool = False,
        chat_template: ChatTemplate | None = None,
        num_api_spec_tokens: int | None = None,
        inherited: bool = True,
    ) -> None:
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.loop = loop
        self.arguments = dict(arguments)
        self.default_params = dict(default_params)
        self.stream = stream
        self.chat_template = chat_template or backend.get_chat_template()
        self.num_api_spec_tokens = num_api_spec_tokens  # accepted for SGLang compatibility

        self.text_ = ""
        self.tokens = TokenSequence(backend.tokenizer) if backend.tokenizer is not None else None
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.messages_: list[dict[str, Any]] = []
        self.cur_role: str | None = None
        self.cur_role_begin_pos: int | None = None
        self.fork_start_text_pos: int | None = None
        self.scope_starts: dict[str, int] = {}
        self.error_: BaseException | None = None
        self.finished = False  # the program body returned and its last op ran
        self.body_thread_id: int | None = None  # thread running a sync body (see state.sync)
        self.inherited = inherited  # False for a fork child until it copied its parent

        self._queue: collections.deque[Any] = collections.deque()
        self._pending: collections.Counter[str] = collections.Counter()
        self._streaming: set[str] = set()
        self.partial_models: dict[str, Any] = {}  # streamed schema= gens: variable -> Pydantic model
        self._worker: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    # -- submission (any thread) ----------------------------------------------------------

    def submit(self, expr: Any) -> None:
        if on_loop_thread(self.loop):
            self._enqueue(expr)
        else:
            self.loop.call_soon_threadsafe(self._enqueue, expr)

    def _enqueue(self, expr: Any) -> None:
        if self.error_ is not None:
            if isinstance(expr, Op):
                expr.abort(self.error_)
            return
        if isinstance(expr, Op):
            expr.on_enqueue(self)
        for name in names_of(expr):
            self._pending[name] += 1
        self._queue.append(expr)
        if self._worker is None:
            self._worker = self.loop.create_task(self._work())

    async def _work(self) -> None:
        try:
            while self._queue and self.error_ is None:
                expr = self._queue.popleft()
                try:
                    await self.execute(expr)
                except Exception as exc:  # noqa: BLE001 - any failure ends the program
                    self.fail(exc)
                finally:
                    if self.error_ is None:  # fail() already cleared the counts
                        for name in names_of(expr):
                            self._pending[name] -= 1
                    self.notify()
        finally:
            self._worker = None
            self.notify()

    def fail(self, exc: BaseException, cancel_running: bool = False) -> None:
        """Record the first error, drop queued work and wake every waiter.

        `cancel_running`: the body failed (not the op in flight), so cancel that op too
        rather than let a long generation finish for nothing.
        """
        if self.error_ is None:
            self.error_ = exc
        if cancel_running and self._worker is not None:
            # A task cancelled before it started never runs its `finally`: forget it here.
            self._worker.cancel()
            self._worker = None
        dropped, self._queue = self._queue, collections.deque()
        for expr in dropped:
            if isinstance(expr, Op):
                expr.abort(exc)
        self._pending.clear()
        self._streaming.clear()
        self.finished = True
        self.notify()

    def notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # -- waiting (loop thread) ------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self._queue and self._worker is None

    async def until(self, condition: Any) -> None:
        while not condition():
            await self._changed.wait()

    def var_ready(self, name: str) -> bool:
        return self.error_ is not None or (
            self.inherited and self._pending[name] == 0 and name not in self._streaming
        )

    def read_var(self, name: str) -> Any:
        if self.error_ is not None:
            raise self.error_
        return self.variables[name]

    async def get_var(self, name: str) -> Any:
        await self.until(lambda: self.var_ready(name))
        return self.read_var(name)

    async def get_meta_info(self, name: str) -> Any:
        await self.until(lambda: self.var_ready(name))
        if self.error_ is not None:
            raise self.error_
        return self.meta_info.get(name)

    async def wait_idle(self) -> None:
        await self.until(lambda: self.idle)

    async def next_text(self, var: str | None, pos: int) -> tuple[str, bool]:
        """Text after `pos` (of the whole state, or of variable `var`) and whether it is final."""

        def current() -> str:
            if var is None:
                return self.text_
            value = self.variables.get(var, "") if self.inherited else ""
            return value if isinstance(value, str) else str(value)

        def done() -> bool:
            if var is None:
                return self.finished and self.idle
            return self.var_ready(var) and (var in self.variables or (self.finished and self.idle))

        await self.until(lambda: len(current()) > pos or done())
        final = done()
        if final and self.error_ is not None and len(current()) <= pos:
            raise self.error_
        return current()[pos:], final

    # -- execution (loop thread) ----------------------------------------------------------

    async def execute(self, expr: Any) -> None:
        if isinstance(expr, str):
            self.fill(expr)
        elif isinstance(expr, ir.SglConstantText):
            self.fill(expr.value)
        elif isinstance(expr, ir.SglExprList):
            for item in expr.expr_list:
                await self.execute(item)
        elif isinstance(expr, ir.SglGen):
            await self._gen(expr)
        elif isinstance(expr, ir.SglSelect):
            await self._select(expr)
        elif isinstance(expr, ir.SglRoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, ir.SglRoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, ir.SglVarScopeBegin):
            self.scope_starts[expr.name] = len(self.text_)
        elif isinstance(expr, ir.SglVarScopeEnd):
            start = self.scope_starts.pop(expr.name, len(self.text_))
            self.variables[expr.name] = self.text_[start:]
        elif isinstance(expr, Op):
            await expr.run(self)
        else:
            raise TypeError(f"cannot execute {type(expr).__name__}: {expr!r}")

    def partial_model(self, name: str) -> Any:
        return self.partial_models.get(name)

    def fill(self, text: str) -> None:
        self.text_ += text
        if self.tokens is not None:
            self.tokens.append_text(text)
        self.notify()

    def prompt(self) -> Prompt:
        if self.tokens is None:
            return Prompt(self.text_)
        return Prompt(self.text_, list(self.tokens.ids), self.tokens._prefix_len)

    async def _gen(self, expr: ir.SglGen) -> None:
        resolved = resolve_gen(self.default_params, expr.options, self.chat_template.stop_str)
        name = expr.name
        prompt = self.prompt()
        if self.stream and resolved.params.n == 1:
            if name is not None and _is_model(expr.options.schema):
                self.partial_models[name] = expr.options.schema  # for ProgramState.partial_iter
            completion = await self._gen_streaming(name, prompt, resolved)
            completions = [completion]
        else:
            completions = await self.backend.generate(prompt, resolved.params, resolved.logprobs)
            first = completions[0]
            self.text_ += first.text
            self._append_tokens(first)
        values: list[Any] = []
        for c in completions:
            meta = dict(c.meta_info)
            value: Any = c.text
            if resolved.typed:  # schema=: the variable holds the validated value
                value = meta["parsed"] = resolved.constraint.parse(c.text, c.finish_reason)
            elif isinstance(expr, SglToolCall):  # the variable holds the parsed calls
                value = meta["tool_calls"] = expr.parse(c.text)
            c.meta_info = meta
            values.append(value)
        if name is not None:
            many = len(completions) > 1
            self.variables[name] = values if many else values[0]
            self.meta_info[name] = [c.meta_info for c in completions] if many else completions[0].meta_info
            self._streaming.discard(name)

    async def _gen_streaming(self, name: str | None, prompt: Prompt, resolved: Any) -> Any:
        if name is not None:
            self.variables[name] = ""
            self._streaming.add(name)
        final, start = None, len(self.text_)
        async for chunk in self.backend.stream(prompt, resolved.params, resolved.logprobs):
            self.text_ += chunk.text
            if name is not None:
                self.variables[name] += chunk.text
            if chunk.completion is not None:
                final = chunk.completion
            self.notify()
        if final is None:
            raise RuntimeError(f"{type(self.backend).__name__}.stream ended without a completion")
        # The final text is authoritative (a backend may have streamed a stop string it then
        # trimmed): make the state agree with it.
        self.text_ = self.text_[:start] + final.text
        if name is not None:
            self.variables[name] = final.text
        self._append_tokens(final)
        return final

    def _append_tokens(self, completion: Any) -> None:
        if self.tokens is None:
            return
        if completion.token_ids is not None:
            self.tokens.append_generated(completion.token_ids, completion.text)
        else:
            self.tokens.append_text(completion.text)

    async def _select(self, expr: ir.SglSelect) -> None:
        if expr.temperature > 1e-5:
            raise InvalidRequestError(
                "select(temperature>0) is not supported: select scores every choice and picks "
                "the best one deterministically", field="temperature")
        method = resolve_choices_method(expr.choices_method)
        decision = await self.backend.select(self.prompt(), expr.choices, expr.temperature, method)
        if expr.name is not None:
            self.variables[expr.name] = decision.decision
            self.meta_info[expr.name] = decision.meta_info
        self.fill(decision.decision)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"nested roles are not allowed ({role} inside {self.cur_role})")
        default_system = self.chat_template.default_system_prompt
        if not self.messages_ and role != "system" and default_system:
            # Like SGLang (and the model's own template): a conversation starts with the
            # template's default system message when the program gives none.
            self._role_begin("system")
            self.fill(default_system)
            self._role_end("system")
        self.cur_role = role
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self.fill(prefix)
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        begin = self.cur_role_begin_pos if self.cur_role_begin_pos is not None else len(self.text_)
        content = self.text_[begin:].lstrip()
        self.cur_role, self.cur_role_begin_pos = None, None
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self.fill(suffix)
        self.messages_.append({"role": role, "content": content})

    # -- fork support ---------------------------------------------------------------------

    def snapshot_into(self, child: StreamExecutor) -> None:
        """Copy this state (at the fork point) into a fork child."""
        child.text_ = self.text_
        child.tokens = self.tokens.copy() if self.tokens is not None else None
        child.variables = dict(self.variables)
        child.meta_info = dict(self.meta_info)
        child.messages_ = list(self.messages_)
        child.cur_role, child.cur_role_begin_pos = self.cur_role, self.cur_role_begin_pos
        child.fork_start_text_pos = len(self.text_)
        child.inherited = True
        child.notify()

    def pending_names(self) -> set[str]:
        return {n for n, c in self._pending.items() if c > 0}
