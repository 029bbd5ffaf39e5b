"""SGLang's own frontend, unmodified, against `sgl serve`: the same programs (gen with stop and
stop_regex, select, roles, regex, fork, run_batch, streaming) give the same greedy results
through `sglang.RuntimeEndpoint` as through sgl's own client.

SGLang is installed with `pip install --no-deps sglang` plus its import-time needs (the `test`
extra lists them; `.ci/run` installs sglang): nothing here patches or stubs it.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import pytest

import sgl
from test_server_support import API_KEY, Server, get_server

sglang = pytest.importorskip("sglang", reason="pip install --no-deps sglang (see .ci/run)")

pytestmark = [pytest.mark.slow]

FEW_SHOT = "Q: What is the capital of France?\nA: Paris\nQ: What is the capital of Germany?\nA: Berlin\n"


def programs(lang: types.ModuleType) -> dict[str, Callable[..., Any]]:
    """One program set, written against either language (`sglang` or `sgl`): the same source."""

    @lang.function
    def qa(s, question):
        s += FEW_SHOT + "Q: " + question + "\nA:" + lang.gen("answer", max_tokens=8, stop="\n", temperature=0)
        s += "\nIs that correct? Answer:" + lang.select("check", choices=[" Yes", " No", " Not sure"])

    @lang.function
    def count(s):
        s += "Count: 1, 2, 3," + lang.gen("rest", max_tokens=24, stop_regex=r"\b7\b", temperature=0)

    @lang.function
    def chat(s):
        s += lang.system("You answer in a few words.")
        s += lang.user("What colour is the sky?")
        s += lang.assistant(lang.gen("first", max_tokens=8, temperature=0))
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += lang.user(["Why?", "And at night?"][i])
            f += lang.assistant(lang.gen("more", max_tokens=6, temperature=0))
        forks.join()

    @lang.function
    def digits(s):
        s += "My favourite number is" + lang.gen("n", regex=r" [0-9]{2}", temperature=0)

    @lang.function
    def story(s):
        s += "Once upon a time" + lang.gen("tale", max_tokens=16, temperature=0)

    return {"qa": qa, "count": count, "chat": chat, "digits": digits, "story": story}


@pytest.fixture(scope="module")
def server() -> Server:
    return get_server()


@pytest.fixture(scope="module")
def theirs(server: Server) -> Any:
    # The server's model is SmolLM2 (ChatML); SGLang picks templates by model path, so name it.
    return sglang.RuntimeEndpoint(server.url, api_key=API_KEY, chat_template_name="chatml")


@pytest.fixture(scope="module")
def ours(server: Server) -> sgl.RuntimeEndpoint:
    return sgl.RuntimeEndpoint(server.url, api_key=API_KEY)


def _vars(state: Any, names: list[str]) -> dict[str, Any]:
    return {n: state[n] for n in names}


def test_gen_stop_select_same_as_sgl(theirs: Any, ours: sgl.RuntimeEndpoint) -> None:
    a = programs(sglang)["qa"].run(question="What is the capital of Italy?", backend=theirs)
    b = programs(sgl)["qa"].run(question="What is the capital of Italy?", backend=ours)
    assert _vars(a, ["answer", "check"]) == _vars(b, ["answer", "check"])
    assert "\n" not in a["answer"] and a["check"] in (" Yes", " No", " Not sure")


def test_stop_regex_same_as_sgl(theirs: Any, ours: sgl.RuntimeEndpoint) -> None:
    a = programs(sglang)["count"].run(backend=theirs)
    b = programs(sgl)["count"].run(backend=ours)
    assert a["rest"] == b["rest"] and "7" not in a["rest"]
    # it stopped on the regex (not on length): the server reports the pattern as matched
    assert a.get_meta_info("rest")["finish_reason"] == {"type": "stop", "matched": r"\b7\b"}


def test_roles_and_fork_same_as_sgl(theirs: Any, ours: sgl.RuntimeEndpoint) -> None:
    a = programs(sglang)["chat"].run(backend=theirs)
    b = programs(sgl)["chat"].run(backend=ours)
    assert a["first"] == b["first"] and list(a["more"]) == list(b["more"])
    assert a.text() == b.text()


def test_regex_same_as_sgl(theirs: Any, ours: sgl.RuntimeEndpoint) -> None:
    a = programs(sglang)["digits"].run(backend=theirs)
    b = programs(sgl)["digits"].run(backend=ours)
    assert a["n"] == b["n"] and len(a["n"]) == 3 and a["n"][1:].isdigit()


def test_run_batch_same_as_sgl(theirs: Any, ours: sgl.RuntimeEndpoint) -> None:
    batch = [{"question": "What is the capital of Spain?"}, {"question": "What is the capital of Japan?"}]
    a = programs(sglang)["qa"].run_batch(batch, backend=theirs)
    b = programs(sgl)["qa"].run_batch(batch, backend=ours)
    assert [_vars(s, ["answer", "check"]) for s in a] == [_vars(s, ["answer", "check"]) for s in b]


def test_streaming_same_as_sgl(theirs: Any, ours: sgl.RuntimeEndpoint) -> None:
    a = programs(sglang)["story"].run(backend=theirs, stream=True)
    streamed = "".join(a.text_iter("tale"))
    b = programs(sgl)["story"].run(backend=ours)
    assert streamed == a["tale"] == b["tale"] and len(streamed) > 0
