"""The HTTP server hosting an in-process engine (OpenAI + SGLang native protocols).

Start it with `sgl serve` (see sgl/cli.py) or embed it: `create_app(engine)` returns an ASGI app.
"""

from __future__ import annotations

from sgl.backend.server.app import create_app
from sgl.backend.server.http_server import serve
from sgl.backend.server.options import ServerOptions

__all__ = ["create_app", "serve", "ServerOptions"]
