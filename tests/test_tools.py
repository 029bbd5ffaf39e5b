"""Tool calls in process: tool normalisation, the call formats and their parser, and
`engine.generate(messages, tools=...)` on a tiny random-weight model (fast, CPU)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator, Literal

import pytest
from pydantic import BaseModel

import sgl
from sgl._tool_format import FORMATS, ToolCallParser, detect_format
from sgl.tools import normalize_tool_choice, normalize_tools
from tiny_engines import tokenized_tiny_engine


class Weather(BaseModel):
    """Today's weather in a city."""

    city: Literal["Paris", "Rome"]
    celsius: bool


def toggle(on: bool, level: Literal[1, 2, 3] = 1) -> str:
    """Switch the lamp."""
    return f"lamp {'on' if on else 'off'} at {level}"


PING = {"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[sgl.Engine]:
    eng = tokenized_tiny_engine()
    yield eng
    eng.close()


# -- normalisation ---------------------------------------------------------------------------------


def test_tools_from_models_functions_and_dicts() -> None:
    weather, lamp, ping = normalize_tools([Weather, toggle, PING])
    assert (weather.name, weather.description, weather.model) == ("Weather", "Today's weather in a city.", Weather)
    assert weather.parameters["required"] == ["city", "celsius"]
    assert lamp.name == "toggle" and lamp.parameters["required"] == ["on"]
    assert lamp.invoke({"on": True, "level": 2}) == "lamp on at 2"
    assert ping.model is None and ping.openai() == PING


@pytest.mark.parametrize("tools,match", [
    ([], "non-empty list"),
    ([{"type": "function", "function": {"name": "has space"}}], "tool name"),
    ([PING, PING], "used twice"),
    ([lambda x: x], "type hint"),
    ([42], "cannot read a tool"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "type object"),
])
def test_bad_tools_raise_naming_the_problem(tools: Any, match: str) -> None:
    with pytest.raises(sgl.InvalidRequestError, match=match) as info:
        normalize_tools(tools)
    assert info.value.field == "tools"


def test_tool_choice_forms() -> None:
    tools = normalize_tools([Weather, PING])
    assert normalize_tool_choice(None, tools).mode == "auto"
    assert normalize_tool_choice("required", tools, parallel=False).parallel is False
    named = normalize_tool_choice({"type": "function", "function": {"name": "ping"}}, tools)
    assert (named.mode, named.name) == ("named", "ping")
    assert normalize_tool_choice(Weather, tools).name == "Weather"
    with pytest.raises(sgl.InvalidRequestError, match="not among the tools"):
        normalize_tool_choice("nope", tools)


# -- formats and the parser ------------------------------------------------------------------------


def test_format_is_read_from_the_chat_template() -> None:
    assert detect_format("{% for t in tools %}<tool_call>{% endfor %}").name == "hermes"
    assert detect_format('{{- \'"parameters": \' }}{{ tools }}').name == "llama3"
    assert detect_format("{{ messages }}").name == "hermes"  # no tool support: the default
    assert detect_format("<tool_call>", configured="llama3").name == "llama3"


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_parser_splits_content_and_calls_at_any_chunking(fmt: str, step: int) -> None:
    f = FORMATS[fmt]
    tools = normalize_tools([Weather, PING])
    args = '{"city": "Paris", "celsius": true}'
    tricky = '{"ok": true, "note": "} </tool_call> {\\"x"}'  # markers inside a string
    text = "Let me check. " + f.begin("Weather") + args + f.end + f.separator + f.begin("ping") + tricky + f.end
    parser = ToolCallParser(f, tools)
    content, deltas = "", []
    for i in range(0, len(text), step):
        piece, new = parser.feed(text[i:i + step])
        content += piece
        deltas += new
    content += parser.flush()
    final, calls = parser.result()
    assert [c.name for c in calls] == ["Weather", "ping"]
    assert calls[0].arguments == {"city": "Paris", "celsius": True}
    assert calls[0].value == Weather(city="Paris", celsius=True)
    assert calls[1].arguments_json == tricky and calls[1].value is None
    assert content == final == "Let me check. " + f.separator
    heads = [d for d in deltas if d.id is not None]
    assert [(d.index, d.name) for d in heads] == [(0, "Weather"), (1, "ping")]
    assert "".join(d.arguments for d in deltas if d.index == 0) == args


def test_parser_leaves_an_unfinished_call_out() -> None:
    f = FORMATS["hermes"]
    parser = ToolCallParser(f, normalize_tools([PING]))
    parser.feed(f.begin("ping") + '{"ok": tr')
    parser.flush()
    content, calls = parser.result()
    assert calls == [] and content == f.begin("ping") + '{"ok": tr'


# -- the engine ------------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["required", "Weather", "toggle"])
def test_generate_returns_typed_calls_for_every_sample(engine: sgl.Engine, choice: str) -> None:
    outs = engine.generate_sync(MESSAGES, tools=[Weather, toggle, PING], tool_choice=choice, n=6, temperature=1.0,
                                seed=3, max_new_tokens=300)
    for out in outs:
        assert out.finish_reason == "stop" and out.tool_calls, out.text
        for call in out.tool_calls:
            assert json.loads(call.arguments_json) == call.arguments
            if call.name == "Weather":
                assert call.value == Weather(**call.arguments)
            elif call.name == "toggle":
                assert isinstance(call.value.on, bool) and call.value.level in (1, 2, 3)
        if choice != "required":
            assert [c.name for c in out.tool_calls] == [choice]


def test_tool_choice_none_constrains_nothing(engine: sgl.Engine) -> None:
    plain = engine.generate_sync(MESSAGES, max_new_tokens=12, temperature=0)
    none = engine.generate_sync(MESSAGES, tools=[Weather], tool_choice="none", max_new_tokens=12, temperature=0)
    assert none.tool_calls is None and none.text  # the tools were shown, nothing was forced
    assert engine.apply_chat_template(MESSAGES, tools=[Weather]) != engine.apply_chat_template(MESSAGES)
    assert plain.tool_calls is None


def test_stream_carries_tool_call_deltas(engine: sgl.Engine) -> None:
    async def run() -> tuple[list[Any], Any]:
        deltas, last = [], None
        async for chunk in engine.stream(MESSAGES, tools=[Weather], tool_choice="Weather", temperature=1.0,
                                         seed=5, max_new_tokens=300):
            deltas += chunk.tool_calls or []
            last = chunk
        return deltas, last

    deltas, last = asyncio.run(run())
    (call,) = last.output.tool_calls
    assert deltas[0].id == call.id and deltas[0].name == "Weather"
    assert "".join(d.arguments for d in deltas) == call.arguments_json


def test_template_without_tools_gets_them_in_the_system_message(engine: sgl.Engine) -> None:
    text = engine.apply_chat_template(MESSAGES, tools=[PING])
    assert '"name": "ping"' in text and "<tool_call>" in text
    history = MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ping", "arguments": {"ok": True}}}]},
        {"role": "tool", "content": "pong", "tool_call_id": "c1"}]
    rendered = engine.apply_chat_template(history, tools=[PING])
    assert '<tool_call>\n{"name": "ping", "arguments": {"ok": true}}\n</tool_call>' in rendered
    assert "pong" in rendered


