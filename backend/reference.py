"""transformers' own model on the engine's weights: the reference for tests and benchmarks.

Greedy outputs of the engine must match this model token for token (float32, CPU), so both
have to read the very same tensors: the dequantized GGUF cache written by the model loader.
"""

from __future__ import annotations

from typing import Any

import torch


def unfused(tensors: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Our checkpoints fuse q/k/v and gate/up projections; transformers wants them apart."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            base, kind = name.rsplit(".qkv_proj.", 1)
            for part, piece in zip(("q", "k", "v"), t.split([q, kv, kv])):
                out[f"{base}.{part}_proj.{kind}"] = piece
        elif name.endswith("gate_up_proj.weight"):
            base = name[: -len("gate_up_proj.weight")]
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = t.chunk(2)
        else:
            out[name] = t
    return out


def load_reference_model(model: str | None = None, dtype: torch.dtype = torch.float32) -> Any:
    """A transformers causal LM holding exactly the weights `sgl.Engine(model)` serves.

    Supports the GGUF path (the default model): the loader's dequantized cache is read back.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from sgl.backend.model_loader import gguf_cache_folder, load_model, resolve_model_path

    path = resolve_model_path(model)
    if path.suffix != ".gguf":
        return AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).eval()
    folder = gguf_cache_folder(path)
    if not (folder / "model.safetensors").exists():  # the engine never loaded it: do it once
        load_model(model, device=torch.device("cpu"), dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder)
    ref = AutoModelForCausalLM.from_config(config, torch_dtype=dtype).eval()
    tensors = unfused(load_file(folder / "model.safetensors"), config)
    missing, unexpected = ref.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"reference weights do not fit: missing={missing} unexpected={unexpected}")
    ref.tie_weights()
    return ref.to(dtype)
