"""The bundled grammars (grammars/*.ebnf): each compiles, accepts valid text, rejects invalid.

Strings are walked through the matcher token by token, as the tokenizer splits them, which is
what decoding does (accept_string would hide token-boundary problems).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sgl.backend.grammar import GrammarBackend
from sgl.constraints import build_constraint, grammar_names

REPO = Path(__file__).resolve().parent.parent
VALID = {
    "json": [
        '{"a": [1, -2.5e3, "x\\n\\u00e9"], "b": {"c": null}, "d": true}',
        "[]",
        '{\n  "name": "Ada",\n  "tags": [\n    "x"\n  ]\n}',
        '[{"k": false}, 0, "é"]',
    ],
    "arithmetic": ["(3 + 4.5) * -2 ^ 2 / 7", "1+2", "-(1)", "((2))", "10 - 3 * 4"],
    "sql_select": [
        "SELECT name, COUNT(*) FROM users WHERE age >= 18 AND city = 'Paris' GROUP BY name;",
        "SELECT * FROM t",
        "SELECT DISTINCT a.b AS c FROM x AS a LEFT JOIN y ON a.id = y.id ORDER BY c DESC LIMIT 10",
        "SELECT id FROM orders WHERE note IS NOT NULL OR status IN ('new', 'paid')",
        "SELECT AVG(price) FROM items WHERE NOT (price < 0 OR name LIKE 'x%')",
    ],
    "function_call": [
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
        '{"name": "ping", "arguments": {}}',
        '{"name": "search.web", "arguments": {"q": "a \\"b\\"", "filters": [1, {"x": null}]}}',
    ],
}
INVALID = {
    "json": ['{"a": 1,}', "{'a': 1}", '{"a": 01}', "42", '{"a": tru}', '["x"'],
    "arithmetic": ["1 +", "(1", "1 ** 2", "a + 1", "1..2", ""],
    "sql_select": [
        "select * from t",
        "SELECT FROM t",
        "SELECT * FROM t WHERE",
        "SELECT * FROM t LIMIT x",
        "DELETE FROM t",
    ],
    "function_call": [
        '{"name": "get weather", "arguments": {}}',
        '{"arguments": {}, "name": "f"}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f"}',
    ],
}


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer: Any) -> Any:
    return default_tokenizer


@pytest.fixture(scope="module")
def backend(tokenizer: Any) -> GrammarBackend:
    return GrammarBackend(tokenizer, 49152)


def walk(backend: GrammarBackend, tokenizer: Any, name: str, text: str) -> bool:
    """True if the grammar accepts `text` token by token and is complete after it."""
    spec = build_constraint(grammar=name)
    state = backend.new_state(backend.compile(spec.kind, spec.text))
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not state.accept_token(token):
            return False
    return state.is_completed() and state.accept_token(backend.stop_token_ids[0])


def test_every_grammar_file_is_tested_and_documented() -> None:
    names = set(grammar_names())
    assert names == set(VALID) == set(INVALID)
    for name in names:
        text = (REPO / "grammars" / f"{name}.ebnf").read_text(encoding="utf-8")
        assert text.startswith(f"# {name}.ebnf:"), "each grammar opens with a comment header"
        assert "root ::=" in text


def test_grammar_files_are_package_data() -> None:
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert '"sgl.grammars" = "grammars"' in pyproject
    assert '"*.ebnf"' in pyproject


@pytest.mark.parametrize("name", sorted(VALID))
def test_grammar_accepts_valid_text(backend: GrammarBackend, tokenizer: Any, name: str) -> None:
    for text in VALID[name]:
        assert walk(backend, tokenizer, name, text), f"{name} rejected {text!r}"


@pytest.mark.parametrize("name", sorted(INVALID))
def test_grammar_rejects_invalid_text(backend: GrammarBackend, tokenizer: Any, name: str) -> None:
    for text in INVALID[name]:
        assert not walk(backend, tokenizer, name, text), f"{name} accepted {text!r}"


def test_json_grammar_bounds_whitespace(backend: GrammarBackend, tokenizer: Any) -> None:
    # A small model can loop on whitespace; the grammar caps a run at 16 characters.
    assert walk(backend, tokenizer, "json", "{" + " " * 16 + "}")
    assert not walk(backend, tokenizer, "json", "{" + " " * 17 + "}")


def test_function_call_jumps_over_its_fixed_frame(backend: GrammarBackend, tokenizer: Any) -> None:
    spec = build_constraint(grammar="function_call")
    state = backend.new_state(backend.compile(spec.kind, spec.text))
    plan = state.jump_forward([])
    assert plan is not None and plan.forced_text == '{"name": "'
