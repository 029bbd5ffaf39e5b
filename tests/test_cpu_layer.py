"""The CPU decode step in one C call (backend/quant/cpu_layer.py) against the op-by-op CPU path
it replaces: hidden states and the KV written to the pool must be bitwise equal (torch.equal),
on random small quantized models of every variant (Llama tied, Qwen2 with q/k/v bias, 8-bit
projections) and on the real default model; the steps and models it does not take (prefill,
Qwen3's q/k norm, more than MAX_ROWS rows, float weights) run the op path."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from test_attention_torch import FakePool, Step, make_forward_batch
from test_models import TINY

from sgl.backend.attention.torch_backend import TorchAttentionBackend
from sgl.backend.forward_batch import ForwardMode
from sgl.backend.kernels.dispatch import resolve_kernels
from sgl.backend.models.registry import get_model_class, resolve_architecture
from sgl.backend.quant import cpu_kernel, cpu_layer
from sgl.backend.quant.cpu_threads import ThreadChoice
from sgl.backend.quant.install import _random_qweight, install_random_quantized
from sgl.backend.quant.weight import QuantizedWeight

pytestmark = pytest.mark.skipif(not cpu_kernel.available(),
                                reason="no C compiler or no AVX2/FMA: the op path serves")

CPU = torch.device("cpu")


def _config(name: str) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {
        "llama-tied": LlamaConfig(**TINY, tie_word_embeddings=True),
        "llama-8bit": LlamaConfig(**TINY, tie_word_embeddings=False),
        "llama-f16": LlamaConfig(**TINY, tie_word_embeddings=False),
        "qwen2-bias": Qwen2Config(**TINY, tie_word_embeddings=False),
        "qwen3": Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
    }[name]


def tiny_quantized(name: str, seed: int = 0) -> torch.nn.Module:
    """A random model of `name` with quantized projections, norms and biases not trivial,
    running the CPU "auto" kernel set (which builds its one-call decode step)."""
    cfg = _config(name)
    model = get_model_class(resolve_architecture(cfg))(cfg, device=CPU, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            scale = 0.2 if pname.endswith("norm.weight") else 0.1
            param.copy_((pname.endswith("norm.weight")) + scale * torch.randn(param.shape,
                                                                               generator=gen))
    install_random_quantized(model, seed)
    if name == "llama-8bit":  # Q8_0's layout: 8-bit groups of 32 (the C kernel's row8 path)
        for i, layer in enumerate(model.model.layers):
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                n, k = proj.qweight.shape
                proj.qweight = _random_qweight(n, k, 8, 32, CPU, 100 + i)
    if name == "llama-f16":  # float16 scale and zero (Q4_0/Q4_1/Q8_0 on the CPU, weight.py)
        _half_scales(model)
    model.use_kernels(resolve_kernels("auto", CPU, torch.float32))
    return model


def _half_scales(model: torch.nn.Module) -> None:
    """Every quantized weight's scale and zero rounded to float16 values, then kept as
    float16 (half_scales: exact now)."""
    for module in model.modules():
        w = getattr(module, "qweight", None)
        if isinstance(w, QuantizedWeight):
            rounded = dataclasses.replace(w, scale=w.scale.half().float(),
                                          zero=w.zero.half().float())
            module.qweight = rounded.half_scales()
            assert module.qweight.f16_scales


def _snapshot(pool: FakePool) -> list[torch.Tensor]:
    return [b.clone() for b in (*pool.k_buffer, *pool.v_buffer)]


def _decode_both_ways(model: torch.nn.Module, pool: FakePool, steps: list[Step]) -> None:
    """One DECODE step by the op path, then the same step (its KV slots wiped) by the one-call
    path: equal hidden states and equal pools."""
    backend = TorchAttentionBackend(fused_cpu=True)
    fb = make_forward_batch(pool, backend, steps, ForwardMode.DECODE)
    decoder = model.model.cpu_decode
    model.model.cpu_decode = None
    try:
        expected = model(fb)  # [T, hidden]
    finally:
        model.model.cpu_decode = decoder
    written = _snapshot(pool)
    for buffer in (*pool.k_buffer, *pool.v_buffer):
        buffer[fb.out_cache_loc] = 0.0
    x = model.model.embed_tokens(fb.input_ids)
    got = decoder.run(x, fb)
    assert got is not None, "the one-call step declined a decode step it should take"
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(pool), written))
    assert torch.equal(model(fb), expected)  # and through the model's forward


def _prefill(model: torch.nn.Module, pool: FakePool, prompts: list[list[int]]) -> None:
    backend = TorchAttentionBackend(fused_cpu=True)
    fb = make_forward_batch(pool, backend, [Step(i, 0, p) for i, p in enumerate(prompts)],
                            ForwardMode.EXTEND)
    x = model.model.embed_tokens(fb.input_ids)
    assert model.model.cpu_decode.run(x, fb) is None  # prefill: the op path
    model(fb)


def _pool(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> FakePool:
    attn = model.model.layers[0].self_attn
    return FakePool(len(model.model.layers), 2048, attn.num_kv_heads, attn.head_dim, dtype=dtype)


@pytest.fixture(params=[1, 3])
def threads(request: pytest.FixtureRequest) -> Any:
    """Steps alone (1) and shared with helper threads (3: more than this machine may have)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16,
                                      torch.float8_e4m3fn])
