"""Pydantic-typed extraction from free text.

    python examples/json_extraction.py

Each passage is turned into a validated `Invoice` instance: `schema=Invoice` compiles the
model's JSON schema into a grammar, so the model can only write JSON that validates, and the
engine returns the instance as `output.parsed` (the raw text stays in `output.text`). The fixed
parts of the JSON (braces, keys, indentation) are appended by jump-forward instead of being
decoded token by token.
"""

from __future__ import annotations

import asyncio
from typing import Literal

from pydantic import BaseModel, Field

import sgl


class Invoice(BaseModel):
    customer: str = Field(max_length=40, description="who pays")
    amount: float = Field(ge=0, description="total, in the currency below")
    currency: Literal["USD", "EUR", "GBP"]
    paid: bool


PASSAGES = [
    "Invoice for Globex Corp: 1,250.00 USD, settled by wire transfer on March 3.",
    "Reminder: Ms. Jane Doe still owes us 89.90 EUR for the spring workshop.",
    "Paid in full - Initech Ltd, GBP 420, thank you for your business!",
]


def prompt(passage: str) -> list[dict[str, str]]:
    fields = ", ".join(Invoice.model_fields)
    return [{"role": "user", "content": f"Extract {fields} from this text as JSON.\n\nText: {passage}"}]


async def extract(engine: sgl.Engine, passages: list[str]) -> list[Invoice]:
    # One call for the whole list: the requests run concurrently, in one batch.
    outputs = await engine.generate([prompt(p) for p in passages], schema=Invoice,
                                    max_new_tokens=80, temperature=0)
    return [out.parsed for out in outputs]


def main(engine: sgl.Engine | None = None) -> list[Invoice]:
    """Extract every passage and print it; pass an engine to reuse one (as the tests do).

    Call it from synchronous code; inside an event loop, `await extract(...)` instead.
    """
    own = engine is None
    engine = engine or sgl.Engine()
    try:
        invoices = asyncio.run(extract(engine, PASSAGES))
        for passage, invoice in zip(PASSAGES, invoices):
            print(f"{passage}\n  -> {invoice!r}")
        return invoices
    finally:
        if own:
            engine.close()


if __name__ == "__main__":
    main()
