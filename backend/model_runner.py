"""ModelRunner: turns a ScheduleBatch into device work and hands back a StepOutput.

`launch(batch)` is split in two halves so that the overlap loop can hide CPU work:

* `_prepare` (scheduler thread, CPU only): flatten the batch into ONE host int64 tensor
  (`PackedInputs`, in step_io.py: ids, positions, slots, lengths, table writes...), pinned
  on CUDA.
* `_execute` (the device's turn, in step order): one host->device copy of that tensor, apply
  the `req_to_token` writes, resolve future-token placeholders, run the model (a CUDA graph
  replay for DECODE batches that fit one), sample, write the sampled tokens into the future
  buffer, and start the copies of the small results into pinned host memory.

On CUDA `_execute` only enqueues work and never waits for the device: no `.item()`,
`.tolist()` or data-dependent branch on a device tensor; every decision is made from host
data in `_prepare`. A CUDA event recorded after the result copies marks completion, and
`StepHandle.result()` waits on it. On the CPU "the device" is a single worker thread: steps
still run strictly in order, and the scheduler thread prepares step N+1 while the worker
computes step N.

Future tokens: a sampled token of step N is an input of step N+1 before the CPU has seen it.
The scheduler writes `-k` as the input id, where `k` is the slot of `future_tokens` that step
N fills on the device; `_execute` replaces negative ids by `future_tokens[k]` on the device.

    CPU   | prepare N | (launch N) | process N-1 | prepare N+1 | (launch N+1) | process N |
    GPU         ...  step N-1 ...  |       step N ...                 |   step N+1 ...
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

import numpy as np
import torch

from sgl.backend.forward_batch import ForwardBatch, ForwardMode
from sgl.backend.req import ScheduleBatch
from sgl.backend.step_io import FutureRing, PackedInputs, PendingResult, PreparedStep, StepHandle


class ModelRunner:
    def __init__(self, model, kv_pool, req_pool, attn_backend, sampler, *, device: torch.device,
                 max_batch: int, vocab_size: int, overlap: bool, grammar=None) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.attn_backend = attn_backend
        self.sampler = sampler
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.vocab_size = vocab_size
        self.grammar = grammar  # a GrammarBackend (set on first constrained request) or None
        self.futures = FutureRing(2 * max_batch + 2)
        self.future_tokens = torch.zeros(self.futures.size, dtype=torch.int64, device=device)
        self._worker = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sgl-device")
            if overlap and device.type == "cpu"
            else None
        )
        self.graphs = None  # a cuda_graph.DecodeGraphs once captured (capture_cuda_graphs)
        # Debug mode: after applying a step's table writes, compare the device rows the step
        # reads with the host mirror (a device sync per step).
        self.verify_table = False
        # Fault injection for tests: called with the PreparedStep inside _execute.
        self.step_hook: Callable[[PreparedStep], None] | None = None
        # Benchmarks: (start event, end event, mode, batch size) per step when a list.
        self.step_events: list[tuple[Any, Any, ForwardMode, int]] | None = None

    def release_idle_memory(self) -> None:
        """The engine has been idle a while: free caches that only speed up running batches."""
        self.attn_backend.release_memory()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def free_memory(self) -> None:
        """The engine is closed and no step runs: give the weights, the KV pool and the CUDA
        graphs back, so that a process building engine after engine does not keep them all."""
        self.graphs = None
        self.attn_backend.release_memory()
        self.kv_pool.k_buffer.clear()
        self.kv_pool.v_buffer.clear()
        for module in self.model.modules():  # (to_empty cannot take oneDNN-packed weights)
            for name in list(module._parameters):
                module.register_parameter(name, None)
            for name in list(module._buffers):
                module.register_buffer(name, None)
            if hasattr(module, "packed_projection"):
                module.packed_projection = None
        if self.is_cuda:
            torch.cuda.empty_cache()

    def capture_cuda_graphs(self, max_bs: int) -> None:
        """Capture decode graphs for padded batch sizes up to `max_bs` (CUDA + Triton only)."""
        from sgl.backend.cuda_graph import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.kv_pool, self.req_pool, self.attn_backend,
                                   self.future_tokens, max_bs)
        self.graphs.capture()

    # -- launch ------------------------------------------------------------------------------

    def launch(self, batch: ScheduleBatch, sampling: Any) -> StepHandle:
        step = self._prepare(batch, sampling)
        if self._worker is not None:
            fut = self._worker.submit(lambda: self._execute(step).wait())
            return StepHandle(fut.result)
        pending = self._execute(step)
        return StepHandle(pending.wait)

    def _prepare(self, batch: ScheduleBatch, sampling: Any) -> PreparedStep:
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        future_idx: list[int] = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        pool_idx: list[int] = []
        seq_lens, prefix_lens, extend_lens, extend_start = [], [], [], []
        top_n, prompt_top_n, want_lp = 0, 0, False
        start = 0
        for it in batch.items:
            r = it.req
            n, prefix = it.extend_len, it.prefix_len
            ids.extend(it.input_ids)
            if n == 1:
                positions.append(prefix)
            else:
                positions.extend(range(prefix, prefix + n))
            pool_idx.append(r.req_pool_idx)
            seq_lens.append(prefix + n)
            prefix_lens.append(prefix)
            extend_lens.append(n)
            extend_start.append(start)
            if it.samples:
                sample_rows.append(start + n - 1)
                future_idx.append(it.future_index)
            if r.logprob.return_logprob:
                want_lp = True
                top_n = max(top_n, r.logprob.top_logprobs_num)
            first, count = it.prompt_logprob_span
            if count:
                prompt_top_n = max(prompt_top_n, r.logprob.top_logprobs_num)
                prompt_rows.extend(range(start + first - prefix, start + first - prefix + count))
                prompt_targets.extend(r.prompt_ids[first + 1 : first + 1 + count])
            start += n
        mode = ForwardMode.DECODE if batch.is_decode else ForwardMode.EXTEND
        vocab_mask = None
        if batch.has_constraints:
            # Constrained steps run synchronously (engine_loop.py): every matcher has accepted
            # its request's latest token, so the masks can be filled here on the CPU.
            from sgl.backend.grammar import allocate_bitmask

            states = [it.req.constraint for it in batch.items if it.samples]
            vocab_mask = allocate_bitmask(len(states), self.vocab_size)
            if not self.grammar.fill_bitmasks(states, vocab_mask):
                vocab_mask = None
        num_reqs = len(batch.items)
        out_cache_loc = batch.out_cache_loc.to(torch.int64).numpy()
        graph_bs = None
        if (mode is ForwardMode.DECODE and self.graphs is not None
                and len(sample_rows) == num_reqs and not prompt_rows):
            graph_bs = self.graphs.padded_size(num_reqs)
        if graph_bs is not None and graph_bs > num_reqs:
            # Padded rows: id 0 at position 0, KV written to the reserved slot 0, attending
            # through the reserved req_to_token row 0 over one key (slot 0). Harmless.
            pad = graph_bs - num_reqs
            ids = ids + [0] * pad
            positions = positions + [0] * pad
            out_cache_loc = np.concatenate([out_cache_loc, np.zeros(pad, dtype=np.int64)])
            pool_idx = pool_idx + [0] * pad
            graph_seq_lens = seq_lens + [1] * pad
        else:
            graph_seq_lens = seq_lens
        table_index, table_value = self._table_writes(batch.table_writes)
        table_check = None
        if self.verify_table:  # what the device rows must hold once this step's writes land
            host = self.req_pool.table
            table_check = [(it.req.req_pool_idx, host[it.req.req_pool_idx, : it.prefix_len + it.extend_len].clone())
                           for it in batch.items]
        packed = PackedInputs(
            [ids, positions, out_cache_loc, pool_idx, graph_seq_lens, prefix_lens, extend_lens,
             extend_start, sample_rows + prompt_rows, future_idx, prompt_targets, table_index,
             table_value],
            pin=self.is_cuda,
        )
        return PreparedStep(
            batch=batch,
            mode=mode,
            packed=packed,
            has_placeholders=any(i < 0 for i in ids),
            graph_bs=graph_bs,
            batch_size=num_reqs,
            num_tokens=start,
            seq_lens=seq_lens,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            num_samples=len(sample_rows),
            num_prompt_rows=len(prompt_rows),
            sampling=sampling,
            top_logprobs_num=top_n,
            prompt_top_logprobs_num=prompt_top_n,
            want_logprobs=want_lp,
            vocab_mask=vocab_mask,
            table_check=table_check,
        )

    def _table_writes(self, writes: list[tuple[int, int, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """(row, start, slots) writes -> flat indices into `req_to_token` and their values."""
        if not writes:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty
        width = self.req_pool.req_to_token.shape[1]
        # Decode writes one slot per request: this runs for every request of every step, so
        # it avoids per-write tensor calls (len() of a tensor alone costs ~1 us).
        lens = np.array([s.shape[0] for _, _, s in writes], dtype=np.int64)
        bases = np.array([row * width + col for row, col, _ in writes], dtype=np.int64)
        slots = [s for _, _, s in writes]
        values = np.asarray(torch.cat(slots) if len(slots) > 1 else slots[0], dtype=np.int64)
        if int(lens.max()) == 1:
            index = bases
        else:
            # flat[j] = base of its write + its offset inside that write
            offsets = np.arange(values.size, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
            index = np.repeat(bases, lens) + offsets
        return last_write_wins(index, values)

    # -- execute (device order) --------------------------------------------------------------

    def _execute(self, step: PreparedStep) -> PendingResult:
        with torch.inference_mode():
            dev = self.device
            timing = self.step_events is not None and self.is_cuda
            if timing:
                start_ev = torch.cuda.Event(enable_timing=True)
                start_ev.record()
            flat = step.packed.host.to(dev, non_blocking=True)  # [sum of field lengths]
            v = step.packed.views(flat)
            table = self.req_pool.req_to_token
            if v["table_index"].numel():
                # int64 -> int32 on the device; index_copy_ takes no host scalar (no sync).
                # Applied before anything that may fail: the writes include rows of requests
                # outside this step (radix swaps), which must land even if the step fails.
                table.view(-1).index_copy_(0, v["table_index"], v["table_value"].to(table.dtype))
            if step.table_check is not None:
                check_table_rows(table, step.table_check)
            if self.step_hook is not None:
                self.step_hook(step)
            if step.graph_bs is not None:
                assert self.graphs is not None
                logits = self.graphs.replay(flat, step.graph_bs, step.batch_size)  # [B, vocab]
            else:
                logits = self._forward_eager(step, v, table)
            if logits is None:
                pending = PendingResult()
            else:
                pending = self._sample_and_score(step, logits, v)
            if timing:
                end_ev = torch.cuda.Event(enable_timing=True)
                end_ev.record()
                self.step_events.append((start_ev, end_ev, step.mode, step.batch_size))
            return pending

    def _forward_eager(self, step: PreparedStep, v: dict[str, torch.Tensor],
                       table: torch.Tensor) -> torch.Tensor | None:
        input_ids = v["input_ids"]
        if step.has_placeholders:  # decided on the host: no device read
            input_ids = torch.where(input_ids < 0, self.future_tokens[(-input_ids).clamp(min=0)],
                                    input_ids)
        fb = ForwardBatch(
            mode=step.mode,
            batch_size=step.batch_size,
            input_ids=input_ids,
            positions=v["positions"],
            out_cache_loc=v["out_cache_loc"],
            req_pool_indices=v["req_pool_indices"],
            seq_lens=v["seq_lens"],
            extend_prefix_lens=v["extend_prefix_lens"],
            extend_seq_lens=v["extend_seq_lens"],
            extend_start=v["extend_start"],
            seq_lens_cpu=step.seq_lens,
            extend_prefix_lens_cpu=step.prefix_lens,
            extend_seq_lens_cpu=step.extend_lens,
            logits_indices=v["logits_indices"],
            req_to_token=table,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )
        self.attn_backend.prepare(fb)
        hidden = self.model.forward(fb)  # [T, hidden]
        num_rows = step.num_samples + step.num_prompt_rows
        if num_rows == 0:
            return None
        if step.mode is ForwardMode.DECODE and step.num_samples == step.num_tokens:
            rows = hidden  # every token is sampled, in order: skip the gather
        else:
            rows = hidden[fb.logits_indices]  # [S + P, hidden]
        return self.model.compute_logits(rows)  # [S + P, vocab] float32

    def _sample_and_score(self, step: PreparedStep, logits: torch.Tensor,
                          v: dict[str, torch.Tensor]) -> PendingResult:
        S = step.num_samples
        res = None
        if S:
            sample_logits = logits[:S]  # [S, vocab]
            mask = step.vocab_mask.to(self.device, non_blocking=True) if step.vocab_mask is not None else None
            res = self.sampler.sample(sample_logits, step.sampling, mask)
            self.future_tokens[v["future_indices"]] = res.next_token_ids
            self.sampler.observe(step.sampling, res.next_token_ids)
        out: dict[str, torch.Tensor | None] = {}
        if res is not None:
            out["tokens"] = res.next_token_ids
            if step.want_logprobs:
                out["logprobs"] = res.next_logprobs
                if step.top_logprobs_num and res.top_ids is not None:
                    out["top_ids"], out["top_vals"] = res.top_ids, res.top_vals
        if step.num_prompt_rows:
            from sgl.backend.sampler import gather_logprobs

            lp, top_ids, top_vals = gather_logprobs(logits[S:], v["prompt_targets"],
                                                    step.prompt_top_logprobs_num)
            out["prompt_lp"] = lp
            if step.prompt_top_logprobs_num:
                out["prompt_top_ids"], out["prompt_top_vals"] = top_ids, top_vals
        if not self.is_cuda:
            return PendingResult(None, **out)
        # Start the copies into pinned host memory; the event tells the host when they landed.
        host: dict[str, torch.Tensor | None] = {}
        for name, t in out.items():
            if t is not None:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                host[name] = h
        event = torch.cuda.Event()
        event.record()
        return PendingResult(event, **host)


def last_write_wins(index: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep only the last write to each `req_to_token` position, in list order.

    One batch can carry two writes to the same position: after a request's prefill,
    `cache_prompt` queues a rewrite of its row's prefix onto the tree's slots; if the request
    finishes before another step runs, the row is freed and the next request that gets it
    queues its own slots for the same columns, in the same batch. The host mirror applies
    writes in order (the last wins), but `index_copy_` on CUDA keeps an arbitrary one of
    duplicate indices, so the device row could point at the previous owner's slots: wrong
    keys, run to run nondeterministic, and only where the radix cache rewrote a row.
    """
    if index.size < 2:
        return index, values
    # np.unique on the reversed index: `first` is each position's last write in list order.
    unique, first = np.unique(index[::-1], return_index=True)
    if unique.size == index.size:
        return index, values
    keep = np.sort(index.size - 1 - first)
    return index[keep], values[keep]


def check_table_rows(table: torch.Tensor, expected: list[tuple[int, torch.Tensor]]) -> None:
    """Debug mode: the device `req_to_token` rows a step reads equal the host mirror's."""
    for row, want in expected:
        got = table[row, : want.shape[0]].to("cpu", torch.int64)
        if not torch.equal(got, want):
            col = int((got != want).nonzero()[0])
            raise AssertionError(
                f"req_to_token row {row} column {col} holds slot {int(got[col])} on the device "
                f"but {int(want[col])} on the host: a table write was lost or reordered")
