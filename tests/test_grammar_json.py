"""JSON-schema grammars admit only valid JSON strings (backend/grammar_json.py) and patterns
that xgrammar would write as invalid JSON are refused (sgl._json_schema.pattern_json_hazards)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from sgl.backend.grammar_json import json_schema_grammar
from sgl.constraints import build_constraint
from sgl.errors import InvalidConstraintError


def _accepts(grammar: xgr.Grammar, text: str) -> bool:
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_completed()


LENGTH = {"type": "object", "properties": {"a": {"type": "string", "minLength": 2, "maxLength": 3}},
          "required": ["a"]}


@pytest.mark.parametrize("value, ok", [
    ("ab", True), ("abc", True), ("abcd", False), ("a", False),
    ("a\x02", False), ("a\x0b", False), ("a\x00", False),  # raw control characters
    ("a\xe9", True), ("\u65e5\u672c", True),                 # any other character, raw
    # no escapes (as xgrammar's converter): the char stays one class, whose masks are cheap
    ("a\\n", False), ('a\\"', False), ("a\\u0041", False), ("a\\ud800", False),
])
def test_length_limited_strings_are_valid_json(value: str, ok: bool) -> None:
    text = '{"a": "' + value + '"}'
    assert _accepts(json_schema_grammar(json.dumps(LENGTH), indent=None), text) is ok
    if ok:
        json.loads(text)


@pytest.mark.parametrize("value, ok", [
    ("\\ud800", False), ("\\ud800x", False), ("\\udfff", False), ("\\ud83d\\ude00", True),
    ("\\u00e9", True), ("\\uD7FF", True), ("\\uE000", True), ("\x01", False),
])
def test_escapes_in_free_strings_never_make_lone_surrogates(value: str, ok: bool) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string"}, "any": {}},
              "required": ["s", "any"]}
    grammar = json_schema_grammar(json.dumps(schema), indent=None)
    assert _accepts(grammar, '{"s": "' + value + '", "any": 1}') is ok
    assert _accepts(grammar, '{"s": "x", "any": "' + value + '"}') is ok  # untyped values too


def _accepts_bytes(grammar: xgr.Grammar, data: bytes) -> bool:
    """Byte by byte (a tokenizer whose tokens are the 256 bytes), as byte-level BPE tokens
    can spell sequences that are not UTF-8."""
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)], xgr.VocabType.RAW)
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return all(matcher.accept_token(b) for b in data) and matcher.is_completed()


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "string", "maxLength": 3},
                                    {"type": "array", "items": {}}])
def test_utf8_encoded_surrogates_are_not_characters(schema: dict) -> None:
    """xgrammar reads ED A0 80 (U+D800 encoded) as one character; the detokenizer writes it as
    three U+FFFD, so a maxLength=3 string could come back longer than 3."""
    grammar = json_schema_grammar(json.dumps(schema), indent=None)
    wrap = (lambda s: b"[" + s + b"]") if schema["type"] == "array" else (lambda s: s)
    assert not _accepts_bytes(grammar, wrap(b'"\xed\xa0\x80"'))
    assert _accepts_bytes(grammar, wrap(b'"\xed\x9f\xbf"'))  # U+D7FF, the last before them
    assert _accepts_bytes(grammar, wrap('"é"'.encode()))


def test_bundled_json_grammar_strings_are_strict() -> None:
    from sgl.constraints import load_grammar

    grammar = xgr.Grammar.from_ebnf(load_grammar("json")[1])
    for data, ok in [(b'["\xed\xa0\x80"]', False), (b'["\x01"]', False),
                     (b'["\\ud800"]', False), (b'["\\ud83d\\ude00", 1]', True), (b'{"a": "\xc3\xa9"}', True)]:
        assert _accepts_bytes(grammar, data) is ok, data


def test_patched_grammar_keeps_the_schema_language() -> None:
    schema = {"type": "object", "properties": {
        "e": {"enum": ["x", "y\u00e9", 3]}, "n": {"type": "number", "minimum": 0.5, "maximum": 9.5},
        "p": {"type": "string", "pattern": "^[a-z .]+$"}, "m": {"type": "string", "format": "email"},
        "l": {"type": "array", "items": {"type": "integer"}, "minItems": 1}},
        "required": ["e", "n", "p", "m", "l"]}
    grammar = json_schema_grammar(json.dumps(schema), indent=2)
    good = {"e": "y\u00e9", "n": 9.5, "p": "a b.", "m": "a@b.co", "l": [1, -2]}
    assert _accepts(grammar, json.dumps(good, indent=2, ensure_ascii=False))
    for bad in ({**good, "n": 9.6}, {**good, "p": "A"}, {**good, "l": []}, {**good, "e": "z"}):
        assert not _accepts(grammar, json.dumps(bad, indent=2, ensure_ascii=False))


@pytest.mark.parametrize("pattern, char", [
    (r"^a\nb$", "\n"), (r"^a\x02$", "\x02"), (r'^a"$', '"'), (r"^a\u0001$", "\x01"),
    (r"^[\x01-\x05]$", "\x01"), (r"^a\cA$", "\x01"), (r"^[\t]+$", "\t"),
])
def test_patterns_naming_escaped_characters_are_refused(pattern: str, char: str) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "string", "pattern": pattern}}}
    with pytest.raises(InvalidConstraintError, match="#/properties/x/pattern") as info:
        build_constraint(json_schema=schema)
    assert repr(char) in str(info.value) and info.value.field == "json_schema"
    with pytest.raises(ValueError, match="must escape"):  # a spec that skipped sgl.constraints
        json_schema_grammar(json.dumps(schema), indent=2)


@pytest.mark.parametrize("pattern", [
    r"^[ -~]+$", r"^[\w\s]+$", r"^a.b$", r"^[^\x00-\x1f]+$", r"^a\\nb$", r"^\d{3}-\d{4}$",
    r"^[\x00-\x7f]+$", r"^[!-$]$",
])
def test_patterns_whose_sets_are_narrowed_by_xgrammar_are_accepted(pattern: str) -> None:
    schema = {"type": "string", "pattern": pattern}
    assert build_constraint(json_schema=schema) is not None
    json_schema_grammar(json.dumps(schema), indent=2)


def test_the_engines_kernel_set_applies_the_grammar_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels="reference" reaches the sampler's mask: the reference bitmask op runs."""
    from tiny_engines import tokenized_tiny_engine

    from sgl.backend.kernels import token_bitmask

    calls: list[int] = []
    reference = token_bitmask.apply_token_bitmask_reference

    def spy(logits, bitmask, indices=None):  # type: ignore[no-untyped-def]
        calls.append(logits.shape[0])
        reference(logits, bitmask, indices)

    monkeypatch.setattr(token_bitmask, "apply_token_bitmask_reference", spy)
    engine = tokenized_tiny_engine(kernels="reference")
    try:
        out = engine.generate_sync("Pick", max_new_tokens=4, temperature=1.0, regex="[ab]{3}")
    finally:
        engine.close()
    assert len(out.text) == 3 and set(out.text) <= {"a", "b"}
    assert calls, "the reference bitmask kernel never ran"
