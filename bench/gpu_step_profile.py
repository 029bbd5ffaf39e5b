"""Where one single-stream decode step of the 8B shape spends its GPU time, kernel by kernel.

    python bench/gpu_step_profile.py [--weights bf16,fp8,fp8_a8,q4] [--tokens 64] [--prefill 0]

For each weight kind (bf16; `quantization="fp8"`; `quantization="gguf"`: random Q4_K-layout
Linears), the Llama-3.1-8B shape with random weights: one request of 64 new tokens after a
warm-up, under torch.profiler (CUDA activity: the kernels inside CUDA graph replays are
recorded one by one). Prints the kernels sorted by total device time, per decode step (total
/ decode steps), grouped by name, and the step's sum: what a single stream pays besides the
weight-streaming GEMVs (attention, norms, rotary, KV stores, sampling, launch gaps).
`--prefill N` profiles prefill instead: N concurrent requests of 1,024-token prompts and one new
token each (what dominates gpu_bench's `fixed` workload), reported per engine step.
Writes $OUT/gpu_step_profile_<kind>.txt when $OUT is set (a kind named again: another engine
of it, `_2`, `_3`: which kernels differ between two engines of the same code).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable  # noqa: E402

ensure_sgl_importable()

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import sgl  # noqa: E402

KINDS = {"bf16": {}, "fp8": {"quantization": "fp8"},
         "fp8_a8": {"quantization": "fp8", "activation_quantization": "fp8"},
         "q4": {"quantization": "gguf"}}


def one_kind(kind: str, tokens: int, prefill: int) -> str:
    engine = sgl.Engine(model="llama3-8b", load_format="dummy", device="cuda",
                        max_running_requests=max(8, prefill), **KINDS[kind])
    try:
        vocab = engine._rt.model_config.vocab_size  # noqa: SLF001
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(1024 if prefill else 128)]
                   for _ in range(max(1, prefill))]

        async def go(n: int, prompts: list[list[int]], e: sgl.Engine = engine) -> None:
            await asyncio.gather(*(e.generate(input_ids=p, max_new_tokens=n, temperature=0,
                                              ignore_eos=True) for p in prompts))

        asyncio.run(go(8, [p[:200] for p in prompts]))  # warm-up: compiles, graphs
        engine.flush_cache()
        new = 1 if prefill else tokens  # new tokens per request of the measured run
        start = time.perf_counter()  # the run once unprofiled: its wall rate
        asyncio.run(go(new, prompts))
        rate = new * len(prompts) / (time.perf_counter() - start)
        engine.flush_cache()
        steps0 = engine.stats().steps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            asyncio.run(go(new, prompts))
        torch.cuda.synchronize()
        steps = engine.stats().steps - steps0
        rows = [(e.key, e.device_time_total, e.count) for e in prof.key_averages()
                if e.device_time_total > 0]
        rows.sort(key=lambda r: -r[1])
        total = sum(t for _, t, _ in rows)
        what = f"{prefill} prompts of 1024 tokens" if prefill else "1 prefill"
        lines = [f"{kind}: {steps} steps ({what}), device time per step {total / steps:.1f} us"
                 f" (unprofiled: {rate:.1f} tok/s)"]
        lines += [f"{t / steps:9.1f} us/step {c / steps:6.1f} calls/step  {name[:110]}"
                  for name, t, c in rows[:40]]
        return "\n".join(lines)
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="bf16,fp8,q4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=0)
    args = ap.parse_args()
    out = os.environ.get("OUT")
    seen: dict[str, int] = {}
    for kind in args.weights.split(","):
        text = one_kind(kind, args.tokens, args.prefill)
        print(text, flush=True)
        # (a kind named again is another engine of it: `--weights q4,q4` compares two engines
        # of the same code, whose single streams have read ~6% apart)
        seen[kind] = seen.get(kind, 0) + 1
        again = f"_{seen[kind]}" if seen[kind] > 1 else ""
        if out:
            name = f"gpu_step_profile_{kind}{'_prefill' if args.prefill else ''}{again}.txt"
            Path(out, name).write_text(text + "\n")


if __name__ == "__main__":
    main()
