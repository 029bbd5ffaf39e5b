"""Fuzzing the request fields of both protocols (hypothesis): every field gets either a value
of the right shape or an arbitrary JSON value, and no request may get a 5xx, break a stream, or
crash the engine. In process, on the tiny model; requests are bounded by small server limits
and an engine request timeout, so the whole file runs in well under a minute."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

import sgl
from sgl.backend.server import ServerOptions, create_app
from sgl.backend.server.validate import SAMPLING_KINDS
from test_server_support import split_limits, tiny_engine_options

pytestmark = pytest.mark.filterwarnings("ignore")

SETTINGS = settings(max_examples=200, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=10)
# The values a careless client most likely sends in the wrong place: near-booleans, numbers
# as strings, integral floats, huge ints, empty containers.
confusing = st.sampled_from([0, 1, -1, 1.0, 2.5, "1", "true", "", [], {}, None, True, False, 2**63, -2**63 - 1,
                             [1], ["a"], {"a": 1}, 10**6, 1e300])
wrong = confusing | json_values
token_ids = st.lists(st.integers(min_value=0, max_value=49151), min_size=1, max_size=6)
words = st.text(st.characters(codec="utf-8"), min_size=1, max_size=10)

# Valid values per sampling field, by engine name; a field added to SamplingParams later gets
# a value of its kind (the kinds the server reads from the type hints).
_VALID = {"max_new_tokens": st.integers(0, 4), "min_new_tokens": st.integers(0, 1),
          "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 8),
          "min_p": st.floats(0, 1), "frequency_penalty": st.floats(-2, 2), "presence_penalty": st.floats(-2, 2),
          "repetition_penalty": st.floats(0.1, 2), "stop": words | st.lists(words, max_size=3),
          "stop_token_ids": st.lists(st.integers(0, 100), max_size=3), "n": st.integers(1, 3),
          "seed": st.integers(0, 2**31), "regex": st.sampled_from(["a|b", "[0-9]{1,3}"]),
          "json_schema": st.sampled_from(['{"type": "integer"}', '{"enum": ["x", "y"]}']),
          "ebnf": st.just('root ::= "yes" | "no"')}
_BY_KIND = {"bool": st.booleans(), "int": st.integers(0, 3), "number": st.floats(0, 1), "str": words,
            "str_list": st.lists(words, max_size=2), "int_list": st.lists(st.integers(0, 9), max_size=2),
            "any": st.none()}
SAMPLING = {name: _VALID.get(name, _BY_KIND[kind]) for name, kind in SAMPLING_KINDS.items()}
_CONSTRAINTS = ("regex", "json_schema", "ebnf")


def _request(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]
             ) -> st.SearchStrategy[dict[str, Any]]:
    """A valid request (required fields, some optional ones), then usually one field (at times
    none, two, or a stray key) replaced by a wrong value: most requests reach the engine with
    one wrong field each, instead of failing on the first of many."""
    names = sorted({*required, *optional})

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        body = {k: draw(v) for k, v in required.items()}
        for k in draw(st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True)):
            body[k] = draw(optional[k])
        count = draw(st.sampled_from([0, 1, 1, 1, 2]))
        for k in draw(st.lists(st.sampled_from(names), min_size=count, max_size=count, unique=True)):
            body[k] = draw(wrong)
        if draw(st.integers(0, 9)) == 0:
            body[draw(st.text(min_size=1, max_size=6))] = draw(wrong)
        return body

    return build()


def _one_constraint(params: dict[str, Any]) -> dict[str, Any]:
    kept = [k for k in _CONSTRAINTS if k in params][:1]  # two constraints are a (tested) 400 anyway
    return {k: v for k, v in params.items() if k not in _CONSTRAINTS or k in kept}


# max_new_tokens is always given (the default, 128, would run each request into the timeout)
sampling_params = _request({"max_new_tokens": st.integers(1, 4)}, SAMPLING).map(_one_constraint)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer"]),
                                 "content": words})
NATIVE_PROMPTS = [{"text": words | st.lists(words, min_size=1, max_size=2), "sampling_params": sampling_params},
                  {"input_ids": token_ids | st.lists(token_ids, min_size=1, max_size=2),
                   "sampling_params": sampling_params | st.lists(sampling_params, min_size=1, max_size=1)}]
NATIVE = {"return_logprob": st.booleans(),
          "logprob_start_len": st.integers(-1, 2), "top_logprobs_num": st.integers(0, 5),
          "return_text_in_logprobs": st.booleans(), "stream": st.booleans(), "timeout": st.floats(0.05, 5),
          "rid": st.text(max_size=4)}
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
COMMON = {**{_OPENAI_NAMES.get(k, k): v for k, v in SAMPLING.items() if k not in _CONSTRAINTS},
          "model": st.text(max_size=5), "stream": st.booleans(),
          "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
          "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {
              "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}]),
          "user": st.text(max_size=4)}
COMPLETION = {**COMMON, "logprobs": st.integers(0, 5), "echo": st.booleans(), "suffix": st.just("")}
CHAT = {**COMMON, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
        "max_completion_tokens": st.integers(0, 4)}
PROMPTS = words | token_ids | st.lists(token_ids, min_size=1, max_size=2) | st.lists(words, min_size=1, max_size=2)


@pytest.fixture(scope="module")
def fuzz_client() -> Iterator[tuple[TestClient, sgl.Engine]]:
    # A request timeout bounds whatever a fuzzed max_tokens asks for; small limits keep n cheap.
    engine_side, server_side = split_limits(max_n=3, max_batch=6, max_top_logprobs_num=5)
    engine = sgl.Engine(**tiny_engine_options(), **engine_side, request_timeout=1.0)
    options = ServerOptions(**server_side)
    try:
        with TestClient(create_app(engine, options=options), raise_server_exceptions=False) as c:
            yield c, engine
    finally:
        engine.close()


def _check(client: TestClient, path: str, payload: dict[str, Any]) -> None:
    content = json.dumps(payload).encode()
    with client.stream("POST", path, content=content, headers={"content-type": "application/json"}) as r:
        body = b"".join(r.iter_bytes())
    assert r.status_code < 500, (path, payload, r.status_code, body[:300])
    if r.status_code != 200:
        error = json.loads(body)["error"]
        assert error["message"] and error["type"], body
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", (path, payload, body[-300:])
        for event in events[:-1]:
            assert "error" not in json.loads(event), (path, payload, event)
    else:
        json.loads(body)


@SETTINGS
@given(payload=st.sampled_from(NATIVE_PROMPTS).flatmap(lambda prompt: _request(prompt, NATIVE)))
def test_fuzz_native_generate(fuzz_client: tuple[TestClient, sgl.Engine], payload: dict[str, Any]) -> None:
    _check(fuzz_client[0], "/generate", payload)


@SETTINGS
@given(payload=_request({"prompt": PROMPTS, "max_tokens": st.integers(0, 4)}, COMPLETION))
def test_fuzz_openai_completions(fuzz_client: tuple[TestClient, sgl.Engine], payload: dict[str, Any]) -> None:
    _check(fuzz_client[0], "/v1/completions", payload)


@SETTINGS
@given(payload=_request({"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": st.integers(0, 4)},
                        CHAT))
def test_fuzz_openai_chat(fuzz_client: tuple[TestClient, sgl.Engine], payload: dict[str, Any]) -> None:
    _check(fuzz_client[0], "/v1/chat/completions", payload)


def test_engine_is_healthy_after_the_fuzzing(fuzz_client: tuple[TestClient, sgl.Engine]) -> None:
    client, engine = fuzz_client
    assert client.get("/health").status_code == 200
    out = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 2
    engine.check_integrity()
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_used_tokens == stats.kv_cached_tokens
