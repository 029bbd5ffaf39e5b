"""Shared pytest fixtures. Async tests use anyio: mark them `@pytest.mark.anyio`."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


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
