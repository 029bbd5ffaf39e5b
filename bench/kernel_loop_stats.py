"""What one K step of a tiled kernel costs, read from its PTX for Hopper (sm_90) without a GPU.

    python bench/kernel_loop_stats.py [--kind q4] [--rows 128] [--n 6144]
                                      [--config 128,64,128,4,2,True,4,last,True]

Compiles the tiled kernel of `--kind` (q4: quant/triton_gemm.py on Q4_K-structured factored
codes; q8: the same on 8-bit codes; fp8: quant/triton_fp8.py) with the installed Triton, its
pointers, strides and sizes divisible by 16 as Triton specializes them at launch for the 8B
shapes, and the table's config for (`--rows`, `--n`) or the `--config` given (GemmConfig's
fields in order). Prints, for the K loop (the first loop of the PTX): its instructions by
opcode, per thread and per weight dequantized, the wgmma instructions and how long they may
stay in flight (`wgmma.wait_group N`: 0 means every step waits for its dots before the next
tile is dequantized), and the loads that block (ld.global) against the asynchronous copies
that pipeline them (cp.async).

The device's Triton may compile differently from the one here: to read what the device runs,
put its version first on the path, e.g. `pip install --target /tmp/t36 triton==3.6.0` and
`PYTHONPATH=/tmp/t36 python bench/kernel_loop_stats.py ...` (session 18 found the tiled 4-bit
kernel's full wait per step this way; docs/benchmarks.md). The pass/fail form of the same
reading is tests/triton_compile_check.py (`check_dots_stay_in_flight`).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable  # noqa: E402

ensure_sgl_importable()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import triton  # noqa: E402
from triton_compile_check import FP8_ARGS, QGEMV_ARGS, k_loop, ptx  # noqa: E402

from sgl.backend.quant import triton_fp8, triton_gemm  # noqa: E402
from sgl.backend.quant.triton_gemm import GemmConfig, gemm_config  # noqa: E402

TILED = {"M": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_ps": "i32"}
GROUP = {"q4": 32, "q8": 32, "fp8": 64}


def parse_config(text: str) -> GemmConfig:
    kinds = [int, int, int, int, int, lambda v: v == "True", int, str, lambda v: v == "True"]
    return GemmConfig(*(cast(v.strip()) for cast, v in zip(kinds, text.split(","))))


def compile_loop(kind: str, cfg: GemmConfig) -> tuple[str, int]:
    """(the PTX of the kernel, weights one thread dequantizes per K step)."""
    common = dict(HAS_BIAS=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, UPCAST=False,
                  IEEE=False, W_AS_A=cfg.weight_as_a, SPLIT=cfg.split_k,
                  LAST=cfg.split_k > 1 and cfg.split_reduce == "last")
    if kind == "fp8":
        code = ptx(triton_fp8._fp8_gemm_kernel, {**FP8_ARGS, **TILED},
                   dict(common, BLOCK_K=cfg.block_k), aligned=True, num_warps=cfg.num_warps,
                   num_stages=cfg.num_stages)
    else:
        bits = 4 if kind == "q4" else 8
        code = ptx(triton_gemm._qgemm_kernel, {**QGEMV_ARGS, **TILED},
                   dict(common, BITS=bits, GROUP=32, GBYTES=16 if bits == 4 else 32, SUPER=8,
                        BLOCK_G=cfg.block_k // 32, JOIN=cfg.join),
                   aligned=True, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return code, cfg.block_n * cfg.block_k // (32 * cfg.num_warps)


def opcode(line: str) -> str | None:
    if not line or line.startswith(("//", "$", ".", "{", "}")):
        return None
    words = line.split()
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("q4", "q8", "fp8"), default="q4")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--n", type=int, default=6144)
    ap.add_argument("--config", default="", help="GemmConfig fields, comma-separated")
    ap.add_argument("--top", type=int, default=24)
    args = ap.parse_args()
    cfg = (parse_config(args.config) if args.config
           else gemm_config(args.rows, args.n, 4096, GROUP[args.kind], args.kind))
    code, weights = compile_loop(args.kind, cfg)
    body = [line.strip() for line in k_loop(code)]
    ops = collections.Counter(op for op in map(opcode, body) if op)
    total = sum(ops.values())
    print(f"triton {triton.__version__}, sm_90, {args.kind}, {cfg}")
    print(f"K loop: {total} instructions per thread per step, {weights} weights dequantized "
          f"per thread: {total / weights:.2f} per weight")
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", "\n".join(body))
    issued = sum(v for k, v in ops.items() if k.startswith("wgmma.mma_async"))
    print(f"wgmma: {issued} issued, waits {waits or 'none'} (0: a full wait every step)")
    sync = sum(v for k, v in ops.items() if k.startswith("ld.global"))
    copies = sum(v for k, v in ops.items() if k.startswith("cp.async.c"))
    print(f"loads: {sync} blocking (ld.global), {copies} asynchronous copies (cp.async)")
    for op, count in ops.most_common(args.top):
        print(f"  {count:6d}  {op}")


if __name__ == "__main__":
    main()
