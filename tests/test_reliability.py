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
from sgl.outputs import StreamChunk

from test_engine_core import assert_clean, make_engine

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


@pytest.mark.parametrize("overlap,n", [(True, 2000), (False, 600)], ids=["overlap", "plain"])
async def test_load_far_beyond_the_pool_completes_with_alone_outputs(overlap: bool, n: int) -> None:
    """2,000 mixed requests at once (600 with the plain loop, to save CI time) into a pool that
    holds a few dozen: all complete with the tokens they get alone, and retraction (plus
    re-admission from the cache) happens."""
    load = mixed_load(n, seed=11)
    engine = make_engine(max_total_tokens=400, chunked_prefill_size=64, max_running_requests=128,
                         disable_overlap_schedule=not overlap)
    tracker = Tracker(engine)
    try:
        total = sum(len(p) + m for p, m in load)
        assert engine.stats().kv_total_tokens * 15 < total  # the pool holds a small fraction
        outs = await asyncio.wait_for(
            asyncio.gather(*(engine.generate(input_ids=p, **greedy(m)) for p, m in load)), 240)
        assert all(o.finish_reason == "length" for o in outs)
        assert [len(o.token_ids) for o in outs] == [m for _, m in load]
        stats = engine.stats()
        assert stats.retractions > 0, "the load never forced a retraction: the test lost its point"
        assert stats.finished_requests == n
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
        blocker = asyncio.create_task(engine.generate(input_ids=[7, 8, 9], **greedy(1000)))
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


# ---- faults ------------------------------------------------------------------------------


def shared_prefix_load(n: int, seed: int) -> list[list[int]]:
    """Prompts that share prefixes of random length (radix hits, duplicate-prefix inserts)."""
    rng = random.Random(seed)
    stem = [rng.randrange(1, 512) for _ in range(48)]
    return [stem[: rng.randint(0, 48)] + [rng.randrange(1, 512) for _ in range(rng.randint(1, 48))]
            for _ in range(n)]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
async def test_model_faults_fail_their_step_only_and_the_engine_keeps_serving(overlap: bool) -> None:
    """Random model steps raise. Exactly requests of failed steps get an EngineError carrying
    the cause; every other request finishes with its alone output, under memory pressure;
    the device-side token table never misses a write (a failed step still applies its own);
    no KV leaks."""
    ps = shared_prefix_load(160, seed=31)
    engine = make_engine(max_total_tokens=200, chunked_prefill_size=32, max_running_requests=16,
                         schedule_policy="fcfs", disable_overlap_schedule=not overlap)
    rt = engine._rt
    tracker = Tracker(engine)
    assert len({tuple(p) for p in ps}) == len(ps)
    rng = random.Random(32)
    in_failed_steps: set[str] = set()
    table_errors: list[str] = []

    def hook(step: Any) -> None:
        if not overlap:  # no step in flight: device table + this step's writes == CPU mirror
            device = rt.req_pool.req_to_token.clone()
            for row, start, slots in step.batch.table_writes:
                device[row, start : start + len(slots)] = torch.as_tensor(slots).to(device.dtype)
            for r in rt.scheduler.running:
                row = r.req_pool_idx
                if not torch.equal(device[row, : r.kv_len].long(), rt.req_pool.table[row, : r.kv_len]):
                    table_errors.append(r.rid)
        if rng.random() < 0.04:
            in_failed_steps.update(it.req.rid for it in step.batch.items)
            raise RuntimeError("injected fault")

    rt.runner.step_hook = hook
    try:
        results = await asyncio.wait_for(asyncio.gather(
            *(engine.generate(input_ids=p, **greedy(10)) for p in ps), return_exceptions=True), 120)
        rt.runner.step_hook = None
        failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
        assert 0 < len(failed) < len(ps) * 0.8
        for i in failed:
            err = results[i]
            assert isinstance(err, sgl.EngineError) and "injected fault" in str(err), err
            assert isinstance(err.__cause__, RuntimeError)
        failed_rids = {tracker[ps[i]].rid for i in failed}
        assert failed_rids <= in_failed_steps  # no request failed without being in a failed step
        ok = [i for i in range(len(ps)) if i not in failed]
        if not overlap:  # ...and all of those failed (with overlap some had finished a step earlier)
            assert failed_rids == in_failed_steps
        assert table_errors == []
        assert [results[i].token_ids for i in ok[:40]] == await alone([(ps[i], 10) for i in ok[:40]])
        # Still serving after the faults:
        out = await asyncio.wait_for(engine.generate(input_ids=ps[0], **greedy(10)), HANG)
        assert out.token_ids == (await alone([(ps[0], 10)]))[0]
        assert_clean(engine)
    finally:
        rt.runner.step_hook = None
        engine.close()


