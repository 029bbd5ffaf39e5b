"""How responsive the caller's event loop stays while the engine is busy.

    python bench/event_loop_latency.py

The engine computes on its own thread (torch releases the GIL inside kernels). This measures
the lag of `asyncio.sleep(0.001)` ticks in the caller's loop while 32 requests decode, and
compares it with the engine's step time, which is how long each tick would be blocked if the
engine ran as a task on the same loop.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, table  # noqa: E402

import sgl  # noqa: E402


async def ticker(stop: asyncio.Event, lags: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - t - 0.001)


async def run(engine: sgl.Engine) -> dict[str, float]:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(64, 256))] for _ in range(32)]
    idle: list[float] = []
    stop = asyncio.Event()
    task = asyncio.create_task(ticker(stop, idle))
    await asyncio.sleep(1.0)
    stop.set()
    await task
    busy: list[float] = []
    stop = asyncio.Event()
    task = asyncio.create_task(ticker(stop, busy))
    steps0 = engine.stats().steps
    t = time.perf_counter()
    await asyncio.gather(*(engine.generate(input_ids=p, max_new_tokens=64, ignore_eos=True) for p in prompts))
    wall = time.perf_counter() - t
    stop.set()
    await task
    steps = engine.stats().steps - steps0
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1e3  # noqa: E731
    return {
        "idle lag p50 ms": q(idle, 0.5), "busy lag p50 ms": q(busy, 0.5), "busy lag p99 ms": q(busy, 0.99),
        "busy lag max ms": max(busy) * 1e3, "mean step ms (a task would block this long)": wall / steps * 1e3,
        "ticks while busy": float(len(busy)), "busy mean lag ms": statistics.mean(busy) * 1e3,
    }


def main() -> None:
    engine = sgl.Engine()
    try:
        figures = asyncio.run(run(engine))
    finally:
        engine.close()
    print(table([{"figure": k, "value": v} for k, v in figures.items()], ["figure", "value"]))
    record("event_loop_latency", "SmolLM2-135M-Instruct", "32 requests x 64 tokens", figures)


if __name__ == "__main__":
    main()
