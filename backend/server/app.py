"""The HTTP server: a Starlette app hosting one in-process `sgl.Engine`.

    app = create_app(engine, api_key="secret")        # any ASGI server can run it
    await serve(engine, host="127.0.0.1", port=30000)  # or uvicorn with our limits (http_server.py)

The engine computes on its own thread; the routes only validate, submit and relay, so one
event loop serves many concurrent requests. Cancelling a route's task (client disconnect)
cancels its engine streams, which aborts the requests and frees their KV.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from sgl.backend.server import native_routes, openai_routes
from sgl.backend.server.context import ServerContext
from sgl.backend.server.driver import Driver
from sgl.backend.server.guard import LocalGuard
from sgl.backend.server.metrics import Metrics
from sgl.backend.server.options import ServerOptions
from sgl.backend.server.protocol import ApiError, TokenTexts

__all__ = ["create_app"]

logger = logging.getLogger("sgl.server")

# Routes a load balancer or orchestrator probes without credentials.
_OPEN_PATHS = frozenset({"/health"})


class _ApiKeyMiddleware:
    """Require `Authorization: Bearer KEY` on every route but /health (plain ASGI, so
    streaming responses pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self._expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self._expected):  # constant time: no key oracle
            why = "missing API key" if not given else "invalid API key"
            response = ApiError(401, f"{why}: send the header 'Authorization: Bearer <key>'",
                                type="authentication_error", code="invalid_api_key").response()
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _model_path(engine: Any) -> str:
    return str(engine.config.model) if engine.config.model else "default"


def create_app(engine: Any, api_key: str | None = None, model_name: str | None = None,
               options: ServerOptions | None = None) -> Starlette:
    """A Starlette app serving `engine` with the OpenAI and SGLang native protocols.

    `api_key`: when set, every route but /health needs `Authorization: Bearer <api_key>`;
    without one, requests from other web pages and foreign Host names are refused (guard.py).
    `model_name`: the name /v1/models reports (default: the model folder or file name).
    `options`: request bounds and safety lists (`ServerOptions`; its defaults when omitted); a
    bound the engine's config also has is the engine's (`ServerOptions.for_engine`).
    The engine is not closed by the app; whoever created it owns it.
    """
    options = (options or ServerOptions()).for_engine(engine.config)
    metrics = Metrics(engine.stats)
    path = _model_path(engine)
    name = model_name or (Path(path).stem if path != "default" else "default")
    ctx = ServerContext(engine=engine, model_name=name, model_path=path, metrics=metrics,
                        driver=Driver(engine, metrics), texts=TokenTexts(engine.tokenizer), api_key=api_key,
                        options=options)

    async def metrics_route(request: Request) -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    routes = [Route(p, handler, methods=methods)
              for p, handler, methods in (*native_routes.routes_spec(), *openai_routes.routes_spec())]
    routes.append(Route("/metrics", metrics_route, methods=["GET"]))

    async def not_found(request: Request, exc: Exception) -> Response:
        return ApiError(404, f"no route {request.method} {request.url.path}", type="not_found").response()

    async def bad_method(request: Request, exc: Exception) -> Response:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                        type="method_not_allowed").response()

    async def crashed(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="internal_error").response()

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: bad_method, 500: crashed})
    app.state.sgl = ctx
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    # Added last, so it runs first: a CORS preflight carries no key and must be answered here.
    app.add_middleware(LocalGuard, protect=not api_key, allowed_origins=options.allowed_origins,
                       allowed_hosts=options.allowed_hosts)
    return app
