"""asyncio-native execution: arun, async programs, concurrency, streaming."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import sgl.lang as sgl
from sgl.errors import ProgramError
from sgl.lang import FakeBackend


@sgl.function
async def tool_agent(s, question):
    s += "Q: " + question + "\nTool call:" + sgl.gen("call", max_tokens=4)
    call = await s.aget("call")
    await asyncio.sleep(0.01)  # e.g. an HTTP request between generations
    s += "\nObservation: " + call.upper() + "\nAnswer:" + sgl.gen("answer", max_tokens=2)


@pytest.mark.anyio
async def test_async_program_awaits_between_gens() -> None:
    backend = FakeBackend()
    state = await tool_agent.arun(question="q", backend=backend)
    assert await state.aget("answer") == " 0"
    assert await state.atext() == "Q: q\nTool call: 0 1\nObservation:  0 1\nAnswer: 0"
    second = backend.requests_of("generate")[1]
    assert second.text.endswith("Observation:  0 1\nAnswer:")


@pytest.mark.anyio
async def test_many_programs_concurrently_on_one_loop_without_threads() -> None:
    backend = FakeBackend(delay=0.05)
    threads_before = threading.active_count()
    start = time.perf_counter()
    states = await asyncio.gather(*(tool_agent.arun(question=str(i), backend=backend)
                                    for i in range(200)))
    elapsed = time.perf_counter() - start
    assert [await s.aget("answer") for s in states] == [" 0"] * 200
    assert backend.max_in_flight >= 150  # they really ran at the same time ...
    assert elapsed < 2.0  # ... 400 sequential calls would take 20 s
    assert threading.active_count() == threads_before  # ... and no thread per program


@pytest.mark.anyio
async def test_sync_program_under_arun_and_sync_read_in_async_program() -> None:
    backend = FakeBackend()

    @sgl.function
    def sync_prog(s):
        s += "a" + sgl.gen("x", max_tokens=2)
        s += s["x"]  # blocks its worker thread, not the loop

    state = await sync_prog.arun(backend=backend)
    assert await state.atext() == "a 0 0"

    @sgl.function
    async def wrong(s):
        s += "a" + sgl.gen("x", max_tokens=2)
        s += s["x"]  # would block the loop: must raise, not hang

    with pytest.raises(ProgramError) as info:
        await wrong.arun(backend=backend)
    assert "await s.aget('x')" in str(info.value.__cause__)


def test_async_program_from_sync_run() -> None:
    state = tool_agent.run(question="q", backend=FakeBackend())
    assert state["answer"] == " 0" and state.text().startswith("Q: q")


@pytest.mark.anyio
async def test_async_program_error_has_traceback() -> None:
    @sgl.function
    async def failing(s):
        s += "x" + sgl.gen("a", max_tokens=1)
        await s.aget("a")
        raise KeyError("missing tool")

    with pytest.raises(ProgramError) as info:
        await failing.arun(backend=FakeBackend())
    assert isinstance(info.value.__cause__, KeyError)
    assert "failing" in str(info.value)


@pytest.mark.anyio
async def test_run_from_inside_a_program_is_refused() -> None:
    inner = sgl.function(lambda s: None)

    @sgl.function
    async def outer(s):
        inner.run(backend=FakeBackend())

    with pytest.raises(ProgramError, match="arun"):
        outer.run(backend=FakeBackend())


@sgl.function
def chat(s, q):
    s += sgl.user(q)
    s += sgl.assistant(sgl.gen("answer", max_tokens=20))


def test_stream_text_iter_sync() -> None:
    backend = FakeBackend(responses={"hello": "Hi there, friend!"}, delay=0.05)
    state = chat.run(q="hello", stream=True, backend=backend)
    chunks = list(state.text_iter("answer"))
    assert len(chunks) > 3  # it streamed token by token
    assert "".join(chunks) == "Hi there, friend!"
    state = chat.run(q="hello", stream=True, backend=backend)
    whole = "".join(state.text_iter())
    assert whole == state.text() and whole.endswith("Hi there, friend!<|im_end|>\n")


@pytest.mark.anyio
async def test_stream_text_async_iter() -> None:
    backend = FakeBackend(responses={"hello": "Hi there!"}, delay=0.02)
    state = await chat.arun(q="hello", stream=True, backend=backend)
    chunks = [c async for c in state.text_async_iter("answer")]
    assert len(chunks) > 3 and "".join(chunks) == "Hi there!"
    # A state started from sync code (the background loop) can be iterated from this loop.
    state = chat.run(q="hello", stream=True, backend=backend)
    assert "".join([c async for c in state.text_async_iter()]) == await state.atext()


def test_stream_error_raises_from_iterator() -> None:
    backend = FakeBackend(fail_on="boom")
    state = chat.run(q="boom", stream=True, backend=backend)
    with pytest.raises(RuntimeError, match="injected"):
        list(state.text_iter("answer"))
