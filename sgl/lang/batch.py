"""run_batch / arun_batch: many programs on one loop, with the shared prefix cached once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from typing import TYPE_CHECKING, Any, Sequence

from sgl.lang import context
from sgl.lang.backend import Prompt
from sgl.lang.state import ProgramState
from sgl.lang.tokens import TokenSequence

if TYPE_CHECKING:
    from sgl.lang.backend import Backend
    from sgl.lang.function import SglFunction

__all__ = ["run_batch", "cache_program"]

_MIN_PREFIX_CHARS = 64  # SGLang's threshold: shorter prefixes are not worth a request


async def cache_program(fn: SglFunction, backend: Backend) -> str:
    """Trace `fn`'s constant prefix and ask the backend to cache it; returns the prefix."""
    from sgl.lang.tracer import extract_prefix

    prefix = extract_prefix(fn, backend.get_chat_template())
    if len(prefix) > _MIN_PREFIX_CHARS:
        if backend.tokenizer is not None:
            tokens = TokenSequence(backend.tokenizer)
            tokens.append_text(prefix)
            prompt = Prompt(prefix, list(tokens.ids), tokens._prefix_len)
        else:
            prompt = Prompt(prefix)
        await backend.cache_prefix(prompt)
    return prefix


async def run_batch(fn: SglFunction, batch: Sequence[Any], backend: Any, num_threads: str | int,
                    progress_bar: bool, sampling: dict[str, Any]) -> list[ProgramState]:
    from sgl.lang.function import _split_sampling, check_batch_arguments

    if not isinstance(batch, (list, tuple)):
        raise TypeError("run_batch takes a list of argument dicts (or tuples)")
    if not batch:
        return []
    items = check_batch_arguments(fn, batch)
    defaults, unknown = _split_sampling(sampling)
    if unknown:
        raise TypeError(f"run_batch got unknown keyword arguments {sorted(unknown)}")
    resolved = context.resolve_backend(backend)
    loop = asyncio.get_running_loop()
    if len(items) > 1:
        try:
            await cache_program(fn, resolved)
        except Exception:  # noqa: BLE001 - caching is an optimisation; the programs report errors
            pass

    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 4) * 16)  # SGLang's default
    limit = max(1, min(int(num_threads), len(items)))
    gate = asyncio.Semaphore(limit)
    pool = None if fn.is_async else concurrent.futures.ThreadPoolExecutor(
        limit, thread_name_prefix="sgl-batch")
    bar = None
    if progress_bar:
        import tqdm

        bar = tqdm.tqdm(total=len(items))

    async def one(kwargs: dict[str, Any]) -> ProgramState:
        async with gate:
            state = fn._new_state(resolved, loop, kwargs, defaults, stream=False)
            if fn.is_async:
                await fn._run_async(state, (), kwargs)
            else:
                await loop.run_in_executor(pool, fn._run_sync_body, state, (), kwargs)
            if bar is not None:
                bar.update(1)
            return state

    try:
        return list(await asyncio.gather(*(one(kw) for kw in items)))
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.shutdown(wait=False)
