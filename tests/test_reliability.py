"""Reliability of the engine core under load, cancellation, timeouts, faults and restarts
(issue 7), on the tiny random-weight Llama: token ids in and out, no tokenizer, fast.

What these tests protect:

* nothing is lost: every request of a load far larger than the KV pool completes, with the
  greedy output it has when run alone (retraction and re-admission must not change tokens);
* nothing hangs: every awaiting caller gets an output or an exception (each await below is
  bounded by `asyncio.wait_for`, so a hang fails the test instead of stalling CI);
* nothing leaks: cancelled, timed-out and failed requests give their KV back at once, and
  the pool ends holding only radix-cache slots (`check_integrity()`, `kv_used == kv_cached`).

Bad input (needs a tokenizer) is in test_reliability_input.py; property-based tests of the
radix cache and allocator in test_reliability_props.py.
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
from typing import Any

import pytest
import torch

import sgl
from sgl.backend.req import Req, ReqStatus

from test_engine_core import TINY, assert_clean, make_engine

pytestmark = pytest.mark.anyio

HANG = 60.0  # seconds: any await taking longer than this is a hang


def mixed_load(n: int, seed: int) -> list[tuple[list[int], int]]:
    """`n` (prompt, max_new_tokens) pairs: short, medium and long prompts, 1-16 new tokens."""
    rng = random.Random(seed)
    load = []
    for _ in range(n):
        length = rng.choice([rng.randint(1, 8), rng.randint(8, 32), rng.randint(32, 96)])
        load.append(([rng.randrange(1, 512) for _ in range(length)], rng.randint(1, 16)))
    return load


def greedy(max_new_tokens: int) -> dict[str, Any]:
    return dict(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)


async def alone(prompt_and_len: list[tuple[list[int], int]]) -> list[list[int]]:
    """Greedy outputs of each request run alone on a plain engine (no cache, no overlap)."""
    engine = make_engine(disable_radix_cache=True, disable_overlap_schedule=True)
    try:
        return [(await engine.generate(input_ids=p, **greedy(m))).token_ids for p, m in prompt_and_len]
    finally:
        engine.close()


class Tracker:
    """Records the engine-side Req of every submission, keyed by its prompt (prompts are unique
    in these tests), so a test can see where each request is and whether it still holds KV."""

    def __init__(self, engine: sgl.Engine) -> None:
        self.by_prompt: dict[tuple[int, ...], Req] = {}
        core = engine._rt.core
        submit = core.submit

        def tracking_submit(reqs: list[Req]) -> None:
            for r in reqs:
                self.by_prompt[tuple(r.prompt_ids)] = r
            submit(reqs)

        core.submit = tracking_submit  # type: ignore[method-assign]

    def __getitem__(self, prompt: list[int]) -> Req:
        return self.by_prompt[tuple(prompt)]


def phase(r: Req) -> str:
    if r.status is ReqStatus.WAITING:
        return "waiting"
    if r.status is ReqStatus.FINISHED:
        return "finished"
    return "prefill" if r.kv_len < len(r.prompt_ids) else "decode"


# ---- load --------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
async def test_load_far_beyond_the_pool_completes_with_alone_outputs(overlap: bool) -> None:
    """2,000 mixed requests at once into a pool that holds a few dozen: all complete with the
    tokens they get alone, and retraction (plus re-admission from the cache) happens."""
    load = mixed_load(2000, seed=11)
    engine = make_engine(max_total_tokens=400, chunked_prefill_size=64, max_running_requests=128,
                         disable_overlap_schedule=not overlap)
    tracker = Tracker(engine)
    try:
        total = sum(len(p) + m for p, m in load)
        assert engine.stats().kv_total_tokens * 50 < total  # the pool holds a small fraction
        outs = await asyncio.wait_for(
            asyncio.gather(*(engine.generate(input_ids=p, **greedy(m)) for p, m in load)), 240)
        assert all(o.finish_reason == "length" for o in outs)
        assert [len(o.token_ids) for o in outs] == [m for _, m in load]
        stats = engine.stats()
        assert stats.retractions > 0, "the load never forced a retraction: the test lost its point"
        assert stats.finished_requests == 2000
        assert stats.output_tokens == sum(m for _, m in load)
        # The sample compared with running alone includes every retracted request.
        retracted = [i for i, (p, _) in enumerate(load) if tracker[p].num_retractions > 0]
        assert retracted
        rng = random.Random(3)
        sample = sorted(set(retracted[:60]) | set(rng.sample(range(len(load)), 80)))
        expected = await alone([load[i] for i in sample])
        assert [outs[i].token_ids for i in sample] == expected
        assert_clean(engine)
    finally:
        engine.close()


# ---- cancellation and timeouts ------------------------------------------------------------


async def engine_call(engine: sgl.Engine, fn: Any) -> Any:
    """Run `fn` on the engine thread between steps (after every message sent before it)."""
    return await asyncio.wait_for(asyncio.to_thread(engine._rt.core.call, fn), HANG)


def holds_kv(engine: sgl.Engine, r: Req) -> bool:
    sched = engine._rt.scheduler
    return r.req_pool_idx is not None or r in sched.running or r in sched.waiting


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
async def test_cancelling_a_third_in_every_phase_frees_kv_at_once(overlap: bool) -> None:
    """Callers cancel a random third of the requests while some wait, some prefill (long
    prompts in small chunks) and some decode. By the time the engine has read the cancels,
    each cancelled request is finished and holds no KV; the rest complete normally."""
    rng = random.Random(21)
    load = [([rng.randrange(1, 512) for _ in range(rng.choice([20, 150, 300]))], rng.randint(20, 60))
            for _ in range(60)]
    engine = make_engine(max_total_tokens=3000, chunked_prefill_size=32, max_running_requests=12,
                         disable_overlap_schedule=not overlap)
    tracker = Tracker(engine)
    tasks = [asyncio.create_task(engine.generate(input_ids=p, **greedy(m))) for p, m in load]
    cancelled: dict[int, str] = {}  # index -> phase when cancelled
    try:
        for _round in range(4):
            await asyncio.sleep(0.1)
            phases = await engine_call(engine, lambda: [phase(tracker[p]) for p, _ in load])
            for ph in ("waiting", "prefill", "decode"):  # about a third of the load, every phase
                group = [i for i, x in enumerate(phases) if x == ph and i not in cancelled]
                for i in rng.sample(group, min(len(group), 2, len(load) // 3 - len(cancelled))):
                    tasks[i].cancel()
                    cancelled[i] = ph
            # The engine reads the aborts before this call: they must be applied by then.
            await engine_call(engine, engine._rt.check_integrity)
            still = await engine_call(engine, lambda: [i for i in cancelled if holds_kv(engine, tracker[load[i][0]])])
            assert still == [], f"cancelled requests {still} still hold KV or a queue place"
        assert {"waiting", "prefill", "decode"} <= set(cancelled.values()), cancelled
        assert len(cancelled) >= len(load) // 4  # a third, or nearly (phases may run dry)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), HANG)
        for i, res in enumerate(results):
            if i in cancelled:
                assert isinstance(res, asyncio.CancelledError)
                r = tracker[load[i][0]]
                # A request may complete between the phase snapshot and the cancel.
                assert r.finish_reason == "abort" or len(r.output_ids) == load[i][1]
            else:
                assert not isinstance(res, BaseException), res
                assert res.finish_reason == "length" and len(res.token_ids) == load[i][1]
        kept = [i for i in range(len(load)) if i not in cancelled][:8]
        assert [results[i].token_ids for i in kept] == await alone([load[i] for i in kept])
        assert_clean(engine)
    finally:
        for t in tasks:
            t.cancel()
        engine.close()


async def test_cancelled_stream_frees_kv() -> None:
    """Breaking out of `async for` (a client disconnect) aborts the request at once."""
    engine = make_engine()
    tracker = Tracker(engine)
    try:
        prompt = list(range(1, 40))
        agen = engine.stream(input_ids=prompt, **greedy(500))
        got = 0
        async for chunk in agen:
            got += len(chunk.token_ids)
            if got >= 3:
                break
        await agen.aclose()
        r = tracker[prompt]
        assert await engine_call(engine, lambda: (r.finish_reason, holds_kv(engine, r))) == ("abort", False)
        assert_clean(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("where", ["waiting", "running"])
async def test_timeout_aborts_with_a_clear_message(where: str) -> None:
    """`timeout=` ends a request with finish_reason "abort" and a message naming the timeout,
    whether it was still queued or already running; its KV is freed and others are unharmed."""
    engine = make_engine(max_running_requests=1)
    try:
        blocker = asyncio.create_task(engine.generate(input_ids=[7, 8, 9], **greedy(300)))
        await asyncio.sleep(0.05 if where == "waiting" else 0)
        t0 = asyncio.get_running_loop().time()
        prompt = [3, 4, 5] if where == "waiting" else [1, 2, 3]
        if where == "running":
            blocker.cancel()
        out = await asyncio.wait_for(engine.generate(input_ids=prompt, **greedy(900), timeout=0.3), HANG)
        elapsed = asyncio.get_running_loop().time() - t0
        assert out.finish_reason == "abort"
        assert "timed out" in out.error and "timeout" in out.error
        assert len(out.token_ids) < 900
        assert 0.3 <= elapsed < 5.0
        if where == "waiting":
            assert out.token_ids == [] and out.usage.completion_tokens == 0
            assert (await asyncio.wait_for(blocker, HANG)).finish_reason == "length"
        assert_clean(engine)
    finally:
        blocker.cancel()
        engine.close()


async def test_engine_wide_request_timeout_applies_and_per_request_overrides() -> None:
    engine = make_engine(request_timeout=0.2)
    try:
        out = await asyncio.wait_for(engine.generate(input_ids=[1, 2], **greedy(900)), HANG)
        assert out.finish_reason == "abort" and "timed out" in out.error
        out = await asyncio.wait_for(engine.generate(input_ids=[1, 2], **greedy(4), timeout=30), HANG)
        assert out.finish_reason == "length"
        assert_clean(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf") * -1, "5", True])
async def test_bad_timeout_is_rejected_before_queueing(bad: Any) -> None:
    engine = make_engine()
    try:
        with pytest.raises(sgl.InvalidRequestError, match="timeout") as info:
            await engine.generate(input_ids=[1, 2], max_new_tokens=2, timeout=bad)
        assert info.value.field == "timeout"
        stats = engine.stats()
        assert (stats.waiting, stats.running, stats.steps) == (0, 0, 0)
    finally:
        engine.close()
