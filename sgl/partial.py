"""Partial objects: the part of a streamed JSON value that is complete so far, typed.

    async for chunk in engine.stream(prompt, schema=Person):
        chunk.partial      # Partial[Person]: name="Ada", age=None (not written yet), ...

`partial_type(Person)` is a model with the same fields, every one optional (None until it is
complete), nested models, lists and dicts of models made partial too; built once per model.
`parse_partial(text, Person)` reads the JSON prefix with pydantic_core's partial parser
(`from_json(..., allow_partial=True)`: it closes open arrays and objects and drops an
unfinished string, key or literal) after cutting a trailing number, which could still grow
("12" of "125"). So a field is present only once its value is final. The grammar guarantees
the prefix is a prefix of a valid document, so the result is exact, not a guess.
"""

from __future__ import annotations

import functools
import re
import types
import typing
from typing import Any

__all__ = ["partial_type", "parse_partial"]

_TRAILING_NUMBER = re.compile(r"-?[0-9][0-9.eE+\-]*$|-$")


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and hasattr(tp, "model_fields") and hasattr(tp, "model_validate")


def _partial_annotation(tp: Any) -> Any:
    """`tp` with every model inside it replaced by its partial type."""
    if _is_model(tp):
        return partial_type(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:  # keep the type, drop the constraints (a prefix may break them)
        return _partial_annotation(args[0])
    if not args:
        return tp
    new_args = tuple(_partial_annotation(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return typing.Union[new_args]  # type: ignore[return-value]
    if origin in (list, set, frozenset, tuple, dict):
        if origin is tuple and new_args[-1] is not Ellipsis:
            return tuple[tuple(typing.Optional[a] for a in new_args)]  # type: ignore[misc]
        return origin[new_args if len(new_args) > 1 else new_args[0]]
    return tp


@functools.lru_cache(maxsize=256)
def partial_type(model: type) -> type:
    """The partial model of `model` (cached): same field names, all optional, default None."""
    import pydantic

    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        annotation = _partial_annotation(info.annotation)
        fields[name] = (typing.Optional[annotation], pydantic.Field(default=None, alias=info.alias))
    config = pydantic.ConfigDict(extra="ignore", populate_by_name=True)
    return pydantic.create_model(f"Partial{model.__name__}", __config__=config, **fields)


def parse_partial(text: str, model: type) -> Any:
    """The partial object of a JSON prefix, or None when nothing of it is complete yet."""
    from pydantic_core import from_json

    prefix = _TRAILING_NUMBER.sub("", text.rstrip()) if not text.rstrip().endswith(("}", "]")) else text
    if not prefix.strip():
        return None
    try:
        value = from_json(prefix, allow_partial=True)
    except ValueError:
        return None  # e.g. the document is only an opening quote so far
    if not isinstance(value, dict):
        return None
    try:
        return partial_type(model).model_validate(value)
    except Exception:  # noqa: BLE001 - a prefix the partial model cannot hold yet (e.g. a bad enum)
        return None
