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
    theta = float(params["rope_theta"])
    # [head_dim / 2]: one frequency per rotated pair
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
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
    def __init__(
        self, head_dim: int, max_positions: int, params: dict[str, Any], *,
        device: torch.device, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.half = head_dim // 2
        inv_freq = _inv_freq(head_dim, params)  # [head_dim / 2]
        # Positions times frequencies in float32 like the reference, then cast once.
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, 2, head_dim / 2]: cos and sin side by side, one gather per step
        cache = torch.stack([freqs.cos(), freqs.sin()], dim=1)
        self.register_buffer("cos_sin", cache.to(device=device, dtype=dtype), persistent=False)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate each x [T, heads, head_dim] by its token's position.

        CPU: returns new tensors. CUDA with (q, k): one Triton launch rotates both *in place*
        (they are views of the fused qkv output, which nothing else reads) and returns them.
        """
        if len(xs) == 2 and xs[0].is_cuda:
            from sgl.backend.kernels import dispatch  # lazy: the CPU path never imports triton

            # [P, 2, half] -> [P, head_dim]: cos | sin, the kernels' cache layout
            cache = self.cos_sin.view(self.cos_sin.shape[0], -1)
            return dispatch.rotary_embedding(positions, xs[0], xs[1], cache, inplace=True)
        cos_sin = self.cos_sin[positions]  # [T, 2, head_dim / 2]
        cos = cos_sin[:, 0].unsqueeze(1)  # [T, 1, head_dim / 2]
        sin = cos_sin[:, 1].unsqueeze(1)  # [T, 1, head_dim / 2]
        return tuple(self._rotate(x, cos, sin) for x in xs)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : self.half], x[..., self.half :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
