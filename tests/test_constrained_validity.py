"""Every constrained output that finished with "stop" is valid (issue 13, "never invalid").

A tiny random-weight Llama served with the default model's real 49k tokenizer samples at
temperature 1, so it tries the odd tokens a trained model rarely picks (byte tokens for
U+0000..U+001F, lone `\\u` escapes, half numbers). Hundreds of requests per constraint run as
one batch; each output that stopped must validate against its constraint:

* JSON schema: a strict JSON parser (pydantic_core's), then `jsonschema` validation;
* Pydantic: the model's own `model_validate_json` (`GenerateOutput.parsed`'s parser);
* regex: Python's `re.fullmatch`;
* EBNF: an xgrammar matcher fed the text must end complete; the bundled `json` grammar must
  also `json.loads`.

Before grammar_json.py, the length-limited strings of the JSON-schema and Pydantic cases
stopped with raw control characters in ~1-4% of outputs, and about 1 in 100 came back longer
than its maxLength (UTF-8-encoded surrogates, one character to xgrammar, three U+FFFD after
decoding).
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from typing import Annotated, Any, Iterator

import jsonschema
import pydantic
import pytest
from tiny_engines import tokenized_tiny_engine

import sgl

pytestmark = pytest.mark.anyio

REQUESTS = 256  # per constraint (half for each JSON schema): 1,824 outputs, ~1 min on 2 cores


@pytest.fixture(scope="module")
def engine() -> Iterator[sgl.Engine]:
    eng = tokenized_tiny_engine(random_seed=13, max_running_requests=REQUESTS)
    yield eng
    eng.close()


async def _stopped(engine: sgl.Engine, n: int = REQUESTS, max_new_tokens: int = 16,
                   min_stopped: int | None = None, **constraint: Any) -> list[str]:
    """The texts of the outputs that finished with "stop" among n sampled at temperature 1
    (seeded per request: the same outputs whatever the batching, so a failure reproduces)."""
    outs = await asyncio.gather(*(
        engine.generate(f"Item {i}:", max_new_tokens=max_new_tokens, temperature=1.0, seed=1000 + i,
                        **constraint)
        for i in range(n)))
    assert all(o.finish_reason in ("stop", "length") for o in outs), [o.error for o in outs]
    texts = [o.text for o in outs if o.finish_reason == "stop"]
    # Enough stopped outputs that the check means something (a grammar that never completes
    # would otherwise pass vacuously).
    least = n // 4 if min_stopped is None else min_stopped
    assert len(texts) >= least, f"only {len(texts)} of {n} outputs stopped"
    return texts


def _invalid(texts: list[str], check: Any) -> list[tuple[str, str]]:
    bad = []
    for text in texts:
        try:
            check(text)
        except Exception as exc:  # the reason, for the failure message
            bad.append((text, f"{type(exc).__name__}: {exc}"[:200]))
    return bad


# -- JSON schema ---------------------------------------------------------------------------------
# Small schemas, so that most outputs stop within a few tokens: each aims at one way to be
# invalid (raw control characters in length-limited strings, lone surrogate escapes, numbers).

SCHEMAS = {
    "short_string": {"type": "string", "maxLength": 3},
    "bounded_string": {"type": "string", "minLength": 1, "maxLength": 2},
    "free_string": {"type": "string"},
    "number": {"type": "number"},
    "object": {"type": "object", "properties": {
        "k": {"type": "string", "maxLength": 2}, "e": {"enum": ["red", 7, None]}},
        "required": ["k", "e"]},
    "nested": {"type": "object", "properties": {
        "c": {"type": "string", "pattern": "^[A-Z][a-z]?$"},
        "o": {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 50}},
              "required": ["n"]}},
        "required": ["c", "o"]},
    "array": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 2},
}


def _strict_json(schema: dict[str, Any]) -> Any:
    def check(text: str) -> None:
        import pydantic_core

        pydantic_core.from_json(text)  # strict: lone surrogates, raw control characters fail
        jsonschema.validate(json.loads(text), schema)

    return check



# (max_new_tokens, how many of the outputs must at least stop)
BUDGETS = {"free_string": (12, 4), "object": (32, None), "nested": (40, None)}


@pytest.mark.parametrize("name", list(SCHEMAS))
async def test_json_schema_outputs_that_stop_are_valid_json(engine: sgl.Engine, name: str) -> None:
    schema = SCHEMAS[name]
    max_new_tokens, min_stopped = BUDGETS.get(name, (12, None))
    texts = await _stopped(engine, n=REQUESTS // 2, json_schema=schema,
                           max_new_tokens=max_new_tokens, min_stopped=min_stopped)
    bad = _invalid(texts, _strict_json(schema))
    assert not bad, f"{len(bad)} of {len(texts)} invalid, e.g. {bad[:3]}"


# -- Pydantic ------------------------------------------------------------------------------------


class Size(str, enum.Enum):
    small = "S"
    large = "L"


class Part(pydantic.BaseModel):
    label: Annotated[str, pydantic.StringConstraints(max_length=2)]
    size: Size


class Order(pydantic.BaseModel):
    ref: Annotated[str, pydantic.StringConstraints(pattern=r"^[a-z][0-9]$")]
    note: Annotated[str, pydantic.StringConstraints(min_length=1, max_length=3)]
    qty: Annotated[int, pydantic.Field(ge=0, le=99)]
    parts: Annotated[list[Part], pydantic.Field(max_length=1)]


async def test_pydantic_outputs_that_stop_validate(engine: sgl.Engine) -> None:
    texts = await _stopped(engine, schema=Order, max_new_tokens=48)
    bad = _invalid(texts, Order.model_validate_json)
    assert not bad, f"{len(bad)} of {len(texts)} invalid, e.g. {bad[:3]}"


# -- regex and EBNF ------------------------------------------------------------------------------

REGEX = r"[a-z]{1,3}@[a-z0-9]{1,2}\.(com|io)( #[0-9]{1,2})?"
# (Printable ASCII in quotes: a negated class such as [^"] also admits the bytes of a UTF-8-encoded
# surrogate, which xgrammar reads as one character and the detokenizer writes as three U+FFFD;
# user EBNF keeps xgrammar's semantics, see docs/structured.md.)
EBNF = r"""
root ::= item ("," " "? item){0,2}
item ::= word "=" value
word ::= [a-z_]{1,3}
value ::= [0-9]{1,2} | "\"" [ !#-~]{0,2} "\"" | "[" ([0-9] ("," [0-9]){0,1})? "]"
"""


async def test_regex_outputs_that_stop_fullmatch(engine: sgl.Engine) -> None:
    texts = await _stopped(engine, regex=REGEX)
    bad = [t for t in texts if re.fullmatch(REGEX, t) is None]
    assert not bad, f"{len(bad)} of {len(texts)} do not match, e.g. {bad[:3]}"


def _ebnf_accepts(grammar_text: str) -> Any:
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(
        xgr.Grammar.from_ebnf(grammar_text))

    def check(text: str) -> None:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        if not matcher.accept_string(text) or not matcher.is_completed():
            raise ValueError("the grammar does not accept the whole text")

    return check


async def test_ebnf_outputs_that_stop_are_accepted_by_the_grammar(engine: sgl.Engine) -> None:
    texts = await _stopped(engine, grammar=EBNF)
    bad = _invalid(texts, _ebnf_accepts(EBNF))
    assert not bad, f"{len(bad)} of {len(texts)} rejected, e.g. {bad[:3]}"


async def test_bundled_json_grammar_outputs_that_stop_parse(engine: sgl.Engine) -> None:
    # (xgrammar fills this grammar's masks slowly, ~40 ms a row: few requests)
    texts = await _stopped(engine, grammar="json", n=32, max_new_tokens=8, min_stopped=1)
    bad = _invalid(texts, json.loads)
    assert not bad, f"{len(bad)} of {len(texts)} invalid, e.g. {bad[:3]}"
