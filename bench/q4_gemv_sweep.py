"""The 4-bit one-row GEMV kernels side by side at the Llama-3.1-8B shapes: the shipped
defaults (GEMV_DEFAULTS) against a grid of one kernel: the lop3 kernel (`--unpack lop3`,
triton_q4gemv.py) or the tensor-core one (`--unpack mma`, triton_q4mma.py), with each config
checked against the reference first.

    python bench/q4_gemv_sweep.py [--budget 420] [--rows 1,2] [--quick] [--unpack lop3|mma]

Weights: Q4 in the GPU's factored form (Q4_K structure, 4.75 bits; bench/quant_sweep.py's
`make_weight`), cycled through >= 256 MiB of copies; graph-timed (bench/gemv_bench.py's
`graph_us`). Per shape: bf16 cuBLAS, the shipped Q4 GEMV, every config of the kernel; then per N
class of GEMV_DEFAULTS (N = 4096: o_proj and down; 6144: qkv; larger: gate_up and the head)
the config with the lowest time per 8B step (32 x the layer shapes, once the head), split-K
tried on the best of the N = 4096 class. Correctness: each config's output on the first
copy against float32 dequantize-then-matmul (relative max error; configs over 1e-2 are
dropped, a wrong kernel shows at ~1).

Output: the tables on stdout and in $OUT/q4_gemv_sweep.md (`--unpack mma`: q4_gemv_sweep_mma.md);
every measurement as JSON lines in $OUT/q4_gemv_sweep.jsonl, written as taken.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable, results_dir  # noqa: E402

ensure_sgl_importable()
from gemv_bench import SHAPES, graph_us  # noqa: E402
from quant_sweep import WEIGHT, WeightSet, nbytes_of, write_report  # noqa: E402
from quant_sweep import N_CLASSES as CLASSES  # noqa: E402

from sgl.backend.quant.triton_gemv import QGemvConfig, gemv_config, qgemv  # noqa: E402



def lop3_grid(quick: bool) -> list[QGemvConfig]:
    out = []
    # (Triton's num_stages changed nothing here in the first device run: the kernel's own
    # `prefetch` is swept instead)
    for bn, bk, warps, prefetch in itertools.product((4, 8, 16, 32, 64), (512, 1024, 2048),
                                                     (1, 2, 4), (True, False)):
        per_thread = bn * bk // 2 // (32 * warps)  # code bytes per thread and K step
        if 16 <= per_thread <= 256:
            out.append(QGemvConfig(bn, bk, warps, num_stages=1, unpack="lop3",
                                   prefetch=prefetch))
    # the likeliest first (the budget may cut the grid): prefetch, ~128 code bytes a thread
    out.sort(key=lambda c: (not c.prefetch, abs(math.log2(c.block_n * c.block_k / 64
                                                          / c.num_warps / 128))))
    return out[::5] if quick else out


def mma_grid(quick: bool) -> list[QGemvConfig]:
    """(rows, K step, warps) of the tensor-core kernel: 16 rows per warp at most (the MMA's
    M), 64 rows on 4 warps being Hopper's wgmma; ~128-256 weights a thread per K step."""
    tiles = ((64, 256, 4), (64, 512, 4), (128, 256, 4), (128, 256, 8), (128, 512, 8),
             (64, 1024, 4), (32, 512, 2), (32, 256, 2), (16, 512, 1), (16, 1024, 1),
             (32, 1024, 2), (256, 256, 8))
    out = [QGemvConfig(bn, bk, warps, num_stages=stages, unpack="mma")
           for stages in (1, 2) for bn, bk, warps in tiles]
    return out[::3] if quick else out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=420.0)
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--unpack", choices=("lop3", "mma"), default="lop3",
                    help="the kernel whose configs are swept against the shipped defaults")
    args = ap.parse_args()
    t0 = time.monotonic()
    out = results_dir()
    log = open(out / "q4_gemv_sweep.jsonl", "a")
    ws, res = WeightSet(), {}  # res[(shape, m, label)] = us
    bf16 = WeightSet()
    lines: list[str] = []

    def put(shape: str, m: int, label: str, us: float | None, err: float | None = None,
            cfg: Any = None) -> None:
        n, k = SHAPES[shape]
        row = dict(shape=shape, m=m, label=label, us=us, err=err,
                   config=None if cfg is None else cfg._asdict(),
                   tb_s=None if us is None else nbytes_of("q4", n, k) / us / 1e6)
        log.write(json.dumps(row) + "\n")
        log.flush()
        if us is not None:
            res[shape, m, label] = us
        print(f"{shape:8} M={m} {label:44} {'-' if us is None else f'{us:8.1f} us'}"
              f"{'' if err is None else f'  err {err:.1e}'}", flush=True)

    def check(x: torch.Tensor, w: Any, cfg: QGemvConfig) -> float:
        ref = F.linear(x.float(), w.dequantize(dtype=torch.float32))
        y = qgemv(x, w, config=cfg).float()
        return ((y - ref).abs().max() / ref.abs().max()).item()

    def measure(shape: str, m: int, cfg: QGemvConfig, label: str) -> float | None:
        n, k = SHAPES[shape]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        copies = ws.get("q4", shape)
        try:
            err = check(x, copies[0], cfg)
            if not err < 1e-2:
                put(shape, m, label, None, err, cfg)
                return None
            us = graph_us([lambda w=w: qgemv(x, w, config=cfg) for w in copies], reps=5)
        except Exception as exc:  # a tile that does not compile or fit
            print(f"{shape} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return None
        put(shape, m, label, us, err, cfg)
        return us

    rows = [int(r) for r in args.rows.split(",")]
    for shape, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        copies = bf16.get("bf16", shape)
        put(shape, 1, "bf16 cublas", graph_us([lambda w=w: F.linear(x, w) for w in copies]))
        measure(shape, 1, gemv_config("q4", n, k, 32), "shipped")
    bf16.cache.clear()
    kind = args.unpack
    grid = lop3_grid(args.quick) if kind == "lop3" else mma_grid(args.quick)
    print(f"{len(grid)} {kind} configs", flush=True)
    best: dict[str, tuple[QGemvConfig, float, str]] = {}
    for cfg in grid:
        if time.monotonic() - t0 > args.budget:
            print("budget reached", flush=True)
            break
        label = (f"{kind} {cfg.block_n}/{cfg.block_k}/{cfg.num_warps}w"
                 f"{' prefetch' if cfg.prefetch else ''}"
                 f"{f' s{cfg.num_stages}' if kind == 'mma' else ''}")
        for cls, names in CLASSES.items():
            total = 0.0
            for shape in names:
                us = measure(shape, 1, cfg, label)
                if us is None:
                    total = float("inf")
                    break
                total += WEIGHT[shape] * us
            if total < best.get(cls, (None, float("inf"), ""))[1]:
                best[cls] = (cfg, total, label)
    if "4096" in best:  # split-K on the N = 4096 class's best tiles
        base = best["4096"][0]
        for split, bn in itertools.product((2, 4), (base.block_n, 2 * base.block_n)):
            if time.monotonic() - t0 > args.budget + 60:
                break
            cfg = base._replace(block_n=bn, split_k=split, split_reduce="last")
            label = (f"{kind} {bn}/{cfg.block_k}/{cfg.num_warps}w"
                     f"{' prefetch' if cfg.prefetch else ''} split{split}")
            total = sum(WEIGHT[s] * (measure(s, 1, cfg, label) or float("inf"))
                        for s in CLASSES["4096"])
            if total < best["4096"][1]:
                best["4096"] = (cfg, total, label)
    for m in rows:
        if m == 1:
            continue
        for shape, (n, k) in SHAPES.items():
            measure(shape, m, gemv_config("q4", n, k, 32), "shipped")
            for cls, (cfg, _, _) in best.items():
                if shape in CLASSES[cls]:
                    measure(shape, m, cfg, f"{kind} best")

    lines.append(f"| shape | bf16 cuBLAS us | Q4 shipped us (TB/s) | Q4 {kind} best us (TB/s) | "
                 f"{kind} config | {kind} / shipped |")
    lines.append("|---|---|---|---|---|---|")
    step = {"bf16 cublas": 0.0, "shipped": 0.0, kind: 0.0}
    for shape, (n, k) in SHAPES.items():
        cls = next(c for c, names in CLASSES.items() if shape in names)
        label = best[cls][2] if cls in best else None
        b, s = res.get((shape, 1, "bf16 cublas")), res.get((shape, 1, "shipped"))
        lo = res.get((shape, 1, label)) if label else None
        tb = lambda us: nbytes_of("q4", n, k) / us / 1e6  # noqa: E731
        for key, v in (("bf16 cublas", b), ("shipped", s), (kind, lo)):
            step[key] += WEIGHT[shape] * (v or float("nan"))
        lines.append(f"| {shape} | {b or float('nan'):.1f} | {s or float('nan'):.1f} "
                     f"({tb(s) if s else float('nan'):.2f}) | "
                     f"{lo or float('nan'):.1f} ({tb(lo) if lo else float('nan'):.2f}) | "
                     f"{label} | {(lo / s) if lo and s else float('nan'):.2f} |")
    lines.append(f"| 8B step (32 layers + head) | {step['bf16 cublas']:.0f} | "
                 f"{step['shipped']:.0f} | {step[kind]:.0f} | | "
                 f"{step[kind] / step['shipped']:.2f} |")
    for m in rows:
        if m == 1:
            continue
        for shape in SHAPES:
            s, lo = res.get((shape, m, "shipped")), res.get((shape, m, f"{kind} best"))
            lines.append(f"| {shape} M={m} | | {s or float('nan'):.1f} | "
                         f"{lo or float('nan'):.1f} | best | "
                         f"{(lo / s) if lo and s else float('nan'):.2f} |")
    lines.append("")
    write_report(out, "q4_gemv_sweep" if kind == "lop3" else f"q4_gemv_sweep_{kind}", lines,
                 "q4", best, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
