"""ModelRunner: turns a ScheduleBatch into device work and hands back a StepOutput.

`launch(batch)` is split in two halves so that the overlap loop can hide CPU work:

* `_prepare` (scheduler thread, CPU only): flatten the batch into host tensors.
* `_execute` (the device's turn, in step order): apply `req_to_token` writes, resolve
  future-token placeholders, run the model, sample, write sampled tokens into the future
  buffer, and copy the small results to the host.

On CUDA `_execute` only enqueues kernels, so it runs inline and a CUDA event marks completion.
On the CPU "the device" is a single worker thread: steps still run strictly in order, and the
scheduler thread prepares step N+1 while the worker computes step N.

Future tokens: a sampled token of step N is an input of step N+1 before the CPU has seen it.
The scheduler writes `-k` as the input id, where `k` is the slot of `future_tokens` that step
N fills on the device; `_execute` replaces negative ids by `future_tokens[k]`.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sgl.backend.forward_batch import ForwardBatch, ForwardMode
from sgl.backend.req import ScheduleBatch


class FutureRing:
    """Hands out slots of the future-token buffer. Two steps are alive at most, so a ring
    of twice the batch size (plus one: slot 0 is never used, -0 is not negative) suffices."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._next = 0

    def next(self) -> int:
        self._next = self._next % (self.size - 1) + 1
        return self._next


@dataclass
class StepOutput:
    next_token_ids: list[int]  # one per sampling item, in batch order
    next_logprobs: list[float] | None = None
    next_top: list[list[tuple[float, int]]] | None = None
    prompt_logprobs: list[float] = field(default_factory=list)  # one per prompt row
    prompt_top: list[list[tuple[float, int]]] = field(default_factory=list)


@dataclass
class PreparedStep:
    """Host tensors of one step (built on the scheduler thread)."""

    batch: ScheduleBatch
    mode: ForwardMode
    input_ids: torch.Tensor  # [T], may hold -k placeholders
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T]
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    extend_start: list[int]
    logits_indices: torch.Tensor  # [S + P]: S sample rows, then P prompt-logprob rows
    num_samples: int
    future_indices: torch.Tensor  # [S]
    prompt_targets: torch.Tensor  # [P]: the prompt token each prompt row scores
    sampling: Any  # the sampler's per-batch info
    top_logprobs_num: int
    prompt_top_logprobs_num: int
    want_logprobs: bool
    vocab_mask: torch.Tensor | None = None  # [S, ceil(V/32)] int32 grammar bitmask (CPU)


class StepHandle:
    """A launched step; `result()` waits for it (CPU worker future or CUDA event)."""

    def __init__(self, get: Callable[[], StepOutput]) -> None:
        self._get = get
        self._value: StepOutput | None = None

    def result(self) -> StepOutput:
        if self._value is None:
            self._value = self._get()
        return self._value


