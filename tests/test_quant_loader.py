"""Loading a GGUF file quantized (model_loader.py with quantization="gguf", backend/quant/):
every weight equals the float path's dequantized weight exactly (formats, the llama q/k row
order, fused q|k|v and gate|up), the tied head is one quantized table, no float cache is
written, and the engine option resolves as documented."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from test_quant_formats import random_blocks

from sgl.backend import model_loader
from sgl.backend.model_loader import load_model
from sgl.backend.quant import FORMATS, cpu_build, cpu_kernel, cpu_ops
from sgl.backend.quant.gguf_file import open_gguf
from sgl.backend.runtime import resolve_device
from sgl.config import EngineConfig
from sgl.errors import InvalidConfigError

CPU = torch.device("cpu")
HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, VOCAB = 256, 2, 4, 2, 512, 64
# Each projection in its own format, so fused layers mix formats (layer 0's q|k|v: Q4_K, Q6_K,
# Q5_K, as a Q4_K_M file does; layer 1's the 2-3 bit K-quants, Q5_1 and IQ4_XS); IQ2_XXS has
# no kernel and must load as float.
LAYER_FORMATS = [
    {"attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q5_K", "attn_output": "Q4_0",
     "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "IQ2_XXS"},
    {"attn_q": "Q3_K", "attn_k": "Q2_K", "attn_v": "Q5_1", "attn_output": "Q5_0",
     "ffn_gate": "IQ4_XS", "ffn_up": "Q3_K", "ffn_down": "IQ4_NL"},
]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "sgl-cache"
    monkeypatch.setenv("SGL_CACHE_DIR", str(folder))
    return folder


def _write_tiny_gguf(path: Path, tied: bool) -> Path:
    writer = GGUFWriter(str(path), "llama")
    for add, value in [(writer.add_context_length, 128), (writer.add_embedding_length, HIDDEN),
                       (writer.add_block_count, LAYERS), (writer.add_feed_forward_length, INTER),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-5),
                       (writer.add_vocab_size, VOCAB), (writer.add_bos_token_id, 1),
                       (writer.add_eos_token_id, 2)]:
        add(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    rng = np.random.default_rng(0)
    seed = iter(range(1000))

    def add(name: str, fmt: str, rows: int, cols: int = 0) -> None:
        if fmt == "F32":
            writer.add_tensor(name, (rng.standard_normal(rows) * 0.1).astype(np.float32))
        elif fmt == "IQ2_XXS":  # (256 weights in 66 bytes: an fp16 scale, then 64 bytes)
            raw = rng.integers(0, 256, (rows, cols // 256, 66), dtype=np.uint8)
            d = rng.normal(0, 0.05, (rows, cols // 256)).astype(np.float16)
            raw[..., 0:2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
            writer.add_tensor(name, raw.reshape(rows, -1),
                              raw_dtype=GGMLQuantizationType.IQ2_XXS)
        else:
            writer.add_tensor(name, random_blocks(fmt, rows, cols, next(seed)),
                              raw_dtype=GGMLQuantizationType[fmt])

    add("token_embd.weight", "Q8_0", VOCAB, HIDDEN)
    if not tied:
        add("output.weight", "Q6_K", VOCAB, HIDDEN)
    add("output_norm.weight", "F32", HIDDEN)
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", "F32", HIDDEN)
        add(f"blk.{i}.ffn_norm.weight", "F32", HIDDEN)
        for proj, fmt in LAYER_FORMATS[i].items():
            add(f"blk.{i}.{proj}.weight", fmt, *shapes[proj])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny_gguf(tmp_path_factory.mktemp("qgguf") / "tiny.gguf", request.param)


def test_reader_matches_the_gguf_package(tiny_gguf: Path) -> None:
    from gguf import GGUFReader

    ours = open_gguf(tiny_gguf)
    theirs = GGUFReader(str(tiny_gguf))
    assert ours.architecture == "llama"
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.type_name == b.tensor_type.name
        assert a.shape == tuple(int(d) for d in reversed(b.shape.tolist()))
        assert np.array_equal(a.data.reshape(-1), np.asarray(b.data).view(np.uint8).reshape(-1))


def _resident_kb(path: Path) -> int | None:
    """Resident KiB of this process's maps of `path` (/proc/self/smaps), None without it."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    total, inside = 0, False
    for line in lines:
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            inside = line.endswith(str(path))
        elif inside and head[0] == "Rss:":
            total += int(head[1])
    return total


