"""The scheduler: which requests compute which tokens in the next step.

Every step (continuous batching):

1. Requests that are decoding get one token each. If the pool cannot hold one more slot per
   request even after evicting unlocked radix leaves, the requests with the least progress are
   retracted (their KV goes into the radix cache, they wait and resume from a cache hit).
2. A request in the middle of a chunked prefill continues first.
3. Waiting requests are admitted in policy order while the prompt-token budget
   (`chunked_prefill_size`) and memory allow. Memory counts free slots, evictable cached slots
   and a reserve for the future decode tokens of everything already running.

Prefill chunks and decode tokens share one EXTEND step; a step of decodes only is DECODE.

The scheduler owns all request state changes and all KV accounting. Writes to the device-side
`req_to_token` table are not done here: they travel with the batch (`table_writes`) and the
runner applies them in step order, so an in-flight step never sees a half-updated row.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from sgl._seq import common_prefix_len
from sgl.backend.req import Req, ReqStatus, ScheduleBatch, ScheduledReq

# Lpm: a waiting request whose prompt shares this many more tokens with a request admitted in
# the same round than with the cache waits one round, to hit the cache instead of recomputing.
IN_BATCH_PREFIX_DEFER = 32
# Lpm matching costs a tree walk per waiting request; beyond this queue length use fcfs.
LPM_MAX_QUEUE = 128
NEW_TOKEN_RATIO_INIT = 0.7
NEW_TOKEN_RATIO_MIN = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002
RESERVE_CAP = 4096  # tokens reserved per running request at most


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    chunked_prefill_size: int  # prompt tokens per step
    max_prefill_tokens: int  # hard cap on tokens of one step
    page_size: int
    policy: str  # "lpm" | "fcfs"
    conservativeness: float


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, allocator, req_pool, tree, future_ring) -> None:
        self.cfg = cfg
        self.allocator = allocator
        self.req_pool = req_pool  # ReqToTokenPool; its CPU mirror `table` is read here
        self._table_np = req_pool.table.numpy()  # a view of the same memory, for fast writes
        self.tree = tree
        self.futures = future_ring
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted, not finished (prefilling or decoding)
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT * cfg.conservativeness
        self.num_retractions = 0
        # Rows of req_to_token changed since the last batch: (row, start, slots), applied by
        # the runner before the next step runs.
        self._pending_table_writes: list[tuple[int, int, torch.Tensor]] = []

    # -- queue -------------------------------------------------------------------------------

    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def req_slots(self, req: Req, end: int | None = None) -> torch.Tensor:
        """A copy of the request's slots: the table row is reused by later requests, so
        nothing that outlives this call (radix tree values!) may be a view of it."""
        end = req.kv_len if end is None else end
        return self.req_pool.table[req.req_pool_idx, :end].clone()

    # -- the decision ------------------------------------------------------------------------

    def schedule(self) -> ScheduleBatch | None:
        decoding: list[Req] = []
        prefilling: list[Req] = []
        for r in self.running:
            decodes = r.extend_len == 1 and r.kv_len >= len(r.prompt_ids)
            (decoding if decodes else prefilling).append(r)
        decoding = self._make_room_for_decode(decoding)
        items: list[ScheduledReq] = []
        locs: list[torch.Tensor] = []

        if decoding:
            slots = self._alloc(decoding, [1] * len(decoding))
            assert slots is not None, "room for decode was ensured above"
            locs.append(slots)  # one slot per decoding request, in `decoding` order
            items.extend(self._item(r, 1) for r in decoding)

        budget = self.cfg.chunked_prefill_size
        step_tokens = len(decoding)
        # (a pass over every running request: only worth it when someone waits for admission)
        reserve = self._decode_reserve(self.running) if self.waiting else 0
        # Prompts being prefilled whose KV is not in the tree yet: a waiting request sharing a
        # long prefix with one of them waits for it (lpm), instead of computing it twice.
        admitted_prompts = [r.prompt_ids for r in self.running if r.cached_len < len(r.prompt_ids) - 1]

        for r in prefilling:  # chunked prefills in progress continue first
            if budget <= 0:
                break
            if r.extend_len == 0:
                # Fully computed, nothing to sample (max_new_tokens=0): it finishes when the
                # step in flight is processed; it must not stop the prefills after it.
                continue
            n = min(r.extend_len, budget, self.cfg.max_prefill_tokens - step_tokens)
            if n <= 0:
                break
            slots = self._alloc([r], [n]) if self._available() >= n else None
            if slots is None:
                break
            locs.append(slots)
            items.append(self._item(r, n))
            budget -= n
            step_tokens += n

        for r in self._ordered_waiting():
            if budget <= 0 or len(self.running) >= self.cfg.max_running_requests:
                break
            if step_tokens >= self.cfg.max_prefill_tokens:
                break
            if r.aborted:
                continue
            admitted = self._try_admit(r, budget, reserve, step_tokens, admitted_prompts)
            if admitted is None:
                break  # out of memory: later requests would not fit either (keeps fcfs order)
            if admitted is False:
                continue  # deferred for an in-batch prefix hit
            n, slots = admitted
            locs.append(slots)
            items.append(self._item(r, n))
            budget -= n
            step_tokens += n
            reserve += self._reserve_for(r)
            admitted_prompts.append(r.prompt_ids)

        if not items:
            return None
        self.new_token_ratio = max(NEW_TOKEN_RATIO_MIN, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        out_cache_loc = torch.cat(locs) if len(locs) > 1 else locs[0]
        batch = ScheduleBatch(
            items=items,
            out_cache_loc=out_cache_loc,
            is_decode=all(it.extend_len == 1 and not it.req.is_prefilling for it in items),
            has_constraints=any(it.req.constraint is not None for it in items),
        )
        # Record the new slots in the table and advance the lengths.
        start = 0
        for it in items:
            r = it.req
            self._write_row(r, r.kv_len, out_cache_loc[start : start + it.extend_len])
            start += it.extend_len
            r.kv_len += it.extend_len
            if it.samples:
                it.future_index = self.futures.next()
                r.pending_future = it.future_index
        batch.table_writes = self._pending_table_writes
        self._pending_table_writes = []
        return batch

    def _item(self, r: Req, n: int) -> ScheduledReq:
        prefix = r.kv_len
        if r.pending_future is not None:
            assert n == 1, "a request with an in-flight sample can only decode"
            ids = [-r.pending_future]
        else:
            ids = r.fill_ids()[prefix : prefix + n]
        samples = prefix + n == r.seq_len and r.params.max_new_tokens > 0
        span = (0, 0)
        if r.logprob.wants_prompt_logprobs:
            # logits row at position p scores prompt token p+1; cover prompt rows in this chunk
            first = max(r.logprob.logprob_start_len - 1, 0, prefix)
            last = min(prefix + n, len(r.prompt_ids) - 1)
            if last > first:
                span = (first, last - first)
        return ScheduledReq(r, n, prefix, samples, ids, prompt_logprob_span=span)

    # -- admission ---------------------------------------------------------------------------

    def _ordered_waiting(self) -> list[Req]:
        queue = list(self.waiting)
        if self.cfg.policy == "lpm" and 1 < len(queue) <= LPM_MAX_QUEUE and not self.tree.disabled:
            lengths = {id(r): len(self.tree.match_prefix(r.fill_ids()).slots) for r in queue}
            queue.sort(key=lambda r: -lengths[id(r)])  # stable: fcfs among equals
        return queue

    def _try_admit(self, r: Req, budget: int, reserve: int, step_tokens: int,
                   admitted_prompts: list[list[int]]):
        """Admit `r` for up to `budget` tokens. Returns (n, slots), False (deferred) or None."""
        if self.req_pool.num_free == 0:
            return None
        tokens = r.fill_ids()
        match = self.tree.match_prefix(tokens)
        cached = min(len(match.slots), len(tokens) - 1)
        if r.logprob.wants_prompt_logprobs:
            cached = min(cached, max(r.logprob.logprob_start_len - 1, 0))
        cached -= cached % self.cfg.page_size
        if self.cfg.policy == "lpm" and admitted_prompts and not self.tree.disabled:
            shared = max(common_prefix_len(tokens, p) for p in admitted_prompts)
            if shared >= cached + IN_BATCH_PREFIX_DEFER:
                return False
        n = min(len(tokens) - cached, budget, self.cfg.max_prefill_tokens - step_tokens)
        if n <= 0:
            return None
        self.tree.inc_lock_ref(match.last_node)  # before counting: locked slots can't be evicted
        need = (len(tokens) - cached) + self._reserve_for(r) + reserve
        row = self.req_pool.alloc() if self._available() >= need else None
        slots = self._alloc(
            [r], [n], last_locs=[int(match.slots[cached - 1]) if cached else -1]
        ) if row is not None else None
        if slots is None:
            if row is not None:
                self.req_pool.free(row)
            self.tree.dec_lock_ref(match.last_node)
            return None
        self.waiting.remove(r)
        r.req_pool_idx = row
        r.status = ReqStatus.RUNNING
        r.last_node = match.last_node
        r.cached_len = cached
        r.kv_len = cached
        self._write_row(r, 0, match.slots[:cached])
        if not r.admitted_once:
            r.admitted_once = True
            r.num_cached_prompt_tokens = min(cached, len(r.prompt_ids))
        self.running.append(r)
        return n, slots

    # -- memory ------------------------------------------------------------------------------

    def _available(self) -> int:
        return self.allocator.available_size() + self.tree.evictable_size()

    def _evict(self, need: int) -> bool:
        short = need - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        return self.allocator.available_size() + self.tree.evictable_size() >= need

    def _reserve_for(self, r: Req) -> int:
        remaining = max(r.params.max_new_tokens - r.output_len, 0)
        return int(min(remaining, RESERVE_CAP) * self.new_token_ratio)

    def _decode_reserve(self, reqs: Iterable[Req]) -> int:
        return sum(self._reserve_for(r) for r in reqs)

    def _alloc(self, reqs: list[Req], lens: list[int], last_locs: list[int] | None = None):
        """Slots for `lens[i]` new tokens of `reqs[i]`, evicting cached leaves if needed."""
        if self.cfg.page_size > 1 and last_locs is None:
            last_locs = [
                int(self.req_pool.table[r.req_pool_idx, r.kv_len - 1]) if r.kv_len else -1
                for r in reqs
            ]

        def attempt():
            if self.cfg.page_size == 1:
                return self.allocator.alloc(sum(lens))
            return self.allocator.alloc_extend(last_locs, lens)

        slots = attempt()
        if slots is None and self._evict(sum(lens) + self.cfg.page_size * len(reqs)):
            slots = attempt()
        return slots

    def _make_room_for_decode(self, decoding: list[Req]) -> list[Req]:
        """Retract decoding requests until one new slot (page) for each of the rest fits."""
        need = lambda reqs: len(reqs) * self.cfg.page_size  # noqa: E731 - worst case per page
        while decoding and not self._evict(need(decoding)):
            victim = min(decoding, key=lambda r: (r.output_len, -len(r.prompt_ids)))
            decoding.remove(victim)
            self.retract(victim)
        return decoding

    def retract(self, r: Req) -> None:
        """Free a running request's KV into the radix cache and put it back in the queue."""
        self.release(r, cache=True)
        r.status = ReqStatus.WAITING
        r.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(r)
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT * self.cfg.conservativeness

    def finish(self, r: Req, cache: bool = True) -> None:
        """Take `r` out of the queues for good, releasing its KV (into the tree with `cache`)."""
        if r in self.waiting:
            self.waiting.remove(r)
        self.release(r, cache)

    def release(self, r: Req, cache: bool) -> None:
        """Give back everything `r` holds. With `cache`, its computed KV joins the radix tree."""
        if r.req_pool_idx is None:
            return
        if r in self.running:
            self.running.remove(r)
        tokens = r.fill_ids()[: r.kv_len]
        slots = self.req_slots(r)
        if cache and len(tokens) == len(slots):
            self.tree.cache_finished(tokens, slots, r.last_node)
        else:
            # Slots beyond what the tree holds are ours; the cached prefix stays in the tree.
            self.allocator.free(slots[r.cached_len :])
            self.tree.dec_lock_ref(r.last_node)
        self.req_pool.free(r.req_pool_idx)
        r.req_pool_idx = None
        r.kv_len = r.cached_len = 0
        r.last_node = None

    def cache_prompt(self, r: Req) -> None:
        """Insert the prompt tokens whose KV is computed into the tree (after each prefill chunk)."""
        n = min(r.kv_len, len(r.prompt_ids))
        n -= n % self.cfg.page_size
        if n <= r.cached_len or self.tree.disabled:
            return
        new_slots, new_node = self.tree.cache_unfinished(
            r.prompt_ids[:n], self.req_slots(r, n), r.last_node
        )
        self._write_row(r, 0, new_slots)
        r.last_node = new_node
        r.cached_len = n

    def rollback(self, r: Req, num_tokens: int) -> None:
        """Drop the last `num_tokens` output tokens (jump-forward re-tokenization)."""
        assert r.pending_future is None and num_tokens <= len(r.output_ids)
        del r.output_ids[len(r.output_ids) - num_tokens :]
        new_kv = min(r.kv_len, r.seq_len)
        assert new_kv >= r.cached_len, "rollback never cuts into cached KV"
        if new_kv < r.kv_len:
            self.allocator.free(self.req_slots(r)[new_kv:])
            r.kv_len = new_kv

    def requeue_table_writes(self, writes: list) -> None:
        """Table writes of a batch that never ran go out with the next batch, in order."""
        self._pending_table_writes[:0] = writes

    def _write_row(self, r: Req, start: int, slots: torch.Tensor) -> None:
        n = slots.shape[0]  # (len() and torch setitem cost ~10 us: this runs per request per step)
        if n == 0:
            return
        self._table_np[r.req_pool_idx, start : start + n] = np.asarray(slots)
        self._pending_table_writes.append((r.req_pool_idx, start, slots))

    # -- accounting --------------------------------------------------------------------------

    def owned_slots(self) -> list[torch.Tensor]:
        """Slots owned by running requests (not by the tree), for the integrity check."""
        return [self.req_slots(r)[r.cached_len :] for r in self.running]
