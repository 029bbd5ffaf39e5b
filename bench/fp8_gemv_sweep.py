"""The FP8 one-row GEMV kernels side by side at the Llama-3.1-8B shapes: the first kernel
(`fp8_decode="cvt"`, its session-6 tiles) against a grid of the word kernel
(`fp8_decode="words"`, quant/triton_fp8.py's `_fp8_words_kernel`), each config checked
against the reference first.

    python bench/fp8_gemv_sweep.py [--budget 240] [--quick] [--pdl on|off|both] [--norm]

Weights: `Fp8Weight.quantize` of random bf16 (std 0.02), cycled through >= 256 MiB of copies;
graph-timed (bench/gemv_bench.py's `graph_us`). `--norm`: every call is an RMSNorm of x and
then the product, as in a decoder layer, so that the GEMVs' early launch (PDL,
kernels/triton_compat.py: they load their first weights while the norm runs) shows; `--pdl`
runs the grid with early launches, without, or both (labels " pdl" / " no-pdl"). Per shape: bf16 cuBLAS, the first kernel at
its session-6 defaults, every word-kernel config; then per N class of GEMV_DEFAULTS (N = 4096:
o_proj and down; 6144: qkv; larger: gate_up and the head) the config with the lowest time per
8B step (32 x the layer shapes, once the head). Correctness: each config's output on the
first copy against float32 dequantize-then-matmul (relative max error; configs over 1e-2 are
dropped, a wrong kernel shows at ~1).

Output: the tables on stdout and in $OUT/fp8_gemv_sweep.md; every measurement as JSON lines in
$OUT/fp8_gemv_sweep.jsonl, written as taken.
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
from quant_sweep import WEIGHT, WeightSet, write_report  # noqa: E402
from quant_sweep import N_CLASSES as CLASSES  # noqa: E402

from sgl.backend.kernels.triton_compat import PDL_SWITCH  # noqa: E402
from sgl.backend.kernels.triton_rmsnorm import rmsnorm_triton  # noqa: E402
from sgl.backend.quant.triton_fp8 import fp8_gemv  # noqa: E402
from sgl.backend.quant.triton_gemv import QGemvConfig  # noqa: E402

# The first kernel's defaults before the word kernel (session 6's sweep)
FIRST = {"4096": QGemvConfig(8, 1024, 4, fp8_decode="cvt"),
         "6144": QGemvConfig(8, 1024, 4, fp8_decode="cvt"),
         "large": QGemvConfig(4, 1024, 4, fp8_decode="cvt")}


def words_grid(quick: bool) -> list[QGemvConfig]:
    out = []
    for bn, bk, warps in itertools.product((2, 4, 8, 16, 32), (512, 1024, 2048, 4096),
                                           (1, 2, 4, 8)):
        per_thread = bn * bk // (32 * warps)  # weight bytes per thread and K step
        if 16 <= per_thread <= 128:
            out.append(QGemvConfig(bn, bk, warps, num_stages=1, fp8_decode="words"))
    out.sort(key=lambda c: abs(math.log2(c.block_n * c.block_k / c.num_warps / 2048)))
    return out[::3] if quick else out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=240.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pdl", choices=("on", "off", "both"), default="off")
    ap.add_argument("--norm", action="store_true")
    args = ap.parse_args()
    t0 = time.monotonic()
    out = results_dir()
    log = open(out / "fp8_gemv_sweep.jsonl", "a")
    ws, res = WeightSet(), {}  # res[(shape, label)] = us

    def put(shape: str, label: str, us: float | None, err: float | None = None,
            cfg: Any = None) -> None:
        n, k = SHAPES[shape]
        row = dict(shape=shape, label=label, us=us, err=err,
                   config=None if cfg is None else cfg._asdict(),
                   tb_s=None if us is None else n * k / us / 1e6)
        log.write(json.dumps(row) + "\n")
        log.flush()
        if us is not None:
            res[shape, label] = us
        print(f"{shape:8} {label:34} {'-' if us is None else f'{us:8.1f} us'}"
              f"{'' if err is None else f'  err {err:.1e}'}", flush=True)

    def inputs(k: int) -> tuple[torch.Tensor, Any]:
        """x [1, K] and what a call does to it first (an RMSNorm with --norm)."""
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        if not args.norm:
            return x, lambda v: v
        weight = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        return x, lambda v: rmsnorm_triton(v, weight, 1e-5)

    def measure(shape: str, cfg: QGemvConfig, label: str) -> float | None:
        n, k = SHAPES[shape]
        x, pre = inputs(k)
        copies = ws.get("fp8", shape)
        try:
            w = copies[0]
            ref = F.linear(pre(x).float(), w.dequantize(torch.float32))
            y = fp8_gemv(pre(x), w.weight, w.scale, config=cfg).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            if not err < 1e-2:
                put(shape, label, None, err, cfg)
                return None
            us = graph_us([lambda w=w: fp8_gemv(pre(x), w.weight, w.scale, config=cfg)
                           for w in copies], reps=5)
        except Exception as exc:  # a tile that does not compile or fit
            print(f"{shape} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return None
        put(shape, label, us, err, cfg)
        return us

    bf16 = WeightSet()
    for cls, names in CLASSES.items():
        for shape in names:
            x, pre = inputs(SHAPES[shape][1])
            copies = bf16.get("bf16", shape)
            put(shape, "bf16 cublas", graph_us([lambda w=w: F.linear(pre(x), w)
                                                for w in copies]))
            bf16.cache.clear()
            PDL_SWITCH[0] = False
            measure(shape, FIRST[cls], "first kernel")
    pdl = {"on": (True,), "off": (False,), "both": (True, False)}[args.pdl]
    grid = [(cfg, early) for cfg in words_grid(args.quick) for early in pdl]
    grid += [(c, True) for c in FIRST.values() if args.pdl != "off"]  # (repeats: one is timed)
    print(f"{len(grid)} configs", flush=True)
    best: dict[str, tuple[QGemvConfig, float, str]] = {}
    for cfg, early in grid:
        if time.monotonic() - t0 > args.budget:
            print("budget reached", flush=True)
            break
        PDL_SWITCH[0] = early
        label = (f"{cfg.fp8_decode} {cfg.block_n}/{cfg.block_k}/{cfg.num_warps}w"
                 f"{' pdl' if early else ' no-pdl'}")
        if any(key[1] == label for key in res):
            continue
        for cls, names in CLASSES.items():
            total = 0.0
            for shape in names:
                us = measure(shape, cfg, label)
                if us is None:
                    total = float("inf")
                    break
                total += WEIGHT[shape] * us
            if total < best.get(cls, (None, float("inf"), ""))[1]:
                best[cls] = (cfg, total, label)
    PDL_SWITCH[0] = True  # (the shipped setting)

    lines = ["| shape | bf16 cuBLAS us | FP8 first kernel us (TB/s) | FP8 best us (TB/s) | "
             "best config | best / first |", "|---|---|---|---|---|---|"]
    step = {"bf16 cublas": 0.0, "first kernel": 0.0, "words": 0.0}
    nan = float("nan")
    for shape, (n, k) in SHAPES.items():
        cls = next(c for c, names in CLASSES.items() if shape in names)
        label = best[cls][2] if cls in best else None
        b, f = res.get((shape, "bf16 cublas")), res.get((shape, "first kernel"))
        wd = res.get((shape, label)) if label else None
        tb = lambda us: n * k / us / 1e6  # noqa: E731 - FP8 weight bytes (the scales: 0.1%)
        for key, v in (("bf16 cublas", b), ("first kernel", f), ("words", wd)):
            step[key] += WEIGHT[shape] * (v or nan)
        lines.append(f"| {shape} | {b or nan:.1f} | {f or nan:.1f} ({tb(f) if f else nan:.2f}) | "
                     f"{wd or nan:.1f} ({tb(wd) if wd else nan:.2f}) | {label} | "
                     f"{(wd / f) if wd and f else nan:.2f} |")
    lines.append(f"| 8B step (32 layers + head) | {step['bf16 cublas']:.0f} | "
                 f"{step['first kernel']:.0f} | {step['words']:.0f} | | "
                 f"{step['words'] / step['first kernel']:.2f} |")
    lines.append("")
    lines.append(f"(--norm {args.norm}: times include an RMSNorm per call; first kernel: "
                 "session-6 tiles, no PDL)")
    write_report(out, "fp8_gemv_sweep", lines, "fp8", best, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
