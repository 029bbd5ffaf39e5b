"""Every example in examples/ runs end to end on the real default model (SmolLM2-135M, CPU).

The examples share one module-scoped engine through their `main(engine)` parameter, so the
model loads once; one test also runs a script as a subprocess to prove it works standalone.
The model is tiny: the assertions check structure (variables, choices, branches, streamed
text), never the quality of an answer.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import httpx
import pytest

import sgl

pytestmark = [pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Examples tested elsewhere by their owners (quickstart uses no program; JSON extraction has
# its own tests). Any other new example must get a test here.
TESTED_ELSEWHERE = {"quickstart.py", "json_extraction.py"}
TESTED_HERE = {"few_shot_qa.py", "chat_roles.py", "react_agent.py", "parallel_tips.py",
               "parallel_encoding.py", "streaming.py", "run_batch.py", "async_web_app.py", "agent_tools.py"}


def load(name: str) -> ModuleType:
    """Import examples/<name>.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"sgl_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engine() -> Iterator[sgl.Engine]:
    previous = sgl.get_default_backend()  # the examples set the default backend: restore it
    eng = sgl.Engine()
    try:
        yield eng
    finally:
        eng.close()
        sgl.set_default_backend(previous)


def test_every_example_is_tested() -> None:
    present = {p.name for p in EXAMPLES.glob("*.py")}
    assert TESTED_HERE <= present
    assert present - TESTED_HERE - TESTED_ELSEWHERE == set(), "add a test for the new example"


def test_few_shot_qa(engine: sgl.Engine) -> None:
    example = load("few_shot_qa")
    states = example.main(engine)
    assert len(states) == len(example.QUESTIONS)
    for state in states:
        assert state.error() is None
        answer = state["answer"]
        assert isinstance(answer, str) and answer.strip() and "\n" not in answer
        assert state.text().endswith("A:" + answer)
    # The worked examples are a shared prefix: later programs find them in the radix cache.
    assert all(s.get_meta_info("answer")["cached_tokens"] > 0 for s in states[1:])


def test_chat_roles(engine: sgl.Engine) -> None:
    state = load("chat_roles").main(engine)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["fact"].strip()
    assert messages[4]["content"] == state["short"].strip()
    assert all(m["content"] for m in messages)
    # The second turn extends the first turn's tokens, so the cache covers the first turn.
    first, second = state.get_meta_info("fact"), state.get_meta_info("short")
    assert second["cached_tokens"] >= first["prompt_tokens"]


def test_calculator_is_safe() -> None:
    calculator = load("react_agent").calculator
    assert calculator("12 * 7") == "84"
    assert calculator("7/2") == "3.5"
    assert calculator("1 / 0").startswith("error")
    assert calculator("__import__('os').getcwd()").startswith("error")


def test_react_agent(engine: sgl.Engine) -> None:
    example = load("react_agent")
    states = example.main(engine)
    assert len(states) == len(example.QUESTIONS)
    for state in states:
        steps = state.ret_value
        assert 1 <= len(steps) <= 3
        for i, step in enumerate(steps):
            assert step["action"] in example.ACTIONS
            assert state[f"action_{i}"] == step["action"]
            assert len(state.get_meta_info(f"action_{i}")["normalized_prompt_logprobs"]) == 2
            if step["action"] == "calculate":
                # The regex constraint guarantees an expression the tool can evaluate.
                assert re.fullmatch(example.EXPRESSION, step["input"])
                assert step["observation"] == example.calculator(step["input"])
                assert "Observation: " + step["observation"] in state.text()
        # The loop stops at "finish" or after max_steps, and always ends with an answer.
        assert steps[-1]["action"] == "finish" or len(steps) == 3
        assert isinstance(state["answer"], str)


def test_agent_tools_calls_real_tools(engine: sgl.Engine) -> None:
    example = load("agent_tools")
    result = example.main(engine)
    tools = {"calculate": example.calculate, "convert_units": example.convert_units}
    for run in result["runs"]:
        assert run["calls"], run  # tool_choice="required": the first turn always calls
        for step in run["calls"]:
            # The grammar guarantees arguments the real function accepts; its result went back.
            assert step["result"] == tools[step["tool"]](**step["arguments"])
        assert isinstance(run["answer"], str)
    state = result["program"]
    call = state["call"][0]
    assert isinstance(call, sgl.ToolCall) and call.name in tools
    assert state.ret_value["result"] == tools[call.name](**call.arguments)
    assert isinstance(state["answer"], str)


