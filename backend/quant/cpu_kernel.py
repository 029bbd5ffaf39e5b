"""The C kernel of QuantizedWeight on the CPU (cpu_kernel.c), built at install time or first use.

    qlinear(x [M, K] float32, w, bias [N] | None) -> [M, N] float32
    dequantize(w) -> [N, K] float32

torch's own weight-only CPU matmuls (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`)
compute exactly the formulas we need for 4-bit groups, but on an AVX2 CPU they run a slow
generic path (measured 2-core AVX2 VM, every projection of one SmolLM2-135M token: 450 ms
int4, 270 ms int8 per-channel, against 80 ms for float32 oneDNN), and int8 has no per-group
scales at all. So sgl carries a small C library (cpu_build.py: its sources, flags and key),
built with the system C compiler when the package is installed (setup.py) and loaded through
ctypes (which drops the GIL for the call). Where the install could not build it, or an editable
install's C sources changed since, the first engine builds it into the cache folder
(`<cache>/kernels/`, named by the sources' hash) on a background thread at load
(`start_build`); whatever runs first after that waits for the build. Without a compiler, or on
an x86-64 CPU without AVX2/FMA/F16C, or a CPU that is neither x86-64 nor 64-bit ARM (which
builds the same kernels from portable C, cpu_portable.h), `available()` is False
(`unavailable_reason()` says why) and the layers fall back to the reference (dequantize, then
F.linear: every product dequantizes its whole weight first), which is why the engine's
`quantization="auto"` then loads float weights instead (quant/policy.py); the engine decides
its kernel set from `likely_available()`.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
import platform
import threading
from pathlib import Path

import torch

from sgl.backend.quant import cpu_build
from sgl.backend.quant.weight import QuantizedWeight

logger = logging.getLogger("sgl.engine")

_PTR, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_lock = threading.Lock()
_resolved: list[ctypes.CDLL | None] = []  # the library (or None) once built or failed
_why: list[str] = []  # why it is None, once it is


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
    """Whether the library should build here (x86-64 with AVX2, FMA and F16C listed, or 64-bit
    ARM; a C compiler or the installed library), decided without building it; `available()`
    is the answer."""
    if _resolved:
        return _resolved[0] is not None
    if not cpu_build.supported_machine():
        return False
    if _packaged_library() is None and cpu_build.compiler() is None:
        return False
    if cpu_build.portable():
        return True  # (portable C: no CPU feature to check)
    flags = cpu_build.cpu_flags()
    if flags is None:
        return True  # (not Linux: the build and its CPU check decide)
    return {"avx2", "fma", "f16c"} <= flags  # (every AVX2 CPU has F16C)


def _packaged_library() -> Path | None:
    """The library setup.py built beside the sources, if there is one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = cpu_build.HERE / f"{cpu_build.PACKAGED_NAME}{suffix}"
        if path.is_file():
            return path
    return None


def _open_current() -> ctypes.CDLL:
    """The install-time library while it matches the sources, else the cache folder's build of
    them (compiled now if missing). Raises OSError where neither can be had."""
    key = cpu_build.source_key()
    packaged = _packaged_library()
    if packaged is not None:
        lib = ctypes.CDLL(str(packaged))
        built_from = getattr(lib, "sgl_source_key", None)
        if built_from is not None:
            built_from.restype = ctypes.c_char_p
            if built_from().decode() == key:
                return lib
        logger.info("the installed CPU kernel library is older than its sources; rebuilding")
    from sgl.backend.model_loader import cache_dir

    target = cache_dir() / "kernels" / f"sgl_qlinear-{key}.so"
    if not target.is_file():
        cpu_build.build(target)
    return ctypes.CDLL(str(target))


def _load() -> ctypes.CDLL | None:
    if not cpu_build.supported_machine():
        return _unavailable(f"the CPU is {platform.machine() or 'unknown'}; the kernels build "
                            "for x86-64 and 64-bit ARM")
    try:
        lib = _open_current()
    except OSError as exc:
        first = (str(exc).strip().splitlines() or ["no message"])[0]
        return _unavailable(f"the C library could not be built or loaded: {first[:300]}")
    if not lib.sgl_cpu_ok():
        return _unavailable("the CPU lacks AVX2, FMA or F16C")
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


def _unavailable(why: str) -> None:
    logger.info("quantized CPU kernels unavailable: %s", why)
    _why.append(why)


def available() -> bool:
    return (_resolved[0] if _resolved else _library()) is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False here, in words; None where the library serves. Builds or
    loads the library first (waits for a build under way)."""
    return None if available() else (_why[-1] if _why else "the library failed to load")


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
