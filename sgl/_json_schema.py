"""JSON Schema documents as the constraint front end needs them (`sgl.constraints`).

Three things a schema goes through before it becomes a `ConstraintSpec`: a Pydantic model or
type is turned into a schema and a parser; every schema is checked for keywords the engine
accepts but cannot enforce; and it is written as one canonical text, the grammar cache key.
They live apart from the spec because they only read and write schema documents: no options,
no spec, no grammar files.

Pure Python like `sgl.constraints`: pydantic is imported only when a type is converted.
"""

from __future__ import annotations

import json
from collections import abc
from typing import Any, Callable, Mapping

from sgl.errors import InvalidConstraintError

__all__ = ["canonical_json", "nesting_depth", "pattern_json_hazards", "type_name",
           "type_json_schema", "unenforceable_keywords"]


# -- size of a document -------------------------------------------------------------------------


def nesting_depth(document: Any, stop_above: int) -> int:
    """How deeply objects and arrays nest in a JSON document (a scalar is 0, `{}` is 1).

    Iterative, so a hostile document cannot exhaust Python's stack here, and it stops as soon
    as the depth passes `stop_above` (returning stop_above + 1): the walkers below recurse,
    and xgrammar's schema compiler grows super-linearly with depth (700 levels: 83 s, 1.7 GB),
    so the depth is checked first.
    """
    deepest = 0
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, abc.Mapping):
            children: Any = value.values()
        elif isinstance(value, (list, tuple)):
            children = value
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > stop_above:
            return deepest
        # Scalars are skipped here: an enum of 200,000 strings must cost milliseconds.
        stack.extend((child, depth + 1) for child in children if not isinstance(child, _SCALARS))
    return deepest


_SCALARS = (str, int, float, bool, type(None))

# -- JSON Schema keywords xgrammar accepts but does not enforce --------------------------------
# Found by compiling a schema with each keyword and checking that a violating document is still
# accepted (xgrammar 0.2.9). Everything else it either enforces or rejects at compile time.
_IGNORED = "is ignored"
_UNENFORCED = {
    "uniqueItems": "duplicates are not prevented", "if": _IGNORED, "then": _IGNORED,
    "else": _IGNORED, "not": _IGNORED, "dependentRequired": _IGNORED,
    "dependentSchemas": _IGNORED, "dependencies": _IGNORED, "contains": _IGNORED,
    "minContains": _IGNORED, "maxContains": _IGNORED, "contentEncoding": _IGNORED,
    "contentMediaType": _IGNORED, "contentSchema": _IGNORED,
}
_ENFORCED_FORMATS = frozenset(
    "email date time date-time duration uri uri-reference uri-template uuid ipv4 ipv6 "
    "hostname json-pointer relative-json-pointer".split()
)
# Keywords whose values are maps of name -> subschema, or lists of subschemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_SINGLE = (
    "items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
    "propertyNames", "contains", "not", "if", "then", "else", "additionalItems",
)


def unenforceable_keywords(schema: Any, path: str = "#") -> list[tuple[str, str, str]]:
    """(keyword, JSON pointer, why) for every keyword that decoding would not enforce."""
    found: list[tuple[str, str, str]] = []
    if not isinstance(schema, Mapping):
        return found
    for key, why in _UNENFORCED.items():
        if key in schema:
            found.append((key, f"{path}/{key}", why))
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in _ENFORCED_FORMATS:
        found.append(("format", f"{path}/format", f"format {fmt!r} is not checked"))
    multiple = schema.get("multipleOf")
    if multiple is not None and (schema.get("type") != "integer" or not isinstance(multiple, int)):
        found.append(("multipleOf", f"{path}/multipleOf", "only integer multipleOf is enforced"))
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        found.append(("allOf", f"{path}/allOf", "only one branch of allOf is enforced"))
    for key in _SCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, Mapping):
            for name, child in sub.items():
                found += unenforceable_keywords(child, f"{path}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, child in enumerate(sub):
                found += unenforceable_keywords(child, f"{path}/{key}/{i}")
    for key in _SCHEMA_SINGLE:
        found += unenforceable_keywords(schema.get(key), f"{path}/{key}")
    return found


# -- patterns xgrammar would write as invalid JSON ------------------------------------------------
# xgrammar writes a string with a `pattern` by matching the pattern against the raw characters
# between the quotes, with no JSON escapes. Character sets (`.`, `\s`, `[^a]`, wide ranges) are
# filtered to the characters JSON allows raw, but a character the pattern names on its own
# (`\n`, `\x01`, `"`, a class with no safe member such as `[\x01-\x05]`) is written raw: the
# document is then invalid JSON. Such patterns are refused before compiling (xgrammar 0.2.9).

_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "v": "\v", "f": "\f", "0": "\0"}
_CLASS_ESCAPES = frozenset("dDwWsSbB")  # sets (and anchors), not single characters


def _unsafe(code: int) -> bool:
    return code < 0x20 or code == 0x22  # control characters and the quote


