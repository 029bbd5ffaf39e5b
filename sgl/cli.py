"""The `sgl` command.

    sgl serve [--model PATH] [--host 127.0.0.1] [--port 30000] [--api-key KEY] [engine options]

Every `EngineConfig` field is a flag (`max_total_tokens` -> `--max-total-tokens`, booleans
are switches such as `--disable-radix-cache`), so the server takes the same options as
`sgl.Engine(...)`. The API key may also come from the environment variable SGL_API_KEY, read
here and nowhere else. `--model-path` is accepted as an alias of `--model` (SGLang's name).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import typing
from typing import Any, Sequence

from sgl.config import EngineConfig

__all__ = ["main", "build_parser"]

_SERVER_FLAGS = {"model", "log_level"}  # handled explicitly (aliases / shared with uvicorn)


def _engine_flag(group: argparse._ArgumentGroup, f: dataclasses.Field, hint: Any) -> None:
    flag = "--" + f.name.replace("_", "-")
    args = typing.get_args(hint)
    base = [a for a in args if a is not type(None)] if args and typing.get_origin(hint) is not typing.Literal else [hint]
    kind = base[0] if len(base) == 1 else hint
    default_help = f"(default: {f.default!r})"
    if kind is bool:
        group.add_argument(flag, dest=f.name, action="store_true", default=argparse.SUPPRESS,
                           help=f"engine option {f.name} {default_help}")
    elif typing.get_origin(kind) is typing.Literal:
        group.add_argument(flag, dest=f.name, choices=typing.get_args(kind), default=argparse.SUPPRESS,
                           help=f"engine option {f.name} {default_help}")
    elif kind in (int, float, str):
        group.add_argument(flag, dest=f.name, type=kind, default=argparse.SUPPRESS,
                           help=f"engine option {f.name} {default_help}")
    else:  # dicts (model_config) travel as JSON
        group.add_argument(flag, dest=f.name, type=json.loads, default=argparse.SUPPRESS,
                           help=f"engine option {f.name}, as JSON {default_help}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sgl", description="sgl: an embeddable LLM inference SDK")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP (OpenAI + SGLang native APIs)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--model", "--model-path", dest="model", default=None,
                       help="HF folder or .gguf file; omitted: the embedded default model")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: all)")
    serve.add_argument("--port", type=int, default=30000, help="TCP port")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (default: $SGL_API_KEY, else none)")
    serve.add_argument("--served-model-name", default=None, help="the name /v1/models reports")
    serve.add_argument("--log-level", default="warning",
                       choices=["debug", "info", "warning", "error", "critical"])
    engine = serve.add_argument_group("engine options (sgl.EngineConfig)")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name not in _SERVER_FLAGS:
            _engine_flag(engine, f, hints[f.name])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    if args.pop("command") == "serve":
        return _serve(args)
    return 2


def _serve(args: dict[str, Any]) -> int:
    server_keys = ("host", "port", "api_key", "served_model_name", "log_level", "model")
    server = {k: args.pop(k) for k in server_keys}
    api_key = server["api_key"] or os.environ.get("SGL_API_KEY") or None
    from sgl.engine import Engine
    from sgl.errors import SglError

    try:
        engine = Engine(server["model"], log_level=server["log_level"], **args)
    except SglError as exc:
        print(f"sgl serve: {exc}", file=sys.stderr)
        return 1
    # The CLI is an application on top of both halves: it reaches the server the way
    # The server is the second seam into the backend (after sgl/engine.py): imported only
    # when `sgl serve` runs, so `import sgl` stays free of torch and starlette.
    from sgl.backend.server import serve
    print(f"sgl: serving {server['model'] or 'the default model'} on "
          f"http://{server['host']}:{server['port']}" + (" (API key required)" if api_key else ""),
          file=sys.stderr, flush=True)
    try:
        asyncio.run(serve(engine, host=server["host"], port=server["port"], api_key=api_key,
                          model_name=server["served_model_name"], log_level=server["log_level"]))
    except KeyboardInterrupt:
        pass
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