def test_tools_conflict_with_another_constraint(engine: sgl.Engine) -> None:
    with pytest.raises(sgl.InvalidRequestError, match="tool_choice='none'") as info:
        engine.generate_sync(MESSAGES, tools=[Weather], tool_choice="required", regex="[a-z]+")
    assert info.value.field == "tools"
    assert engine.generate_sync(MESSAGES, max_new_tokens=2).text is not None  # still serving


# -- the language ----------------------------------------------------------------------------------


def test_tool_call_primitive_in_a_program(engine: sgl.Engine) -> None:
    @sgl.function
    def program(s):  # noqa: ANN001, ANN202
        s += sgl.system(sgl.tools_prompt([Weather, toggle]))
        s += sgl.user("Turn the lamp on.")
        s += sgl.assistant(sgl.tool_call("call", tools=[Weather, toggle], tool_choice="toggle", max_tokens=200))

    state = program.run(backend=engine, temperature=1.0)
    (call,) = state["call"]
    assert isinstance(call, sgl.ToolCall) and call.name == "toggle" and isinstance(call.value.on, bool)
    assert state.get_meta_info("call")["tool_calls"] == [call]
    assert '"name": "toggle"' in sgl.tools_prompt([toggle])
    with pytest.raises(sgl.InvalidRequestError, match="tool_choice"):
        sgl.tool_call("x", tools=[toggle], tool_choice="auto")


# -- the grammars, checked with xgrammar's matcher -------------------------------------------------


def _matcher(engine: sgl.Engine, tools: list[Any], choice: str, fmt: str = "hermes") -> Any:
    import xgrammar as xgr

    from sgl import _structural

    normalized = normalize_tools(tools)
    ebnf = _structural.to_ebnf(_structural.tool_format(normalized, normalize_tool_choice(choice, normalized),
                                                       FORMATS[fmt]))
    info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer, vocab_size=engine.model_config.vocab_size)
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(xgr.Grammar.from_ebnf(ebnf)))


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_auto_grammar_allows_text_and_forces_well_formed_calls(engine: sgl.Engine, fmt: str) -> None:
    f = FORMATS[fmt]
    good = "Sure. " + f.begin("Weather") + '{"city": "Rome", "celsius": false}' + f.end + " Done."
    m = _matcher(engine, [Weather, PING], "auto", fmt)
    assert m.accept_string(good) and m.is_terminated() is False  # free text may go on
    for bad in [f.begin("Weather") + '{"city": "Lima", "celsius": false}',  # not in the enum
                f.begin("nope") + "{}",  # not a tool
                f.begin("Weather") + '{"celsius": false}']:  # a required key missing
        assert not _matcher(engine, [Weather, PING], "auto", fmt).accept_string(bad)


def test_required_grammar_refuses_text_first(engine: sgl.Engine) -> None:
    assert not _matcher(engine, [Weather], "required").accept_string("Hello")
    named = _matcher(engine, [Weather, PING], "ping")
    assert not named.accept_string(FORMATS["hermes"].begin("Weather"))


def test_llama3_format_end_to_end() -> None:
    eng = tokenized_tiny_engine(tool_call_parser="llama3")
    try:
        outs = eng.generate_sync(MESSAGES, tools=[Weather, PING], tool_choice="required", n=3, temperature=1.0,
                                 seed=2, max_new_tokens=200)
    finally:
        eng.close()
    for out in outs:
        assert out.text.startswith('{"name": "') and '"parameters": ' in out.text
        assert out.tool_calls and all(c.name in ("Weather", "ping") for c in out.tool_calls)
