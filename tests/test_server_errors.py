"""The server's failure paths: API key, bad requests (4xx JSON naming the field), and clients
that disconnect (their requests are aborted, KV freed, and the server keeps serving)."""

from __future__ import annotations

import httpx
import openai
import pytest

from test_server_support import API_KEY, Server, get_server

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def server() -> Server:
    return get_server()


@pytest.fixture(scope="module")
def http(server: Server) -> httpx.Client:
    with server.client() as c:
        yield c


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) >= {"message", "type", "param"}
    return body


def test_api_key_required_except_health(server: Server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    for path in ("/v1/models", "/get_model_info", "/metrics"):
        body = _error(httpx.get(server.url + path), 401)
        assert "missing API key" in body["message"]
        _error(httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}), 401)
    _error(httpx.post(server.url + "/generate", json={"text": "hi"}), 401)
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="default", prompt="hi", max_tokens=1)
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.models.list().data


@pytest.mark.parametrize("path, payload, param", [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**7}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": "", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "regex": "(unclosed"}, "regex"),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function"}]}, "tools"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -2}}, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_token": 3}}, "sampling_params.max_new_token"),
    ("/generate", {"sampling_params": {}}, "text"),
    ("/generate", {"text": "hi", "input_ids": [1]}, "input_ids"),
    ("/generate", {"text": "hi", "top_logprobs_num": -1, "return_logprob": True}, "top_logprobs_num"),
    ("/generate", {"text": "hi", "image_data": "x.png"}, "image_data"),
])
def test_bad_requests_name_the_field(http: httpx.Client, path: str, payload: dict, param: str) -> None:
    body = _error(http.post(path, json={"model": "default", **payload} if path != "/generate" else payload), 400)
    assert body["param"] == param, body


def test_malformed_json_and_unknown_routes(http: httpx.Client) -> None:
    body = _error(http.post("/generate", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert "JSON" in body["message"]
    _error(http.get("/v1/nothing"), 404)
    _error(http.get("/generate"), 405)


def test_streaming_client_disconnect_aborts_and_frees_kv(server: Server, http: httpx.Client) -> None:
    before = server.wait_idle()
    payload = {"text": "Tell me a very long story.", "stream": True,
               "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=payload) as response:
        lines = response.iter_lines()
        got = [line for _, line in zip(range(6), lines)]
        assert any(line.startswith("data: ") for line in got)
        assert server.server_info()["stats"]["running"] == 1
    stats = server.wait_idle()
    assert stats["running"] == 0
    # Only the cached prefix may remain: far less than the 2000 tokens it could have held.
    assert stats["kv_used_tokens"] - before["kv_used_tokens"] < 500
    out = http.post("/generate", json={"text": "Still there?", "sampling_params": {"max_new_tokens": 2}})
    assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 2


def test_non_streaming_client_disconnect_aborts(server: Server) -> None:
    server.wait_idle()
    payload = {"model": "default", "prompt": "Write a long essay.", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=payload, headers=server.headers, timeout=2.0)
    stats = server.wait_idle()
    assert stats["running"] == 0 and stats["waiting"] == 0
    metrics = httpx.get(server.url + "/metrics", headers=server.headers).text
    assert 'outcome="disconnected"' in metrics
