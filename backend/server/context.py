"""What every route needs, built once by `create_app` and kept on `app.state.sgl`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from sgl.backend.server.driver import Driver
from sgl.backend.server.metrics import Metrics
from sgl.backend.server.options import ServerOptions
from sgl.backend.server.protocol import TokenTexts, read_json

__all__ = ["ServerContext", "context_of", "engine_problem"]


@dataclass
class ServerContext:
    engine: Any  # an sgl.Engine (typed loosely: the server only uses its public facade)
    model_name: str
    model_path: str
    metrics: Metrics
    driver: Driver
    texts: TokenTexts
    api_key: str | None = None
    options: ServerOptions = field(default_factory=ServerOptions)
    started: float = field(default_factory=time.time)

    async def read_body(self, request: Request) -> dict[str, Any]:
        """The request's JSON object, within the size, depth and time limits."""
        opts = self.options
        return await read_json(request, opts.max_body_bytes, opts.max_json_depth, opts.header_timeout)


def context_of(request: Request) -> ServerContext:
    return request.app.state.sgl


def engine_problem(engine: Any) -> str | None:
    """Why the engine cannot serve (closed, or its thread died), or None when it can.

    `sgl.Engine` has no public liveness property, so this reads the engine core's through
    the runtime the server is hosted on (`engine._rt.core`): a dead engine thread must turn
    /health red so a supervisor restarts the process, and `engine.closed` alone stays False
    after a crash.
    """
    if engine.closed:
        return "the engine is closed"
    core = getattr(getattr(engine, "_rt", None), "core", None)
    if core is not None and not core.alive:
        cause = getattr(core, "fatal_error", None)
        return "the engine thread stopped" + (f" after a crash: {cause!r}" if cause is not None else "")
    return None
