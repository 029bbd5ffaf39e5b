"""The pure-torch references compute exactly what transformers' Llama modules compute.

The CPU engine runs these references (kernels/dispatch.py), and the Triton kernels are tested
against them, so they must be the arithmetic of the model they serve: bit for bit equal to
transformers' LlamaRMSNorm, SwiGLU and rotary embedding, in float32 and in bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from sgl.backend.kernels import activation, rmsnorm, rotary


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 96), (2, 576), (1, 4096)])
def test_rmsnorm_reference_is_transformers(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Bit for bit transformers' LlamaRMSNorm (float32: through the reference's F.rms_norm
    fast path, which must stay exact; bfloat16: rounded before the weight multiplies)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = gen(1)
    x = (3 * torch.randn(*shape, generator=g)).to(dtype)
    hf = LlamaRMSNorm(shape[-1], eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.2 * torch.randn(shape[-1], generator=g))
        expected = hf(x)
    got = rmsnorm.rmsnorm_reference(x, hf.weight.detach(), 1e-5)
    assert got.dtype == dtype and torch.equal(got, expected)
    residual = torch.randn(*shape, generator=g).to(dtype)
    normed, summed = rmsnorm.fused_add_rmsnorm_reference(x, residual, hf.weight.detach(), 1e-5)
    assert torch.equal(summed, residual + x)  # transformers adds in the model's dtype
    with torch.no_grad():
        assert torch.equal(normed, hf(residual + x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_reference_is_transformers(dtype: torch.dtype) -> None:
    from transformers.activations import ACT2FN

    x = torch.randn(9, 2 * 300, generator=gen(3)).to(dtype)
    gate, up = x[:, :300], x[:, 300:]
    assert torch.equal(activation.silu_and_mul_reference(x), ACT2FN["silu"](gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions", [[0, 1, 2, 3], [7, 300, 4095, 8000, 12]])
def test_rotary_reference_is_transformers(dtype: torch.dtype, positions: list[int]) -> None:
    """Bit for bit transformers' Llama rotary (its cos/sin, rounded to the model dtype, and
    apply_rotary_pos_emb), from our cache built the way RotaryEmbedding builds it."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    heads, kv_heads, head_dim, theta = 4, 2, 64, 100000.0
    cfg = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=8192,
                      rope_parameters={"rope_type": "default", "rope_theta": theta})
    g = gen(4)
    tokens = len(positions)
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    pos = torch.tensor(positions)
    cos, sin = LlamaRotaryEmbedding(cfg)(q, pos[None])  # [1, T, head_dim] in q's dtype
    # transformers' layout: [batch, heads, T, head_dim]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache = rotary.make_cos_sin_cache(8192, head_dim, theta, dtype=dtype)
    got_q, got_k = rotary.rotary_embedding_reference(pos, q, k, cache)
    assert torch.equal(got_q, hf_q[0].transpose(0, 1))
    assert torch.equal(got_k, hf_k[0].transpose(0, 1))
    in_q, in_k = q.clone(), k.clone()  # in place: the same values, written into q and k
    rotary.rotary_embedding_reference(pos, in_q, in_k, cache, True)
    assert torch.equal(in_q, got_q) and torch.equal(in_k, got_k)
