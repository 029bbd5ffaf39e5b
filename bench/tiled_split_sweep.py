"""Split-K in the tiled kernels (`GemmConfig.split_k`): 4-bit (Q4_K structure, factored) and
FP8 weights at decode batches of the Llama-3.1-8B shapes, against what ships at the same rows
(`quant_linear`: the table's tiles unsplit, or scratch + cuBLAS past the tiled rows) and bf16
cuBLAS.

    python bench/tiled_split_sweep.py [--pairs q4:128,q4:16,fp8:16,q4:64,q4:256] [--budget 240]
                                      [--join off|on|both] [--warps 4,8]
                                      [--operands table|both]

Per (kind, rows) it times, on every shape, the table's tile unsplit and split 2/4/8 at BLOCK_N
32/64/128 (the table's BLOCK_M and operand order; at 128+ rows also BLOCK_M 128; 4-bit
weights with and without `join`, one dot per K step over both halves of a group), each
checked against float32 dequantize-then-matmul first; then prints per N class (N <= 8192,
larger) the best config and the per-8B-step totals (32 layers x the four projections + the
head) of bf16, what ships and the best split. Graph-timed over >= 256 MiB of weight copies
(bench/quant_sweep.py). Stops at `--budget` seconds with what it has (kind:rows pairs in the
order given: `fixed`'s 128 rows of 4-bit weights first). Tables to stdout and
$OUT/tiled_split_sweep.md.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable  # noqa: E402

ensure_sgl_importable()
from gemv_bench import SHAPES  # noqa: E402
from quant_sweep import WEIGHT, WeightSet, class_of, save_table, time_path  # noqa: E402

from sgl.backend.quant.linear import cuda_route  # noqa: E402
from sgl.backend.quant.triton_gemm import GemmConfig, gemm_config  # noqa: E402

GROUP = {"q4": 32, "fp8": 64}


def candidates(kind: str, m: int, n: int, joins: tuple[bool, ...],
               warps: tuple[int, ...] = (), orders: tuple[bool, ...] = ()) -> list[GemmConfig]:
    """The table's config varied: BLOCK_M (128 too from 128 rows), BLOCK_N, split, and the
    `join`, warp counts and operand orders (`weight_as_a`) asked for (default: the table's)."""
    base = gemm_config(m, n, 4096, GROUP[kind], kind)
    block_ms = [base.block_m] + ([128] if m >= 128 and base.block_m != 128 else [])
    return [base._replace(block_m=block_m, block_n=block_n, split_k=split, split_reduce="last",
                          join=join, num_warps=num_warps, weight_as_a=weight_as_a)
            for block_m, block_n, split, join, num_warps, weight_as_a in itertools.product(
                block_ms, (32, 64, 128), (1, 2, 4, 8), joins if kind == "q4" else (False,),
                warps or (base.num_warps,), orders or (base.weight_as_a,))]


def checked(ws: WeightSet, kind: str, name: str, x: torch.Tensor, path: str,
            cfg: GemmConfig | None, ref: torch.Tensor) -> float | None:
    """time_path after a check of the first copy's result (None if it fails to compile)."""
    from quant_sweep import call

    try:
        y = call(kind, ws.get(kind, name)[0], x, path, cfg)()
    except Exception as exc:  # too many registers or shared memory
        print(f"    {name} {kind} M={x.shape[0]} {cfg}: {type(exc).__name__}", flush=True)
        return None
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, (kind, name, x.shape[0], path, cfg, err)
    return time_path(ws, kind, name, x, path, cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="q4:128,q4:16,fp8:16,q4:64,q4:256,fp8:64")
    ap.add_argument("--budget", type=float, default=240.0)
    ap.add_argument("--join", choices=("off", "on", "both"), default="both",
                    help="4-bit tiles: `GemmConfig.join` (one dot per K step) off, on or both")
    ap.add_argument("--warps", default="", help="warps per program to try, e.g. 4,8 "
                    "(default: the table's)")
    ap.add_argument("--operands", choices=("table", "both"), default="table",
                    help="`weight_as_a`: the table's, or both operand orders (a weight tile "
                    "as the first operand stays in registers: bench/kernel_loop_stats.py)")
    args = ap.parse_args()
    joins = {"off": (False,), "on": (True,), "both": (False, True)}[args.join]
    warps = tuple(int(w) for w in args.warps.split(",") if w)
    orders = (False, True) if args.operands == "both" else ()
    t0 = time.monotonic()
    ws = WeightSet()
    lines = ["| kind | rows | class | bf16 us/step | shipped (route) us/step | "
             "best split us/step | best / shipped | best / bf16 | best config per class |", "|" + "---|" * 9]
    for pair in args.pairs.split(","):
        kind, m = pair.split(":")[0], int(pair.split(":")[1])
        if time.monotonic() - t0 > args.budget:
            print(f"budget reached before {kind} M={m}", flush=True)
            break
        per: dict[str, dict[str, float]] = {}  # class -> {label: us per step}
        best_cfg: dict[str, GemmConfig] = {}
        for cls in ("small", "large"):
            names = [s for s in SHAPES if class_of(s) == cls]
            totals: dict[GemmConfig | str, float] = {}
            for name in names:
                n, k = SHAPES[name]
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w0 = ws.get(kind, name)[0]
                ref = F.linear(x.float(), w0.dequantize(dtype=torch.float32))
                for label, path, cfg in [("bf16", "cublas", None),
                                         ("shipped", "shipped", None)]:
                    us = (time_path(ws, "bf16", name, x, path) if label == "bf16"
                          else checked(ws, kind, name, x, path, cfg, ref))
                    totals[label] = totals.get(label, 0.0) + WEIGHT[name] * (us or 1e9)
                for cfg in candidates(kind, m, n, joins, warps, orders):
                    us = checked(ws, kind, name, x, "gemm", cfg, ref)
                    totals[cfg] = totals.get(cfg, 0.0) + WEIGHT[name] * (us or 1e9)
                    print(f"{kind} M={m} {name} {tuple(cfg)}: "
                          f"{'-' if us is None else f'{us:.1f}'} us", flush=True)
            cfgs = {c: t for c, t in totals.items() if isinstance(c, GemmConfig)}
            best_cfg[cls] = min(cfgs, key=cfgs.get)
            per[cls] = {"bf16": totals["bf16"], "shipped": totals["shipped"],
                        "best": cfgs[best_cfg[cls]]}
        for cls, t in per.items():
            line = (f"| {kind} | {m} | {cls} | {t['bf16']:.0f} | {t['shipped']:.0f} "
                    f"({cuda_route(m, kind)}) | {t['best']:.0f} | "
                    f"{t['best'] / t['shipped']:.2f} | {t['best'] / t['bf16']:.2f} | "
                    f"{tuple(best_cfg[cls])} |")
            lines.append(line)
            print(line, flush=True)
        step = {label: sum(t[label] for t in per.values()) for label in ("bf16", "shipped",
                                                                           "best")}
        lines.append(f"| {kind} | {m} | 8B step | {step['bf16']:.0f} | {step['shipped']:.0f} | "
                     f"{step['best']:.0f} | {step['best'] / step['shipped']:.2f} | "
                     f"{step['best'] / step['bf16']:.2f} | |")
        print(lines[-1], flush=True)
    save_table("tiled_split_sweep", lines, t0)


if __name__ == "__main__":
    main()
