"""Tokenizer loading (only loading: encoding and detokenizing live with their users).

A GGUF file's tokenizer is rebuilt from its metadata by transformers (gguf_metadata.py keeps
that under a second for the default model; other files can take seconds), so the result is
saved next to the file's dequantized weights and loaded from there later.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

from sgl.backend.gguf_metadata import tokenizer_from_gguf
from sgl.backend.model_loader import gguf_cache_folder
from sgl.errors import ModelLoadError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False)`, through a fast tokenizer's own
    `tokenizers.Tokenizer` when it has one: the same ids at a third to a half of the wrapper's
    cost (the engine thread calls this inside a step: jump planning, text drafts)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def decode_ids(tokenizer: Any, ids: Sequence[int]) -> str:
    """`tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)`,
    through the fast tokenizer's backend likewise (no clean-up: it rewrites spaces before
    punctuation)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode(list(ids), skip_special_tokens=False)
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def load_tokenizer(model_path: Path, tokenizer: str | None = None, cache: str | None = None) -> Any | None:
    """A transformers tokenizer for the model, or None when there is none (dummy weights).

    `tokenizer` (a folder or a .gguf file) overrides the model's own.
    """
    from transformers import AutoTokenizer

    source = Path(tokenizer).expanduser() if tokenizer is not None else Path(model_path)
    if source.is_file() and source.suffix == ".gguf":
        return _gguf_tokenizer(source, cache)
    if source.is_dir() and any((source / name).is_file() for name in _TOKENIZER_FILES):
        try:
            return AutoTokenizer.from_pretrained(source)
        except Exception as exc:
            raise ModelLoadError(f"could not load the tokenizer in {source}: {exc}") from exc
    if tokenizer is not None:
        raise ModelLoadError(
            f"tokenizer {tokenizer!r}: expected a folder with tokenizer files "
            f"({', '.join(_TOKENIZER_FILES)}) or a .gguf file"
        )
    return None  # e.g. a dummy preset: the engine then works on token ids only


def _gguf_tokenizer(path: Path, cache: str | None) -> Any:
    from transformers import AutoTokenizer

    cached = gguf_cache_folder(path, cache) / "tokenizer"
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    try:
        tok = tokenizer_from_gguf(path)
    except Exception as exc:
        raise ModelLoadError(f"could not read the tokenizer of {path}: {exc}") from exc
    cached.parent.mkdir(parents=True, exist_ok=True)
    # Save into a temporary sibling, then rename: readers never see a half-written folder.
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tokenizer-"))
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, cached)
    except OSError:  # another process won the race; its copy is as good
        pass
    return tok
