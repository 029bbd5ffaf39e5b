"""select: the three choices methods, batched scoring, meta info (FakeBackend, char tokens)."""

from __future__ import annotations

import math
from typing import Sequence

import pytest

import sgl.lang as sgl
from sgl.errors import ProgramError
from sgl.lang import FakeBackend

PROMPT = "Answer:"


def run_select(backend: FakeBackend, choices: list[str], method=None):  # noqa: ANN001, ANN201
    @sgl.function
    def prog(s):
        if method is None:
            s += PROMPT + sgl.select("pick", choices)
        else:
            s += PROMPT + sgl.select("pick", choices, choices_method=method)

    return prog.run(backend=backend)


def prefers_tru(ctx: Sequence[int], tok: int) -> float:
    return -0.1 if chr(tok) in "Tru" else -1.0


def test_token_length_normalized_default_and_meta() -> None:
    backend = FakeBackend(scorer=prefers_tru)
    state = run_select(backend, ["True", "False", "Unknown"])
    assert state["pick"] == "True"
    assert state.text() == PROMPT + "True"
    meta = state.get_meta_info("pick")
    assert meta["normalized_prompt_logprobs"] == pytest.approx([-0.325, -1.0, -1.0])
    first = meta["input_token_logprobs"][0]
    assert [t[2] for t in first] == list("True") and [t[1] for t in first] == [ord(c) for c in "True"]
    assert first[0][0] == pytest.approx(-0.1)
    # All choices were scored in ONE batched call, starting right after the prompt.
    (score,) = backend.requests_of("score")
    assert score.logprob_start_len == len(PROMPT)
    assert score.score_prompts == [[ord(c) for c in PROMPT + ch] for ch in ["True", "False", "Unknown"]]


def ab_scorer(ctx: Sequence[int], tok: int) -> float:
    prev = chr(ctx[-1])
    if chr(tok) == "a":
        return -0.1
    return -5.0 if prev == "a" else -0.5  # "b" is cheap first, expensive after "a"


def test_greedy_token_selection_disagrees_with_normalized() -> None:
    normalized = run_select(FakeBackend(scorer=ab_scorer), ["ab", "ba"])
    greedy = run_select(FakeBackend(scorer=ab_scorer), ["ab", "ba"], sgl.greedy_token_selection)
    assert normalized["pick"] == "ba"  # mean -0.3 beats -2.55
    assert greedy["pick"] == "ab"  # first token -0.1 beats -0.5
    assert "greedy_logprob_matrix" in greedy.get_meta_info("pick")
    by_name = run_select(FakeBackend(scorer=ab_scorer), ["ab", "ba"], "greedy_token_selection")
    assert by_name["pick"] == "ab"


def test_greedy_pads_shorter_choice_with_its_mean() -> None:
    # "a" (one token, -0.1) vs "ab" (-0.1, -5): tie at token 0, then "a" padded with -0.1 wins.
    state = run_select(FakeBackend(scorer=ab_scorer), ["ab", "a"], sgl.greedy_token_selection)
    assert state["pick"] == "a"


def uncond_scorer(ctx: Sequence[int], tok: int) -> float:
    with_prompt = len(ctx) > 2
    c, prev = chr(tok), chr(ctx[-1])
    if c in "xy":
        return {"x": -1.0, "y": -0.5}[c]
    if with_prompt:
        return -1.0
    return -3.0 if prev == "x" else -0.2


def test_unconditional_likelihood_normalized() -> None:
    backend = FakeBackend(scorer=uncond_scorer)
    plain = run_select(FakeBackend(scorer=uncond_scorer), ["xq", "yq"])
    state = run_select(backend, ["xq", "yq"], sgl.unconditional_likelihood_normalized)
    assert plain["pick"] == "yq"
    assert state["pick"] == "xq"
    meta = state.get_meta_info("pick")
    assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx([0.5, -0.65])
    assert math.isnan(meta["unconditional_token_logprobs"][0][0][0])  # no context, no logprob
    conditional, unconditional = backend.requests_of("score")
    assert unconditional.score_prompts == [[ord("x"), ord("q")], [ord("y"), ord("q")]]
    assert unconditional.logprob_start_len == 0 and conditional.logprob_start_len == len(PROMPT)


def test_gen_with_choices_is_select_and_temperature_rules() -> None:
    backend = FakeBackend(scorer=prefers_tru)

    @sgl.function
    def prog(s):
        s += "A:" + sgl.gen("g", choices=["False", "True"])

    assert prog.run(backend=backend)["g"] == "True"

    @sgl.function
    def hot(s):
        s += sgl.select("x", ["a", "b"], temperature=0.7)

    with pytest.raises(ProgramError, match="temperature"):
        hot.run(backend=backend)


def test_select_without_logprobs_is_a_capability_error() -> None:
    from sgl.errors import BackendCapabilityError

    @sgl.function
    def prog(s):
        s += "x" + sgl.select("x", ["a", "b"])

    with pytest.raises(ProgramError) as info:
        prog.run(backend=FakeBackend(text_only=True))
    assert isinstance(info.value.__cause__, BackendCapabilityError)


def test_custom_choices_method() -> None:
    class Last(sgl.ChoicesSamplingMethod):
        def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                     output_token_logprobs, unconditional_token_logprobs=None):
            return sgl.ChoicesDecision(choices[-1], {"custom": True})

    state = run_select(FakeBackend(), ["a", "b", "c"], Last())
    assert state["pick"] == "c" and state.get_meta_info("pick") == {"custom": True}
