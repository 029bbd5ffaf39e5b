"""The batch-invariant linear (backend/kernels/triton_matmul.py) against the default linear op
(our GEMV at one row, cuBLAS above) at the Llama-3.1-8B shapes, bf16: what
`enable_deterministic_inference` costs per product, and which one tile configuration serves
every row count best.

    python bench/det_linear.py [--rows 1,16,128,256,2048] [--tiles 64x64x64x4x4,...]

Per tile candidate (BLOCK_M x BLOCK_N x BLOCK_K x warps x stages) and row count: µs of an 8B
decode step's products (32 layers' qkv, o_proj, gate_up, down, plus the LM head), graph-timed
over enough weight copies that the L2 cannot serve a repeat (bench/gemv_bench.graph_us), and
the ratio to the default op. Each candidate is first checked for row invariance (a row's bits
alone and inside 257 rows) and against float32 F.linear. The shipped tile is `TILE` there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable  # noqa: E402

ensure_sgl_importable()
from gemv_bench import SHAPES, graph_us  # noqa: E402

from sgl.backend.kernels import triton_gemv  # noqa: E402
from sgl.backend.kernels import triton_matmul as tm  # noqa: E402

PER_STEP = {"qkv": 32, "o_proj": 32, "gate_up": 32, "down": 32, "lm_head": 1}


def parse_tile(text: str) -> tm.MatmulTile:
    return tm.MatmulTile(*(int(v) for v in text.split("x")))


def check(tile: tm.MatmulTile) -> str:
    """'' when the tile keeps rows invariant and close to float32; else what failed."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(257, 4096, device="cuda", generator=g).bfloat16()
    w = (torch.randn(6144, 4096, device="cuda", generator=g) / 64).bfloat16()
    tm.TILE[torch.bfloat16] = tile
    whole = tm.linear_batch_invariant(x, w)
    ref = torch.nn.functional.linear(x.float(), w.float())
    if not torch.allclose(whole.float(), ref, atol=3e-2, rtol=3e-2):
        return "not close to float32"
    for start, rows in ((0, 1), (3, 1), (5, 7), (100, 64), (1, 200)):
        if not torch.equal(tm.linear_batch_invariant(x[start:start + rows], w), whole[start:start + rows]):
            return f"rows {start}..{start + rows} changed bits"
    return ""


def step_us(fn, rows: int, copies: int) -> float:
    """µs of one 8B step's products at `rows` rows through `fn`."""
    total = 0.0
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda").bfloat16() for _ in range(max(1, copies * 4096 * 4096 // (n * k)))]
        x = torch.randn(rows, k, device="cuda").bfloat16()
        total += PER_STEP[name] * graph_us([lambda w=w: fn(x, w) for w in ws])
        del ws
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,16,128,256,2048")
    ap.add_argument("--tiles", default="64x64x64x4x4,64x32x128x4x4,64x128x64x4x3,128x128x64x8x3")
    ap.add_argument("--copies", type=int, default=8, help="4096^2 weight copies cycled per shape")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    shipped = tm.TILE[torch.bfloat16]
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; shipped tile {shipped}")
    base = {m: step_us(triton_gemv.linear_triton, m, args.copies) for m in rows}
    print("default op (GEMV at 1 row, cuBLAS above), µs per 8B step: "
          + ", ".join(f"{m} rows {base[m]:.0f}" for m in rows), flush=True)
    results = []
    for text in args.tiles.split(","):
        tile = parse_tile(text)
        failed = check(tile)
        if failed:
            print(f"tile {text}: {failed}", flush=True)
            continue
        us = {m: step_us(tm.linear_batch_invariant, m, args.copies) for m in rows}
        line = ", ".join(f"{m} rows {us[m]:.0f} ({us[m] / base[m]:.2f}x)" for m in rows)
        print(f"tile {text}: {line}", flush=True)
        results.append(dict(tile=text, us=us, ratio={m: us[m] / base[m] for m in rows}))
    tm.TILE[torch.bfloat16] = shipped
    record = dict(bench="det_linear", device=torch.cuda.get_device_name(0), base_us=base, tiles=results)
    out = os.environ.get("OUT")
    if out:
        with open(Path(out) / "det_linear.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
