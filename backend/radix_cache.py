"""Token radix tree mapping cached prefixes to KV slots (SGLang's RadixAttention idea).

Each node holds a run of tokens (`key`, a tuple) and the KV slots of those tokens (`value`,
an int64 CPU tensor of the same length). A path from the root spells a cached prefix; the
concatenated values are that prefix's KV slots. Children are keyed by their first token
(page_size 1) or by their first page of tokens (page_size > 1; every key length is then a
multiple of page_size, so cached prefixes are always whole pages).

Ownership and locking (the memory accounting the scheduler relies on)::

    request tokens:  [ t0 ... t(c-1) | tc ... t(n-1) ]
    request slots:   [ tree-owned     | request-owned ]
                       ^ cached prefix c = prefix_len(last_node); last_node is locked, so the
                         whole root->last_node path is safe from eviction.

  * `match_prefix` + `inc_lock_ref(last_node)` on admission: the request reads the tree's
    slots for the prefix and owns only what it allocates afterwards.
  * `insert(tokens, slots)` returns n = length ALREADY cached. The tree takes ownership of
    `slots[n:]`; the caller keeps `slots[:n]`, each of which is either the tree's own slot
    (it came from a match) or a duplicate the caller must free. `cache_unfinished` and
    `cache_finished` do that freeing (and the re-locking) for you; prefer them.
  * `evict` only removes unlocked leaves, least recently used first.

With the cache off the engine uses `prefix_cache.NoPrefixCache`, same interface, nothing cached.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from sgl.backend.kv_pool import SlotAllocator

__all__ = ["MatchResult", "RadixCache", "TreeNode"]

_EMPTY = torch.empty(0, dtype=torch.int64)
_ids = itertools.count()


class TreeNode:
    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access", "prefix_len", "id")

    def __init__(self, key: tuple[int, ...], value: torch.Tensor, parent: TreeNode | None, prefix_len: int) -> None:
        self.key = key
        self.value = value  # [len(key)] int64 KV slots
        self.parent = parent
        self.children: dict[object, TreeNode] = {}  # first token (or first page tuple) -> child
        self.lock_ref = 0  # requests whose locked path passes through this node
        self.last_access = 0
        self.prefix_len = prefix_len  # tokens from the root through the end of this node
        self.id = next(_ids)  # heap tie-breaker

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, prefix_len={self.prefix_len}, lock={self.lock_ref})"


class MatchResult(NamedTuple):
    slots: torch.Tensor  # [m] int64 KV slots of the matched prefix
    last_node: TreeNode  # node ending exactly at token m (root when m == 0)

    @property
    def prefix_len(self) -> int:
        return int(self.slots.shape[0])


def _as_tokens(tokens: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    if isinstance(tokens, tuple):
        return tokens
    if hasattr(tokens, "tolist"):  # torch tensor / numpy array
        return tuple(tokens.tolist())  # type: ignore[union-attr]
    return tuple(tokens)


def _common_len(key: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
    """Length of the common prefix of `key` and `tokens[pos:]` (C-speed in the usual cases)."""
    n = min(len(key), len(tokens) - pos)
    if key[:n] == tokens[pos : pos + n]:
        return n
    lo, hi = 0, n  # key[:lo] matches, key[:hi] does not: bisect with slice compares
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key[:mid] == tokens[pos : pos + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixCache:
    caches = True  # (prefix_cache.PrefixCache)

    def __init__(self, allocator: SlotAllocator, page_size: int = 1) -> None:
        if page_size != getattr(allocator, "page_size", page_size):
            raise ValueError("radix cache and allocator must use the same page_size")
        self.allocator = allocator
        self.page_size = page_size
        self._clock = itertools.count(1)  # logical time for LRU (deterministic, no ties)
        self._new_root()

    def _new_root(self) -> None:
        self.root = TreeNode((), _EMPTY, None, 0)
        self.root.lock_ref = 1  # the root is never evicted; its lock is permanent
        self._evictable = 0  # tokens in unlocked nodes
        self._protected = 0  # tokens in locked nodes
        self._leaves: set[TreeNode] = set()  # non-root nodes without children

    def reset(self) -> None:
        """Flush the cache, freeing every cached slot. Illegal while any request holds a lock."""
        if self._protected != 0 or self.root.lock_ref != 1:
            raise AssertionError("reset() while nodes are locked")
        slots = self.cached_slots()
        if slots.numel():
            self.allocator.free(slots)
        self._new_root()

    # ---- sizes (tokens) ----
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # ---- helpers ----
    def _child_key(self, tokens: tuple[int, ...], pos: int) -> object:
        return tokens[pos] if self.page_size == 1 else tokens[pos : pos + self.page_size]

    def _page_floor(self, n: int) -> int:
        return n - n % self.page_size

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut `node` after `at` tokens; returns the new upper part (node keeps the rest).

        parent -> node[0:len]   becomes   parent -> upper[0:at] -> node[at:len]
        The upper part inherits node's lock count (every lock through node passes through it),
        so the evictable/protected counters and the leaf set are unchanged.
        """
        assert 0 < at < len(node.key) and at % self.page_size == 0
        parent = node.parent
        assert parent is not None
        upper = TreeNode(node.key[:at], node.value[:at], parent, node.prefix_len - len(node.key) + at)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        parent.children[self._child_key(node.key, 0)] = upper
        node.key, node.value, node.parent = node.key[at:], node.value[at:], upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    def _walk(self, tokens: tuple[int, ...], now: int) -> tuple[TreeNode, list[torch.Tensor]]:
        """Follow the longest page-aligned cached prefix of `tokens`, splitting the node where the
        match ends inside it. Returns the last node and the values along the path."""
        node, pos, values = self.root, 0, []
        node.last_access = now
        end = self._page_floor(len(tokens))
        tokens = tokens[:end]
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            m = self._page_floor(_common_len(child.key, tokens, pos))
            if m == 0:  # only possible with pages: first page equal is the dict key, so m >= P
                break
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = now
            values.append(child.value)
            node, pos = child, pos + m
        return node, values

    # ---- public API ----
    def match_prefix(self, tokens: Sequence[int] | torch.Tensor) -> MatchResult:
        """Longest cached prefix (a multiple of page_size). Marks the path as recently used."""
        node, values = self._walk(_as_tokens(tokens), next(self._clock))
        # A fresh tensor (cat/clone), never a view of a node's value: the caller may write to it.
        slots = torch.cat(values) if len(values) > 1 else (values[0].clone() if values else _EMPTY)
        return MatchResult(slots, node)

    def _insert(
        self, tokens: tuple[int, ...], slots: torch.Tensor
    ) -> tuple[int, list[torch.Tensor], TreeNode]:
        """Insert; returns (already-cached length n, tree values for tokens[:n], node ending at
        len(tokens)). The tree takes ownership of slots[n:]."""
        assert len(tokens) == slots.shape[0] and len(tokens) % self.page_size == 0
        node, values = self._walk(tokens, next(self._clock))
        n = node.prefix_len
        if n < len(tokens):
            leaf = TreeNode(tokens[n:], slots[n:].clone(), node, len(tokens))
            leaf.last_access = node.last_access
            node.children[self._child_key(tokens, n)] = leaf
            self._leaves.discard(node)
            self._leaves.add(leaf)
            self._evictable += len(leaf.key)
            node = leaf
        return n, values, node

    def insert(self, tokens: Sequence[int] | torch.Tensor, slots: torch.Tensor) -> int:
        """Cache `tokens` -> `slots` (equal lengths; a multiple of page_size).

        Returns n, the prefix length that was already cached. Ownership afterwards: the tree
        owns `slots[n:]`; the caller still owns those of `slots[:n]` that differ from the tree's
        slots (duplicates to free).
        """
        toks = _as_tokens(tokens)
        slots = slots.to(dtype=torch.int64, device="cpu")
        if len(toks) != slots.shape[0] or len(toks) % self.page_size:
            raise ValueError(f"insert needs equal, page-aligned lengths: {len(toks)} tokens, {slots.shape[0]} slots")
        return self._insert(toks, slots)[0]

    def _insert_and_free_duplicates(self, toks: tuple[int, ...], slots: torch.Tensor) -> tuple[torch.Tensor, TreeNode]:
        n, values, node = self._insert(toks, slots)
        if n:
            # (in numpy: five small torch ops cost ~30 us, once per cached prompt and per
            # finished request)
            own = slots.numpy()
            tree_prefix = np.concatenate([v.numpy() for v in values]) if len(values) > 1 else values[0].numpy()
            dup = own[:n][own[:n] != tree_prefix]  # slots already cached under other slots
            if dup.size:
                self.allocator.free(dup)
            return torch.from_numpy(np.concatenate((tree_prefix, own[n:]))), node
        return slots.clone(), node  # never alias the caller's tensor (often a req_to_token row view)

    def cache_unfinished(
        self, tokens: Sequence[int] | torch.Tensor, slots: torch.Tensor, old_last_node: TreeNode
    ) -> tuple[torch.Tensor, TreeNode]:
        """Cache a still-running request's computed tokens (after a prefill or prefill chunk).

        `slots[i]` holds the KV of `tokens[i]`; `old_last_node` is the request's locked node.
        Inserts the page-aligned part L = floor(len, page_size), frees the request's duplicate
        slots, locks the new last node and unlocks the old one. Returns (slots for tokens[:L]
        as the tree holds them: write them into req_to_token, new last node). Afterwards the
        request owns exactly `slots[L:]` (its unaligned tail) plus anything it allocates later.
        """
        toks = _as_tokens(tokens)
        slots = slots.to(dtype=torch.int64, device="cpu")
        L = self._page_floor(len(toks))
        prefix, node = self._insert_and_free_duplicates(toks[:L], slots[:L])
        self.inc_lock_ref(node)
        self.dec_lock_ref(old_last_node)
        return prefix, node

    def cache_finished(self, tokens: Sequence[int] | torch.Tensor, slots: torch.Tensor, last_node: TreeNode) -> None:
        """Cache a finished request and release everything it holds.

        `tokens` are exactly the tokens whose KV is written; `slots` holds them and may be
        longer (slots allocated beyond len(tokens), e.g. for a last token never computed, are
        freed). The page-aligned part is inserted, duplicates and the unaligned tail are freed,
        and `last_node` is unlocked. Afterwards the request owns no slots.
        Precondition: len(tokens) >= the request's cached (tree-owned) prefix length, since
        `slots[page_floor(len(tokens)):]` are freed as the request's own.
        """
        toks = _as_tokens(tokens)
        slots = slots.to(dtype=torch.int64, device="cpu")
        assert slots.shape[0] >= len(toks), "fewer slots than tokens"
        L = self._page_floor(len(toks))
        if L:
            self._insert_and_free_duplicates(toks[:L], slots[:L])
        if slots.shape[0] > L:
            self.allocator.free(slots[L:])
        self.dec_lock_ref(last_node)

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect node and its ancestors from eviction (one more request uses this path)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise AssertionError(f"dec_lock_ref on unlocked {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` cached tokens if possible, least recently used leaves first
        (parents become candidates once their last child goes). Returns tokens freed."""
        heap = [(n.last_access, n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None and not node.children and node.lock_ref == 0
            del parent.children[self._child_key(node.key, 0)]
            node.parent = None
            self._leaves.discard(node)
            self._evictable -= len(node.key)
            num_freed += len(node.key)
            freed.append(node.value)
            if parent is not self.root and not parent.children:
                self._leaves.add(parent)
                if parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if freed:
            self.allocator.free(torch.cat(freed))
        return num_freed

    # ---- inspection ----
    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def cached_slots(self) -> torch.Tensor:
        """All slots held by the tree, `[total_size()]` int64 (order unspecified)."""
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else _EMPTY

    def check_integrity(self) -> None:
        """Tree invariants; raises AssertionError naming the broken one."""
        P = self.page_size
        assert self.root.lock_ref == 1 and self.root.parent is None and not self.root.key, "bad root"
        evictable = protected = 0
        leaves: set[TreeNode] = set()
        for node in [self.root, *self._nodes()]:
            child_locks = 0
            for ck, child in node.children.items():
                assert child.parent is node, f"{child!r} has the wrong parent"
                assert ck == self._child_key(child.key, 0), f"child key {ck!r} != first token(s) of {child!r}"
                child_locks += child.lock_ref
            if node is self.root:
                continue
            assert len(node.key) > 0 and len(node.key) % P == 0, f"{node!r}: key length not whole pages"
            assert node.value.shape == (len(node.key),), f"{node!r}: key/value lengths differ"
            parent_len = node.parent.prefix_len  # type: ignore[union-attr]
            assert node.prefix_len == parent_len + len(node.key), f"{node!r}: prefix_len"
            assert node.lock_ref >= child_locks, f"{node!r}: locked child under a less-locked parent"
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            if not node.children:
                leaves.add(node)
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"size counters {(self._evictable, self._protected)} != actual {(evictable, protected)}"
        )
        assert leaves == self._leaves, "leaf set out of sync"
        slots = np.sort(self.cached_slots().numpy())
        assert not (slots[1:] == slots[:-1]).any(), "a slot is cached twice"
        if slots.size:
            assert slots[0] > 0, "the reserved slot 0 is cached"
            assert self.allocator.allocated_mask()[slots].all(), "a cached slot is free in the allocator"
