"""logit_bias: a per-request sparse add in the sampler, before temperature and filtering, in
process, over both HTTP protocols (OpenAI sends string token ids) and in the language; bad
values are refused naming the field, before anything is queued."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
from starlette.testclient import TestClient

import sgl
from sgl.backend.sampler import SamplingBatchInfo, sample
from sgl.backend.server import create_app
from sgl.errors import InvalidSamplingParamsError
from sgl.sampling import SamplingParams
from test_server_support import get_tiny_engine

VOCAB = 32


def _info(params: list[SamplingParams]) -> SamplingBatchInfo:
    return SamplingBatchInfo.build(params, vocab_size=VOCAB, device="cpu", output_lens=[0] * len(params))


def test_bias_is_added_per_row_in_one_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    top = logits.argmax(dim=-1)
    params = [SamplingParams(temperature=0, logit_bias={7: 100}),  # forces 7
              SamplingParams(temperature=0),  # untouched
              SamplingParams(temperature=0, logit_bias={int(top[2]): -100})]  # bans its argmax
    out = sample(logits.clone(), _info(params)).next_token_ids
    assert out[0] == 7 and out[1] == top[1] and out[2] != top[2]
    expected = logits[2].clone()
    expected[top[2]] -= 100
    assert out[2] == expected.argmax()


def test_bias_applies_before_sampling_filters() -> None:
    # top_k=1 keeps only the biased token: the bias was added before the filter ran.
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 5.0
    params = [SamplingParams(temperature=1.0, top_k=1, seed=1, logit_bias={"11": 10})]
    assert sample(logits, _info(params)).next_token_ids.tolist() == [11]


def test_no_bias_builds_no_tensors() -> None:
    assert _info([SamplingParams(), SamplingParams(temperature=0)]).logit_bias is None


@pytest.mark.parametrize("bias,why", [({1: 101}, "[-100, 100]"), ({-1: 1}, "token id"), ({"x": 1}, "token id"),
                                      ({1: float("nan")}, "finite"), ([1, 2], "dict")])
def test_invalid_bias_values(bias: Any, why: str) -> None:
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.field == "logit_bias" and why in str(info.value)


# -- the engine and the server (tiny random-weight model) -----------------------------------------


@pytest.fixture(scope="module")
def engine() -> sgl.Engine:
    return get_tiny_engine()


@pytest.fixture(scope="module")
def client(engine: sgl.Engine) -> Iterator[TestClient]:
    with TestClient(create_app(engine)) as c:
        yield c


def test_engine_bias_forces_a_token(engine: sgl.Engine) -> None:
    out = engine.generate_sync([1, 2, 3], max_new_tokens=4, temperature=0, logit_bias={42: 100}, ignore_eos=True)
    assert out.token_ids == [42, 42, 42, 42]


def test_engine_rejects_ids_outside_the_vocabulary(engine: sgl.Engine) -> None:
    with pytest.raises(InvalidSamplingParamsError) as info:
        engine.generate_sync([1, 2, 3], max_new_tokens=1, logit_bias={10**6: 1})
    assert info.value.field == "logit_bias"


def test_native_and_openai_bias(client: TestClient) -> None:
    native = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {"42": 100}}})
    assert native.status_code == 200, native.text
    assert native.json()["output_ids"] == [42, 42, 42]
    oai = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0,
                                               "ignore_eos": True, "logit_bias": {"42": 100}})
    assert oai.status_code == 200, oai.text
    assert oai.json()["usage"]["completion_tokens"] == 3
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
        "logit_bias": {"42": 100}, "ignore_eos": True, "logprobs": True})
    assert chat.status_code == 200, chat.text
    ids = [e["token"] for e in chat.json()["choices"][0]["logprobs"]["content"]]
    assert len(ids) == 2 and all(t == ids[0] for t in ids)


@pytest.mark.parametrize("bias,param", [({"42": 1000}, "sampling_params.logit_bias"),
                                        ({"abc": 1}, "sampling_params.logit_bias"),
                                        ({"999999": 1}, "sampling_params.logit_bias")])
def test_native_bad_bias_is_a_400_naming_the_field(client: TestClient, bias: dict, param: str) -> None:
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"logit_bias": bias}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_language_gen_bias(engine: sgl.Engine) -> None:
    @sgl.function
    def prog(s):
        s += "Say:" + sgl.gen("x", max_tokens=3, temperature=0, ignore_eos=True, logit_bias={42: 100})

    state = prog.run(backend=engine)
    assert state["x"] == engine.decode([42, 42, 42])


def test_openai_backend_sends_logit_bias_and_stop_regex() -> None:
    remote = sgl.OpenAI("gpt-3.5-turbo-instruct", base_url="http://127.0.0.1:9/v1")
    args = remote._arguments(SamplingParams(logit_bias={42: -5}, stop_regex=r"\d"), sgl.LogprobOptions())
    assert args["logit_bias"] == {"42": -5.0} and args["extra_body"]["stop_regex"] == [r"\d"]
