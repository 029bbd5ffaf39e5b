"""Radix cache: unit tests per operation, then a stateful property test that drives it the way
the scheduler does (admit, extend, cache, finish, abort, evict) and checks global ownership."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sgl.backend.kv_pool import SlotAllocator, check_kv_integrity
from sgl.backend.prefix_cache import NoPrefixCache
from sgl.backend.radix_cache import RadixCache, TreeNode


def make(page: int = 1, slots: int = 64, disable: bool = False) -> tuple[SlotAllocator, Any]:
    a = SlotAllocator(slots, page_size=page)
    return a, (NoPrefixCache(a) if disable else RadixCache(a, page_size=page))


def put(a: SlotAllocator, t: RadixCache, tokens: list[int]) -> torch.Tensor:
    """Allocate fresh slots for `tokens` and insert them; frees the caller's duplicates."""
    s = a.alloc(len(tokens))
    assert s is not None
    n = t.insert(tokens, s)
    a.free(s[:n])  # fresh slots: the whole already-cached prefix is duplicate
    return s


def test_insert_match_and_split() -> None:
    a, t = make()
    s = put(a, t, [1, 2, 3, 4])
    m = t.match_prefix([1, 2, 3, 4, 5])
    assert m.slots.tolist() == s.tolist() and m.prefix_len == 4 and m.last_node.prefix_len == 4
    m = t.match_prefix([1, 2, 9])  # ends inside the node: split at 2
    assert m.slots.tolist() == s[:2].tolist()
    assert m.last_node.prefix_len == 2 and len(m.last_node.children) == 1
    assert t.match_prefix([7]).prefix_len == 0 and t.match_prefix([]).last_node is t.root
    s2 = a.alloc(2)
    assert s2 is not None
    assert t.insert([1, 2, 7, 8], torch.cat([s[:2], s2])) == 2  # same slots for the prefix
    assert t.total_size() == 6 and t.evictable_size() == 6 and t.protected_size() == 0
    assert len(t.root.children[1].children) == 2
    t.check_integrity()
    check_kv_integrity(a, t, [])


def test_match_accepts_tensors_and_tuples() -> None:
    a, t = make()
    s = put(a, t, [5, 6, 7])
    assert t.match_prefix(torch.tensor([5, 6, 7])).slots.tolist() == s.tolist()
    assert t.match_prefix((5, 6)).prefix_len == 2


def test_insert_returns_cached_len_and_takes_only_new_part() -> None:
    a, t = make()
    put(a, t, [1, 2, 3])
    free_before = a.num_free
    s = a.alloc(5)
    assert s is not None
    assert t.insert([1, 2, 3, 4, 5], s) == 3
    a.free(s[:3])
    assert a.num_free == free_before - 2  # the tree kept exactly the 2 new slots
    assert t.match_prefix([1, 2, 3, 4, 5]).slots[3:].tolist() == s[3:].tolist()
    check_kv_integrity(a, t, [])
    with pytest.raises(ValueError):
        t.insert([1, 2], s[:1])


def test_pages_truncate_match_and_insert() -> None:
    a, t = make(page=4)
    s = put(a, t, list(range(10, 18)))  # two pages
    assert t.match_prefix(list(range(10, 17))).prefix_len == 4  # 7 tokens -> 1 whole page
    m = t.match_prefix(list(range(10, 16)) + [0, 0])  # diverges at 6 -> split at 4
    assert m.prefix_len == 4 and m.last_node.prefix_len == 4
    assert m.slots.tolist() == s[:4].tolist()
    assert t.match_prefix([10, 11, 12]).prefix_len == 0
    s2 = a.alloc(4)
    assert s2 is not None
    with pytest.raises(ValueError, match="page-aligned"):
        t.insert([1, 2, 3], s2[:3])
    # Diverging inside the first page: a sibling keyed by its whole first page.
    assert t.insert([10, 11, 12, 99], s2) == 0
    assert len(t.root.children) == 2
    t.check_integrity()
    check_kv_integrity(a, t, [])


