"""GGUF block formats decoded into QuantizedWeight (backend/quant/formats.py, weight.py),
checked value for value against the `gguf` package's own dequantization on random blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from sgl.backend.quant import FORMATS, QuantizedWeight, decode
from sgl.backend.quant.formats import NIBBLE_NATIVE, nibble_native, q8_0_native

# Byte offsets of each format's fp16 fields inside a block (random bytes there could be
# NaN/inf, which no real file holds; everything else is random bytes).
_F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
               "IQ4_NL": [0], "IQ4_XS": [0]}


def random_blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, row_bytes] uint8: a random `fmt` tensor of shape [rows, cols]."""
    rng = np.random.default_rng(seed)
    block, block_bytes, _ = FORMATS[fmt]
    raw = rng.integers(0, 256, (rows, cols // block, block_bytes), dtype=np.uint8)
    for offset in _F16_FIELDS[fmt]:
        halves = rng.normal(0, 0.05, raw.shape[:2]).astype(np.float16)
        raw[:, :, offset:offset + 2] = halves.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def reference(fmt: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[fmt]).copy())


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 7])
def test_decoded_weight_equals_gguf_dequantize(fmt: str, rows: int) -> None:
    cols = 512  # two K-quant super-blocks, sixteen 32-blocks
    raw = random_blocks(fmt, rows, cols, seed=rows)
    weight = QuantizedWeight.from_decoded(decode(fmt, torch.from_numpy(raw), cols), fmt)
    assert weight.shape == (rows, cols)
    assert torch.equal(weight.dequantize(), reference(fmt, raw))  # exact, not close


@pytest.mark.parametrize("fmt", sorted(NIBBLE_NATIVE))
def test_nibble_native_copy_equals_the_full_decode(fmt: str) -> None:
    raw = torch.from_numpy(random_blocks(fmt, 5, 96))
    codes, scale, zero = nibble_native(fmt, raw, 96)
    fast = QuantizedWeight(codes, scale, zero, 4, 32, 96, fmt)
    full = QuantizedWeight.from_decoded(decode(fmt, raw, 96), fmt)
    assert torch.equal(fast.codes, full.codes)
    assert torch.equal(fast.dequantize(), full.dequantize())


def test_q8_0_copy_equals_the_full_decode() -> None:
    raw = torch.from_numpy(random_blocks("Q8_0", 6, 96))
    codes, scale, zero = q8_0_native(raw, 96)
    fast = QuantizedWeight(codes, scale, zero, 8, 32, 96, "Q8_0")
    assert torch.equal(fast.dequantize(), reference("Q8_0", raw.numpy()))


def test_rows_of_the_table_dequantize_alone() -> None:
    """The embedding lookup dequantizes only the rows it needs: same values as the whole."""
    raw = random_blocks("Q8_0", 40, 64)
    weight = QuantizedWeight.from_decoded(decode("Q8_0", torch.from_numpy(raw), 64), "Q8_0")
    ids = torch.tensor([3, 3, 39, 0])
    assert torch.equal(weight.dequantize(ids), reference("Q8_0", raw)[ids])


def test_cat_promotes_mixed_formats_exactly() -> None:
    """q|k|v of a Q4_K_M file mixes Q4_K and Q6_K: merged, every value stays exact."""
    parts_raw = [("Q4_K", random_blocks("Q4_K", 3, 256, 1)),
                 ("Q6_K", random_blocks("Q6_K", 2, 256, 2)),
                 ("Q4_1", random_blocks("Q4_1", 4, 256, 3))]
    parts = [QuantizedWeight.from_decoded(decode(f, torch.from_numpy(r), 256), f)
             for f, r in parts_raw]
    merged = QuantizedWeight.cat(parts)
    assert (merged.bits, merged.group_size, merged.source_format) == (8, 16, "mixed")
    expected = torch.cat([reference(f, r) for f, r in parts_raw])
    assert torch.equal(merged.dequantize(), expected)


def test_decode_rejects_a_row_that_is_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match="Q4_K"):
        decode("Q4_K", torch.zeros(2, 144, dtype=torch.uint8), 200)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "IQ4_XS", "Q5_0"])
def test_large_tensors_decode_in_row_slices_to_the_same_weight(
        fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """to_quantized decodes DECODE_WEIGHTS at a time (bounded temporaries on an 8B
    embedding): slices of 3 rows, the last one short, give the whole decode's weight."""
    from sgl.backend.quant import gguf_weights

    raw = torch.from_numpy(random_blocks(fmt, 11, 512, seed=5))
    whole = QuantizedWeight.from_decoded(decode(fmt, raw, 512), fmt)
    monkeypatch.setattr(gguf_weights, "DECODE_WEIGHTS", 3 * 512)
    sliced = gguf_weights.to_quantized(gguf_weights.GGUFTensor("w", fmt, (11, 512), raw))
    for a, b in ((whole.codes, sliced.codes), (whole.scale, sliced.scale),
                 (whole.zero, sliced.zero)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert (sliced.bits, sliced.group_size, sliced.source_format) == (whole.bits,
                                                                        whole.group_size, fmt)
