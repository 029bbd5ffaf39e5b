"""Local-server safety: a server without an API key must not be reachable from web pages.

A keyless `sgl serve` on 127.0.0.1 trusts everything that can open a socket to it, and a web
browser is such a thing: any page the developer visits can POST to http://127.0.0.1:30000
(a `text/plain` body needs no CORS preflight), and a page on an attacker's domain that
re-resolves to 127.0.0.1 (DNS rebinding) can even read the answers. Without a key this
middleware therefore refuses, before any route runs:

- a `Host` that is not a loopback name, an IP address, the bound host or this machine's name
  (rebinding always arrives with the attacker's domain name): 403;
- an `Origin` other than the server's own (http://host:port with host the bound address,
  localhost, 127.0.0.1 or [::1]): 403. Non-browser clients send no Origin and pass;
- a request body that is not `application/json` (a browser form or a `text/plain` POST): 415.

`allowed_hosts` / `allowed_origins` (`*` for any) widen this, as ollama's OLLAMA_ORIGINS
does; allowed origins also get CORS headers, so a page there can call the API. With an API
key the key is the protection: browsers cannot attach it cross-origin without a preflight
that only allowed origins pass, so only the CORS part applies.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sgl.backend.server.protocol import ApiError

__all__ = ["LocalGuard", "split_host"]

_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def split_host(value: str) -> tuple[str, int | None]:
    """'Example.com:80' -> ('example.com', 80); '[::1]:8000' -> ('::1', 8000); no port -> None."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:  # a bare name, or a bare IPv6 address
        name, port = value, ""
    return name.rstrip("."), int(port) if port.isdigit() else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class LocalGuard:
    """Plain ASGI middleware (streaming responses pass through untouched); see the module doc."""

    def __init__(self, app: ASGIApp, protect: bool, allowed_origins: Iterable[str] = (),
                 allowed_hosts: Iterable[str] = ()) -> None:
        self.app, self.protect = app, protect
        self.origins = {o.strip().rstrip("/").lower() for o in allowed_origins}
        self.hosts = {split_host(h)[0] for h in allowed_hosts}
        self.machine = socket.gethostname().lower()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        refusal = self._refusal(scope, headers, origin) if self.protect else None
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        cors = origin is not None and self._listed(origin)
        if cors and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await self._preflight(origin, headers)(scope, receive, send)
            return
        if not cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"access-control-allow-origin", origin.encode()),
                                                  (b"vary", b"Origin")]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    # -- the checks --------------------------------------------------------------------------------

    def _refusal(self, scope: Scope, headers: Headers, origin: str | None) -> ApiError | None:
        host = headers.get("host", "")
        if not self._host_ok(scope, host):
            return ApiError(403, f"Host {host!r} is not allowed: a server without an API key answers only "
                                 "to localhost, IP addresses and its bound name (DNS-rebinding protection); "
                                 "start it with --allowed-hosts or --api-key", type="permission_error")
        if origin is not None and not self._origin_ok(scope, origin):
            return ApiError(403, f"Origin {origin!r} is not allowed: a server without an API key refuses "
                                 "requests from other web pages; start it with --allowed-origins or --api-key",
                            type="permission_error")
        if scope["method"] in _BODY_METHODS and _has_body(headers):
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return ApiError(415, f"the request body must be sent as 'Content-Type: application/json', "
                                     f"got {kind or 'no Content-Type'!r}", type="invalid_request_error")
        return None

    def _host_ok(self, scope: Scope, host: str) -> bool:
        if "*" in self.hosts or not host:  # no Host at all (HTTP/1.0 probes): not a browser
            return True
        name, _ = split_host(host)
        bound = str((scope.get("server") or ("",))[0]).lower()
        return (name in _LOOPBACK_NAMES or name.endswith(".localhost") or _is_ip(name)
                or name in (bound, self.machine) or name in self.hosts)

    def _origin_ok(self, scope: Scope, origin: str) -> bool:
        if self._listed(origin):
            return True
        parts = urlsplit(origin.strip().lower())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # includes the opaque origin "null" (sandboxed frames, file://)
        name, port = split_host(parts.netloc)
        port = port or (443 if parts.scheme == "https" else 80)
        bound_name, bound_port = (scope.get("server") or ("", None))
        own_names = _LOOPBACK_NAMES | {str(bound_name).lower()}
        return name in own_names and port == bound_port

    def _listed(self, origin: str) -> bool:
        return "*" in self.origins or origin.strip().rstrip("/").lower() in self.origins

    @staticmethod
    def _preflight(origin: str, headers: Headers) -> Response:
        asked = headers.get("access-control-request-headers", "authorization, content-type")
        return Response(status_code=204, headers={
            "Access-Control-Allow-Origin": origin, "Vary": "Origin",
            "Access-Control-Allow-Methods": "GET, POST, PUT, OPTIONS",
            "Access-Control-Allow-Headers": asked, "Access-Control-Max-Age": "600"})


def _has_body(headers: Headers) -> bool:
    length = headers.get("content-length")
    return "transfer-encoding" in headers or (length is not None and length.strip() not in ("", "0"))
