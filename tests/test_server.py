"""`sgl serve` end to end: a real server process on loopback, driven with the official `openai`
client and with raw HTTP for SGLang's native protocol. Greedy outputs are compared across
the protocols and with the in-process engine."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from test_server_support import API_KEY, Server, get_engine, get_server

pytestmark = [pytest.mark.slow]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server() -> Server:
    return get_server()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server: Server) -> httpx.Client:
    with server.client() as c:
        yield c


# -- OpenAI protocol ----------------------------------------------------------------------------


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["default"]


def test_completion_greedy_equals_native_and_engine(client: openai.OpenAI, http: httpx.Client) -> None:
    out = client.completions.create(model="default", prompt=PROMPT, max_tokens=6, temperature=0)
    native = http.post("/generate", json={"text": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0}}).json()
    local = get_engine().generate_sync(PROMPT, max_new_tokens=6, temperature=0)
    assert out.choices[0].text == native["text"] == local.text
    assert out.usage.prompt_tokens == native["meta_info"]["prompt_tokens"] == local.usage.prompt_tokens
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"


def test_completion_stop_n_seed_and_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model="default", prompt="1, 2, 3,", max_tokens=12, temperature=0,
                                    stop=[" 6"], logprobs=2)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and "6" not in choice.text and "5" in choice.text
    lp = choice.logprobs
    # Logprobs cover every generated token, the matched (trimmed) stop string included.
    assert "".join(lp.tokens).startswith(choice.text) and len(lp.token_logprobs) == len(lp.tokens)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    sampled = client.completions.create(model="default", prompt="Once upon a time", max_tokens=5,
                                        temperature=1.0, n=2, seed=7)
    again = client.completions.create(model="default", prompt="Once upon a time", max_tokens=5,
                                      temperature=1.0, n=2, seed=7)
    assert [c.index for c in sampled.choices] == [0, 1]
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]
    assert sampled.usage.completion_tokens == 10


def test_chat_usage_reports_cached_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name one colour of the rainbow."}]
    first = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0)
    second = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0)
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content == second.choices[0].message.content
    local = get_engine().generate_sync(messages, max_new_tokens=4, temperature=0)
    assert first.choices[0].message.content == local.text
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.total_tokens == second.usage.prompt_tokens + second.usage.completion_tokens


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=3, temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)


def test_streaming_completion_and_chat(client: openai.OpenAI) -> None:
    full = client.completions.create(model="default", prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model="default", prompt=PROMPT, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    messages = [{"role": "user", "content": "Count to three."}]
    whole = client.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0)
    parts = list(client.chat.completions.create(model="default", messages=messages, max_tokens=8,
                                                temperature=0, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == whole.choices[0].message.content


def test_json_schema_response_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Invent a person as JSON."}],
        max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    value = json.loads(out.choices[0].message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    obj = client.completions.create(model="default", prompt="JSON:", max_tokens=30, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)
    regex = client.completions.create(model="default", prompt="The year is", max_tokens=8, temperature=0,
                                      extra_body={"regex": r" (19|20)[0-9]{2}"})
    assert regex.choices[0].text.strip().isdigit() and len(regex.choices[0].text) == 5


# -- SGLang native protocol ---------------------------------------------------------------------


def test_native_batch_and_input_ids(http: httpx.Client) -> None:
    engine = get_engine()
    prompts = [PROMPT, "Water is made of"]
    out = http.post("/generate", json={"text": prompts, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "n": 2}}).json()
    assert len(out) == 4 and out[0]["text"] == out[1]["text"]
    local = engine.generate_sync(prompts, max_new_tokens=4, temperature=0)
    assert [o["text"] for o in out[::2]] == [o.text for o in local]
    ids = engine.encode(prompts[1])
    by_ids = http.post("/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}}).json()
    assert by_ids["text"] == out[2]["text"] and by_ids["output_ids"] == local[1].token_ids
    reason = by_ids["meta_info"]["finish_reason"]
    assert reason["type"] == "length" and "matched" in reason


def test_native_logprobs_shape(http: httpx.Client) -> None:
    out = http.post("/generate", json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
        "return_text_in_logprobs": True}).json()
    meta = out["meta_info"]
    prompt_len = meta["prompt_tokens"]
    assert len(meta["input_token_logprobs"]) == prompt_len
    assert meta["input_token_logprobs"][0][0] is None  # no logprob for the first token
    assert len(meta["input_top_logprobs"]) == prompt_len and meta["input_top_logprobs"][0] is None
    assert [row[1] for row in meta["output_token_logprobs"]] == out["output_ids"]
    assert "".join(row[2] for row in meta["output_token_logprobs"]) == out["text"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    local = get_engine().generate_sync(PROMPT, max_new_tokens=3, temperature=0, return_logprob=True,
                                       logprob_start_len=0)
    assert [r[0] for r in meta["output_token_logprobs"]] == pytest.approx(
        [e.logprob for e in local.logprobs.output], abs=1e-3)


def test_native_stream_is_cumulative(http: httpx.Client) -> None:
    payload = {"text": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0}, "stream": True}
    with http.stream("POST", "/generate", json=payload) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    whole = http.post("/generate", json={**payload, "stream": False}).json()
    assert texts[-1] == whole["text"]


def test_native_constraint_and_info_routes(http: httpx.Client) -> None:
    out = http.post("/generate", json={"text": "Pick a digit:", "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "regex": "[0-9]"}}).json()
    assert len(out["text"]) == 1 and out["text"].isdigit()
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and "<|im_start|>" in info["chat_template"]
    server_info = http.get("/get_server_info").json()
    assert server_info["max_total_num_tokens"] == 8192 and "stats" in server_info
    assert http.post("/flush_cache").status_code in (200, 400)
    assert http.get("/health_generate").status_code == 200


def test_metrics(http: httpx.Client) -> None:
    text = http.get("/metrics").text
    for name in ("sgl_requests_total{", "sgl_generation_tokens_total", "sgl_cache_hit_rate",
                 "sgl_time_to_first_token_seconds_bucket", "sgl_e2e_request_latency_seconds_count",
                 "sgl_inter_token_latency_seconds_sum", "sgl_kv_usage_ratio"):
        assert name in text, name
    count = next(line for line in text.splitlines() if line.startswith("sgl_e2e_request_latency_seconds_count"))
    assert int(count.split()[1]) > 0
