"""CUDA C compiled without a GPU, as a GPU would at first use: NVRTC to PTX for compute_90
(the `nvidia-cuda-nvrtc-cu12` wheel; torch's CUDA builds carry the same library), then
Triton's ptxas to sm_90 machine code and its cuobjdump to read it. Used by
tests/test_quant_cuda_gemv.py and bench/cuda_kernel_stats.py.
"""

from __future__ import annotations

import ctypes
import importlib.util
import subprocess
from pathlib import Path


def _nvrtc() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for lib in sorted(Path(folder, "lib").glob("libnvrtc.so*")):
            return ctypes.CDLL(str(lib))
    return None


def _ptxas() -> Path | None:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return path if path.exists() else None


NVRTC, PTXAS = _nvrtc(), _ptxas()


def to_ptx(source: str) -> str:
    """NVRTC: CUDA C -> PTX for compute_90, as torch.cuda._compile_kernel does on a GPU."""
    assert NVRTC is not None
    prog = ctypes.c_void_p()
    assert NVRTC.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"cuda_gemv.cu", 0,
                                    None, None) == 0
    opts = (ctypes.c_char_p * 1)(b"--gpu-architecture=compute_90")
    status = NVRTC.nvrtcCompileProgram(prog, 1, opts)
    size = ctypes.c_size_t()
    NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    NVRTC.nvrtcGetProgramLog(prog, log)
    assert status == 0, log.value.decode()
    NVRTC.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    NVRTC.nvrtcGetPTX(prog, ptx)
    NVRTC.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode()


def assemble(ptx: str, tmp: Path) -> tuple[str, Path]:
    """ptxas -arch=sm_90 -v: (the resource report, the cubin)."""
    src, cubin = tmp / "k.ptx", tmp / "k.cubin"
    src.write_text(ptx)
    proc = subprocess.run([str(PTXAS), "-arch=sm_90", "-v", "-o", str(cubin), str(src)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr, cubin


def sass(cubin: Path) -> str:
    """The cubin's machine code (cuobjdump from the triton wheel, beside its ptxas)."""
    assert PTXAS is not None
    proc = subprocess.run([str(PTXAS.with_name("cuobjdump")), "-sass", str(cubin)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout
