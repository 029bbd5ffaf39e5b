"""The CUDA tensor-core 4-bit GEMV (quant/cuda_q4mma.py) against what ships at one and two rows,
at the Llama-3.1-8B shapes: its (tiles, warps) grid, each config checked against float32
dequantize-then-matmul first (odd shapes too: N off the 16-row tiles, K off the four-group
blocks, plain and factored scales, a bias).

    python bench/q4_cuda_sweep.py [--budget 300] [--rows 1,2] [--grid small]

Weights: Q4 in the GPU's factored form (Q4_K structure, 4.75 bits; bench/quant_sweep.py's
`make_weight`), cycled through >= 256 MiB of copies; graph-timed (bench/gemv_bench.py's
`graph_us`). Per shape and row count: bf16 cuBLAS, the Triton path those rows take
(quant_linear with linear.CUDA_Q4_GEMV off: the lop3 GEMV at 1-2 rows, the tiled kernel at
3-128, `--rows 1,2,4,8` to compare the CUDA kernel's pairs of rows with it), every
config of `--grid` (full or small), and the shipped config launched early; then the best
config per shape and the 8B step (32 x the four layer shapes + the head as Q4) for each.
Output: stdout and $OUT/q4_cuda_sweep.md; every
measurement as JSON lines in $OUT/q4_cuda_sweep.jsonl, written as taken.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable, results_dir  # noqa: E402

ensure_sgl_importable()
from gemv_bench import SHAPES, graph_us  # noqa: E402
from quant_sweep import WeightSet, make_weight, nbytes_of  # noqa: E402

from sgl.backend.quant import cuda_q4mma  # noqa: E402
from sgl.backend.quant.cuda_q4mma import CudaQ4Config, q4_mma_gemv  # noqa: E402
from sgl.backend.quant import linear  # noqa: E402
from sgl.backend.quant.linear import quant_linear  # noqa: E402
from sgl.backend.quant.weight import QuantizedWeight  # noqa: E402

# (tiles, warps, span)
GRIDS = {
    "full": [CudaQ4Config(t, w, span)
             for t, w, span in itertools.product((1, 2), (2, 4, 8), (1, 2, 4))],
    # the shipped config and its neighbours: a sweep over more row counts in one device call
    "small": [CudaQ4Config(t, w, span) for t, w, span in ((1, 8, 2), (1, 4, 2), (1, 8, 1),
                                                           (1, 8, 4), (2, 8, 2))],
}
GRID = GRIDS["full"]
STEP = {"qkv": 32, "o_proj": 32, "gate_up": 32, "down": 32, "lm_head": 1}


def rel_err(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None,
            cfg: CudaQ4Config) -> float:
    ref = F.linear(x.float(), w.dequantize(dtype=torch.float32),
                   None if bias is None else bias.float())
    y = q4_mma_gemv(x, w, bias, config=cfg).float()
    return ((y - ref).abs().max() / ref.abs().max()).item()


def plain_weight(n: int, k: int, seed: int) -> QuantizedWeight:
    """Q4_1-like: float32 scale and zero per group of 32 (any K a multiple of 32)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), device="cuda", generator=gen).to(torch.uint8)
    scale = torch.rand(n, k // 32, device="cuda", generator=gen) * 1e-2
    zero = -torch.rand(n, k // 32, device="cuda", generator=gen) * 8e-2
    return QuantizedWeight(codes, scale, zero, 4, 32, k, "Q4_1")


def odd_checks(rows: list[int]) -> list[str]:
    """Each config on shapes that end off its tiles (N) and off its blocks of four groups
    (K: plain scales only, factored ones come in super-blocks of eight groups), with a bias."""
    bad = []
    cases = [(make_weight("q4", 1000, 768, 7), "factored"), (make_weight("q4", 48, 4096, 8),
             "factored"), (plain_weight(1000, 800, 9), "plain"), (plain_weight(272, 96, 10),
             "plain"), (plain_weight(4096, 4096, 11), "plain")]
    for (w, form), m in itertools.product(cases, rows):
        n, k = w.shape
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for cfg in GRID:
            if 16 * cfg.tiles > n:
                continue
            err = rel_err(x, w, bias, cfg)
            if not err < 1e-2:
                bad.append(f"{form} {n}x{k} M={m} {tuple(cfg)}: err {err:.2e}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="full")
    args = ap.parse_args()
    global GRID
    GRID = GRIDS[args.grid]
    t0 = time.monotonic()
    out = results_dir()
    log = open(out / "q4_cuda_sweep.jsonl", "a")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"available: {cuda_q4mma.available()}", flush=True)
    bad = odd_checks(rows)
    print(f"odd-shape checks: {'all within 1e-2' if not bad else bad}", flush=True)
    ws, bf16 = WeightSet(), WeightSet()
    res: dict[tuple[str, int, str], float] = {}

    def put(shape: str, m: int, label: str, us: float | None, err: float | None = None) -> None:
        n, k = SHAPES[shape]
        row = dict(shape=shape, m=m, label=label, us=us, err=err,
                   tb_s=None if us is None else nbytes_of("q4", n, k) / us / 1e6)
        log.write(json.dumps(row) + "\n")
        log.flush()
        if us is not None:
            res[shape, m, label] = us
        tb = "" if us is None else f" {row['tb_s']:5.2f} TB/s"
        print(f"{shape:8} M={m} {label:20} {'-' if us is None else f'{us:8.1f} us'}{tb}"
              f"{'' if err is None else f'  err {err:.1e}'}", flush=True)

    for shape, m in itertools.product(SHAPES, rows):
        if time.monotonic() - t0 > args.budget:
            print("budget reached", flush=True)
            break
        n, k = SHAPES[shape]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        put(shape, m, "bf16 cublas", graph_us([lambda w=w: F.linear(x, w)
                                               for w in bf16.get("bf16", shape)], reps=5))
        copies = ws.get("q4", shape)
        linear.CUDA_Q4_GEMV = False
        put(shape, m, "triton route", graph_us([lambda w=w: quant_linear(x, w) for w in copies],
                                               reps=5))
        linear.CUDA_Q4_GEMV = True
        for cfg in GRID:
            try:
                err = rel_err(x, copies[0], None, cfg)
                us = (graph_us([lambda w=w: q4_mma_gemv(x, w, config=cfg) for w in copies],
                               reps=5) if err < 1e-2 else None)
            except Exception as exc:  # a config that does not compile or launch
                print(f"{shape} {tuple(cfg)}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            put(shape, m, f"cuda {cfg.tiles}t {cfg.warps}w {cfg.span}s", us, err)
        # the shipped config launched early (cuda_q4mma.EARLY_LAUNCH): in the graph each call
        # may start while the one before it runs
        cuda_q4mma.EARLY_LAUNCH = True
        try:
            put(shape, m, "early default", graph_us([lambda w=w: q4_mma_gemv(x, w)
                                                     for w in copies], reps=5))
        except Exception as exc:
            print(f"{shape} early launch: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            cuda_q4mma.EARLY_LAUNCH = False
        bf16.cache.clear()
        ws.cache.clear()

    lines = ["| rows | shape | bf16 cuBLAS | Triton route | best CUDA config | us | TB/s "
             "| vs Triton | default launched early |",
             "|---|---|---|---|---|---|---|---|---|"]
    steps: dict[int, list[float]] = {}
    for m, shape in itertools.product(rows, SHAPES):
        cands = {lab: us for (s, mm, lab), us in res.items()
                 if s == shape and mm == m and lab.startswith("cuda")}
        if not cands or (shape, m, "triton route") not in res:
            continue
        lab, us = min(cands.items(), key=lambda kv: kv[1])
        early = res.get((shape, m, "early default"), float("nan"))
        n, k = SHAPES[shape]
        ship, blas = res[shape, m, "triton route"], res[shape, m, "bf16 cublas"]
        lines.append(f"| {m} | {shape} | {blas:.1f} | {ship:.1f} | {lab} | {us:.1f} | "
                     f"{nbytes_of('q4', n, k) / us / 1e6:.2f} | {us / ship:.2f} | {early:.1f} |")
        tot = steps.setdefault(m, [0.0, 0.0, 0.0, 0.0])
        for i, v in enumerate((blas, ship, us, early)):
            tot[i] += STEP[shape] * v
    for m, (blas, ship, best, early) in steps.items():
        lines.append(f"| {m} | 8B step | {blas:.0f} | {ship:.0f} | best per shape | {best:.0f} "
                     f"| | {best / ship:.2f} | {early:.0f} |")
    text = "\n".join(lines)
    print(text, flush=True)
    (out / "q4_cuda_sweep.md").write_text(text + "\n")
    print(f"done in {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
