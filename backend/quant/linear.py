"""The linear op on a quantized weight: one dispatcher, a reference, the kernels per device.

    quant_linear(x [..., K], w, bias [N] | None) -> [..., N]      (x's dtype)
    quant_linear_reference(...)                                  same signature

`w` is a `QuantizedWeight` (GGUF formats) or an `Fp8Weight` (quant/fp8.py, which has its own
`fp8_linear` with the same row rule).

CPU, a weight with `int8_activations` (the engine's `activation_quantization="int8"`): up to
`INT8_MAX_ROWS` rows run the integer-activation kernel (cpu_int8.c); more rows, and every
product of a weight without the mark, keep float activations:
decode steps and short prefills (up to `GEMV_MAX_ROWS` rows) run the C kernel straight on
the codes, converted once per tile of four rows. Larger products dequantize the weight into
float32 and multiply it with BLAS. A
weight over `TILE_BYTES` as float32 is done a tile of output features at a time, so the
scratch stays bounded (SmolLM2's tied 49k-row head is 113 MB as float32, which a 32-request
decode step would otherwise allocate and fill every step).

CUDA (Triton): `CUDA_ROUTES` maps the number of rows, which is static inside a CUDA graph
(the choice is fixed at capture, no host sync), and the weight's kind to a path:
    "gemv"      triton_gemv / triton_fp8: dequantize in registers, every code byte read once
                (one program grid row per row of x)
    "gemm"      triton_gemm / triton_fp8: tiled, dequantize a weight tile, tensor-core dots
    "scratch"   dequantize slices of the weight to x's dtype, then cuBLAS (prefill)
GGUF codes (4-bit, 8-bit in groups of 16 or 32) against 1-8 bf16 rows take the CUDA
tensor-core GEMV before the table (cuda_gemv: one pass over the weight for all the rows)
where it compiles and passes its self-check (`CUDA_GEMV`).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F

from sgl.backend.kernels import onednn_linear
from sgl.backend.kernels.dispatch import has_triton
from sgl.backend.quant import cpu_kernel, cuda_gemv
from sgl.backend.quant.cpu_int8 import int8_linear
from sgl.backend.quant.fp8 import Fp8Weight, fp8_linear
from sgl.backend.quant.weight import QuantizedWeight, mark_weights

__all__ = ["CUDA_GEMV", "CUDA_ROUTES", "GEMV_MAX_ROWS", "INT8_MAX_ROWS", "SCRATCH_ELEMENTS",
           "TILE_BYTES", "cuda_route", "dense_via_scratch", "keep_rows_invariant",
           "prepare_cuda_kernels", "quant_linear", "quant_linear_reference", "use_triton",
           "weight_kind"]

log = logging.getLogger(__name__)

# CPU: products of up to this many rows run the C kernel on the codes, larger ones dequantize
# and multiply through oneDNN (`_dense`). One prompt's prefill on the 2-core AVX-512 VM
# (bench/cpu_prefill_route.py, default model, interleaved, medians of 5), C kernel / dequantize
# + oneDNN: 0.98 at 48 tokens, 1.12 at 64, 1.36 at 128, 1.53 at 200. The limit stays at the
# one-call decode step's 64 rows (cpu_layer.MAX_ROWS) all the same: a decode step the one-call
# step does not serve runs this op path, and its rows must have the bits the C kernel gives
# them there, whatever the batch (verify rows and jumped tokens equal plain decoding). (Before
# `_dense`, with F.linear's sgemm, the crossover was at ~200 rows and this limit 192.)
GEMV_MAX_ROWS = 64
# CPU, int8 activations: products of up to this many rows run the integer kernel; larger ones
# (prefill chunks) take the float path below (dequantize + BLAS), exact, which measured faster
# there on the 2-core AVX2 VM (docs/benchmarks.md: the int8 kernel 1.4x the float kernel at
# 16 rows, 1.1x BLAS at 64, 0.9x at 128, 0.74x at 512).
INT8_MAX_ROWS = 64
# Float32 bytes of one dequantized tile of the weight on that path: a weight up to this size
# is dequantized whole (every layer of a small model), a larger one (an LM head) in tiles of
# this size. Few tiles per call: each costs two parallel regions, which stall when another
# process holds a core.
TILE_BYTES = 16 << 20
# CUDA: per weight kind ("q4": 4-bit codes, "q8": 8-bit codes, "fp8"), (largest rows, path)
# in increasing rows; rows past the last entry take the scratch path. Set from
# bench/quant_gemv_bench.py, which prints this table from its measurements (session 6 on the
# H200, `--budget 400`: the tiled kernel beats scratch + cuBLAS up to 16-64 rows; from 256 rows
# scratch wins, and both stay ~2x bf16's time). 4-bit codes up to 128 rows since session 18:
# the joined tiles (triton_gemm, `GemmConfig.join`) took an 8B step at 128 rows to 11.4 ms
# against scratch's 12.1 (bench/tiled_split_sweep.py). tests/test_quant_gpu.py checks the
# tiled kernel at 1..40 rows on the real model's weights (session 5 saw wrong tokens on a
# 37-row prefill through an earlier version of it).
CUDA_ROUTES: dict[str, tuple[tuple[int, str], ...]] = {
    "q4": ((2, "gemv"), (128, "gemm")),
    "q8": ((2, "gemv"), (16, "gemm")),
    "fp8": ((1, "gemv"), (64, "gemm")),
}
# CUDA: whether GGUF-code products of 1..cuda_gemv.MAX_ROWS bf16 rows take cuda_gemv's
# tensor-core GEMV (compiled with NVRTC at first use; where that fails, CUDA_ROUTES' Triton
# kernels serve). On the H200 (bench/cuda_gemv_sweep.py, session 20) it took an 8B step's
# 4-bit products at 1, 2, 4 and 8 rows to 0.83, 0.52, 0.51 and 0.74 of the Triton route's.
CUDA_GEMV = True
# Largest dequantized scratch, in weight elements (128 MB in bf16): bigger weights (the 8B
# LM head is 525M) are dequantized and multiplied in row slices.
SCRATCH_ELEMENTS = 64 << 20


def prepare_cuda_kernels(model: torch.nn.Module, device: torch.device,
                         dtype: torch.dtype) -> int:
    """Compile, in parallel, the CUDA GEMV variants that `model`'s quantized weights will
    launch (the engine calls this before capturing its CUDA graphs, whose warm-up would
    compile them one at a time). Returns how many; 0 where the CUDA GEMV does not serve
    (another device or dtype, `CUDA_GEMV` off, no NVRTC: then available() says so and the
    Triton kernels serve)."""
    if not (CUDA_GEMV and device.type == "cuda" and dtype == torch.bfloat16
            and hasattr(torch.cuda, "_compile_kernel")):
        return 0
    from sgl.backend.layers.linear import Linear  # (which imports this module)

    # the projections and the head; an untied embedding table is only looked up
    multiplied = [m for m in model.modules() if isinstance(m, Linear)]
    multiplied.append(getattr(model, "lm_head", None))
    weights = {id(w): w for m in multiplied
               if isinstance(w := getattr(m, "qweight", None), QuantizedWeight)}
    if not weights:
        return 0
    try:
        return cuda_gemv.prepare(weights.values(), device)
    except Exception as exc:  # (NVRTC missing or failing: the self-check will tell)
        log.info("compiling the CUDA GEMV ahead failed (%s: %s)", type(exc).__name__, exc)
        return 0


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernels serve this product (CUDA tensors, triton installed)."""
    return x.device.type == "cuda" and has_triton()  # (imports triton: CUDA only)


