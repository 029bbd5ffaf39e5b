"""Split-K in the one-row kernels (`QGemvConfig.split_k`, backend/quant/triton_split.py): the
GEMV of every GGUF format (plain and factored scales) and FP8's, at 1, 2 and 4 slices, against
dequantize-then-matmul; odd N, a ragged last K step and uneven slices; 1..5 rows; the slice
plan; a bad split_k refused; the kernels compiled for sm_90 without a GPU. Helpers and the bound: tests/test_quant_triton.py; the
interpreter set-up: tests/triton_interp.py (without CUDA these run interpreted, on the CPU;
tests/test_quant_gpu.py has the 8B shapes, determinism and graph replay on the device).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_interp import (  # first: sets TRITON_INTERPRET before triton is imported
    NO_TRITON,
    rerun_interpreted,
    skip_unless_rerun_needed,
    triton_runs_here,
)
from test_quant_triton import FMTS, K_QUANTS, assert_matches, fp8_weight, inputs, qweight

from sgl.backend.kernels import triton_compat
from sgl.backend.quant import linear, triton_fp8, triton_gemm, triton_gemv, triton_split
from sgl.backend.quant.triton_fp8 import fp8_gemv
from sgl.backend.quant.triton_gemv import QGemvConfig, qgemv
from sgl.backend.quant.triton_split import split_plan

TRITON_HERE = triton_runs_here(triton_gemv._qgemv_kernel, triton_fp8._fp8_gemv_kernel,
                               triton_split._reduce_kernel)
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason=NO_TRITON)

KINDS = FMTS + [f"{f}/factored" for f in K_QUANTS] + ["fp8"]


def case(kind: str, m: int, split: int, seed: int = 0, reduce: str = "kernel"):
    """(run(x, bias) -> y, reference weight, x, bias, N) for `kind` at a shape whose K loop
    has a ragged last step: group-32 formats K = 13 groups in steps of 4 (4 steps: 2+2,
    1+1+1+1); K-quants K = 1280 in steps of 512 (3 steps: uneven 2+1, and 1+1+1 when 4 are
    asked); FP8 K = 200 in steps of 32 (7 steps: 4+3, 2+2+2+1). N = 37 or 21, no multiple of
    the 16-row tile."""
    if kind == "fp8":
        n, k = 37, 200
        _, w8 = fp8_weight(n, k, seed=seed)
        cfg = QGemvConfig(16, 32, 1, split_k=split, split_reduce=reduce)
        x, b = inputs(m, k, n, torch.float32, bias=True, seed=seed)
        return (lambda xx, bb: fp8_gemv(xx, w8.weight, w8.scale, bb, config=cfg),
                w8.dequantize(), x, b, n)
    fmt, _, factored = kind.partition("/")
    n, k, block_k = (21, 1280, 512) if fmt in K_QUANTS else (37, 13 * 32, 128)
    w = qweight(fmt, n, k, seed=seed, factored=bool(factored))
    cfg = QGemvConfig(16, block_k, 1, split_k=split, split_reduce=reduce)
    x, b = inputs(m, k, n, torch.float32, bias=True, seed=seed)
    return (lambda xx, bb: qgemv(xx, w, bb, config=cfg)), w.dequantize(), x, b, n


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("split", [1, 2, 4])
def test_split_k_gemv_matches_dequantize_then_matmul(kind: str, split: int) -> None:
    """Every kind at every split: one row without a bias, slices added by a second kernel;
    two rows with one (added once), by the last slice of each tile (the rows-first grid with
    the slices as a third axis), bit for bit what the second kernel gives: both add the same
    float32 partials in slice order."""
    run, ref, x, _, _ = case(kind, 1, split, seed=split)
    assert_matches(run(x, None), x, ref, None)
    run, ref, x, b, _ = case(kind, 2, split, seed=split + 1, reduce="last")
    y = run(x, b)
    assert_matches(y, x, ref, b)
    if split > 1:
        by_kernel, _, _, _, _ = case(kind, 2, split, seed=split + 1, reduce="kernel")
        assert torch.equal(by_kernel(x, b), y)


@needs_triton
@pytest.mark.parametrize("kind,reduce", [("Q4_K/factored", "kernel"), ("fp8", "last")])
def test_split_rows_do_not_depend_on_the_row_count(kind: str, reduce: str) -> None:
    """Row r of an M-row product is bit for bit the same for M = r+1..5: a partials buffer
    or a tile counter indexed with the wrong row or slice stride would mix rows here."""
    run, ref, x, b, _ = case(kind, 5, 4, seed=9, reduce=reduce)
    full = run(x, b)
    assert_matches(full, x, ref, b)
    for m in range(1, 5):
        assert torch.equal(run(x[:m], b), full[:m]), m


@needs_triton
def test_the_last_slice_reduction_leaves_its_counters_zeroed() -> None:
    """Every tile's counter is back at 0 after a launch, so the next launch (a graph replay)
    finds its tiles' last slice again: the same result twice, and the buffer all zeros."""
    for kind in ("Q6_K/factored", "fp8"):
        run, ref, x, b, _ = case(kind, 2, 4, seed=4, reduce="last")
        first = run(x, b)
        assert_matches(first, x, ref, b)
        assert torch.equal(run(x, b), first)
        counters = triton_compat.tile_counters(x.device, 1)
        assert counters.numel() >= triton_compat.MIN_COUNTERS
        assert not counters.any()


