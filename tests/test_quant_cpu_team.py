"""The CPU helper team (backend/quant/cpu_team.c) that shares one-row products, the LM head
and the one-call decode step with the calling thread: any number of threads gives the bits of
one, and callers on several Python threads at once (ctypes drops the GIL) all finish, the
ones that find the team busy running alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from test_quant_kernels import needs_kernel, weight

from sgl.backend.quant import QuantizedWeight, cpu_kernel


@pytest.fixture
def threads() -> Iterator[int]:
    """Restores torch's thread count after the test."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("count", [2, 3, 5])
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_any_thread_count_gives_the_bits_of_one(fmt: str, count: int, threads: int) -> None:
    w = weight(fmt, 1000, 96, seed=count)  # 63 blocks of 16 features, the last one short
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(count))
    torch.set_num_threads(1)
    alone = [cpu_kernel.qlinear(x[:rows], w, None) for rows in (1, 3)]
    torch.set_num_threads(count)
    for _ in range(3):  # (helpers asleep, then lingering from the previous call)
        assert all(torch.equal(cpu_kernel.qlinear(x[:rows], w, None), expected)
                   for rows, expected in zip((1, 3), alone))


@needs_kernel
def test_concurrent_callers_all_finish_with_the_right_bits(threads: int) -> None:
    """Four Python threads share two torch threads' worth of team: whoever finds it held by
    another caller runs alone; nobody waits on somebody else's session."""
    w = weight("Q4_1", 2000, 192, seed=7)
    torch.set_num_threads(2)
    inputs = [torch.randn(1, 192, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    expected = [cpu_kernel.qlinear(x, w, None) for x in inputs]
    wrong: list[int] = []

    def caller(i: int) -> None:
        for _ in range(200):
            if not torch.equal(cpu_kernel.qlinear(inputs[i], w, None), expected[i]):
                wrong.append(i)

    workers = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in workers), "a caller hung"
    assert not wrong


@needs_kernel
def test_a_forked_child_computes_without_the_parents_helpers(threads: int) -> None:
    """The child has none of the helper threads the parent started; its products still run
    (alone or with helpers of its own) and give the same bits."""
    import multiprocessing

    w = weight("Q4_1", 500, 96, seed=3)
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(3))
    torch.set_num_threads(2)
    expected = cpu_kernel.qlinear(x, w, None)  # (the parent's helpers exist now)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(_product, (x, w)).get(timeout=60)
    assert torch.equal(got, expected)


def _product(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    torch.set_num_threads(2)
    return cpu_kernel.qlinear(x, w, None)