def test_installing_hands_the_files_pages_back(tiny_gguf: Path, cache: Path) -> None:
    """The loader copies each tensor out of the memory-mapped file and then gives its pages
    back (GGUFTensor.drop): the file is not resident beside the weights built from it."""
    from sgl.backend.quant.gguf_weights import read_gguf
    from sgl.backend.quant.install import install_quantized

    if _resident_kb(tiny_gguf) is None:
        pytest.skip("no /proc/self/smaps here")
    module, config = model_loader._build(model_loader._gguf_config(tiny_gguf, str(cache)), CPU,
                                         torch.float32, [])
    tensors = read_gguf(tiny_gguf, config.num_heads, config.num_kv_heads)
    for t in tensors.values():
        t.raw.float().sum()  # every byte read: the map's pages are resident
    size_kb = tiny_gguf.stat().st_size // 1024
    assert _resident_kb(tiny_gguf) >= size_kb // 2
    install_quantized(module, tensors)
    assert _resident_kb(tiny_gguf) == 0
    assert any(t.raw.numel() for t in tensors.values())  # (the tensors, and the map, live on)


def test_quantized_load_equals_the_float_path(tiny_gguf: Path, cache: Path) -> None:
    quant, config = load_model(str(tiny_gguf), device=CPU, dtype=torch.float32,
                               quantization="gguf")
    assert not (model_loader.gguf_cache_folder(tiny_gguf) / "model.safetensors").exists()
    float_model, _ = load_model(str(tiny_gguf), device=CPU, dtype=torch.float32)
    reference = dict(float_model.named_parameters())
    layer = quant.model.layers[0]
    assert layer.self_attn.qkv_proj.qweight.source_format == "mixed"
    assert layer.mlp.gate_up_proj.qweight.source_format == "Q4_1"
    assert layer.mlp.down_proj.qweight is None  # IQ2_XXS: no kernel, loaded as float
    assert quant.model.layers[1].mlp.gate_up_proj.qweight.source_format == "mixed"
    checked = 0
    for name, module in quant.named_modules():
        qweight = getattr(module, "qweight", None)
        if qweight is not None:
            assert torch.equal(qweight.dequantize(), reference[f"{name}.weight"]), name
            checked += 1
    assert checked == 1 + 3 + 4 + (0 if config.tie_word_embeddings else 1)
    for name, param in quant.named_parameters():
        assert torch.equal(param, reference[name]), name
    if config.tie_word_embeddings:
        assert quant.lm_head is quant.model.embed_tokens and quant.lm_head.weight is None


