"""Quantized weights put into a built model, as transforms after construction.

    floats = install_quantized(model, tensors, device)   # then model.load_weights(floats)
    install_fp8(model)                  # every Linear's float weight -> Fp8Weight (in place)
    install_random_quantized(model, seed)   # dummy models: random 4-bit weights (benchmarks)
    quantize_after_load(model, quantization, device)   # the loader's entry to the two above

Each Linear (or fused q|k|v, gate|up MergedLinear) whose every shard is quantized gets one
`QuantizedWeight` (`layer.qweight`; its float `weight` parameter is dropped before any memory
was written into it). The token embedding is quantized in place too, and when the head is
tied it is the same object, so the table exists once. Everything else (norms, biases, layers
with a float shard) is returned as float tensors under HF names for `load_weights`. With a
`device` (the GPU path) each QuantizedWeight moves there as soon as it is built, so host
memory holds one layer's codes at a time. Once a layer's tensors are copied out of the
memory-mapped file their pages go back to the OS (`GGUFTensor.drop`), so the file is not
resident beside the weights built from it.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from sgl.backend.layers.linear import Embedding, Linear, MergedLinear
from sgl.backend.models.llama import _FUSED as FUSED  # HF projection -> (fused module, shard)
from sgl.backend.quant.factored import factor
from sgl.backend.quant.fp8 import Fp8Weight
from sgl.backend.quant.gguf_weights import GGUFTensor, to_quantized
from sgl.backend.quant.weight import QuantizedWeight

__all__ = ["install_fp8", "install_quantized", "install_random_quantized", "quantize_after_load",
           "weight_bytes"]


def _target(name: str) -> tuple[str, str]:
    """HF weight name -> (our module path, shard name or "")."""
    prefix = name.rpartition(".")[0]
    parent, _, proj = prefix.rpartition(".")
    if proj in FUSED:
        fused, shard = FUSED[proj]
        return f"{parent}.{fused}", shard
    return prefix, ""


def install_quantized(model: nn.Module, tensors: dict[str, GGUFTensor],
                      device: torch.device | None = None) -> dict[str, torch.Tensor]:
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
        t.drop()
    for path, parts in groups.items():
        module = modules[path]
        order = list(module.shard_slices) if isinstance(module, MergedLinear) else [""]
        if set(parts) != set(order):  # a float shard: the whole layer stays float
            floats.update((t.name, _as_float(t)) for t in parts.values())
            for t in parts.values():
                t.drop()
            continue
        qweight = QuantizedWeight.cat([to_quantized(parts[s]) for s in order])
        for t in parts.values():  # (copied out: the file's pages go back, module docstring)
            t.drop()
        # The GPU reads float32 or factored scales; the CPU keeps float16 ones where exact
        # (Q4_0, Q4_1, Q8_0: 5 bits per 4-bit weight streamed instead of 6, weight.py).
        qweight = qweight.to(device) if device is not None else qweight.half_scales()
        expected = tuple(module.weight.shape) if module.weight is not None else None
        if expected is not None and qweight.shape != expected:
            raise ValueError(f"{path}: GGUF weight of shape {qweight.shape}, model expects "
                             f"{expected}")
        module.weight = None  # never written: its pages were never touched
        module.qweight = qweight
    for t in tensors.values():  # (the pages later reads mapped back in around their own)
        t.drop()
    return floats


def _as_float(t: GGUFTensor) -> torch.Tensor:
    return to_quantized(t).dequantize() if t.quantized else t.raw


def quantize_after_load(model: nn.Module, quantization: str, device: torch.device, *,
                        dummy_seed: int | None = None) -> None:
    """A loaded float model's weights as `quantization` asks: "fp8" converts its Linears;
    "gguf" on a dummy model (`dummy_seed` given) installs random quantized weights (a real
    GGUF loads quantized from the file instead). On CUDA the replaced floats' cached blocks go
    back to the device: the runtime sizes the KV pool from free device memory."""
    if quantization == "fp8":
        install_fp8(model)
    elif quantization == "gguf" and dummy_seed is not None:
        install_random_quantized(model, dummy_seed)
    else:
        return
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.no_grad()
def install_fp8(model: nn.Module, *, head: bool = True) -> None:
    """Every Linear's float weight (the fused ones included) becomes an `Fp8Weight`, one layer
    at a time (peak: the float model plus one layer's temporaries), and so does an untied LM
    head (`head`): at one row it is the step's largest product (the 8B head is 1 GB in bf16,
    ~7% of a step), and it is a linear like the others, with the same per-channel rounding.
    The embedding table stays in the model's dtype, and with it a tied head (the same table:
    quantizing it would change the lookup too, or need a second copy)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None and module.qweight is None:
            module.qweight = Fp8Weight.quantize(module.weight)
            module.weight = None
    lm_head = getattr(model, "lm_head", None)
    if (head and isinstance(lm_head, Embedding) and not getattr(model, "tie_word_embeddings", True)
            and lm_head.weight is not None and lm_head.qweight is None):
        lm_head.qweight = Fp8Weight.quantize(lm_head.weight)
        lm_head.weight = None


