"""KV cache memory: per-layer K/V buffers, the slot allocator, and the request-to-token table.

A *slot* is one token's K/V entry in every layer (row `slot` of `k_buffer[l]`/`v_buffer[l]`).
Slots are grouped into *pages* of `page_size` consecutive slots; page p holds slots
`p*P .. p*P + P - 1`. Page 0 is reserved: slot 0 is the dummy target of padded rows
(CUDA-graph decode padding writes there) and is never handed out.

Ownership (checked by `check_kv_integrity`): every allocated slot is owned by exactly one
holder, either the radix tree (`RadixCache.cached_slots()`) or one running request (the slots
past its locked cached prefix). A free slot is owned by nobody.

    page:   |  0 (reserved) |      1      |      2      |      3      |
    slot:   | 0  1  2  3    | 4  5  6  7  | 8  9 10 11  |12 13 14 15  |
    state:  | -  -  -  -    | A  A  A  .  | T  T  T  T  | free        |
            A = allocated to a request, "." = slack in the request's last page (reserved for
            its next tokens via alloc_extend, not allocated), T = cached in the tree.
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from sgl.backend.radix_cache import RadixCache

__all__ = ["KVPool", "ReqToTokenPool", "SlotAllocator", "check_kv_integrity"]


def _as_numpy(slots: torch.Tensor | np.ndarray | Sequence[int]) -> np.ndarray:
    """View (no copy when possible) of slot indices as a 1-D int64 numpy array."""
    if isinstance(slots, torch.Tensor):
        if slots.dtype != torch.int64 or slots.device.type != "cpu" or slots.requires_grad:
            slots = slots.detach().to(device="cpu", dtype=torch.int64)
        return slots.reshape(-1).numpy()
    return np.asarray(slots, dtype=np.int64).reshape(-1)


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """np.unique without its overhead (it dominates small calls); sorted distinct values."""
    s = np.sort(a)
    return s[np.concatenate(([True], s[1:] != s[:-1]))] if s.size > 1 else s


class SlotAllocator:
    """CPU bookkeeping of free KV slots, page-granular.

    Free pages live in a fixed-size LIFO stack (`_stack[:_top]`), so allocating or freeing n
    pages is O(n) numpy work with no per-token Python. Invariants (see `check_integrity`):
      * a page is either on the free stack or in use, never both; page 0 is neither;
      * a free page has no allocated slot; an in-use page has >= 1 allocated slot
        (`_page_fill[p]` counts them), so it returns to the stack when its last slot is freed;
      * `_allocated[s]` is True exactly for slots handed out and not yet freed.
    """

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if page_size < 1 or num_slots % page_size != 0 or num_slots < 2 * page_size:
            raise ValueError(f"bad allocator shape: num_slots={num_slots} page_size={page_size}")
        self.page_size = page_size
        self.num_slots = num_slots
        self.num_pages = num_slots // page_size
        self._allocated = np.zeros(num_slots, dtype=bool)
        self._page_fill = np.zeros(self.num_pages, dtype=np.int64)
        self._stack = np.empty(self.num_pages - 1, dtype=np.int64)
        # Highest page ever handed out: the free stack hands out low pages first and reuses
        # freed ones first, so pages above it were never written (KVPool's lazy CPU memory).
        self.high_water_page = 0
        self.clear()

    def clear(self) -> None:
        """Free everything (engine flush/reset)."""
        # Descending so the first allocations pop pages 1, 2, 3... (readable in tests).
        self._stack[:] = np.arange(self.num_pages - 1, 0, -1, dtype=np.int64)
        self._top = self.num_pages - 1
        self._allocated[:] = False
        self._page_fill[:] = 0
        self._num_allocated = 0

    # ---- sizes (in tokens) ----
    @property
    def capacity(self) -> int:
        """Allocatable tokens (all pages but the reserved one)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def num_free(self) -> int:
        """Tokens in free pages; `num_free + num_used == capacity` always."""
        return self._top * self.page_size

    @property
    def num_used(self) -> int:
        """Tokens in pages in use (allocated slots plus slack of partially filled pages)."""
        return self.capacity - self.num_free

    @property
    def num_allocated(self) -> int:
        """Exactly the slots handed out and not yet freed."""
        return self._num_allocated

    def available_size(self) -> int:
        return self.num_free

    # ---- allocation ----
    def _pop_pages(self, n: int) -> np.ndarray:
        pages = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        if n:
            self.high_water_page = max(self.high_water_page, int(pages.max()))
        return pages

    def _mark_allocated(self, slots: np.ndarray) -> None:
        if self._allocated[slots].any():
            bad = int(slots[self._allocated[slots]][0])
            raise AssertionError(f"slot {bad} handed out twice (already allocated)")
        self._allocated[slots] = True
        self._num_allocated += int(slots.size)

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` fresh slots (starting new pages), int64 CPU tensor, or None if not enough free."""
        if n < 0:
            raise ValueError(f"alloc of {n} slots")
        if self.page_size > 1:
            return self.alloc_extend([-1], [n])
        if n > self._top:
            return None
        slots = self._pop_pages(n)
        self._mark_allocated(slots)
        return torch.from_numpy(slots)

    def alloc_extend(self, last_locs: Sequence[int], extend_lens: Sequence[int]) -> torch.Tensor | None:
        """Slots for several requests at once, request-major: `[sum(extend_lens)]` int64.

        Request b first fills the rest of the page holding `last_locs[b]` (the slot of its last
        token, -1 if it has none), then takes whole new pages. All or nothing: None when the
        free pages do not suffice. Token i of a request thus always sits at page offset
        `i % page_size`, which is what keeps radix-cached prefixes page-aligned.
        """
        P = self.page_size
        if P == 1:
            return self.alloc(int(sum(extend_lens)))
        last = np.asarray(last_locs, dtype=np.int64).reshape(-1)
        ext = np.asarray(extend_lens, dtype=np.int64).reshape(-1)
        if last.shape != ext.shape or (ext < 0).any():
            raise ValueError("last_locs and extend_lens must have equal length, lens >= 0")
        start = last + 1  # next slot right after the last token
        n = int(ext.sum())
        if n == ext.size and n and int(ext.max()) == 1:
            return self._alloc_one_each(last, start)
        has_room = (last >= 0) & (start % P != 0)
        room = np.where(has_room, P - start % P, 0)
        in_page = np.minimum(ext, room)  # tokens that continue the current page
        new_pages = (ext - in_page + P - 1) // P
        total_pages = int(new_pages.sum())
        if total_pages > self._top:
            return None
        if (has_room & ~self._allocated[np.maximum(last, 0)]).any():
            raise AssertionError("alloc_extend: a last_loc is not an allocated slot")
        pages = self._pop_pages(total_pages)
        req = np.repeat(np.arange(ext.size), ext)  # [n] request of each new token
        tok_start = np.cumsum(ext) - ext
        i = np.arange(n, dtype=np.int64) - tok_start[req]  # [n] index within its request
        page_start = np.cumsum(new_pages) - new_pages  # first of request b's pages in `pages`
        slots = start[req] + i  # [n] right for tokens that continue their current page
        k = i - in_page[req]  # [n] index among the request's tokens that go into new pages
        fresh = k >= 0
        if fresh.any():
            kf, rf = k[fresh], req[fresh]
            slots[fresh] = pages[page_start[rf] + kf // P] * P + kf % P
        slots = slots.astype(np.int64, copy=False)
        self._mark_allocated(slots)
        np.add.at(self._page_fill, slots // P, 1)
        return torch.from_numpy(slots)

    def _alloc_one_each(self, last: np.ndarray, start: np.ndarray) -> torch.Tensor | None:
        """Decode fast path of alloc_extend (pages): one token per request, ~10 numpy ops."""
        P = self.page_size
        need_page = (last < 0) | (start % P == 0)  # [B] no room left in the current page
        k = int(np.count_nonzero(need_page))
        if k > self._top:
            return None
        if not self._allocated[last[~need_page]].all():
            raise AssertionError("alloc_extend: a last_loc is not an allocated slot")
        slots = start.copy()
        if k:
            slots[need_page] = self._pop_pages(k) * P
        self._mark_allocated(slots)
        np.add.at(self._page_fill, slots // P, 1)
        return torch.from_numpy(slots)

    def free(self, slots: torch.Tensor | np.ndarray | Sequence[int]) -> None:
        """Release slots; a page returns to the free stack once its last allocated slot goes."""
        arr = _as_numpy(slots)
        if arr.size == 0:
            return
        if ((arr <= 0) | (arr >= self.num_slots)).any():
            raise AssertionError(f"free of out-of-range or reserved slot in {arr.tolist()[:8]}...")
        if not self._allocated[arr].all():
            bad = int(arr[~self._allocated[arr]][0])
            raise AssertionError(f"double free: slot {bad} is not allocated")
        if arr.size > 1 and _sorted_unique(arr).size != arr.size:
            raise AssertionError("free: the same slot appears twice in one call")
        self._allocated[arr] = False
        self._num_allocated -= int(arr.size)
        if self.page_size == 1:
            emptied = arr
        else:
            pages = arr // self.page_size
            np.subtract.at(self._page_fill, pages, 1)
            emptied = _sorted_unique(pages[self._page_fill[pages] == 0])
        k = int(emptied.size)
        self._stack[self._top : self._top + k] = emptied
        self._top += k

    # ---- inspection ----
    def allocated_mask(self) -> np.ndarray:
        """`[num_slots]` bool copy: True for slots handed out and not freed."""
        return self._allocated.copy()

    def check_integrity(self) -> None:
        free_pages = self._stack[: self._top]
        if free_pages.size and (free_pages.min() < 1 or free_pages.max() >= self.num_pages):
            raise AssertionError("free stack holds page 0 or an out-of-range page")
        if _sorted_unique(free_pages).size != free_pages.size:
            raise AssertionError("a page is on the free stack twice")
        fill = self._allocated.reshape(self.num_pages, self.page_size).sum(axis=1)
        if fill[0] != 0:
            raise AssertionError("reserved page 0 has allocated slots")
        if (fill[free_pages] != 0).any():
            p = int(free_pages[fill[free_pages] != 0][0])
            raise AssertionError(f"page {p} is free and has allocated slots")
        in_use = np.ones(self.num_pages, dtype=bool)
        in_use[0] = False
        in_use[free_pages] = False
        if (fill[in_use] == 0).any():
            p = int(np.flatnonzero(in_use & (fill == 0))[0])
            raise AssertionError(f"page {p} is neither free nor holds an allocated slot (leak)")
        if self.page_size > 1 and not np.array_equal(fill, self._page_fill):
            raise AssertionError("per-page fill counters disagree with the slot mask")
        if int(fill.sum()) != self._num_allocated:
            raise AssertionError("num_allocated counter disagrees with the slot mask")


class ReqToTokenPool:
    """`req_to_token[row, i]` = KV slot of token i of the request at `row` (int32, on device).

    Row 0 is reserved for padded batch rows (it stays all zeros = the dummy slot), so the table
    has `max_reqs + 1` rows and `alloc` hands out rows 1..max_reqs. `table` is a CPU int64
    mirror of the same shape for the scheduler, which must never read the device table (a
    sync); whoever writes one keeps the other in step (this class writes neither).
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((max_reqs + 1, max_context_len), dtype=torch.int32, device=device)
        self.table = torch.zeros((max_reqs + 1, max_context_len), dtype=torch.int64)
        self._free_rows: list[int] = list(range(max_reqs, 0, -1))  # pop() yields 1 first
        self._is_free = [False] + [True] * max_reqs

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._is_free[row] = False
        return row

    def free(self, row: int) -> None:
        if row <= 0 or row > self.max_reqs or self._is_free[row]:
            raise AssertionError(f"free of reserved, out-of-range or already free row {row}")
        self._is_free[row] = True
        self._free_rows.append(row)


class KVPool:
    """Per-layer K/V buffers `[num_slots, num_kv_heads, head_dim]` plus their `SlotAllocator`.

    `num_tokens` is the usable capacity; one extra page (page 0, slot 0) is reserved, and the
    total is rounded up to whole pages.

    On the CPU the buffers are views of one anonymous memory map: the capacity is reserved as
    address space only, and the OS supplies zeroed memory page by page as slots are first
    written, so the pool grows on demand up to its cap (`touched_bytes` follows the
    allocator's high-water page). On a GPU they are allocated and zeroed up front.
    """

    def __init__(
        self,
        num_tokens: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        page_size: int = 1,
    ) -> None:
        if num_tokens < 1:
            raise ValueError(f"KV pool needs at least one token, got {num_tokens}")
        num_pages = -(-num_tokens // page_size) + 1
        self.num_slots = num_pages * page_size
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (self.num_slots, num_kv_heads, head_dim)
        self._arena: mmap.mmap | None = None
        if self.device.type == "cpu":
            buffers = self._lazy_buffers(2 * num_layers, shape, dtype)
            self.k_buffer, self.v_buffer = buffers[:num_layers], buffers[num_layers:]
        else:
            self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = SlotAllocator(self.num_slots, page_size)

    def _lazy_buffers(self, count: int, shape: tuple[int, int, int],
                      dtype: torch.dtype) -> list[torch.Tensor]:
        """`count` zero buffers of `shape` over one anonymous map (no memory until written)."""
        per_buffer = shape[0] * shape[1] * shape[2] * dtype.itemsize
        self._arena = mmap.mmap(-1, count * per_buffer)  # private, zero-filled on first touch
        flat = torch.frombuffer(self._arena, dtype=torch.uint8)
        return [flat[i * per_buffer:(i + 1) * per_buffer].view(dtype).view(shape)
                for i in range(count)]

    @property
    def bytes_per_slot(self) -> int:
        """One token's K and V in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def reserved_bytes(self) -> int:
        """The pool's capacity in bytes (on the CPU: address space, not memory)."""
        return self.num_slots * self.bytes_per_slot

    @property
    def touched_bytes(self) -> int:
        """Bytes of slots ever written: the pool's memory on the CPU (all of it on a GPU)."""
        if self._arena is None:
            return self.reserved_bytes
        pages = self.allocator.high_water_page + 1  # (page 0: the dummy slot padded rows write)
        return min(pages * self.page_size * self.bytes_per_slot, self.reserved_bytes)


def check_kv_integrity(
    allocator: SlotAllocator, tree: RadixCache | None, owned_slot_lists: Iterable[torch.Tensor]
) -> None:
    """Global check: every slot is free, or cached in the tree, or owned by exactly one request.

    `owned_slot_lists[i]` are the slots request i owns (those past its locked cached prefix).
    Raises AssertionError naming the slot and its holders. O(num_slots): for tests/debug mode.
    """
    allocator.check_integrity()
    holders: list[tuple[str, np.ndarray]] = []
    if tree is not None:
        tree.check_integrity()
        holders.append(("the radix tree", _as_numpy(tree.cached_slots())))
    holders += [(f"request #{i}", _as_numpy(s)) for i, s in enumerate(owned_slot_lists)]
    count = np.zeros(allocator.num_slots, dtype=np.int64)
    for name, arr in holders:
        if arr.size and (arr.min() <= 0 or arr.max() >= allocator.num_slots):
            raise AssertionError(f"{name} holds the reserved slot 0 or an out-of-range slot")
        count += np.bincount(arr, minlength=allocator.num_slots)
    if (count > 1).any():
        s = int(np.flatnonzero(count > 1)[0])
        who = [name for name, arr in holders for _ in range(int((arr == s).sum()))]
        raise AssertionError(f"slot {s} held more than once: by {', '.join(who)}")
    allocated = allocator.allocated_mask()
    if (allocated & (count == 0)).any():
        s = int(np.flatnonzero(allocated & (count == 0))[0])
        n = int((allocated & (count == 0)).sum())
        raise AssertionError(f"leak: slot {s} (and {n - 1} more) allocated but held by nobody")
    if ((count > 0) & ~allocated).any():
        s = int(np.flatnonzero((count > 0) & ~allocated)[0])
        who = [name for name, arr in holders if (arr == s).any()]
        raise AssertionError(f"slot {s} is free in the allocator but held by {who[0]}")
