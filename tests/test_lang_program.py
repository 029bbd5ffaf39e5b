"""The program language on FakeBackend: gen, roles, variables, errors (sync programs)."""

from __future__ import annotations

import pytest

import sgl.lang as sgl
from sgl.errors import BackendCapabilityError, InvalidRequestError, ProgramError
from sgl.lang import FakeBackend


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(responses={"capital of France?": " Paris\nQ: next", "Germany": " Berlin"})


@sgl.function
def few_shot(s, question):
    s += "Q: What is the capital of Italy?\nA: Rome\n"
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", temperature=0)


def test_gen_stop_and_variable(backend: FakeBackend) -> None:
    state = few_shot.run(question="What is the capital of France?", backend=backend)
    assert state["answer"] == " Paris"
    assert state.text().endswith("A: Paris")
    meta = state.get_meta_info("answer")
    assert meta["finish_reason"] == {"type": "stop", "matched": "\n"}
    (req,) = backend.requests_of("generate")
    assert req.text == "Q: What is the capital of Italy?\nA: Rome\nQ: What is the capital of France?\nA:"
    assert req.params.temperature == 0 and "\n" in req.params.stop


def test_max_tokens_and_run_defaults(backend: FakeBackend) -> None:
    @sgl.function
    def prog(s):
        s += "count:" + sgl.gen("a", max_tokens=5) + sgl.gen("b")

    state = prog.run(backend=backend, max_new_tokens=3, temperature=0.5, top_k=7)
    assert state["a"] == " 0 1 "  # the counting stream cut at 5 tokens (characters)
    assert state["b"] == " 0 "
    a, b = backend.requests_of("generate")
    assert (a.params.max_new_tokens, b.params.max_new_tokens) == (5, 3)
    assert a.params.temperature == b.params.temperature == 0.5 and b.params.top_k == 7
    assert state.get_meta_info("a")["finish_reason"]["type"] == "length"


def test_reading_a_variable_mid_program_waits(backend: FakeBackend) -> None:
    @sgl.function
    def expert(s, question):
        s += "Question: " + question + "\nA good expert is" + sgl.gen("expert", stop=".")
        s += "\nFor example," + s["expert"] + " would say" + sgl.gen("answer", max_tokens=3)
        if s["expert"].strip() == "Berlin":
            s += "!"

    state = expert.run(question="Germany", backend=backend)
    assert state["expert"] == " Berlin"
    assert state.text().startswith("Question: Germany\nA good expert is Berlin\nFor example, Berlin")
    assert state.text().endswith("!")


def test_set_var_var_scope_contains_and_missing(backend: FakeBackend) -> None:
    @sgl.function
    def prog(s):
        with s.var_scope("block"):
            s += "{" + sgl.gen("x", max_tokens=2) + "}"
        s["y"] = 41
        s["y"] = s["y"] + 1
        s += "x" * 3
        return "ret"

    state = prog.run(backend=backend)
    assert state["block"] == "{ 0}" and state["y"] == 42 and "x" in state
    assert state.ret_value == "ret"
    with pytest.raises(KeyError):
        state["nope"]
    state["z"] = "after"  # assignment after the run, like SGLang's test_dtype_gen
    assert state["z"] == "after"


def test_roles_messages_and_chat_template(backend: FakeBackend) -> None:
    @sgl.function
    def chat(s, q1, q2):
        s += sgl.system("You are terse.")
        s += sgl.user(q1)
        s += sgl.assistant(sgl.gen("a1", max_tokens=4))
        with s.user():
            s += q2
        s += sgl.assistant_begin() + sgl.gen("a2", max_tokens=2) + sgl.assistant_end()

    state = chat.run(q1="Hi", q2="Again", backend=backend)
    assert state.messages() == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "0 1"},  # lstripped, like SGLang
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "0"},
    ]
    assert state.text().startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi")
    # The chat template's stop string is added to every gen (SGLang semantics).
    assert all("<|im_end|>" in r.params.stop for r in backend.requests_of("generate"))


def test_default_system_prompt_inserted() -> None:
    template = sgl.ChatTemplate("t", {"system": ("S:", "\n"), "user": ("U:", "\n"),
                                      "assistant": ("A:", "\n")}, default_system_prompt="be nice")
    backend = FakeBackend(chat_template=template)

    @sgl.function
    def chat(s):
        s += sgl.user("hi")

    state = chat.run(backend=backend)
    assert state.text() == "S:be nice\nU:hi\n"
    assert [m["role"] for m in state.messages()] == ["system", "user"]


