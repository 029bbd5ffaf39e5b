"""Qwen3: the Llama decoder with per-head RMSNorm on q and k (before RoPE), no q/k/v bias."""

from __future__ import annotations

from typing import Any

from sgl.backend.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def _variant(cfg: Any) -> dict[str, bool]:
        bias = bool(getattr(cfg, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True, "mlp_bias": False}
