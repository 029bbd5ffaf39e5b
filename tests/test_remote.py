"""The same programs on the in-process engine and on remote backends against a real server:
`sgl.RuntimeEndpoint` (SGLang's native protocol) and `sgl.OpenAI` (OpenAI-compatible API).
Greedy outputs and select decisions must be equal."""

from __future__ import annotations

import pytest

import sgl
from sgl.errors import BackendCapabilityError, ContextLengthError, InvalidConfigError, InvalidRequestError
from test_server_support import API_KEY, Server, get_engine, get_server

pytestmark = [pytest.mark.slow]

FEW_SHOT = "Q: What is the capital of France?\nA: Paris\nQ: What is the capital of Germany?\nA: Berlin\n"


@sgl.function
def qa(s, question):
    s += FEW_SHOT + "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=6, stop="\n", temperature=0)
    s += "\nIs that correct? Answer:" + sgl.select("check", [" Yes", " No", " Not sure"])


@sgl.function
def chat(s):
    s += sgl.system("You answer in a few words.")
    s += sgl.user("What colour is the sky?")
    s += sgl.assistant(sgl.gen("first", max_tokens=6, temperature=0))
    forks = s.fork(2)
    forks += lambda i: sgl.user(["Why?", "And at night?"][i]) + sgl.assistant(
        sgl.gen("more", max_tokens=5, temperature=0))
    forks.join()


@sgl.function
def digits(s):
    s += "My favourite number is" + sgl.gen("n", regex=r" [0-9]{2}", temperature=0)


@sgl.function
def judge(s):
    s += sgl.user("Is the sky blue?")
    s += sgl.assistant(sgl.select("yn", ["Yes", "No"]))


# Select logprobs agree to this much, not to float32's noise: the two backends reach the same
# prompt by different requests (a prefix's K/V from the radix cache, written by a decode step,
# or recomputed by a prefill: float32 values a few ulps apart), and the CPU's float16 KV cache
# (kv_cache_dtype "auto") rounds them to float16 steps (relative 2^-11), which moves a
# normalized prompt logprob by ~1e-3. The texts and the chosen options stay equal (asserted).
LOGPROB_ABS = 5e-3


@pytest.fixture(scope="module")
def server() -> Server:
    return get_server()


@pytest.fixture(scope="module")
def endpoint(server: Server) -> sgl.RuntimeEndpoint:
    return sgl.RuntimeEndpoint(server.url, api_key=API_KEY)


@pytest.fixture(scope="module")
def engine():  # noqa: ANN201
    return get_engine()


def test_runtime_endpoint_gen_select_equal_engine(endpoint: sgl.RuntimeEndpoint, engine) -> None:  # noqa: ANN001
    local = qa.run(question="What is the capital of Italy?", backend=engine)
    remote = qa.run(question="What is the capital of Italy?", backend=endpoint)
    assert remote.text() == local.text()
    assert remote["answer"] == local["answer"] and remote["check"] == local["check"]
    lp_local = local.get_meta_info("check")["normalized_prompt_logprobs"]
    lp_remote = remote.get_meta_info("check")["normalized_prompt_logprobs"]
    assert lp_remote == pytest.approx(lp_local, abs=LOGPROB_ABS)
    assert remote.get_meta_info("answer")["finish_reason"]["type"] in ("stop", "length")


def test_runtime_endpoint_roles_fork_and_constraints(endpoint: sgl.RuntimeEndpoint, engine) -> None:  # noqa: ANN001
    assert endpoint.get_chat_template().role_prefix_and_suffix == \
        sgl.EngineBackend(engine).get_chat_template().role_prefix_and_suffix
    local, remote = chat.run(backend=engine), chat.run(backend=endpoint)
    assert remote.text() == local.text()
    assert remote["more"] == local["more"]
    assert remote.messages() == local.messages()
    out = digits.run(backend=endpoint)
    assert out["n"] == digits.run(backend=engine)["n"] and len(out["n"].strip()) == 2


def test_runtime_endpoint_streaming_and_token_mode(server: Server, endpoint, engine) -> None:  # noqa: ANN001
    state = qa.run(question="What is the capital of Spain?", backend=endpoint, stream=True)
    pieces = list(state.text_iter("answer"))
    assert "".join(pieces) == state["answer"]
    tokens = sgl.RuntimeEndpoint(server.url, api_key=API_KEY, tokenizer=engine.tokenizer)
    by_ids = qa.run(question="What is the capital of Spain?", backend=tokens)
    assert by_ids.text() == qa.run(question="What is the capital of Spain?", backend=engine).text()
    assert by_ids.get_meta_info("answer")["cached_tokens"] > 0  # the few-shot prefix was cached


def test_runtime_endpoint_errors(server: Server, endpoint: sgl.RuntimeEndpoint) -> None:
    with pytest.raises(InvalidConfigError, match="api_key"):
        sgl.RuntimeEndpoint(server.url, api_key="wrong")

    @sgl.function
    def bad(s):
        s += "hi" + sgl.gen("x", max_tokens=10**6)  # valid locally, too long for the server

    with pytest.raises(Exception) as info:  # the program error wraps the server's 400
        bad.run(backend=endpoint)
    cause = info.value if isinstance(info.value, InvalidRequestError) else info.value.__cause__
    assert isinstance(cause, ContextLengthError) and cause.field == "sampling_params.max_new_tokens"


def test_openai_backend_chat_and_completion_models(server: Server, engine) -> None:  # noqa: ANN001
    chat_model = sgl.OpenAI("default", base_url=server.url + "/v1", api_key=API_KEY)
    local, remote = chat.run(backend=engine), chat.run(backend=chat_model)
    # The server renders the model's own template (default system prompt included), so the
    # model sees the same tokens: same greedy answers.
    assert remote["first"] == local["first"] and remote["more"] == local["more"]
    with pytest.raises(sgl.ProgramError) as info:
        judge.run(backend=chat_model)
    assert isinstance(info.value.__cause__, BackendCapabilityError) and "select" in str(info.value)
    with pytest.raises(sgl.ProgramError, match="outside an assistant turn"):
        digits.run(backend=chat_model)

    completion_model = sgl.OpenAI("default", base_url=server.url + "/v1", api_key=API_KEY,
                                  is_chat_model=False)
    local_qa = qa.run(question="What is the capital of Italy?", backend=engine)
    remote_qa = qa.run(question="What is the capital of Italy?", backend=completion_model)
    assert remote_qa.text() == local_qa.text()
    assert remote_qa.get_meta_info("check")["normalized_prompt_logprobs"] == pytest.approx(
        local_qa.get_meta_info("check")["normalized_prompt_logprobs"], abs=LOGPROB_ABS)
    streamed = qa.run(question="What is the capital of Italy?", backend=completion_model, stream=True)
    assert "".join(streamed.text_iter("answer")) == local_qa["answer"]
