"""KVManager: a request's KV slots, its `req_to_token` row, and its share of the prefix cache.

The scheduler decides; this class does the bookkeeping of each decision (admit, extend,
cache a computed prompt, roll back, release), keeping three things consistent:

* slot ownership (kv_pool.py): every slot is free, in the tree, or owned by one request;
* the CPU mirror `req_pool.table`, written here at once;
* the device `req_to_token` table, written only by the runner, in step order, from the
  `(row, start, slots)` writes queued here and handed out with the next batch
  (`take_table_writes`), so an in-flight step never sees a half-updated row.

A request's row, with its cached prefix locked in the tree through `last_node`::

    row:   | tree's slots (locked) |  slots the request owns  |
           0                  cached_len                  kv_len
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sgl.backend.radix_cache import MatchResult
from sgl.backend.req import Req

TableWrite = tuple[int, int, "torch.Tensor | np.ndarray"]  # (row, first column, slots)


class KVManager:
    def __init__(self, allocator: Any, req_pool: Any, tree: Any, page_size: int) -> None:
        self.allocator = allocator
        self.req_pool = req_pool
        self._table_np = req_pool.table.numpy()  # a view of the CPU mirror, for fast writes
        self.tree = tree
        self.page_size = page_size
        self._pending_writes: list[TableWrite] = []

    # -- memory ------------------------------------------------------------------------------

    def available(self) -> int:
        """Slots a step could get: free ones plus cached ones that can be evicted."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def make_room(self, need: int) -> bool:
        """Evict unlocked cache leaves until `need` slots are free, if that is possible."""
        short = need - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        return self.available() >= need

    def extend(self, reqs: list[Req], lens: list[int], last_locs: list[int] | None = None) -> torch.Tensor | None:
        """Slots for `lens[i]` new tokens of `reqs[i]`, evicting cached leaves if needed."""
        if self.page_size > 1 and last_locs is None:
            last_locs = [int(self.req_pool.table[r.req_pool_idx, r.kv_len - 1]) if r.kv_len else -1
                         for r in reqs]

        def attempt() -> torch.Tensor | None:
            if self.page_size == 1:
                return self.allocator.alloc(sum(lens))
            return self.allocator.alloc_extend(last_locs, lens)

        slots = attempt()
        if slots is None and self.make_room(sum(lens) + self.page_size * len(reqs)):
            slots = attempt()
        return slots

    # -- a request's row ---------------------------------------------------------------------

    def admit(self, r: Req, match: MatchResult, cached: int, n: int, need: int) -> torch.Tensor | None:
        """Give `r` a row holding its first `cached` tokens from the tree and slots for `n`
        more, if `need` slots are available; None (nothing held) otherwise."""
        self.tree.inc_lock_ref(match.last_node)  # before counting: locked slots can't be evicted
        row = self.req_pool.alloc() if self.req_pool.num_free and self.available() >= need else None
        slots = None
        if row is not None:
            last = [int(match.slots[cached - 1]) if cached else -1]
            slots = self.extend([r], [n], last_locs=last)
        if slots is None:
            if row is not None:
                self.req_pool.free(row)
            self.tree.dec_lock_ref(match.last_node)
            return None
        r.req_pool_idx, r.last_node, r.cached_len, r.kv_len = row, match.last_node, cached, cached
        self.write_row(r, 0, match.slots[:cached])
        return slots

    def req_slots(self, r: Req, end: int | None = None) -> torch.Tensor:
        """A copy of the request's slots: the table row is reused by later requests, so
        nothing that outlives this call (radix tree values!) may be a view of it."""
        end = r.kv_len if end is None else end
        # (a numpy copy: torch's index-and-clone cost ~10 us, for every prompt cached and every
        # request released)
        return torch.from_numpy(self._table_np[r.req_pool_idx, :end].copy())

    def write_row(self, r: Req, start: int, slots: torch.Tensor | np.ndarray) -> None:
        n = slots.shape[0]  # (len() and torch setitem cost ~10 us: this runs per request per step)
        if n == 0:
            return
        self._table_np[r.req_pool_idx, start : start + n] = np.asarray(slots)
        self._pending_writes.append((r.req_pool_idx, start, slots))

    def release(self, r: Req, cache: bool) -> None:
        """Give back everything `r` holds. With `cache`, its computed KV joins the radix tree."""
        if r.req_pool_idx is None:
            return
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
        n -= n % self.page_size
        if n <= r.cached_len:
            return
        new_slots, new_node = self.tree.cache_unfinished(r.prompt_ids[:n], self.req_slots(r, n), r.last_node)
        self.write_row(r, 0, new_slots)
        r.last_node = new_node
        r.cached_len = new_slots.shape[0]  # what the cache took: n, or 0 when it caches nothing

    def truncate(self, r: Req, kv_len: int) -> None:
        """Free the request's slots from `kv_len` on (never into the cached prefix)."""
        assert kv_len >= r.cached_len, "rollback never cuts into cached KV"
        if kv_len < r.kv_len:
            # (the freed span read in place: a copy of the whole row cost a speculative step
            # more than the rest of its update)
            self.allocator.free(self._table_np[r.req_pool_idx, kv_len : r.kv_len])
            r.kv_len = kv_len

    # -- table writes ------------------------------------------------------------------------

    def take_table_writes(self) -> list[TableWrite]:
        writes, self._pending_writes = self._pending_writes, []
        return writes

    def requeue_table_writes(self, writes: list[TableWrite]) -> None:
        """Table writes of a batch that never ran go out with the next batch, in order."""
        self._pending_writes[:0] = writes
