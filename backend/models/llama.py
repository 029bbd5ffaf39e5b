"""Llama decoder (also the base of Qwen2 and Qwen3), written for serving.

Differences from the HF module tree, all for speed: q/k/v are one projection (`qkv_proj`)
and gate/up are one (`gate_up_proj`); the residual add is fused into the next RMSNorm call;
attention goes through the step's attention backend, which owns the KV cache. Variants set
three switches: `qkv_bias`, `o_bias`, `qk_norm` (per-head RMSNorm on q and k before RoPE).

Every layer runs the ops of one KernelSet (kernels/dispatch.py). A model is built on the
torch references unless given a set; the runtime resolves the engine's set once and hands it
over with `use_kernels`, after the weights are loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from sgl.backend.forward_batch import ForwardBatch
from sgl.backend.kernels.dispatch import KernelSet, resolve_kernels
from sgl.backend.layers.activation import SiluAndMul
from sgl.backend.layers.linear import Embedding, Linear, MergedLinear, pack_for_cpu
from sgl.backend.layers.norm import RMSNorm
from sgl.backend.layers.rotary import RotaryEmbedding, rope_parameters
from sgl.backend.quant.cpu_layer import MAX_ROWS as CPU_DECODE_ROWS
from sgl.backend.quant.cpu_layer import CpuDecodeStep

# HF projection name -> (our fused module, shard name)
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


# The layers that call kernels (each holds the model's KernelSet).
_KERNEL_LAYERS = (Linear, Embedding, RMSNorm, RotaryEmbedding, SiluAndMul)


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class Attention(nn.Module):
    def __init__(self, cfg: Any, layer_id: int, rotary: RotaryEmbedding, *, qkv_bias: bool,
                 o_bias: bool, qk_norm: bool, kernels: KernelSet, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads or self.num_heads
        self.head_dim = head_dim_of(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.rotary = rotary  # shared by all layers (one cos/sin cache)
        kw: dict[str, Any] = {"kernels": kernels, "device": device, "dtype": dtype}
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=qkv_bias, **kw,
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias, **kw)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, **kw) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, **kw) if qk_norm else None

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)  # [T, heads, head_dim]
        k = k.view(tokens, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        v = v.view(tokens, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # (the backend rotates q and k: on the GPU in the KV store's launch)
        out = fb.attn_backend.forward(q, k, v, self.layer_id, self.scale, fb, rotary=self.rotary)
        return self.o_proj(out.reshape(tokens, self.q_size))  # [T, hidden]


class MLP(nn.Module):
    def __init__(self, cfg: Any, *, bias: bool, kernels: KernelSet, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        kw: dict[str, Any] = {"kernels": kernels, "device": device, "dtype": dtype}
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": inter, "up": inter},
                                         bias=bias, **kw)
        self.act = SiluAndMul(kernels=kernels)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_id: int, rotary: RotaryEmbedding, *, qkv_bias: bool,
                 o_bias: bool, qk_norm: bool, mlp_bias: bool, kernels: KernelSet,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        kw: dict[str, Any] = {"kernels": kernels, "device": device, "dtype": dtype}
        self.self_attn = Attention(cfg, layer_id, rotary, qkv_bias=qkv_bias, o_bias=o_bias,
                                   qk_norm=qk_norm, **kw)
        self.mlp = MLP(cfg, bias=mlp_bias, **kw)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        # Pre-norm block; `residual` carries the stream so each add fuses into a norm call.
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, fb)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, *, max_positions: int, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, mlp_bias: bool, kernels: KernelSet, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        kw: dict[str, Any] = {"kernels": kernels, "device": device, "dtype": dtype}
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, **kw)
        self.rotary = RotaryEmbedding(head_dim_of(cfg), max_positions, rope_parameters(cfg), **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rotary, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm,
                         mlp_bias=mlp_bias, **kw)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        # The CPU decode step in one C call (quant/cpu_layer.py), set by `use_kernels` when
        # the model qualifies; the steps it declines run the layers below.
        self.cpu_decode: CpuDecodeStep | None = None

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(fb.input_ids)  # [T, hidden]
        if self.cpu_decode is not None:
            hidden = self.cpu_decode.run(x, fb)
            if hidden is not None:
                return hidden  # [T, hidden], final-normed
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, fb)
        if residual is None:  # a model with zero layers (tests only)
            return self.norm(x)
        x, _ = self.norm(x, residual)
        return x  # [T, hidden]


class LlamaForCausalLM(nn.Module):
    def __init__(self, hf_config: Any, *, device: torch.device, dtype: torch.dtype,
                 max_positions: int | None = None, kernels: KernelSet | None = None) -> None:
        super().__init__()
        self.config = hf_config
        if kernels is None:  # built by the loader: the references until `use_kernels`
            kernels = resolve_kernels("reference", device, dtype)
        self.kernels = kernels
        switches = self._variant(hf_config)
        self.model = LlamaModel(
            hf_config, max_positions=max_positions or hf_config.max_position_embeddings,
            kernels=kernels, device=device, dtype=dtype, **switches,
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens  # same Parameter, loaded once
        else:
            self.lm_head = Embedding(hf_config.vocab_size, hf_config.hidden_size,
                                     kernels=kernels, device=device, dtype=dtype)

    def use_kernels(self, kernels: KernelSet) -> None:
        """Run every layer on `kernels`, pack the linear weights for oneDNN when the set says
        so, and on the CPU's "auto" set describe a quantized model for the one-call decode
        step (quant/cpu_layer.py; it points at the weights as loaded, so: one-way, call once,
        after the weights are loaded)."""
        self.kernels = kernels
        for module in self.modules():
            if isinstance(module, _KERNEL_LAYERS):
                module.kernels = kernels
        if kernels.pack_linears:
            pack_for_cpu(self, self.lm_head, tied=self.tie_word_embeddings)
        self.model.cpu_decode = None
        if kernels.mode == "auto" and kernels.device.type == "cpu":
            self.model.cpu_decode = CpuDecodeStep.build(self.model)

    def cpu_decode_rows(self) -> int:
        """The most rows one step of the one-call CPU decode step takes (0: the model runs
        without it)."""
        return 0 if self.model.cpu_decode is None else CPU_DECODE_ROWS

    @staticmethod
    def _variant(cfg: Any) -> dict[str, bool]:
        """The switches of this architecture (subclasses override)."""
        bias = bool(getattr(cfg, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False,
                "mlp_bias": bool(getattr(cfg, "mlp_bias", False))}

    @torch.no_grad()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb)  # [T, hidden], final-normed

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [N, hidden] -> [N, vocab] float32 (samplers and logprobs want full precision). With
        # the one-call CPU decode step, on the thread count the step's head choice times.
        decode = self.model.cpu_decode
        if decode is not None:
            return decode.project_head(self.lm_head, hidden).float()
        return self.lm_head.project(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into our parameters; every one must arrive.

        Names are HF names (q/k/v and gate/up go into their fused slices) or our own.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        # What must still arrive: plain parameters by name, fused ones shard by shard.
        missing: set[str] = set()
        for name in params:
            owner = modules[name.rpartition(".")[0]]
            shards = owner.shard_slices if isinstance(owner, MergedLinear) else {"": None}
            missing.update(f"{name}:{shard}" if shard else name for shard in shards)
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue  # HF buffers, recomputed here
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding table is the head
            prefix, _, param_name = name.rpartition(".")
            parent, _, proj = prefix.rpartition(".")
            if proj in _FUSED:
                fused, shard = _FUSED[proj]
                module = modules[f"{parent}.{fused}"]
                assert isinstance(module, MergedLinear)
                module.load_shard(shard, param_name, tensor)
                missing.discard(f"{parent}.{fused}.{param_name}:{shard}")
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            target = params[name]
            if target.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                                 f"model shape {tuple(target.shape)}")
            target.copy_(tensor)
            missing.discard(name)
            owner = modules[prefix]
            if isinstance(owner, MergedLinear):  # our own fused name: every shard arrived
                missing.difference_update(f"{name}:{shard}" for shard in owner.shard_slices)
        if missing:
            raise KeyError(f"checkpoint lacks tensors: {sorted(missing)[:8]}"
                           f"{' ...' if len(missing) > 8 else ''}")
