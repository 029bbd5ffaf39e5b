"""QuantizedWeight: a linear layer's weight kept in GGUF precision, in the layout the CPU
kernel reads (cpu_kernel.py) and the reference dequantizes (`dequantize`).

    bits 4: codes [N, K/2] uint8, per group of 32 weights along K 16 bytes: byte i holds
            code i in its low nibble and code i+16 in its high nibble (ggml's Q4 order, so
            one 16-byte load yields a whole group)
    bits 8: codes [N, K] int8
    scale, zero [N, K / group_size] float32:  w[n, k] = scale[n, g] * code[n, k] + zero[n, g]

Float16 scale and zero (CPU, `half_scales`): Q4_0, Q4_1 and Q8_0 store their block scale
(and Q4_1 its min) as float16 in the file, so the float32 values are float16 values, and the
CPU keeps them that way when every one of a weight's scales and zeros converts exactly (Q4_0's
zero -8 * d too, unless it overflows). A one-row product streams every byte of the weight:
4-bit codes with float32 scale and zero are 6 bits per weight, with float16 5 (Q8_0: 12 and
8.5). The kernels widen them to float32 before use, so the arithmetic and its results are the
same; the K-quants' products `d * sc` are generally not float16 values and stay float32.

One class for every GGUF format (formats.py maps each onto it exactly); a layer that merges
projections of different formats (q|k|v of a Q4_K_M file) promotes them to the widest
(`promote`) before `cat`.

Factored scales (GPU only, quant/factored.py): the K-quants' group scales are products
`d * sc` of a per-256-weight float and a small integer, so on the GPU, where a decode step is
priced in bytes, they are stored that way when it is exact (`super_groups` > 0):

    scale, zero [N, G] int8, super_scale, super_zero [N, G / super_groups] float32
    w[n, k] = super_scale[n, g // S] * scale[n, g] * code[n, k]
              + super_zero[n, g // S] * zero[n, g]              (S = super_groups)

with every product `super * sub` equal, in float32, to the unfactored value (checked when the
form is made). 4-bit groups of 32 then cost 4.75 bits per weight instead of 6.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sgl.backend.quant.formats import Decoded

__all__ = ["QuantizedWeight"]


@dataclass(frozen=True)
class QuantizedWeight:
    codes: torch.Tensor  # bits 4: [N, K/2] uint8; bits 8: [N, K] int8
    scale: torch.Tensor  # [N, G] float32 (float16: `half_scales`)
    zero: torch.Tensor  # [N, G], scale's dtype
    bits: int
    group_size: int
    in_features: int
    source_format: str  # the GGUF format it came from ("Q4_1", ...; "mixed" after cat)
    # Factored scales (module docstring): 0 = plain float32 scale/zero.
    super_groups: int = 0
    super_scale: torch.Tensor | None = None  # [N, G / super_groups] float32
    super_zero: torch.Tensor | None = None  # [N, G / super_groups] float32
    # CPU: products quantize their input to int8 per group (cpu_int8.py), the engine's
    # `activation_quantization="int8"`; set after loading (cpu_int8.use_int8_activations).
    int8_activations: bool = False
    # CPU: every product runs the C kernel on the codes, whatever its row count (the engine's
    # `enable_deterministic_inference`; linear.keep_rows_invariant), so a row's bits never
    # depend on the other rows of its step. Without it, products past GEMV_MAX_ROWS rows
    # (prefill chunks) dequantize and multiply through oneDNN: faster, other bits.
    row_invariant: bool = False

    def __post_init__(self) -> None:
        # The C kernel reads raw pointers: layouts are checked once here, not per call.
        n, k, gs = self.codes.shape[0], self.in_features, self.group_size
        width = k // 2 if self.bits == 4 else k
        subs = (torch.int8,) if self.super_groups else (torch.float32, torch.float16)
        ok = ((self.bits, gs) in ((4, 32), (8, 32), (8, 16)) and k % gs == 0
              and self.codes.shape == (n, width) and self.scale.shape == (n, k // gs)
              and self.zero.shape == (n, k // gs)
              and self.scale.dtype == self.zero.dtype and self.scale.dtype in subs
              and self.codes.dtype == (torch.uint8 if self.bits == 4 else torch.int8)
              and all(t.is_contiguous() for t in (self.codes, self.scale, self.zero)))
        if ok and self.super_groups:
            sup = (n, k // gs // self.super_groups)
            ok = (k // gs % self.super_groups == 0 and all(
                t is not None and t.shape == sup and t.dtype == torch.float32
                and t.is_contiguous() for t in (self.super_scale, self.super_zero)))
        if not ok:
            raise ValueError(f"inconsistent QuantizedWeight: bits={self.bits} group={gs} "
                             f"codes {tuple(self.codes.shape)} {self.codes.dtype} scale "
                             f"{tuple(self.scale.shape)} zero {tuple(self.zero.shape)} K={k}")

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        parts = (self.codes, self.scale, self.zero, self.super_scale, self.super_zero)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight with its tensors on `device` (the GPU path loads on the CPU, from
        the mapped file, and moves each layer's weight as it is built). On CUDA the scales
        are factored where that is exact (from float32: the GPU kernels read float32 or
        factored scales, never float16); elsewhere they are plain (the C kernel's layout,
        float16 ones kept)."""
        from sgl.backend.quant.factored import factor, unfactor

        device = torch.device(device)
        w = self.float_scales() if device.type == "cuda" else unfactor(self)
        parts = (w.codes, w.scale, w.zero, w.super_scale, w.super_zero)
        codes, scale, zero, sup_s, sup_z = (None if t is None else t.to(device) for t in parts)
        assert codes is not None and scale is not None and zero is not None
        w = QuantizedWeight(codes, scale, zero, w.bits, w.group_size, w.in_features,
                            w.source_format, w.super_groups, sup_s, sup_z)
        return factor(w) if device.type == "cuda" else w

    @property
    def f16_scales(self) -> bool:
        """Scale and zero are float16 (`half_scales`)."""
        return self.scale.dtype == torch.float16

    def half_scales(self) -> QuantizedWeight:
        """The same weight with float16 scale and zero when every value converts exactly
        (module docstring), else self. (Plain form only: factored scales are the GPU's.)"""
        if self.super_groups or self.f16_scales:
            return self
        scale, zero = self.scale.half(), self.zero.half()
        if not (torch.equal(scale.float(), self.scale) and torch.equal(zero.float(), self.zero)):
            return self
        return dataclasses.replace(self, scale=scale, zero=zero)

    def float_scales(self) -> QuantizedWeight:
        """The same weight with float32 scale and zero (the inverse of `half_scales`)."""
        if not self.f16_scales:
            return self
        return dataclasses.replace(self, scale=self.scale.float(), zero=self.zero.float())

    def group_scales(self, rows: torch.Tensor | slice = slice(None)
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) [n, G] float32 of `rows`, the products when factored."""
        if not self.super_groups:
            return self.scale[rows].float(), self.zero[rows].float()
        assert self.super_scale is not None and self.super_zero is not None
        s = self.super_groups
        return (self.scale[rows].float() * self.super_scale[rows].repeat_interleave(s, dim=1),
                self.zero[rows].float() * self.super_zero[rows].repeat_interleave(s, dim=1))

    @classmethod
    def from_decoded(cls, d: Decoded, source_format: str) -> QuantizedWeight:
        n, k = d.codes.shape
        if d.bits == 4:
            groups = d.codes.to(torch.uint8).view(n, k // 32, 2, 16)  # [N, G, half, 16]
            codes = (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(n, k // 2)
        else:
            codes = d.codes.to(torch.int8)
        return cls(codes.contiguous(), d.scale.float().contiguous(),
                   d.zero.float().contiguous(), d.bits, d.group_size, k, source_format)

    def integer_codes(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """[n, K] int16 codes of `rows` (all by default)."""
        c = self.codes[rows]
        if self.bits == 8:
            return c.short()
        groups = c.view(c.shape[0], -1, 1, 16)  # [n, G, 1, 16]
        return torch.cat([groups & 0xF, groups >> 4], dim=2).reshape(c.shape[0], -1).short()

    def dequantize(self, rows: torch.Tensor | slice = slice(None),
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[n, K] float weights of `rows` (the reference every kernel is tested against; also
        the embedding lookup of a quantized table, which reads a few rows per step)."""
        codes = self.integer_codes(rows).float()
        n = codes.shape[0]
        grouped = codes.view(n, -1, self.group_size)  # [n, G, group]
        scale, zero = self.group_scales(rows)
        w = grouped * scale[..., None] + zero[..., None]
        return w.view(n, self.in_features).to(dtype)

    def promote(self, bits: int, group_size: int) -> QuantizedWeight:
        """The same values with wider codes and/or smaller groups (exact)."""
        if self.super_groups:  # (merging happens at load, on the plain form)
            from sgl.backend.quant.factored import unfactor

            return unfactor(self).promote(bits, group_size)
        if (bits, group_size) == (self.bits, self.group_size):
            return self
        if bits < self.bits or group_size > self.group_size or self.group_size % group_size:
            raise ValueError(f"cannot promote {self.bits}-bit/{self.group_size} to "
                             f"{bits}-bit/{group_size}")
        repeat = self.group_size // group_size
        codes = self.integer_codes()
        d = Decoded(codes, self.scale.repeat_interleave(repeat, 1),
                    self.zero.repeat_interleave(repeat, 1), bits, group_size)
        return QuantizedWeight.from_decoded(d, self.source_format)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack along the output dim (fused q|k|v, gate|up), promoting to a common form."""
        bits = max(p.bits for p in parts)
        group = min(p.group_size for p in parts)
        parts = [p.promote(bits, group) for p in parts]
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("merged projections must share in_features")
        formats = {p.source_format for p in parts}
        if len({p.scale.dtype for p in parts}) != 1:  # (float16 and float32: all float32)
            parts = [p.float_scales() for p in parts]
        return QuantizedWeight(
            torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]), bits, group, parts[0].in_features,
            formats.pop() if len(formats) == 1 else "mixed")


def mark_weights(model: torch.nn.Module, where: Callable[[QuantizedWeight], bool] = lambda w: True,
                 **marks: Any) -> int:
    """Give every GGUF-quantized weight of `model` (a module's `qweight`, the tied table's
    included) for which `where` holds a copy with the fields `marks` set; returns how many.
    Transforms after loading (int8 activations, row invariance) mark weights so."""
    marked = 0
    for module in model.modules():
        w = getattr(module, "qweight", None)
        if isinstance(w, QuantizedWeight) and where(w):
            module.qweight = dataclasses.replace(w, **marks)
            marked += 1
    return marked
