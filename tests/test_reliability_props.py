"""Property tests for the radix cache and the slot allocator together (issue 7), against a
reference model.

test_radix_cache.py drives the tree through the scheduler's request lifecycle, and
test_kv_pool.py the allocator alone. What they leave out, and this machine adds:

* `match_prefix` checked against a reference (a dict from every cached token prefix to the
  slot holding its last token's KV): it returns the longest cached page-aligned prefix, with
  exactly the slots inserted for it;
* locks taken on arbitrary matched nodes, several on one path and nested, released in any
  order; `evict` never removes a locked node and evicting everything leaves exactly the
  protected tokens;
* slots allocated and freed directly (outside the tree) interleaved with all of the above,
  with `check_kv_integrity` proving that every slot is free, cached or owned exactly once.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sgl.backend.kv_pool import SlotAllocator, check_kv_integrity
from sgl.backend.radix_cache import RadixCache, TreeNode

TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=10)


class CacheModelMachine(RuleBasedStateMachine):
    @initialize(page=st.sampled_from([1, 2, 4]))
    def setup(self, page: int) -> None:
        self.P = page
        self.a = SlotAllocator(40 * page, page_size=page)
        self.t = RadixCache(self.a, page_size=page)
        # cached page-aligned prefix -> slots of its last page (the tree's unit is a page)
        self.model: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.locks: list[tuple[TreeNode, tuple[int, ...]]] = []  # (node, its path's tokens)
        self.owned: list[list[int]] = []  # slots held outside the tree
        self.seen: list[list[int]] = [[]]  # inserted sequences, to derive queries that hit

    def _query(self, data: st.DataObject) -> list[int]:
        """A random sequence, or a cut / extension / variation of one inserted before (random
        lists over a small alphabet rarely share long prefixes by chance)."""
        base = data.draw(st.sampled_from(self.seen))
        cut = data.draw(st.integers(0, len(base)))
        return base[:cut] + data.draw(TOKENS)

    # -- helpers -------------------------------------------------------------------------------

    def _floor(self, tokens: list[int]) -> list[int]:
        return tokens[: len(tokens) - len(tokens) % self.P]

    def _pages(self, tokens: tuple[int, ...] | list[int]) -> list[tuple[int, ...]]:
        """The page-aligned prefixes of `tokens`, shortest first."""
        return [tuple(tokens[:i]) for i in range(self.P, len(tokens) + 1, self.P)]

    def _tree_contents(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        out: dict[tuple[int, ...], tuple[int, ...]] = {}
        stack: list[tuple[TreeNode, tuple[int, ...]]] = [(self.t.root, ())]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                key, value = tuple(child.key), tuple(child.value.tolist())
                for i in range(self.P, len(key) + 1, self.P):
                    out[path + key[:i]] = value[i - self.P : i]
                stack.append((child, path + key))
        return out

    def _expected_match(self, tokens: list[int]) -> list[int]:
        slots: list[int] = []
        for prefix in self._pages(tokens):
            page = self.model.get(prefix)
            if page is None:
                break
            slots.extend(page)
        return slots

    # -- rules ---------------------------------------------------------------------------------

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        tokens = self._floor(self._query(data))
        if not tokens:
            return
        slots = self.a.alloc(len(tokens))
        if slots is None:
            return
        already = self.t.insert(tokens, slots)
        assert already == len(self._expected_match(tokens)), "insert reported the wrong cached length"
        if already:
            self.a.free(slots[:already])  # the caller frees the duplicates it computed
        self.seen.append(tokens)
        for prefix in self._pages(tokens):
            n = len(prefix)
            self.model.setdefault(prefix, tuple(slots[n - self.P : n].tolist()))

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        tokens = self._query(data)
        m = self.t.match_prefix(tokens)
        expected = self._expected_match(tokens)
        assert m.slots.tolist() == expected, "match_prefix disagrees with the reference"
        assert m.last_node.prefix_len == len(expected)

    @rule(data=st.data(), times=st.integers(1, 2))
    def lock(self, data: st.DataObject, times: int) -> None:
        tokens = self._query(data)
        m = self.t.match_prefix(tokens)
        for _ in range(times):
            self.t.inc_lock_ref(m.last_node)
            self.locks.append((m.last_node, tuple(tokens[: m.prefix_len])))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 99))
    def unlock(self, i: int) -> None:
        node, _ = self.locks.pop(i % len(self.locks))
        self.t.dec_lock_ref(node)

    @rule(n=st.integers(0, 50) | st.just(10**6))
    def evict(self, n: int) -> None:
        evictable = self.t.evictable_size()
        free_before = self.a.num_free
        freed = self.t.evict(n)
        assert freed >= min(n, evictable)
        assert self.a.num_free >= free_before + (freed if self.P == 1 else 0)
        contents = self._tree_contents()
        gone = set(self.model) - set(contents)
        assert len(gone) * self.P == freed
        assert set(contents) <= set(self.model)
        for node, path in self.locks:  # a locked path is never evicted, nor any of its prefixes
            assert all(p in contents for p in self._pages(path)), "a locked node was evicted"
            assert node.parent is not None or node is self.t.root
        for prefix in gone:
            self.model.pop(prefix)
        if n >= 10**6:
            assert self.t.total_size() == self.t.protected_size(), "evicting all left unlocked tokens"

    @rule(n=st.integers(1, 9))
    def allocate(self, n: int) -> None:
        slots = self.a.alloc(n)
        if slots is not None:
            self.owned.append(slots.tolist())

    @precondition(lambda self: self.owned)
    @rule(i=st.integers(0, 99))
    def free(self, i: int) -> None:
        self.a.free(torch.tensor(self.owned.pop(i % len(self.owned)), dtype=torch.int64))

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "t"):
            return
        check_kv_integrity(self.a, self.t, [torch.tensor(o, dtype=torch.int64) for o in self.owned])
        assert self._tree_contents() == self.model
        locked_pages = {p for _, path in self.locks for p in self._pages(path)}
        assert self.t.protected_size() == len(locked_pages) * self.P
        assert self.t.evictable_size() == (len(self.model) - len(locked_pages)) * self.P


CacheModelMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestCacheModelMachine = CacheModelMachine.TestCase
