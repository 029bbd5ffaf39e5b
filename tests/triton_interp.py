"""Run the Triton kernel tests without a GPU: Triton's interpreter, in process or in a child.

Triton decides "interpreted or compiled" when a function is decorated with `@triton.jit`,
which for its own standard library (`tl.sum`, `tl.max`, `tl.cdiv`, ...) happens when `triton`
is first imported. So a kernel test module imports this helper before anything that imports
triton (our kernels do), and:

- if triton is not imported yet, this module sets TRITON_INTERPRET=1: the Triton tests run
  in process, on CPU tensors;
- if another test module imported triton first (compiled mode, useless without a GPU), the
  in-process Triton tests skip and the module's subprocess test (`rerun_interpreted`) reruns
  its file in a fresh interpreter with TRITON_INTERPRET=1 set from the start.

The environment is set at import, so the first import in a process decides; later imports of
this module (a second kernel test file) see triton already imported and change nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton (and our kernels) are decorated

from sgl.backend.kernels import triton_compat  # noqa: E402  (after TRITON_INTERPRET)

__all__ = ["CUDA", "DEVICE", "NO_TRITON", "triton_runs_here", "skip_unless_rerun_needed",
           "rerun_interpreted"]

DEVICE = torch.device("cuda" if CUDA else "cpu")
NO_TRITON = "triton missing, or imported uninterpreted (see the subprocess test)"
_CHILD_MARK = "SGL_TRITON_INTERP_CHILD"  # set in the child, so it never reruns itself


def triton_runs_here(*kernels: Any) -> bool:
    """Can these Triton kernels run in this process: on CUDA, or all of them interpreted
    together with Triton's standard library (an interpreted kernel calling a compiled
    `tl.sum` fails)."""
    if not triton_compat.HAS_TRITON:
        return False
    if CUDA:
        return True
    return all(triton_compat.is_interpreted(k) for k in (triton_compat.tl.sum, *kernels))


def skip_unless_rerun_needed(triton_here: bool) -> pytest.MarkDecorator:
    """Mark for a subprocess test: run it only when the Triton tests skipped here but an
    interpreted child could run them (triton installed, no CUDA, not already the child)."""
    return pytest.mark.skipif(
        triton_here or not triton_compat.HAS_TRITON or CUDA or os.environ.get(_CHILD_MARK) == "1",
        reason="the Triton tests already ran in this process")


def rerun_interpreted(test_file: str, *pytest_args: str) -> None:
    """Run `test_file` under pytest in a fresh interpreter with TRITON_INTERPRET=1; fail with
    the tail of its output unless it passes."""
    env = {**os.environ, "TRITON_INTERPRET": "1", _CHILD_MARK: "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-x", "-p", "no:cacheprovider", *pytest_args],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
