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

import hashlib
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
HEADER_NAME = "cpu_simd.h"  # included by every source
SOURCES = tuple(HERE / name for name in SOURCE_NAMES)
HEADER = HERE / HEADER_NAME
FLAGS = ("-O3", "-fopenmp", "-fPIC", "-std=c11")  # each source's object; linked with -shared
# The name of the library built at install time, beside these sources (setup.py's extension).
PACKAGED_NAME = "sgl_cpu_kernels"


def supported_machine() -> bool:
    """The kernels are x86-64 only (AVX2, FMA and F16C, checked at run time by `sgl_cpu_ok`)."""
    return platform.machine() in ("x86_64", "AMD64")


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def source_key(source_dir: Path = HERE) -> str:
    """What names a build: the sources, the header and the flags, hashed."""
    data = b"".join((source_dir / name).read_bytes() for name in (*SOURCE_NAMES, HEADER_NAME))
    return hashlib.sha256(data + " ".join(FLAGS).encode()).hexdigest()[:16]


def build(target: Path, source_dir: Path = HERE) -> None:
    """Compile every source at once (one compiler process each, so a build, 4-8 s in series on
    a 2-core laptop, takes about its slowest file), then link the library at `target`. Raises
    OSError with the compiler's message; leaves nothing behind on failure. `source_dir`: where
    the sources and the header are (another revision's, bench/cpu_kernel_ab.py)."""
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler (cc/gcc) found")
    key = f'-DSGL_SOURCE_KEY="{source_key(source_dir)}"'
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        sources = [source_dir / name for name in SOURCE_NAMES]
        objects = [Path(tmp) / f"{source.stem}.o" for source in sources]
        jobs = [subprocess.Popen([cc, *FLAGS, key, "-c", "-o", str(obj), str(source)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for source, obj in zip(sources, objects)]
        errors = [job.communicate()[1] for job in jobs]  # (waits for each; reads its stderr)
        failures = [err for job, err in zip(jobs, errors) if job.returncode != 0]
        out = Path(tmp) / target.name
        if not failures:
            linked = subprocess.run([cc, "-shared", "-fopenmp", "-o", str(out), *map(str, objects)],
                                    capture_output=True, text=True)
            failures = [linked.stderr] if linked.returncode != 0 else []
        if failures:
            raise OSError(f"{cc} failed: {failures[0].strip()[-800:]}")
        os.replace(out, target)  # atomic: concurrent engines never load half a file
