"""Partial objects: every prefix of a JSON document read as the typed object complete so far."""

from __future__ import annotations

import asyncio
from typing import Literal, Optional

import pytest
from pydantic import BaseModel, Field

import sgl
from sgl.partial import parse_partial, partial_type
from tiny_engines import tokenized_tiny_engine


class Pet(BaseModel):
    name: str
    kind: Literal["cat", "dog"]


class Person(BaseModel):
    name: str = Field(min_length=2)
    age: int
    score: float
    tags: list[str]
    pets: list[Pet]
    best: Optional[Pet] = None


PERSON = Person(name="Ada Lovelace", age=36, score=-1.25e3, tags=["math", "x"],
                pets=[Pet(name="Tom", kind="cat"), Pet(name="Rex", kind="dog")], best=Pet(name="Tom", kind="cat"))


def _subset(partial: BaseModel | None, full: BaseModel) -> None:
    """Everything present in `partial` is final: equal to the full object's value (lists may be
    shorter; their last item may itself be partial)."""
    if partial is None:
        return
    for name in type(partial).model_fields:
        value, final = getattr(partial, name), getattr(full, name)
        if value is None:
            continue
        if isinstance(value, list):
            assert len(value) <= len(final)
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    _subset(item, final[i])
                else:
                    assert item == final[i]
        elif isinstance(value, BaseModel):
            _subset(value, final)
        else:
            assert value == final, (name, value, final)


@pytest.mark.parametrize("indent", [None, 2])
def test_every_prefix_is_exact(indent: int | None) -> None:
    text = PERSON.model_dump_json(indent=indent)
    seen_fields = 0
    for end in range(len(text) + 1):
        partial = parse_partial(text[:end], Person)
        _subset(partial, PERSON)
        if partial is not None:
            present = sum(getattr(partial, n) is not None for n in Person.model_fields)
            assert present >= seen_fields  # fields never disappear
            seen_fields = present
    assert parse_partial(text, Person) == partial_type(Person).model_validate(PERSON.model_dump())


def test_numbers_and_strings_appear_only_when_complete() -> None:
    assert parse_partial('{"name": "Ad', Person).name is None
    assert parse_partial('{"name": "Ada", "age": 3', Person).age is None  # could become 36
    assert parse_partial('{"name": "Ada", "age": 36,', Person).age == 36
    assert parse_partial('{"pets": [{"name": "Tom", "kind": "ca', Person).pets[0].kind is None
    assert parse_partial("", Person) is None


def test_partial_type_is_cached_and_optional() -> None:
    assert partial_type(Person) is partial_type(Person)
    empty = partial_type(Person)()
    assert all(getattr(empty, n) is None for n in Person.model_fields)


def test_engine_stream_carries_partials() -> None:
    class Small(BaseModel):
        ok: bool
        color: Literal["red", "blue"]
        many: list[Literal["a", "b"]]

    engine = tokenized_tiny_engine()

    async def run() -> tuple[list[object], sgl.GenerateOutput]:
        partials, out = [], None
        async for chunk in engine.stream("Give JSON:", schema=Small, temperature=1.0, seed=9, max_new_tokens=300):
            partials.append(chunk.partial)
            out = chunk.output or out
        return partials, out

    try:
        partials, out = asyncio.run(run())
    finally:
        engine.close()
    final = out.parsed
    assert isinstance(final, Small)
    for p in partials:
        _subset(p, final)
    assert partials[-1].model_dump() == final.model_dump()
    assert any(p is not None and p.ok is None for p in partials)  # it really was partial at first


def test_program_streams_partials_of_a_typed_gen() -> None:
    class Small(BaseModel):
        ok: bool
        many: list[Literal["a", "b"]]

    @sgl.function
    def program(s):  # noqa: ANN001, ANN202
        s += "JSON: " + sgl.gen("obj", schema=Small, max_tokens=300)

    engine = tokenized_tiny_engine()
    try:
        state = program.run(backend=engine, stream=True, temperature=1.0)
        partials = list(state.partial_iter("obj"))
        final = state["obj"]
    finally:
        engine.close()
    assert isinstance(final, Small) and partials
    for p in partials:
        _subset(p, final)
    assert partials[-1].model_dump() == final.model_dump()
