"""Read a GGUF file's tensors without dequantizing them, under our module names.

    tensors = read_gguf(path, num_heads, num_kv_heads)   # {our name: GGUFTensor}

The file is memory-mapped (gguf_file.py); each tensor is either quantized (its raw blocks,
decoded into a `QuantizedWeight` by `to_quantized`) or float (F32/F16/BF16 norms and the like).
A quantized format sgl has no kernel for (IQ1-IQ3, TQ...) is dequantized to
float32 by the `gguf` package itself, so such a file still loads, at float cost for those
tensors.

Names: llama.cpp's (`blk.3.attn_q.weight`) -> HF's (`model.layers.3.self_attn.q_proj.weight`),
which `LlamaForCausalLM.load_weights` and the fused layers already know. For the "llama"
architecture llama.cpp's converter permuted the rows of q and k (its RoPE pairs neighbouring
dims, HF pairs halves); rows are independent blocks, so undoing it is a row gather on the
quantized data, as transformers' GGUF reader does on the float data.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sgl.backend.quant import formats
from sgl.backend.quant.gguf_file import open_gguf
from sgl.backend.quant.weight import QuantizedWeight

__all__ = ["GGUFTensor", "read_gguf", "to_quantized"]

_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


@dataclass(frozen=True)
class GGUFTensor:
    name: str  # ours (HF's)
    format: str  # "Q4_1", "F32", ...
    shape: tuple[int, ...]  # torch order: [out_features, in_features]
    raw: torch.Tensor  # quantized: [N, row_bytes] uint8 (mapped); float: the values
    # hands the tensor's file pages back to the OS once what is needed of them is copied
    # (GGUFFile.drop_pages; harmless where raw is a copy, or twice)
    drop: Callable[[], None] = lambda: None

    @property
    def quantized(self) -> bool:
        return formats.supported(self.format)


def our_name(gguf_name: str) -> str | None:
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{kind}"
    match = _BLOCK.match(gguf_name)
    if match is None or match.group(2) not in _LAYER:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}.{match.group(3)}"


def read_gguf(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, GGUFTensor]:
    import gguf

    file = open_gguf(path)
    permute_qk = file.architecture == "llama"
    out: dict[str, GGUFTensor] = {}
    for t in file.tensors:
        name = our_name(t.name)
        if name is None:
            continue  # rope_freqs and the like: recomputed by our layers
        shape, fmt = t.shape, t.type_name
        drop = functools.partial(file.drop_pages, t)
        if fmt in _FLOAT_TYPES:
            raw = torch.from_numpy(np.array(t.data)).view(_FLOAT_TYPES[fmt]).reshape(shape)
            raw, fmt = raw.float(), "F32"
        elif not formats.supported(fmt):
            values = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType[fmt])
            raw, fmt = torch.from_numpy(values).reshape(shape).float(), "F32"
        else:
            # [N, row_bytes] over the read-only map: decoding only reads it (torch warns
            # about non-writable arrays; nothing writes here).
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(t.data)
        if permute_qk and (".q_proj." in name or ".k_proj." in name):
            heads = num_heads if ".q_proj." in name else num_kv_heads
            raw = raw[_unpermute_rows(shape[0], heads)]
        if fmt != t.type_name or raw.data_ptr() != t.data.ctypes.data:  # (a copy already)
            drop()  # (and again later: a neighbour's reads may map its pages back in)
        out[name] = GGUFTensor(name, fmt, shape, raw, drop)  # type: ignore[arg-type]
    return out


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: ours (h, a, b) <- its (h, b, a)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


# Weights decoded at a time: the decoders' temporaries (up to 8 bytes a weight) stay ~32 MB
# however large the tensor (an 8B model's embedding is 525M weights: whole, ~4 GB of them).
DECODE_WEIGHTS = 1 << 22


def to_quantized(t: GGUFTensor) -> QuantizedWeight:
    # Formats already in our code layout are copied, not decoded: fewer temporaries, so a
    # load leaves less freed-but-resident heap behind.
    if t.format in formats.NIBBLE_NATIVE:
        codes, scale, zero = formats.nibble_native(t.format, t.raw, t.shape[-1])
        return QuantizedWeight(codes, scale, zero, 4, 32, t.shape[-1], t.format)
    if t.format == "Q8_0":
        codes, scale, zero = formats.q8_0_native(t.raw, t.shape[-1])
        return QuantizedWeight(codes, scale, zero, 8, 32, t.shape[-1], t.format)
    k = t.shape[-1]
    step = max(1, DECODE_WEIGHTS // k)  # rows a decode takes at once
    first = QuantizedWeight.from_decoded(formats.decode(t.format, t.raw[:step], k), t.format)
    n = t.raw.shape[0]
    if n <= step:
        return first
    parts = [torch.empty((n, *p.shape[1:]), dtype=p.dtype)
             for p in (first.codes, first.scale, first.zero)]
    for start in range(0, n, step):
        rows = slice(start, min(start + step, n))
        w = first if start == 0 else QuantizedWeight.from_decoded(
            formats.decode(t.format, t.raw[rows], k), t.format)
        for part, piece in zip(parts, (w.codes, w.scale, w.zero)):
            part[rows] = piece
    return QuantizedWeight(*parts, first.bits, first.group_size, k, t.format)
