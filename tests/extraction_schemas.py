"""The three Pydantic schemas of the JSON extraction workload: one definition, two users.

bench/json_workload.py measures constrained decoding and jump-forward on them, and
tests/test_structured_real.py checks on them that jump-forward keeps the extracted fields; the
test's agreement figure speaks for the benchmark only while both use the same schemas.

Every string has a maxLength: a 135M model may otherwise loop inside a string until
max_new_tokens, and a truncated output cannot validate.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

__all__ = ["Person", "Product", "Meeting"]


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=130)
    city: str = Field(max_length=30)


class Product(BaseModel):
    product: str = Field(max_length=40)
    price: float = Field(ge=0)
    in_stock: bool


class Meeting(BaseModel):
    person: str = Field(max_length=40)
    day: Literal["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    hour: int = Field(ge=0, le=23)
