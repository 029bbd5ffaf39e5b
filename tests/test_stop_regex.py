"""stop_regex: the checker (cut at the first match, hold back what a later match could cut),
its validation and bounds, and the engine end to end (streamed text == final text)."""

from __future__ import annotations

import pytest

from sgl.backend.detokenizer import StopChecker
from sgl.backend.stop_regex import RegexStopChecker, StopChain
from sgl.errors import InvalidSamplingParamsError
from sgl.sampling import SamplingParams


def _run(checker, deltas: list[str]) -> tuple[list[str], str | None]:
    """Feed deltas as the scheduler does; at the end flush what is held (as final_text does)."""
    out, matched = [], None
    for d in deltas:
        text, m = checker.feed(d)
        out.append(text)
        if m is not None:
            return out, m
    out.append(checker.flush())
    return out, checker.matched


@pytest.mark.parametrize("chunks", [["The answer is 42. More"], list("The answer is 42. More"),
                                    ["The ans", "wer is 4", "2", ". More"]])
def test_cuts_at_first_match_whatever_the_chunking(chunks: list[str]) -> None:
    out, matched = _run(RegexStopChecker([r"\d+\."]), chunks)
    assert "".join(out) == "The answer is " and matched == r"\d+\."


def test_no_stop_trim_keeps_the_match() -> None:
    out, matched = _run(RegexStopChecker([r"\d+\."], no_stop_trim=True), list("x 12. y"))
    assert "".join(out) == "x 12." and matched == r"\d+\."


def test_holds_back_text_a_later_match_would_cut() -> None:
    checker = RegexStopChecker([r"Answer: \d"])
    assert checker.feed("The Answ") == ("The ", None)  # "Answ" may become a match
    assert checker.feed("er: ") == ("", None)
    assert checker.feed("x") == ("Answer: x", None)  # ruled out: released
    assert checker.feed(" Answer: 7 tail") == (" ", r"Answer: \d")


def test_earliest_match_wins_across_patterns() -> None:
    out, matched = _run(RegexStopChecker([r"c+d", r"b"]), ["aabccd"])
    assert "".join(out) == "aa" and matched == "b"


def test_complete_match_beats_an_earlier_partial_one() -> None:
    # "a.*z" could still match from the "a", but "c" already matched: stop there.
    out, matched = _run(RegexStopChecker([r"a.*z|c"]), ["xaxc"])
    assert "".join(out) == "xax" and matched == r"a.*z|c"


def test_no_match_releases_everything_at_the_end() -> None:
    out, matched = _run(RegexStopChecker([r"END\d"]), ["text EN", "D"])
    assert "".join(out) == "text END" and matched is None


def test_lookbehind_sees_released_text() -> None:
    out, matched = _run(RegexStopChecker([r"(?<=x)y"]), ["ax", "y tail"])
    assert "".join(out) == "ax" and matched == r"(?<=x)y"


def test_chain_with_stop_strings_stops_at_whichever_comes_first() -> None:
    chain = StopChain(StopChecker(["STOP"]), RegexStopChecker([r"\d\d"]))
    out, matched = _run(chain, list("ab 12 STOP"))
    assert "".join(out) == "ab " and matched == r"\d\d"
    chain = StopChain(StopChecker(["STOP"]), RegexStopChecker([r"\d\d"]))
    out, matched = _run(chain, list("ab 1 STOP 12"))
    assert "".join(out) == "ab 1 " and matched == "STOP"


@pytest.mark.parametrize("bad", ["(", "[a-", "", "x*", "$"])
def test_invalid_or_empty_matching_regex_is_rejected(bad: str) -> None:
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(stop_regex=bad)
    assert info.value.field == "stop_regex"


def test_stop_regex_normalised_and_typed() -> None:
    assert SamplingParams(stop_regex=r"\d").stop_regex == (r"\d",)
    assert SamplingParams(stop_regex=["a", "b"]).to_dict()["stop_regex"] == ["a", "b"]
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(stop_regex=[1])  # type: ignore[list-item]


# -- end to end on the tiny random-weight model: in process, streamed, native HTTP ---------------

import regex  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from sgl.backend.server import create_app  # noqa: E402
from test_server_support import get_tiny_engine  # noqa: E402

PROMPT = [1, 2, 3, 4]


def _pattern_in(text: str) -> tuple[str, str]:
    """A regex that first matches inside `text` (three characters from its middle, escaped,
    followed by anything), and the text it must leave: everything before that first match."""
    piece = text[len(text) // 2: len(text) // 2 + 3]
    pattern = regex.escape(piece) + r".?"
    return pattern, text[: regex.search(pattern, text).start()]


def test_engine_cuts_at_the_regex_and_streams_the_same_text() -> None:
    engine = get_tiny_engine()
    base = engine.generate_sync(PROMPT, max_new_tokens=24, temperature=0, ignore_eos=True).text
    pattern, expected = _pattern_in(base)
    out = engine.generate_sync(PROMPT, max_new_tokens=24, temperature=0, ignore_eos=True, stop_regex=pattern)
    assert out.text == expected and out.finish_reason == "stop" and out.matched_stop == pattern
    chunks = list(engine.stream_sync(PROMPT, max_new_tokens=24, temperature=0, ignore_eos=True,
                                     stop_regex=[pattern]))
    assert "".join(c.text for c in chunks) == expected  # nothing streamed that the match cut
    kept = engine.generate_sync(PROMPT, max_new_tokens=24, temperature=0, ignore_eos=True, stop_regex=pattern,
                                no_stop_trim=True)
    assert kept.text.startswith(expected) and regex.fullmatch(pattern, kept.text[len(expected):])


def test_engine_bounds_stop_regex() -> None:
    engine = get_tiny_engine()
    with pytest.raises(InvalidSamplingParamsError) as info:
        engine.generate_sync(PROMPT, stop_regex=["a"] * 33)
    assert info.value.field == "stop_regex" and "max_stop_regexes" in str(info.value)


def test_native_http_stop_regex_streamed_and_not() -> None:
    engine = get_tiny_engine()
    base = engine.generate_sync(PROMPT, max_new_tokens=24, temperature=0, ignore_eos=True).text
    pattern, expected = _pattern_in(base)
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True,
                                                     "stop_regex": pattern}}
    with TestClient(create_app(engine)) as client:
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["text"] == expected and r.json()["meta_info"]["finish_reason"]["matched"] == pattern
        with client.stream("POST", "/generate", json={**body, "stream": True}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        import json

        texts = [json.loads(e)["text"] for e in events if e != "[DONE]"]
        assert all(expected.startswith(t) for t in texts) and texts[-1] == expected
        bad = client.post("/generate", json={"text": "hi", "sampling_params": {"stop_regex": ["ok", "("]}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.stop_regex[1]"
        long = client.post("/generate", json={"text": "hi", "sampling_params": {"stop_regex": "a" * 300}})
        assert long.status_code == 400 and "max-stop-regex-len" in long.json()["error"]["message"]
        oai = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                   "ignore_eos": True, "stop_regex": pattern})
        assert oai.status_code == 200 and oai.json()["choices"][0]["text"] == expected


def test_catastrophic_pattern_stops_the_request_instead_of_hanging() -> None:
    import time

    checker = RegexStopChecker([r"(a|aa)+b"])
    start = time.monotonic()
    out, matched = _run(checker, ["x", "a" * 40, "c"])
    assert time.monotonic() - start < 5 and matched == r"(a|aa)+b"
    assert "".join(out) == "x"  # nothing the pattern might still cut was released