def test_lock_protects_and_counts() -> None:
    a, t = make()
    put(a, t, [1, 2, 3, 4])
    m = t.match_prefix([1, 2])
    t.inc_lock_ref(m.last_node)
    assert (t.protected_size(), t.evictable_size()) == (2, 2)
    t.inc_lock_ref(m.last_node)
    assert t.evict(100) == 2  # only the unlocked tail [3, 4]
    assert t.total_size() == 2 and t.protected_size() == 2
    # Splitting a locked node keeps both halves locked.
    m1 = t.match_prefix([1])
    assert m1.last_node.lock_ref == 2 and m.last_node.lock_ref == 2
    t.dec_lock_ref(m.last_node)
    t.dec_lock_ref(m.last_node)
    assert t.protected_size() == 0 and t.evictable_size() == 2
    with pytest.raises(AssertionError):
        t.dec_lock_ref(m.last_node)
    t.check_integrity()


def test_evict_lru_order_and_parents_become_leaves() -> None:
    a, t = make()
    put(a, t, [1, 2, 3])
    put(a, t, [1, 2, 4])
    put(a, t, [5, 6])
    t.match_prefix([1, 2, 3])  # touch: [1,2]/[3] are now the most recent
    assert t.evict(1) == 1  # oldest leaf: [4]
    assert t.match_prefix([1, 2, 4]).prefix_len == 2
    assert t.match_prefix([5, 6]).prefix_len == 2  # touched again: [3] is now the oldest
    assert t.evict(1) == 1  # [3]; then [1,2] is a leaf, older than [5,6]
    assert t.evict(2) == 2
    assert t.match_prefix([1, 2, 3]).prefix_len == 0 and t.match_prefix([5, 6]).prefix_len == 2
    assert t.evict(100) == 2 and t.total_size() == 0
    assert a.num_free == a.capacity
    t.check_integrity()


def test_cache_unfinished_relocks_and_frees_duplicates() -> None:
    a, t = make()
    put(a, t, [1, 2, 3, 4])  # someone else's prompt
    m = t.match_prefix([1, 2, 3, 4, 5, 6])
    t.inc_lock_ref(m.last_node)
    cached = 2  # the request chose to reuse only 2 (e.g. prompt logprobs), owns the rest
    own = a.alloc(4)
    assert own is not None
    tokens, slots = [1, 2, 3, 4, 5, 6], torch.cat([m.slots[:cached], own])
    check_kv_integrity(a, t, [own])
    new_slots, node = t.cache_unfinished(tokens, slots, m.last_node)
    # own[0:2] duplicated tree slots for [3, 4] and are freed; own[2:] now belong to the tree.
    assert new_slots.tolist() == m.slots.tolist() + own[2:].tolist()
    assert node.prefix_len == 6 and node.lock_ref == 1 and m.last_node.lock_ref == 1
    assert t.protected_size() == 6
    check_kv_integrity(a, t, [])  # the request owns nothing now
    t.cache_finished(tokens, new_slots, node)
    assert t.protected_size() == 0
    check_kv_integrity(a, t, [])


def test_returned_slots_never_alias_inputs_or_tree() -> None:
    a, t = make()
    table = torch.zeros(10, dtype=torch.int64)  # stands in for a req_to_token CPU row
    s = a.alloc(3)
    assert s is not None
    table[:3] = s
    prefix, node = t.cache_unfinished([1, 2, 3], table[:3], t.root)
    table[:3] = 0  # the row is reused by another request
    assert prefix.tolist() == s.tolist()
    m = t.match_prefix([1, 2, 3])
    assert m.slots.tolist() == s.tolist()
    m.slots[0] = 0  # writing to a match result must not corrupt the tree
    t.check_integrity()
    t.cache_finished([1, 2, 3], prefix, node)
    check_kv_integrity(a, t, [])


def test_cache_finished_pages_frees_tail_and_extra_slots() -> None:
    a, t = make(page=4)
    slots = a.alloc(7)
    assert slots is not None
    tokens = list(range(100, 106))  # KV for 6 tokens; slot 7 was for a token never computed
    t.cache_finished(tokens, slots, t.root)
    assert t.total_size() == 4 and a.num_allocated == 4
    assert t.match_prefix(tokens).slots.tolist() == slots[:4].tolist()
    check_kv_integrity(a, t, [])


