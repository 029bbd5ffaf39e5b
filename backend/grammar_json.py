"""JSON-schema grammars that only ever admit valid JSON strings.

    grammar = json_schema_grammar(schema_text, indent=2)   # an xgr.Grammar, ready to compile

xgrammar 0.2.9 converts a schema to EBNF itself, and three things in its string rules let a finished
output be invalid JSON (found by sampling random-weight models at temperature 1: ~3% of
"stop" outputs failed `json.loads`):

* a string with `minLength` / `maxLength` is written as `"\\"" chars{m,n} "\\""` where one
  char is `[^"\\\\\\r\\n]`: every other control character (U+0000..U+001F) is admitted raw,
  and no escape at all (so `"a\\"b"` is impossible while `"a<U+0002>b"` is possible);
* every `\\uXXXX` escape admits any four hex digits, so a lone surrogate (`"\\ud800"`) can be
  written: `json.loads` takes it, but Pydantic (and most strict parsers) reject the document;
* a raw UTF-8-encoded surrogate (bytes ED A0 80...) counts as one character, which the
  detokenizer writes as three U+FFFD: a `maxLength` string came back too long.

We keep xgrammar's converter (it knows the whole schema language) and patch its output text
before parsing it back with `Grammar.from_ebnf`: the length-limited char becomes "a character
JSON allows raw" (no control character, quote, backslash or surrogate), every `\\u` escape
becomes "a non-surrogate, or a high surrogate followed by `\\u` and a low one", and no raw
character is a surrogate code point (in unlimited strings too). xgrammar's printed grammar
parses back to the same grammar, and tests/test_grammar_json.py checks that the patched one
keeps the schema's language; when nothing needs patching the converter's grammar is used
unchanged.

A length-limited string admits no escape sequence, as in xgrammar's own converter: its char
stays one character class under `{m,n}`, which xgrammar's mask cache serves in microseconds.
"A raw character or one escape" under `{m,n}` (an alternation) measured 52 ms per mask fill
in such a string on the default tokenizer, against 0.03 ms for the class (a step's mask, on
every step inside the string, and per row of a batch). Spelling the count out as n rules
(one per characters left) kept fills fast but cost ~9 ms of compile per unit of maxLength.

Not patchable here: `pattern` strings. xgrammar writes the characters a pattern names on its
own (`\\n`, `"`, `\\x01`...) raw; such patterns are refused (`sgl._json_schema.
pattern_json_hazards`, checked by `sgl.constraints` and again here for specs that reach the
engine another way).
"""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from sgl.constraints import pattern_json_hazards

__all__ = ["json_schema_grammar", "patch_json_string_rules"]

_HEX = "[A-Fa-f0-9]"
# A \u escape's four digits, without lone surrogates: a non-surrogate code unit, or a high
# surrogate (D800-DBFF) followed by an escaped low one (DC00-DFFF).
_SAFE_U_ESCAPE = (
    f'("u" (([0-9A-Ca-cEFef] {_HEX} {_HEX} {_HEX}) | ([Dd] [0-7] {_HEX} {_HEX}) '
    f'| ([Dd] [89ABab] {_HEX} {_HEX} "\\\\" "u" [Dd] [C-Fc-f] {_HEX} {_HEX})))'
)
# xgrammar's printed \u escape (in basic_escape and friends).
_U_ESCAPE = f'("u" {_HEX} {_HEX} {_HEX} {_HEX})'
# xgrammar's printed char of a length-limited string, and what it becomes.
_LENGTH_CHAR = '[^\\"\\\\\\r\\n]'
# A raw character JSON allows: not a quote, backslash or control character, and not a UTF-16
# surrogate code point (xgrammar takes the bytes ED A0 80.. as one; no decoder does).
_RAW_CHAR = '[^\\"\\\\\\0-\\x1f\\ud800-\\udfff]'
# xgrammar's printed char of an unlimited string, and what it becomes.
_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'
_SAFE_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n\\ud800-\\udfff]'

_REGEX_RULE = re.compile(r"::=\s*Regex\(")


def patch_json_string_rules(ebnf: str) -> str:
    """xgrammar's printed JSON-schema grammar with its string rules made strict (see above).
    Lines holding a `Regex(...)` rule are left alone: their text is the user's pattern."""
    lines = []
    for line in ebnf.splitlines():
        if not _REGEX_RULE.search(line):
            line = line.replace(_LENGTH_CHAR, _RAW_CHAR).replace(_U_ESCAPE, _SAFE_U_ESCAPE)
            line = line.replace(_STRING_CHAR, _SAFE_STRING_CHAR)
        lines.append(line)
    return "\n".join(lines) + "\n"


def json_schema_grammar(spec: str, *, indent: int | None) -> xgr.Grammar:
    """The grammar of documents valid for the schema `spec`, in a fixed layout (no free
    whitespace; `indent` spaces, or one line when None), whose strings are always valid JSON.
    Raises ValueError for a pattern that names a character JSON must escape, and what
    xgrammar raises for a schema it cannot convert."""
    try:
        hazards = pattern_json_hazards(json.loads(spec))
    except (ValueError, RecursionError):
        hazards = []  # not JSON: xgrammar's own error below says so
    if hazards:
        pointer, char = hazards[0]
        raise ValueError(f"the pattern at {pointer} requires {char!r}, which a JSON string must "
                         f"escape and constrained decoding writes unescaped; remove it")
    grammar = xgr.Grammar.from_json_schema(
        spec, any_whitespace=False, indent=indent, strict_mode=True)
    printed = str(grammar)
    patched = patch_json_string_rules(printed)
    if patched.strip() == printed.strip():
        return grammar
    return xgr.Grammar.from_ebnf(patched)
