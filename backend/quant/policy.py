"""What `quantization` (the engine option) means for one engine: resolved with the device
before anything loads (runtime.resolve_device), and the checks of the combinations that
cannot work, so they fail with an InvalidConfigError instead of a surprise."""

from __future__ import annotations

import logging

import torch

from sgl.config import EngineConfig
from sgl.errors import InvalidConfigError

__all__ = ["check_activation_quantization", "check_deterministic", "check_fp8_device",
           "require_float8_gpu", "require_gguf_model", "resolve_activation_quantization",
           "resolve_quantization"]

logger = logging.getLogger("sgl.engine")


def check_fp8_device(quantization: str, device: torch.device) -> None:
    """FP8 weights on CUDA run Triton kernels over e4m3 (Triton's fp8e4nv, compiled for compute
    capability 8.9 and later only) and, W8A8, `torch._scaled_mm` on the FP8 tensor cores
    (8.9 and later too): an older GPU is refused before the load, not at the first product."""
    if quantization != "fp8" or device.type != "cuda":
        return
    require_float8_gpu(device, "quantization='fp8'",
                       "Ada, Hopper: e4m3 in the kernels and FP8 tensor cores",
                       "use quantization='none' for float weights, or 'gguf' with a GGUF file")


def require_float8_gpu(device: torch.device, what: str, why: str, instead: str) -> None:
    """InvalidConfigError unless `device` (CUDA) has compute capability 8.9 or later, where
    Triton compiles float8 e4m3 (fp8e4nv) and the FP8 tensor cores exist."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise InvalidConfigError(f"{what} needs a GPU of compute capability 8.9 or later "
                                 f"({why}), this one is {major}.{minor}: {instead}")


def resolve_activation_quantization(asked: str, quantization: str) -> str:
    """`activation_quantization` for a resolved `quantization`: "auto" is W8A8 ("fp8") under
    FP8 weights, as SGLang's `fp8` computes (quant/fp8.py), and float activations otherwise."""
    if asked != "auto":
        return asked
    return "fp8" if quantization == "fp8" else "none"


def resolve_quantization(config: EngineConfig, device: str) -> str:
    """"auto": a GGUF stays quantized on the CPU when no dtype was asked for and the C kernels
    run here (they beat float32 there, docs/benchmarks.md); float weights on the GPU, where the
    quantized Triton kernels are an opt-in (`quantization="gguf"` or "fp8") until the device
    figures show them no slower than bf16 at batch (docs/architecture.md), and for dummy
    models, whose random weights are float unless quantization is asked for.

    Where the C kernels cannot run (no C compiler, an x86 CPU without AVX2, a CPU that is
    neither x86-64 nor 64-bit ARM), the quantized layers would dequantize every weight on
    every product (the default model: 3.5 tok/s against 23 for float32 weights,
    docs/operations.md), so "auto" loads float weights there, and an explicit "gguf" is kept
    but warned about."""
    resolved = _resolve(config, device)
    _check_int8(config, device, resolved)
    return resolved


def _resolve(config: EngineConfig, device: str) -> str:
    quantization = config.quantization
    dummy = _is_dummy(config)
    if quantization == "auto":
        if device != "cpu" or config.dtype != "auto" or dummy:
            return "none"
        return "gguf" if _cpu_kernels_serve(quantization) else "none"
    if quantization == "gguf" and device == "cpu" and not dummy:
        _cpu_kernels_serve(quantization)
    if quantization == "fp8" and not device.startswith("cuda"):
        raise InvalidConfigError(
            f"quantization='fp8' needs a CUDA device (device={device!r}): sgl has no FP8 "
            "kernel for the CPU; use quantization='gguf' with a GGUF file for quantized "
            "weights there, or 'none' for float weights")
    if quantization == "gguf" and config.load_format == "safetensors":
        raise InvalidConfigError(
            "quantization='gguf' keeps a GGUF file's quantized tensors, but load_format="
            "'safetensors' loads float weights: use a .gguf model, or quantization='fp8' "
            "(GPU) or 'none'")
    return quantization


def _cpu_kernels_serve(quantization: str) -> bool:
    """Whether the CPU's C kernels run here (loading or building them now); where they do not,
    a warning says why and what `quantization` then costs."""
    from sgl.backend.quant import cpu_kernel

    why = cpu_kernel.unavailable_reason()
    if why is None:
        return True
    if quantization == "auto":
        logger.warning("sgl: the quantized CPU kernels cannot run here (%s); loading the GGUF's "
                       "weights as float32 instead (quantization='none': about 4x the "
                       "weights' memory, and several times faster than quantized products "
                       "without the kernels)", why)
    else:
        logger.warning("sgl: quantization='gguf' without the quantized CPU kernels (%s): every "
                       "product dequantizes its whole weight first, several times slower than "
                       "float weights (quantization='auto' or 'none')", why)
    return False


