"""The `sgl` command.

    sgl serve [--model PATH] [--host 127.0.0.1] [--port 30000] [--api-key KEY] [options]

Every `EngineConfig` field is a flag (`max_total_tokens` -> `--max-total-tokens`; booleans are
switches such as `--disable-radix-cache`, with a `--no-` form), and so is every field of the
server's `ServerOptions` (`--max-n`, `--allowed-origins`, ...). Both lists are read from the
dataclasses, so an option added there is a flag, with its help, without an edit here: the
engine options' help is the comment beside (or above) the field in sgl/config.py, and their
device-dependent defaults are spelled out below. The API key may also come from the environment
variable SGL_API_KEY, read here and nowhere else. `--model-path` is an alias of `--model`.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import dataclasses
import inspect
import io
import json
import os
import sys
import tokenize
import typing
from typing import Any, Sequence

from sgl.config import EngineConfig

__all__ = ["main", "build_parser", "engine_option_help"]

_SERVER_FLAGS = {"model", "log_level"}  # handled explicitly (aliases / shared with uvicorn)
_SERVER_KEYS = ("host", "port", "api_key", "served_model_name", "log_level", "model")

# Help for the current engine options. A field added to EngineConfig later without an entry
# here is described by its comment in sgl/config.py (see `_field_comments`).
_ABOUT = {
    "model": "HF folder, .gguf file or dummy preset name",
    "tokenizer": "tokenizer folder or .gguf file, instead of the model's own",
    "load_format": "how to read the weights; dummy: random weights from model_config",
    "model_config": "with load_format=dummy: a config dict (or overrides of the preset named by --model)",
    "context_length": "context window in tokens (capped at the model's)",
    "device": "cpu, cuda or cuda:N",
    "dtype": "weights and KV dtype: float32, bfloat16 or float16",
    "random_seed": "seed of the sampler (requests without their own seed)",
    "max_total_tokens": "KV pool size in tokens (running requests and the radix cache together)",
    "mem_fraction_static": "share of free memory for weights and the KV pool, when max_total_tokens is unset",
    "page_size": "KV page size in tokens",
    "chunked_prefill_size": "prompt tokens computed per step; -1 turns chunking off",
    "max_prefill_tokens": "prompt tokens admitted per step",
    "max_running_requests": "requests running at once; the rest wait",
    "schedule_policy": "queue order: lpm (longest cached prefix first) or fcfs",
    "disable_radix_cache": "turn off prefix caching",
    "disable_overlap_schedule": "run the plain loop instead of overlapping scheduling with the model step",
    "enable_deterministic_inference": "batch-invariant kernels: a request's tokens and logprobs do not depend on what runs beside it (slower)",
    "disable_jump_forward": "compute grammar-forced tokens one per step instead of together (same output, slower)",
    "schedule_conservativeness": "reserve factor for the future decode tokens of running requests",
    "speculative_algorithm": "ngram: verify draft tokens copied from the request's own text (same output, fewer steps)",
    "speculative_num_draft_tokens": "draft tokens verified per step",
    "speculative_ngram_min_match_window_size": "shortest run of last tokens matched for a draft",
    "speculative_ngram_max_match_window_size": "longest run of last tokens matched for a draft (tried first)",
    "speculative_disable_by_batch_size": "no drafts in a step where more than this many requests decode (plain decoding, overlapped)",
    "attention_backend": "attention implementation",
    "disable_cuda_graph": "decode without CUDA graphs",
    "cuda_graph_max_bs": "largest decode batch captured in a CUDA graph (graphs hold twice as many token rows)",
    "request_timeout": "seconds a request may take, queueing included (a request's own timeout overrides)",
    "debug_integrity": "check the KV pool and radix tree whenever the engine goes idle (slow; for debugging)",
    "log_level": "engine log level",
}
# What "auto" / None resolves to, where it depends on the device (backend/runtime.py).
_AUTO_DEFAULTS = {
    "device": "auto: cuda when available, else cpu",
    "dtype": "auto: float32 on the CPU, bfloat16 on CUDA",
    "context_length": "the model's max_position_embeddings",
    "max_total_tokens": "CUDA: mem_fraction_static of free GPU memory; CPU: 20% of available memory, "
                        "at most 2 GiB",
    "mem_fraction_static": "0.85 on CUDA, 0.2 on the CPU",
    "kv_cache_dtype": "auto: float16 on the CPU under a float32 model, else the model's dtype "
                      "(fp8_e4m3: half of bf16's bytes, a quarter of float32's; lossy)",
    "chunked_prefill_size": "8192 on CUDA, 512 on the CPU",
    "max_prefill_tokens": "chunked_prefill_size + max_running_requests",
    "max_running_requests": "256 on CUDA, 64 on the CPU, never more than the pool",
    "disable_overlap_schedule": "off (overlap) on CUDA, on (plain loop) on the CPU",
    "attention_backend": "auto: triton on CUDA, torch on the CPU",
    "cuda_graph_max_bs": "max_running_requests",
    "request_timeout": "no limit",
    "model": "the embedded default model",
    "tokenizer": "the model's own",
}


def _field_comments(cls: type) -> dict[str, str]:
    """field -> the comment on its line, else the comment lines just above it."""
    source = inspect.getsource(sys.modules[cls.__module__])
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    line, above = stmt.lineno, []
                    k = line - 1
                    while k in comments and lines[k - 1].lstrip().startswith("#") and "--" not in comments[k]:
                        above.insert(0, comments[k])
                        k -= 1
                    out[stmt.target.id] = comments.get(line) or " ".join(above)
    return out


def engine_option_help() -> dict[str, str]:
    """Engine option -> its help line with the default (what `sgl serve --help` prints)."""
    comments = _field_comments(EngineConfig)
    out = {}
    for f in dataclasses.fields(EngineConfig):
        default = _AUTO_DEFAULTS.get(f.name) or ("none" if f.default is None else repr(f.default))
        about = _ABOUT.get(f.name) or comments.get(f.name) or f"engine option {f.name}"
        out[f.name] = f"{about} (default: {default})"
    return out


def _engine_flag(group: argparse._ArgumentGroup, f: dataclasses.Field, hint: Any, help: str) -> None:
    flag = "--" + f.name.replace("_", "-")
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    kind = args[0] if len(args) == 1 and typing.get_origin(hint) is not typing.Literal else hint
    help = help.replace("%", "%%")
    common: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=help)
    if kind is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
    elif typing.get_origin(kind) is typing.Literal:
        group.add_argument(flag, choices=typing.get_args(kind), **common)
    elif kind in (int, float, str):
        group.add_argument(flag, type=kind, **common)
    else:  # dicts (model_config) travel as JSON
        common["help"] = help + "; as JSON"
        group.add_argument(flag, type=json.loads, **common)


def _server_option_flags(group: argparse._ArgumentGroup) -> None:
    """A flag per server option, except those the engine also has (one limit, one flag: the
    engine's, whose value the server's edge then applies too)."""
    from sgl.backend.server import ServerOptions  # starlette and uvicorn, but no torch

    for name, (default, about) in ServerOptions.field_help().items():
        if name in EngineConfig.option_names():
            continue
        shown = ",".join(default) or "none" if isinstance(default, tuple) else default
        kwargs: dict[str, Any] = dict(dest=name, default=argparse.SUPPRESS,
                                      help=f"{about} (default: {shown})".replace("%", "%%"))
        if isinstance(default, tuple):
            kwargs["type"] = str  # a comma list, split by ServerOptions
        else:
            kwargs["type"] = type(default)
        group.add_argument(ServerOptions.flag(name), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sgl", description="sgl: an embeddable LLM inference SDK")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP (OpenAI + SGLang native APIs)",
                           description="Serve a model over HTTP: OpenAI's /v1 API and SGLang's native one.")
    serve.add_argument("--model", "--model-path", dest="model", default=None,
                       help="HF folder, .gguf file or dummy preset (default: the embedded default model)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind; 0.0.0.0: all (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=30000, help="TCP port; 0: any free one (default: 30000)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (default: $SGL_API_KEY, else none: then "
                            "only this machine's own pages and clients are served)")
    serve.add_argument("--served-model-name", default=None,
                       help="the name /v1/models reports (default: the model file's name)")
    serve.add_argument("--log-level", default="warning",
                       choices=["debug", "info", "warning", "error", "critical"], help="(default: warning)")
    _server_option_flags(serve.add_argument_group("server limits and safety (sgl.backend.server.ServerOptions)"))
    engine = serve.add_argument_group("engine options (sgl.EngineConfig)")
    hints = typing.get_type_hints(EngineConfig)
    helps = engine_option_help()
    for f in dataclasses.fields(EngineConfig):
        if f.name not in _SERVER_FLAGS:
            _engine_flag(engine, f, hints[f.name], helps[f.name])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    if args.pop("command") == "serve":
        return _serve(args)
    return 2


def _serve(args: dict[str, Any]) -> int:
    # The server is the second seam into the backend (after sgl/engine.py): imported only when
    # `sgl serve` runs, so `import sgl` stays free of torch and starlette.
    from sgl.backend.server import ServerOptions, serve

    server = {k: args.pop(k) for k in _SERVER_KEYS}
    server_fields = {f.name for f in dataclasses.fields(ServerOptions)} - EngineConfig.option_names()
    try:
        options = ServerOptions(**{k: args.pop(k) for k in list(args) if k in server_fields})
    except ValueError as exc:
        print(f"sgl serve: {exc}", file=sys.stderr)
        return 2
    api_key = server["api_key"] or os.environ.get("SGL_API_KEY") or None
    from sgl.engine import Engine
    from sgl.errors import SglError

    try:
        engine = Engine(server["model"], log_level=server["log_level"], **args)
    except SglError as exc:
        print(f"sgl serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        print("sgl: interrupted", file=sys.stderr)
        return 130

    what = server["model"] or ("dummy weights" if args.get("load_format") == "dummy" else "the default model")

    def announce(url: str) -> None:  # called once the socket is bound
        print(f"sgl: serving {what} on {url}"
              + (" (API key required)" if api_key else ""), file=sys.stderr, flush=True)

    try:
        asyncio.run(serve(engine, host=server["host"], port=server["port"], api_key=api_key,
                          model_name=server["served_model_name"], log_level=server["log_level"],
                          options=options, on_started=announce))
    except KeyboardInterrupt:  # Ctrl-C: the server has already shut down cleanly
        pass
    except OSError as exc:
        print(f"sgl serve: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.close()
    print("sgl: stopped", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
