"""The sampler's greedy argmax on the GPU: torch's `argmax(dim=-1)` against the one-launch
Triton kernel (kernels/triton_argmax.py), float32 logits of the 8B vocabulary (128,256) at 1,
8 and 128 rows, device time per call (gemv_bench.graph_us: calls replayed from one CUDA
graph); the answers compared first. (Session 24's figures, docs/benchmarks.md, came from the
same method with the script's first timer: 50 calls in a graph, events around 20 replays.)

    python bench/argmax_bench.py [--vocab 128256] [--rows 1,8,128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable  # noqa: E402
from gemv_bench import graph_us  # noqa: E402

ensure_sgl_importable()
from sgl.backend.kernels.triton_argmax import argmax_triton  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--rows", default="1,8,128")
    args = ap.parse_args()
    print("| rows | torch argmax us | Triton argmax us | ratio |\n|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, device="cuda") * 4
        assert torch.equal(argmax_triton(logits), logits.argmax(dim=-1))
        ref = graph_us([lambda: logits.argmax(dim=-1)])
        ours = graph_us([lambda: argmax_triton(logits)])
        print(f"| {rows} | {ref:.1f} | {ours:.1f} | {ours / ref:.2f} |")
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
