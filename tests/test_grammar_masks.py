"""Grammar masks filled beside the step's forward (backend/grammar_masks.py): the same masks
as a fill in place, errors surface at `result()`, and the runner waits for them before it
samples."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any

import pytest
import torch
from tiny_engines import tokenized_tiny_engine

from sgl.backend.grammar import ConstraintState, GrammarBackend, allocate_bitmask, fill_bitmasks

VOCAB = 49152


@pytest.fixture(scope="module")
def backend(default_tokenizer: Any) -> GrammarBackend:
    backend = GrammarBackend(default_tokenizer, VOCAB, fill_threads=2)
    yield backend
    backend.close()


def _states(backend: GrammarBackend, n: int) -> list[ConstraintState | None]:
    compiled = backend.compile("json_schema", '{"type":"object","properties":{"a":{"type":"string"}}}')
    return [None if i % 4 == 0 else backend.new_state(compiled) for i in range(n)]


def test_async_fill_equals_the_fill_in_place(backend: GrammarBackend) -> None:
    states = _states(backend, 12)  # 9 constrained rows: the fill thread
    # The reference first: a matcher must never be filled by two threads at once (xgrammar's
    # fill walks its parser forward and back; filling the same matchers here while the fill
    # thread did crashed the CI run with a segfault inside xgrammar).
    expected = allocate_bitmask(12, VOCAB)
    fill_bitmasks(states, expected)
    masks = backend.fill_bitmasks_async(states, allocate_bitmask(12, VOCAB))
    got = masks.result(timeout=30)
    assert got is not None and masks.ready and torch.equal(got, expected)


def test_small_batches_fill_in_place(backend: GrammarBackend) -> None:
    masks = backend.fill_bitmasks_async(_states(backend, 4), allocate_bitmask(4, VOCAB))
    assert masks.ready and masks.result() is not None
    free = backend.fill_bitmasks_async([None] * 9, allocate_bitmask(9, VOCAB))
    assert free.result(timeout=30) is None  # nothing constrained: no mask to apply


def test_fill_errors_surface_at_result(backend: GrammarBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(matchers: Any, bitmask: Any, rows: Any) -> None:
        raise RuntimeError("fill failed")

    monkeypatch.setattr(backend, "_fill_rows", broken)
    masks = backend.fill_bitmasks_async(_states(backend, 12), allocate_bitmask(12, VOCAB))
    with pytest.raises(RuntimeError, match="fill failed"):
        masks.result(timeout=30)


@pytest.mark.anyio
async def test_the_runner_waits_for_slow_masks_before_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fill slower than the forward: were the sampler not to wait, it would sample from the
    all-allowed mask allocate_bitmask starts with, and the outputs would break the regex."""
    real = GrammarBackend._fill_rows
    threads: set[str] = set()

    def slow(self: GrammarBackend, matchers: Any, bitmask: torch.Tensor, rows: Any) -> None:
        threads.add(threading.current_thread().name)
        time.sleep(0.05)
        real(self, matchers, bitmask, rows)

    monkeypatch.setattr(GrammarBackend, "_fill_rows", slow)
    engine = tokenized_tiny_engine(random_seed=3)
    try:
        outs = await asyncio.gather(*(engine.generate(f"n{i}", max_new_tokens=6, temperature=1.0,
                                                      regex="[0-9]{2}-[a-z]{2}") for i in range(10)))
    finally:
        engine.close()
    assert any(name.startswith("sgl-grammar-fill") for name in threads)  # the async path ran
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch("[0-9]{2}-[a-z]{2}", out.text), out


def test_closing_starts_masks_the_loop_never_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """The overlap loop on the CPU: a deferred step's device worker waits for its masks. If the
    loop never starts them (a bug stops it), closing the runner starts them, so the worker and
    the shutdown that waits for it finish instead of hanging."""
    from sgl.backend.step_io import StepHandle

    engine = tokenized_tiny_engine(disable_overlap_schedule=False)
    rt = engine._rt
    monkeypatch.setattr(StepHandle, "start_masks", lambda self: None)  # the loop "forgets"
    fut = asyncio.run_coroutine_threadsafe(
        engine.generate("n", max_new_tokens=8, regex="[0-9]{6}"), _loop_in_thread())
    deadline = time.monotonic() + 30
    while len(rt.runner._unstarted) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rt.runner._unstarted, "no deferred step was launched"
    closer = threading.Thread(target=lambda: rt.core.shutdown(timeout=1.0), daemon=True)
    closer.start()
    closer.join(20)
    assert not closer.is_alive(), "closing hung on a deferred step's masks"
    fut.cancel()
    engine.close()


def _loop_in_thread() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop
