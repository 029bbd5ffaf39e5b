"""Reasoning models: <think> splitting, constraints after the reasoning, the reasoning cap.

The default model does not think, so the engine tests give the tiny random-weight model a
chat template that does: THINK_OPEN opens `<think>` in the prompt (DeepSeek-R1's and newer
Qwen3 templates), THINK_QWEN3 only mentions it (the model opens it; `enable_thinking=False`
closes an empty one in the prompt, as Qwen3's template does). Random weights never write
`</think>` themselves, so the cap is what ends the reasoning.
"""

from __future__ import annotations

import asyncio
from typing import Iterator, Literal

import pytest
from pydantic import BaseModel
from starlette.testclient import TestClient

import sgl
from sgl.reasoning import ReasoningMode, ReasoningSplitter, reasoning_mode
from tiny_engines import tokenized_tiny_engine

TURNS = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
THINK_OPEN = TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
THINK_QWEN3 = TURNS + ("{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined "
                       "and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "Is it sunny?"}]


class Answer(BaseModel):
    sunny: bool
    sky: Literal["clear", "cloudy"]


@pytest.fixture(scope="module")
def engine() -> Iterator[sgl.Engine]:
    eng = tokenized_tiny_engine()
    yield eng
    eng.close()


@pytest.fixture
def thinking(engine: sgl.Engine) -> Iterator[sgl.Engine]:
    tok = engine.tokenizer
    original = tok.chat_template
    tok.chat_template = THINK_OPEN
    yield engine
    tok.chat_template = original


# -- the splitter ----------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [1, 3, 100])
@pytest.mark.parametrize("inside,text", [
    (False, "<think>\nhmm </thi nk> ok\n</think>\n\nThe answer."),
    (True, "hmm </thi nk> ok\n</think>\n\nThe answer."),
    (True, "<think>hmm </thi nk> ok\n</think>\n\nThe answer."),  # R1 repeating the opening tag
])
def test_splitter_at_any_chunking(step: int, inside: bool, text: str) -> None:
    splitter = ReasoningSplitter(ReasoningMode(inside))
    reasoning, content = "", ""
    for i in range(0, len(text), step):
        r, c = splitter.feed(text[i:i + step])
        # Never half an end marker: what was handed out is always a prefix of the reasoning.
        assert "hmm </thi nk> ok\n".startswith((reasoning + r).lstrip("\n"))
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    assert (reasoning + r).strip() == "hmm </thi nk> ok" and content + c == "The answer."


def test_no_reasoning_when_the_output_does_not_open_it() -> None:
    splitter = ReasoningSplitter(ReasoningMode(inside=False))
    assert splitter.feed("Just an answer") == ("", "Just an answer")


def test_mode_is_read_from_template_and_prompt() -> None:
    assert reasoning_mode("auto", "no thinking here", "<|im_start|>assistant\n") is None
    assert reasoning_mode("auto", THINK_OPEN, "assistant\n<think>\n") == ReasoningMode(inside=True)
    assert reasoning_mode("auto", THINK_QWEN3, "assistant\n") == ReasoningMode(inside=False)
    assert reasoning_mode("auto", THINK_QWEN3, "<think>\n\n</think>\n\n") is None
    assert reasoning_mode("deepseek-r1", "", "assistant\n") == ReasoningMode(inside=True)
    assert reasoning_mode("none", THINK_OPEN, "<think>\n") is None


# -- the engine ------------------------------------------------------------------------------------


def _reasoning_tokens(engine: sgl.Engine, out: sgl.GenerateOutput) -> int:
    """How many output tokens the reasoning took: those whose text lies before `</think>`."""
    assert "</think>" in out.text
    reasoning = out.text.split("</think>")[0]
    k = 0
    while k < len(out.token_ids) and reasoning.startswith(engine.decode(out.token_ids[:k + 1])):
        k += 1
    return k


@pytest.mark.parametrize("cap", [0, 3, 12])
def test_schema_applies_after_capped_reasoning(thinking: sgl.Engine, cap: int) -> None:
    outs = thinking.generate_sync(MESSAGES, schema=Answer, max_reasoning_tokens=cap, n=4, temperature=1.0, seed=1,
                                  max_new_tokens=200)
    for out in outs:
        assert isinstance(out.parsed, Answer), out.text
        assert out.content == out.parsed.model_dump_json(indent=2)
        assert out.text.endswith(out.content) and out.reasoning is not None
        assert _reasoning_tokens(thinking, out) <= cap
        assert out.text.split("</think>")[0].strip() == out.reasoning


def test_cap_alone_ends_free_reasoning(thinking: sgl.Engine) -> None:
    out = thinking.generate_sync(MESSAGES, max_reasoning_tokens=5, max_new_tokens=40, temperature=1.0, seed=2)
    assert "</think>" in out.text and out.reasoning == out.text.split("</think>")[0].strip()
    assert out.content == out.text.split("</think>", 1)[1].lstrip()


def test_without_a_cap_or_constraint_the_text_is_only_split(thinking: sgl.Engine) -> None:
    out = thinking.generate_sync(MESSAGES, max_new_tokens=10, temperature=0)
    plain = thinking.generate_sync(MESSAGES, max_new_tokens=10, temperature=0, separate_reasoning=False)
    assert out.text == plain.text  # no grammar was added
    assert out.reasoning == out.text.strip() and out.content == ""
    assert plain.reasoning is None and plain.content is None


def test_streamed_reasoning_and_content(thinking: sgl.Engine) -> None:
    async def run() -> tuple[str, str, sgl.GenerateOutput]:
        reasoning, content, out = "", "", None
        async for chunk in thinking.stream(MESSAGES, schema=Answer, max_reasoning_tokens=4, temperature=1.0, seed=3,
                                           max_new_tokens=200):
            reasoning += chunk.reasoning or ""
            content += chunk.content or ""
            out = chunk.output or out
        return reasoning, content, out

    reasoning, content, out = asyncio.run(run())
    assert reasoning.strip() == out.reasoning and content == out.content
    assert isinstance(out.parsed, Answer)


def test_qwen3_style_template_opens_think_itself(engine: sgl.Engine) -> None:
    tok = engine.tokenizer
    original, tok.chat_template = tok.chat_template, THINK_QWEN3
    try:
        out = engine.generate_sync(MESSAGES, schema=Answer, max_reasoning_tokens=3, temperature=1.0, seed=4,
                                   max_new_tokens=200)
        assert out.text.startswith("<think>") and isinstance(out.parsed, Answer)
        # A plain completion prompt is not chat: nothing is forced unless the caller says so.
        raw = engine.generate_sync("Answer in JSON:", schema=Answer, temperature=1.0, seed=4, max_new_tokens=200)
        assert raw.text.startswith("{") and raw.reasoning is None
        chat_ids = engine.apply_chat_template(MESSAGES, tokenize=True)
        said = engine.generate_sync(chat_ids, schema=Answer, separate_reasoning=True, max_reasoning_tokens=2,
                                    temperature=1.0, seed=4, max_new_tokens=200)
        assert said.text.startswith("<think>") and isinstance(said.parsed, Answer)
        off = engine.generate_sync(MESSAGES, schema=Answer, chat_template_kwargs={"enable_thinking": False},
                                   temperature=1.0, seed=4, max_new_tokens=200)
        assert off.text.startswith("{") and off.reasoning is None  # the prompt closed the reasoning
    finally:
        tok.chat_template = original


def test_cap_without_a_reasoning_model_is_refused(engine: sgl.Engine) -> None:
    with pytest.raises(sgl.InvalidRequestError, match="reasoning model") as info:
        engine.generate_sync(MESSAGES, max_reasoning_tokens=4)
    assert info.value.field == "max_reasoning_tokens"


def test_server_reports_reasoning_content(thinking: sgl.Engine) -> None:
    from sgl.backend.server import create_app

    body = {"model": "m", "messages": MESSAGES, "max_reasoning_tokens": 3, "temperature": 0, "max_tokens": 100,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "a", "schema": Answer.model_json_schema()}}}
    with TestClient(create_app(thinking)) as http:
        message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message["reasoning_content"] and Answer.model_validate_json(message["content"])
        lines = http.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
    import json

    deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in lines if x.startswith("data: {")]
    assert "".join(d.get("reasoning_content", "") for d in deltas).strip() == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_tool_calls_after_reasoning(thinking: sgl.Engine) -> None:
    outs = thinking.generate_sync(MESSAGES, tools=[Answer], tool_choice="Answer", max_reasoning_tokens=4, n=3,
                                  temperature=1.0, seed=6, max_new_tokens=200)
    for out in outs:
        (call,) = out.tool_calls
        assert call.name == "Answer" and isinstance(call.value, Answer)
        assert out.reasoning and "</think>" not in out.reasoning and "<tool_call>" not in out.reasoning
        assert out.content == ""
