"""The decode GEMV (backend/kernels/triton_gemv.py) against its reference, F.linear.

Same arrangement as tests/test_kernels.py: without CUDA the Triton kernel runs under Triton's
interpreter (tests/triton_interp.py), in process when this module is the first to import
triton; otherwise the in-process Triton tests skip and `test_gemv_in_subprocess` reruns this
file with TRITON_INTERPRET=1 from the start. Shapes are small and deliberately not multiples
of the blocks, so every masked path runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interp import (  # first: sets TRITON_INTERPRET before triton is imported
    DEVICE,
    NO_TRITON,
    rerun_interpreted,
    skip_unless_rerun_needed,
    triton_runs_here,
)

from sgl.backend.kernels import dispatch
from sgl.backend.kernels import triton_gemv as gemv

TRITON_HERE = triton_runs_here(gemv._gemv_kernel)
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason=NO_TRITON)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=5e-3, rtol=5e-3)}


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)  # [M, K]
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)  # [N, K]
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None  # [N]
    return x, w, b


def _expected(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(37, 200), (8, 64), (100, 513)])
def test_gemv_matches_reference(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    x, w, b = _inputs(m, n, k, dtype, bias=(n == 37), seed=m)
    y = gemv.gemv_triton(x, w, b)
    assert y.shape == (m, n) and y.dtype == dtype
    torch.testing.assert_close(y.float(), _expected(x, w, b), **TOL[dtype])
    torch.testing.assert_close(gemv.gemv_reference(x, w, b).float(), _expected(x, w, b),
                               **TOL[dtype])


@needs_triton
@pytest.mark.parametrize("cfg", [gemv.GemvConfig(4, 64, 1), gemv.GemvConfig(16, 128, 2)])
def test_gemv_explicit_configs_and_even_blocks(cfg: gemv.GemvConfig) -> None:
    # Exact multiples of the blocks (the unmasked EVEN_N/EVEN_K path) and ragged ones.
    for n, k in ((32, 256), (33, 250)):
        x, w, b = _inputs(2, n, k, torch.bfloat16, bias=True)
        torch.testing.assert_close(gemv.gemv_triton(x, w, b, config=cfg).float(),
                                   _expected(x, w, b), **TOL[torch.bfloat16])


@needs_triton
def test_gemv_leading_dims_and_strided_rows() -> None:
    x, w, _ = _inputs(4, 24, 96, torch.float32, bias=False)
    x3 = x.view(2, 2, 96)  # [2, 2, K]: leading dims flatten to rows
    y = gemv.gemv_triton(x3, w)
    assert y.shape == (2, 2, 24)
    torch.testing.assert_close(y, F.linear(x3, w), **TOL[torch.float32])
    wide = torch.randn(3, 200, device=DEVICE)[:, :96]  # rows strided, last dim contiguous
    torch.testing.assert_close(gemv.gemv_triton(wide, w), F.linear(wide, w), **TOL[torch.float32])


def test_gemv_rejects_too_many_rows() -> None:
    x, w, _ = _inputs(gemv.MAX_ROWS + 1, 8, 16, torch.float32, bias=False)
    with pytest.raises(ValueError):
        gemv.gemv_triton(x, w)


def test_gemv_config_is_shape_only() -> None:
    for m in range(1, gemv.MAX_ROWS + 1):
        for n, k in ((6144, 4096), (4096, 14336), (128256, 4096), (37, 200)):
            cfg = gemv.gemv_config(m, n, k)
            assert cfg == gemv.gemv_config(m, n, k)
            assert cfg.block_n & (cfg.block_n - 1) == 0 and cfg.block_k & (cfg.block_k - 1) == 0


@pytest.mark.parametrize("mode", ["auto", "reference", "triton"])
@pytest.mark.parametrize("m,dtype", [(1, torch.bfloat16), (4, torch.bfloat16),
                                     (5, torch.bfloat16), (2, torch.float32)])
def test_kernel_set_linear(mode: str, m: int, dtype: torch.dtype,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    if mode == "triton" and not TRITON_HERE:
        pytest.skip(NO_TRITON)
    calls: list[int] = []
    real = gemv.gemv_triton
    monkeypatch.setattr(gemv, "gemv_triton", lambda *a: calls.append(1) or real(*a))
    x, w, b = _inputs(m, 40, 72, dtype, bias=True)
    y = dispatch.resolve_kernels(mode, DEVICE, dtype).linear(x, w, b)
    torch.testing.assert_close(y.float(), _expected(x, w, b), **TOL[dtype])
    triton_set = mode == "triton" or (mode == "auto" and DEVICE.type == "cuda")
    # The Triton set's linear is the GEMV for one 16-bit row only; cuBLAS/F.linear otherwise.
    assert bool(calls) == (triton_set and m == 1 and dtype == torch.bfloat16)
    if DEVICE.type == "cpu" and mode != "triton":
        assert torch.equal(y, F.linear(x, w, b))  # the CPU path is F.linear, bit for bit


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (128256, 4096)])
def test_gpu_gemv_llama8b_shapes(m: int, n: int, k: int) -> None:
    x, w, _ = _inputs(m, n, k, torch.bfloat16, bias=False)
    torch.testing.assert_close(gemv.gemv_triton(x, w).float(), _expected(x, w, None),
                               **TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_gemv_in_cuda_graph() -> None:
    x, w, b = _inputs(2, 4096, 4096, torch.bfloat16, bias=True)
    static_x = x.clone()
    gemv.gemv_triton(static_x, w, b)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.gemv_triton(static_x, w, b)
    x2, _, _ = _inputs(2, 4096, 4096, torch.bfloat16, bias=False, seed=7)
    static_x.copy_(x2)
    graph.replay()
    torch.testing.assert_close(out.float(), _expected(x2, w, b), **TOL[torch.bfloat16])


@skip_unless_rerun_needed(TRITON_HERE)
def test_gemv_in_subprocess() -> None:
    """Triton was imported before this module could ask for its interpreter: rerun here."""
    rerun_interpreted(__file__)