@pytest.mark.parametrize("name", ["llama-tied", "llama-8bit", "qwen2-bias", "llama-f16"])
def test_one_call_step_equals_the_op_path_bitwise(name: str, threads: int,
                                                  kv_dtype: torch.dtype) -> None:
    """Also over a 16- or 8-bit pool (kv_cache_dtype): both paths round on store and widen
    on read with the same C functions."""
    model = tiny_quantized(name)
    assert isinstance(model.model.cpu_decode, cpu_layer.CpuDecodeStep)
    model.model.cpu_decode.thread_choice.threads = lambda cap: cap  # (no timing trial)
    pool = _pool(model, kv_dtype)
    lengths = [5, 37, 12, 9, 20]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in lengths]
    _prefill(model, pool, prompts)
    # five requests (a team shares their attention a KV head's query heads at a time), then
    # the second alone (one query head at a time)
    for step in range(4):
        reqs = [0, 1, 2, 3, 4] if step < 3 else [1]
        _decode_both_ways(model, pool, [Step(i, lengths[i] + step, [(7 * step + i) % 96])
                                        for i in reqs])


def test_float16_scales_give_the_bits_of_float32_ones(threads: int) -> None:
    """The same weight values with float16 and with float32 scale and zero: the same step."""
    models = [tiny_quantized("llama-f16") for _ in range(2)]
    for module in models[1].modules():
        if isinstance(getattr(module, "qweight", None), QuantizedWeight):
            module.qweight = module.qweight.float_scales()
    models[1].use_kernels(resolve_kernels("auto", CPU, torch.float32))
    outs = []
    for model in models:
        model.model.cpu_decode.thread_choice.threads = lambda cap: cap  # (no timing trial)
        pool = _pool(model)
        _prefill(model, pool, [[1, 2, 3, 4, 5], [7, 8]])
        fb = make_forward_batch(pool, TorchAttentionBackend(fused_cpu=True),
                                [Step(0, 5, [9]), Step(1, 2, [10])], ForwardMode.DECODE)
        outs.append(model.model.cpu_decode.run(model.model.embed_tokens(fb.input_ids), fb))
    assert models[0].model.layers[0].mlp.down_proj.qweight.f16_scales
    assert not models[1].model.layers[0].mlp.down_proj.qweight.f16_scales
    assert outs[0] is not None and outs[1] is not None and torch.equal(outs[0], outs[1])


def test_more_rows_than_the_gemv_limit_take_the_op_path() -> None:
    model = tiny_quantized("llama-tied")
    pool = FakePool(len(model.model.layers), 4096, 2, 16, max_reqs=cpu_layer.MAX_ROWS + 1)
    rows = cpu_layer.MAX_ROWS + 1
    _prefill(model, pool, [[i % 96, 3] for i in range(rows)])
    fb = make_forward_batch(pool, TorchAttentionBackend(fused_cpu=True),
                            [Step(i, 2, [5]) for i in range(rows)], ForwardMode.DECODE)
    assert model.model.cpu_decode.run(model.model.embed_tokens(fb.input_ids), fb) is None
    # ... and at the limit it takes them.
    fb = make_forward_batch(pool, TorchAttentionBackend(fused_cpu=True),
                            [Step(i, 3, [6]) for i in range(rows - 1)], ForwardMode.DECODE)
    assert model.model.cpu_decode.run(model.model.embed_tokens(fb.input_ids), fb) is not None


