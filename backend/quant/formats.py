"""GGUF block formats decoded into one canonical form: integer codes with a float scale and
zero per group of `group_size` consecutive weights along K.

    weight[n, k] = scale[n, g] * code[n, k] + zero[n, g]        (g = k // group_size)

Every supported format maps onto it exactly in float32: GGUF stores its block scales as fp16
and its sub-block scales as 6- or 8-bit integers, so `d * sc` (11-bit mantissa x 8-bit int)
and `dmin * m` fit float32's 24-bit mantissa without rounding.

    format  block  bytes  codes        group  scale        zero
    Q4_0    32     18     q in 0..15   32     d            -8 d
    Q4_1    32     20     q in 0..15   32     d            m
    Q5_0    32     22     q in 0..31   32     d            -16 d
    Q5_1    32     24     q in 0..31   32     d            m
    Q8_0    32     34     q in -128..  32     d            0
    Q2_K    256    84     q in 0..3    16     d * sc_j     -dmin * m_j
    Q3_K    256    110    q-4 in -4..3 16     d * (sc_j - 32)  0
    Q4_K    256    144    q in 0..15   32     d * sc_j     -dmin * m_j
    Q5_K    256    176    q in 0..31   32     d * sc_j     -dmin * m_j
    Q6_K    256    210    q-32 in -32..31  16 d * sc_j     0
    IQ4_NL  32     18     T[q] in -127..113  32  d          0
    IQ4_XS  256    136    T[q] in -127..113  32  d * (ls_j - 32)  0

(T: the IQ4 formats' table of 16 non-linear levels; each 4-bit index q becomes its level, an
8-bit code.)

Codes wider than 4 bits or in groups of 16 are kept as 8-bit codes (Q2_K's and Q3_K's too:
2-3 bits a weight in the file, 8 held, still well under a float copy's 16-32).

The decoders take a tensor's raw bytes `[N, blocks_per_row * block_bytes]` (uint8, the layout
`gguf.GGUFReader` maps) and return `Decoded(codes [N, K] int16, scale [N, G], zero [N, G])`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

__all__ = ["FORMATS", "Decoded", "decode", "supported"]


class Decoded(NamedTuple):
    codes: torch.Tensor  # [N, K] int16 (fits every format's range)
    scale: torch.Tensor  # [N, G] float32
    zero: torch.Tensor  # [N, G] float32
    bits: int  # 4: codes in 0..15; 8: codes in -128..127
    group_size: int


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> [...] float32 (the fp16 values, exactly)."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles_by_half(qs: torch.Tensor) -> torch.Tensor:
    """[..., B] bytes -> [..., 2B]: the low nibbles of all bytes, then the high nibbles."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _q4_0(blocks: torch.Tensor) -> Decoded:  # [N, nb, 18]
    d = _f16(blocks[..., 0:2])  # [N, nb]
    codes = _nibbles_by_half(blocks[..., 2:18])  # [N, nb, 32]
    return Decoded(codes.flatten(1).short(), d, -8.0 * d, 4, 32)


def _q4_1(blocks: torch.Tensor) -> Decoded:  # [N, nb, 20]
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    codes = _nibbles_by_half(blocks[..., 4:20])
    return Decoded(codes.flatten(1).short(), d, m, 4, 32)


def _q5_low_high(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 codes [N, nb, 32]: code i's low nibble from byte i % 16 (low, then high
    nibbles), its fifth bit bit i of the little-endian 32-bit qh."""
    bits = qh.long()  # [N, nb, 4] bytes
    word = bits[..., 0] | bits[..., 1] << 8 | bits[..., 2] << 16 | bits[..., 3] << 24
    high = (word[..., None] >> torch.arange(32)) & 1  # [N, nb, 32]
    return (_nibbles_by_half(qs).long() | high << 4).short()


def _q5_0(blocks: torch.Tensor) -> Decoded:  # [N, nb, 22]
    d = _f16(blocks[..., 0:2])
    codes = _q5_low_high(blocks[..., 2:6], blocks[..., 6:22])
    return Decoded(codes.flatten(1), d, -16.0 * d, 8, 32)


def _q5_1(blocks: torch.Tensor) -> Decoded:  # [N, nb, 24]
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    codes = _q5_low_high(blocks[..., 4:8], blocks[..., 8:24])
    return Decoded(codes.flatten(1), d, m, 8, 32)


def _two_bit_quarters(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K's 2-bit fields: qs [N, nb, 64] -> [N, nb, half, quarter, 32], weight
    128 half + 32 quarter + l taking bits 2 quarter, 2 quarter + 1 of byte 32 half + l."""
    q = qs.unflatten(-1, (2, 1, 32)).short()  # [N, nb, half, 1, 32]
    return (q >> torch.arange(0, 8, 2, dtype=torch.int16).view(4, 1)) & 3