def test_quantized_forward_equals_the_float_forward(tiny_gguf: Path, cache: Path) -> None:
    from test_attention_torch import FakePool, Step, make_forward_batch

    from sgl.backend.attention.torch_backend import TorchAttentionBackend
    from sgl.backend.forward_batch import ForwardMode

    logits = []
    for quantization in ("gguf", "none"):
        model, config = load_model(str(tiny_gguf), device=CPU, dtype=torch.float32,
                                   quantization=quantization)
        pool = FakePool(LAYERS, 64, KV_HEADS, HIDDEN // HEADS, max_context=32)
        fb = make_forward_batch(pool, TorchAttentionBackend(), [Step(1, 0, [3, 9, 4, 17, 5])],
                                ForwardMode.EXTEND)
        logits.append(model.compute_logits(model(fb)))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


@pytest.fixture
def cpu_kernels_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C kernels as loaded (a stand-in library: resolving never calls into it)."""
    monkeypatch.setattr(cpu_kernel, "_resolved", [object()])


@pytest.fixture
def no_cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The C kernels as a machine without a C compiler has them: not at all."""
    why = "a test's stand-in for a machine without a compiler"
    monkeypatch.setattr(cpu_kernel, "_resolved", [None])
    monkeypatch.setattr(cpu_kernel, "_why", [why])
    cpu_kernel.likely_available.cache_clear()
    yield why
    cpu_kernel.likely_available.cache_clear()  # (recomputed once the library is back)


@pytest.mark.parametrize(("device", "dtype", "option", "expected"), [
    ("cpu", "auto", "auto", "gguf"),
    ("cpu", "float32", "auto", "none"),  # an explicit dtype asks for float weights
    ("cpu", "bfloat16", "gguf", "gguf"),
    ("cpu", "auto", "none", "none"),
])
def test_quantization_option_resolves(device: str, dtype: str, option: str, expected: str,
                                      cpu_kernels_serve: None) -> None:
    config = resolve_device(EngineConfig(device=device, dtype=dtype, quantization=option))
    assert config.quantization == expected


def test_without_the_cpu_kernels_auto_loads_float_weights(
        no_cpu_kernels: str, caplog: pytest.LogCaptureFixture) -> None:
    """Quantized products without the C kernels dequantize every weight each time (the
    default model 3.5 tok/s against 23 for float32 weights): "auto" takes float weights
    there and says why; an explicit "gguf" is kept and warned about; int8 activations, which
    only the C kernels compute, are refused before anything loads."""
    with caplog.at_level(logging.WARNING, logger="sgl.engine"):
        assert resolve_device(EngineConfig(device="cpu")).quantization == "none"
    assert no_cpu_kernels in caplog.text and "float32" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sgl.engine"):
        assert resolve_device(EngineConfig(device="cpu", quantization="gguf")).quantization \
            == "gguf"
    assert no_cpu_kernels in caplog.text and "dequantizes its whole weight" in caplog.text
    with pytest.raises(InvalidConfigError, match="cannot run here.*without a compiler"):
        resolve_device(EngineConfig(device="cpu", quantization="gguf",
                                    activation_quantization="int8"))


@pytest.mark.parametrize(("flags", "builds", "f16c"), [
    ({"sse2", "avx", "avx2", "fma", "f16c"}, True, True),
    ({"sse2", "avx", "fma", "f16c"}, False, True),  # no AVX2: the AVX2 build cannot run
    ({"sse2", "avx2", "fma"}, False, False),  # no F16C: nor can float16 pools
    (None, True, False),  # no /proc/cpuinfo (not Linux): the build and its CPU check decide
])
def test_the_x86_library_is_expected_where_the_cpu_lists_its_features(
        monkeypatch: pytest.MonkeyPatch, flags: set[str] | None, builds: bool,
        f16c: bool) -> None:
    monkeypatch.setattr(cpu_kernel, "_resolved", [])  # (not yet loaded)
    monkeypatch.setattr(cpu_build, "supported_machine", lambda: True)
    monkeypatch.setattr(cpu_build, "portable", lambda: False)
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: None if flags is None else frozenset(flags))
    cpu_kernel.likely_available.cache_clear()
    cpu_ops._has_f16c.cache_clear()
    try:
        assert cpu_kernel.likely_available() is builds
        assert cpu_ops._has_f16c() is f16c
    finally:
        cpu_kernel.likely_available.cache_clear()
        cpu_ops._has_f16c.cache_clear()


