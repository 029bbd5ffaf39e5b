"""Find a program's constant prefix by running it on placeholder arguments (for run_batch).

`run_batch` of 64 few-shot questions sends 64 prompts that share a long constant prefix; if
they all arrive at once the engine may prefill that prefix 64 times before the radix cache
holds it. Like SGLang, sgl runs the program once on placeholders: everything appended before
the first use of an argument, gen, select or read is the constant prefix, cached once.

The body really runs until that point, so side effects before the first argument use happen
once more (same as SGLang). An async body is stepped synchronously and abandoned at its first
real suspension, so nothing it awaits is executed.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

from sgl.lang import ir
from sgl.lang.chat import ChatTemplate

if TYPE_CHECKING:
    from sgl.lang.function import SglFunction

__all__ = ["extract_prefix"]


class _StopTracing(Exception):
    pass


def _stop(*_: Any, **__: Any) -> Any:
    raise _StopTracing


class _Partial:
    """`"Question: " + arg`: the constant part still belongs to the prefix."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __radd__(self, other: Any) -> _Partial:
        return _Partial(other + self.text) if isinstance(other, str) else _stop()

    def __add__(self, other: Any) -> _Partial:
        return self  # whatever follows the argument is not constant


class _Placeholder:
    """An argument whose every use ends the trace."""

    def __radd__(self, other: Any) -> _Partial:
        return _Partial(other) if isinstance(other, str) else _stop()

    __str__ = __repr__ = __format__ = __add__ = __len__ = __iter__ = _stop
    __bool__ = __int__ = __float__ = __index__ = __getitem__ = __eq__ = __lt__ = _stop
    __hash__ = None  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:
        raise _StopTracing


class _TracingState:
    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self.text = ""
        self.num_messages = 0

    def __iadd__(self, other: Any) -> _TracingState:
        if isinstance(other, _Partial):
            self.text += other.text
            raise _StopTracing
        self._append(ir.as_expr(other) if not isinstance(other, _Placeholder) else _stop())
        return self

    def _append(self, expr: ir.SglExpr) -> None:
        if isinstance(expr, ir.SglExprList):
            for e in expr.expr_list:
                self._append(e)
        elif isinstance(expr, ir.SglConstantText):
            self.text += expr.value
        elif isinstance(expr, ir.SglRoleBegin):
            if not self.num_messages and expr.role != "system" and self.template.default_system_prompt:
                sys_prefix, sys_suffix = self.template.get_prefix_and_suffix("system")
                self.text += sys_prefix + self.template.default_system_prompt + sys_suffix
                self.num_messages += 1
            self.text += self.template.get_prefix_and_suffix(expr.role)[0]
        elif isinstance(expr, ir.SglRoleEnd):
            self.text += self.template.get_prefix_and_suffix(expr.role)[1]
            self.num_messages += 1
        else:
            raise _StopTracing

    def _role(self, role: str, expr: Any = None) -> Any:
        if expr is not None:
            self._append(ir.SglExprList([ir.SglRoleBegin(role), ir.as_expr(expr), ir.SglRoleEnd(role)]))
            return None
        return self._scope(role)

    @contextlib.contextmanager
    def _scope(self, role: str) -> Iterator[None]:
        self._append(ir.SglRoleBegin(role))
        yield
        self._append(ir.SglRoleEnd(role))

    def system(self, expr: Any = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    def __getattr__(self, name: str) -> Any:  # s["x"], s.fork(), s.text(), ...: end the trace
        raise _StopTracing

    __getitem__ = __setitem__ = __contains__ = _stop


def extract_prefix(fn: SglFunction, template: ChatTemplate) -> str:
    """The text a program appends before depending on anything variable ("" when unknown)."""
    state = _TracingState(template)
    kwargs: dict[str, Any] = {name: _Placeholder() for name in fn.arg_names}
    kwargs.update(fn.bind_arguments)
    try:
        result = fn.func(state, **kwargs)
        if fn.is_async:
            try:
                result.send(None)  # runs until the first real suspension point
            except StopIteration:
                pass
            finally:
                result.close()
    except Exception:  # noqa: BLE001 - _StopTracing, or a body that rejects placeholders
        pass
    return state.text
