"""Stop strings through `sgl.Engine` on the real default model (CPU, float32, greedy).

Each test first generates without a stop, reads where the tokens' text begins and ends, and
picks a stop string from that output that crosses a token boundary (or a whole token). Run
again with that stop, the output must end right before it (or with it, `no_stop_trim`), name
it in `matched_stop`, stop at the very token that completed it, and stream the same text.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

import sgl

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

PROMPTS = [
    "The history of the Roman Empire began",
    "Ingredients for a simple pancake recipe:\n1.",
]
GREEDY = dict(temperature=0, max_new_tokens=40)


@pytest.fixture(scope="module")
def engine() -> Iterator[sgl.Engine]:
    e = sgl.Engine(device="cpu", dtype="float32", max_total_tokens=8192)
    try:
        yield e
    finally:
        e.close()


def token_ends(engine: sgl.Engine, out: Any) -> list[int]:
    """ends[k]: length of the text of the first k+1 output tokens (byte-level BPE decodes
    concatenatively, which the first assertion checks against the engine's own text)."""
    def text(ids: list[int]) -> str:
        return engine.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    assert text(out.token_ids) == out.text, "the output text is not the decode of its tokens"
    return [len(text(out.token_ids[: k + 1])) for k in range(len(out.token_ids))]


def completing_token(ends: list[int], end: int) -> int:
    """Index of the token whose text contains character `end - 1`."""
    return next(k for k, e in enumerate(ends) if e >= end)


def straddling_stop(text: str, ends: list[int], start_token: int = 2, whole_token: bool = False) -> tuple[str, int]:
    """A stop string that first occurs across a token boundary inside a word, and where it
    starts; with `whole_token`, one that spans a whole token plus a character either side."""
    for k in range(start_token, len(ends) - 2):
        if whole_token:
            a, b = ends[k - 1] - 1, ends[k] + 1
            in_word = ends[k] - ends[k - 1] >= 2
        else:
            a, b = ends[k - 1] - 2, ends[k - 1] + 2
            in_word = " " not in text[ends[k - 1] - 1 : ends[k - 1] + 1]  # the boundary's two chars
        stop = text[a:b]
        if a > 0 and in_word and not stop.isspace() and text.find(stop) == a:
            return stop, a
    raise AssertionError(f"no token boundary to place a stop string across in {text!r}")


@pytest.mark.parametrize("whole_token", [False, True], ids=["boundary", "whole-token"])
@pytest.mark.parametrize("prompt", PROMPTS)
async def test_stop_across_token_boundaries_cuts_text_and_tokens(engine: sgl.Engine, prompt: str,
                                                                 whole_token: bool) -> None:
    base = await engine.generate(prompt, **GREEDY)
    ends = token_ends(engine, base)
    stop, at = straddling_stop(base.text, ends, whole_token=whole_token)
    last = completing_token(ends, at + len(stop))
    assert completing_token(ends, at + 1) < last, "the stop must span tokens"

    out = await engine.generate(prompt, stop=stop, **GREEDY)
    assert (out.text, out.matched_stop, out.finish_reason) == (base.text[:at], stop, "stop")
    assert out.token_ids == base.token_ids[: last + 1]  # stopped at the completing token
    kept = await engine.generate(prompt, stop=[stop], no_stop_trim=True, **GREEDY)
    assert (kept.text, kept.matched_stop, kept.finish_reason) == (base.text[: at + len(stop)], stop, "stop")
    assert kept.token_ids == out.token_ids


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_of_several_stops_the_first_to_occur_wins(engine: sgl.Engine, prompt: str) -> None:
    base = await engine.generate(prompt, **GREEDY)
    ends = token_ends(engine, base)
    early, at = straddling_stop(base.text, ends)
    later_from = completing_token(ends, at + len(early)) + 2
    late, late_at = straddling_stop(base.text, ends, start_token=later_from)
    assert late_at > at and late not in base.text[: at + len(early)]
    never = "\u2603 no such text \u2603"
    out = await engine.generate(prompt, stop=[late, never, early], **GREEDY)
    assert (out.text, out.matched_stop, out.finish_reason) == (base.text[:at], early, "stop")


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_streamed_stop_gives_the_text_of_generate(engine: sgl.Engine, prompt: str) -> None:
    base = await engine.generate(prompt, **GREEDY)
    stop, at = straddling_stop(base.text, token_ends(engine, base))
    plain = await engine.generate(prompt, stop=stop, **GREEDY)
    streamed, final = "", None
    async for chunk in engine.stream(prompt, stop=stop, **GREEDY):
        streamed += chunk.text
        assert stop not in streamed, "the stop string leaked into the stream"
        if chunk.output is not None:
            final = chunk.output
    assert final is not None and final.finish_reason == "stop" and final.matched_stop == stop
    assert streamed == final.text == plain.text == base.text[:at]


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_text_held_as_a_possible_stop_is_released_when_the_length_ends(engine: sgl.Engine,
                                                                              prompt: str) -> None:
    base = await engine.generate(prompt, **GREEDY)
    # The output's last two characters start this stop, so they are held back when the
    # length limit ends the request; they must come out all the same, streamed or not.
    stop = base.text[-2:] + "\u2603\u2603"
    out = await engine.generate(prompt, stop=stop, **GREEDY)
    assert (out.text, out.matched_stop, out.finish_reason) == (base.text, None, "length")
    streamed = ""
    async for chunk in engine.stream(prompt, stop=stop, **GREEDY):
        streamed += chunk.text
    assert streamed == base.text
