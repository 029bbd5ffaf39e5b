"""HF `architectures` / `model_type` -> our model class, imported only when chosen."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from sgl.errors import ModelLoadError

# architecture name -> (module under sgl.backend.models, class name)
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}
# GGUF-derived configs carry a model_type but no `architectures` list.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve_architecture(hf_config: Any) -> str:
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in _ARCHITECTURES:
            return arch
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ModelLoadError(
        f"unsupported model (architectures={getattr(hf_config, 'architectures', None)}, "
        f"model_type={model_type!r}); supported architectures: {supported_architectures()}"
    )


def get_model_class(architecture: str) -> type[nn.Module]:
    module_name, class_name = _ARCHITECTURES[architecture]
    module = importlib.import_module(f"sgl.backend.models.{module_name}")
    return getattr(module, class_name)