class ModelRunner:
    def __init__(self, model, kv_pool, req_pool, attn_backend, sampler, *, device: torch.device,
                 max_batch: int, vocab_size: int, overlap: bool, grammar=None) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.attn_backend = attn_backend
        self.sampler = sampler
        self.device = device
        self.vocab_size = vocab_size
        self.grammar = grammar  # a GrammarBackend (set on first constrained request) or None
        self.futures = FutureRing(2 * max_batch + 2)
        self.future_tokens = torch.zeros(self.futures.size, dtype=torch.int64, device=device)
        self._worker = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sgl-device")
            if overlap and device.type == "cpu"
            else None
        )
        # Fault injection for tests: called with the PreparedStep inside _execute.
        self.step_hook: Callable[[PreparedStep], None] | None = None

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    # -- launch ------------------------------------------------------------------------------

    def launch(self, batch: ScheduleBatch, sampling: Any) -> StepHandle:
        step = self._prepare(batch, sampling)
        if self._worker is not None:
            fut = self._worker.submit(self._execute, step)
            return StepHandle(fut.result)
        out = self._execute(step)
        return StepHandle(lambda: out)

    def _prepare(self, batch: ScheduleBatch, sampling: Any) -> PreparedStep:
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        sample_rows: list[int] = []
        future_idx: list[int] = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        seq_lens, prefix_lens, extend_lens, extend_start = [], [], [], []
        top_n, prompt_top_n, want_lp = 0, 0, False
        start = 0
        for it in batch.items:
            r = it.req
            ids.extend(it.input_ids)
            positions.append(torch.arange(it.prefix_len, it.prefix_len + it.extend_len))
            seq_lens.append(it.prefix_len + it.extend_len)
            prefix_lens.append(it.prefix_len)
            extend_lens.append(it.extend_len)
            extend_start.append(start)
            if it.samples:
                sample_rows.append(start + it.extend_len - 1)
                future_idx.append(it.future_index)
            if r.logprob.return_logprob:
                want_lp = True
                top_n = max(top_n, r.logprob.top_logprobs_num)
            first, count = it.prompt_logprob_span
            if count:
                prompt_top_n = max(prompt_top_n, r.logprob.top_logprobs_num)
                prompt_rows.extend(range(start + first - it.prefix_len, start + first - it.prefix_len + count))
                prompt_targets.extend(r.prompt_ids[first + 1 : first + 1 + count])
            start += it.extend_len
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
        return PreparedStep(
            batch=batch,
            mode=mode,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.cat(positions) if len(positions) > 1 else positions[0],
            out_cache_loc=batch.out_cache_loc.to(torch.int64),
            req_pool_indices=torch.tensor([it.req.req_pool_idx for it in batch.items], dtype=torch.int64),
            seq_lens=seq_lens,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            extend_start=extend_start,
            logits_indices=torch.tensor(sample_rows + prompt_rows, dtype=torch.int64),
            num_samples=len(sample_rows),
            future_indices=torch.tensor(future_idx, dtype=torch.int64),
            prompt_targets=torch.tensor(prompt_targets, dtype=torch.int64),
            sampling=sampling,
            top_logprobs_num=top_n,
            prompt_top_logprobs_num=prompt_top_n,
            want_logprobs=want_lp,
            vocab_mask=vocab_mask,
        )

    # -- execute (device order) --------------------------------------------------------------

    def _execute(self, step: PreparedStep) -> StepOutput:
        with torch.inference_mode():
            if self.step_hook is not None:
                self.step_hook(step)
            dev = self.device
            table = self.req_pool.req_to_token
            for row, start, slots in step.batch.table_writes:
                table[row, start : start + len(slots)] = slots.to(dev, non_blocking=True)
            input_ids = step.input_ids.to(dev, non_blocking=True)
            if bool((step.input_ids < 0).any()):
                placeholder = input_ids < 0
                resolved = self.future_tokens[(-input_ids).clamp(min=0)]
                input_ids = torch.where(placeholder, resolved, input_ids)
            fb = ForwardBatch(
                mode=step.mode,
                batch_size=len(step.seq_lens),
                input_ids=input_ids,
                positions=step.positions.to(dev, non_blocking=True),
                out_cache_loc=step.out_cache_loc.to(dev, non_blocking=True),
                req_pool_indices=step.req_pool_indices.to(dev, non_blocking=True),
                seq_lens=torch.tensor(step.seq_lens, dtype=torch.int64).to(dev, non_blocking=True),
                extend_prefix_lens=torch.tensor(step.prefix_lens, dtype=torch.int64).to(dev, non_blocking=True),
                extend_seq_lens=torch.tensor(step.extend_lens, dtype=torch.int64).to(dev, non_blocking=True),
                extend_start=torch.tensor(step.extend_start, dtype=torch.int64).to(dev, non_blocking=True),
                seq_lens_cpu=step.seq_lens,
                extend_prefix_lens_cpu=step.prefix_lens,
                extend_seq_lens_cpu=step.extend_lens,
                logits_indices=step.logits_indices.to(dev, non_blocking=True),
                req_to_token=table,
                kv_pool=self.kv_pool,
                attn_backend=self.attn_backend,
            )
            self.attn_backend.prepare(fb)
            hidden = self.model.forward(fb)  # [T, hidden]
            if len(step.logits_indices) == 0:
                return StepOutput(next_token_ids=[])
            logits = self.model.compute_logits(hidden[fb.logits_indices])  # [S + P, vocab]
            return self._sample_and_score(step, logits)

    def _sample_and_score(self, step: PreparedStep, logits: torch.Tensor) -> StepOutput:
        out = StepOutput(next_token_ids=[])
        S = step.num_samples
        if S:
            sample_logits = logits[:S]  # [S, vocab]
            mask = step.vocab_mask.to(self.device, non_blocking=True) if step.vocab_mask is not None else None
            res = self.sampler.sample(sample_logits, step.sampling, mask)
            tokens = res.next_token_ids
            self.future_tokens[step.future_indices.to(self.device)] = tokens
            self.sampler.observe(step.sampling, tokens)
            out.next_token_ids = tokens.tolist()
            if step.want_logprobs:
                out.next_logprobs = res.next_logprobs.tolist()
                if step.top_logprobs_num and res.top_ids is not None:
                    out.next_top = _pairs(res.top_vals, res.top_ids)
        if len(step.prompt_targets):
            from sgl.backend.sampler import gather_logprobs

            lp, top_ids, top_vals = gather_logprobs(
                logits[S:], step.prompt_targets.to(self.device), step.prompt_top_logprobs_num
            )
            out.prompt_logprobs = lp.tolist()
            if step.prompt_top_logprobs_num:
                out.prompt_top = _pairs(top_vals, top_ids)
        return out


def _pairs(vals: torch.Tensor, ids: torch.Tensor) -> list[list[tuple[float, int]]]:
    return [list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist())]
