"""Put a GGUF file's quantized tensors into a built model, as a transform after construction.

    floats = install_quantized(model, tensors)    # then model.load_weights(floats.items())

Each Linear (or fused q|k|v, gate|up MergedLinear) whose every shard is quantized gets one
`QuantizedWeight` (`layer.qweight`; its float `weight` parameter is dropped before any memory
was written into it). The token embedding is quantized in place too, and when the head is
tied it is the same object, so the table exists once. Everything else (norms, biases, layers
with a float shard) is returned as float tensors under HF names for `load_weights`.
"""

from __future__ import annotations

import torch
from torch import nn

from sgl.backend.layers.linear import Embedding, Linear, MergedLinear
from sgl.backend.models.llama import _FUSED as FUSED  # HF projection -> (fused module, shard)
from sgl.backend.quant.gguf_weights import GGUFTensor, to_quantized
from sgl.backend.quant.weight import QuantizedWeight

__all__ = ["install_quantized", "weight_bytes"]


def _target(name: str) -> tuple[str, str]:
    """HF weight name -> (our module path, shard name or "")."""
    prefix = name.rpartition(".")[0]
    parent, _, proj = prefix.rpartition(".")
    if proj in FUSED:
        fused, shard = FUSED[proj]
        return f"{parent}.{fused}", shard
    return prefix, ""


def install_quantized(model: nn.Module, tensors: dict[str, GGUFTensor]) -> dict[str, torch.Tensor]:
    modules = dict(model.named_modules())
    groups: dict[str, dict[str, GGUFTensor]] = {}
    floats: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t.quantized and name.endswith(".weight"):
            path, shard = _target(name)
            if isinstance(modules.get(path), (Linear, Embedding)):
                groups.setdefault(path, {})[shard] = t
                continue
        floats[name] = _as_float(t)
    for path, parts in groups.items():
        module = modules[path]
        order = list(module.shard_slices) if isinstance(module, MergedLinear) else [""]
        if set(parts) != set(order):  # a float shard: the whole layer stays float
            floats.update((t.name, _as_float(t)) for t in parts.values())
            continue
        qweight = QuantizedWeight.cat([to_quantized(parts[s]) for s in order])
        expected = tuple(module.weight.shape) if module.weight is not None else None
        if expected is not None and qweight.shape != expected:
            raise ValueError(f"{path}: GGUF weight of shape {qweight.shape}, model expects "
                             f"{expected}")
        module.weight = None  # never written: its pages were never touched
        module.qweight = qweight
    return floats


def _as_float(t: GGUFTensor) -> torch.Tensor:
    return to_quantized(t).dequantize() if t.quantized else t.raw


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held: float parameters plus quantized tables (a tied
    table counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # (yields a shared parameter once)
        total += p.numel() * p.element_size()
    for module in model.modules():
        qweight = getattr(module, "qweight", None)
        if isinstance(qweight, QuantizedWeight) and id(qweight) not in seen:
            seen.add(id(qweight))
            total += qweight.nbytes
        packed = getattr(module, "packed_projection", None)
        if isinstance(packed, torch.Tensor) and id(packed) not in seen:
            seen.add(id(packed))
            total += packed.numel() * packed.element_size()
    return total
