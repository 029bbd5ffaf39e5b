"""The attention backend interface.

A model's attention layer computes q, k, v for the new tokens and hands them to the backend,
which (1) writes k and v into the KV pool at `fb.out_cache_loc` and (2) attends each new token
to its request's whole sequence: the cached prefix plus the new tokens up to itself (causal).
Given the layer's `rotary`, q and k arrive unrotated and the backend rotates them first (the
Triton backend in the same launch as the KV store: kernels/rotary.py, `rotary_kv_store`).

Implementations: `torch_backend.TorchAttentionBackend` (pure torch, the CPU path) and
`triton_backend.TritonAttentionBackend` (the Triton kernels of the engine's KernelSet). Both
receive exactly the same arguments; tests run each against the kernels' torch references.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from sgl.backend.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from sgl.backend.layers.rotary import RotaryEmbedding


class AttentionBackend(ABC):
    @abstractmethod
    def prepare(self, fb: ForwardBatch) -> None:
        """Build per-step metadata (index tensors, splits) into `fb.attn_metadata`.

        Called once per step before the model runs; the layers then reuse it.
        """

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        layer_id: int,
        scale: float,
        fb: ForwardBatch,
        rotary: RotaryEmbedding | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Rotate q and k by `fb.positions` when given `rotary`, store k/v for layer `layer_id`
        in the pool, then return the attention output."""

    def release_memory(self) -> None:
        """Free what the backend caches between steps and can rebuild (the engine is idle)."""
