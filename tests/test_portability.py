"""What sgl does where Linux's facilities are missing (macOS, Windows), simulated on Linux:
the memory figures of `engine.stats()` and the server's connection cap."""

from __future__ import annotations

import builtins
import sys
from typing import Any

import pytest

from sgl.backend import runtime


def test_macos_memory_figures_are_the_peak_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """macOS has no /proc and gives ru_maxrss in bytes (Linux: KiB): the current figure is
    unknown (0) and the peak is read in the right unit."""
    import resource

    real_open = builtins.open

    def no_proc(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    monkeypatch.setattr(runtime.sys, "platform", "darwin")
    monkeypatch.setattr(builtins, "open", no_proc)
    rss, peak = runtime._process_memory()
    monkeypatch.undo()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert rss == 0
    assert before <= peak <= after  # (Linux's KiB, read as macOS bytes: the unit is not scaled)
    rss, peak = runtime._process_memory()
    assert 0 < rss <= peak and peak >= after * 1024


def test_without_the_resource_module_the_server_keeps_its_connection_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows has no `resource` module: the server starts with the cap it was asked for."""
    from sgl.backend.server import http_server

    monkeypatch.setitem(sys.modules, "resource", None)  # (import resource: ImportError)
    assert http_server.connection_cap(10_000) == 10_000
    monkeypatch.undo()
    assert 1 <= http_server.connection_cap(10) <= 10
