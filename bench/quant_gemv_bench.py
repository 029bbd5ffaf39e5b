"""Quantized linears (backend/quant: Triton GEMV / tiled / scratch + cuBLAS) vs bf16 at the
Llama-3.1-8B layer shapes: the kernel-level view of issue 14's GPU targets.

    python bench/quant_gemv_bench.py [--no-sweep] [--sweep-tiled] [--rows 1,4,16,64,256,1024]

Weights per projection (qkv 6144x4096, o_proj 4096x4096, gate_up 28672x4096, down
4096x14336, LM head 128256x4096): bf16 (cuBLAS, and our bf16 GEMV at one row), Q4 (4-bit
codes per 32 with K-quant scales in the GPU's factored form, quant/factored.py: Q4_K's
mapping, 4.75 bits per weight), Q8/16 (8-bit codes per 16: Q6_K's, the usual head of a
Q4_K_M file, 9.25 bits) and FP8 (1 byte
plus a float32 scale per row). For each row count: microseconds of the shipped dispatch
(`quant_linear`) and the weight TB/s that implies; at one row the best of a small config
sweep of the GEMV (FP8: e4m3 decoded with integer ops or by the hardware conversion);
from 16 rows on both the tiled kernel and scratch + cuBLAS, so the switch
point (`GEMM_MAX_ROWS`) can be checked. Timing as in bench/gemv_bench.py: calls replayed from
one CUDA graph, cycling through enough weight copies that the L2 cannot serve a repeat.
Prints a table; one JSON line to bench/results/quant_gemv_bench.jsonl (and $OUT).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_sgl_importable  # noqa: E402

ensure_sgl_importable()
from gemv_bench import SHAPES, graph_us  # noqa: E402

from sgl.backend.kernels import gemv  # noqa: E402
from sgl.backend.quant import linear  # noqa: E402
from sgl.backend.quant.factored import factor  # noqa: E402
from sgl.backend.quant.fp8 import Fp8Weight  # noqa: E402
from sgl.backend.quant.triton_gemm import fp8_gemm, qgemm  # noqa: E402
from sgl.backend.quant.triton_gemv import QGemvConfig, fp8_gemv, qgemv  # noqa: E402
from sgl.backend.quant.weight import QuantizedWeight  # noqa: E402

DEV = torch.device("cuda")
KINDS = ("bf16", "q4", "q8g16", "fp8")


def make_weight(kind: str, n: int, k: int, seed: int) -> Any:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    if kind == "bf16":
        return torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=gen) * 0.02
    if kind == "fp8":
        return Fp8Weight.quantize(torch.randn(n, k, device=DEV, generator=gen) * 0.02)
    # K-quant structure (Q4_K: d * sc and -dmin * m, 6-bit sc and m per 32; Q6_K: d * sc,
    # signed 8-bit sc per 16), so the weight takes the GPU's factored form as a file's would.
    bits, group = (4, 32) if kind == "q4" else (8, 16)
    width, groups, per = (k // 2 if bits == 4 else k), k // group, 256 // group
    codes = torch.randint(0, 256, (n, width), device=DEV, generator=gen, dtype=torch.int32)
    codes = codes.to(torch.uint8) if bits == 4 else (codes - 128).to(torch.int8)

    def per_block() -> torch.Tensor:  # [N, G] an fp16 value per 256 weights
        d = (torch.rand(n, groups // per, device=DEV, generator=gen) * 1e-3).half().float()
        return d.repeat_interleave(per, dim=1)

    low = 0 if bits == 4 else -128
    scale = per_block() * torch.randint(low, 64 if bits == 4 else 128, (n, groups), device=DEV,
                                        generator=gen).float()
    zero = (-per_block() * torch.randint(0, 64, (n, groups), device=DEV, generator=gen).float()
            if bits == 4 else torch.zeros_like(scale))
    w = factor(QuantizedWeight(codes, scale, zero, bits, group, k, kind))
    assert w.super_groups, "K-quant scales factor"
    return w


def weight_nbytes(w: Any) -> int:
    return w.numel() * 2 if isinstance(w, torch.Tensor) else w.nbytes


def shipped(w: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    if isinstance(w, torch.Tensor):
        return lambda x: gemv.linear_triton(x, w)  # the engine's bf16 linear
    return lambda x: linear.quant_linear(x, w)


def tiled(w: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    if isinstance(w, Fp8Weight):
        return lambda x: fp8_gemm(x, w.weight, w.scale)
    return lambda x: qgemm(x, w)


def scratch(w: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    from sgl.backend.quant.triton_gemm import fp8_dequant, qdequant

    if isinstance(w, Fp8Weight):
        def deq(sl: slice) -> torch.Tensor:
            return fp8_dequant(w.weight, w.scale, torch.bfloat16, sl)
    else:
        def deq(sl: slice) -> torch.Tensor:
            return qdequant(w, torch.bfloat16, sl)
    return lambda x: linear.dense_via_scratch(x, w.shape[0], w.shape[1], None, deq)


def gemv_sweep(ws: list[Any], x: torch.Tensor) -> tuple[float, list[int]] | None:
    """Best one-row config over a small grid, cycling the weight copies (no L2 reuse)."""
    best = None
    bits = (True, False) if isinstance(ws[0], Fp8Weight) else (True,)
    for bn, bk, warps, fp8_bits in itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), bits):
        cfg = QGemvConfig(bn, bk, warps, fp8_bits)
        if isinstance(ws[0], Fp8Weight):
            fns: list[Callable[[], Any]] = [
                lambda w=w, c=cfg: fp8_gemv(x, w.weight, w.scale, config=c) for w in ws]
        else:
            fns = [lambda w=w, c=cfg: qgemv(x, w, config=c) for w in ws]
        try:
            us = graph_us(fns, reps=5)
        except Exception as exc:  # a config that does not compile or fit: skip it
            print(f"    sweep {cfg}: {type(exc).__name__}", flush=True)
            continue
        if best is None or us < best[0]:
            best = (us, list(cfg))
    return best


def tiled_sweep(ws: list[Any], x: torch.Tensor) -> tuple[float, list[int]] | None:
    """Best tiled-kernel config at x's row count over a small grid (BLOCK_M by the rule)."""
    from sgl.backend.quant.triton_gemm import GemmConfig, gemm_config

    block_m = gemm_config(x.shape[0], 1, 1).block_m
    best = None
    for bn, bk, warps, stages in itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8),
                                                   (2, 3, 4)):
        cfg = GemmConfig(block_m, bn, bk, warps, stages)
        if isinstance(ws[0], Fp8Weight):
            fns: list[Callable[[], Any]] = [
                lambda w=w, c=cfg: fp8_gemm(x, w.weight, w.scale, config=c) for w in ws]
        else:
            fns = [lambda w=w, c=cfg: qgemm(x, w, config=c) for w in ws]
        try:
            us = graph_us(fns, reps=5)
        except Exception as exc:  # too much shared memory, a config that does not compile
            print(f"    tiled sweep {cfg}: {type(exc).__name__}", flush=True)
            continue
        if best is None or us < best[0]:
            best = (us, list(cfg))
    return best


