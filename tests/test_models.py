"""Our model implementations against transformers' on the same weights.

Tiny random configs (2 layers, hidden 64) in float32; logits must agree within 1e-4 for a
full prefill, a prefill in two chunks (the second over a cached prefix, batched with decode
rows), and token-by-token batched decode of requests of different lengths.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_attention_torch import FakePool, Step, make_forward_batch

from sgl.backend.attention.torch_backend import TorchAttentionBackend
from sgl.backend.forward_batch import ForwardMode
from sgl.backend.kernels import onednn_linear
from sgl.backend.layers.linear import pack_for_cpu
from sgl.backend.models.registry import get_model_class, resolve_architecture

VOCAB = 96
TINY: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}


def _hf_configs() -> dict[str, Any]:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    llama3_rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
    return {
        "llama": LlamaConfig(**TINY, rope_parameters={"rope_type": "default",
                                                      "rope_theta": 10000.0}),
        "llama-tied-llama3-rope": LlamaConfig(**TINY, tie_word_embeddings=True,
                                              rope_parameters=llama3_rope),
        "qwen2": Qwen2Config(**TINY, tie_word_embeddings=False),
        # head_dim 32 != hidden / heads: the q/k/v sizes must come from head_dim
        "qwen3": Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
    }


CONFIG_NAMES = ["llama", "llama-tied-llama3-rope", "qwen2", "qwen3"]
# Each config twice: plain weights (F.linear, the reference) and weights packed for oneDNN
# (the CPU engine's default, layers/linear.py:pack_for_cpu).
PACKED = onednn_linear.available(torch.device("cpu"), torch.float32)
VARIANTS = [(name, False) for name in CONFIG_NAMES] + [(name, True) for name in CONFIG_NAMES]


@pytest.fixture(scope="module", params=VARIANTS,
                ids=[f"{name}-{'packed' if packed else 'plain'}" for name, packed in VARIANTS])
def models(request: pytest.FixtureRequest) -> tuple[Any, torch.nn.Module]:
    """(transformers model, our model) sharing random weights, norms and biases included."""
    import transformers

    name, packed = request.param
    if packed and not PACKED:
        pytest.skip("this torch build has no oneDNN linear")
    cfg = _hf_configs()[name]
    cfg._attn_implementation = "eager"  # an independent reference path
    torch.manual_seed(0)
    hf_model = getattr(transformers, resolve_architecture(cfg))(cfg).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))  # not all ones: norms matter
            else:
                param.copy_(0.15 * torch.randn_like(param))  # biases too
        if cfg.tie_word_embeddings:
            assert hf_model.lm_head.weight is hf_model.model.embed_tokens.weight
    ours = get_model_class(resolve_architecture(cfg))(cfg, device=torch.device("cpu"),
                                                      dtype=torch.float32)
    ours.load_weights(hf_model.state_dict().items())
    if packed:
        pack_for_cpu(ours, ours.lm_head, tied=ours.tie_word_embeddings)
        assert ours.lm_head.weight.is_mkldnn != ours.tie_word_embeddings
        assert ours.model.layers[0].mlp.down_proj.weight.is_mkldnn
    return hf_model, ours


def _hf_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()  # [len, vocab]


def _pool(model: torch.nn.Module) -> FakePool:
    attn = model.model.layers[0].self_attn
    return FakePool(len(model.model.layers), 2048, attn.num_kv_heads, attn.head_dim)


def _run(model: torch.nn.Module, pool: FakePool, steps: list[Step],
         mode: ForwardMode) -> list[torch.Tensor]:
    """One step; returns each request's logits for its new tokens."""
    fb = make_forward_batch(pool, TorchAttentionBackend(), steps, mode)
    logits = model.compute_logits(model(fb))  # [T, vocab]
    assert logits.dtype == torch.float32
    assert logits.shape == (fb.num_tokens, model.config.vocab_size)
    bounds = fb.extend_start.tolist()
    return [logits[s : s + len(st.new_ids)] for s, st in zip(bounds, steps)]


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def test_full_prefill_batched(models: tuple[Any, torch.nn.Module]) -> None:
    hf_model, ours = models
    prompts = _prompts(1, [13, 1, 30, 7])
    steps = [Step(i + 1, 0, p) for i, p in enumerate(prompts)]
    for got, prompt in zip(_run(ours, _pool(ours), steps, ForwardMode.EXTEND), prompts):
        torch.testing.assert_close(got, _hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)


