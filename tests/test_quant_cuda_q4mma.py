"""The CUDA tensor-core 4-bit GEMV (quant/cuda_q4mma.py) without a GPU: its source compiled as
a GPU would at first use (NVRTC to PTX for compute_90, then Triton's ptxas to sm_90 machine
code) for the variants the engine launches, with the resources checked; and the config rules
the launcher applies. Its answers against dequantize-then-matmul are checked on the device
(tests/test_quant_gpu.py: every 8B shape, odd N and K, bias, row 0 of two == one row).

    python -m pytest -q tests/test_quant_cuda_q4mma.py

NVRTC comes from the `nvidia-cuda-nvrtc-cu12` wheel (the test extra; torch's CUDA builds
carry the same library); ptxas from the triton wheel.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cuda_compile import NVRTC, PTXAS, assemble, to_ptx

from sgl.backend.quant.cuda_q4mma import (SOURCE, CudaQ4Config, Q4MMA_DEFAULTS, _defines,
                                          config_for, fitted)

needs_tools = pytest.mark.skipif(NVRTC is None or PTXAS is None,
                                 reason="NVRTC (nvidia-cuda-nvrtc-cu12) or Triton's ptxas missing")


VARIANTS = [  # (config, rows, super_groups, groups): the defaults at the 8B Ks and at
    # SmolLM2's (576 = 18 groups: a tail step), plain and factored scales
    (cfg, rows, sup, groups)
    for cfg in sorted({c for _, c in Q4MMA_DEFAULTS})
    for rows in (1, 2, 5, 8) for sup, groups in ((8, 128), (8, 448), (0, 18), (0, 25))
]


@needs_tools
@pytest.mark.parametrize("cfg,rows,sup,groups", VARIANTS)
def test_the_cuda_gemv_compiles_for_hopper_on_the_tensor_cores(
        cfg: CudaQ4Config, rows: int, sup: int, groups: int, tmp_path: Path) -> None:
    """Every launched variant compiles, multiplies with mma (bf16 in, float32 accumulate),
    unpacks with lop3, waits for the kernel before when launched early (griddepcontrol), and
    keeps its state in registers: no spills (a spill would put the two steps in flight
    through local memory, the slow path the design avoids)."""
    ptx = to_ptx(_defines(cfg, rows, sup, groups) + SOURCE)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "lop3.b32" in ptx
    assert "griddepcontrol.wait" in ptx
    report = assemble(ptx, tmp_path)[0]
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and spills.groups() == ("0", "0"), report
    regs = re.search(r"Used (\d+) registers", report)
    assert regs and int(regs.group(1)) <= 255, report


def test_fitted_keeps_the_last_program_inside_the_weight() -> None:
    """The last program starts at N - 16 tiles: a config never has more tiles than N / 16."""
    assert fitted(CudaQ4Config(4, 2, 1), 40).tiles == 2
    assert fitted(CudaQ4Config(4, 2, 1), 16).tiles == 1
    assert fitted(CudaQ4Config(2, 8, 2), 4096) == CudaQ4Config(2, 8, 2)


def test_the_defaults_table_covers_every_width() -> None:
    limits = [limit for limit, _ in Q4MMA_DEFAULTS]
    assert limits == sorted(limits) and limits[-1] >= 1 << 40
    for n in (16, 576, 4096, 128256, 1 << 30):
        cfg = config_for(n)
        assert cfg.tiles >= 1 and cfg.warps >= 1 and cfg.span in (1, 2, 4)
