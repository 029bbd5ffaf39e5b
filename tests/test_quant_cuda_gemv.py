"""The CUDA tensor-core GEMV on GGUF codes (quant/cuda_gemv.py) without a GPU: its source
compiled as a GPU would at first use (NVRTC to PTX for compute_90, then Triton's ptxas to
sm_90 machine code) for the variants the engine launches, with the resources checked; the
bit tricks that turn codes into bf16 operands, evaluated on every code; and the config rules
the launcher applies. Its answers against dequantize-then-matmul are checked on the device
(tests/test_quant_gpu.py: every 8B shape, odd N and K, bias, row 0 of two == one row).

    python -m pytest -q tests/test_quant_cuda_gemv.py

NVRTC comes from the `nvidia-cuda-nvrtc-cu12` wheel (the test extra; torch's CUDA builds
carry the same library); ptxas from the triton wheel.
"""

from __future__ import annotations

import itertools
import re
import struct
from pathlib import Path

import pytest
import torch
from cuda_compile import NVRTC, PTXAS, assemble, to_ptx

from sgl.backend.quant import cuda_gemv
from sgl.backend.quant.cuda_gemv import (CUDA_GEMV_DEFAULTS, MAX_ROWS, SOURCE, CudaGemvConfig,
                                         _defines, config_for, fitted)

needs_tools = pytest.mark.skipif(NVRTC is None or PTXAS is None,
                                 reason="NVRTC (nvidia-cuda-nvrtc-cu12) or Triton's ptxas missing")


VARIANTS = [  # (config, rows, super_groups, chunks, bits, chunks per group): each default at
    # its row counts, at the 8B Ks and at SmolLM2's (576: a tail step): 4-bit codes with
    # factored (Q4_K) and plain (Q4_1) scales; 8-bit in factored groups of 16 (Q6_K) and plain
    # groups of 32 (Q8_0)
    (config_for(rows, form[2], form[1] * (32 if form[2] == 4 else 16), form[0] > 0), rows, *form)
    for rows in (1, 2, 4, 5, 8)
    for form in ((8, 128, 4, 1), (8, 448, 4, 1), (0, 18, 4, 1), (0, 25, 4, 1),
                 (16, 256, 8, 1), (16, 896, 8, 1), (0, 36, 8, 1), (0, 50, 8, 2))
]


@needs_tools
@pytest.mark.parametrize("cfg,rows,sup,chunks,bits,per_group", VARIANTS)
def test_the_cuda_gemv_compiles_for_hopper_on_the_tensor_cores(
        cfg: CudaGemvConfig, rows: int, sup: int, chunks: int, bits: int, per_group: int,
        tmp_path: Path) -> None:
    """Every launched variant compiles, multiplies with mma (bf16 in, float32 accumulate),
    unpacks with lop3, waits for the kernel before when launched early (griddepcontrol), and
    keeps its state in registers: no spills (a spill would put the two steps in flight
    through local memory, the slow path the design avoids)."""
    ptx = to_ptx(_defines(fitted(cfg, 4096, per_group), rows, sup, chunks, bits, per_group)
                 + SOURCE)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "lop3.b32" in ptx
    assert "griddepcontrol.wait" in ptx
    report = assemble(ptx, tmp_path)[0]
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and spills.groups() == ("0", "0"), report
    regs = re.search(r"Used (\d+) registers", report)
    assert regs and int(regs.group(1)) <= 255, report


def lop3(a: int, b: int, c: int, imm: int) -> int:
    """PTX lop3.b32: bit i of the result is bit (a_i b_i c_i) of the 8-bit table `imm`."""
    return sum(((imm >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i
               for i in range(32))


def bf16(bits16: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits16 << 16))[0]


def source_lop3() -> tuple[int, int, int, int, float, float]:
    """(table, mask, magic, flip, offset of 4-bit codes, of 8-bit codes) as SOURCE has them."""
    call = re.search(r'lop3\.b32 %0, %1, %2, %3, (0x[0-9A-Fa-f]+);"\s*: "=r"\(r\) : "r"\(w\), '
                     r'"r"\((0x[0-9A-Fa-f]+)u\), "r"\((0x[0-9A-Fa-f]+)u \| FLIP\)', SOURCE)
    flip = re.search(r"bf16_pair<(0x[0-9A-Fa-f]+)u>", SOURCE)
    offsets = re.findall(r"#define OFFSET ([0-9.]+)f", SOURCE)
    assert call and flip and len(offsets) == 2
    return (*(int(v, 16) for v in call.groups()), int(flip.group(1), 16),
            float(offsets[0]), float(offsets[1]))


def test_lop3_makes_every_4_bit_code_a_bf16_at_the_offset() -> None:
    """One lop3 turns the nibbles at bits 0 and 16 of a word into bf16 (offset + code): every
    code, in both halves, with the other bits of the word set (they must not leak in)."""
    table, mask, magic, _, offset4, _ = source_lop3()
    for lo, hi in itertools.product(range(16), repeat=2):
        word = 0xFFF0FFF0 & 0xFFFFFFFF | lo | hi << 16
        pair = lop3(word, mask, magic, table)
        assert (bf16(pair & 0xFFFF), bf16(pair >> 16)) == (offset4 + lo, offset4 + hi)


def test_two_nibble_operands_rebuild_every_8_bit_code_at_the_offset() -> None:
    """8-bit codes: the low nibble as is and the high nibble with the sign bit inverted, each
    bf16 (128 + nibble), meet x and 16 x in two MMAs: (128 + low) + 16 (128 + high) must be
    code + the offset the kernel takes off, for every int8 code (signed bytes, as stored)."""
    table, mask, magic, flip, _, offset8 = source_lop3()
    for code in range(-128, 128):
        byte = code & 0xFF
        word = byte | (byte ^ 0x5A) << 8 | byte << 16 | 0xA5 << 24  # (neighbours must not leak)
        low = lop3(word, mask, magic, table)
        high = lop3(word >> 4, mask, magic | flip, table)
        for half in (0, 16):
            value = bf16(low >> half & 0xFFFF) + 16 * bf16(high >> half & 0xFFFF)
            assert value == code + offset8, (code, half)


def test_fitted_keeps_the_last_program_inside_the_weight() -> None:
    """The last program starts at N - 16 tiles: a config never has more tiles than N / 16."""
    assert fitted(CudaGemvConfig(4, 2, 1), 40).tiles == 2
    assert fitted(CudaGemvConfig(4, 2, 1), 16).tiles == 1
    assert fitted(CudaGemvConfig(2, 8, 2), 4096) == CudaGemvConfig(2, 8, 2)


def test_fitted_gives_q8_0_an_even_span() -> None:
    """Two 16-byte chunks share a Q8_0 scale: a lane's chunks of a step must start a group."""
    assert fitted(CudaGemvConfig(1, 8, 1), 4096, 2).span == 2
    assert fitted(CudaGemvConfig(1, 8, 2), 4096, 2).span == 2
    assert fitted(CudaGemvConfig(1, 8, 1), 4096, 1).span == 1


@pytest.mark.parametrize("bits", [4, 8])
def test_the_defaults_table_covers_every_row_count(bits: int) -> None:
    limits = [limit for limit, _ in CUDA_GEMV_DEFAULTS[bits]]
    assert limits == sorted(limits) and limits[-1] == MAX_ROWS
    for rows in range(1, MAX_ROWS + 1):
        for k, factored in ((576, True), (4096, False), (4096, True), (14336, True)):
            cfg = config_for(rows, bits, k, factored)
            assert cfg.tiles >= 1 and cfg.warps >= 1 and cfg.span in (1, 2, 4)


def test_one_row_short_k_q4_k_products_hold_three_programs_per_sm() -> None:
    """One row against factored 4-bit codes of K <= 4,096 runs capped to 80 registers
    (session 23's in-engine A/B: +5% single stream); longer K, more rows and plain scales
    keep the compiler's choice (capped, they spill: the compile test above would fail)."""
    assert config_for(1, 4, 4096, True).min_blocks == config_for(1, 4, 576, True).min_blocks == 3
    assert {config_for(1, 4, 14336, True).min_blocks, config_for(2, 4, 4096, True).min_blocks,
            config_for(1, 4, 4096, False).min_blocks, config_for(1, 8, 4096, True).min_blocks
            } == {0, 2}  # (8-bit codes: their own min_blocks 2)


class Compiled(Exception):
    """Raised by a stand-in kernel loader: mma_gemv got as far as choosing its variant."""


def fake_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """cuda_gemv's NVRTC call replaced by a recorder (no GPU, no NVRTC here), its caches
    emptied and pointed at tmp_path; returns the list of sources compiled."""
    compiled: list[str] = []

    def compile_(source: str, arch: str) -> bytes:
        compiled.append(source)
        return f"cubin sm_{arch} {hash(source)}".encode()

    monkeypatch.setattr(cuda_gemv, "_compile", compile_)
    monkeypatch.setattr(cuda_gemv, "_cache_folder", lambda: tmp_path / "kernels")
    monkeypatch.setattr(cuda_gemv, "_cubins", {})
    monkeypatch.setattr(cuda_gemv, "_arch", lambda device: "90")
    return compiled


def test_compiled_kernels_are_kept_on_disk_for_the_next_start(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A variant compiles once: the machine code lands in the cache folder, and a new process
    (an empty in-memory cache) reads it from there; another source or GPU compiles anew."""
    compiled = fake_compiler(monkeypatch, tmp_path)
    source = _defines(CudaGemvConfig(1, 8, 2), 1, 8, 128) + SOURCE
    first = cuda_gemv._cubin(source, "90")
    assert compiled == [source] and len(list((tmp_path / "kernels").iterdir())) == 1
    monkeypatch.setattr(cuda_gemv, "_cubins", {})  # a new process
    assert cuda_gemv._cubin(source, "90") == first and compiled == [source]
    cuda_gemv._cubin(source, "100")
    cuda_gemv._cubin(source.replace("#define ROWS 1", "#define ROWS 2"), "90")
    assert len(compiled) == 3 and len(list((tmp_path / "kernels").iterdir())) == 3


def test_a_read_only_cache_folder_only_costs_the_compile(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    compiled = fake_compiler(monkeypatch, tmp_path)
    (tmp_path / "kernels").write_text("a file where the folder should be")
    source = _defines(CudaGemvConfig(1, 8, 2), 1, 8, 128) + SOURCE
    assert cuda_gemv._cubin(source, "90").startswith(b"cubin sm_90")
    assert compiled == [source]


def test_prepare_compiles_every_variant_the_products_launch(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """prepare (called before graph capture) compiles, once each, exactly the variants that
    mma_gemv then asks for at 1..MAX_ROWS rows with the default configs, for weights of every
    form (4-bit factored and plain, 8-bit Q6_K and Q8_0 layouts, an odd N), plus the
    self-check's; weights the kernel does not read are left out."""
    from sgl.backend.quant.factored import factor
    from sgl.backend.quant.install import _random_qweight

    compiled = fake_compiler(monkeypatch, tmp_path)
    cpu = torch.device("cpu")
    weights = [factor(_random_qweight(4096, 4096, 4, 32, cpu, 0)),
               factor(_random_qweight(4096, 4096, 4, 32, cpu, 1)),  # (the same variants)
               _random_qweight(1000, 800, 4, 32, cpu, 2),
               factor(_random_qweight(512, 768, 8, 16, cpu, 3)),
               _random_qweight(40, 224, 8, 32, cpu, 4),
               _random_qweight(8, 256, 4, 32, cpu, 5)]  # (fewer than 16 rows: not served)
    count = cuda_gemv.prepare(weights, torch.device("cuda", 0), threads=4)
    assert count == len(compiled) == len(set(compiled))

    launched: set[str] = set()

    def kernel(variant: tuple, device: int) -> None:
        launched.add(_defines(*variant) + SOURCE)
        raise Compiled

    def launches(cases: list) -> set[str]:
        launched.clear()
        for w, rows in cases:
            with pytest.raises(Compiled):
                cuda_gemv.mma_gemv(torch.zeros(rows, w.in_features, dtype=torch.bfloat16), w)
        return set(launched)

    monkeypatch.setattr(cuda_gemv, "_kernel", kernel)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    served = [w for w in weights if cuda_gemv.serves(w)]
    assert len(served) == len(weights) - 1
    model = launches([(w, rows) for w in served for rows in range(1, MAX_ROWS + 1)])
    check = launches([(w, rows) for w in cuda_gemv._self_check_weights("cpu")
                      for rows in cuda_gemv.SELF_CHECK_ROWS])
    assert set(compiled) == model | check


@pytest.mark.parametrize("tied", [True, False])
def test_the_engine_prepares_the_projections_and_the_head_not_the_table(
        tied: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """linear.prepare_cuda_kernels hands cuda_gemv.prepare every quantized projection and the
    LM head, once each; an untied embedding table, only ever looked up, costs no compile."""
    from transformers import LlamaConfig

    from sgl.backend.models.registry import get_model_class, resolve_architecture
    from sgl.backend.quant import linear
    from sgl.backend.quant.install import install_random_quantized

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    model = get_model_class(resolve_architecture(cfg))(cfg, device=torch.device("cpu"),
                                                       dtype=torch.bfloat16)
    install_random_quantized(model, 0)
    given: list = []
    monkeypatch.setattr(linear.cuda_gemv, "prepare",
                        lambda weights, device: given.extend(weights) or len(given))
    assert linear.prepare_cuda_kernels(model, torch.device("cuda", 0), torch.bfloat16) == 9
    head, table = model.lm_head.qweight, model.model.embed_tokens.qweight
    assert sum(w is head for w in given) == 1
    assert tied or not any(w is table for w in given)
    assert linear.prepare_cuda_kernels(model, torch.device("cuda", 0), torch.float16) == 0
