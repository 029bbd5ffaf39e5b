"""KV pool, slot allocator (pages), req-to-token pool and the global KV integrity check."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sgl.backend.kv_pool import KVPool, ReqToTokenPool, SlotAllocator, check_kv_integrity


def _l(t: torch.Tensor | None) -> list[int]:
    assert t is not None
    assert t.dtype == torch.int64
    return t.tolist()


# ---- page_size 1 ----------------------------------------------------------------------------


def test_alloc_free_page1() -> None:
    a = SlotAllocator(9)  # slot 0 reserved -> 8 usable
    assert (a.capacity, a.num_free, a.num_used, a.available_size()) == (8, 8, 0, 8)
    s = a.alloc(3)
    assert _l(s) == [1, 2, 3]
    assert (a.num_free, a.num_used, a.num_allocated) == (5, 3, 3)
    assert a.alloc(6) is None and a.num_free == 5  # never partial
    t = a.alloc(5)
    assert 0 not in _l(t) and set(_l(t)).isdisjoint(_l(s))
    assert a.alloc(1) is None
    a.free(s)
    assert a.num_free == 3
    a.check_integrity()
    assert _l(a.alloc(0)) == []


def test_free_errors() -> None:
    a = SlotAllocator(9)
    s = a.alloc(2)
    a.free(s)
    with pytest.raises(AssertionError, match="double free"):
        a.free(s)
    s = a.alloc(2)
    with pytest.raises(AssertionError):
        a.free(torch.tensor([0]))
    with pytest.raises(AssertionError, match="twice"):
        a.free(torch.cat([s[:1], s[:1]]))
    with pytest.raises(AssertionError):
        a.free(torch.tensor([99]))
    a.free(torch.empty(0, dtype=torch.int64))
    a.check_integrity()


def test_alloc_extend_page1_is_plain_alloc() -> None:
    a = SlotAllocator(9)
    s = a.alloc_extend([-1, 5], [2, 3])
    assert len(_l(s)) == 5 and a.num_free == 3
    assert a.alloc_extend([-1], [4]) is None


def test_clear_and_integrity_detects_corruption() -> None:
    a = SlotAllocator(9)
    a.alloc(4)
    a.clear()
    assert a.num_free == 8
    a.check_integrity()
    a._allocated[5] = True  # a slot marked used in a free page
    with pytest.raises(AssertionError, match="free and has allocated"):
        a.check_integrity()


# ---- pages ----------------------------------------------------------------------------------


def test_pages_alloc_extend_continues_last_page() -> None:
    a = SlotAllocator(16, page_size=4)  # pages 1..3 usable
    assert a.capacity == 12
    s = _l(a.alloc(5))  # two fresh pages
    assert s == [4, 5, 6, 7, 8]
    assert (a.num_free, a.num_used, a.num_allocated) == (4, 8, 5)
    t = _l(a.alloc_extend([8], [3]))  # continues page 2: 9, 10, 11
    assert t == [9, 10, 11] and a.num_free == 4
    u = _l(a.alloc_extend([11], [1]))  # page 2 full -> new page 3
    assert u == [12]
    assert a.alloc_extend([12], [4]) is None  # 3 fit in page 3, 1 needs a page: none left
    assert a.num_allocated == 9
    a.check_integrity()


def test_pages_multi_request_layout() -> None:
    a = SlotAllocator(40, page_size=4)
    first = _l(a.alloc_extend([-1, -1], [2, 5]))
    assert first == [4, 5, 8, 9, 10, 11, 12]
    s = _l(a.alloc_extend([5, 12, -1], [3, 1, 0]))
    assert s[:2] == [6, 7]  # request 0 finishes page 1 then needs a new page
    assert s[2] % 4 == 0 and s[3] == 13
    for slots in (first, s):
        for x in slots:
            assert x != 0
    a.check_integrity()


def test_pages_decode_fast_path() -> None:
    a = SlotAllocator(32, page_size=4)  # pages 1..7
    r0, r1 = _l(a.alloc(2)), _l(a.alloc(4))  # r0 mid-page (4, 5), r1 fills page 2
    s = _l(a.alloc_extend([r0[-1], r1[-1], -1], [1, 1, 1]))
    assert s[0] == 6  # continues its page
    assert s[1] % 4 == 0 and s[2] % 4 == 0 and s[1] != s[2]  # fresh pages
    assert a.num_free == 4 * 3
    t = _l(a.alloc_extend([6, s[1], s[2], -1], [1, 1, 1, 1]))
    assert t[:3] == [7, s[1] + 1, s[2] + 1] and a.num_free == 8  # only the last took a page
    before = a.num_free
    assert a.alloc_extend([-1] * (before // 4 + 1), [1] * (before // 4 + 1)) is None  # all or nothing
    assert a.num_free == before
    with pytest.raises(AssertionError):
        a.alloc_extend([30], [1])  # slot 30 is not allocated
    a.check_integrity()


def test_pages_free_only_when_page_empty() -> None:
    a = SlotAllocator(16, page_size=4)
    s = a.alloc(6)  # pages 1 and 2 (2 slots of page 2)
    a.free(s[4:5])
    assert a.num_free == 4  # page 2 still holds slot 9
    a.free(s[5:6])
    assert a.num_free == 8
    a.free(s[:4])
    assert a.num_free == 12
    a.check_integrity()


def test_pages_bad_last_loc() -> None:
    a = SlotAllocator(16, page_size=4)
    with pytest.raises(AssertionError):
        a.alloc_extend([5], [1])  # slot 5 was never allocated


# ---- request table and pool -----------------------------------------------------------------


def test_req_to_token_pool() -> None:
    p = ReqToTokenPool(3, 8)
    assert p.req_to_token.shape == (4, 8) and p.req_to_token.dtype == torch.int32
    assert p.table.shape == (4, 8)
    rows = [p.alloc(), p.alloc(), p.alloc()]
    assert sorted(rows) == [1, 2, 3] and p.alloc() is None and p.num_free == 0  # type: ignore[type-var]
    p.free(2)
    with pytest.raises(AssertionError):
        p.free(2)
    with pytest.raises(AssertionError):
        p.free(0)
    assert p.alloc() == 2


def test_kv_pool_shapes_and_writes() -> None:
    pool = KVPool(10, num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float16, device="cpu", page_size=4)
    assert pool.num_slots == 16  # 10 tokens -> 3 pages, plus the reserved page
    assert len(pool.k_buffer) == 2 and pool.k_buffer[0].shape == (16, 3, 4)
    assert pool.v_buffer[1].dtype == torch.float16
    assert pool.allocator.capacity == 12
    loc = pool.allocator.alloc(2)
    assert loc is not None
    pool.k_buffer[1][loc] = torch.ones(2, 3, 4, dtype=torch.float16)  # slots index rows
    assert pool.k_buffer[1][0].abs().sum() == 0 and pool.v_buffer[1].abs().sum() == 0


def test_pool_size_from_the_model_config_bytes_per_token() -> None:
    """The pool holds max_total_tokens plus the reserved page, whole pages."""
    for page in (1, 4):
        pool = KVPool(100, 4, 2, 8, torch.bfloat16, "cpu", page_size=page)
        assert pool.num_slots % page == 0 and 100 + page <= pool.num_slots < 100 + 2 * page


# ---- global integrity -----------------------------------------------------------------------


def test_check_kv_integrity_messages() -> None:
    a = SlotAllocator(17)
    r0, r1 = a.alloc(3), a.alloc(2)
    assert r0 is not None and r1 is not None
    check_kv_integrity(a, None, [r0, r1])
    with pytest.raises(AssertionError, match="leak"):
        check_kv_integrity(a, None, [r0])
    with pytest.raises(AssertionError, match=r"held more than once: by request #0, request #1"):
        check_kv_integrity(a, None, [r0, torch.cat([r1, r0[:1]])])
    a.free(r1)
    with pytest.raises(AssertionError, match="free in the allocator but held by request #1"):
        check_kv_integrity(a, None, [r0, r1])


# ---- property: random alloc / free against a model ------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Requests allocate (fresh or continuing their last page) and free; the allocator must
    never hand out a slot twice, conserve its counts, and keep slots page-aligned per request."""

    @initialize(page=st.sampled_from([1, 2, 4]), pages=st.integers(2, 12))
    def setup(self, page: int, pages: int) -> None:
        self.a = SlotAllocator(pages * page, page_size=page)
        self.reqs: list[list[int]] = []  # slots of each live request, token order

    @rule(n=st.integers(0, 9))
    def new_request(self, n: int) -> None:
        before = self.a.num_free
        s = self.a.alloc(n)
        if s is None:
            assert -(-n // self.a.page_size) * self.a.page_size > before and self.a.num_free == before
        else:
            self.reqs.append(s.tolist())

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        idx = data.draw(st.lists(st.integers(0, len(self.reqs) - 1), min_size=1, max_size=3, unique=True))
        lens = data.draw(st.lists(st.integers(0, 5), min_size=len(idx), max_size=len(idx)))
        last = [self.reqs[i][-1] if self.reqs[i] else -1 for i in idx]
        before = self.a.num_free
        s = self.a.alloc_extend(last, lens)
        if s is None:
            assert self.a.num_free == before
            return
        out = s.tolist()
        assert len(out) == sum(lens)
        for i, n in zip(idx, lens):
            self.reqs[i] += out[:n]
            out = out[n:]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.reqs) - 1))
        slots = self.reqs.pop(i)
        k = data.draw(st.integers(0, len(slots)))  # free in two calls, any split
        self.a.free(torch.tensor(slots[:k], dtype=torch.int64))
        self.a.free(torch.tensor(slots[k:], dtype=torch.int64))

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "a"):
            return
        a, P = self.a, self.a.page_size
        a.check_integrity()
        all_slots = [s for r in self.reqs for s in r]
        assert len(all_slots) == len(set(all_slots)) == a.num_allocated
        assert 0 not in all_slots
        assert a.num_free + a.num_used == a.capacity
        pages_held = {s // P for s in all_slots}
        assert a.num_used == len(pages_held) * P
        for r in self.reqs:
            assert all(s % P == i % P for i, s in enumerate(r)), "token i must sit at page offset i % P"
        owned = [torch.tensor(r, dtype=torch.int64) for r in self.reqs]
        check_kv_integrity(a, None, owned)


AllocatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
