"""One prompt's prefill on the CPU default engine through each of the quantized products' two
paths: the C kernel on the codes and dequantize + BLAS (what `linear.GEMV_MAX_ROWS`, the row
count up to which the kernel serves, decides).

    python bench/cpu_prefill_route.py [--prompts 64 128 200 256 512] [--repeats 5]

For each prompt length: the wall time of `generate(max_new_tokens=1)` on a fresh random prompt
(no cache hit), alternating the two routes (GEMV_MAX_ROWS set above and below the length),
medians of `--repeats`. Prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

import sgl  # noqa: E402
from sgl.backend.quant import linear  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, nargs="+", default=[64, 128, 200, 256, 512])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    engine = sgl.Engine()
    rng = random.Random(0)
    shipped = linear.GEMV_MAX_ROWS

    async def prefill(n: int) -> float:
        prompt = [rng.randrange(100, 40000) for _ in range(n)]
        start = time.perf_counter()
        await engine.generate(input_ids=prompt, max_new_tokens=1, temperature=0)
        return time.perf_counter() - start

    rows = []
    try:
        for n in args.prompts:
            times: dict[str, list[float]] = {"C kernel": [], "dequantize+BLAS": []}
            for _ in range(args.repeats):
                for route, cut in (("C kernel", n), ("dequantize+BLAS", n - 1)):
                    linear.GEMV_MAX_ROWS = cut
                    times[route].append(asyncio.run(prefill(n)))
            kernel, blas = (statistics.median(t) * 1e3 for t in times.values())
            rows.append({"prompt tokens": n, "C kernel ms": kernel, "dequantize+BLAS ms": blas,
                         "C / BLAS": kernel / blas})
    finally:
        linear.GEMV_MAX_ROWS = shipped
        engine.close()
    print(f"GEMV_MAX_ROWS = {shipped}")
    print(table(rows, ["prompt tokens", "C kernel ms", "dequantize+BLAS ms", "C / BLAS"]))


if __name__ == "__main__":
    main()
