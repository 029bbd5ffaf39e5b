"""Running the app with uvicorn: connection limits, the startup message, and a clean shutdown.

uvicorn alone has two gaps that let a few idle sockets take a server down:

- no deadline for a request's head: a client that sends half a request line and stalls keeps
  its connection (and file descriptor) forever; uvicorn's keep-alive timer runs only after a
  response. `BoundedH11Protocol` closes a connection whose request head has not arrived
  `header_timeout` seconds after it opened or became idle.
- `limit_concurrency` answers 503 to *every* request once the count is reached, /health
  included, so stalled sockets would still lock everyone out. Instead, past `max_connections`
  the longest-idle connection without a running request is closed (a stalled one, usually),
  so a new client always gets in; only when every connection is busy is the newcomer refused.

Shutdown (SIGINT/SIGTERM): listening stops, then the engine is closed, which ends every
running request with finish_reason "abort"; each open stream therefore sends its final chunk
and `data: [DONE]` and the connections finish at once, instead of waiting out uvicorn's
graceful timeout and being cut mid-stream.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any, Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from sgl.backend.server.app import create_app
from sgl.backend.server.options import ServerOptions

__all__ = ["serve", "BoundedH11Protocol", "connection_cap"]

logger = logging.getLogger("sgl.server")

# Connections accepted in one go: asyncio accepts up to `backlog` sockets in one callback, and
# their connection_made (where the cap acts) and the closing of the evicted ones each run one
# loop iteration later, so up to three bursts' descriptors can be open beyond the cap.
_BACKLOG = 64
_SPARE_FDS = 64  # files the engine may still open (grammar cache, logs), the listening socket
_REFUSED = b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline and an evicting connection cap.
    The two class attributes are set on a subclass made per server (`_protocol_class`)."""

    header_timeout: float = 10.0
    max_connections: int = 1000

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._idle_since = self.loop.time()
        self._arm()
        self._enforce_cap()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and not self._busy():  # the first bytes of the next request
            self._arm()
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        if self._header_timer is not None:  # the next request's first bytes arm a new one
            self._header_timer.cancel()
            self._header_timer = None
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _busy(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        # The cycle at arming time: a complete request head replaces it with a new one.
        self._header_timer = self.loop.call_later(self.header_timeout, self._deadline, self.cycle)

    def _deadline(self, armed_cycle: Any) -> None:
        self._header_timer = None
        if self.cycle is armed_cycle and not self.transport.is_closing():
            self.transport.close()  # no request head in time: a stalled or idle socket

    def _enforce_cap(self) -> None:
        # Closing connections stay in the set until connection_lost runs (next loop iteration):
        # they neither count nor can be evicted twice.
        live = [c for c in self.server_state.connections if not c.transport.is_closing()]
        if len(live) <= self.max_connections:
            return
        idle = [c for c in live if c is not self and isinstance(c, BoundedH11Protocol) and not c._busy()]
        if idle:
            min(idle, key=lambda c: c._idle_since).transport.close()
        else:  # every other connection is serving a request: this one cannot be served now
            self.transport.write(_REFUSED)
            self.transport.close()


def _protocol_class(options: ServerOptions, max_connections: int) -> type[BoundedH11Protocol]:
    attrs = {"header_timeout": options.header_timeout, "max_connections": max_connections}
    return type("SglH11Protocol", (BoundedH11Protocol,), attrs)


def connection_cap(requested: int) -> int:
    """Raise the soft open-file limit toward the hard one so `requested` connections fit, and
    return the cap that fits (fewer when the hard limit is lower): running out of descriptors
    stalls accept() for every client, /health included."""
    try:
        import resource
    except ImportError:  # (Windows: no open-file limit to raise or to fit)
        return requested
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    reserve = _open_fds() + 3 * _BACKLOG + _SPARE_FDS
    want = requested + reserve
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return requested
    cap = max(1, min(requested, soft - reserve))
    if cap < requested:
        logger.warning("max_connections lowered from %d to %d to fit the open-file limit (%d); "
                       "raise it with `ulimit -n`", requested, cap, soft)
    return cap


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: a generous guess
        return 128


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: Any, on_started: Callable[[str], None] | None) -> None:
        super().__init__(config)
        self.engine, self.on_started = engine, on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:  # bound: only now may clients connect
            self.on_started(self.bound_url())

    def bound_url(self) -> str:
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # no new connections while the running requests end
            server.close()
        await asyncio.to_thread(self.engine.close)  # every request ends with finish_reason "abort"
        await super().shutdown(sockets)


async def serve(engine: Any, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
                model_name: str | None = None, log_level: str = "info",
                options: ServerOptions | None = None,
                on_started: Callable[[str], None] | None = None) -> None:
    """Run the server in the current event loop until it is stopped (Ctrl-C / SIGTERM).

    `on_started(url)` is called once the socket is bound (with the real port when `port=0`).
    On shutdown the engine is closed, so running requests end with finish_reason "abort" and
    streams get their final chunk; the engine cannot be used afterwards.
    Raises OSError when the address cannot be bound.
    """
    options = options or ServerOptions()
    app = create_app(engine, api_key=api_key, model_name=model_name, options=options)
    cap = connection_cap(options.max_connections)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            http=_protocol_class(options, cap), timeout_keep_alive=options.timeout_keep_alive,
                            backlog=_BACKLOG, timeout_graceful_shutdown=3, lifespan="off")
    server = _Server(config, engine, on_started)
    try:
        await server.serve()
    except SystemExit as exc:  # uvicorn exits when it cannot bind; its log says why
        if not server.started:
            raise OSError(f"could not listen on {host}:{port} (see the error above)") from exc
        raise