def test_the_cpu_kernels_say_why_they_cannot_run(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setattr(cpu_kernel, "_why", [])
    monkeypatch.setattr(cpu_kernel.platform, "machine", lambda: "riscv64")
    assert cpu_kernel._load() is None
    assert cpu_kernel._why == ["the CPU is riscv64; the kernels build for x86-64 and 64-bit ARM"]
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernel, "_why", [])
    monkeypatch.setattr(cpu_kernel, "_packaged_library", lambda: None)
    monkeypatch.setenv("SGL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert cpu_kernel._load() is None
    assert cpu_kernel._why[0].startswith("the C library could not be built or loaded: ")


def test_quantization_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF stays quantized on CUDA when asked (Triton kernels); "auto" keeps float weights
    there; fp8 is CUDA-only; a dummy model is float unless asked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for option, expected in (("gguf", "gguf"), ("fp8", "fp8"), ("auto", "none")):
        assert resolve_device(EngineConfig(device="cuda", quantization=option)).quantization \
            == expected
    assert resolve_device(EngineConfig(device="cpu", model="smollm2-135m")).quantization == "none"
    with pytest.raises(InvalidConfigError, match="load_format='safetensors'"):
        resolve_device(EngineConfig(device="cuda", quantization="gguf", load_format="safetensors"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "auto" means the CPU
    with pytest.raises(InvalidConfigError, match="quantization='fp8' needs a CUDA device"):
        resolve_device(EngineConfig(device="auto", quantization="fp8"))
    with pytest.raises(InvalidConfigError, match="quantization"):
        EngineConfig(device="cpu", quantization="fp8")


def test_explicit_gguf_with_a_model_folder_is_refused_before_loading(tmp_path: Path) -> None:
    import sgl

    (tmp_path / "config.json").write_text("{}")  # a folder: never read, refused first
    with pytest.raises(InvalidConfigError, match="is a model folder"):
        sgl.Engine(model=str(tmp_path), device="cpu", quantization="gguf")


def test_bad_quantization_value_names_the_choices() -> None:
    with pytest.raises(InvalidConfigError, match="quantization"):
        EngineConfig(quantization="int4")  # type: ignore[arg-type]


def test_every_kernel_format_is_written_by_this_file() -> None:
    written = {fmt for layer in LAYER_FORMATS for fmt in layer.values()} | {"Q8_0", "Q6_K"}
    assert written >= set(FORMATS)


def test_random_q4_k_m_layout_widens_v_and_down_of_about_half_the_layers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Dummy models (the GPU bench's 8B): RANDOM_LAYOUT "q4_k_m" gives the fused q|k|v and the
    down projection 8-bit codes in groups of 16 (Q6_K) in the layers a Q4_K_M file widens
    (first and last eighth, every third between), 4-bit groups of 32 elsewhere and in every
    other Linear; "q4_k" keeps every Linear 4-bit."""
    from transformers import LlamaConfig

    from sgl.backend.models.registry import get_model_class, resolve_architecture
    from sgl.backend.quant import install

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=16, num_attention_heads=2, num_key_value_heads=1)
    for layout in ("q4_k", "q4_k_m"):
        model = get_model_class(resolve_architecture(cfg))(cfg, device=torch.device("cpu"),
                                                           dtype=torch.float32)
        monkeypatch.setattr(install, "RANDOM_LAYOUT", layout)
        install.install_random_quantized(model, 0)
        wide = []
        for i, layer in enumerate(model.model.layers):
            assert layer.self_attn.o_proj.qweight.bits == 4
            assert layer.mlp.gate_up_proj.qweight.bits == 4
            qkv, down = layer.self_attn.qkv_proj.qweight, layer.mlp.down_proj.qweight
            assert (qkv.bits, qkv.group_size) == (down.bits, down.group_size)
            if qkv.bits == 8:
                assert qkv.group_size == 16
                wide.append(i)
        # 16 layers: 0-1 and 14-15, and 2 + 3j + 2 between
        assert wide == ([] if layout == "q4_k" else [0, 1, 4, 7, 10, 13, 14, 15])
