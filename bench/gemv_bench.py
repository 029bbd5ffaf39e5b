"""Decode GEMV (backend/kernels/gemv.py) vs F.linear (cuBLAS) at the Llama-3.1-8B shapes, bf16.

    python bench/gemv_bench.py [--no-sweep]

For each projection (qkv 6144x4096, o_proj 4096x4096, gate_up 28672x4096, down 4096x14336,
LM head 128256x4096) and M = 1, 2, 4 rows: microseconds and weight TB/s of cuBLAS, of the
shipped config (`gemv_config`), and at M=1 of the best config in a small sweep. Timing is
what the engine sees: calls replayed from a CUDA graph (no launch cost), cycling through
enough weight copies that the L2 (50 MB) cannot serve a repeat. Prints a table, appends one
JSON line to bench/results/gemv_bench.jsonl (and $OUT/gemv_bench.jsonl when $OUT is set).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}


from common import ensure_sgl_importable  # noqa: E402

ensure_sgl_importable()
from sgl.backend.kernels import triton_gemv as gemv  # noqa: E402


def graph_us(calls: list[Callable[[], Any]], reps: int = 10) -> float:
    """Microseconds per call, replaying all `calls` (cycled to >= 32) from one CUDA graph."""
    seq = list(itertools.islice(itertools.cycle(calls), max(32, len(calls))))
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in seq:
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(seq))


def sweep_configs() -> list[Any]:
    out = []
    for bn, bk, warps in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8)):
        per_thread = bn * bk // (32 * warps)
        if 8 <= per_thread <= 64:
            out.append(gemv.GemvConfig(bn, bk, warps))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-sweep", action="store_true", help="shipped config and cuBLAS only")
    args = ap.parse_args()
    import triton

    dev = torch.device("cuda")
    figures: dict[str, Any] = {}
    lines = []
    for name, (n, k) in SHAPES.items():
        copies = max(1, -(-256 * 2**20 // (n * k * 2)))  # >= 256 MiB of weights: no L2 reuse
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        tb = lambda us: n * k * 2 / (us * 1e-6) / 1e12  # noqa: E731 - weight bytes only
        for m in (1, 2, 4):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), ws[0].float())
            err = (gemv.gemv_triton(x, ws[0]).float() - ref).abs().max().item() / ref.abs().max().item()
            cublas = graph_us([lambda w=w: F.linear(x, w) for w in ws])
            ours = graph_us([lambda w=w: gemv.gemv_triton(x, w) for w in ws])
            row = dict(m=m, cublas_us=cublas, cublas_TB_s=tb(cublas), gemv_us=ours,
                       gemv_TB_s=tb(ours), speedup=cublas / ours, rel_err=err,
                       config=list(gemv.gemv_config(m, n, k)))
            if m == 1 and not args.no_sweep:
                best = None
                for cfg in sweep_configs():
                    try:
                        us = graph_us([lambda w=w, c=cfg: gemv.gemv_triton(x, w, config=c)
                                       for w in ws], reps=5)
                    except Exception as exc:  # a config that does not compile: skip it
                        print(f"  {name} {cfg}: {type(exc).__name__}", flush=True)
                        continue
                    if best is None or us < best[0]:
                        best = (us, cfg)
                if best is not None:
                    row.update(best_us=best[0], best_TB_s=tb(best[0]), best_config=list(best[1]))
            figures[f"{name}_m{m}"] = row
            line = (f"{name:8} {n:>6}x{k:<5} M={m}  cuBLAS {cublas:7.1f} us {tb(cublas):5.2f} TB/s"
                    f"   gemv {ours:7.1f} us {tb(ours):5.2f} TB/s  x{cublas / ours:4.2f}"
                    f"  err {err:.1e}")
            if "best_us" in row:
                line += f"   best {row['best_us']:7.1f} us {row['best_TB_s']:5.2f} TB/s {row['best_config']}"
            print(line, flush=True)
            lines.append(line)
        del ws
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}")
    from common import record

    row = record("gemv_bench", "llama3-8b", "gemv vs cuBLAS (graph-timed)", figures)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "gemv_bench.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
