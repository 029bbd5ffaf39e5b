"""Fast checks of the remote backends and server helpers that need no server or model."""

from __future__ import annotations

import math

import pytest

import sgl
from sgl.errors import BackendCapabilityError, ContextLengthError, InvalidConfigError, InvalidRequestError
from sgl.remote.http import remote_error
from sgl.remote.openai_backend import messages_from_text
from sgl.remote.runtime_endpoint import sampling_payload
from sgl.remote.templates import _JinjaTemplate, guess_template
from sgl.sampling import SamplingParams

CHATML = sgl.get_chat_template("chatml")


def _chatml(*turns: tuple[str, str], open_assistant: str | None = "") -> str:
    text = "".join(CHATML.role_prefix_and_suffix[r][0] + c + CHATML.role_prefix_and_suffix[r][1] for r, c in turns)
    if open_assistant is not None:
        text += CHATML.role_prefix_and_suffix["assistant"][0] + open_assistant
    return text


def test_chat_text_round_trips_to_messages() -> None:
    text = _chatml(("system", "Be brief."), ("user", "Hi\nthere"), ("assistant", "Hello"), ("user", "Bye"))
    assert messages_from_text(text) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    with pytest.raises(BackendCapabilityError, match="partial assistant"):
        messages_from_text(_chatml(("user", "Hi"), open_assistant="The answer is"))
    with pytest.raises(BackendCapabilityError, match="outside an assistant turn"):
        messages_from_text(_chatml(("user", "Hi"), open_assistant=None))
    with pytest.raises(BackendCapabilityError, match="outside a role"):
        messages_from_text("Plain text. " + _chatml(("user", "Hi")))


def test_sampling_payload_sends_only_changes_with_sglang_names() -> None:
    assert sampling_payload(SamplingParams()) == {}
    payload = sampling_payload(SamplingParams(max_new_tokens=5, temperature=0.0, stop=("\n",), seed=3,
                                              regex="[0-9]"))
    assert payload == {"max_new_tokens": 5, "temperature": 0.0, "stop": ["\n"], "sampling_seed": 3,
                       "regex": "[0-9]"}


def test_remote_errors_map_to_sgl_exceptions() -> None:
    err = remote_error(400, {"error": {"message": "bad", "param": "sampling_params.top_p"}}, "u")
    assert isinstance(err, InvalidRequestError) and err.field == "sampling_params.top_p"
    err = remote_error(400, {"error": {"message": "long", "param": "prompt",
                                       "code": "context_length_exceeded"}}, "u")
    assert isinstance(err, ContextLengthError)
    assert isinstance(remote_error(401, {"error": {"message": "no"}}, "u"), InvalidConfigError)
    assert isinstance(remote_error(503, "down", "u"), sgl.EngineError)


def test_jinja_roles_match_a_chatml_template() -> None:
    source = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    derived = sgl.chat_template_from_tokenizer(_JinjaTemplate(source, None, None))
    assert derived.role_prefix_and_suffix == CHATML.role_prefix_and_suffix
    assert guess_template("Qwen/Qwen2.5-7B-Instruct").name == "chatml"
    assert guess_template("meta-llama/Meta-Llama-3-8B-Instruct").name == "llama-3-instruct"
    assert guess_template("mistral-7b").name == "default"


def test_openai_backend_capabilities_without_a_server() -> None:
    chat = sgl.OpenAI("some-chat-model", base_url="http://127.0.0.1:9/v1")
    assert chat.is_chat_model and not chat.supports_logprobs
    completion = sgl.OpenAI("gpt-3.5-turbo-instruct", base_url="http://127.0.0.1:9/v1")
    assert not completion.is_chat_model and completion.supports_logprobs
    args = completion._arguments(SamplingParams(max_new_tokens=3, json_schema='{"type": "object"}',
                                                top_k=5), sgl.LogprobOptions(True, 0, 2))
    assert args["echo"] is True and args["logprobs"] == 2
    assert args["extra_body"] == {"top_k": 5, "response_format": {
        "type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}}}
    with pytest.raises(BackendCapabilityError, match="prompt logprobs"):
        chat._arguments(SamplingParams(), sgl.LogprobOptions(True, 0, 0))


def test_server_helpers() -> None:
    from sgl.backend.server.metrics import Histogram
    from sgl.backend.server.protocol import ApiError, finite
    from sgl.backend.server.validate import Fields

    h = Histogram("x_seconds", "help", (0.1, 1.0))
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    lines = h.render()
    assert 'x_seconds_bucket{le="0.1"} 1' in lines and 'x_seconds_bucket{le="+Inf"} 3' in lines
    assert "x_seconds_count 3" in lines
    f = Fields({"n": True, "typo": 1})
    with pytest.raises(ApiError) as info:
        f.integer("n")
    assert info.value.param == "n"
    with pytest.raises(ApiError) as info:
        f.reject_unknown()
    assert info.value.param == "typo"
    assert finite(math.nan) is None and finite(-1.5) == -1.5


def test_cli_maps_engine_options_to_flags() -> None:
    from sgl.cli import build_parser

    args = vars(build_parser().parse_args(
        ["serve", "--model-path", "m.gguf", "--max-total-tokens", "4096", "--disable-radix-cache",
         "--schedule-policy", "fcfs", "--api-key", "k"]))
    assert args["model"] == "m.gguf" and args["max_total_tokens"] == 4096
    assert args["disable_radix_cache"] is True and args["schedule_policy"] == "fcfs"
    assert "page_size" not in args  # unset engine options keep the engine's defaults
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--schedule-policy", "random"])
