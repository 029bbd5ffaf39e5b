"""The CUDA GEMV's main loop read from its sm_90 machine code, without a GPU: registers,
spills, the instruction mix of the K loop and instructions per weight (and per byte of codes).

    python bench/cuda_kernel_stats.py [--tiles 1 --warps 8 --span 2 --rows 1 --super 8 --groups 448]
    python bench/cuda_kernel_stats.py --bits 8 --super 16 --groups 896    # Q6_K's form

Compiles quant/cuda_gemv.py's source as the engine does at first use (NVRTC for compute_90,
then ptxas for sm_90; tests/cuda_compile.py), finds the loop with the most mma instructions
(its two steps, taken in turn) and divides its instructions by the weights a lane handles in
them: 2 steps x tiles x 2 rows x span chunks x 32 codes (16 with 8-bit codes). That is how docs/benchmarks.md's
"~2.2 instructions per weight" (session 19) was counted. K is a constant of the compiled
kernel: at 128 groups and 8 warps each warp's two steps unroll into straight code (no loop to
read), hence the default 448 (the 8B down projection's K). Needs the `nvidia-cuda-nvrtc-cu12`
and triton wheels (the test extra).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable  # noqa: E402

ensure_sgl_importable()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from cuda_compile import assemble, sass, to_ptx  # noqa: E402

from sgl.backend.quant.cuda_gemv import SOURCE, CudaGemvConfig, _defines  # noqa: E402

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def opcode(text: str) -> str:
    """`@P0 LDG.E.128 R4, ...` -> "LDG"."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main_loop(code: str) -> list[str]:
    """The instructions of the backward branch's body that holds the most HMMAs."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in map(LINE.search, code.splitlines()) if m]
    best: list[str] = []
    for addr, text in ins:
        target = re.search(r"BRA\s+(?:`?\(?\.L_x_\d+\)?`?\s*)?0x([0-9a-f]+)", text)
        if not target or int(target.group(1), 16) >= addr:
            continue
        body = [t for a, t in ins if int(target.group(1), 16) <= a <= addr]
        if sum(opcode(t) == "HMMA" for t in body) > sum(opcode(t) == "HMMA" for t in best):
            best = body
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=1)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--span", type=int, default=2)
    ap.add_argument("--min-blocks", type=int, default=0,
                    help="programs an SM must hold (caps the registers; 0: none)")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--super", type=int, default=8, help="0: float32 scales; 8: factored")
    ap.add_argument("--groups", type=int, default=448,
                    help="16-byte chunks per row: K / 32 for 4-bit codes (448: the 8B's 14336), "
                         "K / 16 for 8-bit")
    ap.add_argument("--bits", type=int, choices=(4, 8), default=4)
    ap.add_argument("--per-group", type=int, default=1, help="chunks per scale (Q8_0: 2)")
    args = ap.parse_args()
    cfg = CudaGemvConfig(args.tiles, args.warps, args.span, args.min_blocks)
    with tempfile.TemporaryDirectory() as tmp:
        report, cubin = assemble(to_ptx(_defines(cfg, args.rows, args.super, args.groups,
                                                 args.bits, args.per_group) + SOURCE), Path(tmp))
        code = sass(cubin)
    print(f"{cfg}, rows {args.rows}, super {args.super}, chunks {args.groups}, "
          f"{args.bits}-bit codes")
    print(" ".join(line.split(":", 1)[-1].strip() for line in report.splitlines()
                   if "registers" in line or "spill" in line))
    loop = main_loop(code)
    if not loop:
        print("no loop with mma found")
        return 1
    mix = collections.Counter(opcode(t) for t in loop)
    chunks = 2 * args.tiles * 2 * args.span  # per lane: two steps in turn
    weights = chunks * (32 if args.bits == 4 else 16)
    print(f"main loop: {len(loop)} instructions for {weights} weights a lane: "
          f"{len(loop) / weights:.2f} per weight, {len(loop) / (16 * chunks):.2f} per byte of "
          f"codes")
    print("mix: " + ", ".join(f"{op} {n}" for op, n in mix.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
