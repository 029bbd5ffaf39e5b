"""ModelRunner: turns a ScheduleBatch into device work and hands back a StepOutput.

`run(batch)` is `launch(batch).result()`; `launch` is split in two halves so that the
overlap loop can hide CPU work:

* `prepare` (scheduler thread, CPU only): flatten the batch into named `StepInputs` (in
  step_io.py: ids, positions, slots, lengths, table writes...) packed into ONE host int64
  tensor, pinned on CUDA; build the sampling info, grammar masks and logprob plan.
* `_execute` (the device's turn, in step order): one host->device copy of that tensor, apply
  the `req_to_token` writes, resolve future-token placeholders, run the model (a CUDA graph
  replay when the step's tokens fit one: a graph row per token, cuda_graph.py), sample, write
  the sampled tokens into the future buffer, and start the copies of the small results into
  pinned host memory. It is `_forward_part` then `_finish_part`; a deferred step (grammar
  masks that wait for the previous step's update) runs them apart.

On CUDA `_execute` only enqueues work and never waits for the device: no `.item()`,
`.tolist()` or data-dependent branch on a device tensor; every decision is made from host
data in `prepare`. A CUDA event recorded after the result copies marks completion, and
`StepHandle.result()` waits on it. On the CPU "the device" is a single worker thread: steps
still run strictly in order, and the scheduler thread prepares step N+1 while the worker
computes step N.

Future tokens: a sampled token of step N is an input of step N+1 before the CPU has seen it.
The scheduler writes `-k` as the input id, where `k` is the slot of `future_tokens` that step
N fills on the device; `_execute` replaces negative ids by `future_tokens[k]` on the device.

    CPU   | prepare N | (launch N) | update N-1 | prepare N+1 | (launch N+1) | update N |
    GPU         ...  step N-1 ...  |       step N ...                 |   step N+1 ...
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from sgl.backend.forward_batch import ForwardBatch, ForwardMode
from sgl.backend.grammar_masks import DeferredMaskFill
from sgl.backend.req import ScheduleBatch
from sgl.backend.speculative import draft_states
from sgl.backend.step_io import (
    ALIGN,
    FutureRing,
    StepHandle,
    StepInputs,
    StepOutput,
    StepPlan,
    StepResult,
    check_table_rows,
    flatten_batch,
    last_write_wins,
    one_row_per_token,
    pad_decode_rows,
    writes_overlap,
)

if TYPE_CHECKING:
    from sgl.backend.attention.base import AttentionBackend
    from sgl.backend.grammar import GrammarBackend
    from sgl.backend.grammar_masks import MaskFill
    from sgl.backend.kv_pool import KVPool, ReqToTokenPool
    from sgl.backend.sampler import Sampler


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_pool: KVPool, req_pool: ReqToTokenPool,
                 attn_backend: AttentionBackend, sampler: Sampler, *, device: torch.device,
                 max_batch: int, vocab_size: int, overlap: bool) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.attn_backend = attn_backend
        self.sampler = sampler
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.is_cpu = device.type == "cpu"
        self._align = 1 if self.is_cpu else ALIGN  # packed fields' alignment (step_io.py)
        self.vocab_size = vocab_size
        self.grammar: GrammarBackend | None = None  # set by the runtime on first constrained request
        # Only the overlap loop schedules a step before the previous one's tokens are known,
        # so only it reads the future-token buffer (the plain loop skips writing it).
        self.overlap = overlap
        self.futures = FutureRing(2 * max_batch + 2)
        self.future_tokens = torch.zeros(self.futures.size, dtype=torch.int64, device=device)
        self._worker = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sgl-device")
            if overlap and device.type == "cpu"
            else None
        )
        self.graphs = None  # a cuda_graph.DecodeGraphs once captured (capture_cuda_graphs)
        self._unstarted: list[DeferredMaskFill] = []  # the CPU worker's deferred masks (see close)
        # Debug mode: after applying a step's table writes, compare the device rows the step
        # reads with the host mirror (a device sync per step).
        self.verify_table = False
        # Fault injection for tests: called with the PreparedStep inside _execute.
        self.step_hook: Callable[[PreparedStep], None] | None = None
        # `enable_deterministic_inference`: a step past the prompts (decode, jumped tokens,
        # drafts) always runs as decode rows, one per token, also where no graph replays it, so
        # that every token after a prompt gets the decode kernel's arithmetic.
        self.decode_rows_past_prompts = False
        # Benchmarks: (start event, end event, mode, batch size) per step when a list.
        self.step_events: list[tuple[Any, Any, ForwardMode, int]] | None = None

    def release_idle_memory(self) -> None:
        """The engine has been idle a while: free caches that only speed up running batches."""
        self.attn_backend.release_memory()

    def close(self) -> None:
        if self._worker is not None:
            # A deferred step whose masks the loop never started (it stopped on a bug) would
            # keep the device worker waiting, and this shutdown with it: start them.
            for masks in self._unstarted:
                masks.start()
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

    def capture_cuda_graphs(self, max_rows: int) -> None:
        """Capture decode graphs for padded row counts up to `max_rows` (CUDA + Triton only):
        a row is a decoding request, or one token of a request computing several."""
        from sgl.backend.cuda_graph import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.kv_pool, self.req_pool, self.attn_backend,
                                   self.future_tokens, max_rows)
        self.graphs.capture()

    # -- launch ------------------------------------------------------------------------------

    def run(self, batch: ScheduleBatch) -> StepOutput:
        """One step, waited for (tests and the plain loop's callers that need no overlap)."""
        return self.launch(batch).result()

    def launch(self, batch: ScheduleBatch, defer_masks: bool = False) -> StepHandle:
        """`start(prepare(batch, defer_masks))`. Raises only when preparing fails (nothing
        was started then)."""
        return self.start(self.prepare(batch, defer_masks))

    def start(self, step: PreparedStep) -> StepHandle:
        """Start a prepared step's device work; a handle to its result."""
        deferred = step.vocab_mask if isinstance(step.vocab_mask, DeferredMaskFill) else None
        if self._worker is not None:
            if deferred is not None:
                self._unstarted = [m for m in self._unstarted if not m.started] + [deferred]
            fut = self._worker.submit(lambda: self._execute(step).wait())
            return StepHandle(fut.result, masks=deferred)
        if deferred is None:
            return StepHandle(self._execute(step).wait)
        forwarded = self._forward_part(step)
        return StepHandle(None, masks=deferred, finish=lambda: self._finish_part(step, forwarded).wait)

    def prepare(self, batch: ScheduleBatch, defer_masks: bool = False) -> PreparedStep:
        """The step's host work (inputs, sampling settings, grammar masks), nothing enqueued.

        `defer_masks`: a step is still in flight before this one (the overlap loop), whose
        tokens the scheduler has not applied yet. This step's grammar masks are then filled
        only when the handle's `start_masks()` is called, and on CUDA its sampling is enqueued
        by `resume()` (the caller resumes the step ahead before starting this one)."""
        inputs, plan = flatten_batch(batch)
        mode = ForwardMode.DECODE if batch.is_decode else ForwardMode.EXTEND
        rows = plan.num_tokens
        graph_bs = None
        row_seq_lens = None
        # Prompts are prefilled eagerly (the extend kernel; the same numerics with and without
        # graphs); steps past the prompts (decode, jumped tokens, drafts) replay a graph.
        past_prompts = batch.is_decode or all(
            it.prefix_len >= len(it.req.prompt_ids) for it in batch.items)
        if self.graphs is not None and past_prompts:
            graph_bs = self.graphs.padded_size(rows)
        if graph_bs is not None:
            if mode is ForwardMode.EXTEND:  # several tokens of a request: one graph row each
                one_row_per_token(inputs)
            if graph_bs > rows:
                pad_decode_rows(inputs, graph_bs - rows)
        elif mode is ForwardMode.EXTEND and (rows <= self._cpu_decode_rows() or (
                self.decode_rows_past_prompts and past_prompts)):
            # The CPU's one-call decode step takes several tokens of a request (verify rows,
            # jumped tokens, and short prefills: a chat turn after its cached prefix) the way
            # the decode graphs do, one row per token: without it they ran the op path, at
            # twice a decode row's cost, and speculation lost to plain decoding.
            one_row_per_token(inputs)
            mode, row_seq_lens = ForwardMode.DECODE, list(inputs.seq_lens)
        writes = self._table_writes(batch.table_writes)
        inputs.table_index, inputs.table_value = writes
        packed, lengths = inputs.pack(pin=self.is_cuda, align=self._align)
        return PreparedStep(
            batch=batch, mode=mode, packed=packed, lengths=lengths, plan=plan, graph_bs=graph_bs,
            table_writes=writes,
            row_seq_lens=row_seq_lens,
            sampling=self.sampler.build_for(batch),
            vocab_mask=self._grammar_masks(batch, defer_masks) if batch.has_constraints else None,
            table_check=self._table_check(batch) if self.verify_table else None,
        )

    def _cpu_decode_rows(self) -> int:
        """The most rows the model's one-call CPU decode step takes (0: it has none)."""
        rows = getattr(self.model, "cpu_decode_rows", None)  # (models that have the step)
        return 0 if rows is None else rows()

    def _grammar_masks(self, batch: ScheduleBatch, defer: bool) -> MaskFill | DeferredMaskFill:
        """The step's masks: filled from now on beside the forward (every matcher has accepted
        its request's latest token), or, deferred, from `start()` on (grammar_masks.py)."""
        states = []
        for it in batch.items:
            if it.samples:
                states.append(it.req.constraint)
                if it.draft_ids:  # verify rows: the grammar state after each draft prefix
                    c = it.req.constraint
                    states.extend(draft_states(c, it.draft_ids) if c is not None else [None] * len(it.draft_ids))
        grammar = self.grammar
        assert grammar is not None, "a constrained request builds the grammar backend"
        mask = grammar.allocate_bitmask(len(states), pin=self.is_cuda)  # [S, ceil(vocab / 32)] int32
        if defer:
            return DeferredMaskFill(lambda: grammar.fill_bitmasks_async(states, mask))
        return grammar.fill_bitmasks_async(states, mask)

    def _table_check(self, batch: ScheduleBatch) -> list[tuple[int, torch.Tensor]]:
        """Debug mode: what the device rows must hold once this step's writes land."""
        host = self.req_pool.table
        return [(it.req.req_pool_idx, host[it.req.req_pool_idx, : it.prefix_len + it.extend_len].clone())
                for it in batch.items]

    def _table_writes(self, writes: list[tuple[int, int, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """(row, start, slots) writes -> flat indices into `req_to_token` and their values."""
        if not writes:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty
        width = self.req_pool.req_to_token.shape[1]
        # Decode writes one slot per request: this runs for every request of every step, so
        # it avoids per-write tensor calls (len() of a tensor alone costs ~1 us).
        sizes = [s.shape[0] for _, _, s in writes]
        bases = np.array([row * width + col for row, col, _ in writes], dtype=np.int64)
        values = np.concatenate([np.asarray(s) for _, _, s in writes]).astype(np.int64, copy=False)
        if max(sizes) == 1:
            index = bases
        else:
            # flat[j] = base of its write + its offset inside that write
            lens = np.array(sizes, dtype=np.int64)
            offsets = np.arange(values.size, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
            index = np.repeat(bases, lens) + offsets
        # (deduplicating sorts every written position: a prefill step can write ~10^5)
        return last_write_wins(index, values) if writes_overlap(writes) else (index, values)

    # -- execute (device order) --------------------------------------------------------------

    def _execute(self, step: PreparedStep) -> StepResult:
        with torch.inference_mode():  # (entered once for both halves: ~10 us each time)
            return self._finish(step, self._forward(step))

    def _forward_part(self, step: PreparedStep) -> _Forwarded:
        with torch.inference_mode():
            return self._forward(step)

    def _finish_part(self, step: PreparedStep, fwd: _Forwarded) -> StepResult:
        with torch.inference_mode():
            return self._finish(step, fwd)

    def _forward(self, step: PreparedStep) -> _Forwarded:
        """The step's table writes and forward, up to its logits (enqueued on CUDA)."""
        timing = None
        if self.step_events is not None and self.is_cuda:
            start_ev = torch.cuda.Event(enable_timing=True)
            start_ev.record()
            timing = (self.step_events, start_ev)  # (the list may be swapped before finish)
        # [sum of aligned field lengths]; on the CPU the host tensor itself
        flat = step.packed if self.is_cpu else step.packed.to(self.device, non_blocking=True)
        inputs = StepInputs.unpack(flat, step.lengths, self._align)
        table = self.req_pool.req_to_token
        if step.table_writes[0].size:
            # Applied before anything that may fail: the writes include rows of requests
            # outside this step (radix swaps), which must land even if the step fails.
            self._write_table(table, inputs, step.table_writes)
        if step.table_check is not None:
            check_table_rows(table, step.table_check)
        if self.step_hook is not None:
            self.step_hook(step)
        if step.graph_bs is not None:
            assert self.graphs is not None
            logits = self.graphs.replay(flat, step.graph_bs, step.plan.num_tokens)  # [T, vocab]
            if not step.plan.rows_in_order:
                logits = logits[inputs.logits_indices]  # [S + P, vocab] (a row per token)
        else:
            logits = self._forward_eager(step, inputs, table)
        return _Forwarded(logits, inputs, timing)

    def _write_table(self, table: torch.Tensor, inputs: StepInputs[torch.Tensor],
                     host: tuple[np.ndarray, np.ndarray]) -> None:
        if self.is_cpu:  # the host arrays, by one numpy assignment instead of three torch ops
            index, values = host
            table.numpy().reshape(-1)[index] = values  # (a view: the table is contiguous)
        else:  # int64 -> int32 on the device; index_copy_ takes no host scalar (no sync)
            table.view(-1).index_copy_(0, inputs.table_index, inputs.table_value.to(table.dtype))

    def _finish(self, step: PreparedStep, fwd: _Forwarded) -> StepResult:
        """Sampling and scoring of a forwarded step, and the copies of its results (enqueued
        on CUDA; the logits of a graph replay stay valid: the next replay is enqueued later)."""
        result = StepResult() if fwd.logits is None else self._sample_and_score(step, fwd.logits, fwd.inputs)
        if self.is_cuda:
            result = result.to_host()
        if fwd.timing is not None:
            events, start_ev = fwd.timing
            end_ev = torch.cuda.Event(enable_timing=True)
            end_ev.record()
            events.append((start_ev, end_ev, step.mode, len(step.batch.items)))
        return result

    def _forward_eager(self, step: PreparedStep, inputs: StepInputs[torch.Tensor],
                       table: torch.Tensor) -> torch.Tensor | None:
        input_ids = inputs.input_ids
        if step.plan.has_placeholders:  # decided on the host: no device read
            input_ids = torch.where(input_ids < 0, self.future_tokens[(-input_ids).clamp(min=0)],
                                    input_ids)
        plan = step.plan
        row_lens = step.row_seq_lens
        fb = ForwardBatch(
            mode=step.mode, batch_size=len(step.batch.items) if row_lens is None else len(row_lens),
            input_ids=input_ids,
            positions=inputs.positions, out_cache_loc=inputs.out_cache_loc,
            req_pool_indices=inputs.req_pool_indices, seq_lens=inputs.seq_lens,
            extend_prefix_lens=inputs.extend_prefix_lens, extend_seq_lens=inputs.extend_seq_lens,
            extend_start=inputs.extend_start,
            seq_lens_cpu=plan.seq_lens if row_lens is None else row_lens,
            extend_prefix_lens_cpu=plan.prefix_lens, extend_seq_lens_cpu=plan.extend_lens,
            logits_indices=inputs.logits_indices, req_to_token=table, kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )  # fmt: skip
        self.attn_backend.prepare(fb)
        hidden = self.model.forward(fb)  # [T, hidden]
        if plan.num_samples + plan.num_score_rows == 0:
            return None
        if plan.rows_in_order:
            rows = hidden  # every token is sampled, in order: skip the gather
        else:
            rows = hidden[fb.logits_indices]  # [S + P, hidden]
        return self.model.compute_logits(rows)  # [S + P, vocab] float32

    def _sample_and_score(self, step: PreparedStep, logits: torch.Tensor,
                          inputs: StepInputs[torch.Tensor]) -> StepResult:
        plan, S = step.plan, step.plan.num_samples
        result = StepResult()
        if S:
            host_mask = step.vocab_mask.result() if step.vocab_mask is not None else None
            mask = host_mask.to(self.device, non_blocking=True) if host_mask is not None else None
            sampled = logits[:S] if plan.num_score_rows else logits  # [S, vocab]
            res = self.sampler.sample(sampled, step.sampling, mask)
            if self.overlap and not step.batch.has_drafts:  # (else no later step reads futures)
                self.future_tokens[inputs.future_indices] = res.next_token_ids
            self.sampler.observe(step.sampling, res.next_token_ids)
            result.tokens = res.next_token_ids
            if plan.want_logprobs:
                result.logprobs = res.next_logprobs
                if plan.top_logprobs_num:
                    result.top_ids, result.top_vals = res.top_ids, res.top_vals
        if plan.num_score_rows:
            from sgl.backend.sampler import gather_logprobs

            lp, top_ids, top_vals = gather_logprobs(logits[S:], inputs.score_targets,
                                                    plan.score_top_logprobs_num)
            result.score_logprobs = lp
            if plan.score_top_logprobs_num:
                result.score_top_ids, result.score_top_vals = top_ids, top_vals
        return result


@dataclass
class _Forwarded:
    """A step between its forward and its sampling."""

    logits: torch.Tensor | None  # [S + P, vocab], None when nothing is sampled or scored
    inputs: StepInputs[torch.Tensor]
    timing: tuple[list[Any], Any] | None  # timing steps: (runner.step_events, start event)


@dataclass
class PreparedStep:
    """The runner's plan of one step, built on the scheduler thread."""

    batch: ScheduleBatch
    mode: ForwardMode
    packed: torch.Tensor  # StepInputs.pack(): every integer input in one int64 host tensor
    lengths: tuple[int, ...]
    plan: StepPlan
    graph_bs: int | None  # replayed by the CUDA decode graph of this (padded) row count
    # eager decode rows of a multi-token step (the CPU's one-call step): each row's sequence
    # length, where `plan.seq_lens` has one per request
    row_seq_lens: list[int] | None
    table_writes: tuple[np.ndarray, np.ndarray]  # req_to_token (flat index, slot), host arrays
    sampling: Any  # the sampler's SamplingBatchInfo
    # the [S, ceil(V/32)] int32 CPU grammar bitmask, being filled beside the forward (or
    # waiting for the previous step's update first: deferred)
    vocab_mask: MaskFill | DeferredMaskFill | None = None
    # debug mode: (row, host slots of its first seq_len columns) for each request of the step
    table_check: list[tuple[int, torch.Tensor]] | None = None
