"""The readable end of bench/quant_gemv_bench.py: tables and the lines to paste."""

from __future__ import annotations

from typing import Any

from gemv_bench import SHAPES
from quant_sweep import LIMIT, SWEEP_ROWS, WEIGHT, nbytes_of

KINDS = ("q4", "q8g16", "fp8")


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def gemv_table(rec: Any) -> list[str]:
    lines = ["## One row (GEMV): us per call (weight TB/s), default config / best swept", "",
             "| shape | bf16 | " + " | ".join(f"{k} default | {k} best" for k in KINDS) + " |",
             "|---|---|" + "---|---|" * len(KINDS)]
    for name, (n, k) in SHAPES.items():
        cells = [name, _us(rec.best("bf16", 1, "shipped", name))]
        for kind in KINDS:
            base = [r["us"] for r in rec.rows if (r["phase"], r["kind"], r["m"], r["shape"],
                                                   r["path"]) == ("base", kind, 1, name, "gemv")]
            best = rec.best(kind, 1, "gemv", name)
            tb = "" if best is None else f" ({nbytes_of(kind, n, k) / best / 1e6:.2f})"
            cells += [_us(base[0] if base else None), _us(best) + tb]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def rows_table(routes: dict[str, Any]) -> list[str]:
    lines = ["", "## Per 8B step (32 x (qkv + o + gate_up + down) + head), us: each path at "
             "its best measured config; ratio = best path / bf16", "",
             "| kind | rows | gemv | gemm | scratch | bf16 | ratio |", "|---|---|---|---|---|---|---|"]
    for kind in KINDS:
        for m, totals in routes[kind]["per_m"].items():
            paths = [totals.get(p) for p in ("gemv", "gemm", "scratch")]
            have = [p for p in paths if p is not None]
            bf16 = totals.get("bf16")
            ratio = f"{min(have) / bf16:.2f}" if have and bf16 else "-"
            lines.append(f"| {kind} | {m} | " + " | ".join(_us(p) for p in paths)
                         + f" | {_us(bf16)} | {ratio} |")
    return lines


def per_shape_table(rec: Any, rows: list[int]) -> list[str]:
    lines = ["", "## Per shape and rows, us: best gemm (default tiles or swept) / scratch / bf16",
             "", "| shape | kind | " + " | ".join(f"M={m}" for m in rows if m > 1) + " |",
             "|---|---|" + "---|" * len([m for m in rows if m > 1])]
    for name in SHAPES:
        for kind in KINDS:
            cells = [f"{_us(rec.best(kind, m, 'gemm', name))} / "
                     f"{_us(rec.best(kind, m, 'scratch', name))} / "
                     f"{_us(rec.best('bf16', m, 'shipped', name))}" for m in rows if m > 1]
            lines.append(f"| {name} | {kind} | " + " | ".join(cells) + " |")
    return lines


def _cfg(best: dict[str, Any], key: str) -> str | None:
    entry = best.get(key)
    if not entry or not entry.get("best"):
        return None
    return repr(entry["best"][0])


def paste_lines(best: dict[str, Any], routes: dict[str, Any]) -> list[str]:
    out = ["", "## Lines to paste (the sweep's winners; '# not measured' keeps today's value)", ""]
    gemv: dict[str, str] = {}
    for kind, key in (("q4", "q4"), ("q8g16", "q8"), ("fp8", "fp8")):
        sweep = best.get(f"gemv_{kind}", {})
        cells = [f"({LIMIT[c] if c == 'small' else '1 << 62'}, {_cfg(sweep, c)})"
                 for c in ("small", "large") if _cfg(sweep, c)]
        gemv[key] = "(" + ", ".join(cells) + ")" if len(cells) == 2 else "# not measured"
    out.append("# backend/quant/triton_gemv.py")
    out.append(f'QGEMV_DEFAULTS = {{"q4": {gemv["q4"]}, "q8": {gemv["q8"]}}}')
    out.append("# backend/quant/triton_fp8.py")
    out.append(f"FP8_GEMV_DEFAULTS = {gemv['fp8']}")
    for kind, name in (("q4", "GEMM_DEFAULTS"), ("fp8", "FP8_GEMM_DEFAULTS"),
                       ("q8g16", "Q8_GEMM_BEST  # (information: GEMM_DEFAULTS serves q8 too)")):
        sweep = best.get(f"gemm_{kind}", {})
        tiers = []
        for m, limit in zip(SWEEP_ROWS, ("16", "64", "256", "1 << 62")):
            s, big = _cfg(sweep, f"{m}_small"), _cfg(sweep, f"{m}_large")
            tiers.append(f"({limit}, {s}, {big})" if s and big else f"({limit}: not measured)")
        out.append("# backend/quant/triton_gemm.py")
        out.append(f"{name} = (" + ", ".join(tiers) + ")")
    table = {("q8" if k == "q8g16" else k): tuple(routes[k]["routes"]) for k in KINDS}
    out.append("# backend/quant/linear.py")
    out.append(f"CUDA_ROUTES = {table!r}")
    return out


def report(rec: Any, best: dict[str, Any], routes: dict[str, Any]) -> str:
    rows = sorted({r["m"] for r in rec.rows})
    lines = gemv_table(rec) + rows_table(routes) + per_shape_table(rec, rows)
    lines += paste_lines(best, routes)
    return "\n".join(lines)


__all__ = ["report", "WEIGHT"]
