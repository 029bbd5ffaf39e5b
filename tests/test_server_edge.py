"""The typed HTTP edge, in process on the tiny model: every field of both protocols is
type-checked and bounded before anything reaches the engine, with a 400 (413 for a body that
is too large) whose `param` names the field, and the engine keeps serving afterwards."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from starlette.testclient import TestClient

import sgl
from sgl.backend.server import ServerOptions, create_app
from test_server_support import get_tiny_engine, split_limits, tiny_engine_options

CHAT = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(get_tiny_engine())) as c:
        yield c


def _error(response: Any, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


def _still_serving(client: TestClient) -> None:
    out = client.post("/generate", json={"text": "still there?", "sampling_params": {"max_new_tokens": 2}})
    assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 2
    assert client.get("/health").status_code == 200


NATIVE_BAD = [
    # booleans must be JSON booleans (0 once crashed the engine thread)
    ({"sampling_params": {"skip_special_tokens": 0}}, "sampling_params.skip_special_tokens", "true or false"),
    ({"sampling_params": {"ignore_eos": "true"}}, "sampling_params.ignore_eos", "true or false"),
    ({"sampling_params": {"jump_forward": 1}}, "sampling_params.jump_forward", "true or false"),
    ({"return_logprob": 1}, "return_logprob", "true or false"),
    ({"stream": "yes"}, "stream", "true or false"),
    ({"return_text_in_logprobs": 0}, "return_text_in_logprobs", "true or false"),
    # integers: not booleans, strings or floats, and within 64 bits
    ({"sampling_params": {"max_new_tokens": True}}, "sampling_params.max_new_tokens", "an integer"),
    ({"sampling_params": {"max_new_tokens": "5"}}, "sampling_params.max_new_tokens", "an integer"),
    ({"sampling_params": {"max_new_tokens": 2.0}}, "sampling_params.max_new_tokens", "an integer"),
    ({"sampling_params": {"n": "x"}}, "sampling_params.n", "an integer"),
    ({"sampling_params": {"n": 0}}, "sampling_params.n", ">= 1"),
    ({"sampling_params": {"seed": 2**64}}, "sampling_params.seed", "64 bits"),
    ({"logprob_start_len": "0"}, "logprob_start_len", "an integer"),
    ({"temperature": 1}, "temperature", "unknown field"),
    ({"sampling_params": {"temperature": "hot"}}, "sampling_params.temperature", "a finite number"),
    ({"timeout": "5"}, "timeout", "a finite number"),
    # stop lists: never coerced
    ({"sampling_params": {"stop": {"a": 1}}}, "sampling_params.stop", "a string or a list of strings"),
    ({"sampling_params": {"stop": 5}}, "sampling_params.stop", "a string or a list of strings"),
    ({"sampling_params": {"stop": ["a", 3]}}, "sampling_params.stop[1]", "a string"),
    ({"sampling_params": {"stop_token_ids": [1, "x"]}}, "sampling_params.stop_token_ids[1]", "an integer"),
    ({"sampling_params": {"stop_token_ids": 5}}, "sampling_params.stop_token_ids", "a list of integers"),
    ({"sampling_params": {"regex": 5}}, "sampling_params.regex", "a string"),
    ({"sampling_params": 5}, "sampling_params", "an object"),
    ({"sampling_params": [{}, {}]}, "sampling_params", "2 entries for 1 prompts"),
]


@pytest.mark.parametrize("payload, param, words", NATIVE_BAD, ids=[p for _, p, _ in NATIVE_BAD])
def test_native_field_of_wrong_type_is_400_naming_it(client: TestClient, payload: dict, param: str,
                                                      words: str) -> None:
    body = _error(client.post("/generate", json={"text": "hi", **payload}))
    assert body["param"] == param and words in body["message"], body


@pytest.mark.parametrize("payload, param, words", [
    ({"input_ids": [[1, 2], ["x"]]}, "input_ids[1][0]", "an integer token id"),
    ({"input_ids": [1, True]}, "input_ids[1]", "an integer token id"),
    ({"input_ids": []}, "input_ids", "a non-empty list"),
    ({"input_ids": [[1], []]}, "input_ids[1]", "a non-empty list"),
    ({"input_ids": [-1]}, "input_ids[0]", ">= 0"),
    ({"text": ["a", 5]}, "text[1]", "a string"),
    ({"text": 5}, "text", "a string or a non-empty list"),
    ({"text": ["a", "b"], "return_logprob": [True, 1]}, "return_logprob[1]", "true or false"),
])
def test_native_prompt_shapes_name_the_element_at_fault(client: TestClient, payload: dict, param: str,
                                                         words: str) -> None:
    body = _error(client.post("/generate", json=payload))
    assert body["param"] == param and words in body["message"], body


OPENAI_BAD = [
    ("/v1/completions", {"prompt": [1.5]}, "prompt[0]", "a string, a token id"),
    ("/v1/completions", {"prompt": [[1, 2], ["x"]]}, "prompt[1][0]", "an integer token id"),
    ("/v1/completions", {"prompt": ["a", 1]}, "prompt[1]", "a string"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt[1]", "an integer token id"),
    ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt", "a string, a list"),
    ("/v1/completions", {"prompt": "hi", "n": 2**63}, "n", "64 bits"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, "echo", "true or false"),
    ("/v1/completions", {"prompt": "hi", "stream": "true"}, "stream", "true or false"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "true or false"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs", "an integer"),
    ("/v1/completions", {"prompt": "hi", "skip_special_tokens": 0}, "skip_special_tokens", "true or false"),
    ("/v1/completions", {"prompt": "hi", "jump_forward": "no"}, "jump_forward", "true or false"),
    ("/v1/completions", {"prompt": "hi", "stop": {"a": 1}}, "stop", "a string or a list of strings"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1.5]}, "stop_token_ids[0]", "an integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens", "an integer"),
    ("/v1/completions", {"prompt": "hi", "best_of": "2"}, "best_of", "an integer"),
    ("/v1/completions", {"prompt": [10**9], "echo": True}, "prompt[0]", "below the vocabulary size"),
    ("/v1/chat/completions", {"messages": [{"role": "hacker", "content": "x"}]}, "messages[0].role", "one of"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role", "one of"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", "a non-empty list"),
    ("/v1/chat/completions", {"messages": ["hi"]}, "messages[0]", "an object"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "a string or a list of text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", "only text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]},
     "messages[0].tool_calls", "only allowed on assistant messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "colour": "red"}]},
     "messages[0].colour", "unknown field"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs", "true or false"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 1.5}, "max_completion_tokens",
     "an integer"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": True}, "temperature", "a finite number"),
]


@pytest.mark.parametrize("path, payload, param, words", OPENAI_BAD, ids=[p for _, _, p, _ in OPENAI_BAD])
def test_openai_field_of_wrong_type_is_400_naming_it(client: TestClient, path: str, payload: dict,
                                                      param: str, words: str) -> None:
    body = _error(client.post(path, json={"model": "default", **payload}))
    assert body["param"] == param and words in body["message"], body


LIMITS = [  # (path, payload, param, flag)
    ("/generate", {"text": "hi", "sampling_params": {"n": 10**7}}, "sampling_params.n", "--max-n"),
    ("/generate", {"text": ["hi"] * 300}, "text", "--max-batch"),
    ("/generate", {"text": ["hi"] * 5, "sampling_params": {"n": 60}}, "text", "--max-batch"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 10**6}, "top_logprobs_num",
     "--max-top-logprobs-num"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": ["x"] * 33}}, "sampling_params.stop",
     "--max-stop-strings"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": ["y" * 257]}}, "sampling_params.stop[0]",
     "--max-stop-string-len"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [1] * 257}},
     "sampling_params.stop_token_ids", "--max-stop-token-ids"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "a" * 70000}}, "sampling_params.regex",
     "--max-grammar-bytes"),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": {"enum": ["v" * 70000]}}},
     "sampling_params.json_schema", "--max-grammar-bytes"),
    ("/v1/completions", {"prompt": "hi", "n": 65}, "n", "--max-n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "--max-top-logprobs-num"),
    ("/v1/completions", {"prompt": "hi", "ebnf": "root ::= " + '"a" ' * 17000}, "ebnf", "--max-grammar-bytes"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "--max-top-logprobs-num"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": ["v" * 70000]}}}}, "response_format.json_schema.schema",
     "--max-grammar-bytes"),
]


@pytest.mark.parametrize("path, payload, param, flag", LIMITS, ids=[f"{p}-{f}" for _, _, p, f in LIMITS])
def test_request_bounds_are_400_naming_the_limit(client: TestClient, path: str, payload: dict, param: str,
                                                 flag: str) -> None:
    body = _error(client.post(path, json=payload))
    assert body["param"] == param and flag in body["message"] and body["code"] == "limit_exceeded", body


def test_bounds_follow_the_options() -> None:
    """Each bound is an option: the server's, or the engine's where the engine has the same one."""
    engine_side, server_side = split_limits(max_n=2, max_top_logprobs_num=1, max_stop_strings=1, max_batch=4)
    engine = sgl.Engine(**tiny_engine_options(), **engine_side) if engine_side else get_tiny_engine()
    try:
        with TestClient(create_app(engine, options=ServerOptions(**server_side))) as c:
            assert "limit of 2" in _error(c.post("/v1/completions", json={"prompt": "hi", "n": 3}))["message"]
            _error(c.post("/generate", json={"text": "hi", "return_logprob": True, "top_logprobs_num": 2}))
            _error(c.post("/generate", json={"text": "hi", "sampling_params": {"stop": ["a", "b"]}}))
            assert "--max-batch" in _error(c.post("/v1/completions", json={"prompt": ["a"] * 3, "n": 2}))["message"]
            ok = c.post("/v1/completions", json={"prompt": "hi", "n": 2, "max_tokens": 1, "stop": ["a"],
                                                 "logprobs": 1})
            assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    finally:
        if engine_side:
            engine.close()


def test_well_formed_requests_still_pass(client: TestClient) -> None:
    """The strict edge keeps every documented shape working."""
    ok = [
        ("/generate", {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1, "stop": "x"},
                                                               {"max_new_tokens": 1, "stop": None}],
                       "return_logprob": [True, False], "top_logprobs_num": 2, "logprob_start_len": 0}),
        ("/generate", {"input_ids": [[5, 6], [7]], "sampling_params": {"max_new_tokens": 1, "n": 2,
                                                                       "stop_token_ids": [3],
                                                                       "json_schema": {"type": "string"},
                                                                       "sampling_seed": 3}}),
        ("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}),
        ("/v1/completions", {"prompt": [[5, 6], [7]], "max_tokens": 1, "stop": None, "echo": True,
                             "logprobs": 0, "user": "u", "seed": 1, "temperature": 1}),
        ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1, "n": 64, "stream": False}),
        ("/v1/chat/completions", {"messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"},
            {"role": "assistant", "content": "hello", "tool_calls": None, "refusal": None},
            {"role": "user", "content": "again"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 20}),
    ]
    for path, payload in ok:
        response = client.post(path, json=payload)
        assert response.status_code == 200, (path, payload, response.text)


@pytest.mark.parametrize("content, words", [
    (b"[" * 5000 + b"]" * 5000, "nests"),  # once a 500 RecursionError
    (b'{"text": ' + b"[" * 70 + b"]" * 70 + b"}", "--max-json-depth"),
    (b'{"text": "hi", "sampling_params": {"temperature": NaN}}', "NaN"),
    (b'{"text": "hi", "sampling_params": {"temperature": Infinity}}', "Infinity"),
    (b'{"text": "\xff"}', "not valid JSON"),
    (b"[1, 2]", "a JSON object"),
])
def test_malformed_bodies_are_400(client: TestClient, content: bytes, words: str) -> None:
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        assert words in _error(client.post(path, content=content, headers=JSON))["message"]


def test_overflowing_number_is_not_infinity(client: TestClient) -> None:
    body = _error(client.post("/v1/completions", content=b'{"prompt": "hi", "temperature": 1e999}', headers=JSON))
    assert body["param"] == "temperature" and "a finite number" in body["message"]


def test_oversized_body_is_413_with_or_without_content_length() -> None:
    with TestClient(create_app(get_tiny_engine(), options=ServerOptions(max_body_bytes=1000))) as c:
        big = json.dumps({"text": "x" * 2000}).encode()
        assert "--max-body-bytes" in _error(c.post("/generate", content=big, headers=JSON), 413)["message"]
        chunks = iter([big[:600], big[600:]])  # chunked: no Content-Length to trust
        _error(c.post("/v1/completions", content=chunks, headers=JSON), 413)
        assert c.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_engine_survives_every_bad_request(client: TestClient) -> None:
    for payload, _, _ in NATIVE_BAD:
        client.post("/generate", json={"text": "hi", **payload})
    for path, payload, _, _ in OPENAI_BAD + LIMITS:
        client.post(path, json=payload)
    _still_serving(client)
    engine = get_tiny_engine()
    engine.check_integrity()
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0


@pytest.mark.parametrize("path, payload, param", [
    ("/generate", {"text": "\x04"}, "text"),
    ("/generate", {"text": ["hi", "\x04\x06"]}, "text[1]"),
    ("/generate", {"text": ""}, "text"),
    ("/v1/completions", {"prompt": "\x13"}, "prompt"),
    ("/v1/completions", {"prompt": ["hi", "\x1d"]}, "prompt[1]"),
])
def test_text_without_tokens_is_400_not_an_engine_crash(client: TestClient, path: str, payload: dict,
                                                        param: str) -> None:
    """A text of characters the tokenizer drops became an empty prompt, and the scheduler's
    admission crashed the engine thread on it (IndexError); every later request got 503."""
    body = _error(client.post(path, json=payload))
    message = body["message"]
    assert body["param"] == param and ("tokenizes to at least one token" in message or "non-empty" in message), body
    _still_serving(client)