def _pattern_atom(pattern: str, i: int, in_class: bool) -> tuple[int | None, int]:
    """The code point pattern[i:] names (None for a set or an anchor) and where it ends."""
    ch = pattern[i]
    if ch != "\\" or i + 1 >= len(pattern):
        return ord(ch), i + 1
    nxt = pattern[i + 1]
    if nxt in _SIMPLE_ESCAPES:
        return ord(_SIMPLE_ESCAPES[nxt]), i + 2
    if nxt == "b" and in_class:
        return 8, i + 2  # backspace inside a class
    if nxt == "c" and i + 2 < len(pattern) and pattern[i + 2].isalpha():
        return ord(pattern[i + 2]) % 32, i + 3
    for prefix, digits in (("x", 2), ("u", 4)):
        text = pattern[i + 2 : i + 2 + digits]
        if nxt == prefix and len(text) == digits and all(c in "0123456789abcdefABCDEF" for c in text):
            return int(text, 16), i + 2 + digits
    if nxt == "u" and pattern[i + 2 : i + 3] == "{":
        end = pattern.find("}", i + 3)
        if end > 0:
            try:
                return int(pattern[i + 3 : end], 16), end + 1
            except ValueError:
                pass
    if nxt in _CLASS_ESCAPES or nxt.isdigit():
        return None, i + 2  # a set, an anchor or a back-reference: not one named character
    return ord(nxt), i + 2  # an escaped literal: \" \. \\ ...


def _pattern_unsafe_chars(pattern: str) -> list[int]:
    """Code points of unsafe characters that xgrammar would write raw for `pattern`: those
    named outside classes, and those of a positive class with no safe member at all (a class
    with one is filtered to its safe members; a negated class is always filtered)."""
    found: list[int] = []
    i = 0
    while i < len(pattern):
        if pattern[i] != "[":
            code, i = _pattern_atom(pattern, i, False)
            if code is not None and _unsafe(code):
                found.append(code)
            continue
        negated = pattern[i + 1 : i + 2] == "^"
        i += 2 if negated else 1
        members, has_safe = [], False
        while i < len(pattern) and pattern[i] != "]":
            low, i = _pattern_atom(pattern, i, True)
            high = low
            if pattern[i : i + 1] == "-" and pattern[i + 1 : i + 2] not in ("", "]") and low is not None:
                high, i = _pattern_atom(pattern, i + 1, True)
            if low is None or high is None:
                has_safe = True  # \w, \s, \d...: sets with safe members
                continue
            span = range(low, min(high, 0x23) + 1)
            members += [c for c in span if _unsafe(c)]
            has_safe = has_safe or high > 0x22 or any(not _unsafe(c) for c in span)
        i += 1
        if not negated and not has_safe:
            found += members
    return found


def pattern_json_hazards(schema: Any, path: str = "#") -> list[tuple[str, str]]:
    """(JSON pointer of a `pattern`, the character) for every pattern that names a character
    JSON must escape (see above); each would let a generated string be invalid JSON."""
    found: list[tuple[str, str]] = []
    if not isinstance(schema, Mapping):
        return found
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        found += [(f"{path}/pattern", chr(code)) for code in dict.fromkeys(_pattern_unsafe_chars(pattern))]
    for key in _SCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, Mapping):
            for name, child in sub.items():
                found += pattern_json_hazards(child, f"{path}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, child in enumerate(sub):
                found += pattern_json_hazards(child, f"{path}/{key}/{i}")
    for key in _SCHEMA_SINGLE:
        found += pattern_json_hazards(schema.get(key), f"{path}/{key}")
    return found


# -- canonical text -----------------------------------------------------------------------------


def canonical_json(schema: Any) -> str:
    """One text per schema, for cache keys: keyword order is sorted, but the order inside
    `properties` is kept (it is the order the model writes the keys in, which matters: e.g.
    reasoning before answer) and data (enum, const, default, examples) is kept verbatim."""
    return json.dumps(_canonical_schema(schema), separators=(",", ":"), ensure_ascii=False)


def _canonical_schema(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_canonical_schema(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key in sorted(schema):
        value = schema[key]
        if key == "properties" and isinstance(value, Mapping):
            out[key] = {name: _canonical_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_MAPS and isinstance(value, Mapping):
            out[key] = {name: _canonical_schema(value[name]) for name in sorted(value)}
        elif key in _SCHEMA_LISTS or key in _SCHEMA_SINGLE:
            out[key] = _canonical_schema(value)
        else:
            out[key] = value  # data or a scalar keyword: verbatim
    return out


# -- Python types -------------------------------------------------------------------------------


def type_name(tp: Any) -> str:
    """How messages name a `schema=` type."""
    return getattr(tp, "__name__", None) or repr(tp)


def type_json_schema(tp: Any) -> tuple[dict[str, Any], Callable[[str], Any]]:
    """The JSON schema of a Pydantic model or of any type `pydantic.TypeAdapter` accepts, and
    the parser that validates generated JSON text into that type."""
    try:
        import pydantic
    except ImportError as exc:  # pragma: no cover - pydantic is a dependency
        raise InvalidConstraintError("schema= needs pydantic installed", field="schema") from exc
    try:
        if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):
            return tp.model_json_schema(), tp.model_validate_json
        adapter = pydantic.TypeAdapter(tp)
        return adapter.json_schema(), adapter.validate_json
    except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError, TypeError) as exc:
        raise InvalidConstraintError(
            f"schema={type_name(tp)}: cannot build a JSON schema for it ({exc}); pass a Pydantic "
            f"model or a type pydantic.TypeAdapter accepts",
            field="schema",
        ) from exc
