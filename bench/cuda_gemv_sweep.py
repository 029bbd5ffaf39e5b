"""The CUDA tensor-core 4-bit GEMV (quant/cuda_gemv.py) against what ships at one and two rows,
at the Llama-3.1-8B shapes: its (tiles, warps) grid, each config checked against float32
dequantize-then-matmul first (odd shapes too: N off the 16-row tiles, K off the four-group
blocks, plain and factored scales, a bias).

    python bench/cuda_gemv_sweep.py [--budget 300] [--rows 1,2] [--grid small]

Weights: Q4 in the GPU's factored form (Q4_K structure, 4.75 bits; bench/quant_sweep.py's
`make_weight`), cycled through >= 256 MiB of copies; graph-timed (bench/gemv_bench.py's
`graph_us`). Per shape and row count: bf16 cuBLAS, the Triton path those rows take
(quant_linear with linear.CUDA_GEMV off: the lop3 GEMV at 1-2 rows, the tiled kernel at
3-128, `--rows 1,2,4,8` to compare the CUDA kernel's pairs of rows with it), every
config of `--grid` (full or small), and the shipped config launched early; then the best
config per shape and the 8B step (32 x the four layer shapes + the head as Q4) for each.
Output: stdout and $OUT/cuda_gemv_sweep.md; every
measurement as JSON lines in $OUT/cuda_gemv_sweep.jsonl, written as taken.
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

from sgl.backend.quant import cuda_gemv  # noqa: E402
from sgl.backend.quant.cuda_gemv import CudaGemvConfig, mma_gemv  # noqa: E402
from sgl.backend.quant import linear  # noqa: E402
from sgl.backend.quant.linear import quant_linear  # noqa: E402
from sgl.backend.quant.weight import QuantizedWeight  # noqa: E402

# (tiles, warps, span)
GRIDS = {
    "full": [CudaGemvConfig(t, w, span)
             for t, w, span in itertools.product((1, 2), (2, 4, 8), (1, 2, 4))],
    # the shipped config and its neighbours: a sweep over more row counts in one device call
    "small": [CudaGemvConfig(t, w, span) for t, w, span in ((1, 8, 2), (1, 4, 2), (1, 8, 1),
                                                           (1, 8, 4), (2, 8, 2), (2, 8, 1))],
    # 16 warps (one K step each at K = 4096 and span 2): the small shapes (qkv, o_proj) move
    # ~1.5 TB/s at one row, bound by each warp's two dependent round trips to memory
    "wide": [CudaGemvConfig(t, w, span) for t, w, span in ((1, 8, 2), (1, 16, 1), (1, 16, 2),
                                                          (2, 16, 1), (2, 16, 2))],
    # more programs per SM against fewer registers (min_blocks: at most 64K / (32 warps
    # min_blocks) registers a thread): session 22's profile of the 1-row products found 3
    # programs of 8 warps per SM, each warp stalled on memory half its cycles
    "occupancy": [CudaGemvConfig(*c) for c in ((1, 8, 2), (1, 8, 2, 3), (1, 8, 2, 4),
                                               (1, 8, 1, 4), (1, 4, 1, 8), (1, 4, 2, 8),
                                               (1, 16, 1, 2), (2, 8, 1, 3), (2, 8, 2, 3))],
}
GRID = GRIDS["full"]
STEP = {"qkv": 32, "o_proj": 32, "gate_up": 32, "down": 32, "lm_head": 1}


def rel_err(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None,
            cfg: CudaGemvConfig) -> float:
    ref = F.linear(x.float(), w.dequantize(dtype=torch.float32),
                   None if bias is None else bias.float())
    y = mma_gemv(x, w, bias, config=cfg).float()
    return ((y - ref).abs().max() / ref.abs().max()).item()


def plain_weight(n: int, k: int, seed: int, bits: int = 4) -> QuantizedWeight:
    """Q4_1-like (4 bits) or Q8_0-like with a zero (8 bits): float32 scale and zero per group
    of 32 (any K a multiple of 32)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2 if bits == 4 else k), device="cuda", generator=gen)
    codes = codes.to(torch.uint8) if bits == 4 else (codes - 128).to(torch.int8)
    scale = torch.rand(n, k // 32, device="cuda", generator=gen) * 1e-2
    zero = -torch.rand(n, k // 32, device="cuda", generator=gen) * 8e-2
    return QuantizedWeight(codes, scale, zero, bits, 32, k, f"Q{bits}")


def odd_checks(rows: list[int], kinds: list[str]) -> list[str]:
    """Each config on shapes that end off its tiles (N) and off its steps (K: plain scales
    only, factored ones come in super-blocks of 256 weights), with a bias."""
    bad = []
    cases = []
    if "q4" in kinds:
        cases += [(make_weight("q4", 1000, 768, 7), "factored"),
                  (make_weight("q4", 48, 4096, 8), "factored"), (plain_weight(1000, 800, 9),
                  "plain"), (plain_weight(272, 96, 10), "plain"),
                  (plain_weight(4096, 4096, 11), "plain")]
    if "q8g16" in kinds:  # Q6_K-like groups of 16; Q8_0-like groups of 32 (two chunks each)
        cases += [(make_weight("q8g16", 1000, 768, 12), "factored 8-bit"),
                  (plain_weight(1000, 800, 13, 8), "plain 8-bit"),
                  (plain_weight(272, 96, 14, 8), "plain 8-bit")]
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
    ap.add_argument("--kinds", default="q4", help="q4 (Q4_K-like), q8g16 (Q6_K-like)")
    args = ap.parse_args()
    global GRID
    GRID = GRIDS[args.grid]
    t0 = time.monotonic()
    out = results_dir()
    log = open(out / "cuda_gemv_sweep.jsonl", "a")
    rows = [int(r) for r in args.rows.split(",")]
    kinds = args.kinds.split(",")
    shipped_early = cuda_gemv.EARLY_LAUNCH
    print(f"available: {cuda_gemv.available()}", flush=True)
    bad = odd_checks(rows, kinds)
    print(f"odd-shape checks: {'all within 1e-2' if not bad else bad}", flush=True)
    ws, bf16 = WeightSet(), WeightSet()
    res: dict[tuple[str, str, int, str], float] = {}

    def put(kind: str, shape: str, m: int, label: str, us: float | None,
            err: float | None = None) -> None:
        n, k = SHAPES[shape]
        row = dict(kind=kind, shape=shape, m=m, label=label, us=us, err=err,
                   tb_s=None if us is None else nbytes_of(kind, n, k) / us / 1e6)
        log.write(json.dumps(row) + "\n")
        log.flush()
        if us is not None:
            res[kind, shape, m, label] = us
        tb = "" if us is None else f" {row['tb_s']:5.2f} TB/s"
        print(f"{kind:5} {shape:8} M={m} {label:20} {'-' if us is None else f'{us:8.1f} us'}{tb}"
              f"{'' if err is None else f'  err {err:.1e}'}", flush=True)

    for kind, shape, m in itertools.product(kinds, SHAPES, rows):
        if time.monotonic() - t0 > args.budget:
            print("budget reached", flush=True)
            break
        n, k = SHAPES[shape]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        if ("bf16", shape, m, "bf16 cublas") not in res:
            put("bf16", shape, m, "bf16 cublas", graph_us([lambda w=w: F.linear(x, w)
                                                          for w in bf16.get("bf16", shape)],
                                                         reps=5))
        copies = ws.get(kind, shape)
        linear.CUDA_GEMV = False
        put(kind, shape, m, "triton route", graph_us([lambda w=w: quant_linear(x, w)
                                                      for w in copies], reps=5))
        linear.CUDA_GEMV = True
        cuda_gemv.EARLY_LAUNCH = False  # every config launched normally, then the default early
        for cfg in GRID:
            try:
                err = rel_err(x, copies[0], None, cfg)
                us = (graph_us([lambda w=w: mma_gemv(x, w, config=cfg) for w in copies],
                               reps=5) if err < 1e-2 else None)
            except Exception as exc:  # a config that does not compile or launch
                print(f"{shape} {tuple(cfg)}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            label = f"cuda {cfg.tiles}t {cfg.warps}w {cfg.span}s"
            put(kind, shape, m, label + (f" {cfg.min_blocks}b" if cfg.min_blocks else ""), us, err)
        # the shipped config launched early (cuda_gemv.EARLY_LAUNCH): in the graph each call
        # may start while the one before it runs
        cuda_gemv.EARLY_LAUNCH = True
        try:
            put(kind, shape, m, "early default", graph_us([lambda w=w: mma_gemv(x, w)
                                                           for w in copies], reps=5))
        except Exception as exc:
            print(f"{shape} early launch: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            cuda_gemv.EARLY_LAUNCH = shipped_early
        ws.cache.clear()

    lines = ["| weight | rows | shape | bf16 cuBLAS | Triton route | best CUDA config | us | TB/s "
             "| vs Triton | default launched early |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    steps: dict[tuple[str, int], list[float]] = {}
    for kind, m, shape in itertools.product(kinds, rows, SHAPES):
        cands = {lab: us for (kd, s, mm, lab), us in res.items()
                 if kd == kind and s == shape and mm == m and lab.startswith("cuda")}
        if not cands or (kind, shape, m, "triton route") not in res:
            continue
        lab, us = min(cands.items(), key=lambda kv: kv[1])
        early = res.get((kind, shape, m, "early default"), float("nan"))
        n, k = SHAPES[shape]
        ship, blas = res[kind, shape, m, "triton route"], res["bf16", shape, m, "bf16 cublas"]
        lines.append(f"| {kind} | {m} | {shape} | {blas:.1f} | {ship:.1f} | {lab} | {us:.1f} | "
                     f"{nbytes_of(kind, n, k) / us / 1e6:.2f} | {us / ship:.2f} | {early:.1f} |")
        tot = steps.setdefault((kind, m), [0.0, 0.0, 0.0, 0.0])
        for i, v in enumerate((blas, ship, us, early)):
            tot[i] += STEP[shape] * v
    for (kind, m), (blas, ship, best, early) in steps.items():
        lines.append(f"| {kind} | {m} | 8B step | {blas:.0f} | {ship:.0f} | best per shape | "
                     f"{best:.0f} | | {best / ship:.2f} | {early:.0f} |")
    text = "\n".join(lines)
    print(text, flush=True)
    (out / "cuda_gemv_sweep.md").write_text(text + "\n")
    print(f"done in {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
