"""The program language on the real default model (SmolLM2-135M-Instruct, CPU): token ids
reach the engine, the radix cache reuses a program's KV, select's scores match the engine's
own prompt logprobs, roles render with the model's template."""

from __future__ import annotations

import math

import pytest

import sgl.lang as L

pytestmark = [pytest.mark.slow]

FEW_SHOT = ("The following are questions with answers.\nQ: What is the capital of France?\n"
            "A: Paris\nQ: What is the capital of Germany?\nA: Berlin\n")


@pytest.fixture(scope="module")
def engine():  # noqa: ANN201
    from sgl.engine import Engine

    eng = Engine(max_total_tokens=16384)
    try:
        yield eng
    finally:
        eng.close()


@L.function
def qa(s, question):
    s += FEW_SHOT + "Q: " + question + "\n"
    s += "A:" + L.gen("answer", stop="\n", temperature=0, max_tokens=10)
    s += "\nQ: And its population?\nA:" + L.gen("more", stop="\n", temperature=0, max_tokens=10)


def test_gen_reuses_kv_and_tokens_match_text(engine) -> None:  # noqa: ANN001
    state = qa.run(question="What is the capital of Italy?", backend=engine)
    assert "Rome" in state["answer"]
    assert state.token_ids() == engine.encode(state.text())
    first, second = state.get_meta_info("answer"), state.get_meta_info("more")
    # The second gen's prompt extends the first's prompt + output: the cache holds most of it.
    assert second["cached_tokens"] >= first["prompt_tokens"]


def test_select_scores_match_engine_prompt_logprobs(engine) -> None:  # noqa: ANN001
    @L.function
    def judge(s):
        s += FEW_SHOT + "Q: Is Paris in France?\nA:" + L.select("yn", [" Yes", " No", " Maybe not"])

    state = judge.run(backend=engine)
    meta = state.get_meta_info("yn")
    for choice, row in zip([" Yes", " No", " Maybe not"], meta["input_token_logprobs"]):
        text = state.text()[: -len(state["yn"])] + choice
        out = engine.generate_sync(text, max_new_tokens=0, return_logprob=True, logprob_start_len=0)
        expected = [e.logprob for e in out.logprobs.prompt][-len(row):]
        assert [t[0] for t in row] == pytest.approx(expected, abs=1e-3)
    assert state["yn"] in (" Yes", " No", " Maybe not")
    assert all(not math.isnan(v) for v in meta["normalized_prompt_logprobs"])


def test_roles_match_the_model_template_and_fork(engine) -> None:  # noqa: ANN001
    @L.function
    def chat(s):
        s += L.user("Give me one word for happy.")
        s += L.assistant(L.gen("word", max_tokens=6, temperature=0))
        forks = s.fork(2)
        forks += lambda i: L.user(f"Another one, number {i}.") + L.assistant(
            L.gen("more", max_tokens=6, temperature=0))
        forks.join()

    state = chat.run(backend=engine)
    assert state.text() == engine.apply_chat_template(state.messages(), add_generation_prompt=False)
    assert len(state["more"]) == 2
    assert all(m["cached_tokens"] > 0 for m in state.get_meta_info("more"))


def test_run_batch_on_engine(engine) -> None:  # noqa: ANN001
    states = qa.run_batch([{"question": f"What is the capital of {c}?"} for c in ("Spain", "Japan")],
                          backend=engine, progress_bar=True)
    assert [s.error() for s in states] == [None, None]
    assert "Madrid" in states[0]["answer"] and "Tokyo" in states[1]["answer"]
