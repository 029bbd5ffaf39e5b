"""Batched sampling: grammar mask, penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

One step for a batch of B requests (every tensor on the model's device, no host sync on GPU)::

    logits [B, V] float32            the model's output; `sample` modifies it in place
      -> raw logprobs                log_softmax of the untouched logits, only when asked
      -> grammar bitmask             disallowed tokens -> -inf
      -> min_new_tokens              EOS and stop_token_ids -> -inf until enough tokens exist
      -> penalties                   repetition, then frequency and presence
      -> logit_bias                  one sparse add of every row's {token: bias}
      -> greedy rows: argmax         an all-greedy batch stops here
      -> probs = softmax(logits / T), then top-k, top-p, min-p as one threshold per row
      -> inverse-CDF draw in vocabulary order, one uniform number per row

- Logprobs are of the model's raw distribution (temperature 1, no penalties, no grammar mask),
  as SGLang returns by default: they mean the same thing whatever the sampling settings.
- A seeded row's uniform number hashes (seed, step) with integer tensor ops, so a request
  draws the same tokens alone or at any position of any batch. For that no row's draw depends
  on other rows: filters are per-row probability thresholds (ties at the boundary all stay)
  and the draw walks probabilities in vocabulary order, whatever sort other rows needed.
- Penalties (their semantics and the per-row counts behind them) live in `penalties.py`;
  this module only builds each batch's `PenaltyBatch` and applies it in the order above.

Engine use, per step: `info = sampler.build_for(batch)` on the scheduler thread, then in device
order `out = sampler.sample(logits, info)` and `sampler.observe(info, out.next_token_ids)`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from sgl.backend.kernels import dispatch
from sgl.backend.kernels.argmax import argmax_reference as argmax_rows
from sgl.backend.logit_bias import apply_logit_bias, logit_bias_tensors
from sgl.backend.penalties import PenaltyBatch, PenaltyPool, PenaltyStart
from sgl.sampling import SamplingParams

__all__ = [
    "SamplingBatchInfo", "SampleOutput", "Sampler", "sample", "process_logits", "filtered_probs",
    "seeded_uniform", "gather_logprobs", "argmax_rows",
]  # fmt: skip

_MASK32 = 0xFFFFFFFF
# On the CPU a top-p row first reads this many top candidates and sorts the whole vocabulary
# only when its nucleus is wider: a full sort of 32 x 49k costs ~15 elementwise passes.
_CPU_TOP_P_CANDIDATES = 1024


@dataclass
class SamplingBatchInfo:
    """Per-batch device tensors. `build` once per batch composition, `with_step` every step."""

    params: tuple[SamplingParams, ...]
    vocab_size: int  # = logits width
    device: torch.device
    temperatures: Tensor  # [B, 1] float32; 1.0 on greedy rows so dividing is harmless
    top_ps: Tensor  # [B] float32; greedy rows get neutral filters (1, V, 0)
    top_ks: Tensor  # [B] int64; vocab_size where disabled
    min_ps: Tensor  # [B] float32
    greedy: Tensor  # [B] bool
    seeded: Tensor  # [B] bool
    seeds: Tensor  # [B] int64 in [0, 2^32); 0 on unseeded rows
    num_greedy: int
    num_seeded: int
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    filter_width: int  # sorted candidates the top-k/top-p pass reads: max top_k, or V
    max_top_k: int  # largest enabled top_k (0: none)
    eos_token_ids: tuple[int, ...]
    penalties: PenaltyBatch | None  # None when no request has a penalty
    # (flat indices b * V + token [L] int64, biases [L] float32), None when no row has one.
    logit_bias: tuple[Tensor, Tensor] | None
    return_logprob: bool
    top_logprobs_num: int  # max over the batch; the engine slices each request's share
    # Step-dependent, rebuilt by `with_step`:
    steps: Tensor | None = None  # [B] int64: seeded rows' counter (tokens sampled so far)
    min_tokens_mask: Tensor | None = None  # [M] int64: flat indices b * V + token to ban
    # PenaltyPool.start calls to make in device order, before this step's penalties.
    penalty_starts: tuple[PenaltyStart, ...] = ()
    token_vocab_size: int | None = None  # ids from here on are padding: never sampled

    @property
    def batch_size(self) -> int:
        return len(self.params)

    @property
    def all_greedy(self) -> bool:
        return self.num_greedy == len(self.params)

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], *, vocab_size: int, device: torch.device | str,
        output_lens: Sequence[int], seed_steps: Sequence[int] | None = None,
        eos_token_ids: Sequence[int] = (), penalty_pool: PenaltyPool | None = None,
        pool_rows: Sequence[int] | None = None, return_logprob: bool = False,
        top_logprobs_num: int = 0, sample_indices: Sequence[int] | None = None,
        token_vocab_size: int | None = None,
    ) -> SamplingBatchInfo:  # fmt: skip
        """`output_lens[b]`: tokens request b has generated (for min_new_tokens);
        `seed_steps[b]`: tokens it has sampled (default output_lens); `pool_rows[b]`: its
        PenaltyPool row (needed when some request has a penalty); `sample_indices[b]`: which of
        the n samples of its prompt it is, so the n samples of one seed differ."""
        device = torch.device(device)
        params = tuple(params)
        host_f: list[tuple[float, float, float]] = []  # per row: temperature, top_p, min_p
        host_i: list[tuple[int, int, int, int]] = []  # per row: top_k, greedy, seeded, seed
        pen: list[tuple[int, int, float, float, float]] = []
        for b, p in enumerate(params):
            on = not p.is_greedy  # greedy rows get neutral filters: they never force a sort
            host_f.append((p.temperature if on else 1.0, p.top_p if on else 1.0, p.min_p if on else 0.0))
            seed = 0 if p.seed is None else _fold_seed(p.seed, sample_indices[b] if sample_indices else 0)
            top_k = p.top_k if on and 0 < p.top_k < vocab_size else vocab_size
            host_i.append((top_k, not on, p.seed is not None, seed))
            if PenaltyPool.needs(p):
                assert penalty_pool is not None and pool_rows is not None, "penalties need a pool"
                pen.append((b, pool_rows[b], p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
        # One host tensor per dtype, one copy each: this runs every step on the CPU thread.
        f = _to(torch.tensor(host_f, dtype=torch.float32).reshape(-1, 3).T, device)  # [3, B]
        i = _to(torch.tensor(host_i, dtype=torch.int64).reshape(-1, 4).T, device)  # [4, B]
        sampled = [p for p in params if not p.is_greedy]  # filters matter only for these
        top_ks = [p.top_k for p in sampled if 0 < p.top_k < vocab_size]
        wide_top_p = any(p.top_p < 1.0 and not 0 < p.top_k < vocab_size for p in sampled)
        penalties = None
        if pen:
            assert penalty_pool is not None
            cols = list(zip(*pen))
            where = _to(torch.tensor(cols[:2], dtype=torch.int64), device)  # [2, P]
            values = _to(torch.tensor(cols[2:], dtype=torch.float32), device)  # [3, P]
            penalties = PenaltyBatch(penalty_pool, where[0], where[1], values)
        info = cls(
            params=params, vocab_size=vocab_size, device=device,
            temperatures=f[0].unsqueeze(1), top_ps=f[1], top_ks=i[0], min_ps=f[2],
            greedy=i[1].bool(), seeded=i[2].bool(), seeds=i[3],
            num_greedy=len(params) - len(sampled),
            num_seeded=sum(p.seed is not None for p in params),
            need_top_k=bool(top_ks),
            need_top_p=any(p.top_p < 1.0 for p in sampled),
            need_min_p=any(p.min_p > 0.0 for p in sampled),
            filter_width=vocab_size if wide_top_p or not top_ks else max(top_ks),
            max_top_k=max(top_ks, default=0),
            eos_token_ids=tuple(eos_token_ids),
            penalties=penalties,
            logit_bias=logit_bias_tensors(params, vocab_size, device),
            return_logprob=return_logprob or top_logprobs_num > 0,
            top_logprobs_num=top_logprobs_num, token_vocab_size=token_vocab_size,
        )  # fmt: skip
        return info.with_step(output_lens, seed_steps)

    def with_step(self, output_lens: Sequence[int], seed_steps: Sequence[int] | None = None) -> SamplingBatchInfo:
        """A copy with the step-dependent fields (seed counters, min_new_tokens mask) rebuilt."""
        steps = None
        if self.num_seeded:
            counters = list(output_lens if seed_steps is None else seed_steps)
            steps = _to(torch.tensor(counters, dtype=torch.int64), self.device)
        flat = [
            b * self.vocab_size + t
            for b, (p, n) in enumerate(zip(self.params, output_lens))
            if n < p.min_new_tokens
            for t in sorted({*self.eos_token_ids, *p.stop_token_ids})
            if t < self.vocab_size
        ]
        mask = _to(torch.tensor(flat, dtype=torch.int64), self.device) if flat else None
        return self.replaced(steps=steps, min_tokens_mask=mask, penalty_starts=())

    def replaced(self, **changes: Any) -> SamplingBatchInfo:
        """`dataclasses.replace` without re-running `__init__` over every field (that took
        ~20 us of every step's preparation; the fields are only rebound, never mutated)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__, **changes)
        return new


def _to(t: Tensor, device: torch.device) -> Tensor:
    """Host tensor -> device without a host sync (a pageable copy may wait for the stream)."""
    return t.contiguous().pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class SampleOutput(NamedTuple):
    next_token_ids: Tensor  # [B] int64
    next_logprobs: Tensor | None = None  # [B] float32: raw logprob of the chosen token, when asked
    top_ids: Tensor | None = None  # [B, k] int64: the k most likely raw tokens, when asked
    top_vals: Tensor | None = None  # [B, k] float32: their raw logprobs


def _fold_seed(seed: int, sample_index: int = 0) -> int:
    """Any Python int -> 32 bits, mixing in the high half (large seeds stay distinct) and the
    sample index (sample 0 keeps the plain seed's stream)."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return ((s & _MASK32) ^ ((s >> 32) * 0x9E3779B1) ^ (sample_index * 0x85EBCA77)) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    """32-bit integer hash on int64 tensors holding [0, 2^32). Multipliers below 2^31 keep
    every product below 2^63, so int64 never overflows (undefined behaviour in kernels)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    return x ^ (x >> 16)


def seeded_uniform(seeds: Tensor, steps: Tensor) -> Tensor:
    """seeds, steps [B] int64 -> [B] float32 in [0, 1), a pure function of (seed, step)."""
    h = _mix32(seeds ^ 0x2545F491)
    h = _mix32(h ^ (steps & _MASK32))
    h = _mix32((h + 0x3C6EF372) & _MASK32)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))  # 24 bits: exact in float32


