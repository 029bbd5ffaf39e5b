"""`activation_quantization="int8"` against float activations on the CPU, in one process.

    python bench/cpu_int8_ab.py kernels [--threads 1] [--rows 1 4 16 64 128 512]
    python bench/cpu_int8_ab.py engine [--threads 1] [--rounds 4]

kernels: every projection shape of one SmolLM2-135M layer (Q4_1 codes, random) and the tied
Q8_0 head, the int8 kernel (`cpu_int8.int8_linear`, any row count) against the float path
(`quant_linear` on the unmarked weight), min of 15 interleaved repeats of CPU time
(`time.process_time`: on a shared machine the steadier measure).

engine: two engines on the default model in one process, float and int8, in alternating
rounds: single-stream decode rate (128-token prompt, 128 new tokens, the prompt's own time
subtracted), prefill of a fresh 128- and 512-token prompt (radix cache off), 8 concurrent
requests x 64 tokens; medians of wall and CPU time. Short: seconds per round.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_quant_kernels import weight  # noqa: E402

import sgl  # noqa: E402
from sgl.backend.quant.cpu_int8 import int8_linear  # noqa: E402
from sgl.backend.quant.linear import quant_linear  # noqa: E402

LAYER = [("Q4_1", 960, 576), ("Q4_1", 576, 576), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536)]
TEXT = "The history of the city goes back many centuries, and "  # ~11 tokens


def interleaved(a: Callable[[], Any], b: Callable[[], Any], n: int,
                repeats: int = 15) -> tuple[float, float]:
    """Min CPU ms per call of a and b, timed alternately."""
    a(), b()
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, f in enumerate((a, b)):
            start = time.process_time()
            for _ in range(n):
                f()
            best[i] = min(best[i], (time.process_time() - start) / n * 1e3)
    return best[0], best[1]


def kernels(rows: list[int]) -> None:
    for m in rows:
        total_f = total_i = 0.0
        for fmt, n, k in LAYER:
            w, x = weight(fmt, n, k), torch.randn(m, k)
            f, i = interleaved(lambda: quant_linear(x, w), lambda: int8_linear(x, w, None),
                               40 if m == 1 else 2)
            total_f, total_i = total_f + f, total_i + i
        print(f"{m:4d} rows, one layer: float {total_f:.2f} ms, int8 {total_i:.2f} ms "
              f"({total_f / total_i:.2f}x)")
    w, x = weight("Q8_0", 49152, 576), torch.randn(1, 576)
    f, i = interleaved(lambda: quant_linear(x, w), lambda: int8_linear(x, w, None), 3)
    print(f"tied head, 1 row: float {f:.3f} ms, int8 {i:.3f} ms ({f / i:.2f}x)")


async def timed(engine: sgl.Engine, prompt: str, new: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    await engine.generate(prompt, max_new_tokens=new, temperature=0, ignore_eos=True)
    return time.perf_counter() - wall, time.process_time() - cpu


async def one_round(engine: sgl.Engine, r: int, out: dict[str, list[float]]) -> None:
    for key, reps in (("prefill128", 11), ("prefill512", 46)):
        wall, cpu = await timed(engine, f"Round {r}. " + TEXT * reps, 1)
        out[key + " wall ms"].append(wall * 1e3)
        out[key + " cpu ms"].append(cpu * 1e3)
    w1, c1 = await timed(engine, f"Again {r}. " + TEXT * 11, 1)
    w, c = await timed(engine, f"Again {r}. " + TEXT * 11, 129)
    out["decode wall tok/s"].append(128 / (w - w1))
    out["decode cpu tok/s"].append(128 / (c - c1))
    wall, cpu = time.perf_counter(), time.process_time()
    done = await asyncio.gather(*[engine.generate(f"Batch {r} {j}. " + TEXT * 3, max_new_tokens=64,
                                                  temperature=0, ignore_eos=True)
                                  for j in range(8)])
    tokens = sum(len(o.token_ids) for o in done)
    out["8 concurrent wall tok/s"].append(tokens / (time.perf_counter() - wall))
    out["8 concurrent cpu tok/s"].append(tokens / (time.process_time() - cpu))


async def engines(rounds: int, threads: int) -> None:
    options = {"float": {}, "int8": {"activation_quantization": "int8"}}
    results: dict[str, dict[str, list[float]]] = {}
    open_engines = {}
    for name, extra in options.items():
        open_engines[name] = await sgl.Engine(device="cpu", max_total_tokens=8192,
                                              disable_radix_cache=True, num_threads=threads,
                                              **extra).__aenter__()
        results[name] = {}
    try:
        for r in range(rounds):
            order = list(open_engines.items())
            for name, engine in order if r % 2 == 0 else order[::-1]:
                out = results[name]
                for key in ("prefill128", "prefill512"):
                    out.setdefault(key + " wall ms", []), out.setdefault(key + " cpu ms", [])
                for key in ("decode", "8 concurrent"):
                    out.setdefault(key + " wall tok/s", []), out.setdefault(key + " cpu tok/s", [])
                await one_round(engine, r, out)
    finally:
        for engine in open_engines.values():
            await engine.__aexit__(None, None, None)
    for key in results["float"]:
        f, i = (statistics.median(results[n][key]) for n in ("float", "int8"))
        ratio = i / f if "tok/s" in key else f / i
        print(f"{key:24s} float {f:8.1f}  int8 {i:8.1f}  int8 speedup {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["kernels", "engine"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128, 512])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.what == "kernels":
        kernels(args.rows)
    else:
        asyncio.run(engines(args.rounds, args.threads))


if __name__ == "__main__":
    main()
