"""A GGUF file's HF config and tokenizer, read without parsing its whole metadata twice.

transformers builds both from a GGUF through `load_gguf_checkpoint`, which runs `gguf`'s
GGUFReader over every metadata element (for SmolLM2's 49k-token vocabulary and 48k merges,
~300k numpy views: 6-9 s each on a small CPU, and `AutoTokenizer` does it once more just to
learn the model type). transformers also ships a fast metadata reader
(`integrations.gguf.read_gguf_metadata`, arrays left as counts unless asked for) and the key
tables the slow path applies; for the architectures below sgl applies those same tables to
the fast reader's output, and builds the tokenizer with the class `AutoTokenizer` would pick.
Everything else, and a transformers without the fast reader, takes the slow path.
tests/test_gguf_metadata.py checks both against the slow path on the default model.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

__all__ = ["config_from_gguf", "gguf_config_dict", "light_config_from_gguf", "tokenizer_from_gguf"]

# Architectures whose config the slow path builds from the key table alone (no special case
# in `load_gguf_checkpoint`: those exist for mistral-named llama files, t5, stablelm, gemma,
# lfm2, gpt-oss, minimax and the MoE variants).
_TABLE_ONLY = ("llama", "qwen2", "qwen3")


def gguf_config_dict(path: Path) -> dict[str, Any] | None:
    """The config dict `load_gguf_checkpoint(path)["config"]` returns, read fast; None where
    this shortcut does not apply (the caller then takes transformers' own path)."""
    stat = path.stat()
    fields = _config_dict(str(path), stat.st_size, stat.st_mtime_ns)
    return None if fields is None else dict(fields)


@functools.lru_cache(maxsize=4)  # the config and the tokenizer read the same file in one load
def _config_dict(path_name: str, _size: int, _mtime_ns: int) -> dict[str, Any] | None:
    path = Path(path_name)
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
        from transformers.integrations.gguf import read_gguf_metadata
    except ImportError:  # an older transformers: no fast reader
        return None
    metadata, tensor_names = read_gguf_metadata(str(path))
    architecture = metadata.get("general.architecture")
    name = str(metadata.get("general.name", "")).lower()
    if architecture not in _TABLE_ONLY or (architecture == "llama" and "mistral" in name):
        return None
    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture, {}).items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed is not None and renamed != -1:
            config[renamed] = value
    return config


def config_from_gguf(path: Path) -> Any:
    """The transformers config of a GGUF file (what `AutoConfig.from_pretrained` returns)."""
    from transformers import AutoConfig

    fields = gguf_config_dict(path)
    if fields is None:
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[fields["model_type"]].from_dict(fields)
    config.name_or_path = str(path.parent)  # (as from_pretrained records the folder)
    return config


def light_config_from_gguf(path: Path) -> Any | None:
    """The GGUF's config fields on a plain `PretrainedConfig`, for the engine's own model
    build (None where `gguf_config_dict` does not apply).

    Why not the model type's config class: transformers' llama/qwen config modules import its
    type validators, which pull in `torch.distributed.tensor` and sympy: 1-2 s and ~55 MB
    on a small CPU, for a config the engine reads a dozen plain fields of. Fields the file
    lacks read as the engine's defaults, which are the config classes' (no attention or MLP
    bias, head_dim = hidden / heads, rope_theta as stored): tests/test_gguf_metadata.py
    checks that what the engine derives from both is the same."""
    fields = gguf_config_dict(path)
    if fields is None:
        return None
    from transformers import PretrainedConfig

    config = PretrainedConfig(**fields)  # (model_type is kept as an attribute)
    config.name_or_path = str(path.parent)
    return config


def tokenizer_from_gguf(path: Path) -> Any:
    """The tokenizer of a GGUF file (what `AutoTokenizer.from_pretrained` returns)."""
    from transformers import AutoTokenizer

    fields = gguf_config_dict(path)
    # AutoTokenizer's choice for a llama config with no tokenizer_config.json beside the file
    # (the model type has no tokenizer class of its own): the generic backend.
    if (fields is not None and fields.get("model_type") == "llama"
            and not (path.parent / "tokenizer_config.json").exists()):
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:
            pass
        else:
            return TokenizersBackend.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