def process_logits(logits: Tensor, info: SamplingBatchInfo, vocab_mask: Tensor | None = None,
                   apply_mask: Callable[..., None] | None = None) -> Tensor:
    """Mask and penalise logits [B, V] in place (the model's buffer), before temperature.
    `apply_mask` is the engine's KernelSet bitmask op (default: the device's "auto" one)."""
    if vocab_mask is not None:
        (apply_mask or dispatch.apply_token_bitmask)(logits, vocab_mask.to(logits.device, non_blocking=True))
    if info.token_vocab_size is not None and info.token_vocab_size < logits.shape[1]:
        # Padded embedding rows past the tokenizer are no tokens (masks do not cover them).
        logits[:, info.token_vocab_size :] = float("-inf")
    if info.min_tokens_mask is not None:
        # index_fill_ takes its value as a kernel argument; index_put_ would copy it (a sync).
        logits.view(-1).index_fill_(0, info.min_tokens_mask, float("-inf"))
    if info.penalties is not None:
        info.penalties.apply(logits, info.penalty_starts)
    if info.logit_bias is not None:
        apply_logit_bias(logits, info.logit_bias)
    return logits


def _sorted_threshold(vals: Tensor, top_ks: Tensor, top_ps: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """vals [R, K] sorted descending -> (probability threshold [R], nucleus size [R]).

    Top-p acts on what top-k leaves, renormalised (as HF): sorted token i stays while the mass
    before it is < top_p x the survivors' mass (1 for rows without top-k). A threshold value,
    not a set, keeps every token tied at the boundary, so tie order never matters."""
    width = vals.shape[1]
    k_on = top_ks < vocab_size  # [R]
    k = top_ks.clamp(max=width).unsqueeze(1)  # [R, 1]
    cum = vals.cumsum(-1)  # [R, K]
    total = torch.where(k_on, cum.gather(1, k - 1).squeeze(1), 1.0)  # [R]
    # Token i stays iff cum[i-1] < top_p * total; cum rises, so count the cum[j] below it.
    below = torch.searchsorted(cum, (top_ps * total).unsqueeze(1))  # [R, 1]
    n_keep = 1 + torch.minimum(below, k - 1)  # [R, 1]
    thr_k = torch.where(k_on, vals.gather(1, k - 1).squeeze(1), 0.0)
    thr_p = torch.where(top_ps < 1.0, vals.gather(1, n_keep - 1).squeeze(1), 0.0)
    return torch.maximum(thr_k, thr_p), n_keep.squeeze(1)


def _top_k_top_p_threshold(probs: Tensor, info: SamplingBatchInfo) -> Tensor:
    """probs [B, V] -> [B] threshold for top-k and top-p, sorting as little as possible."""
    vocab = probs.shape[1]
    width = info.filter_width
    # CPU: read the top candidates first and fully sort only rows whose nucleus is wider. The
    # host sync this needs is free on the CPU; on a GPU a full sort is cheap instead.
    narrow = width == vocab and probs.device.type == "cpu"
    if narrow:
        width = min(vocab, max(_CPU_TOP_P_CANDIDATES, info.max_top_k))
    if width < vocab:
        vals = probs.topk(width, dim=-1).values  # [B, width], descending
    else:
        vals = probs.sort(dim=-1, descending=True).values  # [B, V]
    thr, n_keep = _sorted_threshold(vals, info.top_ks, info.top_ps, vocab)
    if narrow and width < vocab:
        wide = (n_keep >= width) & (info.top_ks >= vocab) & (info.top_ps < 1.0)  # [B]
        redo = wide.nonzero().squeeze(1)  # [R]
        if redo.numel():
            # numpy's sort is ~4x faster than torch's on the CPU; values only, so ties are moot.
            full = torch.from_numpy(-np.sort(-probs[redo].numpy(), axis=-1))  # [R, V] descending
            thr[redo] = _sorted_threshold(full, info.top_ks[redo], info.top_ps[redo], vocab)[0]
    return thr


def filtered_probs(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """Temperature, then top-k, top-p and min-p: probs [B, V] with filtered tokens zeroed.

    Not renormalised: the draw scales its uniform number by each row's remaining mass."""
    probs = torch.softmax(logits / info.temperatures, dim=-1)  # [B, V]
    threshold: Tensor | None = None  # [B]
    if info.need_top_k or info.need_top_p:
        threshold = _top_k_top_p_threshold(probs, info)
    if info.need_min_p:
        relative = probs.amax(dim=-1) * info.min_ps  # [B]: min-p is relative to the top token
        threshold = relative if threshold is None else torch.maximum(threshold, relative)
    if threshold is not None:
        probs = probs.masked_fill(probs < threshold.unsqueeze(1), 0.0)
    return probs


def _draw(probs: Tensor, uniform: Tensor) -> Tensor:
    """Inverse CDF in vocabulary order: probs [B, V] (unnormalised), uniform [B] -> ids [B]."""
    cdf = probs.cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1:].contiguous()  # [B, 1]
    ids = torch.searchsorted(cdf, uniform.unsqueeze(1) * total, right=True)  # [B, 1]
    # u * total may round up to total; the first position where the CDF reaches its total is
    # the last token with mass, so capping there never picks a filtered token.
    last = torch.searchsorted(cdf, total, right=False)  # [B, 1]
    return torch.minimum(ids, last).squeeze(1).clamp(max=probs.shape[1] - 1)


def _uniforms(info: SamplingBatchInfo, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """[B] uniform numbers: hashed for seeded rows, from the generator for the others."""
    hashed = seeded_uniform(info.seeds, info.steps) if info.steps is not None else None
    if hashed is not None and info.num_seeded == info.batch_size:
        return hashed  # the generator's state is untouched by fully seeded batches
    u = torch.rand(info.batch_size, generator=generator, device=device)
    return u if hashed is None else torch.where(info.seeded, hashed, u)


def sample(
    logits: Tensor, info: SamplingBatchInfo, vocab_mask: Tensor | None = None,
    generator: torch.Generator | None = None, apply_mask: Callable[..., None] | None = None,
    argmax: Callable[[Tensor], Tensor] = argmax_rows,
) -> SampleOutput:  # fmt: skip
    """logits [B, V] float32 (modified in place) -> next tokens, and raw logprobs when asked.

    vocab_mask: xgrammar bitmask [B, ceil(V/32)] int32; unconstrained rows have every bit set."""
    assert logits.shape == (info.batch_size, info.vocab_size), (logits.shape, info.batch_size)
    raw = torch.log_softmax(logits, dim=-1) if info.return_logprob else None  # [B, V]
    logits = process_logits(logits, info, vocab_mask, apply_mask)
    if info.all_greedy:
        next_ids = argmax(logits)  # [B]
    else:
        drawn = _draw(filtered_probs(logits, info), _uniforms(info, generator, logits.device))
        next_ids = torch.where(info.greedy, argmax(logits), drawn) if info.num_greedy else drawn
    if raw is None:
        return SampleOutput(next_ids)
    next_logprobs = raw.gather(1, next_ids.unsqueeze(1)).squeeze(1)  # [B]
    if info.top_logprobs_num == 0:
        return SampleOutput(next_ids, next_logprobs)
    vals, ids = raw.topk(min(info.top_logprobs_num, raw.shape[1]), dim=-1)  # [B, k]
    return SampleOutput(next_ids, next_logprobs, ids, vals)


class Sampler:
    """The engine's sampler: the generator of unseeded requests (seeded by the engine's
    `random_seed`), the PenaltyPool, and `build_for`, which turns a ScheduleBatch into a
    SamplingBatchInfo, reusing the last one when the sampled requests are unchanged."""

    def __init__(
        self, vocab_size: int, max_rows: int, device: torch.device | str,
        seed: int | None = None, eos_token_ids: Sequence[int] = (), token_vocab_size: int | None = None,
        apply_token_bitmask: Callable[..., None] | None = None,
        argmax: Callable[[Tensor], Tensor] = argmax_rows,
    ) -> None:  # fmt: skip
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.token_vocab_size = token_vocab_size
        self.apply_token_bitmask = apply_token_bitmask  # the KernelSet's op; None: "auto"
        self.argmax = argmax  # the KernelSet's op (greedy rows)
        self.eos_token_ids = tuple(eos_token_ids)
        self.generator = torch.Generator(device=self.device)
        _ = self.generator.seed() if seed is None else self.generator.manual_seed(seed)
        self.penalty_pool = PenaltyPool(max_rows, vocab_size, self.device)
        self._last: tuple[list[Any], tuple[Any, ...], SamplingBatchInfo] | None = None
        self._rows: dict[int, tuple[Any, int]] = {}  # row -> (req, output tokens counted after the step)

    def build_for(self, batch: Any) -> SamplingBatchInfo:
        """ScheduleBatch -> info for its sampled items, in order (on the scheduler thread)."""
        # One row per sample; a speculative item samples its last known token's row and one row
        # per draft, each at the output index (seed step) decoding would draw it at.
        reqs = [it.req for it in batch.items if it.samples for _ in range(1 + len(it.draft_ids))]
        # (index + 1: tokens generated once this one is; the seed step and min_new_tokens count)
        lens = [it.output_index + 1 + j for it in batch.items if it.samples
                for j in range(1 + len(it.draft_ids))]
        rows = [r.req_pool_idx for r in reqs]
        # Logprob flags come from every item, as the runner decides from every item.
        lp = [it.req.logprob for it in batch.items if it.req.logprob.return_logprob]
        key = (rows, bool(lp), max((o.top_logprobs_num for o in lp), default=0))
        starts = []
        for r, n in zip(reqs, lens):
            if PenaltyPool.needs(r.params):
                # Counts are (re)built from the CPU ids when the row changes hands or the outputs
                # changed other than by sampling (jump-forward, retraction). Such requests have
                # no sample in flight, so output_ids is complete.
                if self._rows.get(r.req_pool_idx, (None, -1)) != (r, n):
                    starts.append((r.req_pool_idx, r.params, r.prompt_ids, tuple(r.output_ids)))
                self._rows[r.req_pool_idx] = (r, n + 1)
        last = self._last
        if last is not None and last[1] == key and len(last[0]) == len(reqs) and all(map(operator.is_, last[0], reqs)):
            info = last[2].with_step(lens)
        else:
            info = SamplingBatchInfo.build(
                [r.params for r in reqs], vocab_size=self.vocab_size, device=self.device,
                output_lens=lens, eos_token_ids=self.eos_token_ids, penalty_pool=self.penalty_pool,
                pool_rows=rows, return_logprob=key[1], top_logprobs_num=key[2],
                sample_indices=[r.sample_index for r in reqs], token_vocab_size=self.token_vocab_size,
            )  # fmt: skip
        self._last = (reqs, key, info)
        return info.replaced(penalty_starts=tuple(starts)) if starts else info

    def sample(self, logits: Tensor, info: SamplingBatchInfo, vocab_mask: Tensor | None = None) -> SampleOutput:
        return sample(logits, info, vocab_mask, self.generator, self.apply_token_bitmask,
                      self.argmax)

    def observe(self, info: SamplingBatchInfo, next_token_ids: Tensor) -> None:
        """Record the sampled tokens [B] in the penalty counts (device order, no sync)."""
        if info.penalties is not None:
            self.penalty_pool.add(info.penalties.rows, next_token_ids[info.penalties.idx])


def gather_logprobs(
    logits: Tensor, token_ids: Tensor, top_k: int = 0, chunk_elems: int = 1 << 25
) -> tuple[Tensor, Tensor, Tensor]:
    """Prompt logprobs: logits [N, V], token_ids [N] -> (lp [N], top_ids [N, k], top_vals [N, k]).

    float32 log_softmax by row chunks, so a long prompt never holds a second full [N, V] copy."""
    n, vocab = logits.shape
    k, rows = min(top_k, vocab), max(1, chunk_elems // vocab)
    lps, top_ids, top_vals = [], [], []
    for start in range(0, max(n, 1), rows):  # one (maybe empty) chunk at least
        part = torch.log_softmax(logits[start : start + rows].float(), dim=-1)  # [r, V]
        ids = token_ids[start : start + rows].to(torch.int64).unsqueeze(1)  # [r, 1]
        lps.append(part.gather(1, ids).squeeze(1))
        vals, idx = part.topk(k, dim=-1)  # [r, k]
        top_ids.append(idx), top_vals.append(vals)
    return torch.cat(lps), torch.cat(top_ids), torch.cat(top_vals)