def bench_shape(name: str, n: int, k: int, rows: list[int], sweep: bool,
                sweep_tiled: bool) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for kind in KINDS:
        if kind == "q8g16" and name != "lm_head":
            continue  # the 8-bit/16 layout is a head's (Q6_K) in a Q4_K_M file
        w0 = make_weight(kind, n, k, 0)
        nbytes = weight_nbytes(w0)
        copies = max(1, -(-256 * 2**20 // nbytes))  # >= 256 MiB of weights: no L2 reuse
        ws = [w0] + [make_weight(kind, n, k, i) for i in range(1, copies)]
        tb = lambda us: nbytes / (us * 1e-6) / 1e12  # noqa: E731
        for m in rows:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            us = graph_us([lambda f=shipped(w): f(x) for w in ws])
            row: dict[str, Any] = dict(us=us, TB_s=tb(us), weight_MB=nbytes / 2**20)
            if kind != "bf16" and m == 1 and sweep:
                best = gemv_sweep(ws, x)
                if best:
                    row.update(best_us=best[0], best_TB_s=tb(best[0]), best_config=best[1])
            if kind != "bf16" and m >= 16:
                row["tiled_us"] = graph_us([lambda f=tiled(w): f(x) for w in ws], reps=5)
                row["scratch_us"] = graph_us([lambda f=scratch(w): f(x) for w in ws], reps=5)
                if sweep_tiled and m in (16, 256):
                    best = tiled_sweep(ws, x)
                    if best:
                        row.update(tiled_best_us=best[0], tiled_best_config=best[1])
            if kind == "bf16":
                row["cublas_us"] = graph_us([lambda w=w: F.linear(x, w) for w in ws], reps=5)
            figures[f"{name}_{kind}_m{m}"] = row
            extra = "  ".join(f"{key} {val:.1f}" for key, val in row.items()
                              if key.endswith("_us") and key != "us")
            for key in ("best_config", "tiled_best_config"):
                if key in row:
                    extra += f"  {key} {row[key]}"
            print(f"{name:8} {kind:6} M={m:<5} {us:8.1f} us {tb(us):5.2f} TB/s  {extra}",
                  flush=True)
        del ws
        torch.cuda.empty_cache()
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-sweep", action="store_true", help="no GEMV config sweep at one row")
    ap.add_argument("--rows", default="1,4,16,64,256,1024")
    ap.add_argument("--sweep-tiled", action="store_true",
                    help="also sweep the tiled kernel's configs at 16 and 256 rows (slow)")
    args = ap.parse_args()
    import triton

    rows = [int(r) for r in args.rows.split(",")]
    figures: dict[str, Any] = {}
    for name, (n, k) in SHAPES.items():
        figures.update(bench_shape(name, n, k, rows, not args.no_sweep, args.sweep_tiled))
    print(f"\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    from common import record

    row = record("quant_gemv_bench", "llama3-8b", "quantized linears vs bf16 (graph-timed)",
                 figures)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "quant_gemv_bench.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
