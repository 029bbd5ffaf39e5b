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


def compute_dtype(model_dtype: torch.dtype | None, kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype attention computes in over a pool of `kv_dtype`: the wider of the two (the
    pool's when no model dtype is given). A float8 pool is always widened, to the model's
    dtype or float32: torch promotes no float8 type, and SDPA takes none."""
    if kv_dtype.itemsize == 1:
        return torch.float32 if model_dtype is None else model_dtype
    return kv_dtype if model_dtype is None else torch.promote_types(model_dtype, kv_dtype)


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
