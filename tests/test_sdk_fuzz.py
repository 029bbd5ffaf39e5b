"""Fuzz of `Engine.generate`'s request fields (issue 12): whatever the values, a call either
returns outputs or raises from the `InvalidRequestError` family before anything is queued;
never another exception, never a hang, and the engine keeps serving.

Values mix each field's valid range (kept small so that accepted requests finish quickly)
with values of every wrong type: bools for numbers, numbers for flags, NaN, huge integers,
strings, bytes, dicts, nested lists.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sgl
from tiny_engines import tokenized_tiny_engine

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4), st.binary(max_size=4), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.lists(st.one_of(st.integers(-3, 10**6), st.text(max_size=3), st.none()), max_size=3),
)
SMALL_INT = st.integers(-2, 6)
UNIT = st.floats(-0.5, 1.5)

FIELDS: dict[str, Any] = {
    "max_new_tokens": SMALL_INT, "min_new_tokens": SMALL_INT, "temperature": st.floats(0, 3),
    "top_p": UNIT, "top_k": st.integers(-2, 60000), "min_p": UNIT, "frequency_penalty": st.floats(-3, 3),
    "presence_penalty": st.floats(-3, 3), "repetition_penalty": st.floats(-1, 3),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(-1, 60000), max_size=3), "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(), "spaces_between_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(), "n": st.integers(-1, 3), "seed": st.integers(-(2**70), 2**70),
    "return_logprob": st.booleans(), "logprob_start_len": st.integers(-2, 3),
    "top_logprobs_num": st.integers(-1, 30), "timeout": st.one_of(st.floats(-1, 0), st.just(60.0)),
}
REQUESTS = st.fixed_dictionaries({}, optional={k: st.one_of(v, JUNK) for k, v in FIELDS.items()})


@pytest.fixture(scope="module")
def engine() -> Any:
    eng = tokenized_tiny_engine()
    yield eng
    eng.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kwargs=REQUESTS)
def test_any_request_fields_give_outputs_or_a_request_error(engine: Any, kwargs: dict[str, Any]) -> None:
    if isinstance(kwargs.get("max_new_tokens"), int) and not isinstance(kwargs["max_new_tokens"], bool):
        kwargs["max_new_tokens"] = min(kwargs["max_new_tokens"], 6)  # accepted requests stay short
    try:
        out = asyncio.run(asyncio.wait_for(engine.generate("Hello", **kwargs), 60))
    except sgl.InvalidRequestError as exc:
        assert exc.field, f"no field named for {kwargs}: {exc}"
    else:
        outs = out if isinstance(out, list) else [out]
        # A drawn timeout (JUNK has small floats) may expire on a busy machine before the
        # default 128 tokens: then the request ends as timed out, which is an answer too.
        timed_out = kwargs.get("timeout") is not None and all(
            o.finish_reason == "abort" and "timed out" in (o.error or "") for o in outs)
        assert outs and (timed_out or all(o.finish_reason in ("length", "stop") for o in outs)), (kwargs, outs)
    assert engine._rt.core.alive


def test_engine_serves_after_the_fuzz(engine: Any) -> None:
    out = engine.generate_sync("Hello", max_new_tokens=3, temperature=0)
    assert len(out.token_ids) == 3 and not math.isnan(out.usage.prompt_tokens)
    engine.check_integrity()
