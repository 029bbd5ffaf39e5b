"""Memory and start-up of the default CPU engine, one configuration per process.

    SGL_CACHE_DIR=$(mktemp -d) python bench/cpu_lean.py            # cold cache, defaults
    python bench/cpu_lean.py --kv-cache-dtype float32 --import-triton  # as before issue 14's
                                                                       # lean round

Reports the time to a ready `sgl.Engine()` (imports included), resident memory after it,
after one 128-token generation and at the peak of a concurrent batch (`--requests`, prompts
of 64-512 random tokens, 32-256 new tokens each; a small stand-in for bench/cpu_engine.py's
32-request batch), and the engine's own memory figures. `--import-triton` imports Triton first,
as the CPU engine did before its kernels were split from the Triton modules. One JSON line
goes to bench/results/cpu_lean.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

from common import ensure_sgl_importable, record


def resident_mb() -> tuple[int, int]:
    """(resident now, peak resident) of this process in MB (Linux)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) // 1024, int(fields["VmHWM"].split()[0]) // 1024


async def run(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    if args.import_triton:
        import triton  # noqa: F401
    ensure_sgl_importable()
    import sgl

    engine = sgl.Engine(device="cpu", kv_cache_dtype=args.kv_cache_dtype)
    row: dict[str, Any] = {"kv_cache_dtype": engine.config.kv_cache_dtype,
                           "triton_imported": "triton" in sys.modules,
                           "ready_s": round(time.perf_counter() - start, 2),
                           "rss_ready_mb": resident_mb()[0]}
    await engine.generate("Write a short story about a robot.", max_new_tokens=128,
                          temperature=0)
    row["rss_single_mb"] = resident_mb()[0]
    rng = random.Random(0)
    batch = [engine.generate([rng.randrange(100, 40000) for _ in range(rng.randint(64, 512))],
                             max_new_tokens=rng.randint(32, 256), temperature=0, ignore_eos=True)
             for _ in range(args.requests)]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*batch)
    elapsed = time.perf_counter() - t0
    row["batch_out_tok_s"] = round(sum(len(o.token_ids) for o in outs) / elapsed, 1)
    row["rss_batch_mb"], row["peak_rss_mb"] = resident_mb()
    stats = engine.stats()
    row.update(kv_touched_mb=stats.kv_bytes_touched >> 20,
               kv_bytes_per_token=stats.kv_bytes_per_token,
               weights_mb=stats.weights_bytes >> 20, requests=args.requests)
    engine.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--import-triton", action="store_true")
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    row = asyncio.run(run(args))
    print(" ".join(f"{k}={v}" for k, v in row.items()))
    record("cpu_lean", "SmolLM2-135M-Instruct Q4_1 GGUF (default)",
           f"Engine(), one 128-token generation, {args.requests} concurrent requests", row)


if __name__ == "__main__":
    main()
