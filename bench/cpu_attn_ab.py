"""The CPU decode attention (quant/cpu_ops.c `sgl_decode_attn`) of the working tree against the
same op at a git revision, both libraries loaded in one process, alternating call by call.

    python bench/cpu_attn_ab.py [--base HEAD] [--threads 1 2] [--rounds 30] [--avx2]

Cases (SmolLM2-135M's 9 query heads over 3 KV heads of 64, one layer): 32 decode rows x 450 keys
in float16 and bfloat16 pools at contiguous, scattered and "engine" slots (each request a
contiguous 150-token prompt then 300 tokens interleaved with the other requests', as a batch's
decode steps allocate them), and one request's 512-token prompt chunk (every token a query row
seeing keys 0 .. its position). Each round calls base and new once per case, in turn, so the
machine's load hits both alike; prints the median ms per call, new / base, and whether the
outputs are bitwise equal (else the largest difference).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402
from cpu_kernel_ab import build_at  # noqa: E402

from sgl.backend.quant import cpu_ops  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def cases(gen: torch.Generator, prefill: int) -> list[dict]:
    rows, keys = 32, 450
    slots = max(40000, 2 * rows * keys)
    prompt = 150
    engine = torch.empty(rows, keys, dtype=torch.int32)
    base = torch.randperm(slots // 2, generator=gen)[:1].item()
    engine[:, :prompt] = (base + torch.arange(rows * prompt, dtype=torch.int32)).view(rows, prompt)
    decode0 = base + rows * prompt
    engine[:, prompt:] = (decode0 + torch.arange((keys - prompt) * rows, dtype=torch.int32)
                          ).view(keys - prompt, rows).T
    layouts = {"contiguous": torch.arange(rows * keys, dtype=torch.int32).view(rows, keys),
               "scattered": torch.randperm(slots, generator=gen)[:rows * keys].int().view(rows, keys),
               "engine": engine}
    out = []
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
    for dtype in (torch.float16, torch.bfloat16):
        k = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        for layout, tbl in layouts.items():
            out.append({"case": f"decode {str(dtype)[6:]} {layout}", "q": q, "k": k, "v": v,
                        "table": tbl.contiguous(), "rows": torch.arange(rows),
                        "lens": torch.full((rows,), keys, dtype=torch.int64)})
    n = prefill
    k = torch.randn(n + 1, KV_HEADS, HEAD_DIM, generator=gen).half()
    v = torch.randn(n + 1, KV_HEADS, HEAD_DIM, generator=gen).half()
    out.append({"case": f"prefill {n} float16", "q": torch.randn(n, HEADS, HEAD_DIM, generator=gen),
                "k": k, "v": v, "table": torch.arange(1, n + 1, dtype=torch.int32)[None],
                "rows": torch.zeros(n, dtype=torch.int64), "lens": torch.arange(1, n + 1)})
    return out


def call(lib: ctypes.CDLL, c: dict, out: torch.Tensor, threads: int, calls: int) -> float:
    q, k = c["q"], c["k"]
    start = time.perf_counter()
    for _ in range(calls):
        lib.sgl_decode_attn(q.data_ptr(), q.stride(0), None, c["rows"].shape[0], HEADS, KV_HEADS,
                            HEAD_DIM, k.data_ptr(), c["v"].data_ptr(), c["table"].data_ptr(),
                            c["table"].stride(0), c["rows"].data_ptr(), c["lens"].data_ptr(),
                            ctypes.c_float(HEAD_DIM ** -0.5), out.data_ptr(), threads, KINDS[k.dtype])
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD", help="git revision of the base library")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=5, help="calls per timing")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    ap.add_argument("--avx2", action="store_true", help="both on their AVX2 loops")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    all_cases = [c for c in cases(gen, args.prefill) if args.only in c["case"]]
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build_at(args.base, Path(tmp) / "base.so"),
                "new": build_at(None, Path(tmp) / "new.so")}
        for lib in libs.values():
            cpu_ops.declare(lib)
            lib.sgl_use_avx512(0 if args.avx2 else 1)
        rows = []
        for threads in args.threads:
            for c in all_cases:
                outs = {name: torch.zeros(c["q"].shape) for name in libs}
                times: dict[str, list[float]] = {name: [] for name in libs}
                for r in range(args.rounds + 1):  # (the first round warms up)
                    for name, lib in (libs.items() if r % 2 else reversed(libs.items())):
                        times[name].append(call(lib, c, outs[name], threads, args.calls))
                base, new = (statistics.median(times[name][1:]) * 1e3 for name in libs)
                lo_b, hi_b = (min(times["base"][1:]) * 1e3, max(times["base"][1:]) * 1e3)
                diff = float((outs["base"] - outs["new"]).abs().max())
                rows.append({"threads": threads, "case": c["case"], "base ms": f"{base:.3f}",
                             "new ms": f"{new:.3f}", "new / base": f"{new / base:.3f}", "base min-max": f"{lo_b:.3f}-{hi_b:.3f}",
                             "bits": "equal" if diff == 0 else f"max diff {diff:.1e}"})
                print(rows[-1], flush=True)
    print(f"base {args.base} vs working tree; "
          f"{'AVX2' if args.avx2 else 'AVX-512 where the CPU has it'}; median of {args.rounds}")
    print(table(rows, ["threads", "case", "base ms", "new ms", "new / base", "base min-max", "bits"]))


if __name__ == "__main__":
    main()
