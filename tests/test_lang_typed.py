"""Typed outputs: gen(schema=Model) gives the validated value; constraints reach the backend."""

from __future__ import annotations

import json

import pytest

import sgl.lang as sgl
from sgl.errors import ProgramError
from sgl.lang import FakeBackend

constraints = pytest.importorskip(
    "sgl.constraints", reason="sgl.constraints (structured generation) is not in this checkout")
pydantic = pytest.importorskip("pydantic")


class City(pydantic.BaseModel):
    name: str
    population: int


def test_schema_gives_a_validated_model() -> None:
    backend = FakeBackend(responses={"Paris": '{"name": "Paris", "population": 2100000}'})

    @sgl.function
    def describe(s, city):
        s += "Describe " + city + " as JSON: " + sgl.gen("info", schema=City, max_tokens=64)

    state = describe.run(city="Paris", backend=backend)
    assert state["info"] == City(name="Paris", population=2100000)
    assert state.text().endswith('"population": 2100000}')  # the text stays text
    (req,) = backend.requests_of("generate")
    assert json.loads(req.params.json_schema)["properties"]["population"]["type"] == "integer"


def test_schema_mismatch_is_a_parse_error() -> None:
    from sgl.errors import ParseError

    backend = FakeBackend(responses={"Paris": '{"name": "Paris"}'})

    @sgl.function
    def describe(s):
        s += "Paris:" + sgl.gen("info", schema=City, max_tokens=64)

    with pytest.raises(ProgramError) as info:
        describe.run(backend=backend)
    assert isinstance(info.value.__cause__, ParseError)


def test_json_schema_regex_dtype_and_grammar_pass_through() -> None:
    backend = FakeBackend(responses={"n:": "42"})

    @sgl.function
    def prog(s):
        s += "n:" + sgl.gen("n", dtype=int, max_tokens=4)
        s += sgl.gen("j", json_schema={"type": "object"}, max_tokens=4)
        s += sgl.gen("g", grammar='root ::= "a"', max_tokens=4)

    state = prog.run(backend=backend)
    assert state["n"] == "42"  # dtype= keeps SGLang's text value
    n, j, g = backend.requests_of("generate")
    assert n.params.regex and json.loads(j.params.json_schema) == {"type": "object"}
    assert g.params.ebnf