def test_nested_roles_fail(backend: FakeBackend) -> None:
    @sgl.function
    def prog(s):
        with s.user():
            s += sgl.assistant("x")

    with pytest.raises(ProgramError, match="nested roles"):
        prog.run(backend=backend)


def test_body_error_raises_program_error_with_traceback(backend: FakeBackend) -> None:
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a", max_tokens=2)
        raise ValueError("boom in body")

    with pytest.raises(ProgramError) as info:
        prog.run(backend=backend)
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and str(cause) == "boom in body"
    frames = []
    tb = cause.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "prog" in frames  # the program's own frame is in the traceback
    assert info.value.state.error() is cause


def test_backend_error_wakes_reader_and_raises() -> None:
    backend = FakeBackend(fail_on="FAIL", error=ConnectionError("engine down"))

    @sgl.function
    def prog(s):
        s += "FAIL" + sgl.gen("a")
        s += "never " + s["a"]  # the read raises instead of hanging

    with pytest.raises(ProgramError) as info:
        prog.run(backend=backend)
    assert isinstance(info.value.__cause__, ConnectionError)


def test_gen_n_returns_list_and_appends_first(backend: FakeBackend) -> None:
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("many", n=3, max_tokens=2)

    state = prog.run(backend=backend)
    assert state["many"] == [" 0", " 0", " 0"]
    assert state.text() == "x 0" and len(state.get_meta_info("many")) == 3


def test_bind_call_and_decorator_forms(backend: FakeBackend) -> None:
    @sgl.function(num_api_spec_tokens=64)
    def prog(s, a, b="B"):
        s += a + b

    assert prog.num_api_spec_tokens == 64
    assert prog("1", backend=backend).text() == "1B"
    assert prog.bind(b="2").run("1", backend=backend).text() == "12"
    with pytest.raises(TypeError):
        prog.bind(c=1)


def test_gen_options_pass_through(backend: FakeBackend) -> None:
    @sgl.function
    def prog(s):
        s += sgl.gen("i", dtype=int) + sgl.gen("r", regex=r"[0-9]+", max_tokens=4)
        s += sgl.gen("l", return_logprob=True, logprob_start_len=0, top_logprobs_num=2, seed=3)
        s += sgl.gen("m", min_tokens=1, stop_token_ids=[7], ignore_eos=True, frequency_penalty=0.5)

    prog.run(backend=backend, max_new_tokens=4)
    i, r, lp, m = backend.requests_of("generate")
    assert i.params.regex is not None and " " in i.params.stop and "\n" in i.params.stop
    assert r.params.regex == r"[0-9]+" and r.params.max_new_tokens == 4
    assert lp.logprobs.return_logprob and lp.logprobs.top_logprobs_num == 2 and lp.params.seed == 3
    assert m.params.min_new_tokens == 1 and m.params.stop_token_ids == (7,) and m.params.ignore_eos
    assert m.params.frequency_penalty == 0.5


def test_gen_passes_stop_regex_and_logit_bias(backend: FakeBackend) -> None:
    @sgl.function
    def prog(s):
        s += sgl.gen("a", stop_regex=r"\d+\.", logit_bias={5: -100})

    prog.run(backend=backend)
    (m,) = backend.requests_of("generate")
    assert m.params.stop_regex == (r"\d+\.",) and m.params.logit_bias == {5: -100.0}


def test_invalid_usage_errors(backend: FakeBackend) -> None:
    with pytest.raises(InvalidRequestError):
        sgl.select("x", [])
    with pytest.raises(BackendCapabilityError):
        sgl.image("a.png")

    @sgl.function
    def prog(s):
        s += sgl.gen("a", stop_regex=r"(")

    with pytest.raises(ProgramError) as info:  # an invalid stop regex fails before generating
        prog.run(backend=backend)
    assert getattr(info.value.__cause__, "field", None) == "stop_regex"

    @sgl.function
    def appends_none(s):
        s += None

    with pytest.raises(ProgramError) as info:
        appends_none.run(backend=backend)
    assert isinstance(info.value.__cause__, ValueError)


def test_default_backend_and_missing_backend(backend: FakeBackend) -> None:
    sgl.set_default_backend(None)
    with pytest.raises(InvalidRequestError, match="no backend"):
        few_shot.run(question="x")
    sgl.set_default_backend(backend)
    try:
        assert few_shot(question="Germany").text().endswith("A: Berlin")
        assert sgl.get_default_backend() is backend
    finally:
        sgl.set_default_backend(None)
    with pytest.raises(InvalidRequestError, match="not a backend"):
        sgl.set_default_backend(object())
