"""Compiling the CPU kernels' C library: the sources, the flags, the key that names a build.

Imported by `cpu_kernel` (which loads the library through ctypes) and by `setup.py` (which builds
it at install time, so a first `sgl.Engine()` finds it ready). This module imports neither torch
nor the rest of the package: setup.py loads it by its path before anything is installed.

Every build embeds `source_key()` (a hash of the sources, the header and the flags) as the
library's `sgl_source_key()`. A library built at install time is used only while its key still
matches the sources beside it; after an edit to an editable install's C files the engine builds
the current sources into its cache folder instead of loading the stale library.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
# The quantized linear, its integer-activation twin (cpu_int8.c), the fused decode ops
# (cpu_ops.c) and the one-call decode step (cpu_layer.c): one library.
SOURCE_NAMES = ("cpu_kernel.c", "cpu_int8.c", "cpu_ops.c", "cpu_layer.c")
# Included by the sources: the intrinsics' target, their portable C for other CPUs, and the
# entry points' prototypes.
HEADER_NAMES = ("cpu_simd.h", "cpu_portable.h", "cpu_api.h")
SOURCES = tuple(HERE / name for name in SOURCE_NAMES)
# Each source's object; linked with -shared. -ffp-contract=off: no multiply-add is fused but
# those the sources ask for (GCC in C11 mode fuses none anyway; clang would), so every build
# rounds as the kernels' tests pin.
FLAGS = ("-O3", "-fopenmp", "-fPIC", "-std=c11", "-ffp-contract=off")
# The CPUs the library builds for: x86-64 from its AVX2 intrinsics, 64-bit ARM from the same
# intrinsics in portable C (cpu_portable.h; NEON once compiled).
X86_MACHINES = ("x86_64", "AMD64")
ARM_MACHINES = ("aarch64", "arm64")
# The name of the library built at install time, beside these sources (setup.py's extension).
PACKAGED_NAME = "sgl_cpu_kernels"


def supported_machine() -> bool:
    """x86-64 (AVX2, FMA and F16C, checked at run time by `sgl_cpu_ok`) or 64-bit ARM."""
    return platform.machine() in X86_MACHINES + ARM_MACHINES


def portable() -> bool:
    """Whether the library is built from cpu_portable.h's C instead of the AVX2 intrinsics: on
    ARM, and on x86-64 where SGL_CPU_PORTABLE=1 (the tests' way to check that C's bits
    against the AVX2 build's on the same machine)."""
    return platform.machine() not in X86_MACHINES or os.environ.get("SGL_CPU_PORTABLE") == "1"


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags as /proc/cpuinfo lists them; None where there is no such file
    (not Linux)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None


def flags() -> tuple[str, ...]:
    """The compiler flags of this machine's build (part of its key)."""
    return FLAGS + (("-DSGL_PORTABLE",) if portable() else ())


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def source_key(source_dir: Path = HERE) -> str:
    """What names a build: the sources, the header and the flags, hashed."""
    data = b"".join((source_dir / name).read_bytes() for name in (*SOURCE_NAMES, *HEADER_NAMES))
    return hashlib.sha256(data + " ".join(flags()).encode()).hexdigest()[:16]


def build(target: Path, source_dir: Path = HERE) -> None:
    """Compile every source at once (one compiler process each, so a build, 4-8 s in series on
    a 2-core laptop, takes about its slowest file), then link the library at `target`. Where
    the compiler has no OpenMP (macOS's clang), the library is built without it: its loops
    then run on one thread. Raises OSError with the compiler's message; leaves nothing behind
    on failure. `source_dir`: where the sources and the headers are (another revision's,
    bench/cpu_kernel_ab.py)."""
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler (cc/gcc) found")
    key = f'-DSGL_SOURCE_KEY="{source_key(source_dir)}"'
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        failure = _compile_and_link(cc, [*flags(), key], source_dir, Path(tmp), target.name)
        if failure is not None and "-fopenmp" in flags():
            single = [f for f in flags() if f != "-fopenmp"]
            if _compile_and_link(cc, [*single, key], source_dir, Path(tmp), target.name) is None:
                failure = None
                logging.getLogger("sgl.engine").warning(
                    "sgl: %s could not build the CPU kernels with OpenMP; built them without it, "
                    "so they run on one thread", cc)
        if failure is not None:
            raise OSError(f"{cc} failed: {failure.strip()[-800:]}")
        os.replace(Path(tmp) / target.name, target)  # atomic: engines never load half a file


def _compile_and_link(cc: str, options: list[str], source_dir: Path, tmp: Path,
                      name: str) -> str | None:
    """The library at tmp / name, built with `options`; the first error's text, or None."""
    sources = [source_dir / source for source in SOURCE_NAMES]
    objects = [tmp / f"{source.stem}.o" for source in sources]
    jobs = [subprocess.Popen([cc, *options, "-c", "-o", str(obj), str(source)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for source, obj in zip(sources, objects)]
    errors = [job.communicate()[1] for job in jobs]  # (waits for each; reads its stderr)
    failures = [err for job, err in zip(jobs, errors) if job.returncode != 0]
    if failures:
        return failures[0]
    link = [cc, "-shared", *(["-fopenmp"] if "-fopenmp" in options else []), "-o",
            str(tmp / name), *map(str, objects)]
    linked = subprocess.run(link, capture_output=True, text=True)
    return linked.stderr if linked.returncode != 0 else None
