"""Rotary position embedding (the "rotate half" layout of HF Llama/Qwen checkpoints).

cos/sin are precomputed once for every position up to the context length, so a step only
gathers rows by `positions` (no trigonometry per step). Supported scalings: none ("default")
and Llama 3's frequency-dependent scaling ("llama3").
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from sgl.backend.kernels.dispatch import KernelSet
from sgl.backend.kernels.rotary import make_cos_sin_cache, rope_inv_freq


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """theta and scaling from a config of any transformers version.

    transformers 5 keeps everything in `rope_parameters` (theta included); 4.x used
    `rope_theta` plus an optional `rope_scaling` dict.
    """
    params: dict[str, Any] = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if legacy:
        params = {**legacy, **params}
    if "rope_theta" not in params:
        params["rope_theta"] = float(getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    inv_freq = rope_inv_freq(head_dim, float(params["rope_theta"]))  # [head_dim / 2]
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported (default, llama3)")


def _llama3_scale(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a ramp between."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # Between the two wavelengths: interpolate between scaled and unscaled frequencies.
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    ramp = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, ramp, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their token's position with the set's `rotary_embedding`."""

    def __init__(
        self, head_dim: int, max_positions: int, params: dict[str, Any], *, kernels: KernelSet,
        device: torch.device, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        # [max_positions, head_dim]: cos | sin, computed in float32 and kept in the model's
        # dtype, as transformers rounds them before rotating.
        cache = make_cos_sin_cache(max_positions, head_dim, inv_freq=_inv_freq(head_dim, params),
                                   device=device, dtype=dtype)
        # Kept as [max_positions, 2, head_dim / 2]: cos and sin of each position side by side.
        self.register_buffer("cos_sin", cache.view(max_positions, 2, -1), persistent=False)

    @property
    def table(self) -> torch.Tensor:
        """[max_positions, head_dim]: cos | sin of each position, the kernels' layout."""
        return self.cos_sin.view(self.cos_sin.shape[0], -1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim], k [T, kv_heads, head_dim] rotated *in place* (they are
        views of the fused qkv output, which nothing else reads); returns them."""
        return self.kernels.rotary_embedding(positions, q, k, self.table, True)
