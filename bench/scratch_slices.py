"""The dequantize-then-cuBLAS path (`quant/linear.py`'s "scratch": products past the tiled
kernel's rows) at the slice sizes `SCRATCH_ELEMENTS` allows, on 4-bit (Q4_K structure,
factored) and FP8 weights of the Llama-3.1-8B shapes, against bf16 cuBLAS.

    python bench/scratch_slices.py [--rows 128,256,2048,16,32,64] [--mib 128,32,16,8]
                                   [--kinds q4,fp8]

A slice that fits in the GPU's L2 (50 MB on the H100/H200) can be written by the dequantize
kernel and read by the GEMM without a round trip to DRAM, and the next slice reuses the same
memory (the allocator hands the freed block back), so its dirty lines need never be written
back: the scratch would then cost its dequantization, not three bytes of traffic per weight.
Smaller slices mean more, smaller launches. Graph-timed over >= 256 MiB of weight copies
(bench/quant_sweep.py), each result checked against float32 dequantize-then-matmul first.
FP8 rows also time W8A8 (`fp8_scaled_linear`: the inputs quantized per row, torch._scaled_mm),
what `quantization="fp8"` runs past the tiled rows by default. Prints µs per product and per
8B step (32 layers x the four projections + the head); also to $OUT/scratch_slices.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable  # noqa: E402

ensure_sgl_importable()
from gemv_bench import SHAPES, graph_us  # noqa: E402
from quant_sweep import WEIGHT, WeightSet, call, save_table, time_path  # noqa: E402

from sgl.backend.quant import linear  # noqa: E402
from sgl.backend.quant.fp8 import fp8_scaled_linear  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="128,256,2048,16,32,64")
    ap.add_argument("--mib", default="128,32,16,8", help="scratch slice sizes, MiB of bf16")
    ap.add_argument("--kinds", default="q4,fp8")
    args = ap.parse_args()
    t0 = time.monotonic()
    ws = WeightSet()
    sizes = [int(s) for s in args.mib.split(",")]
    lines = ["| kind | rows | bf16 us/step | " + " | ".join(f"scratch {s} MiB" for s in sizes)
             + " | W8A8 (FP8) |", "|" + "---|" * (4 + len(sizes))]
    default = linear.SCRATCH_ELEMENTS
    for m in [int(r) for r in args.rows.split(",")]:
        for kind in args.kinds.split(","):
            step = {"bf16": 0.0, "w8a8": 0.0, **{s: 0.0 for s in sizes}}
            for name, (n, k) in SHAPES.items():
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                step["bf16"] += WEIGHT[name] * (time_path(ws, "bf16", name, x, "cublas") or 0)
                ref = F.linear(x.float(), ws.get(kind, name)[0].dequantize(dtype=torch.float32))
                for s in sizes:
                    linear.SCRATCH_ELEMENTS = s << 19  # MiB of bf16 -> elements
                    try:
                        y = call(kind, ws.get(kind, name)[0], x, "scratch", None)()
                        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                        assert err < 1e-2, (kind, name, m, s, err)
                        us = time_path(ws, kind, name, x, "scratch")
                    finally:
                        linear.SCRATCH_ELEMENTS = default
                    step[s] += WEIGHT[name] * (us or 0)
                    print(f"{kind} M={m} {name} {s} MiB: {us:.1f} us", flush=True)
                if kind == "fp8":
                    copies = ws.get(kind, name)
                    us = graph_us([lambda w=w: fp8_scaled_linear(x, w) for w in copies], reps=5)
                    step["w8a8"] += WEIGHT[name] * us
                    print(f"{kind} M={m} {name} w8a8: {us:.1f} us", flush=True)
            lines.append(f"| {kind} | {m} | {step['bf16']:.0f} | "
                         + " | ".join(f"{step[s]:.0f} ({step[s] / step['bf16']:.2f}x)"
                                      for s in sizes)
                         + (f" | {step['w8a8']:.0f} ({step['w8a8'] / step['bf16']:.2f}x) |"
                            if kind == "fp8" else " | - |"))
            print(lines[-1], flush=True)
    save_table("scratch_slices", lines, t0)


if __name__ == "__main__":
    main()
