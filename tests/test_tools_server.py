"""Tool calls and reasoning on /v1/chat/completions, driven by the official `openai` client.

The server hosts the tiny random-weight model (test_server_support), in process through
Starlette's TestClient: random weights pick arbitrary tokens wherever the grammar allows, so
every sample that validates shows the grammar, not the model, made it valid.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Literal

import openai
import pytest
from pydantic import BaseModel
from starlette.testclient import TestClient

from sgl.backend.server import create_app
from test_server_support import get_tiny_engine


class Weather(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    unit: Literal["celsius", "fahrenheit"]
    days: list[bool]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast.",
                                      "parameters": Weather.model_json_schema()}},
    {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    with TestClient(create_app(get_tiny_engine())) as c:
        yield c


@pytest.fixture(scope="module")
def client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def _check_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        Weather.model_validate(args)
    else:
        assert name == "ping" and isinstance(args["ok"], bool) and set(args) == {"ok"}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_validate_in_every_sample(client: openai.OpenAI, choice: Any) -> None:
    out = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                         n=8, temperature=1.0, seed=7, max_tokens=400)
    assert len(out.choices) == 8
    for c in out.choices:
        assert c.finish_reason == "tool_calls", c
        calls = c.message.tool_calls
        assert calls and all(call.type == "function" and call.id.startswith("call_") for call in calls)
        for call in calls:
            _check_call(call.function.name, call.function.arguments)
        if isinstance(choice, dict):
            assert [call.function.name for call in calls] == ["get_weather"]  # exactly one, the named one


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "ping"}}])
def test_streamed_tool_call_deltas(client: openai.OpenAI, choice: Any) -> None:
    for seed in range(4):
        stream = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                temperature=1.0, seed=seed, max_tokens=400, stream=True)
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in stream:
            choice0 = chunk.choices[0]
            for d in choice0.delta.tool_calls or []:
                if d.id is not None:  # OpenAI's shape: id, type and name first, then arguments
                    assert d.index not in calls and d.type == "function" and d.function.name
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice0.finish_reason or finish
        assert finish == "tool_calls" and calls and sorted(calls) == list(range(len(calls)))
        for call in calls.values():
            _check_call(call["name"], call["arguments"])


def test_tool_choice_none_and_auto_answer_in_text(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                         max_tokens=8, temperature=0)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
    auto = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                          temperature=0)
    assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_tool_results_round_trip(client: openai.OpenAI) -> None:
    """An assistant turn with tool_calls and a tool result, as the openai client sends them back."""
    first = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=400)
    message = first.choices[0].message
    history = MESSAGES + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model="default", messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=5, temperature=0)
    assert second.choices[0].message.content


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_reasoning_tokens": 4}, "max_reasoning_tokens"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tool_requests_are_400_naming_the_field(http: TestClient, body: dict[str, Any], param: str) -> None:
    response = http.post("/v1/chat/completions", json={"model": "default", "messages": MESSAGES, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    ok = http.post("/v1/chat/completions", json={"model": "default", "messages": MESSAGES, "max_tokens": 2})
    assert ok.status_code == 200  # the engine keeps serving


def test_bad_history_tool_calls_are_400(http: TestClient) -> None:
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "ping", "arguments": "{not json"}}]}]
    response = http.post("/v1/chat/completions", json={"model": "default", "messages": history})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