def _q2_k(blocks: torch.Tensor) -> Decoded:  # [N, nb, 84]
    sc = blocks[..., 0:16].long()  # [N, nb, 16]: scale (low nibble) and min (high), per 16
    d, dmin = _f16(blocks[..., 80:82]), _f16(blocks[..., 82:84])
    codes = _two_bit_quarters(blocks[..., 16:80])
    scale = (d[..., None] * (sc & 0xF).float()).flatten(1)  # [N, nb * 16]
    zero = (-dmin[..., None] * (sc >> 4).float()).flatten(1)
    return Decoded(codes.flatten(1), scale, zero, 8, 16)


def _q3_k(blocks: torch.Tensor) -> Decoded:  # [N, nb, 110]
    hmask = blocks[..., 0:32].short()  # [N, nb, 32]: bit 4 half + quarter of weight l's third
    low = _two_bit_quarters(blocks[..., 32:96])  # [N, nb, half, quarter, 32]
    high = (hmask[..., None, None, :] >> torch.arange(8, dtype=torch.int16).view(2, 4, 1)) & 1
    codes = low + 4 * high - 4  # [N, nb, half, quarter, 32] in -4..3
    # 16 six-bit scales: the low four bits are the nibbles of bytes 0-7 (low nibbles first),
    # the high two come from bytes 8-11, two bits per scale j at bit 2 (j // 4) of byte
    # 8 + j % 4
    b = blocks[..., 96:108].long()  # [N, nb, 12]
    j = torch.arange(16)
    low4 = torch.where(j < 8, b[..., j % 8] & 0xF, b[..., j % 8] >> 4)
    high2 = (b[..., 8 + j % 4] >> (2 * (j // 4))) & 3
    d = _f16(blocks[..., 108:110])  # [N, nb]
    scale = (d[..., None] * ((low4 | high2 << 4) - 32).float()).flatten(1)
    return Decoded(codes.flatten(1), scale, torch.zeros_like(scale), 8, 16)


# The 16 levels a 4-bit IQ4_NL/IQ4_XS index selects (the formats' definition).
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_codes(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] index bytes (Q4_0's nibble order) -> [..., 32] int16 levels."""
    return torch.tensor(IQ4_LEVELS, dtype=torch.int16)[_nibbles_by_half(qs).long()]


def _iq4_nl(blocks: torch.Tensor) -> Decoded:  # [N, nb, 18]
    d = _f16(blocks[..., 0:2])
    codes = _iq4_codes(blocks[..., 2:18])
    return Decoded(codes.flatten(1), d, torch.zeros_like(d), 8, 32)


def _iq4_xs(blocks: torch.Tensor) -> Decoded:  # [N, nb, 136]
    d = _f16(blocks[..., 0:2])  # [N, nb]
    high = blocks[..., 2].long() | blocks[..., 3].long() << 8  # [N, nb] scales' high bits
    low = _nibbles_by_half(blocks[..., 4:8]).long()  # [N, nb, 8]: scale j's low nibble ...
    low = low.view(*low.shape[:-1], 2, 4).transpose(-1, -2).flatten(-2)  # ... from byte j / 2
    j = torch.arange(8)
    ls = low | ((high[..., None] >> (2 * j)) & 3) << 4  # [N, nb, 8] six-bit
    codes = _iq4_codes(blocks[..., 8:136].unflatten(-1, (8, 16)))  # [N, nb, 8, 32]
    scale = (d[..., None] * (ls - 32).float()).flatten(1)
    return Decoded(codes.flatten(1), scale, torch.zeros_like(scale), 8, 32)


def _q8_0(blocks: torch.Tensor) -> Decoded:  # [N, nb, 34]
    d = _f16(blocks[..., 0:2])
    codes = blocks[..., 2:34].contiguous().view(torch.int8)
    return Decoded(codes.flatten(1).short(), d, torch.zeros_like(d), 8, 32)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of a Q4_K/Q5_K block -> (sc [.., 8], m [.., 8]), 6-bit each."""
    p = packed.long()
    lo_sc, lo_m = p[..., 0:4] & 63, p[..., 4:8] & 63
    hi_sc = (p[..., 8:12] & 0xF) | ((p[..., 0:4] >> 6) << 4)
    hi_m = (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1).float(), torch.cat([lo_m, hi_m], -1).float()


def _k_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero per 32-group of a Q4_K/Q5_K block: d*sc and -dmin*m ([N, nb*8])."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [N, nb]
    sc, m = _k_scales(blocks[..., 4:16])  # [N, nb, 8]
    return (d[..., None] * sc).flatten(1), (-dmin[..., None] * m).flatten(1)


def _q4_k(blocks: torch.Tensor) -> Decoded:  # [N, nb, 144]
    scale, zero = _k_groups(blocks)
    qs = blocks[..., 16:144].unflatten(-1, (4, 32))  # [N, nb, chunk, 32]: 64 weights each
    codes = _nibbles_by_half(qs)  # [N, nb, 4, 64]
    return Decoded(codes.flatten(1).short(), scale, zero, 4, 32)


def _q5_k(blocks: torch.Tensor) -> Decoded:  # [N, nb, 176]
    scale, zero = _k_groups(blocks)
    qh = blocks[..., 16:48]  # [N, nb, 32]: bit 2c / 2c+1 is the 5th bit of chunk c's halves
    qs = blocks[..., 48:176].unflatten(-1, (4, 32))  # [N, nb, 4, 32]
    low = _nibbles_by_half(qs).short()  # [N, nb, 4, 64]
    shifts = torch.arange(8, dtype=torch.int16).view(4, 2, 1)  # [chunk, half, 1]
    high = (qh.short()[..., None, None, :] >> shifts) & 1  # [N, nb, 4, 2, 32]
    codes = low + (high.flatten(-2) << 4)
    return Decoded(codes.flatten(1), scale, zero, 8, 32)


def _q6_k(blocks: torch.Tensor) -> Decoded:  # [N, nb, 210]
    ql = blocks[..., 0:128].unflatten(-1, (2, 2, 32)).short()  # [N, nb, half, 2, 32]
    qh = blocks[..., 128:192].unflatten(-1, (2, 32)).short()  # [N, nb, half, 32]
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [N, nb, 16]
    d = _f16(blocks[..., 208:210])  # [N, nb]
    # Within a half (128 weights): quarter r takes nibble r // 2 of ql row r % 2 and bits
    # 2r, 2r+1 of qh.
    low = torch.stack([ql[..., 0, :] & 0xF, ql[..., 1, :] & 0xF,
                       ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], dim=-2)  # [N, nb, half, 4, 32]
    shifts = torch.arange(0, 8, 2, dtype=torch.int16).view(4, 1)
    high = (qh[..., None, :] >> shifts) & 3  # [N, nb, half, 4, 32]
    codes = (low | (high << 4)) - 32
    scale = (d[..., None] * sc).flatten(1)  # [N, nb * 16]: one per 16 weights
    return Decoded(codes.flatten(1), scale, torch.zeros_like(scale), 8, 16)


# name -> (weights per block, bytes per block, decoder)
FORMATS: dict[str, tuple[int, int, Callable[[torch.Tensor], Decoded]]] = {
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0),
    "Q2_K": (256, 84, _q2_k),
    "Q3_K": (256, 110, _q3_k),
    "Q4_K": (256, 144, _q4_k),
    "Q5_K": (256, 176, _q5_k),
    "Q6_K": (256, 210, _q6_k),
    "IQ4_NL": (32, 18, _iq4_nl),
    "IQ4_XS": (256, 136, _iq4_xs),
}


# Formats whose 16 code bytes per block are already QuantizedWeight's 4-bit order (byte i:
# code i low, code i+16 high): their codes are copied, not decoded and repacked.
NIBBLE_NATIVE = {"Q4_0": 2, "Q4_1": 4}  # format -> offset of the code bytes in a block


def nibble_native(format_name: str, raw: torch.Tensor,
                  in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K/2] uint8, scale [N, G], zero [N, G]) of a Q4_0/Q4_1 tensor."""
    offset = NIBBLE_NATIVE[format_name]
    blocks = raw.reshape(raw.shape[0], in_features // 32, offset + 16)  # [N, G, block]
    d = _f16(blocks[..., 0:2])
    zero = -8.0 * d if format_name == "Q4_0" else _f16(blocks[..., 2:4])
    return blocks[..., offset:].reshape(raw.shape[0], -1).contiguous(), d, zero.contiguous()


def q8_0_native(raw: torch.Tensor,
                in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] int8, scale [N, G], zero [N, G]) of a Q8_0 tensor, codes copied once."""
    blocks = raw.reshape(raw.shape[0], in_features // 32, 34)  # [N, G, block]
    codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(raw.shape[0], in_features)
    d = _f16(blocks[..., 0:2])
    return codes, d, torch.zeros_like(d)


def supported(format_name: str) -> bool:
    return format_name in FORMATS


def decode(format_name: str, raw: torch.Tensor, in_features: int) -> Decoded:
    """Raw GGUF rows `[N, row_bytes]` uint8 of a `[N, in_features]` weight -> Decoded."""
    block, block_bytes, decoder = FORMATS[format_name]
    if in_features % block or raw.shape[-1] != in_features // block * block_bytes:
        raise ValueError(f"{format_name}: {tuple(raw.shape)} bytes do not hold rows of "
                         f"{in_features} weights ({block}-weight blocks of {block_bytes} bytes)")
    return decoder(raw.reshape(raw.shape[0], -1, block_bytes))
