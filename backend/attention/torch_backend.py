"""Pure-torch attention over the paged KV pool: the CPU path, and the backend that
attention_backend "auto" means wherever the kernel set is not Triton's.

It stores k/v with `kv_store_reference` and attends like `decode_attention_reference` /
`extend_attention_reference` (the Triton kernels' references), batched through SDPA;
tests/test_attention_torch.py checks it against those references.

Per step, `prepare` splits the requests in two groups and builds their gather indices once
(every layer reuses them):

- single-token rows (all of a DECODE step; decode requests riding along in an EXTEND step)
  are attended in one batched call: their sequences' KV is gathered into a padded
  [B, max_len] block with a key mask, and the G query heads that share a KV head are laid
  out as G queries of that head, so grouped-query attention needs no KV expansion:

      q [B, kv_heads, G, head_dim]  x  k [B, kv_heads, max_len, head_dim]  (mask [B,1,1,max_len])

- multi-token rows (prefill chunks) are attended per request; with a cached prefix the causal
  mask is aligned bottom-right (new query i sits at position prefix + i and sees keys
  0 .. prefix + i).

Softmax and accumulation run in float32 inside SDPA for every input dtype. A pool in a
narrower dtype than the model's (a 16-bit KV cache under a float32 model: `kv_cache_dtype`)
is widened as it is read, so attention computes in the wider of the two dtypes; widening
float16 or bfloat16 to float32 is exact.

With `fused_cpu` (the CPU engine in kernel mode "auto" under a float32 model, a float32,
float16 or bfloat16 pool, the C library built) every row runs `cpu_ops.decode_attention`
instead: one C call per layer that reads each request's keys in place from the pool through
its req_to_token row (no gather, no padded block, no stage memory), and new K/V rows are
stored by `cpu_ops.kv_store` first. A prompt chunk's tokens are query rows of that call too,
token i of a request with `prefix` cached tokens seeing keys 0 .. prefix + i (its own
included), so a token's attention has the same arithmetic whether it is prefilled, decoded,
verified or jumped. Otherwise, with
`stage_positions > 0` (the CPU engine) the single-token rows read their keys from a
`DecodeStage`, which keeps the padded block from one step to the next and copies in only what
changed (decode_stage.py); without it (the reference, and on GPUs) the block is gathered anew.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from sgl.backend.attention.base import AttentionBackend, compute_dtype
from sgl.backend.attention.decode_stage import DecodeStage, StagePlan
from sgl.backend.forward_batch import ForwardBatch, ForwardMode
from sgl.backend.kernels.kv_store import kv_store_reference
from sgl.backend.quant import cpu_ops

if TYPE_CHECKING:
    from sgl.backend.layers.rotary import RotaryEmbedding


@dataclass
class _DecodeRows:
    rows: torch.Tensor | None  # [B] rows of q holding the single-token queries; None: all rows
    slots: torch.Tensor  # [B * max_len] pool slots of each request's sequence, padded with 0
    key_mask: torch.Tensor  # [B, 1, 1, max_len] bool: True where the key is real
    batch: int
    max_len: int
    # A lone request whose slots are consecutive (a single stream usually is) reads its keys
    # as a view of the pool from this slot: no gather, no mask.
    contiguous_from: int | None = None
    # Gather targets [kv_heads, B * max_len, head_dim] for K and V, shared by all layers of the
    # step: fresh multi-MB tensors per layer would cost page faults on every call.
    k_out: torch.Tensor | None = None
    v_out: torch.Tensor | None = None
    stage: StagePlan | None = None  # read the keys from the DecodeStage instead of gathering


@dataclass
class _FusedDecodeRows:
    """Every row of the step, in order, a query row of `cpu_ops.decode_attention` (pool read
    in place): row t attends keys [0, lens[t]) of req_to_token row table_rows[t]."""

    table_rows: torch.Tensor  # [B] int64 rows of req_to_token
    lens: torch.Tensor  # [B] int64 keys per request (this step's token included)


@dataclass
class _ExtendRequest:
    start: int  # first row of this request's queries in q
    num_new: int
    slots: torch.Tensor  # [seq_len] pool slots of the whole sequence
    causal_mask: torch.Tensor | None  # [num_new, seq_len] bool; None: plain causal (no prefix)


@dataclass
class TorchAttentionMetadata:
    decode: _DecodeRows | _FusedDecodeRows | None
    extends: list[_ExtendRequest]


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, stage_positions: int = 0, fused_cpu: bool = False,
                 model_dtype: torch.dtype | None = None) -> None:
        # stage_positions: the DecodeStage's budget in token positions (0: no stage), used
        # where the fused path does not apply; fused_cpu: use cpu_ops where it applies (a
        # float32 model); model_dtype: the stage's compute dtype with the pool's (None: the pool's).
        self.stage = DecodeStage(stage_positions, model_dtype) if stage_positions > 0 else None
        self.fused_cpu = fused_cpu and cpu_ops.likely_available()

    def _fused(self, fb: ForwardBatch) -> bool:
        """The fused CPU path serves this pool (on the CPU, in a dtype the C ops take: float32,
        float16 or bfloat16; int32 table)."""
        like = fb.kv_pool.k_buffer[0]
        return (self.fused_cpu and like.device.type == "cpu"
                and cpu_ops.kv_dtype_supported(like.dtype)
                and like.is_contiguous() and fb.req_to_token.dtype == torch.int32
                and fb.req_to_token.is_contiguous() and cpu_ops.available())

    def fused_decode_rows(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(table_rows, lens) [B] int64 when `prepare` put this step, every row a single-token
        query in order, on the fused CPU path; None otherwise. The one-call CPU decode step
        (quant/cpu_layer.py) attends these itself, the way `_forward_fused` would."""
        meta = fb.attn_metadata
        if (fb.mode is ForwardMode.DECODE and isinstance(meta, TorchAttentionMetadata)
                and isinstance(meta.decode, _FusedDecodeRows)):
            return meta.decode.table_rows, meta.decode.lens
        return None

    def release_memory(self) -> None:
        if self.stage is not None:
            self.stage.release()

    def prepare(self, fb: ForwardBatch) -> None:
        fused = self._fused(fb)
        if fused and self.stage is not None:
            self.stage.release()  # (a no-op once released: the fused path never fills it)
        if fb.mode is ForwardMode.DECODE:
            if fused:
                decode: _DecodeRows | _FusedDecodeRows = _FusedDecodeRows(
                    fb.req_pool_indices.contiguous(), fb.seq_lens.contiguous())
            else:
                decode = self._decode_rows(fb, list(range(fb.batch_size)), True)
            fb.attn_metadata = TorchAttentionMetadata(decode, [])
            return
        if fused:  # every row, prompt tokens included, is a query row of the C op
            fb.attn_metadata = TorchAttentionMetadata(self._fused_extend_rows(fb), [])
            return
        single: list[int] = []
        extends: list[_ExtendRequest] = []
        # Rows are concatenated request by request, so starts follow from the host lengths
        # (no device sync to read fb.extend_start).
        starts = [0]
        for num_new in fb.extend_seq_lens_cpu[:-1]:
            starts.append(starts[-1] + num_new)
        for b, (num_new, prefix, seq_len) in enumerate(
            zip(fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu, fb.seq_lens_cpu)
        ):
            if num_new == 1:
                single.append(b)
                continue
            row = fb.req_to_token[fb.req_pool_indices[b], :seq_len].long()  # [seq_len]
            mask = None
            if prefix > 0:
                device = fb.req_to_token.device
                key_pos = torch.arange(seq_len, device=device)  # [seq_len]
                query_pos = torch.arange(prefix, seq_len, device=device)  # [num_new]
                mask = key_pos[None, :] <= query_pos[:, None]  # [num_new, seq_len]
            extends.append(_ExtendRequest(starts[b], num_new, row, mask))
        mixed = self._decode_rows(fb, single, False) if single else None
        if mixed is not None:
            mixed.rows = torch.tensor([starts[b] for b in single], device=fb.seq_lens.device)
        elif self.stage is not None:
            self.stage.reset()  # no request of the stage is in this step
        fb.attn_metadata = TorchAttentionMetadata(mixed, extends)

    @staticmethod
    def _fused_extend_rows(fb: ForwardBatch) -> _FusedDecodeRows:
        """An EXTEND step on the fused CPU path: each new token is a query row of its own
        (the one-call decode step's one_row_per_token), token i of a request with `prefix`
        cached tokens seeing keys 0 .. prefix + i. One C call per layer attends a prompt
        chunk's rows, in 0.44-0.48x the time of SDPA's CPU flash kernel on SmolLM2's 512-token
        chunks (which computes the causal block whole, its products on MKL's AVX2 path on AMD
        CPUs; bench/cpu_decode_attn.py --prefill)."""
        new = np.asarray(fb.extend_seq_lens_cpu, dtype=np.int64)
        ends = np.asarray(fb.seq_lens_cpu, dtype=np.int64)
        # lens of request b's rows: ends[b] - new[b] + 1 .. ends[b]
        first = np.repeat(ends - new + 1, new)
        lens = first + np.arange(new.sum()) - np.repeat(np.cumsum(new) - new, new)
        table_rows = torch.repeat_interleave(fb.req_pool_indices.long(), torch.from_numpy(new))
        return _FusedDecodeRows(table_rows, torch.from_numpy(lens))

    def _decode_rows(self, fb: ForwardBatch, reqs: list[int], every: bool) -> _DecodeRows:
        lens_cpu = [fb.seq_lens_cpu[b] for b in reqs]
        max_len = max(lens_cpu)
        if every:
            pool_idx, lens = fb.req_pool_indices, fb.seq_lens
        else:
            sel = torch.tensor(reqs, device=fb.seq_lens.device)
            pool_idx, lens = fb.req_pool_indices[sel], fb.seq_lens[sel]
        slots = fb.req_to_token[pool_idx, :max_len].long()  # [B, max_len]
        key_mask = torch.arange(max_len, device=slots.device)[None, :] < lens[:, None]
        # Padding keys read slot 0 (reserved, never allocated): any finite value, masked out.
        slots = slots.masked_fill(~key_mask, 0)
        contiguous_from = None
        if len(reqs) == 1 and slots.device.type == "cpu":  # reading it on a GPU would sync
            row = slots[0]
            if max_len == 1 or bool((row[1:] - row[:-1] == 1).all()):
                contiguous_from = int(row[0])
        like = fb.kv_pool.k_buffer[0]  # [num_slots, kv_heads, head_dim]
        stage = None
        if self.stage is not None:
            if contiguous_from is None:
                pool_rows = [int(r) for r in pool_idx.tolist()]  # host tensors: no sync
                stage = self.stage.plan(pool_rows, lens_cpu, slots, like, len(fb.kv_pool.k_buffer))
            else:
                self.stage.reset()  # the lone request reads a view; it leaves the stage
        k_out = v_out = None
        if contiguous_from is None and stage is None:
            shape = (like.shape[1], len(reqs) * max_len, like.shape[2])  # head-major
            k_out = torch.empty(shape, dtype=like.dtype, device=like.device)
            v_out = torch.empty(shape, dtype=like.dtype, device=like.device)
        return _DecodeRows(None, slots.view(-1), key_mask[:, None, None, :], len(reqs), max_len,
                           contiguous_from, k_out, v_out, stage)

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
        if rotary is not None:
            q, k = rotary(fb.positions, q, k)
        k_buffer = fb.kv_pool.k_buffer[layer_id]  # [num_slots, kv_heads, head_dim]
        v_buffer = fb.kv_pool.v_buffer[layer_id]
        meta: TorchAttentionMetadata = fb.attn_metadata
        if isinstance(meta.decode, _FusedDecodeRows):
            return self._forward_fused(q, k, v, k_buffer, v_buffer, scale, fb)
        kv_store_reference(k_buffer, v_buffer, k, v, fb.out_cache_loc)
        if meta.decode is not None and not meta.extends and meta.decode.rows is None:
            return self._attend_decode(q, k_buffer, v_buffer, meta.decode, layer_id, scale)
        out = torch.empty_like(q)
        if meta.decode is not None:
            rows = meta.decode.rows
            out[rows] = self._attend_decode(q[rows], k_buffer, v_buffer, meta.decode, layer_id,
                                            scale)
        self._attend_extends(q, k_buffer, v_buffer, meta.extends, scale, out)
        return out

    def _forward_fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_buffer: torch.Tensor, v_buffer: torch.Tensor, scale: float,
                       fb: ForwardBatch) -> torch.Tensor:  # [T, num_heads, head_dim]
        decode = fb.attn_metadata.decode
        assert isinstance(decode, _FusedDecodeRows)
        cpu_ops.kv_store(k_buffer, v_buffer, k, v, fb.out_cache_loc)
        dtype = q.dtype
        if not cpu_ops.decode_attention_supported(q, k_buffer, fb.req_to_token):
            # (a model whose q is not a plain float32 [T, heads, d] view: the C op reads a
            # float32 copy; the engine takes this path for float32 models only)
            q = q.float().contiguous()
        out = torch.empty(q.shape, dtype=q.dtype)  # [T, heads, head_dim]
        cpu_ops.decode_attention(q, k_buffer, v_buffer, fb.req_to_token, decode.table_rows,
                                 decode.lens, scale, None, out)
        return out.to(dtype)

    def _attend_extends(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                        extends: list[_ExtendRequest], scale: float, out: torch.Tensor) -> None:
        for req in extends:
            end = req.start + req.num_new
            out[req.start : end] = self._attend_extend(q[req.start : end], k_buffer, v_buffer,
                                                       req, scale)

    def _attend_decode(
        self,
        q: torch.Tensor,  # [B, heads, head_dim]
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        meta: _DecodeRows,
        layer_id: int,
        scale: float,
    ) -> torch.Tensor:  # [B, heads, head_dim]
        batch, heads, head_dim = q.shape
        kv_heads = k_buffer.shape[1]
        compute = compute_dtype(q.dtype, k_buffer.dtype)
        # [B, kv_heads, G, head_dim]: the G query heads of a KV head become G queries of it
        qg = q.reshape(batch, kv_heads, heads // kv_heads, head_dim).to(compute)
        if meta.stage is not None:
            assert self.stage is not None
            out = self.stage.attend(layer_id, qg, k_buffer, v_buffer, meta.stage, scale)
            return out.reshape(batch, heads, head_dim).to(q.dtype)
        shape = (batch, meta.max_len, kv_heads, head_dim)
        mask: torch.Tensor | None = meta.key_mask
        if meta.contiguous_from is not None:
            first, last = meta.contiguous_from, meta.contiguous_from + meta.max_len
            k = k_buffer[first:last].view(shape).transpose(1, 2)  # [1, kvh, L, d], a view
            v = v_buffer[first:last].view(shape).transpose(1, 2)
            mask = None  # every key is real
        else:
            # Gathered head by head into [kvh, B * L, d], so that each (request, head) matrix
            # [L, d] is contiguous for SDPA (a slot-major gather would leave its rows strided
            # by kvh * d, and SDPA would copy it again).
            for h in range(kv_heads):
                torch.index_select(k_buffer[:, h], 0, meta.slots, out=meta.k_out[h])
                torch.index_select(v_buffer[:, h], 0, meta.slots, out=meta.v_out[h])
            head_major = (kv_heads, batch, meta.max_len, head_dim)
            k = meta.k_out.view(head_major).transpose(0, 1)  # [B, kvh, L, d]
            v = meta.v_out.view(head_major).transpose(0, 1)  # [B, kvh, L, d]
        k, v = k.to(compute), v.to(compute)  # (no-ops unless the pool is narrower)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        return out.reshape(batch, heads, head_dim).to(q.dtype)  # [B, heads, head_dim]

    @staticmethod
    def _attend_extend(
        q: torch.Tensor,  # [n, heads, head_dim]
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        req: _ExtendRequest,
        scale: float,
    ) -> torch.Tensor:  # [n, heads, head_dim]
        # Batched 4-D inputs: with 3-D ones SDPA takes its unfused math path on the CPU
        # (scores materialized, several times slower).
        compute = compute_dtype(q.dtype, k_buffer.dtype)
        k = k_buffer.index_select(0, req.slots).transpose(0, 1)[None]  # [1, kv_heads, L, head_dim]
        v = v_buffer.index_select(0, req.slots).transpose(0, 1)[None]  # [1, kv_heads, L, head_dim]
        k, v = k.to(compute), v.to(compute)
        qh = q.transpose(0, 1)[None].to(compute)  # [1, heads, n, head_dim]
        gqa = q.shape[1] != k.shape[1]
        if req.causal_mask is None:
            out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale,
                                                 enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(qh, k, v, attn_mask=req.causal_mask,
                                                 scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1).to(q.dtype)  # [n, heads, head_dim]
