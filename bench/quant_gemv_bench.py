"""Quantized linears (backend/quant: Triton GEMV / tiled / scratch + cuBLAS) vs bf16 at the
Llama-3.1-8B layer shapes, with a sweep of every kernel variant: one command for the device.

    python bench/quant_gemv_bench.py [--budget 540] [--rows 1,2,4,16,64,256,1024]
                                     [--phases base,gemv,split,gemm] [--kinds q4,fp8,q8g16]
                                     [--quick]

Weights per projection (qkv 6144x4096, o_proj 4096x4096, gate_up 28672x4096, down
4096x14336, LM head 128256x4096): bf16 (cuBLAS, and our bf16 GEMV at one row), Q4 (4-bit
codes per 32 with K-quant scales in the GPU's factored form, quant/factored.py: Q4_K's
mapping, 4.75 bits per weight), Q8/16 (8-bit codes per 16: Q6_K's, the head and some layers
of a Q4_K_M file, 9.25 bits) and FP8 (1 byte plus a float32 scale per row).

Phases (the run stops at --budget seconds and reports what it has), in this order: base at
one row, Q4's GEMV sweep, base at the other row counts, then per kind (Q4, FP8, Q8) its GEMV
sweep (Q4's done) and its tiled sweep, 256 rows first:
  base   every path as shipped: bf16; per kind the GEMV at 1, 2, 4 rows, the tiled kernel
         (its default tiles, both operand orders) and scratch + cuBLAS from 2 rows on
  gemv   one-row sweep per kind (quant_sweep.py): tiles first (block_n x block_k x warps,
         scored by the summed time of the shapes in each N class), then the variant flags on
         the best tiles (I2F vs the 2^23 trick, int32 word loads, pipelining depth; FP8: the
         three e4m3 decodes)
  split  one-row split-K sweep per kind, after `gemv` when both are asked (from the default
         config when alone): K slices 2/4/8 (2/4 for the large N class) x 16-64 rows per
         program x K steps of 256/512 x 4/8 warps, with the flags found so far and the
         one-launch reduction, then on the best the two-launch reduction and other depths.
         `--phases base,split --rows 1 --budget 240` is the short run (the default and
         bf16 at one row, then the split grids by kind, q4 first)
  gemm   tiled sweep per kind at 16, 64, 256 and 1,024 rows: tiles and operand order, then
         warps and stages on the best
Then the routes: per kind and row count the fastest of gemv / gemm / scratch over all five
shapes, as the CUDA_ROUTES table of quant/linear.py.

Output: the table on stdout and in $OUT/quant_gemv_table.md, every measurement as JSON lines
in $OUT/quant_gemv_sweep.jsonl (written as they are taken: a killed run keeps its figures),
one summary line in bench/results/quant_gemv_bench.jsonl, and three Python lines to paste:
GEMV_DEFAULTS (quant/triton_gemv.py), GEMM_DEFAULTS (quant/triton_gemm.py) and CUDA_ROUTES
(quant/linear.py); an entry the run did not measure keeps today's value. Timing as in
bench/gemv_bench.py: calls replayed from one CUDA graph, cycling through enough weight copies
(>= 256 MiB) that the L2 cannot serve a repeat.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable, results_dir  # noqa: E402

ensure_sgl_importable()
from quant_sweep import (  # noqa: E402
    TABLE_KIND,
    Budget,
    Recorder,
    WeightSet,
    gemm_sweep,
    gemv_sweep,
    routes_table,
    time_path,
)
from gemv_bench import SHAPES  # noqa: E402

from sgl.backend.quant.triton_gemm import gemm_config  # noqa: E402

QUANT = ("q4", "q8g16", "fp8")


def base_phase(ws: WeightSet, rows: list[int], rec: Recorder, budget: Budget) -> None:
    """Every path as shipped, per shape, kind and row count."""
    for name, (n, k) in SHAPES.items():
        for m in rows:
            if budget.over():
                return
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            rec.add("base", name, "bf16", m, "shipped", time_path(ws, "bf16", name, x, "shipped"))
            rec.add("base", name, "bf16", m, "cublas", time_path(ws, "bf16", name, x, "cublas"))
            for kind in QUANT:
                paths = ["gemv"] if m <= 4 else []
                if m > 1:
                    paths += ["gemm", "gemm_wa", "scratch"]
                for path in paths:
                    cfg = None
                    if path.startswith("gemm"):
                        cfg = gemm_config(m, n, k, 16 if kind == "q8g16" else 32,
                                          TABLE_KIND[kind])._replace(
                            weight_as_a=path == "gemm_wa")
                    rec.add("base", name, kind, m, path,
                            time_path(ws, kind, name, x, path, cfg), config=cfg)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=540.0,
                    help="seconds for the whole run; sweeps stop there (device calls: 600)")
    ap.add_argument("--rows", default="1,2,4,16,64,256,1024")
    ap.add_argument("--quick", action="store_true", help="small grids (a smoke test)")
    ap.add_argument("--phases", default="base,gemv,split,gemm")
    ap.add_argument("--kinds", default="q4,fp8,q8g16", help="sweep order of the weight kinds")
    args = ap.parse_args()
    import triton

    rows = [int(r) for r in args.rows.split(",")]
    phases = args.phases.split(",")
    unknown = set(phases) - {"base", "gemv", "split", "gemm"}
    if unknown:
        ap.error(f"--phases: unknown {sorted(unknown)}; use base, gemv, split, gemm")
    out = results_dir()
    budget = Budget(args.budget)
    rec = Recorder(out / "quant_gemv_sweep.jsonl")
    ws = WeightSet()
    best: dict[str, Any] = {}
    kinds = args.kinds.split(",")
    # The order is the priority: one row everywhere, then the first kind's GEMV sweep (the
    # issue's single-stream targets), then the batches everywhere, then the rest by kind.
    if "base" in phases:
        base_phase(ws, [m for m in rows if m == 1], rec, budget)
    one_row = "gemv" in phases or "split" in phases

    def sweep_one_row(kind: str) -> None:
        best[f"gemv_{kind}"] = gemv_sweep(ws, kind, rec, budget, args.quick,
                                          tiles="gemv" in phases, split="split" in phases)

    if one_row:
        sweep_one_row(kinds[0])
    if "base" in phases:
        base_phase(ws, [m for m in rows if m > 1], rec, budget)
    for i, kind in enumerate(kinds):
        if one_row and i > 0:
            sweep_one_row(kind)
        if "gemm" in phases:
            best[f"gemm_{kind}"] = gemm_sweep(ws, kind, rec, budget, args.quick)
    text = rec.report(best, routes_table(rec, rows))
    text += (f"\n\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
             f"triton {triton.__version__}; {budget.elapsed():.0f} s"
             f"{' (budget reached: partial)' if budget.hit else ''}\n")
    print(text, flush=True)
    (out / "quant_gemv_table.md").write_text(text)
    from common import record

    record("quant_gemv_bench", "llama3-8b", "quantized linears vs bf16, variant sweep "
           "(graph-timed)", rec.summary(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