def test_cache_finished_duplicate_prompt() -> None:
    a, t = make()
    for _ in range(2):  # two requests with the same prompt, neither hit the cache
        s = a.alloc(5)
        assert s is not None
        t.cache_finished([1, 2, 3, 4, 5], s, t.root)
    assert t.total_size() == 5 and a.num_allocated == 5
    check_kv_integrity(a, t, [])


def test_no_prefix_cache_caches_nothing_behind_the_same_interface() -> None:
    a, t = make(disable=True)
    s = a.alloc(4)
    assert s is not None
    assert t.insert([1, 2, 3, 4], s) == 0 and a.num_allocated == 0  # dropped and freed
    assert t.match_prefix([1, 2, 3, 4]).prefix_len == 0 and not t.caches
    s = a.alloc(4)
    assert s is not None
    prefix, node = t.cache_unfinished([1, 2, 3], s[:3], t.root)
    assert prefix.numel() == 0 and node is t.root and a.num_allocated == 4  # still the request's
    t.cache_finished([1, 2, 3], s, node)
    assert a.num_allocated == 0 and t.total_size() == 0
    t.check_integrity()


def test_reset() -> None:
    a, t = make()
    put(a, t, [1, 2, 3])
    m = t.match_prefix([1, 2])
    t.inc_lock_ref(m.last_node)
    with pytest.raises(AssertionError, match="locked"):
        t.reset()
    t.dec_lock_ref(m.last_node)
    t.reset()
    assert t.total_size() == 0 and a.num_allocated == 0
    t.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    a, t = make()
    s = put(a, t, [1, 2, 3])
    t._evictable += 1
    with pytest.raises(AssertionError, match="size counters"):
        t.check_integrity()
    t._evictable -= 1
    put(a, t, [5, 6])
    other = t.match_prefix([5, 6]).last_node
    saved, other.value = other.value, s[:2].clone()  # two nodes claim the same slots
    with pytest.raises(AssertionError, match="cached twice"):
        t.check_integrity()
    other.value = saved
    t.check_integrity()
    a.free(s[:1])  # the tree still holds it
    with pytest.raises(AssertionError, match="free in the allocator"):
        t.check_integrity()


def test_match_speed_many_nodes() -> None:
    import time

    a, t = make(slots=20_000)
    prompt = list(range(2000))
    for i in range(1, 2000, 2):  # a chain of ~1000 nodes along the prompt, each with a branch
        put(a, t, prompt[:i] + [10_000 + i])
    put(a, t, prompt)
    t0 = time.perf_counter()
    m = t.match_prefix(prompt)
    dt = time.perf_counter() - t0
    assert m.prefix_len == 2000
    assert dt < 0.25, f"matching took {dt:.3f}s"  # loose bound: ~1000 nodes visited


# ---- property: the scheduler's lifecycle ----------------------------------------------------


class Req:
    def __init__(self, tokens: list[int], slots: list[int], cached: int, node: TreeNode) -> None:
        self.tokens, self.slots, self.cached, self.node = tokens, slots, cached, node


