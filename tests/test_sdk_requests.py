"""In-process request checks of issue 12: bounds on what a request multiplies, strict types,
and arguments that say what is wrong, all raised before anything is queued.

One engine for the module: random weights at the default model's vocabulary size with the
default model's tokenizer, so text, chat and detokenization paths run without the weights.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import sgl
from sgl.backend.model_loader import resolve_model_path

TOKENIZED_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=49152, max_position_embeddings=1024, eos_token_id=0)


@pytest.fixture(scope="module")
def engine() -> Any:
    eng = sgl.Engine(model_config=TOKENIZED_TINY, load_format="dummy", device="cpu", max_total_tokens=4096,
                     tokenizer=str(resolve_model_path(None)), max_n=8, max_top_logprobs_num=5,
                     max_stop_strings=3, max_stop_string_len=10, max_stop_token_ids=4)
    submitted: list[Any] = []
    submit = eng._rt.core.submit

    def counting_submit(reqs: list[Any]) -> None:
        submitted.extend(reqs)
        submit(reqs)

    eng._rt.core.submit = counting_submit  # type: ignore[method-assign]
    eng.submitted = submitted  # type: ignore[attr-defined]
    yield eng
    eng.close()


def _refused(engine: Any, exc: type[Exception], field: str, words: tuple[str, ...], **kwargs: Any) -> str:
    """Run generate(**kwargs): it must raise `exc` naming `field`, with nothing queued."""
    before = len(engine.submitted)
    with pytest.raises(exc) as info:
        asyncio.run(asyncio.wait_for(engine.generate(**{"max_new_tokens": 4, **kwargs}), 30))
    msg = str(info.value)
    assert info.value.field == field, (info.value.field, msg)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert len(engine.submitted) == before, "the request reached the engine thread"
    return msg


# -- limits (EngineConfig "request limits") -------------------------------------------------

LIMITS = [
    ("n", dict(n=9), ("n=9", "max_n=8")),
    ("top_logprobs_num", dict(return_logprob=True, top_logprobs_num=6), ("top_logprobs_num=6",
                                                                         "max_top_logprobs_num=5")),
    ("stop", dict(stop=["a", "b", "c", "d"]), ("4 strings", "max_stop_strings=3")),
    ("stop", dict(stop="x" * 11), ("11 characters", "max_stop_string_len=10")),
    ("stop_token_ids", dict(stop_token_ids=[1, 2, 3, 4, 5]), ("5 ids", "max_stop_token_ids=4")),
]


@pytest.mark.parametrize("field,kwargs,words", LIMITS, ids=[w[1] for _, _, w in LIMITS])
def test_request_over_a_limit_is_refused_naming_the_option(engine: Any, field: str, kwargs: dict[str, Any],
                                                           words: tuple[str, ...]) -> None:
    msg = _refused(engine, sgl.InvalidSamplingParamsError, field, words, prompt="Hi", **kwargs)
    option = words[-1].split("=")[0]
    assert f"sgl.Engine({option}=...)" in msg and f"--{option.replace('_', '-')}" in msg


def test_requests_at_the_limits_run(engine: Any) -> None:
    outs = engine.generate_sync("Hi", max_new_tokens=2, n=8, return_logprob=True, top_logprobs_num=5,
                                stop=["a", "b", "x" * 10], stop_token_ids=[1, 2, 3, 4])
    assert len(outs) == 8


def test_default_limits() -> None:
    cfg = sgl.EngineConfig()
    assert (cfg.max_n, cfg.max_top_logprobs_num, cfg.max_stop_strings, cfg.max_stop_string_len,
            cfg.max_stop_token_ids) == (64, 20, 32, 256, 256)


def test_stream_is_bounded_too(engine: Any) -> None:
    async def first() -> Any:
        async for chunk in engine.stream("Hi", n=100, max_new_tokens=2):
            return chunk

    with pytest.raises(sgl.InvalidSamplingParamsError, match="max_n"):
        asyncio.run(first())


# -- strict types ---------------------------------------------------------------------------


def test_non_boolean_flag_is_refused_and_the_engine_keeps_serving(engine: Any) -> None:
    # It used to reach the detokenizer on the engine thread, crash it, and the await never
    # returned (here: the 30 s wait_for would raise TimeoutError instead).
    _refused(engine, sgl.InvalidSamplingParamsError, "skip_special_tokens", ("True or False",),
             prompt="Hi", skip_special_tokens=0)
    assert engine._rt.core.alive
    out = asyncio.run(asyncio.wait_for(engine.generate("Hi", max_new_tokens=3, temperature=0), 30))
    assert len(out.token_ids) == 3


BAD_TYPES = [
    ("ignore_eos=1", dict(prompt="Hi", ignore_eos=1), sgl.InvalidSamplingParamsError, "ignore_eos",
     ("True or False",)),
    ("n=True", dict(prompt="Hi", n=True), sgl.InvalidSamplingParamsError, "n", ("integer",)),
    ("stop=5", dict(prompt="Hi", stop=5), sgl.InvalidSamplingParamsError, "stop", ("a string or a list",)),
    ("stop=dict", dict(prompt="Hi", stop={"a": 1}), sgl.InvalidSamplingParamsError, "stop",
     ("a string or a list",)),
    ("stop-list-of-int", dict(prompt="Hi", stop=["a", 5]), sgl.InvalidSamplingParamsError, "stop",
     ("list of strings", "5")),
    ("stop_token_ids=str", dict(prompt="Hi", stop_token_ids="3"), sgl.InvalidSamplingParamsError,
     "stop_token_ids", ("token id",)),
    ("return_logprob=1", dict(prompt="Hi", return_logprob=1), sgl.InvalidSamplingParamsError,
     "return_logprob", ("True or False",)),
    ("top_logprobs_num=True", dict(prompt="Hi", top_logprobs_num=True), sgl.InvalidSamplingParamsError,
     "top_logprobs_num", ("integer",)),
    ("stream=1", dict(prompt="Hi", stream=1), sgl.InvalidRequestError, "stream", ("True or False",)),
    ("sampling_params=list", dict(prompt="Hi", sampling_params=[1]), sgl.InvalidSamplingParamsError,
     "sampling_params", ("dict",)),
    ("prompt=bytes", dict(prompt=b"Hi"), sgl.InvalidRequestError, "prompt", ("bytes", "decode")),
    ("input_ids=bytes", dict(input_ids=b"\x01\x02"), sgl.InvalidRequestError, "input_ids", ("bytes",)),
    ("input_ids-bad-item", dict(input_ids=[[1, 2], ["x"]]), sgl.InvalidRequestError, "input_ids",
     ("integers", "'x'", "input_ids[1]")),
    ("input_ids-mixed", dict(input_ids=[[1, 2], 3]), sgl.InvalidRequestError, "input_ids",
     ("input_ids[1]", "lists of token ids")),
    ("batch-item-of-wrong-type", dict(prompt=["Hi", 3.5]), sgl.InvalidRequestError, "prompt",
     ("3.5",)),
    ("batch-item-dict", dict(prompt=["Hi", {"a": 1}]), sgl.InvalidRequestError, "prompt",
     ("prompt[1]",)),
    ("unknown-role", dict(prompt=[{"role": "root", "content": "Hi"}]), sgl.InvalidRequestError, "messages",
     ("unknown role", "'root'", "user")),
    ("content-not-text", dict(prompt=[{"role": "user", "content": 5}]), sgl.InvalidRequestError, "messages",
     ("content",)),
    ("max_tokens", dict(prompt="Hi", max_tokens=8), sgl.InvalidSamplingParamsError, "max_tokens",
     ("did you mean 'max_new_tokens'",)),
    ("misspelt", dict(prompt="Hi", top_pp=0.5), sgl.InvalidSamplingParamsError, "top_pp",
     ("did you mean 'top_p'",)),
    ("logprobs", dict(prompt="Hi", logprobs=True), sgl.InvalidSamplingParamsError, "logprobs",
     ("did you mean 'return_logprob'",)),
    ("regex-shorter-than-min-new-tokens", dict(prompt="Hi", regex="a", min_new_tokens=5, max_new_tokens=8),
     sgl.InvalidSamplingParamsError, "min_new_tokens", ("at most 1",)),
    ("choices-shorter-than-min-new-tokens", dict(prompt="Hi", choices=["yes", "no"], min_new_tokens=4,
                                                max_new_tokens=8),
     sgl.InvalidSamplingParamsError, "min_new_tokens", ("at most 3",)),
]


@pytest.mark.parametrize("kwargs,exc,field,words", [c[1:] for c in BAD_TYPES], ids=[c[0] for c in BAD_TYPES])
def test_wrong_argument_is_refused_naming_it(engine: Any, kwargs: dict[str, Any], exc: type[Exception],
                                            field: str, words: tuple[str, ...]) -> None:
    _refused(engine, exc, field, words, **kwargs)


def test_stream_names_the_bad_token_id_not_the_prompt_count(engine: Any) -> None:
    async def first() -> Any:
        async for chunk in engine.stream(input_ids=[[1, 2], ["x"]]):
            return chunk

    with pytest.raises(sgl.InvalidRequestError, match=r"input_ids\[1\]"):
        asyncio.run(first())


def test_reachable_min_new_tokens_with_a_regex_runs(engine: Any) -> None:
    # 3 characters: 1 to 3 tokens, so min_new_tokens=1 can always be met and is not refused.
    out = engine.generate_sync("Hi", regex="[ab]{3}", min_new_tokens=1, max_new_tokens=6, temperature=0)
    assert len(out.text) == 3 and set(out.text) <= {"a", "b"}


# -- temperature ------------------------------------------------------------------------------


def test_tiny_temperatures_are_greedy() -> None:
    from test_engine_core import make_engine

    eng = make_engine()
    try:
        greedy = eng.generate_sync(input_ids=[1, 2, 3], max_new_tokens=8, temperature=0).token_ids
        for t in (1e-6, 1e-38, 1e-40, 1e-45):
            out = eng.generate_sync(input_ids=[1, 2, 3], max_new_tokens=8, temperature=t, seed=1)
            assert out.token_ids == greedy, (t, out.token_ids, greedy)
    finally:
        eng.close()



def test_a_text_without_tokens_is_refused_not_an_engine_crash(engine: Any) -> None:
    """"\x04" tokenizes to nothing: admitting it crashed the engine thread (an IndexError in
    the scheduler); it is refused up front and the engine keeps serving."""
    _refused(engine, sgl.InvalidRequestError, "prompt", ("no tokens",), prompt="\x04")
    assert engine._rt.core.alive
    out = asyncio.run(asyncio.wait_for(engine.generate("Hi", max_new_tokens=3, temperature=0), 30))
    assert len(out.token_ids) == 3
