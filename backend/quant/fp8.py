"""FP8 weights (`quantization="fp8"`, SGLang's name): float8_e4m3fn with one float32 scale
per output channel, converted at load from a float checkpoint. Products of fewer than
`W8A8_MIN_ROWS` rows are weight-only (activations stay in the model's dtype); larger ones
W8A8 by default (below).

    w = Fp8Weight.quantize(float_weight [N, K])      # scale[n] = amax(|W[n, :]|) / 448
    fp8_linear(x [..., K], w, bias) -> [..., N]      (x's dtype)
    fp8_linear_reference(x, w, bias)                 same signature: dequantize, then F.linear

On CUDA (quant/linear.py's CUDA_ROUTES, kind "fp8"): the FP8 GEMV, the tiled kernel or a
dequantized scratch in x's dtype and cuBLAS, by rows (kernels in triton_fp8.py). The scratch
path (past the tiled kernel's rows: prefill, large decode batches) moves three bytes per weight
for the one it holds (read e4m3, write and read the scratch), so at batch it is slower than
bf16 weights (docs/benchmarks.md).

W8A8 (`activation_quantization="fp8"`, what its "auto" resolves to under FP8 weights; marked
by `use_fp8_activations`; SGLang's `fp8` always computes so; "none" turns it off): products
of `W8A8_MIN_ROWS` rows or more quantize their input per row to e4m3 (`quantize_rows`:
scale amax times 1/448, values rounded to nearest) and multiply on the FP8 tensor cores, both
scales applied in the product's epilogue (`torch._scaled_mm`, row-wise scales). Not exact:
each input row is rounded to 3 mantissa bits. The smaller products keep unquantized inputs
(the GEMV, the tiled kernel): at a few rows a product streams its weights, and quantizing
the activations costs more than it saves. On the
CPU there is no FP8 kernel: the runtime refuses `fp8` there (runtime.py);
`fp8_scaled_linear` itself runs on either device (tests).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["FP8_MAX", "W8A8_MIN_ROWS", "Fp8Weight", "fp8_linear", "fp8_linear_reference",
           "fp8_scaled_linear", "fp8_scaled_linear_reference", "quantize_rows",
           "quantize_rows_reference", "use_fp8_activations"]

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Rows from which a marked weight's product runs W8A8. bench/scratch_slices.py and
# bench/tiled_split_sweep.py (session 17, H200), us per 8B step: at 16 rows the tiled kernel
# 3,073 against W8A8's 4,779, at 64 rows 5,158 against 4,536 (W8A8 at 128: 4,169, bf16 4,455);
# the lines cross near 50 rows.
W8A8_MIN_ROWS = 49


@dataclass(frozen=True)
class Fp8Weight:
    weight: torch.Tensor  # [N, K] float8_e4m3fn, rows contiguous
    scale: torch.Tensor  # [N] float32
    # W8A8 where the scratch path would serve (module docstring); set after loading.
    fp8_activations: bool = False

    def __post_init__(self) -> None:
        n = self.weight.shape[0]
        if (self.weight.dtype != torch.float8_e4m3fn or self.weight.dim() != 2
                or self.scale.shape != (n,) or self.scale.dtype != torch.float32
                or not self.weight.is_contiguous() or self.scale.device != self.weight.device):
            raise ValueError(f"inconsistent Fp8Weight: weight {tuple(self.weight.shape)} "
                             f"{self.weight.dtype}, scale {tuple(self.scale.shape)} "
                             f"{self.scale.dtype}")

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * 4

    @classmethod
    @torch.no_grad()
    def quantize(cls, w: torch.Tensor) -> Fp8Weight:
        """Per-output-channel scales amax/448 (a zero row gets scale 1), values rounded to
        nearest e4m3. Computed in float32 on w's device, one row block at a time so an 8B
        layer's temporaries stay small."""
        n, k = w.shape
        out = torch.empty(n, k, device=w.device, dtype=torch.float8_e4m3fn)
        scale = torch.empty(n, device=w.device, dtype=torch.float32)
        step = max(1, (64 << 20) // max(1, 4 * k))  # rows per block: ~64 MB of float32
        for start in range(0, n, step):
            rows = w[start:start + step].float()  # [r, K]
            amax = rows.abs().amax(dim=1)  # [r]
            s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
            out[start:start + step] = (rows / s[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(out.dtype)
            scale[start:start + step] = s
        return cls(out, scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] = weight * scale[:, None] (the reference every FP8 kernel is tested against)."""
        return (self.weight.float() * self.scale[:, None]).to(dtype)


def fp8_linear_reference(x: torch.Tensor, w: Fp8Weight,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w.dequantize(x.dtype), bias)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    from sgl.backend.quant.linear import use_triton

    if not use_triton(x):
        return fp8_linear_reference(x, w, bias)
    from sgl.backend.quant.linear import cuda_route, dense_via_scratch
    from sgl.backend.quant.triton_fp8 import fp8_dequant, fp8_gemm, fp8_gemv

    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if w.fp8_activations and rows >= W8A8_MIN_ROWS and scaled_mm_fits(w):
        return fp8_scaled_linear(x, w, bias)
    path = cuda_route(rows, "fp8")
    if path == "gemv":
        return fp8_gemv(x, w.weight, w.scale, bias)
    if path == "gemm":
        return fp8_gemm(x, w.weight, w.scale, bias)
    return dense_via_scratch(x, w.out_features, w.in_features, bias,
                             lambda sl: fp8_dequant(w.weight, w.scale, x.dtype, sl))


def use_fp8_activations(model: torch.nn.Module) -> int:
    """Mark every Linear's FP8 weight for W8A8 (`activation_quantization="fp8"`; the LM head,
    whose logits sampling reads, keeps unquantized inputs); returns how many."""
    import dataclasses

    from sgl.backend.layers.linear import Linear

    marked = 0
    for module in model.modules():
        w = getattr(module, "qweight", None)
        if isinstance(module, Linear) and isinstance(w, Fp8Weight):
            module.qweight = dataclasses.replace(w, fp8_activations=True)
            marked += 1
    return marked


def scaled_mm_fits(w: Fp8Weight) -> bool:
    """torch._scaled_mm's shape rule: both dimensions of the weight multiples of 16."""
    return w.in_features % 16 == 0 and w.out_features % 16 == 0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]) with x[m] ~ q[m] * scale[m]: scale
    amax(|x[m]|) times the float32 1/448 (a zero row: 1), x / scale rounded to the nearest e4m3
    value, ties to even. (Written as a product: torch on CUDA divides by a Python scalar that
    way and on the CPU it does not, so `/ 448` would give two rules.) On the GPU one Triton
    kernel (triton_fp8.fp8_quantize_rows: the torch ops cost a third of a W8A8 prefill's GEMM
    time in float32 temporaries); `quantize_rows_reference` elsewhere."""
    from sgl.backend.quant.linear import use_triton

    if use_triton(x) and x.stride(-1) == 1:
        from sgl.backend.quant.triton_fp8 import fp8_quantize_rows

        return fp8_quantize_rows(x)
    return quantize_rows_reference(x)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` as torch ops."""
    lo, hi = torch.aminmax(x, dim=1, keepdim=True)  # one pass over x, no |x| temporary
    amax = torch.maximum(-lo, hi).float()
    scale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), torch.ones_like(amax))
    q = torch.div(x, scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # (float32)
    return q, scale


def fp8_scaled_linear(x: torch.Tensor, w: Fp8Weight,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: [..., K] -> [..., N] in x's dtype: x quantized per row (`quantize_rows`) times the
    e4m3 weight, float32 accumulation, both scales applied to the product (torch._scaled_mm,
    bfloat16 out)."""
    lead = x.shape[:-1]
    q, sx = quantize_rows(x.reshape(-1, w.in_features))
    if q.device.type == "cpu" and not _cpu_rowwise_scaled_mm():
        # (the same arithmetic: e4m3 values widen exactly, their products are exact in float32)
        y = (F.linear(q.float(), w.weight.float()) * sx * w.scale.view(1, -1)).to(torch.bfloat16)
    else:
        y = torch._scaled_mm(q, w.weight.t(), scale_a=sx, scale_b=w.scale.view(1, -1),
                             out_dtype=torch.bfloat16)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).view(*lead, w.out_features)


@functools.cache
def _cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU `torch._scaled_mm` takes row-wise scales (2.13's does; 2.11's
    asserts per-tensor scales on the CPU). The engine never runs W8A8 on the CPU; tests do."""
    a = torch.ones(2, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 2),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def fp8_scaled_linear_reference(x: torch.Tensor, w: Fp8Weight,
                                bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_scaled_linear` as float32 arithmetic: the dequantized input times the dequantized
    weight (what the kernel computes, up to summation order and its bfloat16 output)."""
    q, sx = quantize_rows(x.reshape(-1, w.in_features))
    y = F.linear(q.float() * sx, w.dequantize(torch.float32),
                 None if bias is None else bias.float())
    return y.to(x.dtype).view(*x.shape[:-1], w.out_features)
