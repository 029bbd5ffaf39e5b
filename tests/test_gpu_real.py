"""The engine on the real default model on a CUDA device, against transformers on the same
weights (`sgl.backend.reference`), with tests/test_engine_real.py's prompts.

- float32: greedy tokens equal transformers' float32 `generate` (one at a time and batched),
  up to a documented tie rule;
- bfloat16: no greedy check (bf16 rounding changes near-ties), but teacher-forced
  log-probabilities: the engine in bf16 scores transformers' float32 greedy continuations, and
  its largest error against transformers' float32 log-probabilities may be at most 1.5x that of
  transformers' own bfloat16 model on the same sequences (plus 0.02 nats).

Marked `gpu` (skipped without CUDA, conftest.py). The model is found as `sgl.Engine()` finds
it, or from `SGL_TEST_MODEL` (a .gguf path) when set, e.g. on a GPU machine that gets the
GGUF copied to a temporary path.
"""

from __future__ import annotations

import asyncio
import math
import os
from typing import Any, Iterator, NamedTuple

import pytest
import torch

import sgl
from test_engine_real import NEW_TOKENS, assert_same_or_tie, build_prompts, greedy_outputs

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.anyio]

# On CUDA the engine's float32 kernels (Triton attention, cuBLAS without TF32) sum in another
# order than transformers' float32 path; measured logprob differences are below 5e-4 nats
# (bench/results/radix_logprob_check.jsonl), so a differing greedy token is accepted only where
# the reference's two best logits are within 1e-3.
GPU_TIE = 1e-3
BF16_FACTOR = 1.5
BF16_EPS = 0.02  # nats
KV_TOKENS = 16384


def model_path() -> str | None:
    return os.environ.get("SGL_TEST_MODEL") or None


def cuda_engine(dtype: str) -> sgl.Engine:
    return sgl.Engine(model_path(), device="cuda", dtype=dtype, max_total_tokens=KV_TOKENS)


def reference_model(dtype: torch.dtype) -> Any:
    from sgl.backend.reference import load_reference_model

    return load_reference_model(model_path(), dtype=dtype).to("cuda")


class Setup(NamedTuple):
    prompts: list[list[int]]
    ref32: Any  # transformers' model in float32 on CUDA
    expected: list[list[int]]  # its greedy continuations


@pytest.fixture(scope="module")
def fp32_engine() -> Iterator[sgl.Engine]:
    engine = cuda_engine("float32")
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def setup(fp32_engine: sgl.Engine) -> Setup:
    prompts = build_prompts(fp32_engine)
    ref32 = reference_model(torch.float32)
    return Setup(prompts, ref32, greedy_outputs(ref32, prompts))


async def test_float32_greedy_matches_transformers_on_cuda(fp32_engine: sgl.Engine, setup: Setup) -> None:
    greedy = dict(temperature=0, max_new_tokens=NEW_TOKENS)
    for p, exp in zip(setup.prompts, setup.expected):
        out = await fp32_engine.generate(input_ids=p, **greedy)
        assert_same_or_tie(setup.ref32, p, exp, out.token_ids, tie=GPU_TIE)
    # All at once: batched prefill, then CUDA-graph decode of several rows.
    outs = await asyncio.gather(*(fp32_engine.generate(input_ids=p, **greedy) for p in setup.prompts))
    for p, exp, out in zip(setup.prompts, setup.expected, outs):
        assert_same_or_tie(setup.ref32, p, exp, out.token_ids, tie=GPU_TIE)
    fp32_engine.check_integrity()


@torch.inference_mode()
def continuation_logprobs(model: Any, prompt: list[int], cont: list[int]) -> list[float]:
    """log p(cont[i] | prompt + cont[:i]) under `model`, computed in float32 from its logits."""
    seq = torch.tensor([prompt + cont], device=model.device)
    logits = model(seq).logits[0, len(prompt) - 1 : -1].float()  # [C, V]
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(cont, device=lp.device).unsqueeze(1)).squeeze(1).tolist()


async def engine_logprobs(engine: sgl.Engine, prompt: list[int], cont: list[int]) -> list[float]:
    """The engine's prompt log-probabilities of `cont`, scoring prompt + cont as one prompt."""
    out = await engine.generate(input_ids=prompt + cont, max_new_tokens=1, temperature=0,
                                return_logprob=True, logprob_start_len=0)
    lps = [t.logprob for t in out.logprobs.prompt]
    assert len(lps) == len(prompt) + len(cont) and math.isnan(lps[0])
    return lps[len(prompt):]


def max_abs_error(got: list[list[float]], want: list[list[float]]) -> float:
    return max(abs(g - w) for gs, ws in zip(got, want) for g, w in zip(gs, ws, strict=True))


async def test_bfloat16_logprobs_are_as_close_as_transformers_bfloat16(setup: Setup) -> None:
    pairs = [(p, c) for p, c in zip(setup.prompts, setup.expected) if c]
    want = [continuation_logprobs(setup.ref32, p, c) for p, c in pairs]
    ref16 = reference_model(torch.bfloat16)
    hf16 = [continuation_logprobs(ref16, p, c) for p, c in pairs]
    del ref16
    engine = cuda_engine("bfloat16")
    try:
        ours = [await engine_logprobs(engine, p, c) for p, c in pairs]
    finally:
        engine.close()
    hf_err, our_err = max_abs_error(hf16, want), max_abs_error(ours, want)
    print(f"bf16 teacher-forced logprobs, max abs error vs float32: sgl {our_err:.4f}, "
          f"transformers bf16 {hf_err:.4f} nats over {sum(len(c) for _, c in pairs)} tokens")
    assert our_err <= BF16_FACTOR * hf_err + BF16_EPS, (
        f"sgl bf16 is off transformers' float32 by up to {our_err:.4f} nats, transformers' own "
        f"bf16 by {hf_err:.4f}: more than {BF16_FACTOR}x + {BF16_EPS}")