def test_parallel_tips(engine: sgl.Engine) -> None:
    example = load("parallel_tips")
    state = example.main(engine)
    details = state["detail"]  # gathered by forks.join()
    assert isinstance(details, list) and len(details) == len(example.TIPS)
    text = state.text()
    positions = [text.index(f"Tip {i + 1}: {tip} matters because" + detail)
                 for i, (tip, detail) in enumerate(zip(example.TIPS, details))]
    assert positions == sorted(positions)
    metas = state.get_meta_info("detail")
    assert len(metas) == len(example.TIPS)
    # Every branch starts from the parent's prefix, cached once at the fork.
    assert all(m["cached_tokens"] > 0 for m in metas)
    assert isinstance(state["summary"], str)


def test_parallel_encoding(engine: sgl.Engine) -> None:
    example = load("parallel_encoding")
    state = example.main(engine)
    text = state.text()
    positions = [text.index(f"Document {i + 1}: {doc}\n") for i, doc in enumerate(example.DOCUMENTS)]
    assert positions == sorted(positions)  # concate_and_append keeps the branches' order
    assert text.count("Note: this document is about") == len(example.DOCUMENTS)
    assert text.index("Question:") > positions[-1]
    assert isinstance(state["answer"], str) and text.endswith(state["answer"])


def test_streaming(engine: sgl.Engine) -> None:
    results = load("streaming").main(engine)
    assert set(results) == {"sync", "async"}
    for chunks, final in results.values():
        assert final and "".join(chunks) == final
        assert len(chunks) >= 2  # min_tokens=8: it really streamed, not one final chunk


def test_run_batch(engine: sgl.Engine, capsys: pytest.CaptureFixture[str]) -> None:
    example = load("run_batch")
    states = example.main(engine)
    assert len(states) == len(example.REVIEWS)
    for review, state in zip(example.REVIEWS, states):
        assert state.error() is None
        assert state["label"] in example.LABELS
        assert review in state.text()
        # run_batch cached the instructions and examples before fanning out.
        assert state.get_meta_info("reason")["cached_tokens"] > 0
    n = len(example.REVIEWS)
    assert f"{n}/{n}" in capsys.readouterr().err  # the tqdm progress bar


def test_async_web_app(engine: sgl.Engine) -> None:
    example = load("async_web_app")
    questions = example.QUESTIONS
    result = example.main(engine)
    responses = result["responses"]
    assert len(responses) == len(questions)
    for question, (status, body) in zip(questions, responses):
        assert status == 200
        assert body["question"] == question
        assert isinstance(body["topic"], str) and isinstance(body["answer"], str)
    stats = result["stats"]
    assert stats["served"] == len(questions) and stats["in_flight"] == 0
    assert stats["max_in_flight"] > 1  # the programs really ran concurrently


def test_async_web_app_rejects_bad_request(engine: sgl.Engine) -> None:
    example = load("async_web_app")

    async def go() -> Any:
        transport = httpx.ASGITransport(app=example.create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.post("/ask", json={"question": ""})

    response = asyncio.run(go())
    assert response.status_code == 400


def test_script_runs_standalone() -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / "few_shot_qa.py")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Q: What is the capital of Italy?" in proc.stdout
    assert proc.stdout.count("\nA:") == len(load("few_shot_qa").QUESTIONS)


def test_state_is_readable_after_its_loop_closed() -> None:
    """`asyncio.run(f.arun())` returns a finished state whose loop is closed; reading it
    must not need that loop (found writing examples/streaming.py; fake backend, fast)."""

    @sgl.function
    async def program(s):
        s += "Q:" + sgl.gen("x", max_tokens=3)

    state = asyncio.run(program.arun(backend=sgl.FakeBackend()))
    assert state["x"] and state.text() == "Q:" + state["x"]
    assert state.get_meta_info("x") is not None