# The layout install_random_quantized gives a dummy model: "q4_k" (every Linear Q4_K) or
# "q4_k_m" (also the mix of a Q4_K_M file: Q6_K for the v and down projections of about half
# the layers, so that their fused q|k|v is promoted to 8-bit codes as a real file's is).
RANDOM_LAYOUT = "q4_k"


def q4_k_m_more_bits(layer: int, layers: int) -> bool:
    """Whether a Q4_K_M file keeps layer `layer`'s v and down projections in Q6_K: the first
    and last eighth of the layers, and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


@torch.no_grad()
def install_random_quantized(model: nn.Module, seed: int) -> None:
    """Random quantized weights in the layout of a K-quant file (dummy models: benchmarks of
    the quantized kernels at a real shape, no file needed): 4-bit groups of 32 for the Linears
    (Q4_K's mapping; with RANDOM_LAYOUT "q4_k_m", 8-bit groups of 16 for the q|k|v and down
    projections of the layers a Q4_K_M file keeps in Q6_K), 8-bit groups of 16 for the
    embedding and the head (Q6_K's). Scales give weights of std ~0.02, like the float dummy
    init."""
    named = [(name, m) for name, m in model.named_modules()
             if isinstance(m, (Linear, Embedding)) and m.weight is not None]
    layer_of = {name: int(found.group(1)) for name, _ in named
                if (found := re.search(r"layers\.(\d+)\.", name))}
    layers = max(layer_of.values(), default=-1) + 1
    for i, (name, module) in enumerate(named):
        assert module.weight is not None
        n, k = module.weight.shape
        wide = not isinstance(module, Linear) or (
            RANDOM_LAYOUT == "q4_k_m" and name.endswith(("qkv_proj", "down_proj"))
            and q4_k_m_more_bits(layer_of.get(name, 0), layers))
        bits, group = (8, 16) if wide else (4, 32)
        module.qweight = _random_qweight(n, k, bits, group, module.weight.device, seed + i)
        module.weight = None


def _random_qweight(n: int, k: int, bits: int, group: int, device: torch.device,
                    seed: int) -> QuantizedWeight:
    gen = torch.Generator(device=device).manual_seed(seed)
    if bits == 4:  # codes 0..15 around 8: std of the codes ~4.6
        codes = torch.randint(0, 256, (n, k // 2), generator=gen, device=device,
                              dtype=torch.int32).to(torch.uint8)
        scale = torch.full((n, k // group), 0.02 / 4.6, device=device)
        zero = -8.0 * scale
    else:  # Q6_K's range -32..31: std ~18.5
        codes = torch.randint(-32, 32, (n, k), generator=gen, device=device,
                              dtype=torch.int32).to(torch.int8)
        scale = torch.full((n, k // group), 0.02 / 18.5, device=device)
        zero = torch.zeros_like(scale)
    source = "Q4_K" if bits == 4 else "Q6_K"
    w = QuantizedWeight(codes, scale, zero, bits, group, k, f"random {source}")
    return factor(w) if device.type == "cuda" else w  # the GPU form of a K-quant file


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held: float parameters plus quantized tables (a tied
    table counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # (yields a shared parameter once)
        total += p.numel() * p.element_size()
    for module in model.modules():
        qweight = getattr(module, "qweight", None)
        if isinstance(qweight, (QuantizedWeight, Fp8Weight)) and id(qweight) not in seen:
            seen.add(id(qweight))
            total += qweight.nbytes
        packed = getattr(module, "packed_projection", None)
        if isinstance(packed, torch.Tensor) and id(packed) not in seen:
            seen.add(id(packed))
            total += packed.numel() * packed.element_size()
    return total
