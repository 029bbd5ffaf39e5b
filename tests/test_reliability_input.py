"""Bad input is refused with a clear exception before any work is queued (issue 7).

Each case must raise the named `sgl` exception class (never a bare TypeError, KeyError or a
template engine's error), carry `field` naming the argument to fix, say how in its message,
and leave the engine untouched: no submission reached the engine thread and no step ran.

Request cases run on the real default model (text and chat prompts need its tokenizer), one
engine for the module; engine-option cases need no model (they fail during validation).
The same cases over HTTP (4xx) belong to the server's tests.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

import sgl

from test_engine_core import TINY, make_engine

CONTEXT = 256


@pytest.fixture(scope="module")
def engine() -> Any:
    eng = sgl.Engine(max_total_tokens=2048, context_length=CONTEXT)
    submitted: list[Any] = []
    core = eng._rt.core
    submit = core.submit

    def counting_submit(reqs: list[Any]) -> None:
        submitted.extend(reqs)
        submit(reqs)

    core.submit = counting_submit  # type: ignore[method-assign]
    eng.submitted = submitted  # type: ignore[attr-defined]
    yield eng
    eng.close()


VOCAB_MSG = "outside the vocabulary"

# (id, generate kwargs, exception class, field, words the message must contain)
CASES: list[tuple[str, dict[str, Any], type[Exception], str, tuple[str, ...]]] = [
    ("prompt-too-long", dict(prompt="word " * 400), sgl.ContextLengthError, "prompt",
     ("context window", f"at most {CONTEXT - 1}")),
    ("ids-too-long", dict(input_ids=[100] * CONTEXT), sgl.ContextLengthError, "prompt", ("context window",)),
    ("max-new-tokens-beyond-context", dict(prompt="Hi", max_new_tokens=CONTEXT), sgl.ContextLengthError,
     "max_new_tokens", ("context window", "lower max_new_tokens to at most")),
    ("empty-text", dict(prompt=""), sgl.InvalidRequestError, "prompt", ("empty",)),
    ("empty-ids", dict(input_ids=[]), sgl.InvalidRequestError, "input_ids", ("empty",)),
    ("empty-in-batch", dict(prompt=["Hi", ""]), sgl.InvalidRequestError, "prompt", ("empty",)),
    ("empty-list-in-batch", dict(prompt=[[1, 2], []]), sgl.InvalidRequestError, "prompt", ("empty",)),
    ("no-prompt", dict(), sgl.InvalidRequestError, "prompt", ("required",)),
    ("prompt-and-ids", dict(prompt="Hi", input_ids=[1]), sgl.InvalidRequestError, "input_ids", ("either",)),
    ("prompt-of-wrong-type", dict(prompt=5), sgl.InvalidRequestError, "prompt", ("pass text",)),
    ("id-negative", dict(input_ids=[5, -1]), sgl.InvalidRequestError, "input_ids", (VOCAB_MSG, "-1")),
    ("id-beyond-vocab", dict(input_ids=[5, 49152]), sgl.InvalidRequestError, "input_ids", (VOCAB_MSG, "49152")),
    ("id-huge", dict(input_ids=[10**12]), sgl.InvalidRequestError, "input_ids", (VOCAB_MSG,)),
    ("id-float", dict(input_ids=[1, 2.5]), sgl.InvalidRequestError, "input_ids", ("integers", "2.5")),
    ("message-without-content", dict(prompt=[{"role": "user"}]), sgl.InvalidRequestError, "messages",
     ("content",)),
    ("stop-id-beyond-vocab", dict(prompt="Hi", stop_token_ids=[10**9]), sgl.InvalidSamplingParamsError,
     "stop_token_ids", (VOCAB_MSG,)),
    ("temperature-negative", dict(prompt="Hi", temperature=-0.5), sgl.InvalidSamplingParamsError,
     "temperature", (">= 0",)),
    ("temperature-nan", dict(prompt="Hi", temperature=math.nan), sgl.InvalidSamplingParamsError,
     "temperature", ("finite",)),
    ("top-p-nan", dict(prompt="Hi", top_p=math.nan), sgl.InvalidSamplingParamsError, "top_p", ("finite",)),
    ("top-p-zero", dict(prompt="Hi", top_p=0.0), sgl.InvalidSamplingParamsError, "top_p", ("(0, 1]",)),
    ("top-k-negative", dict(prompt="Hi", top_k=-5), sgl.InvalidSamplingParamsError, "top_k", ("-1",)),
    ("min-p-above-one", dict(prompt="Hi", min_p=1.5), sgl.InvalidSamplingParamsError, "min_p", ("[0, 1]",)),
    ("max-new-tokens-negative", dict(prompt="Hi", max_new_tokens=-1), sgl.InvalidSamplingParamsError,
     "max_new_tokens", (">= 0",)),
    ("max-new-tokens-float", dict(prompt="Hi", max_new_tokens=2.5), sgl.InvalidSamplingParamsError,
     "max_new_tokens", ("integer",)),
    ("repetition-penalty-zero", dict(prompt="Hi", repetition_penalty=0.0), sgl.InvalidSamplingParamsError,
     "repetition_penalty", ("(0, 2]",)),
    ("frequency-penalty-inf", dict(prompt="Hi", frequency_penalty=math.inf), sgl.InvalidSamplingParamsError,
     "frequency_penalty", ("finite",)),
    ("presence-penalty-nan", dict(prompt="Hi", presence_penalty=math.nan), sgl.InvalidSamplingParamsError,
     "presence_penalty", ("finite",)),
    ("n-zero", dict(prompt="Hi", n=0), sgl.InvalidSamplingParamsError, "n", (">= 1",)),
    ("seed-string", dict(prompt="Hi", seed="7"), sgl.InvalidSamplingParamsError, "seed", ("integer",)),
    ("stop-empty-string", dict(prompt="Hi", stop=[""]), sgl.InvalidSamplingParamsError, "stop", ("non-empty",)),
    ("min-above-max", dict(prompt="Hi", min_new_tokens=5, max_new_tokens=2), sgl.InvalidSamplingParamsError,
     "min_new_tokens", ("<= max_new_tokens",)),
    ("unknown-kwarg", dict(prompt="Hi", temprature=0.5), sgl.InvalidSamplingParamsError, "temprature",
     ("unknown", "temperature")),
    ("unknown-in-dict", dict(prompt="Hi", sampling_params={"max_tokens": 5}), sgl.InvalidSamplingParamsError,
     "max_tokens", ("unknown", "max_new_tokens")),
    ("top-logprobs-negative", dict(prompt="Hi", top_logprobs_num=-1), sgl.InvalidSamplingParamsError,
     "top_logprobs_num", (">= 0",)),
    ("logprob-start-beyond-prompt", dict(prompt="Hi", return_logprob=True, logprob_start_len=50),
     sgl.InvalidRequestError, "logprob_start_len", ("beyond the prompt",)),
    ("regex-invalid", dict(prompt="Hi", regex="(ab"), sgl.InvalidConstraintError, "regex", ("regex",)),
    ("json-schema-not-json", dict(prompt="Hi", json_schema="{not json"), sgl.InvalidConstraintError,
     "json_schema", ("JSON",)),
    ("json-schema-bad-type", dict(prompt="Hi", json_schema={"type": "nonsense"}), sgl.InvalidConstraintError,
     "json_schema", ("nonsense",)),
    ("grammar-invalid", dict(prompt="Hi", grammar="root ::= "), sgl.InvalidConstraintError, "ebnf", ("EBNF",)),
    ("choices-empty", dict(prompt="Hi", choices=[]), sgl.InvalidConstraintError, "choices", ("non-empty",)),
    ("two-constraints", dict(prompt="Hi", regex="a+", json_schema='{"type": "string"}'),
     sgl.InvalidConstraintError, "json_schema", ("only one constraint",)),
    ("timeout-negative", dict(prompt="Hi", timeout=-1), sgl.InvalidRequestError, "timeout", ("positive",)),
    ("timeout-nan", dict(prompt="Hi", timeout=math.nan), sgl.InvalidRequestError, "timeout", ("positive",)),
]


@pytest.mark.parametrize("kwargs,exc,field,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_is_refused_before_queueing(engine: Any, kwargs: dict[str, Any], exc: type[Exception],
                                                field: str, words: tuple[str, ...]) -> None:
    before = engine.stats()
    submitted = len(engine.submitted)
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(exc) as info:
        asyncio.run(asyncio.wait_for(engine.generate(**kwargs), 30))
    err = info.value
    assert err.field == field, (err.field, str(err))
    for w in words:
        assert w in str(err), f"{w!r} not in message: {err}"
    after = engine.stats()
    assert len(engine.submitted) == submitted, "the request reached the engine thread"
    assert (after.steps, after.waiting, after.running) == (before.steps, 0, 0)


STREAM_CASES = ["prompt-too-long", "empty-text", "id-beyond-vocab", "message-without-content",
                "temperature-nan", "unknown-kwarg", "regex-invalid", "timeout-negative"]


@pytest.mark.parametrize("kwargs,exc,field,words", [c[1:] for c in CASES if c[0] in STREAM_CASES],
                         ids=[c[0] for c in CASES if c[0] in STREAM_CASES])
def test_stream_refuses_the_same_input(engine: Any, kwargs: dict[str, Any], exc: type[Exception],
                                       field: str, words: tuple[str, ...]) -> None:
    async def first_chunk() -> Any:
        async for chunk in engine.stream(**{"max_new_tokens": 4, **kwargs}):
            return chunk

    submitted = len(engine.submitted)
    with pytest.raises(exc) as info:
        asyncio.run(asyncio.wait_for(first_chunk(), 30))
    assert info.value.field == field
    assert len(engine.submitted) == submitted


def test_engine_still_serves_after_the_bad_requests(engine: Any) -> None:
    out = engine.generate_sync("The capital of France is", max_new_tokens=4, temperature=0)
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    engine.check_integrity()


def test_request_larger_than_the_kv_pool_is_refused() -> None:
    eng = make_engine(max_total_tokens=300)
    try:
        with pytest.raises(sgl.ContextLengthError, match="max_total_tokens") as info:
            eng.generate_sync(input_ids=[1] * 200, max_new_tokens=200)
        assert info.value.field == "max_new_tokens"
        assert eng.stats().steps == 0
    finally:
        eng.close()


# ---- engine options ------------------------------------------------------------------------

BAD_OPTIONS: list[tuple[dict[str, Any], str]] = [
    (dict(max_total_token=4096), "unknown engine option"),
    (dict(temperature=0.5), "unknown engine option"),
    (dict(max_total_tokens=0), "positive integer"),
    (dict(max_total_tokens=True), "integer"),
    (dict(max_running_requests=-3), "positive integer"),
    (dict(page_size=0), ">= 1"),
    (dict(page_size="4"), "integer"),
    (dict(chunked_prefill_size=0), "-1 (off)"),
    (dict(context_length=1.5), "integer"),
    (dict(dtype="float8"), "must be one of"),
    (dict(device="tpu"), "'cuda'"),
    (dict(schedule_policy="random"), "'lpm' or 'fcfs'"),
    (dict(attention_backend="flash"), "'torch'"),
    (dict(mem_fraction_static=1.5), "(0, 1)"),
    (dict(mem_fraction_static=math.nan), "(0, 1)"),
    (dict(request_timeout=-1), "positive number"),
    (dict(request_timeout=math.nan), "positive number"),
    (dict(request_timeout="5"), "number"),
    (dict(schedule_conservativeness="x"), "number"),
    (dict(schedule_conservativeness=0), "> 0"),
    (dict(disable_radix_cache="no"), "True or False"),
    (dict(random_seed="a"), "integer"),
    (dict(log_level=3), "string"),
]


@pytest.mark.parametrize("options,words", BAD_OPTIONS, ids=[next(iter(o)) + "=" + repr(next(iter(o.values())))
                                                           for o, _ in BAD_OPTIONS])
def test_bad_engine_option_is_refused_naming_the_option(options: dict[str, Any], words: str) -> None:
    with pytest.raises(sgl.InvalidConfigError) as info:
        sgl.Engine(**{"model_config": TINY, "load_format": "dummy", "device": "cpu", **options})
    msg = str(info.value)
    assert words in msg and next(iter(options)) in msg, msg
