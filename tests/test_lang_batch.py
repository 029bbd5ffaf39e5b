"""run_batch / arun_batch: order, progress bar, threads, errors, prefix caching."""

from __future__ import annotations

import pytest

import sgl.lang as sgl
from sgl.lang import FakeBackend

FEW_SHOT = "The following are questions with answers.\n\n" + "".join(
    f"Q: What is {i} + {i}?\nA: {2 * i}\n" for i in range(4))


@sgl.function
def qa(s, question):
    s += FEW_SHOT
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", max_tokens=16)


def test_run_batch_order_progress_bar_and_prefix_cache(capsys: pytest.CaptureFixture[str]) -> None:
    backend = FakeBackend(responder=lambda r: " " + r.text.rsplit("Q: ", 1)[1].split("?")[0] + "\n")
    questions = [f"question {i}?" for i in range(20)]
    states = qa.run_batch([{"question": q} for q in questions], backend=backend,
                          progress_bar=True, num_threads=4, temperature=0.1)
    assert [s["answer"] for s in states] == [f" question {i}" for i in range(20)]
    assert all(r.params.temperature == 0.1 for r in backend.requests_of("generate"))
    assert "20/20" in capsys.readouterr().err  # tqdm drew the bar
    # The constant few-shot prefix was traced and cached once, before the programs ran.
    (cached,) = backend.requests_of("cache_prefix")
    assert cached.text == FEW_SHOT + "Q: "
    assert cached.token_ids == [ord(c) for c in FEW_SHOT + "Q: "]
    assert backend.requests[0] is cached


def test_run_batch_keeps_errors_on_states() -> None:
    backend = FakeBackend(fail_on="question 1", error=ValueError("bad input"))
    states = qa.run_batch([{"question": "question 0"}, ("question 1",)], backend=backend)
    assert states[0].error() is None and states[0]["answer"]
    assert isinstance(states[1].error(), ValueError)
    with pytest.raises(ValueError):
        states[1]["answer"]


def test_run_batch_positional_and_empty() -> None:
    assert qa.run_batch([], backend=FakeBackend()) == []
    with pytest.raises(Exception, match="does not match"):
        qa.run_batch([("a", "b", "c")], backend=FakeBackend())


@pytest.mark.anyio
async def test_arun_batch_async_programs_concurrent() -> None:
    backend = FakeBackend(delay=0.02)

    @sgl.function
    async def prog(s, i):
        s += f"item {i}:" + sgl.gen("x", max_tokens=2)
        await s.aget("x")
        s += sgl.gen("y", max_tokens=2)

    states = await prog.arun_batch([{"i": i} for i in range(50)], backend=backend,
                                   num_threads=16, progress_bar=False)
    assert [await s.atext() for s in states] == [f"item {i}: 0 0" for i in range(50)]
    assert 8 <= backend.max_in_flight <= 16  # num_threads bounds the concurrency


@pytest.mark.anyio
async def test_arun_batch_sync_programs() -> None:
    states = await qa.arun_batch([{"question": "q?"}] * 3, backend=FakeBackend(), num_threads=2)
    assert len(states) == 3 and all(s.error() is None for s in states)


def test_prefix_tracing_stops_at_first_argument_use() -> None:
    from sgl.lang.tracer import extract_prefix

    @sgl.function
    def chat(s, q):
        s += sgl.system("You are a helpful assistant that answers in one word.")
        with s.user():
            s += "Question: " + q
        s += sgl.assistant(sgl.gen("a"))

    template = FakeBackend().get_chat_template()
    prefix = extract_prefix(chat, template)
    assert prefix == ("<|im_start|>system\nYou are a helpful assistant that answers in one "
                      "word.<|im_end|>\n<|im_start|>user\nQuestion: ")

    @sgl.function
    async def async_prog(s, q):
        s += "constant " * 10
        s += f"{q}"

    assert extract_prefix(async_prog, template) == "constant " * 10
