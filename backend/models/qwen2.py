"""Qwen2: the Llama decoder with a bias on the q/k/v projections (not on o_proj)."""

from __future__ import annotations

from typing import Any

from sgl.backend.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def _variant(cfg: Any) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False, "mlp_bias": False}
