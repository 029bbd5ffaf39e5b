"""Attention on the GPU with our Triton kernels (backend/kernels), over the token-indexed pool.

The kernels are the KernelSet's `kv_store`, `decode_attention` and `extend_attention`: the
Triton ones (`resolve_kernels` gives them in "auto" mode on CUDA and in "triton" mode; the
runtime builds this backend only with such a set).

Per step, `prepare` decides the launch shapes from host data only (no device sync):

- DECODE: the number of KV splits of flash-decoding, from the batch size and the KV head count
  only, never from the sequence lengths, so a CUDA graph captured at one (padded) batch size
  stays valid for every later step of that size. With a batch-invariant kernel set
  (`enable_deterministic_inference`) it is `DETERMINISTIC_KV_SPLITS` at every batch size: a
  row's splits then follow its own length only, so its bits do not depend on the step.
- EXTEND: the longest extend of the step (`max(fb.extend_seq_lens_cpu)`), which sizes the
  query-block axis of the extend grid. Decode rows riding along in an EXTEND step are simply
  requests with one new token.

`forward` writes k/v of the new tokens into layer `layer_id` of the pool at `fb.out_cache_loc`
(kv_store kernel; given the layer's rotary, q and k are rotated in the same launch:
rotary_kv_store), then attends (decode or extend kernel). The pool is duck-typed:
`fb.kv_pool.k_buffer[layer_id]`, `fb.kv_pool.v_buffer[layer_id]`, `[num_slots, kv_heads, dim]`.

CUDA-graph safety (DECODE only):
- captured: the kv_store and decode attention launches (one: stage 1 merges its splits).
  Their grids depend on (batch size, heads, num_kv_splits) only; everything data-dependent
  (seq_lens, req_pool_indices, out_cache_loc, req_to_token) is read on the device, so
  refilling those static input tensors before `replay()` is enough. Scratch tensors are
  allocated inside forward and come from the graph's private pool while capturing, at fixed
  addresses.
- Call `prepare` on the padded batch before capture; keep its metadata for replays
  (the metadata is shape-only for DECODE).
- Padded rows: give them seq_len 0 (output 0) or 1 with slot 0 (the pool's reserved slot) and
  out_cache_loc 0: both are harmless.
- Not graph-safe: EXTEND (its grid follows the step's longest extend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl.backend.attention.base import AttentionBackend
from sgl.backend.forward_batch import ForwardBatch, ForwardMode
from sgl.backend.kernels.triton_attention_decode import decode_num_kv_splits
from sgl.backend.kernels.dispatch import KernelSet

if TYPE_CHECKING:
    from sgl.backend.layers.rotary import RotaryEmbedding

# KV splits per decode row when the kernel set is batch-invariant: enough to keep a single
# stream's long context spread over the SMs; a short row leaves most of them empty (they exit).
DETERMINISTIC_KV_SPLITS = 16


@dataclass(frozen=True)
class TritonAttentionMetadata:
    mode: ForwardMode
    num_kv_splits: int  # DECODE: flash-decoding splits (shape-only, graph-safe)
    max_extend_len: int  # EXTEND: longest run of new tokens of one request this step


def _default_num_sms() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 8  # CPU (interpreter runs): only the split heuristic uses it


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, kernels: KernelSet, num_sms: int | None = None,
                 max_kv_splits: int = 32) -> None:
        self.kernels = kernels
        self.num_sms = num_sms if num_sms is not None else _default_num_sms()
        self.max_kv_splits = max_kv_splits

    def prepare(self, fb: ForwardBatch) -> None:
        if fb.mode is ForwardMode.DECODE:
            num_kv_heads = int(fb.kv_pool.k_buffer[0].shape[1])
            splits = DETERMINISTIC_KV_SPLITS if self.kernels.batch_invariant else (
                decode_num_kv_splits(fb.batch_size, num_kv_heads, self.num_sms, self.max_kv_splits))
            fb.attn_metadata = TritonAttentionMetadata(fb.mode, splits, 1)
        else:
            max_extend = max(fb.extend_seq_lens_cpu, default=0)
            fb.attn_metadata = TritonAttentionMetadata(fb.mode, 1, max_extend)

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
        meta = fb.attn_metadata
        if not isinstance(meta, TritonAttentionMetadata) or meta.mode is not fb.mode:
            self.prepare(fb)  # a caller that skipped prepare still gets right answers
            meta = fb.attn_metadata
        k_buffer = fb.kv_pool.k_buffer[layer_id]  # [num_slots, kv_heads, head_dim]
        v_buffer = fb.kv_pool.v_buffer[layer_id]
        # Store first: the attention kernels then read every key, old or new, from the pool.
        if rotary is not None:  # rotated and stored in one launch
            q = self.kernels.rotary_kv_store(fb.positions, q, k, v, rotary.table, k_buffer,
                                             v_buffer, fb.out_cache_loc)
        else:
            self.kernels.kv_store(k_buffer, v_buffer, k, v, fb.out_cache_loc)
        if fb.mode is ForwardMode.DECODE:
            return self.kernels.decode_attention(
                q, k_buffer, v_buffer, fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                scale, meta.num_kv_splits,
            )
        return self.kernels.extend_attention(
            q, k_buffer, v_buffer, fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
            fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start, scale,
            max_extend_len=meta.max_extend_len,
        )