def test_models_it_does_not_cover_keep_the_op_path() -> None:
    assert tiny_quantized("qwen3").model.cpu_decode is None  # per-head q/k norm
    cfg = _config("llama-tied")
    floats = get_model_class(resolve_architecture(cfg))(cfg, device=CPU, dtype=torch.float32)
    floats.use_kernels(resolve_kernels("auto", CPU, torch.float32))
    assert floats.model.cpu_decode is None  # float weights
    quant = tiny_quantized("llama-tied")
    quant.use_kernels(resolve_kernels("reference", CPU, torch.float32))
    assert quant.model.cpu_decode is None  # the reference kernel set


def test_the_op_path_attention_backend_is_declined() -> None:
    """A step prepared without the backend's fused CPU path (another pool layout) is not taken."""
    model = tiny_quantized("llama-tied")
    pool = _pool(model)
    _prefill(model, pool, [[1, 2, 3]])
    fb = make_forward_batch(pool, TorchAttentionBackend(fused_cpu=False), [Step(0, 3, [4])],
                            ForwardMode.DECODE)
    assert model.model.cpu_decode.run(model.model.embed_tokens(fb.input_ids), fb) is None


@pytest.mark.slow
def test_real_model_one_call_step_equals_the_op_path(threads: int) -> None:
    from sgl.backend.model_loader import load_model

    model, _ = load_model(None, device=CPU, dtype=torch.float32, quantization="gguf")
    model.use_kernels(resolve_kernels("auto", CPU, torch.float32))
    assert model.model.cpu_decode is not None
    model.model.cpu_decode.thread_choice.threads = lambda cap: cap  # (no timing trial)
    pool = _pool(model)
    gen = torch.Generator().manual_seed(2)
    lengths = [40, 9]
    _prefill(model, pool, [torch.randint(0, 49152, (n,), generator=gen).tolist()
                           for n in lengths])
    for step in range(3):
        _decode_both_ways(model, pool, [Step(i, lengths[i] + step, [100 + step * 7 + i])
                                        for i in range(2)])


def _trial(choice: ThreadChoice, cap: int, seconds: dict[int, float]) -> list[int]:
    """One trial's worth of steps with these per-count timings; the counts it ran."""
    ran = []
    for _ in range(ThreadChoice.TRIAL_STEPS):
        n = choice.threads(cap)
        choice.record(n, seconds[n])
        ran.append(n)
    return ran


@pytest.mark.parametrize("faster", [1, 4])
def test_thread_choice_keeps_the_faster_count_then_tries_again(faster: int) -> None:
    choice = ThreadChoice()
    slower = 4 if faster == 1 else 1
    ran = _trial(choice, 4, {faster: 0.01, slower: 0.02})
    assert sorted(set(ran)) == [1, 4] and ran.count(1) == ran.count(4)  # both, alternating
    assert choice.choice == faster
    assert {choice.threads(4) for _ in range(ThreadChoice.EXPLOIT_STEPS)} == {faster}
    # Then a new trial: the machine got busy, and the other count wins it.
    _trial(choice, 4, {faster: 0.05, 1 if faster == 4 else 4: 0.01})
    assert choice.choice != faster


def test_thread_choice_with_one_thread_or_a_new_budget() -> None:
    choice = ThreadChoice()
    assert {choice.threads(1) for _ in range(20)} == {1}  # nothing to try
    _trial(choice, 2, {1: 0.03, 2: 0.01})
    assert choice.choice == 2 and choice.threads(2) == 2
    assert choice.threads(3) in (1, 3)  # a new budget starts a new trial at once
    _trial(choice, 3, {1: 0.01, 3: 0.02})
    assert choice.choice == 1


@pytest.mark.parametrize("chosen", [1, 3])
def test_the_head_runs_on_the_threads_its_own_choice_picks(
        chosen: int, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_quantized("llama-tied")  # the tied table is quantized: the head is C too
    hidden = torch.randn(2, model.config.hidden_size)
    expected = model.lm_head.project(hidden)
    calls: list[int | None] = []
    qlinear = cpu_kernel.qlinear

    def recorded(x: torch.Tensor, w: QuantizedWeight, bias: Any, threads: int | None = None):
        calls.append(threads)
        return qlinear(x, w, bias, threads)

    monkeypatch.setattr(cpu_kernel, "qlinear", recorded)
    choice = model.model.cpu_decode.head_choice
    monkeypatch.setattr(choice, "threads", lambda cap: chosen)
    timed: list[int] = []
    monkeypatch.setattr(choice, "record", lambda threads, seconds: timed.append(threads))
    assert torch.equal(model.compute_logits(hidden), expected)  # any count: the same bits
    assert calls == [chosen] and timed == [chosen]
