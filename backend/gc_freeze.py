"""Keep the cyclic garbage collector off the objects that live as long as an engine.

    hold()      # a Runtime is ready: freeze what is alive now
    release()   # that Runtime closed: the last one out unfreezes

By the time an engine is ready the process holds a few hundred thousand GC-tracked objects
(torch, transformers, the tokenizer, the model's modules: ~230k for the default model, ~310k
with a 128k-entry vocabulary), none of which the serving loop frees. Python's oldest-generation
collection walks all of them whenever enough new long-lived objects have piled up, and while
it runs no step is scheduled: measured on the 2-core VM, a single such pass took 0.64 s in the
middle of a 128-request JSON batch (`bench/gpu_json.py --cpu` shapes), and the GPU loop stalls
the same way, its device idle. `gc.freeze()` moves everything alive into the permanent
generation, which collections skip; the pass then walks only what the loop created since.

Freezing costs nothing (no collection: right after loading, a collection finds no garbage)
and changes no object's lifetime except one: an object frozen now that later becomes part of
an unreachable reference cycle is not collected while frozen. That is why the freeze is held
only while an engine is open, and undone when the last one closes (and at interpreter exit,
so that extension modules' leak checks do not see frozen survivors). The freeze is
process-wide: an application that calls `gc.freeze()` itself should know that closing the
last engine unfreezes.
"""

from __future__ import annotations

import atexit
import gc
import threading

__all__ = ["hold", "release"]

_lock = threading.Lock()
_holders = 0


def hold() -> None:
    """An engine is ready: freeze every object alive now (again, if others were frozen)."""
    global _holders
    with _lock:
        _holders += 1
        gc.freeze()


def release() -> None:
    """An engine closed: when it was the last open one, unfreeze."""
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0:
            gc.unfreeze()


def _at_exit() -> None:
    global _holders
    with _lock:
        if _holders:
            _holders = 0
            gc.unfreeze()


atexit.register(_at_exit)
