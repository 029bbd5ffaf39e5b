"""Shared helpers for the benchmarks: machine/commit info and the JSON-lines result log.

Every benchmark prints a table and appends one JSON line per run to bench/results/<name>.jsonl
with the date, machine, commit, model, workload and figures, so runs compare over time.
"""

from __future__ import annotations

import datetime
import importlib.abc
import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


def results_dir() -> Path:
    """Where a bench writes its tables and logs: $OUT on the device machine (its files come
    back from there), else bench/results; created."""
    out = Path(os.environ.get("OUT") or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    return out


def ensure_sgl_importable() -> None:
    """Without an (editable) install, e.g. on the GPU machine, map sgl.backend -> backend/ and
    sgl.grammars -> grammars/ (the setuptools package-dir mapping) with a meta-path finder."""
    try:
        import sgl.backend  # noqa: F401

        return
    except ImportError:
        pass
    sys.path.insert(0, str(ROOT))
    for name in [m for m in sys.modules if m == "sgl" or m.startswith("sgl.")]:
        del sys.modules[name]

    class _Mapped(importlib.abc.MetaPathFinder):
        roots = {"sgl.backend": ROOT / "backend", "sgl.grammars": ROOT / "grammars"}

        def find_spec(self, fullname, path, target=None):  # noqa: ANN001
            folder = self.roots.get(fullname)
            if folder is None:
                return None
            return importlib.util.spec_from_file_location(
                fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])

    sys.meta_path.insert(0, _Mapped())
    import sgl.backend  # noqa: F401


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = " + " + torch.cuda.get_device_name(0)
    except Exception:
        pass
    return f"{os.cpu_count()} cores {cpu}{gpu}"


def commit() -> str:
    """The commit the run measured, "-dirty" when the tree had changes. Where the tree is a
    copy without git (the GPU machine), the caller passes it as SGL_BENCH_COMMIT."""
    if os.environ.get("SGL_BENCH_COMMIT"):
        return os.environ["SGL_BENCH_COMMIT"]
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True,  # noqa: E731
                                    cwd=Path(__file__).parent).stdout.strip()
    try:
        sha = git("rev-parse", "--short", "HEAD")
        return (sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")) or "unknown"
    except OSError:
        return "unknown"


def record(name: str, model: str, workload: str, figures: dict[str, Any]) -> dict[str, Any]:
    row = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               machine=machine(), commit=commit(), model=model, workload=workload, figures=figures)
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / f"{name}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [[str(r.get(c, "")) if not isinstance(r.get(c), float) else f"{r[c]:.2f}" for c in columns]
             for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join([line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in cells)])
