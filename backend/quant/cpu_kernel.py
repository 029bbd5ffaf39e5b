"""The C kernel of QuantizedWeight on the CPU (cpu_kernel.c), compiled on first use.

    qlinear(x [M, K] float32, w, bias [N] | None) -> [M, N] float32
    dequantize(w) -> [N, K] float32

torch's own weight-only CPU matmuls (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`)
compute exactly the formulas we need for 4-bit groups, but on an AVX2 CPU they run a slow
generic path (measured 2-core AVX2 VM, every projection of one SmolLM2-135M token: 450 ms
int4, 270 ms int8 per-channel, against 80 ms for float32 oneDNN), and int8 has no per-group
scales at all. So sgl carries one small C file, compiled with the system C compiler into the
cache folder (`<cache>/kernels/`, keyed by the source's hash) and loaded through ctypes (which
drops the GIL for the call). Without a compiler, or on a CPU without AVX2/FMA, `available()`
is False and the layers fall back to the reference (dequantize, then F.linear). The engine
starts the build on a background thread at load (`start_build`) and decides its kernel set
from `likely_available()`; whatever runs first after that waits for the build.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from sgl.backend.quant.weight import QuantizedWeight

logger = logging.getLogger("sgl.engine")

# The quantized linear, its integer-activation twin (cpu_int8.c, cpu_int8.py), the fused decode
# ops (cpu_ops.c, wrapped by cpu_ops.py) and the one-call decode step (cpu_layer.c,
# cpu_layer.py): one library.
_SOURCES = tuple(Path(__file__).with_name(name)
                 for name in ("cpu_kernel.c", "cpu_int8.c", "cpu_ops.c", "cpu_layer.c"))
_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-std=c11"]  # each source's object; linked with -shared
_PTR, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_HEADER = Path(__file__).with_name("cpu_simd.h")  # included by the sources (their hash key too)


def _build(target: Path) -> None:
    """Compile every source at once (one compiler process each, so a cold start's build, 4-8 s
    in series on a 2-core laptop, takes about its slowest file), then link the library."""
    compiler = _compiler()
    if compiler is None:
        raise OSError("no C compiler (cc/gcc) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in _SOURCES]
        jobs = [subprocess.Popen([compiler, *_FLAGS, "-c", "-o", str(obj), str(source)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for source, obj in zip(_SOURCES, objects)]
        errors = [job.communicate()[1] for job in jobs]  # (waits for each; reads its stderr)
        failures = [err for job, err in zip(jobs, errors) if job.returncode != 0]
        out = Path(tmp) / target.name
        if not failures:
            linked = subprocess.run([compiler, "-shared", "-fopenmp", "-o", str(out),
                                     *map(str, objects)], capture_output=True, text=True)
            failures = [linked.stderr] if linked.returncode != 0 else []
        if failures:
            raise OSError(f"{compiler} failed: {failures[0].strip()[-800:]}")
        os.replace(out, target)  # atomic: concurrent engines never load half a file


_lock = threading.Lock()
_resolved: list[ctypes.CDLL | None] = []  # the library (or None) once built or failed


def _library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built or run (logged once). The first
    caller builds it; concurrent callers (the background build, a first step) wait for it."""
    if _resolved:
        return _resolved[0]
    with _lock:
        if not _resolved:
            _resolved.append(_load())
    return _resolved[0]


def start_build() -> None:
    """Build or load the library on a background thread, so that compiling (1-4 s from a
    cold cache) overlaps the rest of the engine's load; the first use waits for it."""
    if not _resolved and not _lock.locked():
        threading.Thread(target=_library, name="sgl-cpu-kernel-build", daemon=True).start()


@functools.cache
def likely_available() -> bool:
    """Whether the library should build here (x86-64, a C compiler, AVX2, FMA and F16C listed),
    decided without building it; `available()` is the answer."""
    if _resolved:
        return _resolved[0] is not None
    if platform.machine() not in ("x86_64", "AMD64") or _compiler() is None:
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return True  # (not Linux: the build and its CPU check decide)
    return "avx2" in flags and "fma" in flags and "f16c" in flags  # (every AVX2 CPU has F16C)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _load() -> ctypes.CDLL | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    from sgl.backend.model_loader import cache_dir

    source = b"".join(path.read_bytes() for path in (*_SOURCES, _HEADER))
    key = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"sgl_qlinear-{key}.so"
    try:
        if not target.is_file():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        logger.warning("quantized CPU kernel unavailable (%s); using dequantize + F.linear", exc)
        return None
    if not lib.sgl_cpu_ok():
        return None
    lib.sgl_qlinear.argtypes = [_INT, _INT, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _INT, _I64, _PTR,
                                _PTR, _INT]
    lib.sgl_qlinear.restype = None
    lib.sgl_qdequant.argtypes = [_INT, _INT, _PTR, _PTR, _PTR, _INT, _I64, _I64, _PTR, _INT]
    lib.sgl_qdequant.restype = None
    from sgl.backend.quant import cpu_int8, cpu_layer, cpu_ops

    cpu_int8.declare(lib)
    cpu_ops.declare(lib)
    cpu_layer.declare(lib)
    return lib


def available() -> bool:
    return (_resolved[0] if _resolved else _library()) is not None


def use_avx512(on: bool) -> bool:
    """Let the 4-bit loops take their AVX-512 twins where the CPU has them (the default from
    load: the same bits with fewer instructions per weight) or keep them on AVX2 (the tests
    compare both); returns whether they are on now."""
    lib = _library()
    return lib is not None and bool(lib.sgl_use_avx512(int(on)))


def qlinear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None,
            threads: int | None = None) -> torch.Tensor:
    """[M, K] float32 contiguous -> [M, N] float32 (needs `available()`), on `threads`
    threads (torch's count by default)."""
    lib = _library()
    assert lib is not None
    m = x.shape[0]
    y = torch.empty(m, w.out_features, dtype=torch.float32)
    lib.sgl_qlinear(w.bits, w.group_size, x.data_ptr(), m, w.in_features, w.codes.data_ptr(),
                    w.scale.data_ptr(), w.zero.data_ptr(), int(w.f16_scales), w.out_features,
                    None if bias is None else bias.data_ptr(), y.data_ptr(),
                    threads or torch.get_num_threads())
    return y


def dequantize(w: QuantizedWeight, rows: slice = slice(None)) -> torch.Tensor:
    """[n, K] float32 weights of the output features in `rows` (a step-1 slice; all by
    default), the C twin of `QuantizedWeight.dequantize` (prefill: several times faster than
    the torch ops, which materialize int16 and float intermediates)."""
    lib = _library()
    assert lib is not None
    start, stop, _ = rows.indices(w.out_features)
    n = max(stop - start, 0)
    out = torch.empty(n, w.in_features, dtype=torch.float32)
    lib.sgl_qdequant(w.bits, w.group_size, w.codes[start].data_ptr() if n else 0,
                     w.scale[start].data_ptr() if n else 0, w.zero[start].data_ptr() if n else 0,
                     int(w.f16_scales), n, w.in_features, out.data_ptr(), torch.get_num_threads())
    return out
