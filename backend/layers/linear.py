"""Plain linear layers whose parameters are allocated uninitialized on the target device.

Model construction must be cheap (an 8B dummy model is built directly on the GPU and then
filled in place), so no layer here runs an initializer: the loader writes every value.

`pack_for_cpu(model, head)` is a transform applied after loading, on the CPU: every Linear's
weight is replaced by its oneDNN-packed copy (same shape, no extra memory), and so is the LM
head's table, or a packed copy of it when it is also the input embedding (kernels/onednn_linear.py
says why).

A layer may instead hold a `QuantizedWeight` (`qweight`, set by quant/install.py when a GGUF
file loads quantized; `weight` is then None): it runs `quant.quant_linear`, and an Embedding
dequantizes only the rows it looks up, so a tied head is one quantized table, never a copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sgl.backend.kernels import onednn_linear
from sgl.backend.kernels.dispatch import KernelSet
from sgl.backend.quant.fp8 import Fp8Weight
from sgl.backend.quant.linear import quant_linear
from sgl.backend.quant.weight import QuantizedWeight


def empty_param(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x @ W^T (+ b). `weight` is [out_features, in_features], the HF layout.

    A plain weight goes through the set's `linear`; a weight packed by `pack_for_cpu` through
    oneDNN (the packed layout is the choice, made once at load when the set says to pack).
    """

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool, kernels: KernelSet,
        device: torch.device, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.in_features = in_features
        self.out_features = out_features
        self.weight: nn.Parameter | None = empty_param(out_features, in_features, device=device,
                                                       dtype=dtype)
        self.bias = empty_param(out_features, device=device, dtype=dtype) if bias else None
        self.qweight: QuantizedWeight | Fp8Weight | None = None  # (quant/install.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return quant_linear(x, self.qweight, self.bias)
        assert self.weight is not None
        if self.weight.is_mkldnn:  # packed by pack_for_cpu
            return onednn_linear.packed_linear(x, self.weight, self.bias)
        return self.kernels.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (q|k|v, gate|up).

    One matmul instead of several; `shard_slices` says where each HF tensor goes.
    """

    def __init__(
        self, in_features: int, shard_sizes: dict[str, int], *, bias: bool, kernels: KernelSet,
        device: torch.device, dtype: torch.dtype,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias, kernels=kernels,
                         device=device, dtype=dtype)
        self.shard_slices: dict[str, slice] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_slices[name] = slice(start, start + size)
            start += size

    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        target = self.weight if param_name == "weight" else self.bias
        if target is None:  # (a quantized weight is installed whole, by quant/install.py)
            raise KeyError(f"{shard}.{param_name}: this layer has no bias")
        rows = self.shard_slices[shard]
        if tensor.shape[0] != rows.stop - rows.start or tensor.shape[1:] != target.shape[1:]:
            raise ValueError(
                f"shard {shard}.{param_name} has shape {tuple(tensor.shape)}, expected "
                f"{(rows.stop - rows.start, *target.shape[1:])}"
            )
        target.data[rows].copy_(tensor)


class Embedding(nn.Module):
    """Token embedding table [vocab, hidden]; also the LM head when embeddings are tied."""

    def __init__(self, vocab_size: int, dim: int, *, kernels: KernelSet, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.kernels = kernels
        self.weight: nn.Parameter | None = empty_param(vocab_size, dim, device=device,
                                                       dtype=dtype)
        # A quantized table (quant/install.py): a GGUF file's, or an untied head's FP8 copy
        # (`quantization="fp8"`, used by `project` only: the input embedding is another table).
        self.qweight: QuantizedWeight | Fp8Weight | None = None
        self.dtype = dtype  # of the rows a quantized table's lookup returns
        # On the CPU (pack_for_cpu), the table packed for oneDNN when this embedding is both
        # the input embedding and the LM head: a copy, since the lookup needs the plain table.
        self.packed_projection: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.qweight, QuantizedWeight):
            rows = self.qweight.dequantize(ids.reshape(-1), self.dtype)  # [T, dim]
            return rows.view(*ids.shape, rows.shape[-1])
        return F.embedding(ids, self.weight)

    def project(self, hidden: torch.Tensor,
                threads: int | None = None) -> torch.Tensor:  # [N, dim] -> [N, vocab]
        """Scores of every table row against each hidden state: the LM head. `threads`: of
        a quantized table's C kernel (torch's count by default)."""
        if self.qweight is not None:
            return quant_linear(hidden, self.qweight, threads=threads)
        assert self.weight is not None
        if self.weight.is_mkldnn:  # an LM head only, packed in place
            return onednn_linear.packed_linear(hidden, self.weight)
        if self.packed_projection is not None:
            return onednn_linear.packed_linear(hidden, self.packed_projection)
        return self.kernels.linear(hidden, self.weight, None)


def pack_for_cpu(model: nn.Module, head: Embedding | None, *, tied: bool = False) -> None:
    """Pack every Linear's weight, and the LM head's table, for oneDNN (after the weights load).

    `tied`: `head` is also the input embedding, whose lookup needs the plain table, so the
    head gets a packed copy; an untied head is packed in place like a Linear.
    """
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None and not module.weight.is_mkldnn:
            module.weight = nn.Parameter(onednn_linear.pack(module.weight), requires_grad=False)
    if head is None or head.weight is None or head.weight.is_mkldnn:
        return
    if tied:
        head.packed_projection = onednn_linear.pack(head.weight)
    else:
        head.weight = nn.Parameter(onednn_linear.pack(head.weight), requires_grad=False)


def unpacked_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with packed weights in their plain layout (to copy a CPU model)."""
    return {name: t.to_dense() if t.is_mkldnn else t for name, t in model.state_dict().items()}
