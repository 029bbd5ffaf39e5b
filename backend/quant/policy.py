"""What `quantization` (the engine option) means for one engine: resolved with the device
before anything loads (runtime.resolve_device), and the checks of the combinations that
cannot work, so they fail with an InvalidConfigError instead of a surprise."""

from __future__ import annotations

from sgl.config import EngineConfig
from sgl.errors import InvalidConfigError

__all__ = ["check_activation_quantization", "require_gguf_model", "resolve_quantization"]


def resolve_quantization(config: EngineConfig, device: str) -> str:
    """"auto": a GGUF stays quantized on the CPU when no dtype was asked for (the C kernels
    beat float32 there, docs/benchmarks.md); float weights on the GPU, where the quantized
    Triton kernels are an opt-in (`quantization="gguf"` or "fp8") until the device figures
    show them no slower than bf16 at batch (docs/architecture.md), and for dummy models,
    whose random weights are float unless quantization is asked for."""
    quantization = config.quantization
    dummy = _is_dummy(config)
    if quantization == "auto":
        return "gguf" if device == "cpu" and config.dtype == "auto" and not dummy else "none"
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


def check_activation_quantization(config: EngineConfig) -> None:
    """`activation_quantization="int8"` on a config whose device and quantization are resolved
    (runtime.resolve_device, resolve_model_source): it needs the CPU, float32 and GGUF weights
    kept quantized, i.e. a .gguf file or a dummy model with quantization="gguf". Raised before
    anything loads, rather than silently running the float path."""
    if config.activation_quantization != "int8":
        return
    why = None
    if config.device != "cpu":
        why = f"it is a CPU kernel and the device is {config.device!r}: use device='cpu'"
    elif config.dtype != "float32":
        why = f"it needs float32 activations (dtype={config.dtype!r})"
    elif config.quantization != "gguf":
        why = (f"the weights are not kept quantized (quantization resolves to "
               f"{config.quantization!r}): use a .gguf model with quantization='gguf' or 'auto'")
    elif not _is_dummy(config):
        from sgl.backend.model_loader import resolve_model_path

        path = resolve_model_path(config.model, config.cache_dir)
        if path.suffix != ".gguf":
            why = f"model {config.model!r} is a model folder (float weights): use a .gguf file"
    if why is not None:
        raise InvalidConfigError(f"activation_quantization='int8': {why}, or "
                                 "activation_quantization='none'")
