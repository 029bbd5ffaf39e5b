"""The CUDA GEMV's launches at the 8B shapes, for Nsight Compute to read: what bounds the
kernel (memory throughput, warp stalls, issue, occupancy) at one row, 4-bit and 8-bit codes.

    ncu --clock-control none --kernel-name mma_gemv --section SpeedOfLight ... \
        python bench/cuda_gemv_ncu.py [--kinds q4,q8g16] [--rows 1] [--shapes qkv,gate_up]

Each (kind, shape, rows) is launched WARM times untimed (so that the compile and the first
launch stay out of the profile) and then once more: profile with `--launch-skip` over the
warm launches, or read the last launch of each. Prints, per launch in order, what it is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable  # noqa: E402

ensure_sgl_importable()
from gemv_bench import SHAPES  # noqa: E402
from quant_sweep import make_weight  # noqa: E402

from sgl.backend.quant import cuda_gemv  # noqa: E402

WARM = 3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="q4,q8g16")
    ap.add_argument("--rows", default="1")
    ap.add_argument("--shapes", default="qkv,o_proj,gate_up,down")
    args = ap.parse_args()
    cuda_gemv.EARLY_LAUNCH = False  # (a plain launch: ncu serializes launches anyway)
    for kind in args.kinds.split(","):
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            w = make_weight(kind, n, k, seed=0)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                for _ in range(WARM + 1):
                    cuda_gemv.mma_gemv(x, w)
                torch.cuda.synchronize()
                cfg = cuda_gemv.fitted(cuda_gemv.default_config(m, w), n,
                                       cuda_gemv.chunking(w)[1])
                print(f"{kind} {shape} rows {m} {cfg}: launches {WARM} warm + 1", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
