"""Constraints: every way a user can restrict the output, normalised to one spec.

`gen(regex=...)`, `json_schema=`, `schema=` (a Pydantic model or any type a pydantic
`TypeAdapter` accepts), `grammar=` (EBNF text or the name of a file in `grammars/`),
`choices=` and `dtype=` all become one `ConstraintSpec` of kind "regex", "json_schema" or
"ebnf": the three kinds the engine compiles (with xgrammar, in `sgl.backend.grammar`).

This module is pure Python: it must not import torch or xgrammar, so `import sgl` stays
light. Pydantic is imported lazily, only when `schema=` is used. Whether a spec *compiles* is
decided engine-side (`GrammarBackend.compile_async`, awaited in `generate` before anything is
queued); here we only normalise, detect conflicting options, enforce the size limits that are
cheap to check before compiling (`ConstraintLimits`: source bytes, JSON schema nesting) and
warn about JSON Schema keywords the engine accepts but cannot enforce. What is done to a
schema document itself (Pydantic type -> schema, canonical text, nesting depth, the unenforced
keywords) lives in `sgl._json_schema`.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

from sgl._json_schema import (
    canonical_json,
    nesting_depth,
    pattern_json_hazards,
    type_json_schema,
    type_name,
    unenforceable_keywords,
)
from sgl.errors import InvalidConstraintError, ParseError

__all__ = [
    "ConstraintKind",
    "ConstraintLimits",
    "ConstraintSpec",
    "UnenforceableSchemaWarning",
    "build_constraint",
    "escape_regex",
    "grammar_names",
    "load_grammar",
    "pattern_json_hazards",
    "unenforceable_keywords",
]

ConstraintKind = Literal["regex", "json_schema", "ebnf"]


class UnenforceableSchemaWarning(UserWarning):
    """A JSON Schema keyword is accepted but not enforced while decoding (see the message)."""


# Characters that are special in the regex dialect xgrammar compiles (ECMAScript-like).
_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}/-")


def escape_regex(text: str) -> str:
    """Escape a literal for a regex; unlike re.escape it only touches real metacharacters."""
    return "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in text)


# -- the spec -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConstraintSpec:
    """One compiled-to-be constraint: `kind` and `text` are all the engine needs.

    `text` is canonical (a JSON schema's keywords are sorted, its property order kept), so
    `(kind, text)` is a good cache key. `source` names the option that produced it, for
    messages. The parser, when present, turns generated text into a typed value (`parse`).
    `compiled` is the engine's compiled grammar once `sgl.Engine` has compiled the spec
    (opaque here); holding it keeps the grammar alive until the request is queued.
    """

    kind: ConstraintKind
    text: str
    source: str = ""
    parser: Callable[[str], Any] | None = field(default=None, compare=False, repr=False)
    compiled: Any = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.text)

    @property
    def spec(self) -> str:  # the name SamplingParams and GrammarBackend.compile use
        return self.text

    def sampling_kwargs(self) -> dict[str, str]:
        """The matching `SamplingParams` field: {"regex"|"json_schema"|"ebnf": text}."""
        return {self.kind: self.text}

    def parse(self, text: str, finish_reason: str | None = None) -> Any:
        """Turn generated text into the typed value, or raise ParseError naming the cause.

        Without a parser (regex / EBNF given as text) the text is returned unchanged; a
        json_schema without a Python type parses to plain JSON values.
        """
        if finish_reason == "length" and not self._complete_despite_length(text):
            # The grammar had not ended, so the text may be a prefix of the value even when it
            # parses: dtype=int cut at "1000" of "100000" must not come back as 1000.
            raise ParseError(_truncated_message(self.source, text, self._parse_verdict(text)))
        parser = self.parser
        if parser is None:
            if self.kind != "json_schema":
                return text
            parser = json.loads
        try:
            return parser(text)
        except Exception as exc:  # pydantic.ValidationError, ValueError, JSONDecodeError, ...
            raise ParseError(
                f"output does not validate against {self.source}: {exc}. "
                f"Output was {_preview(text)}"
            ) from exc

    def _complete_despite_length(self, text: str) -> bool:
        """A JSON document whose last character closes an object, array or string is complete
        (nothing may follow it but EOS), even if max_new_tokens hit before the EOS. Any other
        text cut by the length limit might have continued (a number, a regex like [0-9]+)."""
        if self.kind != "json_schema" or not text.rstrip().endswith(("}", "]", '"')):
            return False
        try:
            json.loads(text)
        except ValueError:
            return False
        return True

    def _parse_verdict(self, text: str) -> str:
        """What the parser makes of a truncated text, for the error message."""
        parser = self.parser or (json.loads if self.kind == "json_schema" else None)
        if parser is None:
            return "no parse attempted"
        try:
            parser(text)
        except Exception as exc:
            return str(exc)
        return "the prefix parses, but it is not the whole value"


def _preview(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _truncated_message(source: str, text: str, cause: str) -> str:
    return (
        f"output for {source} was truncated: generation stopped at max_new_tokens "
        f"(finish_reason='length') before the constraint was complete, so it cannot be "
        f"parsed; raise max_new_tokens. Parser said: {cause}. Output was {_preview(text)}"
    )


# -- grammars/ lookup ---------------------------------------------------------------------------

_GRAMMAR_SUFFIXES = {".ebnf": "ebnf", ".gbnf": "ebnf", ".json": "json_schema"}
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def _grammar_dirs() -> list[Any]:
    """Where grammar files live: the `sgl.grammars` package data in a wheel, or the repo's
    `grammars/` folder in an editable install (where the data package is not importable,
    because setuptools' editable finder does not resolve namespace sub-packages)."""
    found: list[Any] = []
    try:
        found.append(resources.files("sgl.grammars"))
    except (ModuleNotFoundError, TypeError):
        pass
    here = Path(__file__).resolve().parent
    for candidate in (here / "grammars", here.parent / "grammars"):
        if candidate.is_dir():
            found.append(candidate)
    return found


def grammar_names() -> list[str]:
    """Names accepted by `grammar=` (file stems in grammars/), sorted."""
    files = [entry.name for folder in _grammar_dirs() for entry in folder.iterdir()]
    return sorted({name.rsplit(".", 1)[0] for name in files
                   if "." + name.rsplit(".", 1)[-1] in _GRAMMAR_SUFFIXES})


def load_grammar(name: str) -> tuple[ConstraintKind, str]:
    """Read grammars/<name>.ebnf (or .gbnf / .json) and return (kind, text)."""
    for folder in _grammar_dirs():
        for suffix, kind in _GRAMMAR_SUFFIXES.items():
            entry = folder / (name + suffix)
            if entry.is_file():
                text = entry.read_text(encoding="utf-8")
                if kind == "json_schema":
                    return "json_schema", canonical_json(json.loads(text))
                return kind, text  # type: ignore[return-value]
    raise InvalidConstraintError(
        f"grammar={name!r} is neither EBNF text (it has no '::=' rule) nor the name of a "
        f"bundled grammar; bundled grammars: {grammar_names()}",
        field="grammar",
    )


def _warn_unenforceable(schema: Any, source: str,
                        found: list[tuple[str, str, str]] | None = None) -> None:
    for keyword, pointer, why in unenforceable_keywords(schema) if found is None else found:
        warnings.warn(
            f"{source}: JSON Schema keyword {keyword!r} at {pointer} is not enforced during "
            f"decoding ({why}); validate the output yourself (schema= does, on parse)",
            UnenforceableSchemaWarning,
            stacklevel=4,
        )


def _refuse_pattern_hazards(schema: Any, source: str, field_name: str,
                            hazards: list[tuple[str, str]] | None = None) -> None:
    """A `pattern` that names a character JSON must escape would let xgrammar write invalid
    JSON (sgl._json_schema.pattern_json_hazards): refuse it, naming the pattern."""
    hazards = pattern_json_hazards(schema) if hazards is None else hazards
    if hazards:
        pointer, char = hazards[0]
        raise InvalidConstraintError(
            f"{source}: the pattern at {pointer} requires the character {char!r}, which a JSON "
            f"string must escape; constrained decoding writes pattern characters unescaped, so "
            f"the output would be invalid JSON. Remove {char!r} from the pattern (sets such as "
            f"\\s or [^a] are fine: they are narrowed to characters JSON allows)",
            field=field_name)


# -- limits -------------------------------------------------------------------------------------

# Without configured limits, schemas are still refused past this depth: the document walkers
# here recurse, and Python's recursion limit would fail with a RecursionError instead.
_WALKABLE_DEPTH = 512


@dataclass(frozen=True)
class ConstraintLimits:
    """How large a constraint may be before it is compiled; the engine options of the same
    names (`sgl.Engine(max_grammar_bytes=..., max_json_schema_depth=...)`). None: no limit."""

    max_grammar_bytes: int | None = None
    max_json_schema_depth: int | None = None

    def check_size(self, text: str | bytes, what: str, field_name: str) -> None:
        limit = self.max_grammar_bytes
        if limit is None or len(text) <= limit // 4:  # even all 4-byte characters would fit
            return
        if isinstance(text, bytes):
            if len(text) <= limit:
                return
            size = f"{len(text)} bytes"
        elif len(text) > limit:  # over already in characters: no need to encode it all
            size = f"{len(text)} characters"
        else:
            encoded = len(text.encode("utf-8", "surrogatepass"))
            if encoded <= limit:
                return
            size = f"{encoded} bytes"
        raise InvalidConstraintError(
            f"{what} is {size}, over the limit of {limit} bytes (engine option "
            f"max_grammar_bytes): shorten it, or raise max_grammar_bytes", field=field_name)

    def check_depth(self, schema: Any, what: str, field_name: str, depth: int | None = None) -> None:
        """`depth`: the schema's nesting depth when known (counted up to past _WALKABLE_DEPTH)."""
        limit = min(self.max_json_schema_depth or _WALKABLE_DEPTH, _WALKABLE_DEPTH)
        if (nesting_depth(schema, limit) if depth is None else depth) > limit:
            raise InvalidConstraintError(
                f"{what} nests objects and arrays more than {limit} deep (engine option "
                f"max_json_schema_depth): flatten it, e.g. share repeated parts through $defs "
                f"and $ref, or raise max_json_schema_depth", field=field_name)


_NO_LIMITS = ConstraintLimits()


# -- build_constraint ---------------------------------------------------------------------------


def build_constraint(
    *,
    regex: str | None = None,
    json_schema: str | Mapping[str, Any] | None = None,
    schema: Any = None,
    grammar: str | None = None,
    choices: Sequence[str] | None = None,
    dtype: type | None = None,
    limits: ConstraintLimits | None = None,
) -> ConstraintSpec | None:
    """Normalise the constraint options of `gen`/`generate` into one spec (or None).

    At most one option may be given; conflicting ones raise InvalidConstraintError naming
    them, as does a spec over `limits` (checked before the expensive steps: a JSON text's
    size before it is parsed, a schema's depth before it is walked). Unenforceable JSON
    Schema keywords are reported with UnenforceableSchemaWarning.
    """
    options = {"regex": regex, "json_schema": json_schema, "schema": schema,
               "grammar": grammar, "choices": choices, "dtype": dtype}
    given = {name: value for name, value in options.items() if value is not None}
    if not given:
        return None
    if len(given) > 1:
        names = sorted(given)
        raise InvalidConstraintError(
            f"conflicting constraints {names}: give only one of regex=, json_schema=, "
            f"schema=, grammar=, choices=, dtype=",
            field=names[1],
        )
    (name, value), = given.items()
    limits = limits or _NO_LIMITS
    spec = _BUILDERS[name](value, limits)
    limits.check_size(spec.text, f"the {_KIND_NAMES[spec.kind]} from {name}=", name)
    return spec


_KIND_NAMES = {"regex": "regex", "json_schema": "JSON schema", "ebnf": "EBNF grammar"}


def _from_regex(regex: Any, limits: ConstraintLimits) -> ConstraintSpec:
    if not isinstance(regex, str) or not regex:
        raise InvalidConstraintError(f"regex={regex!r}: must be a non-empty string", field="regex")
    return ConstraintSpec("regex", regex, source=f"regex {regex!r}")


def _from_json_schema(value: Any, limits: ConstraintLimits) -> ConstraintSpec:
    parsed = value
    if isinstance(value, (str, bytes)):
        limits.check_size(value, "json_schema", "json_schema")  # before parsing it
        try:
            parsed = json.loads(value)
        except RecursionError as exc:
            raise InvalidConstraintError(
                "json_schema nests objects and arrays too deeply to parse; flatten it",
                field="json_schema") from exc
        except ValueError as exc:
            raise InvalidConstraintError(f"json_schema is not valid JSON ({exc}); pass a dict "
                                         "or a JSON string", field="json_schema") from exc
    if not isinstance(parsed, Mapping):
        raise InvalidConstraintError(
            f"json_schema must be a JSON object (dict), got {type(parsed).__name__}",
            field="json_schema",
        )
    limits.check_depth(parsed, "json_schema", "json_schema")
    _refuse_pattern_hazards(parsed, "json_schema", "json_schema")
    _warn_unenforceable(parsed, "json_schema")
    return ConstraintSpec("json_schema", canonical_json(parsed), source="json_schema")


@dataclass(frozen=True)
class _TypeSchema:
    """What a `schema=` type's JSON schema yields, computed once per type (`_type_schema`)."""

    document: dict[str, Any]
    parser: Callable[[str], Any]
    depth: int  # nesting depth, counted up to just past _WALKABLE_DEPTH
    # None when deeper than _WALKABLE_DEPTH (refused by the depth check: never walked)
    text: str | None
    hazards: list[tuple[str, str]] | None
    unenforced: list[tuple[str, str, str]] | None


def _walk_type_schema(tp: Any) -> _TypeSchema:
    document, parser = type_json_schema(tp)
    depth = nesting_depth(document, _WALKABLE_DEPTH)
    if depth > _WALKABLE_DEPTH:
        return _TypeSchema(document, parser, depth, None, None, None)
    return _TypeSchema(document, parser, depth, canonical_json(document),
                       pattern_json_hazards(document), unenforceable_keywords(document))


# A program sends the same few types with every request: Pydantic's schema generation and the
# walks over its document cost ~5-10 ms a request (measured on the 2-core VM), on the caller's
# event loop. Types are hashable; one that is not (Annotated with unhashable metadata) is
# walked each time. (A class rebuilt under the same object, e.g. by `model_rebuild`, keeps its
# first schema here.)
_type_schema = functools.lru_cache(maxsize=256)(_walk_type_schema)


def _from_schema(tp: Any, limits: ConstraintLimits) -> ConstraintSpec:
    try:
        hash(tp)
    except TypeError:  # unhashable (Annotated with unhashable metadata): walked, not cached
        ts = _walk_type_schema(tp)
    else:
        ts = _type_schema(tp)
    source = f"schema {type_name(tp)}"
    limits.check_depth(ts.document, f"the JSON schema of {source}", "schema", depth=ts.depth)
    assert ts.text is not None  # (a document past _WALKABLE_DEPTH was refused just above)
    _refuse_pattern_hazards(ts.document, source, "schema", ts.hazards)
    _warn_unenforceable(ts.document, source, ts.unenforced)
    return ConstraintSpec("json_schema", ts.text, source=source, parser=ts.parser)


def _from_grammar(grammar: Any, limits: ConstraintLimits) -> ConstraintSpec:
    if not isinstance(grammar, str) or not grammar.strip():
        raise InvalidConstraintError(
            f"grammar={grammar!r}: must be EBNF text or a bundled grammar name "
            f"({grammar_names()})",
            field="grammar",
        )
    if "::=" not in grammar and _NAME_RE.match(grammar.strip()):
        kind, text = load_grammar(grammar.strip())
        return ConstraintSpec(kind, text, source=f"grammar {grammar.strip()!r}")
    return ConstraintSpec("ebnf", grammar, source="grammar")


def _from_choices(choices: Any, limits: ConstraintLimits) -> ConstraintSpec:
    if isinstance(choices, str) or not isinstance(choices, Sequence) or not choices or not all(
        isinstance(choice, str) and choice for choice in choices
    ):
        raise InvalidConstraintError(
            f"choices={choices!r}: must be a non-empty list of non-empty strings", field="choices"
        )
    # Longest first, so a choice that prefixes another is not preferred by the alternation.
    ordered = sorted(dict.fromkeys(choices), key=len, reverse=True)
    regex = "(" + "|".join(escape_regex(c) for c in ordered) + ")"
    allowed = frozenset(choices)

    def parse_choice(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"{text!r} is not one of {list(choices)}")
        return text

    return ConstraintSpec("regex", regex, source=f"choices {list(choices)}", parser=parse_choice)


def _parse_bool(text: str) -> bool:
    if text.strip().lower() not in ("true", "false"):
        raise ValueError(f"{text!r} is not True or False")
    return text.strip().lower() == "true"


# Numbers are JSON-style (no leading zeros, no "+"), so int()/float() always parse them. A str
# is a JSON string literal (parsed with json.loads): the closing quote makes its end explicit.
_DTYPES: dict[type, tuple[str, Callable[[str], Any]]] = {
    int: (r"-?(0|[1-9][0-9]*)", int),
    float: (r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?", float),
    bool: (r"(True|False)", _parse_bool),
    str: (r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"', json.loads),
}


def _from_dtype(dtype: Any, limits: ConstraintLimits) -> ConstraintSpec:
    if not any(dtype is known for known in _DTYPES):
        raise InvalidConstraintError(f"dtype={dtype!r}: must be int, float, bool or str",
                                     field="dtype")
    regex, parser = _DTYPES[dtype]
    return ConstraintSpec("regex", regex, source=f"dtype {dtype.__name__}", parser=parser)


_BUILDERS: dict[str, Callable[[Any, ConstraintLimits], ConstraintSpec]] = {
    "regex": _from_regex, "json_schema": _from_json_schema, "schema": _from_schema,
    "grammar": _from_grammar, "choices": _from_choices, "dtype": _from_dtype,
}
