"""Builds the CPU kernels' C library (backend/quant/cpu_build.py) when sgl is installed, so that
a first `sgl.Engine()` does not spend seconds compiling it. Everything else about the package
is in pyproject.toml.

The library is loaded through ctypes, not imported: it is declared as an extension module only
so that setuptools places it in the package (and in the source tree for an editable install)
and tags the wheel for the platform. Where it cannot be built (no C compiler, not x86-64) the
install goes on with a warning, and the engine tries again at first use or serves the
reference path.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("sgl_cpu_build", ROOT / "backend" / "quant" / "cpu_build.py")
cpu_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_build)


class BuildCpuKernels(build_ext):
    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name))
        if not cpu_build.supported_machine():
            print("sgl: not x86-64: the CPU kernel library is not built", file=sys.stderr)
            return
        try:
            cpu_build.build(target)
        except OSError as exc:
            print(f"sgl: WARNING: the CPU kernel library was not built ({exc}); the engine "
                  "will try again at first use", file=sys.stderr)

    def get_outputs(self) -> list[str]:  # only what was built (an optional build may be absent)
        return [path for path in super().get_outputs() if Path(path).is_file()]


setup(
    ext_modules=[Extension(f"sgl.backend.quant.{cpu_build.PACKAGED_NAME}",
                           sources=[p.resolve().relative_to(ROOT).as_posix() for p in cpu_build.SOURCES])],
    cmdclass={"build_ext": BuildCpuKernels},
)