def test_prefill_in_two_chunks(models: tuple[Any, torch.nn.Module]) -> None:
    hf_model, ours = models
    pool = _pool(ours)
    a, b, c = _prompts(2, [25, 18, 9])
    # Step 1: first chunks of a and b, all of c. Step 2: rest of a and b over the cached
    # prefix, plus c's next token as a decode row riding along.
    _run(ours, pool, [Step(1, 0, a[:10]), Step(2, 0, b[:17]), Step(3, 0, c)], ForwardMode.EXTEND)
    c_next = 5
    got = _run(ours, pool, [Step(1, 10, a[10:]), Step(2, 17, b[17:]), Step(3, 9, [c_next])],
               ForwardMode.EXTEND)
    torch.testing.assert_close(got[0], _hf_logits(hf_model, a)[10:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], _hf_logits(hf_model, b)[17:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[2], _hf_logits(hf_model, c + [c_next])[9:], atol=1e-4,
                               rtol=1e-4)


def test_batched_decode(models: tuple[Any, torch.nn.Module]) -> None:
    hf_model, ours = models
    pool = _pool(ours)
    prompts = _prompts(3, [4, 19, 1, 11])
    first = _run(ours, pool, [Step(i + 1, 0, p) for i, p in enumerate(prompts)],
                 ForwardMode.EXTEND)
    seqs = [list(p) for p in prompts]
    next_ids = [int(lg[-1].argmax()) for lg in first]
    for _ in range(5):  # greedy decode, all requests in one DECODE step each time
        steps = [Step(i + 1, len(s), [t]) for i, (s, t) in enumerate(zip(seqs, next_ids))]
        got = _run(ours, pool, steps, ForwardMode.DECODE)
        for seq, token in zip(seqs, next_ids):
            seq.append(token)
        for seq, logits in zip(seqs, got):
            torch.testing.assert_close(logits[0], _hf_logits(hf_model, seq)[-1], atol=1e-4,
                                       rtol=1e-4)
        next_ids = [int(lg[0].argmax()) for lg in got]


def test_load_weights_rejects_missing_and_unknown_tensors(
    models: tuple[Any, torch.nn.Module],
) -> None:
    hf_model, ours = models
    if ours.model.layers[0].mlp.down_proj.weight.is_mkldnn:
        pytest.skip("weights load into plain tensors; packing comes after loading")
    state = dict(hf_model.state_dict())
    with pytest.raises(KeyError, match="lacks"):
        ours.load_weights((k, v) for k, v in state.items() if "layers.1.mlp.up_proj" not in k)
    with pytest.raises(KeyError, match="no place"):
        ours.load_weights([*state.items(), ("model.layers.0.mystery.weight", torch.zeros(1))])
    ours.load_weights(state.items())  # restore for the other tests of this module


@pytest.mark.slow
def test_default_model_prefill_matches_transformers() -> None:
    """The real SmolLM2 weights (dequantized GGUF): ours vs transformers' LlamaForCausalLM."""
    import transformers

    from sgl.backend.model_loader import load_model, resolve_model_path
    from sgl.backend.tokenizer import load_tokenizer

    ours, config = load_model(None, device=torch.device("cpu"), dtype=torch.float32)
    tok = load_tokenizer(resolve_model_path(None))
    ids = tok("The capital of France is Paris. The capital of Italy is")["input_ids"]
    with torch.device("meta"):  # skip transformers' random init; the weights come next
        hf_model = transformers.LlamaForCausalLM(config.hf_config).eval()
    hf_model.load_state_dict(_unfused(ours, config), strict=True, assign=True)
    # The rotary buffers are not in the state dict: rebuild them off the meta device.
    hf_model.model.rotary_emb = type(hf_model.model.rotary_emb)(config.hf_config)
    expected = _hf_logits(hf_model, ids)
    got = _run_any(ours, ids)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
    assert tok.decode(int(got[-1].argmax())).strip() == "Rome"


def _unfused(ours: torch.nn.Module, config: Any) -> dict[str, torch.Tensor]:
    """Our fused parameters split back into HF names (the same dequantized values)."""
    state: dict[str, torch.Tensor] = {}
    for name, param in ours.named_parameters():
        if ".qkv_proj." in name:
            q_size = config.num_heads * config.head_dim
            kv_size = config.num_kv_heads * config.head_dim
            for part, t in zip("qkv", param.split([q_size, kv_size, kv_size])):
                state[name.replace("qkv_proj", f"{part}_proj")] = t
        elif ".gate_up_proj." in name:
            for part, t in zip(("gate", "up"), param.chunk(2)):
                state[name.replace("gate_up_proj", f"{part}_proj")] = t
        else:
            state[name] = param
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def _run_any(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return _run(model, _pool(model), [Step(1, 0, ids)], ForwardMode.EXTEND)[0]
