"""Where the CPU batch workload's time goes: its prompts' prefill against the whole run.

    python bench/cpu_batch_split.py [--batch 32] [--engine "sgl quantized (no overlap)"]

bench/cpu_engine.py's batch workload (32 requests, prompts of 64-512 tokens, outputs of
32-256, all submitted at once) on one engine, twice from an empty prefix cache: once with one
new token per request (the prompts' prefill and one decode step), then as the benchmark runs
it. Prints both walls, the prefill's tokens per second and the float32 arithmetic it implies
for SmolLM2-135M's projections (2 x 106M multiply-adds a token; attention and the LM head's
few rows are left out), so a figure of the batch row can be set against the machine's
arithmetic peak.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable  # noqa: E402

ensure_sgl_importable()
import sgl  # noqa: E402
from cpu_engine import ENGINES, workload  # noqa: E402

PROJECTION_PARAMS = 106_168_320  # SmolLM2-135M: 30 layers x (q|k|v, o, gate|up, down)


async def run(engine: sgl.Engine, prompts: list[list[int]], outs: list[int]) -> float:
    t = time.perf_counter()
    await asyncio.gather(*(engine.generate(input_ids=p, max_new_tokens=o, ignore_eos=True,
                                           temperature=0) for p, o in zip(prompts, outs)))
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--engine", default="sgl quantized (no overlap)", choices=sorted(ENGINES))
    args = ap.parse_args()
    prompts, outs = workload(args.batch)
    engine = sgl.Engine(**ENGINES[args.engine])
    try:
        asyncio.run(engine.generate(input_ids=prompts[0][:16], max_new_tokens=4))  # warm-up
        engine.flush_cache()
        prefill = asyncio.run(run(engine, prompts, [1] * len(prompts)))
        engine.flush_cache()
        whole = asyncio.run(run(engine, prompts, outs))
    finally:
        engine.close()
    tokens = sum(map(len, prompts))
    print(f"{args.engine}, {args.batch} requests: prompts {tokens} tokens, outputs {sum(outs)}")
    print(f"prefill only: {prefill:.1f} s, {tokens / prefill:.0f} tok/s, "
          f"~{2 * PROJECTION_PARAMS * tokens / prefill / 1e9:.0f} GFLOP/s of projections")
    print(f"whole run: {whole:.1f} s, {sum(outs) / whole:.1f} output tok/s; "
          f"prefill {prefill / whole:.0%} of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
