"""CUDA graphs for decode steps: the whole model forward plus the LM head, replayed.

An eager decode step of an 8B model launches ~500 kernels; on a machine with a high launch
cost that is milliseconds of CPU per step, longer than the GPU needs (a few ms). A graph
replays them all with one launch.

A graph row is one token that attends to the keys of its request up to itself: a decoding
request is one row; a request computing several tokens in one step (jump-forward's jumped
tokens, speculative verification, a short prompt) is one row per token, all on the request's
`req_to_token` row with growing `seq_lens` (causal by construction: every layer stores the
step's keys before attending). So the same graphs serve plain decoding and multi-token steps,
with the decode attention kernel (flash-decoding, the KV heads of a group read once).

Shapes must not change between capture and replay, so one graph is captured per *padded*
row count (`graph_batch_sizes`); a step of R rows replays the smallest graph >= R.

Static inputs (one int64 block, `inputs[5, max_bs]`, rows: the first five fields of
`step_io.StepInputs` laid out per token) are the only thing a replay changes::

    inputs[0, :bs]  input ids (may hold -k future placeholders: resolved inside the graph)
    inputs[1, :bs]  positions
    inputs[2, :bs]  out_cache_loc     (padded rows: 0, the pool's reserved slot)
    inputs[3, :bs]  req_pool_indices  (padded rows: 0, the reserved req_to_token row)
    inputs[4, :bs]  seq_lens = position + 1 (padded rows: 1, one key: slot 0)

Everything else the graph reads lives at fixed addresses: weights, the KV pool, the
`req_to_token` table (updated before the replay, outside the graph), and the future-token
buffer. The Triton decode attention's launch grid depends on (batch size, heads) only, not on
the sequence lengths (see attention/triton_backend.py), which is what makes it capturable.
Sampling stays outside the graph: its work depends on the requests' sampling settings.

All graphs share one memory pool; they are captured largest first, so the smaller ones reuse
the largest one's blocks (only one graph runs at a time).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch

from sgl.backend.forward_batch import ForwardBatch, ForwardMode
from sgl.backend.step_io import aligned

logger = logging.getLogger("sgl.engine")


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, then steps of 16: padding wastes <= 1/8 of a
    large batch, and each graph costs capture time and a little memory."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, max(max_bs, 1) + 16, 16))
    sizes = sorted({s for s in sizes if s < max_bs} | {max_bs})
    return sizes


@torch.inference_mode()
def capture_graphs(forward: Any, sizes: list[int], device: torch.device, graphs: dict[int, Any],
                   outputs: dict[int, torch.Tensor], pool: Any = None) -> tuple[Any, float]:
    """Capture `forward(bs)` for every size, largest first so that the smaller graphs reuse its
    blocks of the shared memory pool; returns (pool, seconds)."""
    t0 = time.monotonic()
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    for bs in reversed(sizes):
        # Warm up on the capture stream: Triton compiles, cuBLAS picks its kernels.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward(bs)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            outputs[bs] = forward(bs)
        graphs[bs] = graph
    torch.cuda.synchronize(device)
    return pool, time.monotonic() - t0


class DecodeGraphs:
    def __init__(self, model: Any, kv_pool: Any, req_pool: Any, attn_backend: Any,
                 future_tokens: torch.Tensor, max_bs: int) -> None:
        from sgl.backend.attention.triton_backend import TritonAttentionBackend

        if not isinstance(attn_backend, TritonAttentionBackend):
            raise ValueError("decode CUDA graphs need the Triton attention backend "
                             "(the torch backend's metadata depends on the sequence lengths)")
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token = req_pool.req_to_token
        self.attn_backend = attn_backend
        self.future_tokens = future_tokens  # [ring] int64, fixed address
        self.device = future_tokens.device
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.inputs = torch.zeros(5, self.max_bs, dtype=torch.int64, device=self.device)
        self.inputs[4].fill_(1)  # padded rows attend over one key
        # Unused by the decode kernels but part of a ForwardBatch; fixed tensors keep the
        # batch description complete.
        self._ones = torch.ones(self.max_bs, dtype=torch.int64, device=self.device)
        self._arange = torch.arange(self.max_bs, dtype=torch.int64, device=self.device)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bs -> logits [bs, vocab] float32
        self.capture_seconds = 0.0
        self.pool: Any = None  # the graphs' memory pool once captured

    def padded_size(self, batch_size: int) -> int | None:
        """The graph batch size serving `batch_size` requests, or None (run eagerly)."""
        if batch_size > self.max_bs or not self.graphs:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, batch_size)]

    def _forward(self, bs: int) -> torch.Tensor:  # -> logits [bs, vocab] float32
        raw = self.inputs[0, :bs]
        # Future placeholders (-k) resolve on the device, inside the graph.
        input_ids = torch.where(raw < 0, self.future_tokens[(-raw).clamp(min=0)], raw)
        fb = ForwardBatch(
            mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=input_ids,
            positions=self.inputs[1, :bs],
            out_cache_loc=self.inputs[2, :bs],
            req_pool_indices=self.inputs[3, :bs],
            seq_lens=self.inputs[4, :bs],
            # (seq_lens - 1, which every graph row's position is: step_io.one_row_per_token,
            # pad_decode_rows; a view, where a subtraction was a kernel in every replay)
            extend_prefix_lens=self.inputs[1, :bs],
            extend_seq_lens=self._ones[:bs],
            extend_start=self._arange[:bs],
            seq_lens_cpu=[1] * bs,  # not read by the Triton decode path
            extend_prefix_lens_cpu=[0] * bs,
            extend_seq_lens_cpu=[1] * bs,
            logits_indices=self._arange[:bs],
            req_to_token=self.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )
        self.attn_backend.prepare(fb)  # shape-only for DECODE
        hidden = self.model.forward(fb)  # [bs, hidden]
        return self.model.compute_logits(hidden)  # [bs, vocab]

    def capture(self) -> None:
        self.pool, self.capture_seconds = capture_graphs(self._forward, self.sizes, self.device,
                                                         self.graphs, self.outputs)
        logger.info("captured %d decode CUDA graphs (row counts %s) in %.1f s",
                    len(self.sizes), self.sizes, self.capture_seconds)

    def replay(self, packed: torch.Tensor, bs: int, rows: int) -> torch.Tensor:
        """packed: the step's device copy of `StepInputs` laid out for `bs` rows.
        Returns logits [rows, vocab] (a view of the graph's output: valid until the next
        replay, which stream order guarantees comes after this step's sampling)."""
        stride = aligned(bs)  # each packed field starts 16-byte aligned
        self.inputs[:, :bs].copy_(packed[: 5 * stride].view(5, stride)[:, :bs])
        self.graphs[bs].replay()
        return self.outputs[bs][:rows]
