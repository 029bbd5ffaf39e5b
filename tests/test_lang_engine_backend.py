"""EngineBackend against a fake object with sgl.Engine's API: ids in, batched select scoring."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest

import sgl.lang as sgl
from sgl.lang import CharTokenizer, EngineBackend
from sgl.outputs import GenerateOutput, Logprobs, StreamChunk, TokenLogprob, Usage
from sgl.sampling import SamplingParams


class FakeEngine:
    """Engine facade look-alike: char tokens, answers "xyz...", logprob = -(token % 5) / 10."""

    def __init__(self) -> None:
        self.tokenizer = CharTokenizer()
        self.calls: list[dict[str, Any]] = []
        self.flushed = False

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def flush_cache(self) -> bool:
        self.flushed = True
        return True

    @staticmethod
    def _params(sampling_params: Any, kwargs: dict[str, Any]) -> SamplingParams:
        if isinstance(sampling_params, SamplingParams):
            return sampling_params.replace(**kwargs)
        return SamplingParams.from_dict({**(sampling_params or {}), **kwargs})

    def _one(self, ids: list[int], params: SamplingParams, return_logprob: bool,
             start: int, index: int = 0) -> GenerateOutput:
        out_ids = [ord(c) for c in "xyz xyz xyz"[: params.max_new_tokens]]
        logprobs = None
        if return_logprob:
            prompt = [TokenLogprob(t, math.nan if i == 0 else -(t % 5) / 10, chr(t))
                      for i, t in enumerate(ids)][max(start, 0):] if start >= 0 else []
            logprobs = Logprobs(output=[TokenLogprob(t, -0.5, chr(t)) for t in out_ids], prompt=prompt)
        return GenerateOutput(self.decode(out_ids), out_ids, "length",
                              Usage(len(ids), len(out_ids), 0), index=index, logprobs=logprobs)

    async def generate(self, prompt: Any, sampling_params: Any = None, *, return_logprob: bool = False,
                       logprob_start_len: int = -1, top_logprobs_num: int = 0,
                       timeout: float | None = None, **kwargs: Any) -> Any:
        params = self._params(sampling_params, kwargs)
        self.calls.append({"prompt": prompt, "params": params, "return_logprob": return_logprob,
                           "logprob_start_len": logprob_start_len, "top": top_logprobs_num})
        batch = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        prompts = prompt if batch else [prompt]
        outs = []
        for p in prompts:
            ids = self.encode(p) if isinstance(p, str) else list(p)
            samples = [self._one(ids, params, return_logprob, logprob_start_len, i)
                       for i in range(params.n)]
            outs.append(samples if params.n > 1 else samples[0])
        return outs if batch else outs[0]

    async def stream(self, prompt: Any, sampling_params: Any = None, **kwargs: Any):  # noqa: ANN201
        out = await self.generate(prompt, sampling_params, **kwargs)
        for i, t in enumerate(out.token_ids):
            last = i == len(out.token_ids) - 1
            yield StreamChunk(chr(t), [t], finish_reason="length" if last else None,
                              output=out if last else None)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


def test_engine_is_a_backend_and_gen_sends_input_ids(engine: FakeEngine) -> None:
    @sgl.function
    def prog(s):
        s += "Hi:" + sgl.gen("a", max_tokens=3, return_logprob=True, top_logprobs_num=2)
        s += "!" + sgl.gen("b", max_tokens=2, temperature=0)

    state = prog.run(backend=engine)
    assert state["a"] == "xyz" and state.text() == "Hi:xyz!xy"
    first, second = engine.calls
    assert first["prompt"] == [ord(c) for c in "Hi:"]  # ids, not text
    assert second["prompt"] == [ord(c) for c in "Hi:xyz!"]  # generated tokens extended
    assert first["params"].max_new_tokens == 3 and second["params"].temperature == 0
    assert first["return_logprob"] and first["top"] == 2
    meta = state.get_meta_info("a")
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 3
    assert meta["output_token_logprobs"][0] == (-0.5, ord("x"), "x")
    assert meta["finish_reason"]["type"] == "length"


def test_set_default_backend_wraps_engine_once(engine: FakeEngine) -> None:
    sgl.set_default_backend(engine)
    try:
        wrapped = sgl.get_default_backend()
        assert isinstance(wrapped, EngineBackend) and wrapped.engine is engine
        sgl.set_default_backend(engine)
        assert sgl.get_default_backend() is wrapped
        assert sgl.flush_cache() and engine.flushed
    finally:
        sgl.set_default_backend(None)


def test_select_is_one_batched_scoring_call(engine: FakeEngine) -> None:
    @sgl.function
    def prog(s):
        s += "Pick:" + sgl.select("p", ["ab", "cd", "a"])

    state = prog.run(backend=engine)
    (call,) = engine.calls
    assert call["prompt"] == [[ord(c) for c in "Pick:" + ch] for ch in ["ab", "cd", "a"]]
    assert call["params"].max_new_tokens == 0 and call["return_logprob"]
    assert call["logprob_start_len"] == len("Pick:")
    # logprob = -(t % 5)/10: a=97 -> -0.2, b -> -0.3, c -> -0.4, d -> 0.0
    meta = state.get_meta_info("p")
    assert meta["normalized_prompt_logprobs"] == pytest.approx([-0.25, -0.2, -0.2])
    assert state["p"] == "cd"  # first of the tied best, like SGLang
    assert [t[1] for t in meta["input_token_logprobs"][0]] == [ord("a"), ord("b")]


def test_unconditional_select_scores_choices_alone(engine: FakeEngine) -> None:
    @sgl.function
    def prog(s):
        s += "Q:" + sgl.select("p", ["ab", "cd"], choices_method=sgl.unconditional_likelihood_normalized)

    prog.run(backend=engine)
    prompts = sorted(str(c["prompt"]) for c in engine.calls)
    assert str([[ord("a"), ord("b")], [ord("c"), ord("d")]]) in prompts
    assert len(engine.calls) == 2  # conditional + unconditional, issued concurrently


def test_engine_stream_n_and_fork_prefix_cache(engine: FakeEngine) -> None:
    @sgl.function
    def prog(s):
        s += "P:" + sgl.gen("a", max_tokens=3)
        forks = s.fork(2)
        forks += sgl.gen("f", max_tokens=1)
        forks.join()
        s += sgl.gen("many", n=2, max_tokens=1)

    state = prog.run(backend=engine, stream=True)
    assert "".join(state.text_iter("a")) == "xyz"
    state.sync()
    assert state["f"] == ["x", "x"] and state["many"] == ["x", "x"]
    warm = [c for c in engine.calls if c["params"].max_new_tokens == 0]
    assert warm and warm[0]["prompt"] == [ord(c) for c in "P:xyz"]


def test_import_sgl_lang_does_not_import_torch() -> None:
    code = "import sys, sgl.lang; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