def _is_dummy(config: EngineConfig) -> bool:
    """Random weights: the load_format, or a preset name / a bare model_config under "auto"."""
    from sgl.backend.model_loader import PRESETS

    return config.load_format == "dummy" or (config.load_format == "auto" and (
        config.model in PRESETS or (config.model is None and bool(config.model_config))))


def require_gguf_model(config: EngineConfig) -> None:
    """An explicit quantization="gguf" needs a GGUF file (or a dummy model): a model folder
    holds float weights, and loading it as float would silently ignore the request."""
    from sgl.backend.model_loader import resolve_model_path

    if _is_dummy(config):
        return
    path = resolve_model_path(config.model, config.cache_dir)
    if path.suffix != ".gguf":
        raise InvalidConfigError(
            f"quantization='gguf' keeps a GGUF file's quantized tensors, but model "
            f"{config.model!r} is a model folder (float weights): use a .gguf file, or "
            "quantization='fp8' (GPU) or 'none'")


def _refuse_int8(why: str) -> None:
    raise InvalidConfigError(f"activation_quantization='int8': {why}, or "
                             "activation_quantization='none'")


def _check_int8(config: EngineConfig, device: str, quantization: str) -> None:
    """`activation_quantization="int8"` needs the CPU, float32 activations and weights kept
    quantized; checked on the resolved device and quantization ("auto" may resolve to the
    GPU or to float weights), before anything loads, rather than silently running floats."""
    if config.activation_quantization != "int8":
        return
    if device != "cpu":
        _refuse_int8(f"it is a CPU kernel and the device resolves to {device!r}: use "
                     "device='cpu'")
    from sgl.backend.quant import cpu_kernel

    why = cpu_kernel.unavailable_reason()
    if why is not None:
        _refuse_int8(f"it runs on the quantized CPU kernels, which cannot run here ({why})")
    if config.dtype not in ("auto", "float32"):
        _refuse_int8(f"it needs float32 activations (dtype={config.dtype!r})")
    if quantization != "gguf":
        _refuse_int8(f"the weights are not kept quantized (quantization resolves to "
                     f"{quantization!r}): use a .gguf model with quantization='gguf' or 'auto'")


def check_activation_quantization(config: EngineConfig) -> None:
    """The part of the int8 check that needs the model's path (hub ids resolved): a model
    folder holds float weights, which "auto" would load unquantized."""
    if config.activation_quantization != "int8" or _is_dummy(config):
        return
    from sgl.backend.model_loader import resolve_model_path

    path = resolve_model_path(config.model, config.cache_dir)
    if path.suffix != ".gguf":
        _refuse_int8(f"model {config.model!r} is a model folder (float weights): use a .gguf "
                     "file")


def check_deterministic(config: EngineConfig) -> None:
    """`enable_deterministic_inference` on a resolved config (device, dtype, quantization):
    refused, before anything loads, where no row-invariant kernels serve the combination.

    CUDA: the batch-invariant Triton linear is for float weights; quantized products route by
    row count (GEMV, tiled, dequantize + cuBLAS), the torch attention and the reference kernels
    run cuBLAS and SDPA, and without triton there are only those. CPU: the row-invariant kernels are the C kernels on GGUF codes
    with float32 activations and the C attention ("auto" kernels); float weights multiply
    through oneDNN, whose bits follow the row count."""
    if not config.enable_deterministic_inference:
        return

    def refuse(why: str) -> None:
        raise InvalidConfigError(f"enable_deterministic_inference on {config.device}: {why}")

    if config.kernels == "reference":
        refuse("kernels='reference' has no batch-invariant kernels; use kernels='auto'")
    if config.is_cuda:
        if config.quantization != "none":
            refuse(f"quantization={config.quantization!r} routes each product by its row "
                   "count; use float weights (quantization='none')")
        if config.attention_backend == "torch":
            refuse("attention_backend='torch' is not batch-invariant; use 'auto' or 'triton'")
        from sgl.backend.kernels.dispatch import has_triton  # (imports triton: CUDA only)

        if not has_triton():
            refuse("its batch-invariant linear and attention are Triton kernels; install triton")
        return
    if config.quantization != "gguf" or config.dtype != "float32":
        refuse(f"the CPU's row-invariant kernels run GGUF-quantized weights with float32 "
               f"activations (quantization resolves to {config.quantization!r}, dtype to "
               f"{config.dtype!r}): use a .gguf model with quantization and dtype 'auto'")
    if config.activation_quantization != "none":
        refuse(f"activation_quantization={config.activation_quantization!r} runs its integer "
               "kernel up to 64 rows only; use activation_quantization='none'")
