"""Type checks read from dataclass annotations, so a new field is checked without a table.

`mismatch(value, hint)` returns None when the value fits the annotation, else what it must
be ("must be an integer"). Python's own `isinstance` is too loose for options and request
fields: `True` is an `int`, `0` is not a `bool` but reads as one, and `"no"` is truthy, so the
rules here are strict: a bool is a bool, an int is never a bool, a float accepts ints.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any, Literal, Union

__all__ = ["mismatch", "field_hints", "describe_choices"]


@functools.lru_cache(maxsize=None)
def field_hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass (they are strings under `from __future__`)."""
    return typing.get_type_hints(cls)


def describe_choices(choices: tuple[Any, ...]) -> str:
    """'a', 'b' or 'c'."""
    shown = [repr(c) for c in choices]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


@functools.lru_cache(maxsize=None)
def _parts(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    """(origin, args) of an annotation: typing's introspection, once per annotation (request
    fields are checked several times per request)."""
    return typing.get_origin(hint), typing.get_args(hint)


def mismatch(value: Any, hint: Any) -> str | None:
    """None when `value` fits `hint`; otherwise a phrase saying what it must be."""
    if hint is Any:
        return None
    origin, args = _parts(hint)
    if origin is Union or origin is types.UnionType:
        options = [a for a in args if a is not type(None)]
        if value is None and len(options) < len(args):
            return None
        whys = [mismatch(value, a) for a in options]
        if any(w is None for w in whys):
            return None
        why = " or ".join(w.removeprefix("must be ") for w in whys if w)
        return f"must be {why}" + (" (or None)" if len(options) < len(args) else "")
    if origin is Literal:
        choices = args
        # `type(...) is` as well: 1 == True, but the option "1" is not the flag True.
        if any(value == c and type(value) is type(c) for c in choices):
            return None
        return f"must be one of {describe_choices(choices)}"
    if origin is tuple:
        item = args[0]
        if not isinstance(value, tuple):
            return f"must be a list of {_noun(item)}"
        bad = next((v for v in value if mismatch(v, item) is not None), _NOTHING)
        return None if bad is _NOTHING else f"must be a list of {_noun(item)} (got {bad!r} in it)"
    if origin is not None:  # dict[str, Any], list[...]: the container type only
        return None if isinstance(value, origin) else f"must be a {origin.__name__}"
    return _scalar(value, hint)


_NOTHING = object()


def _scalar(value: Any, hint: Any) -> str | None:
    if hint is bool:
        return None if isinstance(value, bool) else "must be True or False"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "must be a number"
    if hint is str:
        return None if isinstance(value, str) else "must be a string"
    if isinstance(hint, type):
        return None if isinstance(value, hint) else f"must be a {hint.__name__}"
    return None  # an annotation this checker does not know: nothing to check


def _noun(hint: Any) -> str:
    return {bool: "booleans", int: "integers", float: "numbers", str: "strings"}.get(hint, "values")
