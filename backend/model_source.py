"""Models by name: a Hugging Face model id -> a local path, through `huggingface_hub`.

`EngineConfig.model` (and `tokenizer`) may be:

- a local folder or `.gguf` file: used as is (a local path always wins over a hub id);
- `"org/name"`: the repository's snapshot (config, tokenizer and weight files) at `revision`;
- `"org/name/file.gguf"`: one GGUF file of the repository (a path inside it, ending in
  `.gguf`), e.g. `"bartowski/Qwen2.5-0.5B-Instruct-GGUF/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf"`.

`huggingface_hub` does the resolving, so its conventions hold unchanged: its cache
(`HF_HUB_CACHE` / `HF_HOME`), offline mode (`HF_HUB_OFFLINE=1`: only the cache is read), and
its token (`HF_TOKEN` or the one `hf auth login` stored) for gated or private repos.
Every failure is a `ModelLoadError` that says what to do.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sgl.errors import ModelLoadError

if TYPE_CHECKING:
    from sgl.config import EngineConfig

__all__ = ["resolve_model_source", "resolve_hub_model", "parse_hub_id", "HubId"]

# org/name, then optionally a path inside the repository that ends in .gguf. Hub names are
# letters, digits, '-', '_' and '.', and never start with '.' or contain '..'.
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB_ID = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?:/(?P<file>(?:{_NAME}/)*{_NAME}\.gguf))?$")
# What a model folder needs; a snapshot skips the rest (other formats, pictures, ONNX, ...).
_FOLDER_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


class HubId:
    """A parsed model id: the repository and, for a GGUF, the file inside it."""

    def __init__(self, repo: str, filename: str | None) -> None:
        self.repo, self.filename = repo, filename

    def __repr__(self) -> str:
        return f"HubId({self.repo!r}, {self.filename!r})"


def parse_hub_id(model: str) -> HubId | None:
    """`model` as a hub id, or None when it cannot be one (or names an existing local path)."""
    if Path(model).expanduser().exists() or ".." in model:
        return None
    m = _HUB_ID.match(model)
    return None if m is None else HubId(m["repo"], m["file"])


def resolve_model_source(config: EngineConfig) -> EngineConfig:
    """`config` with hub ids in `model` and `tokenizer` replaced by local paths (downloaded, or
    read from the hub cache offline). Local paths, presets and None pass through unchanged."""
    changes: dict[str, Any] = {}
    for name in ("model", "tokenizer"):
        value = getattr(config, name)
        if value is not None and parse_hub_id(value) is not None:
            changes[name] = str(resolve_hub_model(value, config.revision))
    return config.replace(**changes) if changes else config


def resolve_hub_model(model: str, revision: str | None = None) -> Path:
    """The local path of hub id `model` at `revision` (a branch, tag or commit; None: main)."""
    hub = parse_hub_id(model)
    if hub is None:
        raise ModelLoadError(f"model {model!r} is not a Hugging Face model id (org/name or "
                             "org/name/file.gguf) nor an existing local path")
    try:
        import huggingface_hub as hf
    except ImportError:  # pragma: no cover - a dependency of transformers
        raise ModelLoadError(f"model {model!r} looks like a Hugging Face id, but huggingface_hub is "
                             "not installed: pip install huggingface_hub") from None
    try:
        if hub.filename is not None:
            return Path(hf.hf_hub_download(hub.repo, hub.filename, revision=revision))
        return Path(hf.snapshot_download(hub.repo, revision=revision, allow_patterns=_FOLDER_FILES))
    except Exception as exc:  # noqa: BLE001 - every hub failure becomes one clear error
        raise _hub_error(model, revision, exc) from exc


def _hub_error(model: str, revision: str | None, exc: Exception) -> ModelLoadError:
    from huggingface_hub import constants
    from huggingface_hub import errors as hub_errors

    at = f" at revision {revision!r}" if revision else ""
    offline = bool(constants.HF_HUB_OFFLINE)
    if isinstance(exc, hub_errors.LocalEntryNotFoundError) or (offline and isinstance(exc, FileNotFoundError)):
        how = (": HF_HUB_OFFLINE is set, so only the cache is read; download it once with "
               f"`hf download {_repo_of(model)}` on a connected machine, or unset HF_HUB_OFFLINE"
               if offline else " and the Hub could not be reached: check the network (or HF_ENDPOINT)")
        return ModelLoadError(f"model {model!r}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
                              f"{how}")
    if isinstance(exc, hub_errors.GatedRepoError):
        return ModelLoadError(f"model {model!r} is gated: accept its terms on huggingface.co and log in "
                              "(`hf auth login` or HF_TOKEN)")
    if isinstance(exc, hub_errors.RepositoryNotFoundError):
        return ModelLoadError(f"model {model!r}: no such repository on the Hub (or it is private: log in "
                              "with `hf auth login` or set HF_TOKEN)")
    if isinstance(exc, hub_errors.RevisionNotFoundError):
        return ModelLoadError(f"model {model!r}: revision {revision!r} does not exist")
    if isinstance(exc, hub_errors.EntryNotFoundError):
        return ModelLoadError(f"model {model!r}{at}: the repository has no such file")
    return ModelLoadError(f"model {model!r}{at} could not be fetched from the Hugging Face Hub: "
                          f"{type(exc).__name__}: {exc}")


def _repo_of(model: str) -> str:
    hub = parse_hub_id(model)
    if hub is None or hub.filename is None:
        return model
    return f"{hub.repo} {hub.filename}"