@needs_triton
def test_split_k_from_the_defaults_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A split in GEMV_DEFAULTS reaches the kernel through quant_linear (gemv_config keeps it
    when it caps the K step to the weight's K)."""
    calls: list[int] = []
    real = triton_split.split_plan
    monkeypatch.setattr(triton_split, "split_plan",
                        lambda *a: calls.append(real(*a)[0]) or real(*a))
    monkeypatch.setattr(linear, "use_triton", lambda x: True)
    monkeypatch.setitem(triton_gemv.GEMV_DEFAULTS, "q4",
                        ((1 << 62, QGemvConfig(16, 64, 1, split_k=4)),))
    w = qweight("Q4_1", 37, 13 * 32)
    x, b = inputs(1, 13 * 32, 37, torch.float32, bias=True, seed=3)
    assert_matches(linear.quant_linear(x, w, b), x, w.dequantize(), b)
    assert calls == [4]


def test_split_plan_makes_no_empty_slice() -> None:
    """(slices, units per slice) for steps x split: whole steps per slice, at most split_k
    slices, every slice non-empty, the slices cover every step."""
    assert split_plan(7, 2, 64) == (2, 4 * 64)
    assert split_plan(7, 4, 64) == (4, 2 * 64)
    assert split_plan(5, 4, 32) == (3, 2 * 32)  # 2+2+1, not 2+2+1+0
    assert split_plan(3, 8, 512) == (3, 512)
    assert split_plan(1, 4, 512) == (1, 512)
    assert split_plan(6, 1, 16) == (1, 6 * 16)
    for steps in range(1, 40):
        for split_k in range(1, 10):
            slices, units = split_plan(steps, split_k, 1)
            assert 1 <= slices <= split_k
            assert (slices - 1) * units < steps <= slices * units, (steps, split_k)


def test_the_defaults_tables_splits_are_valid() -> None:
    """What the sweep pastes into GEMV_DEFAULTS passes the launch's checks (shape-only)."""
    for kind, entries in triton_gemv.GEMV_DEFAULTS.items():
        for _, cfg in entries:
            triton_split.check_split(cfg.split_k, cfg.split_reduce)  # raises if not
            assert triton_gemv.gemv_config(kind, 4096, 4096, 32).split_k >= 1
    for entries in triton_gemm.GEMM_DEFAULTS.values():  # (the tiled kernels' table too)
        for _, small, large in entries:
            for cfg in (small, large):
                triton_split.check_split(cfg.split_k, cfg.split_reduce)


@needs_triton
def test_a_bad_split_k_is_refused() -> None:
    w = qweight("Q4_0", 37, 13 * 32)
    x, _ = inputs(1, 13 * 32, 37, torch.float32, bias=False)
    with pytest.raises(ValueError, match="split_k 0"):
        qgemv(x, w, config=QGemvConfig(16, 64, 1, split_k=0))
    _, w8 = fp8_weight(37, 200)
    with pytest.raises(ValueError, match="split_k -1"):
        fp8_gemv(torch.randn(1, 200, device=w8.weight.device), w8.weight, w8.scale,
                 config=QGemvConfig(16, 32, 1, split_k=-1))
    with pytest.raises(ValueError, match="split_reduce 'atomic'"):
        qgemv(x, w, config=QGemvConfig(16, 64, 1, split_k=2, split_reduce="atomic"))


@pytest.mark.skipif(not triton_compat.HAS_TRITON, reason="triton missing")
def test_the_gemv_kernels_compile_for_hopper() -> None:
    """The compiled path, which the interpreter never takes: the GEMVs (split, both
    reductions, bytes and words, FP8) and the reduction compile to sm_90 PTX and a cubin, and
    the one-launch reduction's PTX orders store, barrier, atomic, L2 reads
    (tests/triton_compile_check.py, in a child without TRITON_INTERPRET)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_compile_check.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@skip_unless_rerun_needed(TRITON_HERE)
def test_quant_triton_splitk_in_subprocess() -> None:
    """Triton was imported before this module could ask for its interpreter: rerun here."""
    rerun_interpreted(__file__)