async def test_fault_in_one_prompt_of_a_batch_aborts_the_rest() -> None:
    """generate([a, b]) raises as soon as a fails, and b stops running instead of computing
    500 tokens for nobody."""
    engine = make_engine(chunked_prefill_size=8)  # a and b never share a step's first chunk
    tracker = Tracker(engine)
    a, b = [5] * 20, [6] * 20

    def hook(step: Any) -> None:
        if any(it.req.prompt_ids == a and it.req.output_ids for it in step.batch.items):
            raise RuntimeError("fault for a")

    engine._rt.runner.step_hook = hook
    try:
        with pytest.raises(sgl.EngineError, match="fault for a"):
            await asyncio.wait_for(engine.generate(input_ids=[a, b], **greedy(500)), HANG)
        rb = tracker[b]
        state = await engine_call(engine, lambda: (rb.finish_reason, holds_kv(engine, rb), len(rb.output_ids)))
        assert state[:2] == ("abort", False) and state[2] < 500
        engine._rt.runner.step_hook = None
        assert_clean(engine)
    finally:
        engine.close()


async def test_a_crash_of_the_engine_loop_fails_everything_and_says_so() -> None:
    """A bug in the scheduler (not in a model step) stops the engine: every waiting caller,
    streams included, gets an EngineError naming the cause; new requests get
    EngineClosedError; close() still works."""
    engine = make_engine()
    sched = engine._rt.scheduler
    schedule = sched.schedule
    calls = {"n": 0}

    def flaky() -> Any:
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("scheduler bug")
        return schedule()

    sched.schedule = flaky  # type: ignore[method-assign]
    try:
        tasks = [asyncio.create_task(engine.generate(input_ids=[i + 1] * 10, **greedy(200))) for i in range(4)]

        async def consume() -> list[StreamChunk]:
            return [c async for c in engine.stream(input_ids=[9] * 10, **greedy(200))]

        tasks.append(asyncio.create_task(consume()))
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), HANG)
        for res in results:
            assert isinstance(res, sgl.EngineError) and "crashed" in str(res) and "scheduler bug" in str(res), res
        assert isinstance(engine._rt.core.fatal_error, RuntimeError)
        with pytest.raises(sgl.EngineClosedError):
            await engine.generate(input_ids=[1, 2], max_new_tokens=2)
    finally:
        engine.close()


# ---- closing and restarting ----------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
async def test_close_ends_every_request_in_flight(overlap: bool) -> None:
    """Closing with requests decoding, prefilling and queued, and a stream open: every caller
    gets finish_reason "abort" (or EngineError) promptly; nothing hangs."""
    engine = make_engine(max_running_requests=4, chunked_prefill_size=16, disable_overlap_schedule=not overlap)
    rng = random.Random(41)
    tasks = [asyncio.create_task(engine.generate(input_ids=[rng.randrange(1, 512) for _ in range(rng.choice([5, 200]))],
                                                 **greedy(800))) for _ in range(12)]
    chunks: list[StreamChunk] = []

    async def consume() -> None:
        async for c in engine.stream(input_ids=[3, 4, 5], **greedy(800)):
            chunks.append(c)

    stream_task = asyncio.create_task(consume())
    await asyncio.sleep(0.3)
    await asyncio.wait_for(asyncio.to_thread(engine.close), HANG)
    results = await asyncio.wait_for(asyncio.gather(*tasks, stream_task, return_exceptions=True), HANG)
    for res in results[:-1]:
        assert (isinstance(res, sgl.EngineError)
                or (res.finish_reason == "abort" and "closed" in res.error)), res
    assert results[-1] is None  # the stream ended normally, with a final abort chunk
    assert chunks and chunks[-1].finish_reason == "abort"
    assert not engine._rt.core.alive


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_start_and_close_repeatedly_leaks_no_threads_or_memory() -> None:
    """Ten engines, each serving sync and streamed requests and closed with one in flight:
    the thread count returns to its baseline and RSS stops growing."""

    def cycle() -> None:
        engine = make_engine(max_total_tokens=2048)
        out = engine.generate_sync(input_ids=list(range(1, 60)), **greedy(8))
        assert len(out.token_ids) == 8
        assert len(list(engine.stream_sync(input_ids=[1, 2, 3], **greedy(4)))) >= 4
        engine._rt.core.submit([Req(rid="in-flight", prompt_ids=[1, 2, 3], params=sgl.SamplingParams(max_new_tokens=900))])
        engine.close()

    cycle()  # warm up: lazy imports, allocator arenas, torch thread pools
    gc.collect()
    threads, rss = threading.active_count(), _rss_bytes()
    rss_after = []
    for _ in range(10):
        cycle()
        gc.collect()
        rss_after.append(_rss_bytes())
        assert threading.active_count() == threads, [t.name for t in threading.enumerate()]
    growth = rss_after[-1] - rss
    assert growth < 64 << 20, f"RSS grew {growth >> 20} MiB over 10 engine cycles: {[r >> 20 for r in rss_after]}"
