"""The readable end of bench/quant_gemv_bench.py: tables and the lines to paste."""

from __future__ import annotations

from typing import Any

from gemv_bench import SHAPES
from quant_sweep import LIMIT, SWEEP_ROWS, TABLE_KIND, WEIGHT, class_of, nbytes_of

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


def class_scores(rec: Any, kind: str, cls: str) -> dict[str, tuple[float, dict[str, Any]]]:
    """Per one-row GEMV config measured on every shape of N class `cls`: (the weighted time
    per 8B step of those shapes, the config), keyed by the config's repr."""
    names = [s for s in SHAPES if class_of(s) == cls]
    times: dict[str, dict[str, float]] = {}
    configs: dict[str, dict[str, Any]] = {}
    for r in rec.rows:
        if ((r["kind"], r["m"], r["path"]) == (kind, 1, "gemv") and r["config"]
                and r["us"] is not None and r["shape"] in names):
            key = repr(sorted(r["config"].items()))
            times.setdefault(key, {})[r["shape"]] = r["us"]
            configs[key] = r["config"]
    return {key: (sum(WEIGHT[s] * t[s] for s in names), configs[key])
            for key, t in times.items() if len(t) == len(names)}


def split_table(rec: Any) -> list[str]:
    """Split-K against no split, per kind and N class: the best measured config of each
    (weighted us per 8B step of the class's shapes)."""
    lines = ["", "## One-row split-K: best unsplit vs best split config per N class (us per "
             "8B step of the class's shapes; bs/bk/w/split/reduce)", "",
             "| kind | N class | unsplit | split | split / unsplit |", "|---|---|---|---|---|"]

    def cell(entry: tuple[float, dict[str, Any]] | None) -> str:
        if entry is None:
            return "-"
        c = entry[1]
        return (f"{entry[0]:.1f} ({c['block_n']}/{c['block_k']}/{c['num_warps']}/"
                f"{c.get('split_k', 1)}/{c.get('split_reduce', 'kernel')})")

    for kind in KINDS:
        for cls in LIMIT:
            scores = list(class_scores(rec, kind, cls).values())
            plain = min((e for e in scores if e[1].get("split_k", 1) == 1),
                        key=lambda e: e[0], default=None)
            split = min((e for e in scores if e[1].get("split_k", 1) > 1),
                        key=lambda e: e[0], default=None)
            if plain is None and split is None:
                continue
            ratio = f"{split[0] / plain[0]:.2f}" if plain and split else "-"
            lines.append(f"| {kind} | {cls} | {cell(plain)} | {cell(split)} | {ratio} |")
    return lines


def rows_table(routes: dict[str, Any]) -> list[str]:
    lines = ["", "## Per 8B step (32 x (qkv + o + gate_up + down) + head), us: each path at "
             "its best measured config; ratio = best path / bf16", "",
             "| kind | rows | gemv | gemm | scratch | bf16 | ratio |",
             "|---|---|---|---|---|---|---|"]
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


def _cfg(best: dict[str, Any], key: str) -> Any:
    entry = best.get(key)
    return entry["best"][0] if entry and entry.get("best") else None


def _limit(v: int) -> str:
    return "1 << 62" if v >= 1 << 62 else str(v)


def paste_lines(best: dict[str, Any], routes: dict[str, Any]) -> list[str]:
    """GEMV_DEFAULTS, GEMM_DEFAULTS and CUDA_ROUTES as Python: the sweep's winners per N class
    (and row tier), today's value where the run measured nothing."""
    from sgl.backend.quant.triton_gemm import GEMM_DEFAULTS
    from sgl.backend.quant.triton_gemv import GEMV_DEFAULTS

    gemv, gemm = [], []
    for kind in KINDS:
        key = TABLE_KIND[kind]
        sweep = best.get(f"gemv_{kind}", {})
        today = GEMV_DEFAULTS[key]
        cells = [(LIMIT["small"], _cfg(sweep, "small") or today[0][1]),
                 (LIMIT["large"], _cfg(sweep, "large") or today[-1][1])]
        gemv.append(f'"{key}": (' + ", ".join(f"({_limit(n)}, {c!r})" for n, c in cells) + ")")
        sweep = best.get(f"gemm_{kind}", {})
        tiers = []
        for m, (limit, small, large) in zip(SWEEP_ROWS, GEMM_DEFAULTS[key]):
            tiers.append(f"({_limit(limit)}, {_cfg(sweep, f'{m}_small') or small!r}, "
                         f"{_cfg(sweep, f'{m}_large') or large!r})")
        gemm.append(f'"{key}": (' + ", ".join(tiers) + ")")
    table = {TABLE_KIND[k]: tuple(routes[k]["routes"]) or ((1, "gemv"),) for k in KINDS}
    return ["", "## Lines to paste (the sweep's winners; today's values where not measured)",
            "", "# backend/quant/triton_gemv.py",
            "GEMV_DEFAULTS: dict[str, tuple[tuple[int, QGemvConfig], ...]] = {"
            + ", ".join(gemv) + "}",
            "# backend/quant/triton_gemm.py",
            "GEMM_DEFAULTS: dict[str, tuple[tuple[int, GemmConfig, GemmConfig], ...]] = {"
            + ", ".join(gemm) + "}",
            "# backend/quant/linear.py",
            f"CUDA_ROUTES: dict[str, tuple[tuple[int, str], ...]] = {table!r}"]


def report(rec: Any, best: dict[str, Any], routes: dict[str, Any]) -> str:
    rows = sorted({r["m"] for r in rec.rows})
    lines = (gemv_table(rec) + split_table(rec) + rows_table(routes)
             + per_shape_table(rec, rows))
    lines += paste_lines(best, routes)
    return "\n".join(lines)


__all__ = ["report", "WEIGHT"]
