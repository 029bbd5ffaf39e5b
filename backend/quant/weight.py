"""QuantizedWeight: a linear layer's weight kept in GGUF precision, in the layout the CPU
kernel reads (cpu_kernel.py) and the reference dequantizes (`dequantize`).

    bits 4: codes [N, K/2] uint8, per group of 32 weights along K 16 bytes: byte i holds
            code i in its low nibble and code i+16 in its high nibble (ggml's Q4 order, so
            one 16-byte load yields a whole group)
    bits 8: codes [N, K] int8
    scale, zero [N, K / group_size] float32:  w[n, k] = scale[n, g] * code[n, k] + zero[n, g]

One class for every GGUF format (formats.py maps each onto it exactly); a layer that merges
projections of different formats (q|k|v of a Q4_K_M file) promotes them to the widest
(`promote`) before `cat`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl.backend.quant.formats import Decoded

__all__ = ["QuantizedWeight"]


@dataclass(frozen=True)
class QuantizedWeight:
    codes: torch.Tensor  # bits 4: [N, K/2] uint8; bits 8: [N, K] int8
    scale: torch.Tensor  # [N, G] float32
    zero: torch.Tensor  # [N, G] float32
    bits: int
    group_size: int
    in_features: int
    source_format: str  # the GGUF format it came from ("Q4_1", ...; "mixed" after cat)

    def __post_init__(self) -> None:
        # The C kernel reads raw pointers: layouts are checked once here, not per call.
        n, k, gs = self.codes.shape[0], self.in_features, self.group_size
        width = k // 2 if self.bits == 4 else k
        ok = ((self.bits, gs) in ((4, 32), (8, 32), (8, 16)) and k % gs == 0
              and self.codes.shape == (n, width) and self.scale.shape == (n, k // gs)
              and self.zero.shape == (n, k // gs)
              and self.scale.dtype == self.zero.dtype == torch.float32
              and self.codes.dtype == (torch.uint8 if self.bits == 4 else torch.int8)
              and all(t.is_contiguous() for t in (self.codes, self.scale, self.zero)))
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
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight with its tensors on `device` (the GPU path loads on the CPU, from
        the mapped file, and moves each layer's weight as it is built)."""
        move = [t.to(device) for t in (self.codes, self.scale, self.zero)]
        return QuantizedWeight(*move, self.bits, self.group_size, self.in_features,
                               self.source_format)

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
        w = grouped * self.scale[rows][..., None] + self.zero[rows][..., None]
        return w.view(n, self.in_features).to(dtype)

    def promote(self, bits: int, group_size: int) -> QuantizedWeight:
        """The same values with wider codes and/or smaller groups (exact)."""
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
        return QuantizedWeight(
            torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]), bits, group, parts[0].in_features,
            formats.pop() if len(formats) == 1 else "mixed")