class RadixMachine(RuleBasedStateMachine):
    """Every slot is free, cached, or owned by one request; slot contents (modelled as the token
    prefix whose KV they hold) always match what the tree and the requests claim."""

    @initialize(page=st.sampled_from([1, 2, 4]), disable=st.booleans() | st.just(False))
    def setup(self, page: int, disable: bool) -> None:
        self.P = page
        self.a = SlotAllocator(48 * page // 2 + page, page_size=page)
        self.t = NoPrefixCache(self.a) if disable else RadixCache(self.a, page_size=page)
        self.reqs: list[Req] = []
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> prefix whose last token's KV it holds

    def _write(self, tokens: list[int], start: int, slots: list[int]) -> None:
        for i, s in enumerate(slots):
            self.kv[s] = tuple(tokens[: start + i + 1])

    def _alloc(self, last: int, n: int) -> list[int] | None:
        s = self.a.alloc_extend([last], [n])
        if s is None:
            self.t.evict(n + self.P)
            s = self.a.alloc_extend([last], [n])
        return None if s is None else s.tolist()

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=12), cut=st.integers(0, 12))
    def admit(self, prompt: list[int], cut: int) -> None:
        m = self.t.match_prefix(prompt)
        assert m.prefix_len % self.P == 0 and m.last_node.prefix_len == m.prefix_len
        assert all(self.kv[s] == tuple(prompt[: i + 1]) for i, s in enumerate(m.slots.tolist()))
        cached = min(m.prefix_len, cut - cut % self.P)  # a request may reuse less than matched
        self.t.inc_lock_ref(m.last_node)
        prefix = m.slots[:cached].tolist()
        new = self._alloc(prefix[-1] if prefix else -1, len(prompt) - cached)
        if new is None:
            self.t.dec_lock_ref(m.last_node)
            return
        self._write(prompt, cached, new)
        self.reqs.append(Req(list(prompt), prefix + new, cached, m.last_node))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99), extra=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def decode(self, i: int, extra: list[int]) -> None:
        r = self.reqs[i % len(self.reqs)]
        new = self._alloc(r.slots[-1], len(extra))
        if new is not None:
            r.tokens += extra
            self._write(r.tokens, len(r.slots), new)
            r.slots += new

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99))
    def cache_unfinished(self, i: int) -> None:
        r = self.reqs[i % len(self.reqs)]
        old = r.node
        prefix, r.node = self.t.cache_unfinished(r.tokens, torch.tensor(r.slots), old)
        L = prefix.numel()
        assert L == (0 if (not self.t.caches) else len(r.tokens) - len(r.tokens) % self.P)
        r.slots[:L] = prefix.tolist()
        r.cached = L if L else r.cached
        assert r.node.lock_ref >= 1 or r.node is self.t.root

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99), drop_last=st.booleans())
    def finish(self, i: int, drop_last: bool) -> None:
        r = self.reqs.pop(i % len(self.reqs))
        n = len(r.tokens) - (1 if drop_last and len(r.tokens) > r.cached else 0)
        self.t.cache_finished(r.tokens[:n], torch.tensor(r.slots), r.node)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99))
    def abort(self, i: int) -> None:
        r = self.reqs.pop(i % len(self.reqs))
        self.a.free(torch.tensor(r.slots[r.cached :], dtype=torch.int64))
        self.t.dec_lock_ref(r.node)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=8))
    def raw_insert(self, tokens: list[int]) -> None:
        tokens = tokens[: len(tokens) - len(tokens) % self.P]
        s = self._alloc(-1, len(tokens)) if tokens else None
        if s is None:
            return
        self._write(tokens, 0, s)
        n = self.t.insert(tokens, torch.tensor(s, dtype=torch.int64))
        if not (not self.t.caches) and n:
            self.a.free(torch.tensor(s[:n]))

    @rule(n=st.integers(0, 30))
    def evict(self, n: int) -> None:
        locked = [(r.node, r.node.prefix_len, self._path_slots(r.node)) for r in self.reqs]
        evictable = self.t.evictable_size()
        freed = self.t.evict(n)
        assert freed >= min(n, evictable) and (freed >= n or self.t.evictable_size() == 0)
        for node, plen, slots in locked:  # locked paths are untouched
            assert node.prefix_len == plen
            x = node
            while x.parent is not None:
                x = x.parent
            assert x is self.t.root, "a locked node was evicted"
            assert self.t.match_prefix(self._tokens_of(node)).slots.tolist() == slots.tolist()

    def _path_slots(self, node: TreeNode) -> torch.Tensor:
        return self.t.match_prefix(self._tokens_of(node)).slots

    def _tokens_of(self, node: TreeNode) -> list[int]:
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return [tok for key in reversed(keys) for tok in key]

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "t"):
            return
        owned = [torch.tensor(r.slots[r.cached :], dtype=torch.int64) for r in self.reqs]
        check_kv_integrity(self.a, self.t, owned)
        assert self.t.total_size() + sum(len(o) for o in owned) == self.a.num_allocated
        assert self.t.protected_size() <= self.t.total_size()
        for r in self.reqs:
            assert r.node.prefix_len >= r.cached
            for i, s in enumerate(r.slots):
                assert self.kv[s] == tuple(r.tokens[: i + 1]), "slot holds the wrong token's KV"
                assert s % self.P == i % self.P
        if (not self.t.caches):
            assert self.t.total_size() == 0


RadixMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestRadixMachine = RadixMachine.TestCase
