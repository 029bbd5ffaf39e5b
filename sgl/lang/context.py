"""The default backend (`sgl.set_default_backend`) and turning what a user passes into a Backend.

An `sgl.Engine` (or anything shaped like one: `generate`, `encode`, `tokenizer`) is wrapped in
`EngineBackend` on first use; the wrapper is cached per engine so its chat template is derived
once. The engine module is never imported here, so `import sgl.lang` stays free of torch.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from sgl.errors import InvalidRequestError
from sgl.lang.backend import Backend

__all__ = ["set_default_backend", "get_default_backend", "resolve_backend"]

_default: Backend | None = None
_wrappers: weakref.WeakKeyDictionary[Any, Backend] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def set_default_backend(backend: Any) -> None:
    """Use `backend` (a Backend or an sgl.Engine) for programs run without `backend=`."""
    global _default
    _default = None if backend is None else as_backend(backend)


def get_default_backend() -> Backend | None:
    return _default


def looks_like_engine(obj: Any) -> bool:
    return all(callable(getattr(obj, name, None)) for name in ("generate", "encode")) and hasattr(
        obj, "tokenizer")


def as_backend(obj: Any) -> Backend:
    if isinstance(obj, Backend):
        return obj
    endpoint = getattr(obj, "endpoint", None)  # SGLang's Runtime wraps its backend this way
    if isinstance(endpoint, Backend):
        return endpoint
    if not looks_like_engine(obj):
        raise InvalidRequestError(
            f"{type(obj).__name__} is not a backend: pass an sgl.Engine or an "
            f"sgl.lang.Backend (e.g. FakeBackend for tests)", field="backend")
    with _lock:
        try:
            cached = _wrappers.get(obj)
        except TypeError:  # unhashable or not weak-referenceable: wrap every time
            cached = None
        if cached is None:
            from sgl.lang.engine_backend import EngineBackend

            cached = EngineBackend(obj)
            try:
                _wrappers[obj] = cached
            except TypeError:
                pass
        return cached


def resolve_backend(backend: Any) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if _default is None:
        raise InvalidRequestError(
            "no backend: call sgl.set_default_backend(engine) or pass backend= to run()",
            field="backend")
    return _default
