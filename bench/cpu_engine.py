"""The engine on the CPU with the default model, against transformers in the same run.

    python bench/cpu_engine.py [--single-tokens 128] [--batch 32]

Workloads (fixed seeds, the same requests for every engine):
- single: one 128-token prompt, 128 new tokens (EOS ignored), prefill included, best of
  `--repeats` runs for each engine (the shared machine is noisy).
- batch: 32 requests, prompts uniform 64-512 tokens, outputs uniform 32-256 tokens (EOS
  ignored), all submitted at once: output tokens/s = requested output tokens / wall time.
  The transformers peer runs them as one left-padded batch to the longest output (what
  `generate` can do); only the requested tokens count for it too.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, table  # noqa: E402

import sgl  # noqa: E402
from sgl.backend.reference import load_reference_model  # noqa: E402

MODEL = "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized)"


def workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(64, 512))] for _ in range(n)]
    outs = [rng.randint(32, 256) for _ in range(n)]
    return prompts, outs


def hf_single(model, prompt: list[int], new: int, repeats: int) -> float:
    best = 0.0
    with torch.inference_mode():
        model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=2)  # warm-up
        for _ in range(repeats):
            t = time.perf_counter()
            model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=2)
            best = max(best, new / (time.perf_counter() - t))
    return best


def hf_padded_batch(model, prompts: list[list[int]], outs: list[int]) -> float:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs),
                       do_sample=False, pad_token_id=2)
        return sum(outs) / (time.perf_counter() - t)


async def sgl_single(engine: sgl.Engine, prompt: list[int], new: int, repeats: int = 1) -> float:
    await engine.generate(input_ids=prompt[:16], max_new_tokens=4)  # warm-up
    engine.flush_cache()  # every repeat prefills the prompt, as transformers does
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        await engine.generate(input_ids=prompt, max_new_tokens=new, ignore_eos=True, temperature=0)
        best = max(best, new / (time.perf_counter() - t))
        engine.flush_cache()
    return best


async def sgl_batch(engine: sgl.Engine, prompts: list[list[int]], outs: list[int]) -> float:
    t = time.perf_counter()
    await asyncio.gather(*(engine.generate(input_ids=p, max_new_tokens=o, ignore_eos=True, temperature=0)
                           for p, o in zip(prompts, outs)))
    return sum(outs) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--single-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="single stream: best of this many runs")
    args = ap.parse_args()
    rng = random.Random(1)
    single_prompt = [rng.randrange(100, 40000) for _ in range(128)]
    prompts, outs = workload(args.batch)
    rows = []
    figures: dict[str, float] = {}

    for name, options in [("sgl (overlap)", {"disable_overlap_schedule": False}),
                          ("sgl (no overlap)", {"disable_overlap_schedule": True})]:
        engine = sgl.Engine(**options)
        try:
            s = asyncio.run(sgl_single(engine, single_prompt, args.single_tokens, args.repeats))
            b = asyncio.run(sgl_batch(engine, prompts, outs))
        finally:
            engine.close()
        rows.append({"engine": name, "single tok/s": s, f"batch{args.batch} out tok/s": b})
        figures[f"{name} single"] = s
        figures[f"{name} batch"] = b

    if not args.skip_hf:
        ref = load_reference_model()
        s = hf_single(ref, single_prompt, args.single_tokens, args.repeats)
        b = hf_padded_batch(ref, prompts, outs)
        rows.append({"engine": "transformers generate", "single tok/s": s, f"batch{args.batch} out tok/s": b})
        figures["hf single"] = s
        figures["hf padded batch"] = b
        best = max(figures["sgl (overlap) single"], figures["sgl (no overlap) single"])
        figures["single ratio vs hf"] = best / s
        figures["batch ratio vs hf"] = max(figures["sgl (overlap) batch"], figures["sgl (no overlap) batch"]) / b

    print(table(rows, ["engine", "single tok/s", f"batch{args.batch} out tok/s"]))
    if "single ratio vs hf" in figures:
        print(f"single-stream ratio vs transformers: {figures['single ratio vs hf']:.2f}x; "
              f"batch ratio: {figures['batch ratio vs hf']:.2f}x")
    record("cpu_engine", MODEL, f"single {args.single_tokens} / batch {args.batch} mixed", figures)


if __name__ == "__main__":
    main()
