"""Front end of constraints (sgl.constraints): pure Python, no tokenizer, no engine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings

import pydantic
import pytest

from sgl.constraints import (
    ConstraintSpec,
    UnenforceableSchemaWarning,
    build_constraint,
    grammar_names,
    unenforceable_keywords,
)
from sgl.errors import InvalidConstraintError, ParseError


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_import_stays_light() -> None:
    code = (
        "import sys, sgl.constraints\n"
        "heavy = [m for m in ('torch', 'xgrammar', 'pydantic', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_option_gives_none() -> None:
    assert build_constraint() is None


def test_each_option_normalises_to_one_kind() -> None:
    assert build_constraint(regex="a+").key == ("regex", "a+")
    assert build_constraint(json_schema={"type": "integer"}).kind == "json_schema"
    assert build_constraint(schema=Person).kind == "json_schema"
    assert build_constraint(grammar='root ::= "x"').key == ("ebnf", 'root ::= "x"')
    assert build_constraint(choices=["a", "b"]).kind == "regex"
    assert build_constraint(dtype=int).kind == "regex"
    assert build_constraint(regex="a+").sampling_kwargs() == {"regex": "a+"}
    assert build_constraint(grammar="json").sampling_kwargs().keys() == {"ebnf"}


@pytest.mark.parametrize(
    "options",
    [
        {"regex": "a", "json_schema": {}},
        {"schema": Person, "choices": ["a"]},
        {"grammar": "json", "dtype": int},
    ],
)
def test_conflicting_options_are_named(options: dict) -> None:
    with pytest.raises(InvalidConstraintError) as info:
        build_constraint(**options)
    for name in options:
        assert name in str(info.value)


def test_json_schema_dict_and_string_share_a_canonical_key() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "string", "enum": ["y", "x"]},
                                               "a": {"const": {"z": 1, "y": 2}}}}
    as_dict = build_constraint(json_schema=schema)
    reordered = '{"properties": {"b": {"enum": ["y", "x"], "type": "string"}, ' \
        '"a": {"const": {"z": 1, "y": 2}}}, "type": "object"}'
    assert as_dict == build_constraint(json_schema=reordered)
    # Property order is the order the model writes keys in: it is kept, as is data.
    parsed = json.loads(as_dict.text)
    assert list(parsed["properties"]) == ["b", "a"]
    assert list(parsed["properties"]["a"]["const"]) == ["z", "y"]
    assert parsed["properties"]["b"]["enum"] == ["y", "x"]
    assert as_dict != build_constraint(json_schema={"type": "object", "properties": {"a": {}, "b": {}}})


def test_pydantic_field_order_is_kept() -> None:
    assert list(json.loads(build_constraint(schema=Person).text)["properties"]) == ["name", "age"]


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", 3])
def test_bad_json_schema_raises(bad: object) -> None:
    with pytest.raises(InvalidConstraintError):
        build_constraint(json_schema=bad)


def test_choices_are_escaped_literals() -> None:
    choices = ["a.b", "c+d (e)", "a.b and more", "[x]|y"]
    spec = build_constraint(choices=choices)
    pattern = re.compile(spec.text)
    for choice in choices:
        assert pattern.fullmatch(choice)
    assert not pattern.fullmatch("aXb")  # "." must be literal
    assert spec.parse("c+d (e)") == "c+d (e)"
    with pytest.raises(ParseError):
        spec.parse("zzz")


@pytest.mark.parametrize("bad", [[], "abc", ["ok", ""], ["ok", 3]])
def test_bad_choices_raise(bad: object) -> None:
    with pytest.raises(InvalidConstraintError):
        build_constraint(choices=bad)


@pytest.mark.parametrize(
    ("dtype", "good", "bad", "value"),
    [
        (int, ["0", "-12", "345"], ["01", "+1", "1.5", ""], -12),
        (float, ["0", "-1.25", "3e-5", "2.0E10"], ["1.", ".5", "01.0"], -1.25),
        (bool, ["True", "False"], ["yes", "1"], True),
        (str, ['"hi"', '"a \\"q\\" \\u00e9"', '""'], ['"unterminated', 'bare', '"a"b"'], 'a "q" \u00e9'),
    ],
)
def test_dtype_regex_and_parse(dtype: type, good: list, bad: list, value: object) -> None:
    spec = build_constraint(dtype=dtype)
    pattern = re.compile(spec.text)
    for text in good:
        assert pattern.fullmatch(text), text
        assert isinstance(spec.parse(text), dtype)
    for text in bad:
        assert not pattern.fullmatch(text), text
    assert spec.parse(good[1] if dtype is not bool else "True") == value


def test_unknown_dtype_raises() -> None:
    with pytest.raises(InvalidConstraintError, match="dtype"):
        build_constraint(dtype=list)


def test_grammar_names_resolve_to_bundled_files() -> None:
    names = grammar_names()
    assert {"json", "arithmetic", "sql_select", "function_call"} <= set(names)
    spec = build_constraint(grammar="arithmetic")
    assert spec.kind == "ebnf" and "root ::=" in spec.text


def test_unknown_grammar_name_lists_the_bundled_ones() -> None:
    with pytest.raises(InvalidConstraintError) as info:
        build_constraint(grammar="no_such_grammar")
    assert "arithmetic" in str(info.value)


def test_pydantic_schema_parses_to_a_model_instance() -> None:
    spec = build_constraint(schema=Person)
    person = spec.parse('{"name": "Ann", "age": 31}', finish_reason="stop")
    assert person == Person(name="Ann", age=31)
    with pytest.raises(ParseError, match="age"):
        spec.parse('{"name": "Ann", "age": "old"}')


def test_type_adapter_types_work() -> None:
    spec = build_constraint(schema=list[int])
    assert json.loads(spec.text)["type"] == "array"
    assert spec.parse("[1, 2]") == [1, 2]


def test_truncated_output_error_names_the_cause() -> None:
    spec = build_constraint(schema=Person)
    with pytest.raises(ParseError) as info:
        spec.parse('{"name": "Ann", "ag', finish_reason="length")
    message = str(info.value)
    assert "truncated" in message and "max_new_tokens" in message
    # The same text without the length finish is a plain validation error.
    with pytest.raises(ParseError) as info:
        spec.parse('{"name": "Ann", "ag')
    assert "truncated" not in str(info.value)


def test_plain_json_schema_parses_to_json_values() -> None:
    spec = build_constraint(json_schema={"type": "array"})
    assert spec.parse("[1, {}]") == [1, {}]
    with pytest.raises(ParseError, match="truncated"):
        spec.parse("[1, ", finish_reason="length")


def test_unenforceable_keywords_warn_with_their_path() -> None:
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "site": {"type": "string", "format": "iri"},
            "n": {"type": "number", "multipleOf": 0.5},
        },
        "if": {"required": ["tags"]},
        "then": {"required": ["n"]},
    }
    with pytest.warns(UnenforceableSchemaWarning) as record:
        build_constraint(json_schema=schema)
    messages = " | ".join(str(w.message) for w in record)
    assert "'uniqueItems' at #/properties/tags/uniqueItems" in messages
    assert "#/properties/site/format" in messages
    assert "#/properties/n/multipleOf" in messages
    assert "'if' at #/if" in messages


def test_enforced_keywords_do_not_warn() -> None:
    schema = {
        "type": "object",
        "properties": {
            "email": {"type": "string", "format": "email", "maxLength": 40},
            "n": {"type": "integer", "minimum": 0, "maximum": 9, "multipleOf": 3},
            "kind": {"enum": ["a", "b"]},
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        },
        "required": ["email"],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_constraint(json_schema=schema)
        build_constraint(schema=Person)
    assert unenforceable_keywords(schema) == []


def test_nested_defs_are_scanned() -> None:
    schema = {"$defs": {"Item": {"type": "array", "contains": {"type": "integer"}}}}
    found = unenforceable_keywords(schema)
    assert ("contains", "#/$defs/Item/contains") in [(k, p) for k, p, _ in found]


def test_spec_is_hashable_and_compares_by_kind_and_text() -> None:
    a = build_constraint(dtype=int)
    b = ConstraintSpec("regex", a.text)
    assert a == ConstraintSpec(a.kind, a.text, a.source)
    assert a.key == b.key
    assert len({a, ConstraintSpec(a.kind, a.text, a.source)}) == 1


def test_a_schema_type_is_walked_once_and_checked_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Programs send the same types with every request: Pydantic's schema generation runs once
    per type, while the per-request checks (depth limit, warnings) still run on every call."""
    import sgl.constraints as constraints
    from sgl.constraints import ConstraintLimits

    calls: list[object] = []
    real = constraints.type_json_schema
    monkeypatch.setattr(constraints, "type_json_schema", lambda tp: calls.append(tp) or real(tp))

    class Inner(pydantic.BaseModel):
        tags: list[str] = pydantic.Field(json_schema_extra={"uniqueItems": True})

    class Outer(pydantic.BaseModel):
        inner: Inner

    first = build_constraint(schema=Outer)
    with pytest.warns(UnenforceableSchemaWarning, match="uniqueItems"):
        again = build_constraint(schema=Outer)
    assert again == first and calls == [Outer]
    # The cached depth meets a tighter limit: refused, naming the option.
    with pytest.raises(InvalidConstraintError, match="max_json_schema_depth"):
        build_constraint(schema=Outer, limits=ConstraintLimits(max_json_schema_depth=2))
    assert calls == [Outer]
    assert again.parser('{"inner": {"tags": ["a"]}}') == Outer(inner=Inner(tags=["a"]))
