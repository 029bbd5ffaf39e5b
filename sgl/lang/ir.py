"""The expressions a program appends to its state: text, gen, select, roles, variable scopes.

Expressions are plain values. `a + b` concatenates them into an `ExprList` (strings are
wrapped in `ConstantText`), so `s += "Q: " + q + gen("a")` appends three expressions in
order. Nothing here runs anything; the interpreter walks these nodes.

Class names follow SGLang's `sglang.lang.ir` (`SglGen`, `SglSelect`, ...) so that code which
inspects expressions (rare) ports; the regex constants match SGLang's values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = [
    "REGEX_INT",
    "REGEX_FLOAT",
    "REGEX_BOOL",
    "REGEX_STR",
    "SglExpr",
    "SglExprList",
    "SglConstantText",
    "SglGen",
    "SglSelect",
    "SglRoleBegin",
    "SglRoleEnd",
    "SglVarScopeBegin",
    "SglVarScopeEnd",
    "GenOptions",
    "as_expr",
]

# SGLang's dtype regexes (gen(dtype=int) etc. when sgl.constraints is unavailable).
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""


class SglExpr:
    """Base of every expression; `+` builds a flat `SglExprList`."""

    def __add__(self, other: Any) -> SglExprList:
        return SglExprList([*_flatten(self), *_flatten(as_expr(other))])

    def __radd__(self, other: Any) -> SglExprList:
        return SglExprList([*_flatten(as_expr(other)), *_flatten(self)])


def as_expr(value: Any) -> SglExpr:
    """Wrap a value appended to a state: expressions pass, anything else becomes its str().

    SGLang accepts str only; numbers are converted here because `s += 3` is an obvious intent.
    `None` is refused (SGLang does the same) since it is nearly always a forgotten return.
    """
    if isinstance(value, SglExpr):
        return value
    if value is None:
        raise ValueError("tried to append None to a program state")
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return SglConstantText(str(value))
    raise TypeError(
        f"cannot append {type(value).__name__} to a program state; append str or an sgl "
        f"expression (gen, select, roles)"
    )


def _flatten(expr: SglExpr) -> list[SglExpr]:
    return list(expr.expr_list) if isinstance(expr, SglExprList) else [expr]


class SglExprList(SglExpr):
    def __init__(self, expr_list: Sequence[SglExpr]) -> None:
        self.expr_list: list[SglExpr] = list(expr_list)

    def __repr__(self) -> str:
        return f"ExprList({self.expr_list})"


class SglConstantText(SglExpr):
    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


@dataclass(frozen=True)
class GenOptions:
    """The per-gen overrides; `None` means "use the run() default" (SGLang semantics)."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    stop_regex: str | Sequence[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    # Constraints; resolved into one ConstraintSpec at execution time.
    dtype: Any = None
    regex: str | None = None
    json_schema: Any = None
    schema: Any = None  # sgl addition: a Pydantic model or type; the variable holds the value
    grammar: str | None = None  # sgl addition: EBNF text or a grammar name from grammars/
    extra: dict[str, Any] = field(default_factory=dict)  # other SamplingParams fields (seed...)


class SglGen(SglExpr):
    def __init__(self, name: str | None, options: GenOptions) -> None:
        self.name = name
        self.options = options

    @property
    def sampling_params(self) -> GenOptions:  # SGLang's attribute name
        return self.options

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class SglSelect(SglExpr):
    def __init__(
        self, name: str | None, choices: Sequence[str], temperature: float, choices_method: Any
    ) -> None:
        self.name = name
        self.choices = list(choices)
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices})"


class SglRoleBegin(SglExpr):
    def __init__(self, role: str) -> None:
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role})"


class SglRoleEnd(SglExpr):
    def __init__(self, role: str) -> None:
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role})"


class SglVarScopeBegin(SglExpr):
    def __init__(self, name: str) -> None:
        self.name = name


class SglVarScopeEnd(SglExpr):
    def __init__(self, name: str) -> None:
        self.name = name


def defined_names(expr: SglExpr) -> list[str]:
    """Variable names an expression will define, known before it runs (for s["x"] waits)."""
    if isinstance(expr, SglExprList):
        return [n for e in expr.expr_list for n in defined_names(e)]
    if isinstance(expr, (SglGen, SglSelect)) and expr.name is not None:
        return [expr.name]
    if isinstance(expr, SglVarScopeEnd):
        return [expr.name]
    return []