def quant_linear_reference(x: torch.Tensor, w: QuantizedWeight | Fp8Weight,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w.dequantize(dtype=x.dtype), bias)


def quant_linear(x: torch.Tensor, w: QuantizedWeight | Fp8Weight,
                 bias: torch.Tensor | None = None, *, threads: int | None = None) -> torch.Tensor:
    """`threads`: of the CPU's C kernel where it serves (torch's count by default)."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w, bias)
    if (w.int8_activations and x.dtype == torch.float32 and x.device.type == "cpu"
            and x.numel() <= INT8_MAX_ROWS * x.shape[-1] and cpu_kernel.available()):
        return _int8_linear(x, w, bias, threads)
    on_codes = x.dim() == 2 and (x.shape[0] <= GEMV_MAX_ROWS or w.row_invariant)
    if (on_codes and x.dtype == torch.float32 and not x.is_cuda and x.is_contiguous()
            and bias is None and cpu_kernel.available()):
        return cpu_kernel.qlinear(x, w, None, threads)  # a decode step's: nothing to convert
    if use_triton(x):
        return _quant_linear_triton(x, w, bias)
    if x.device.type != "cpu" or not cpu_kernel.available():
        return quant_linear_reference(x, w, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)  # [M, K]
    if x2.shape[0] > GEMV_MAX_ROWS and not w.row_invariant:
        y = _tiled_linear(x2.float(), w, None if bias is None else bias.float())
    else:
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        b = None if bias is None else bias.float().contiguous()
        y = cpu_kernel.qlinear(x2, w, b, threads)
    return y.to(x.dtype).view(*lead, w.out_features)


def keep_rows_invariant(model: torch.nn.Module) -> int:
    """Mark every GGUF-quantized weight of `model` `row_invariant` (CPU: the C kernel at every
    row count); returns how many. The engine's `enable_deterministic_inference` on the CPU."""
    return mark_weights(model, row_invariant=True)


