"""ForwardBatch: the device-side description of one model step.

Data flow (one type per stage)::

    Req (CPU, per request)  --scheduler-->  ScheduleBatch (CPU: which requests, how many tokens)
                            --prepare--->   ForwardBatch (device tensors + attention metadata)
                            --runner--->    StepOutput (sampled tokens, logprobs; copied to CPU)

A step is either EXTEND (some requests compute several new tokens: prefill, chunked prefill,
jump-forward; decode requests may ride along with one token each) or DECODE (every request
computes exactly one token; the GPU path replays a CUDA graph for these).

Token layout: the new tokens of all requests are concatenated request by request ("ragged").
For request b, tokens `extend_start[b] : extend_start[b] + extend_seq_lens[b]` of
`input_ids` are its new tokens; they sit at positions
`extend_prefix_lens[b] .. seq_lens[b] - 1` of the request's sequence, and their KV is written
to pool slots `out_cache_loc[...]`. The whole sequence's KV slots are
`req_to_token[req_pool_indices[b], :seq_lens[b]]`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sgl.backend.attention.base import AttentionBackend
    from sgl.backend.kv_pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = enum.auto()  # ragged new tokens over cached prefixes (decode rows allowed)
    DECODE = enum.auto()  # exactly one new token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: pool slot receiving each new token's KV
    req_pool_indices: torch.Tensor  # [B] int64: row of req_to_token
    seq_lens: torch.Tensor  # [B] int64: sequence length after this step
    extend_prefix_lens: torch.Tensor  # [B] int64: tokens already in the KV cache
    extend_seq_lens: torch.Tensor  # [B] int64: new tokens this step
    extend_start: torch.Tensor  # [B] int64: offset of request b's first new token in input_ids
    # Host copies of the per-request lengths (metadata building must not sync the device).
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    # Rows of the hidden states whose logits are needed: the last new token of every request
    # (for sampling), plus prompt positions when prompt logprobs are asked.
    logits_indices: torch.Tensor  # [L] int64
    req_to_token: torch.Tensor  # [max_reqs, max_context] int32, shared with the pool
    kv_pool: KVPool
    attn_backend: AttentionBackend
    attn_metadata: Any = None  # filled by attn_backend.prepare(self)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu) if self.seq_lens_cpu else 0
