"""`enable_deterministic_inference`: a request's tokens and logprobs keep their bits whatever
else runs with it: alone or in a batch, beside prompts that arrive while it decodes, after a
cached prefix of any length, with its prompt in one chunk or several, with speculation on.

Kernels first (without CUDA under Triton's interpreter, as tests/test_kernels.py; the
subprocess test reruns this file interpreted when triton was imported compiled first):
- the batch-invariant linear gives a row the same bits in calls of 1 to 130 rows, at any
  offset, and stays within the dtype's tolerance of F.linear;
- extend attention gives a token the same bits whatever prefix length precedes its chunk;
- decode attention with the fixed split count gives a row the same bits alone and in a batch.

Then the engines: the real default model on the CPU (marked slow), a random-weight bf16 Llama
on CUDA (marked gpu; over a bf16 and a float8 KV pool), and the option's refusals where no
invariant kernel serves.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from triton_interp import (  # first: sets TRITON_INTERPRET before triton is imported
    DEVICE,
    NO_TRITON,
    rerun_interpreted,
    skip_unless_rerun_needed,
    triton_runs_here,
)

import sgl
from sgl.backend.kernels import triton_attention_decode, triton_attention_extend
from sgl.backend.kernels import triton_matmul as matmul
from sgl.backend.quant.policy import check_deterministic
from sgl.config import EngineConfig
from sgl.errors import InvalidConfigError

TRITON_HERE = triton_runs_here(matmul._matmul_kernel)
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason=NO_TRITON)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- kernels


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_keep_their_bits_in_calls_of_any_size(dtype: torch.dtype) -> None:
    g = _gen(0)
    n, k = 70, 100  # not multiples of any tile
    # Magnitudes spread over ~2^10, so that sums rounded in another order differ in bits.
    x = (torch.randn(130, k, generator=g) * torch.randn(130, k, generator=g).mul(2).exp()).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)  # [N, K]
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    whole = matmul.linear_batch_invariant(x, w, b)  # [130, N]
    assert whole.shape == (130, n) and whole.dtype == dtype
    torch.testing.assert_close(whole.float(), F.linear(x.float(), w.float(), b.float()), **TOL[dtype])
    # Rows moved to other tile positions (offsets 5, 33) and calls of 1..65 rows.
    for start, rows in [(0, 1), (5, 1), (33, 2), (7, 31), (64, 65), (1, 129)]:
        part = matmul.linear_batch_invariant(x[start:start + rows], w, b)
        assert torch.equal(part, whole[start:start + rows]), (start, rows)
    # A leading batch shape flattens to rows.
    assert torch.equal(matmul.linear_batch_invariant(x[:6].view(2, 3, k), w, b).view(6, n), whole[:6])


@needs_triton
def test_linear_without_bias_and_with_empty_input() -> None:
    g = _gen(1)
    x = torch.randn(3, 64, generator=g).to(DEVICE)
    w = torch.randn(32, 64, generator=g).to(DEVICE)
    torch.testing.assert_close(matmul.linear_batch_invariant(x, w), F.linear(x, w), **TOL[torch.float32])
    assert matmul.linear_batch_invariant(x[:0], w).shape == (0, 32)
    with pytest.raises(ValueError, match="bfloat16"):
        matmul.linear_batch_invariant(x, w.bfloat16())


def _pool(length: int, kv_heads: int, head_dim: int, g: torch.Generator):
    """One request's keys and values at slots 1..length (slot 0: the pool's reserved one),
    scattered through a shuffled table as a paged pool would hold them."""
    slots = torch.randperm(length, generator=g) + 1
    k = torch.randn(length + 1, kv_heads, head_dim, generator=g).to(DEVICE)
    v = torch.randn(length + 1, kv_heads, head_dim, generator=g).to(DEVICE)
    table = slots.to(torch.int32)[None, :].to(DEVICE)  # [1, length]
    return k, v, table


@needs_triton
def test_extend_attention_gives_a_token_the_same_bits_after_any_prefix() -> None:
    g = _gen(2)
    length, heads, kv_heads, head_dim = 150, 4, 2, 32
    k, v, table = _pool(length, kv_heads, head_dim, g)
    q = torch.randn(length, heads, head_dim, generator=g).to(DEVICE)  # [T, heads, dim]
    t = lambda xs: torch.tensor(xs, device=DEVICE)  # noqa: E731

    def attend(prefix: int) -> torch.Tensor:  # tokens prefix..length-1 as one chunk
        n = length - prefix
        return triton_attention_extend.extend_attention_triton(
            q[prefix:], k, v, table, t([0]), t([length]), t([prefix]), t([n]), t([0]),
            head_dim**-0.5, n)

    whole = attend(0)
    for prefix in (1, 37, 63, 64, 65, 100):  # cached prefixes and chunk ends of any length
        assert torch.equal(attend(prefix), whole[prefix:]), prefix


@needs_triton
def test_decode_attention_with_fixed_splits_keeps_a_row_bits_in_any_batch() -> None:
    from sgl.backend.attention.triton_backend import DETERMINISTIC_KV_SPLITS

    g = _gen(3)
    lens, heads, kv_heads, head_dim = [150, 9, 77], 4, 2, 32
    k, v, table = _pool(max(lens), kv_heads, head_dim, g)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(DEVICE)
    rows = torch.zeros(len(lens), dtype=torch.int64, device=DEVICE)  # all on one table row
    seq = torch.tensor(lens, device=DEVICE)
    args = (head_dim**-0.5, DETERMINISTIC_KV_SPLITS)
    batch = triton_attention_decode.decode_attention_triton(q, k, v, table, rows, seq, *args)
    for i in range(len(lens)):
        alone = triton_attention_decode.decode_attention_triton(
            q[i:i + 1], k, v, table, rows[i:i + 1], seq[i:i + 1], *args)
        assert torch.equal(alone, batch[i:i + 1]), i


def test_the_attention_backend_fixes_its_splits_when_the_set_is_batch_invariant() -> None:
    from types import SimpleNamespace

    from sgl.backend.attention.triton_backend import DETERMINISTIC_KV_SPLITS, TritonAttentionBackend
    from sgl.backend.forward_batch import ForwardMode

    pool = SimpleNamespace(k_buffer=[torch.empty(4, 8, 16)])
    for invariant in (True, False):
        backend = TritonAttentionBackend(SimpleNamespace(batch_invariant=invariant), num_sms=132)
        splits = set()
        for bs in (1, 8, 256):
            fb = SimpleNamespace(mode=ForwardMode.DECODE, batch_size=bs, kv_pool=pool)
            backend.prepare(fb)
            splits.add(fb.attn_metadata.num_kv_splits)
        assert (splits == {DETERMINISTIC_KV_SPLITS}) == invariant, (invariant, splits)


@skip_unless_rerun_needed(TRITON_HERE)
def test_deterministic_kernels_in_subprocess() -> None:
    """Triton was imported before this module could ask for its interpreter: rerun here."""
    rerun_interpreted(__file__)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("options,match", [
    (dict(device="cuda", quantization="fp8", dtype="bfloat16"), "routes each product"),
    (dict(device="cuda", quantization="none", dtype="bfloat16", attention_backend="torch"),
     "attention_backend='torch'"),
    (dict(device="cpu", quantization="none", dtype="float32"), "GGUF-quantized"),
    (dict(device="cpu", quantization="gguf", dtype="float32", activation_quantization="int8"),
     "activation_quantization='int8'"),
    (dict(device="cpu", quantization="gguf", dtype="float32", kernels="reference"),
     "kernels='reference'"),
])
def test_combinations_without_invariant_kernels_are_refused(options: dict, match: str) -> None:
    config = EngineConfig(enable_deterministic_inference=True, **options)
    with pytest.raises(InvalidConfigError, match=match):
        check_deterministic(config)
    check_deterministic(config.replace(enable_deterministic_inference=False))  # (only then)


def test_cuda_without_triton_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl.backend.kernels import dispatch

    config = EngineConfig(enable_deterministic_inference=True, device="cuda", quantization="none",
                          dtype="bfloat16")
    monkeypatch.setattr(dispatch, "has_triton", lambda: True)
    check_deterministic(config)
    monkeypatch.setattr(dispatch, "has_triton", lambda: False)
    with pytest.raises(InvalidConfigError, match="install triton"):
        check_deterministic(config)


def test_a_float_model_on_the_cpu_is_refused_before_it_serves() -> None:
    with pytest.raises(InvalidConfigError, match="GGUF-quantized"):
        sgl.Engine(model_config=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=128, vocab_size=256),
                   load_format="dummy", device="cpu", enable_deterministic_inference=True)


# --------------------------------------------------------------------------- engines


def _step_kinds(e: sgl.Engine) -> list[str]:
    """Record each step as "prefill", "decode" or "mixed" (prompt tokens and tokens past a
    prompt in one step)."""
    kinds: list[str] = []
    runner = e._rt.runner
    previous = runner.step_hook

    def hook(step: Any) -> None:
        past = [it.prefix_len >= len(it.req.prompt_ids) for it in step.batch.items]
        kinds.append("decode" if all(past) else "prefill" if not any(past) else "mixed")
        if previous is not None:
            previous(step)

    runner.step_hook = hook
    return kinds


async def _scenarios(e: sgl.Engine, prompts: list[Any], **kw: Any) -> dict[str, list[Any]]:
    """Each scenario's (token ids, output logprobs) of prompt 0, and of every prompt for
    "alone" and "together"."""

    async def one(p: Any) -> tuple[list[int], list[float]]:
        key = "input_ids" if isinstance(p, list) else "prompt"
        o = await e.generate(**{key: p}, return_logprob=True, **kw)
        return o.token_ids, [t.logprob for t in o.logprobs.output]

    async def late(p: Any, delay: float) -> Any:
        await asyncio.sleep(delay)
        return await one(p)

    out: dict[str, list[Any]] = {}
    out["alone"] = []
    for p in prompts:
        e.flush_cache()
        out["alone"].append(await one(p))
    e.flush_cache()
    out["together"] = list(await asyncio.gather(*map(one, prompts)))
    e.flush_cache()
    first, *_ = await asyncio.gather(one(prompts[0]),
                                     *(late(p, 0.05 * i) for i, p in enumerate(prompts[1:], 1)))
    out["others arrive while it decodes"] = [first]
    e.flush_cache()
    head = prompts[0][:37] if isinstance(prompts[0], list) else prompts[0][:101]
    await one(head)  # the tree now holds a prefix of prompt 0 of an unaligned length
    out["after a cached prefix"] = [await one(prompts[0])]
    return out


def _assert_all_equal(got: dict[str, list[Any]]) -> None:
    alone = got.pop("alone")
    for name, outs in got.items():
        for i, (ids, logprobs) in enumerate(outs):
            assert ids == alone[i][0], f"{name}: prompt {i}'s tokens differ"
            assert logprobs == alone[i][1], f"{name}: prompt {i}'s logprobs differ in some bit"


def test_the_scheduler_can_keep_prefill_and_decode_in_separate_steps() -> None:
    """The policy CUDA's deterministic engines schedule with (tried here on a CPU engine): a
    step prefills or decodes, and while a request decodes, prompts arriving in 16-token chunks
    take turns with it instead of holding it up; everyone finishes."""
    import dataclasses

    tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256, max_position_embeddings=1024, eos_token_id=0)
    kw = dict(temperature=0, ignore_eos=True)
    with sgl.Engine(model_config=tiny, load_format="dummy", device="cpu", max_total_tokens=4096) as e:
        scheduler = e._rt.scheduler
        scheduler.cfg = dataclasses.replace(scheduler.cfg, mix_decode_with_prefill=False,
                                            chunked_prefill_size=16)
        kinds = _step_kinds(e)

        async def go() -> list[sgl.GenerateOutput]:
            first = asyncio.create_task(e.generate(input_ids=list(range(1, 9)), max_new_tokens=300, **kw))
            while "decode" not in kinds:
                await asyncio.sleep(0.001)
            later = [asyncio.create_task(e.generate(input_ids=list(range(1, 100)), max_new_tokens=4, **kw))
                     for _ in range(2)]
            return [await first, *await asyncio.gather(*later)]

        outs = asyncio.run(go())
    assert [len(o.token_ids) for o in outs] == [300, 4, 4]
    assert "mixed" not in kinds
    after = kinds[kinds.index("decode"):]
    assert after.count("prefill") >= 10, after  # the two prompts came in 16-token chunks
    assert not any(a == b == "prefill" for a, b in zip(after, after[1:])), " ".join(after)


PROMPTS = [
    "Write a long letter to a friend about a journey through the mountains, the rivers you "
    "crossed, the villages where you stopped, the food you ate and the people you met along "
    "the way, and what you learned about yourself during those weeks of walking.",
    "List ten facts about the ocean.",
    "Explain how a compiler turns source code into machine code, step by step, for a student "
    "who has written a few small programs but never looked inside the tools that build them.",
    "What is the capital of France?",
]


@pytest.mark.slow
def test_cpu_engine_gives_a_request_the_same_bits_whatever_runs_beside_it() -> None:
    model = os.environ.get("SGL_TEST_MODEL") or None
    with sgl.Engine(model, device="cpu", enable_deterministic_inference=True) as e:
        kinds = _step_kinds(e)
        got = asyncio.run(_scenarios(e, PROMPTS, max_new_tokens=24, temperature=0))
        # The CPU attends prompt and decode rows with one C op, so steps may mix them: the
        # arrivals while prompt 0 decodes must have made some.
        assert "mixed" in kinds and "decode" in kinds
    alone = got["alone"]
    _assert_all_equal(got)
    # Prompts in 24-token chunks, with decode steps of the others in between.
    with sgl.Engine(model, device="cpu", enable_deterministic_inference=True,
                    chunked_prefill_size=24) as chunked:
        got = asyncio.run(_scenarios(chunked, PROMPTS[:2], max_new_tokens=24, temperature=0))
    assert got["alone"] == alone[:2]
    assert got["together"] == alone[:2]


BF16 = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            intermediate_size=1024, vocab_size=4096, max_position_embeddings=2048, eos_token_id=0)


def _gpu_engine(**options: Any) -> sgl.Engine:
    return sgl.Engine(model_config=BF16, load_format="dummy", device="cuda", dtype="bfloat16",
                      max_total_tokens=16384, max_running_requests=16,
                      enable_deterministic_inference=True, **options)


def _gpu_prompts() -> list[list[int]]:
    g = _gen(4)
    return [torch.randint(1, 4096, (n,), generator=g).tolist() for n in (120, 7, 66, 200, 31)]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_gpu_engine_gives_a_request_the_same_bits_whatever_runs_beside_it(
        kv_cache_dtype: str) -> None:
    from test_gpu_engine import copy_weights
    from test_gpu_multi_token import _always_draft

    kw = dict(max_new_tokens=24, temperature=0, ignore_eos=True)
    ps = _gpu_prompts()
    e = _gpu_engine(kv_cache_dtype=kv_cache_dtype)
    try:
        kinds = _step_kinds(e)
        got = asyncio.run(_scenarios(e, ps, **kw))
        assert "mixed" not in kinds  # (decode rows in an extend step would take its kernel)
        alone = got["alone"]
        _assert_all_equal(got)
        # The same weights with prompts in 48-token chunks, and with every step verifying drafts
        # (replayed by the decode graphs, and eagerly as decode rows).
        spec = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=3)
        for options in (dict(chunked_prefill_size=48), spec, dict(spec, disable_cuda_graph=True)):
            other = _gpu_engine(kv_cache_dtype=kv_cache_dtype, **options)
            try:
                copy_weights(e, other)
                if "speculative_algorithm" in options:
                    _always_draft(other)
                outs = asyncio.run(_scenarios(other, ps[:2], **kw))["alone"]
                assert outs == alone[:2], options
            finally:
                other.close()
    finally:
        e.close()


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_bf16_structured_outputs_keep_their_tokens_with_jumps_and_drafts() -> None:
    """The default model in bf16 on CUDA: every structured case of tests/test_structured_real.py
    (schemas, regexes, EBNF, extraction prompts that do not name the keys) decoded at once,
    greedy: jump-forward off and n-gram speculation give jump-forward on's token ids. Without
    the option this held for 250 of 256 texts (docs/structured.md): the kernels' tiles followed
    each step's rows."""
    from test_structured_real import ALL_CASES

    model = os.environ.get("SGL_TEST_MODEL") or None

    async def go(engine: sgl.Engine, jump: bool) -> list[list[int] | None]:
        outs = await asyncio.gather(*(
            engine.generate(c.prompt, max_new_tokens=c.max_new_tokens, temperature=0,
                            jump_forward=jump, **c.options) for c in ALL_CASES),
            return_exceptions=True)
        return [None if isinstance(o, BaseException) else o.token_ids for o in outs]

    runs = {}
    for name, options in (("plain", {}), ("ngram", dict(speculative_algorithm="ngram"))):
        with sgl.Engine(model, device="cuda", enable_deterministic_inference=True,
                        max_total_tokens=65536, **options) as e:
            runs[name, True] = asyncio.run(go(e, True))
            if name == "plain":
                runs[name, False] = asyncio.run(go(e, False))
            else:
                assert e.stats().spec_accepted_tokens > 0
    on = runs["plain", True]
    assert sum(ids is not None for ids in on) >= len(ALL_CASES) - 2
    for other in (runs["plain", False], runs["ngram", True]):
        for case, a, b in zip(ALL_CASES, on, other):
            assert a == b, f"{case.name}: the tokens changed"
