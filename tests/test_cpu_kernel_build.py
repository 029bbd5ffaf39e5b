"""Building the CPU kernels' library (quant/cpu_build.py): every source compiled by its own
compiler process, then linked; a compiler error is raised with the compiler's message and leaves
no library behind (the engine then logs it and serves the reference path). setup.py builds the
library at install time; the engine loads that one only while it was built from the current
sources, and otherwise builds them into its cache folder."""

from __future__ import annotations

import ctypes
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sgl.backend.quant import cpu_build, cpu_kernel

pytestmark = pytest.mark.skipif(
    cpu_build.compiler() is None or not cpu_build.supported_machine(),
    reason="no C compiler, or neither x86-64 nor 64-bit ARM: the library is never built here")

ROOT = Path(__file__).resolve().parent.parent


def _key_of(path: Path) -> str:
    fn = ctypes.CDLL(str(path)).sgl_source_key
    fn.restype = ctypes.c_char_p
    return fn().decode()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build of the current sources (a build takes seconds)."""
    target = tmp_path_factory.mktemp("build") / "kernels" / "lib.so"
    cpu_build.build(target)
    return target


def test_build_links_every_source_into_one_loadable_library(built: Path) -> None:
    target = built
    lib = ctypes.CDLL(str(target))
    # one symbol from each source: all of them were compiled and linked
    for symbol in ("sgl_qlinear", "sgl_q8_quantize", "sgl_rmsnorm", "sgl_decode_step"):
        assert hasattr(lib, symbol), symbol
    assert [p.name for p in target.parent.iterdir()] == ["lib.so"]  # no objects left over
    assert _key_of(target) == cpu_build.source_key()  # the build names its sources


# AVX-512 registers (zmm, ymm/xmm 16-31, mask registers) and EVEX-only instruction forms
_AVX512 = re.compile(r"%zmm|%[xy]mm(1[6-9]|2\d|3[01])\b|%k[1-7]\b|\b\w+(32x4|32x8|64x2|64x4)\b|vpternlog")


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump to read the library")
def test_only_the_avx512_twins_use_avx512(built: Path) -> None:
    # The library runs on AVX2-only CPUs: code outside the *_512 twins (chosen at run time)
    # must not use AVX-512, which a function compiled for it may do anywhere it inlines.
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(built)],
                             capture_output=True, text=True, check=True).stdout
    function, offenders = "", set()
    for line in listing.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if head:
            function = head.group(1)
        # (a GCC clone, tiles8_512.constprop.0, is its function specialised)
        elif _AVX512.search(line) and not function.split(".")[0].endswith("_512"):
            offenders.add(function)
    assert not offenders, offenders
    assert "<tiles4_512>:" in listing  # (the twins are there, and were looked at)


def test_a_compiler_error_is_raised_with_its_message(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "cc"
    # fails to compile, but "links" fine: the compile failure itself must be reported
    broken.write_text('#!/bin/sh\ncase " $* " in *" -c "*) echo "cc: error: no such instruction" >&2; '
                      'exit 1;; esac\nexit 0\n')
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(broken))
    target = tmp_path / "kernels" / "lib.so"
    with pytest.raises(OSError, match="no such instruction"):
        cpu_build.build(target)
    assert not target.exists()


def test_without_openmp_the_library_is_built_for_one_thread(
        built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler without OpenMP (macOS's clang refuses -fopenmp): the sources are built
    without it, the library's loops then run on one thread, with the same results."""
    real = cpu_build.compiler()
    no_openmp = tmp_path / "cc"
    no_openmp.write_text('#!/bin/sh\ncase " $* " in *" -fopenmp "*) echo "clang: error: '
                         f'unsupported option -fopenmp" >&2; exit 1;; esac\nexec {real} "$@"\n')
    no_openmp.chmod(no_openmp.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(no_openmp))
    target = tmp_path / "kernels" / "lib.so"
    cpu_build.build(target)
    assert b"GOMP_" not in target.read_bytes() and b"GOMP_" in built.read_bytes()
    gen = np.random.default_rng(0)
    n, k, rows = 40, 256, 3
    x = gen.standard_normal((rows, k), dtype=np.float32)
    codes = gen.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = gen.random((n, k // 32), dtype=np.float32) / 16
    zero = gen.standard_normal((n, k // 32), dtype=np.float32)
    outs = []
    for path in (built, target):
        lib = ctypes.CDLL(str(path))
        assert lib.sgl_cpu_ok()
        y = np.zeros((rows, n), dtype=np.float32)
        ptr = [a.ctypes.data_as(ctypes.c_void_p) for a in (x, codes, scale, zero, y)]
        lib.sgl_qlinear(ctypes.c_int(4), ctypes.c_int(32), ptr[0], ctypes.c_int64(rows),
                        ctypes.c_int64(k), ptr[1], ptr[2], ptr[3], ctypes.c_int(0),
                        ctypes.c_int64(n), None, ptr[4], ctypes.c_int(2))
        outs.append(y)
    assert np.abs(outs[0]).sum() > 0 and np.array_equal(outs[0], outs[1])


def test_setup_builds_the_library_into_the_package(tmp_path: Path) -> None:
    # what `pip install` runs: setup.py's build_ext, into a build folder here
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                    "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, check=True, capture_output=True)
    built = list((tmp_path / "lib" / "sgl" / "backend" / "quant").glob(f"{cpu_build.PACKAGED_NAME}*"))
    assert len(built) == 1, built
    assert _key_of(built[0]) == cpu_build.source_key()


def _point_at(monkeypatch: pytest.MonkeyPatch, packaged: Path, cache: Path) -> None:
    monkeypatch.setattr(cpu_kernel, "_packaged_library", lambda: packaged)
    monkeypatch.setenv("SGL_CACHE_DIR", str(cache))


def test_the_installed_library_is_used_while_it_matches_its_sources(
        built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    packaged = built
    _point_at(monkeypatch, packaged, tmp_path / "cache")

    def no_build(target: Path) -> None:
        raise AssertionError("built although the installed library is current")

    monkeypatch.setattr(cpu_build, "build", no_build)
    lib = cpu_kernel._open_current()
    assert lib._name == str(packaged)


def test_a_stale_installed_library_is_replaced_by_a_build_of_the_current_sources(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an editable install whose C files were edited after `pip install -e .`
    packaged = tmp_path / "pkg" / "lib.so"
    with monkeypatch.context() as m:
        m.setattr(cpu_build, "source_key", lambda source_dir=None: "0123456789abcdef")
        cpu_build.build(packaged)
    assert _key_of(packaged) == "0123456789abcdef"
    _point_at(monkeypatch, packaged, tmp_path / "cache")
    lib = cpu_kernel._open_current()
    assert lib._name != str(packaged)
    assert Path(lib._name).parent == tmp_path / "cache" / "kernels"
    assert _key_of(Path(lib._name)) == cpu_build.source_key()
