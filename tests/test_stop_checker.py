"""`StopChecker` on its own: stop strings cut a stream of text deltas, whatever the chunking.

The reference is a character-by-character scan written here: after each character, the first
position where some stop string ends is the match (the longest one if several end there), and
before a match the stream may emit everything except the longest suffix that could still grow
into a stop string. Every test compares the checker with that scan, so a stop string can never
leak into streamed text and chunking can never change the result.
"""

from __future__ import annotations

from typing import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl.backend.detokenizer import StopChecker


def reference(text: str, stops: Sequence[str], no_stop_trim: bool = False) -> tuple[str, str | None]:
    """The final text and matched stop of a character-by-character scan of `text`."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            s = max(ending, key=len)  # a tie at the same end: the longest stop string
            return (text[:end] if no_stop_trim else text[: end - len(s)]), s
    return text, None


def safe_prefix(text: str, stops: Sequence[str]) -> str:
    """What may be streamed of `text` (no stop in it yet): all but the longest suffix that is a
    proper prefix of some stop string, since the next characters could complete that stop."""
    hold = max((n for n in range(1, len(text) + 1)
                if any(len(s) > n and s.startswith(text[-n:]) for s in stops)), default=0)
    return text[: len(text) - hold]


def run(chunks: Sequence[str], stops: Sequence[str], no_stop_trim: bool = False) -> tuple[str, str | None]:
    """Feed `chunks` one by one, checking after each feed that exactly the safe prefix is out;
    return the streamed text (with `flush` at the end) and the match."""
    checker = StopChecker(stops, no_stop_trim=no_stop_trim)
    out, seen, matched = "", "", None
    for chunk in chunks:
        seen += chunk
        delta, m = checker.feed(chunk)
        if matched is not None:
            assert (delta, m) == ("", None), "text came out after the stop matched"
            continue
        out += delta
        if m is not None:
            matched = m
            assert checker.matched == m
        else:
            assert out == safe_prefix(seen, [s for s in stops if s]), (
                f"after feeding {seen!r} the stream emitted {out!r}")
    tail = checker.flush()
    assert matched is None or tail == "", "flush released text after a match"
    return out + tail, matched


def every_split(text: str, parts: int) -> list[list[str]]:
    """All ways to cut `text` into `parts` chunks (empty chunks included)."""
    if parts == 1:
        return [[text]]
    return [[text[:i], *rest] for i in range(len(text) + 1) for rest in every_split(text[i:], parts - 1)]


# -- one stop string, split every way ------------------------------------------------------------


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_a_stop_string_split_every_way_is_found_and_never_leaks(no_stop_trim: bool) -> None:
    text = "say END now, END"
    want = ("say END" if no_stop_trim else "say ", "END")
    assert reference(text, ["END"], no_stop_trim) == want
    for chunks in every_split(text, 3):
        assert run(chunks, ["END"], no_stop_trim) == want, chunks


def test_one_character_partial_match_is_held_back_then_released() -> None:
    checker = StopChecker(["\n\n"])
    assert checker.feed("a\n") == ("a", None)  # "\n" may be the start of "\n\n": held
    assert checker.feed("b") == ("\nb", None)  # ruled out: released with the new text
    assert checker.feed("\n") == ("", None)
    assert checker.feed("\n") == ("", "\n\n")  # the held "\n" was the stop's first half
    assert checker.feed("more") == ("", None)  # stopped: nothing else comes out


def test_a_partial_match_that_fails_keeps_the_suffix_that_may_still_match() -> None:
    # "aaa" cannot become "aab" any more, but its suffix "aa" can: only the first "a" is safe.
    checker = StopChecker(["aab"])
    assert checker.feed("a") == ("", None)
    assert checker.feed("a") == ("", None)
    assert checker.feed("a") == ("a", None)
    assert checker.feed("b") == ("", "aab")
    assert run(["x", "aa", "ab", "y"], ["aab"]) == ("xa", "aab")


def test_flush_releases_held_text_when_the_request_ends_otherwise() -> None:
    checker = StopChecker(["END"])
    assert checker.feed("the EN") == ("the ", None)
    assert checker.flush() == "EN"
    assert checker.flush() == ""
    assert checker.matched is None


def test_no_stop_trim_keeps_the_stop_and_drops_what_follows() -> None:
    assert StopChecker(["END"], no_stop_trim=True).feed("a END b") == ("a END", "END")
    checker = StopChecker(["END"], no_stop_trim=True)
    assert checker.feed("a EN") == ("a ", None)
    assert checker.feed("D b") == ("END", "END")


def test_empty_stop_strings_are_ignored() -> None:
    assert run(["abc"], ["", "c"]) == ("ab", "c")
    assert run(["abc"], [""]) == ("abc", None)


# -- several stops -------------------------------------------------------------------------------


@pytest.mark.parametrize("stops", [["cd", "abcdef"], ["abcdef", "cd"]])
def test_the_stop_that_ends_first_wins_even_if_another_starts_earlier(stops: list[str]) -> None:
    for chunks in [["abcdefg"], *every_split("abcdefg", 3)]:
        assert run(chunks, stops) == ("ab", "cd"), chunks


@pytest.mark.parametrize("stops", [["c", "abc", "bc"], ["bc", "c", "abc"]])
def test_the_longest_stop_wins_when_several_end_at_the_same_place(stops: list[str]) -> None:
    for chunks in [["xabcx"], *every_split("xabcx", 3)]:
        assert run(chunks, stops) == ("x", "abc"), chunks


@pytest.mark.parametrize("stops", [["ab", "bc"], ["bc", "ab"]])
def test_overlapping_stops(stops: list[str]) -> None:
    for chunks in every_split("abc", 3):
        assert run(chunks, stops) == ("", "ab"), chunks
    for chunks in every_split("xbca", 2):
        assert run(chunks, stops) == ("x", "bc"), chunks
    checker = StopChecker(stops)
    assert checker.feed("xa") == ("x", None)  # "a" may start "ab"
    assert checker.feed("b") == ("", "ab")


# -- unicode -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "stop", "before"),
    [
        ("日本語の中文字です", "中文", "日本語の"),  # CJK
        ("ok 👋🙂 bye", "🙂", "ok 👋"),  # an emoji outside the BMP
        ("fam 👨\u200d👩\u200d👧 !", "👨\u200d👩\u200d👧", "fam "),  # a ZWJ sequence, split at the joiners
        ("cafe\u0301 au lait", "e\u0301", "caf"),  # a combining mark, split from its base
        ("Ålesund, Ærø", "Æ", "Ålesund, "),
    ],
)
def test_unicode_stops_split_between_any_two_code_points(text: str, stop: str, before: str) -> None:
    assert reference(text, [stop]) == (before, stop)
    for chunks in every_split(text, 3):
        assert run(chunks, [stop]) == (before, stop), chunks
        assert run(chunks, [stop], no_stop_trim=True) == (before + stop, stop), chunks


def test_a_base_character_is_held_while_a_combining_mark_could_follow() -> None:
    checker = StopChecker(["e\u0301"])
    assert checker.feed("cafe") == ("caf", None)
    assert checker.feed("s") == ("es", None)  # no accent came: the "e" is released


# -- property: any text, any stops, any chunking --------------------------------------------------

CHARS = st.sampled_from(["a", "b", "\n", " ", "é", "e", "\u0301", "中", "🙂"])
TEXTS = st.lists(CHARS, max_size=24).map("".join)
STOPS = st.lists(st.lists(CHARS, min_size=1, max_size=4).map("".join), min_size=1, max_size=3)


@settings(max_examples=400, deadline=None)
@given(text=TEXTS, stops=STOPS, no_stop_trim=st.booleans(), data=st.data())
def test_any_chunking_equals_the_character_scan(text: str, stops: list[str], no_stop_trim: bool,
                                                data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8), label="cuts"))
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]  # empty chunks included
    assert run(chunks, stops, no_stop_trim) == reference(text, stops, no_stop_trim)