def _int8_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None,
                 threads: int | None) -> torch.Tensor:  # [..., K] -> [..., N]
    """Up to INT8_MAX_ROWS rows on the integer-activation kernel (cpu_int8.c)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features).contiguous()  # [M, K]
    b = None if bias is None else bias.float().contiguous()
    return int8_linear(x2, w, b, threads).view(*lead, w.out_features)


def _tiled_linear(x: torch.Tensor, w: QuantizedWeight,
                  bias: torch.Tensor | None) -> torch.Tensor:  # [M, K] -> [M, N]
    tile = max(64, TILE_BYTES // (4 * w.in_features))  # output features per tile
    if tile >= w.out_features:
        return _dense(x, cpu_kernel.dequantize(w), bias)
    y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    for start in range(0, w.out_features, tile):
        rows = slice(start, min(start + tile, w.out_features))
        y[:, rows] = _dense(x, cpu_kernel.dequantize(w, rows), None)  # [M, tile]
    if bias is not None:
        y += bias
    return y


def _dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias), float32 on the CPU: through oneDNN where torch has
    it (2.1-2.3x MKL's sgemm at 512 rows: onednn_linear.plain_linear), else F.linear."""
    if not onednn_linear.available(x.device, x.dtype):
        return F.linear(x, weight, bias)
    return onednn_linear.plain_linear(x.contiguous(), weight, bias)  # (rows padded there)


def weight_kind(w: QuantizedWeight | Fp8Weight) -> str:
    """The CUDA_ROUTES key of a weight."""
    if isinstance(w, Fp8Weight):
        return "fp8"
    return "q4" if w.bits == 4 else "q8"


def cuda_route(rows: int, kind: str) -> str:
    """"gemv", "gemm" or "scratch" for a product of `rows` rows on a `kind` weight."""
    return next((path for limit, path in CUDA_ROUTES[kind] if rows <= limit), "scratch")


def _quant_linear_triton(x: torch.Tensor, w: QuantizedWeight,
                         bias: torch.Tensor | None) -> torch.Tensor:
    from sgl.backend.quant.triton_gemm import qdequant, qgemm
    from sgl.backend.quant.triton_gemv import qgemv

    if CUDA_GEMV and cuda_gemv.supports(x, w) and cuda_gemv.available(x.device):
        return cuda_gemv.mma_gemv(x, w, bias)
    path = cuda_route(x.numel() // x.shape[-1] if x.shape[-1] else 0, weight_kind(w))
    if path == "gemv":
        return qgemv(x, w, bias)
    if path == "gemm":
        return qgemm(x, w, bias)
    return dense_via_scratch(x, w.out_features, w.in_features, bias,
                             lambda rows_: qdequant(w, x.dtype, rows_))


def dense_via_scratch(x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None,
                      dequantize: Callable[[slice], torch.Tensor]) -> torch.Tensor:
    """F.linear(x, W, bias) with W [n, k] produced slice by slice by `dequantize(rows)` (at
    most SCRATCH_ELEMENTS weights alive at once)."""
    step = max(1, SCRATCH_ELEMENTS // max(1, k))
    if step >= n:
        return F.linear(x, dequantize(slice(0, n)), bias)
    parts = [F.linear(x, dequantize(slice(s, s + step)),
                      None if bias is None else bias[s:s + step]) for s in range(0, n, step)]
    return torch.cat(parts, dim=-1)  # [..., N]
