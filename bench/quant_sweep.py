"""The parts of bench/quant_gemv_bench.py's sweep: weights, timing, the config grids, the
scoring per N class, the route table and the report (with the lines to paste)."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from common import results_dir
from gemv_bench import SHAPES, graph_us

from sgl.backend.kernels import triton_gemv as gemv
from sgl.backend.quant import linear
from sgl.backend.quant.factored import factor
from sgl.backend.quant.fp8 import Fp8Weight
from sgl.backend.quant.triton_fp8 import fp8_dequant, fp8_gemm, fp8_gemv
from sgl.backend.quant.triton_gemm import GemmConfig, gemm_config, qdequant, qgemm
from sgl.backend.quant.triton_gemv import QGemvConfig, gemv_config, qgemv
from sgl.backend.quant.weight import QuantizedWeight

DEV = torch.device("cuda")
LAYERS = 32  # an 8B step: 32 layers of qkv/o/gate_up/down, one head
WEIGHT = {name: (1 if name == "lm_head" else LAYERS) for name in SHAPES}
# The one-row sweeps' N classes (q4_gemv_sweep, fp8_gemv_sweep): the shapes each best config serves
N_CLASSES = {"4096": ("o_proj", "down"), "6144": ("qkv",), "large": ("gate_up", "lm_head")}
SWEEP_ROWS = (16, 64, 256, 1024)  # one per GEMM_DEFAULTS entry
SWEEP_ORDER = (256, 64, 16, 1024)  # the `fixed` batch first: the budget may stop the rest
LIMIT = {"small": 8192, "large": 1 << 62}  # the N classes of every defaults table
TABLE_KIND = {"q4": "q4", "q8g16": "q8", "fp8": "fp8"}  # bench kind -> the tables' key
GROUP = {"q4": 32, "q8g16": 16, "fp8": 64}  # (FP8: the smallest K step, no group)
MIN_BYTES = 256 << 20  # weight copies cycled per timing: more than the L2 can hold



def write_report(out: Path, name: str, lines: list[str], kind: str, best: dict, t0: float) -> None:
    """A one-row sweep's tables (`lines`), the GEMV_DEFAULTS candidates of `kind` per N class
    (`best`: class -> (config, us per step, label)) and the machine, to stdout and
    `out/<name>.md`."""
    lines = [*lines, f"GEMV_DEFAULTS['{kind}'] candidates: " + ", ".join(
        f"{cls}: {cfg} ({us:.0f} us per step)" for cls, (cfg, us, _) in best.items())]
    text = "\n".join(lines) + (f"\n\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
                               f"{time.monotonic() - t0:.0f} s\n")
    print(text, flush=True)
    (out / f"{name}.md").write_text(text)


def save_table(name: str, lines: list[str], t0: float) -> None:
    """A bench's table and the machine to stdout and $OUT/<name>.md (bench/results/ without
    $OUT)."""
    text = "\n".join(lines) + (f"\n\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
                               f"{time.monotonic() - t0:.0f} s\n")
    out = results_dir()
    (out / f"{name}.md").write_text(text)
    print(text, flush=True)


def class_of(name: str) -> str:
    return "small" if SHAPES[name][0] <= LIMIT["small"] else "large"


class Budget:
    def __init__(self, seconds: float) -> None:
        self.start, self.seconds, self.hit = time.monotonic(), seconds, False

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def over(self) -> bool:
        self.hit = self.hit or self.elapsed() > self.seconds
        return self.hit


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


def nbytes(w: Any) -> int:
    return w.numel() * 2 if isinstance(w, torch.Tensor) else w.nbytes


class WeightSet:
    """Copies of each (kind, shape) weight, >= 256 MiB in all (no L2 reuse), made once."""

    def __init__(self) -> None:
        self.cache: dict[tuple[str, str], list[Any]] = {}

    def get(self, kind: str, name: str) -> list[Any]:
        if (kind, name) not in self.cache:
            n, k = SHAPES[name]
            first = make_weight(kind, n, k, 0)
            copies = max(1, -(-MIN_BYTES // nbytes(first)))
            self.cache[kind, name] = [first] + [make_weight(kind, n, k, i)
                                                for i in range(1, copies)]
        return self.cache[kind, name]


def call(kind: str, w: Any, x: torch.Tensor, path: str, cfg: Any) -> Callable[[], Any]:
    """One product of x by w through `path`, as a thunk."""
    if kind == "bf16":
        if path == "cublas":
            return lambda: F.linear(x, w)
        return lambda: gemv.linear_triton(x, w)  # the engine's bf16 linear
    fp8 = kind == "fp8"
    if path == "gemv":
        return ((lambda: fp8_gemv(x, w.weight, w.scale, config=cfg)) if fp8
                else (lambda: qgemv(x, w, config=cfg)))
    if path.startswith("gemm"):
        return ((lambda: fp8_gemm(x, w.weight, w.scale, config=cfg)) if fp8
                else (lambda: qgemm(x, w, config=cfg)))
    if path == "scratch":
        deq = ((lambda sl: fp8_dequant(w.weight, w.scale, torch.bfloat16, sl)) if fp8
               else (lambda sl: qdequant(w, torch.bfloat16, sl)))
        return lambda: linear.dense_via_scratch(x, w.shape[0], w.shape[1], None, deq)
    return lambda: linear.quant_linear(x, w)  # "shipped"


def time_path(ws: WeightSet, kind: str, name: str, x: torch.Tensor, path: str,
              cfg: Any = None) -> float | None:
    """Microseconds per call, or None where the config does not compile or fit."""
    try:
        return graph_us([call(kind, w, x, path, cfg) for w in ws.get(kind, name)], reps=5)
    except Exception as exc:  # too many registers or shared memory, an invalid tile
        print(f"    {name} {kind} M={x.shape[0]} {path} {cfg}: {type(exc).__name__}",
              flush=True)
        return None


class Recorder:
    """Every measurement, kept and appended to a JSON-lines file as it is taken."""

    def __init__(self, path: Path) -> None:
        self.path, self.rows = path, []  # type: ignore[var-annotated]

    def add(self, phase: str, shape: str, kind: str, m: int, path: str, us: float | None,
            config: Any = None) -> None:
        n, k = SHAPES[shape]
        row = dict(phase=phase, shape=shape, kind=kind, m=m, path=path, us=us,
                   config=None if config is None else config._asdict())
        if us is not None:
            wb = nbytes_of(kind, n, k)
            row["weight_TB_s"] = wb / (us * 1e-6) / 1e12
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        cfg = "" if config is None else f"  {tuple(config)}"
        print(f"{phase:5} {shape:8} {kind:6} M={m:<5} {path:8} "
              f"{'-' if us is None else f'{us:9.1f} us'}{cfg}", flush=True)

    def best(self, kind: str, m: int, path: str, shape: str) -> float | None:
        vals = [r["us"] for r in self.rows if (r["kind"], r["m"], r["shape"]) == (kind, m, shape)
                and r["path"].startswith(path) and r["us"] is not None]
        return min(vals) if vals else None

    def report(self, best: dict[str, Any], routes: dict[str, Any]) -> str:
        from quant_report import report

        return report(self, best, routes)

    def summary(self, best: dict[str, Any]) -> dict[str, Any]:
        return dict(best={k: _jsonable(v) for k, v in best.items()},
                    measurements=len(self.rows))


def nbytes_of(kind: str, n: int, k: int) -> float:
    """Bytes of one weight (bits per weight as the layouts hold them)."""
    bits = {"bf16": 16, "q4": 4.75, "q8g16": 9.25, "fp8": 8}[kind]
    return n * k * bits / 8


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple) and hasattr(v, "_asdict"):
        return v._asdict()
    if isinstance(v, dict):
        return {str(a): _jsonable(b) for a, b in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(b) for b in v]
    return v


def score(ws: WeightSet, kind: str, m: int, path: str, cfg: Any, names: list[str],
          rec: Recorder, phase: str) -> float | None:
    """Weighted time (per 8B step) of `cfg` over `names`; None if it fails on any."""
    total = 0.0
    for name in names:
        x = torch.randn(m, SHAPES[name][1], device=DEV, dtype=torch.bfloat16)
        us = time_path(ws, kind, name, x, path, cfg)
        rec.add(phase, name, kind, m, path, us, cfg)
        if us is None:
            return None
        total += WEIGHT[name] * us
    return total


def pick(ws: WeightSet, kind: str, m: int, path: str, configs: list[Any], names: list[str],
         rec: Recorder, budget: Budget, phase: str,
         start: tuple[Any, float] | None = None) -> tuple[Any, float] | None:
    """The lowest-scoring config (from `start`, a config and its score, if given)."""
    best = start
    for cfg in configs:
        if budget.over():
            break
        s = score(ws, kind, m, path, cfg, names, rec, phase)
        if s is not None and (best is None or s < best[1]):
            best = (cfg, s)
    return best


def gemv_grid(kind: str, quick: bool) -> list[QGemvConfig]:
    bits = {"q4": 4, "q8g16": 8, "fp8": 8}[kind]
    out = []
    # (512-weight steps are today's default, timed first; wider ones keep more bytes in flight)
    for bn, bk, warps in itertools.product((4, 8, 16, 32), (1024, 2048, 4096), (4, 8)):
        per_thread = bn * bk * bits // 8 // (32 * warps)  # code bytes per thread per step
        if 16 <= per_thread <= 64:
            out.append(QGemvConfig(bn, bk, warps, fp8_decode="bits"))
    return out[::4] if quick else out


def gemv_flag_variants(kind: str, base: QGemvConfig) -> list[QGemvConfig]:
    if kind == "fp8":
        flags: list[dict[str, Any]] = [dict(fp8_decode="sext"), dict(fp8_decode="cvt")]
    else:
        flags = [dict(magic=False), dict(words=True), dict(words=True, magic=False)]
    flags += [dict(num_stages=s) for s in (1, 2, 4)]
    return [base._replace(**f) for f in flags]


# Split-K candidates (QGemvConfig.split_k): K slices x wide row tiles x short K steps. The
# large N class (gate_up, the head) fills the GPU unsplit, so it gets the smaller splits only.
SPLITS = {"small": (4, 2, 8), "large": (2, 4)}


def split_grid(kind: str, cls: str, base: QGemvConfig, quick: bool) -> list[QGemvConfig]:
    """Split configs with `base`'s flags (decode, conversions, stages), the one-launch
    reduction ("last"), 16-64 code bytes per thread and step."""
    bits = {"q4": 4, "q8g16": 8, "fp8": 8}[kind]
    out = []
    for split, bn, bk, warps in itertools.product(SPLITS[cls], (32, 16, 64), (512, 256),
                                                  (4, 8)):
        per_thread = bn * bk * bits // 8 // (32 * warps)
        if 16 <= per_thread <= 64:
            out.append(base._replace(block_n=bn, block_k=bk, num_warps=warps, split_k=split,
                                     split_reduce="last"))
    return out[::4] if quick else out


def split_variants(base: QGemvConfig) -> list[QGemvConfig]:
    """The best split config with the two-launch reduction, and other pipelining depths."""
    return [base._replace(split_reduce="kernel")] + [
        base._replace(num_stages=s) for s in (2, 4) if s != base.num_stages]


def gemv_sweep(ws: WeightSet, kind: str, rec: Recorder, budget: Budget, quick: bool,
               tiles: bool = True, split: bool = False) -> dict[str, Any]:
    """Per N class: the default's score; with `tiles` the best unsplit tiles, then the best
    flags on them; with `split` the split-K grid (with the flags so far), then its variants.
    `best` is the lowest score of all (the default when nothing beat it)."""
    out: dict[str, Any] = {}
    for cls in ("small", "large"):
        names = [s for s in SHAPES if class_of(s) == cls]
        if not names:
            continue
        n, k = SHAPES[names[0]]
        default = gemv_config(TABLE_KIND[kind], n, 1 << 20, GROUP[kind])
        start = pick(ws, kind, 1, "gemv", [default], names, rec, budget, "gemv")
        if start is None:  # (out of budget, or the default failed: nothing to compare)
            continue
        cur = start  # (pick from a start never returns None)

        def better(configs: list[QGemvConfig], phase: str) -> tuple[Any, float]:
            return pick(ws, kind, 1, "gemv", configs, names, rec, budget, phase, cur) or cur

        if tiles:
            cur = better(gemv_grid(kind, quick), "gemv")
            cur = better(gemv_flag_variants(kind, cur[0]), "gemv")
        if split:
            cur = better(split_grid(kind, cls, cur[0], quick), "split")
            if cur[0].split_k > 1:
                cur = better(split_variants(cur[0]), "split")
        out[cls] = dict(default=start, best=cur)
    return out


def gemm_grid(kind: str, m: int, quick: bool) -> list[GemmConfig]:
    top = min(128, max(16, 1 << (m - 1).bit_length()))  # all rows in one tile, up to 128
    block_ms = (top, top // 2) if m == 256 else (top,)
    block_ns = (32, 64, 128) if m <= 16 else (64, 128)
    block_ks = (128, 256) if kind == "q4" else (64, 128)
    out = []
    for bm, bn, bk, wa in itertools.product(block_ms, block_ns, block_ks, (False, True)):
        out.append(GemmConfig(bm, bn, bk, 4 if bm * bn <= 64 * 64 else 8, 3, wa))
    return out[::3] if quick else out


def gemm_sweep(ws: WeightSet, kind: str, rec: Recorder, budget: Budget,
               quick: bool) -> dict[str, Any]:
    """Per swept row count and N class: the default's score, the best tiles and operand
    order, then warps and stages on them."""
    out: dict[str, Any] = {}
    group = 16 if kind == "q8g16" else 32
    for m in SWEEP_ORDER:  # (GROUP's 64 for FP8 is a K floor, not a group: 32 here too)
        for cls in ("small", "large"):
            names = [s for s in SHAPES if class_of(s) == cls]
            if not names:
                continue
            n, k = SHAPES[names[0]]
            default = gemm_config(m, n, k, group, TABLE_KIND[kind])
            start = pick(ws, kind, m, "gemm", [default], names, rec, budget, "gemm")
            tiles = pick(ws, kind, m, "gemm", gemm_grid(kind, m, quick), names, rec, budget,
                         "gemm", start)
            if tiles is None:
                continue
            c = tiles[0]
            more = [c._replace(num_warps=12 - c.num_warps)] + [
                c._replace(num_stages=s) for s in (2, 4)]
            out[f"{m}_{cls}"] = dict(default=start,
                                     best=pick(ws, kind, m, "gemm", more, names, rec, budget,
                                               "gemm", tiles))
    return out


def routes_table(rec: Recorder, rows: list[int]) -> dict[str, Any]:
    """Per kind: the fastest path at each measured row count (weighted over the five shapes,
    each path at its best measured config), and the CUDA_ROUTES entry that follows."""
    out: dict[str, Any] = {}
    for kind in ("q4", "q8g16", "fp8"):
        per_m, chosen = {}, []
        for m in rows:
            totals = {}
            for path in ("gemv", "gemm", "scratch"):
                vals = [rec.best(kind, m, path, name) for name in SHAPES]
                if all(v is not None for v in vals):
                    totals[path] = sum(WEIGHT[nm] * v for nm, v in zip(SHAPES, vals))
            bf16 = [rec.best("bf16", m, "shipped", name) for name in SHAPES]
            if all(v is not None for v in bf16):
                totals["bf16"] = sum(WEIGHT[nm] * v for nm, v in zip(SHAPES, bf16))
            paths = {p: t for p, t in totals.items() if p != "bf16"}
            if paths:
                chosen.append((m, min(paths, key=paths.__getitem__)))
            per_m[m] = totals
        table: list[tuple[int, str]] = []
        for m, path in chosen:  # the limit of a run of one path: its last measured row count
            if table and table[-1][1] == path:
                table[-1] = (m, path)
            else:
                table.append((m, path))
        while table and table[-1][1] == "scratch":  # (rows past the table take the scratch)
            table.pop()
        out[kind] = dict(per_m=per_m, routes=table)
    return out
