"""The attention backend interface.

A model's attention layer computes q, k, v for the new tokens and hands them to the backend,
which (1) writes k and v into the KV pool at `fb.out_cache_loc` and (2) attends each new token
to its request's whole sequence: the cached prefix plus the new tokens up to itself (causal).

Implementations: `torch_backend.TorchAttentionBackend` (pure torch, the CPU path) and
`triton_backend.TritonAttentionBackend` (the Triton kernels of the engine's KernelSet). Both
receive exactly the same arguments; tests run each against the kernels' torch references.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from sgl.backend.forward_batch import ForwardBatch


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
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Store k/v for layer `layer_id` in the pool, then return the attention output."""

    def release_memory(self) -> None:
        """Free what the backend caches between steps and can rebuild (the engine is idle)."""
