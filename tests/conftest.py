"""Shared pytest fixtures. Async tests use anyio: mark them `@pytest.mark.anyio`."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def default_tokenizer():  # noqa: ANN201 - a transformers tokenizer
    """The default model's tokenizer (SmolLM2, read from its GGUF; no weights are loaded).

    Found the way `sgl.Engine()` finds the model: installed, cached, or fetched on first use.
    Never skipped: without it the tokenizer-level tests would silently not run."""
    from sgl.backend.model_loader import resolve_model_path
    from sgl.backend.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path(None))


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing entirely
        return False


def pytest_collection_modifyitems(config, items):  # noqa: ANN001 - pytest hook signature
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
