"""What every route needs, built once by `create_app` and kept on `app.state.sgl`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from sgl.backend.server.driver import Driver
from sgl.backend.server.metrics import Metrics
from sgl.backend.server.protocol import TokenTexts

__all__ = ["ServerContext", "context_of"]


@dataclass
class ServerContext:
    engine: Any  # an sgl.Engine (typed loosely: the server only uses its public facade)
    model_name: str
    model_path: str
    metrics: Metrics
    driver: Driver
    texts: TokenTexts
    api_key: str | None = None
    started: float = field(default_factory=time.time)


def context_of(request: Request) -> ServerContext:
    return request.app.state.sgl
