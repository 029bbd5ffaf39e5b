"""The CPU C library of the working tree against the same library at a git revision, side by side
in one process, on the default model's own quantized weights.

    python bench/cpu_kernel_ab.py [--base HEAD~1] [--rows 1 2 4 5 8 16 32] [--threads 1]
                                  [--rounds 15] [--avx2]

Both libraries are compiled here with cpu_build's flags (the base from `git show <base>:` of
each source) and loaded together; `sgl_qlinear` of each runs every projection of one forward
pass of SmolLM2-135M (30 layers x qkv, o_proj, gate_up, down; the tied 8-bit head apart) in
layer order, alternating base and new pass by pass so that machine load hits both alike.
Prints the median pass time per row count and path, the ratio new / base, and whether the
outputs are bitwise equal (they need not be when a change reorders the sums; then the
largest difference is shown). `--avx2` keeps both on their AVX2 loops (an AVX-512 CPU can
measure what an AVX2-only laptop runs).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402
from cpu_linear import projections  # noqa: E402

from sgl.backend.model_loader import load_model  # noqa: E402
from sgl.backend.quant import cpu_build  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def build_at(rev: str | None, out: Path) -> ctypes.CDLL:
    """The library from the sources at `rev` (None: the working tree), built into `out`."""
    src = cpu_build.HERE
    if rev is not None:
        src = out.parent / f"src-{out.stem}"
        src.mkdir()
        for name in (*cpu_build.SOURCE_NAMES, *cpu_build.HEADER_NAMES):
            rel = (cpu_build.HERE / name).relative_to(ROOT).as_posix()
            shown = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True)
            if shown.returncode == 0 or name not in cpu_build.HEADER_NAMES:  # (older revs: fewer)
                shown.check_returncode()
                (src / name).write_bytes(shown.stdout)
    cpu_build.build(out, src)
    lib = ctypes.CDLL(str(out))
    assert lib.sgl_cpu_ok(), "the CPU lacks AVX2/FMA/F16C"
    lib.sgl_qlinear.argtypes = [_INT, _INT, _P, _I64, _I64, _P, _P, _P, _INT, _I64, _P, _P, _INT]
    return lib


def one_pass(lib: ctypes.CDLL, inputs: list[torch.Tensor], weights: list, outputs: list[torch.Tensor],
             threads: int) -> float:
    start = time.perf_counter()
    for x, w, y in zip(inputs, weights, outputs):
        lib.sgl_qlinear(w.bits, w.group_size, x.data_ptr(), x.shape[0], w.in_features,
                        w.codes.data_ptr(), w.scale.data_ptr(), w.zero.data_ptr(),
                        int(w.f16_scales), w.out_features, None, y.data_ptr(), threads)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD~1", help="git revision of the base library")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16, 32])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--avx2", action="store_true", help="both on their AVX2 loops")
    args = ap.parse_args()
    model, _ = load_model(None, device=torch.device("cpu"), dtype=torch.float32,
                          quantization="gguf")
    weights = projections(model, "qweight")
    paths = {"layers": weights[:-1], "head": weights[-1:]}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build_at(args.base, Path(tmp) / "base.so"),
                "new": build_at(None, Path(tmp) / "new.so")}
        for lib in libs.values():
            lib.sgl_use_avx512(0 if args.avx2 else 1)
        rows = []
        for m in args.rows:
            for name, ws in paths.items():
                inputs = [torch.randn(m, w.in_features) for w in ws]
                outs = {k: [torch.empty(m, w.out_features) for w in ws] for k in libs}
                times: dict[str, list[float]] = {k: [] for k in libs}
                for _ in range(args.rounds + 1):  # (the first round warms up)
                    for k, lib in libs.items():
                        times[k].append(one_pass(lib, inputs, ws, outs[k], args.threads))
                base, new = (statistics.median(times[k][1:]) * 1e3 for k in libs)
                diff = max(float((a - b).abs().max()) for a, b in zip(outs["base"], outs["new"]))
                rows.append({"rows": m, "path": name, "base ms": base, "new ms": new,
                             "new / base": new / base,
                             "bits": "equal" if diff == 0 else f"max diff {diff:.1e}"})
    print(f"base {args.base} vs working tree; {args.threads} thread(s); "
          f"{'AVX2' if args.avx2 else 'AVX-512 where the CPU has it'}; median of {args.rounds}")
    print(table(rows, ["rows", "path", "base ms", "new ms", "new / base", "bits"]))


if __name__ == "__main__":
    main()
