"""Building the CPU kernels' library (quant/cpu_kernel.py `_build`): every source compiled by
its own compiler process, then linked; a compiler error is raised with the compiler's message
and leaves no library behind (the engine then logs it and serves the reference path)."""

from __future__ import annotations

import ctypes
import platform
import stat
from pathlib import Path

import pytest

from sgl.backend.quant import cpu_kernel

pytestmark = pytest.mark.skipif(
    cpu_kernel._compiler() is None or platform.machine() not in ("x86_64", "AMD64"),
    reason="no C compiler, or not x86-64: the library is never built here")


def test_build_links_every_source_into_one_loadable_library(tmp_path: Path) -> None:
    target = tmp_path / "kernels" / "lib.so"
    cpu_kernel._build(target)
    lib = ctypes.CDLL(str(target))
    # one symbol from each source: all of them were compiled and linked
    for symbol in ("sgl_qlinear", "sgl_q8_quantize", "sgl_rmsnorm", "sgl_decode_step"):
        assert hasattr(lib, symbol), symbol
    assert [p.name for p in target.parent.iterdir()] == ["lib.so"]  # no objects left over


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
        cpu_kernel._build(target)
    assert not target.exists()
