"""SGLang 0.5.x request fields on the native /generate (tiny model, in process): each sampling
field SGLang accepts is accepted here; the ones that cannot apply in process are type-checked
and ignored, or accepted only off; a wrong value is a 400 naming the field."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
from starlette.testclient import TestClient

from sgl.backend.server import create_app
from test_server_support import get_tiny_engine

# Every field of SGLang 0.5.23's SamplingParams API section, with a value that client sends.
SGLANG_SAMPLING: dict[str, Any] = {
    "max_new_tokens": 3, "stop": ["\n"], "stop_token_ids": [0], "stop_regex": [r"\d{4}"], "temperature": 0.0,
    "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "beam_width": None, "json_schema": None,
    "regex": None, "ebnf": None, "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "no_stop_trim": False, "stream_interval": 2,
    "logit_bias": {"5": 0.5}, "sampling_seed": 7, "custom_params": {"k": [1, "x"]}, "watermark": None,
}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(get_tiny_engine())) as c:
        yield c


def test_every_sglang_sampling_field_is_accepted(client: TestClient) -> None:
    r = client.post("/generate", json={"text": "hi", "sampling_params": SGLANG_SAMPLING,
                                       "rid": "r1", "routing_key": "k", "return_routed_experts": False})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] <= 3


def test_ignored_fields_do_not_change_the_output(client: TestClient) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    plain = client.post("/generate", json=body).json()
    body["sampling_params"].update(stream_interval=3, custom_params={"a": 1})
    assert client.post("/generate", json=body).json()["output_ids"] == plain["output_ids"]


@pytest.mark.parametrize("field,value", [("beam_width", 2), ("structural_tag", '{"x": 1}'),
                                         ("watermark", {"on": True}), ("stream_interval", 0),
                                         ("custom_params", [1])])
def test_wrong_or_unsupported_values_name_the_field(client: TestClient, field: str, value: Any) -> None:
    r = client.post("/generate", json={"text": "hi", "sampling_params": {field: value}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"sampling_params.{field}"


@pytest.mark.parametrize("field,value", [("return_routed_experts", True), ("session_id", "s"),
                                         ("lora_id", "x"), ("input_embeds", [[0.1]])])
def test_off_only_request_fields(client: TestClient, field: str, value: Any) -> None:
    r = client.post("/generate", json={"text": "hi", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_openai_routes_take_sglang_sampling_extras(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop_regex": [r"\d{4}"],
                                             "logit_bias": {"5": 1}, "custom_params": {"a": 1},
                                             "no_stop_trim": True})
    assert r.status_code == 200, r.text
    bad = client.post("/v1/completions", json={"prompt": "hi", "custom_params": [1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "custom_params"
