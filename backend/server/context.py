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
    """Why the engine cannot serve (closed, or its thread died), or None when it can: a dead
    engine thread must turn /health red so a supervisor restarts the process."""
    return engine.problem
