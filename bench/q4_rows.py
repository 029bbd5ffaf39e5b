"""The 4-bit products at a few rows (decode of 1-16 requests) at the Llama-3.1-8B shapes: what
ships (`quant_linear`'s CUDA route: the one-row GEMV up to 2 rows, the tiled kernel up to 64)
against the tensor-core GEMV (`unpack="mma"`, all rows of x in one pass over the weights) at
the configs the session-16 sweep found best at one row.

    python bench/q4_rows.py [--rows 1,2,4,8,16]

Weights as bench/q4_gemv_sweep.py's (Q4_K structure, factored form, >= 256 MiB of copies,
graph-timed); each path checked against float32 dequantize-then-matmul first. Prints µs per
call per shape and the per-8B-step total (32 layers x the four projections + the head);
the table also goes to $OUT/q4_rows.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable, results_dir  # noqa: E402

ensure_sgl_importable()
from gemv_bench import SHAPES, graph_us  # noqa: E402
from quant_sweep import WEIGHT, WeightSet  # noqa: E402

from sgl.backend.quant.linear import cuda_route, quant_linear  # noqa: E402
from sgl.backend.quant.triton_gemv import QGemvConfig, qgemv  # noqa: E402

# The sweep's best tensor-core configs per N class at one row (session 16, H200).
MMA = {4096: QGemvConfig(16, 512, 1, num_stages=2, split_k=4, split_reduce="last", unpack="mma"),
       6144: QGemvConfig(32, 512, 2, num_stages=2, unpack="mma"),
       1 << 62: QGemvConfig(32, 256, 2, num_stages=1, unpack="mma")}


def mma_config(n: int) -> QGemvConfig:
    return next(cfg for limit, cfg in MMA.items() if n <= limit)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    args = ap.parse_args()
    ws = WeightSet()
    totals: dict[tuple[int, str], float] = {}
    lines = ["| rows | shape | shipped route | shipped us | mma us | mma / shipped |",
             "|---|---|---|---|---|---|"]
    for m in [int(r) for r in args.rows.split(",")]:
        for shape, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            copies = ws.get("q4", shape)
            ref = F.linear(x.float(), copies[0].dequantize(dtype=torch.float32))
            paths = {"shipped": lambda w: quant_linear(x, w, None),
                     "mma": lambda w: qgemv(x, w, config=mma_config(n))}
            us = {}
            for name, fn in paths.items():
                err = ((fn(copies[0]).float() - ref).abs().max() / ref.abs().max()).item()
                assert err < 1e-2, (shape, m, name, err)
                us[name] = graph_us([lambda w=w, fn=fn: fn(w) for w in copies], reps=5)
                totals[m, name] = totals.get((m, name), 0.0) + WEIGHT[shape] * us[name]
            line = (f"| {m} | {shape} | {cuda_route(m, 'q4')} | {us['shipped']:.1f} | "
                    f"{us['mma']:.1f} | {us['mma'] / us['shipped']:.2f} |")
            print(line, flush=True)
            lines.append(line)
        lines.append(f"| {m} | 8B step | | {totals[m, 'shipped']:.0f} | {totals[m, 'mma']:.0f} | "
                     f"{totals[m, 'mma'] / totals[m, 'shipped']:.2f} |")
        print(lines[-1], flush=True)
    out = results_dir()
    (out / "q4_rows.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
