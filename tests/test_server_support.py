"""One real `sgl serve` process (and one in-process engine) shared by the server and remote tests,
plus a tiny random-weight model for the fast server tests.

The server runs the default model on loopback with an API key (so the 401 tests need no
second process); it starts on first use, and an atexit hook always terminates it. The
in-process engine is the reference that greedy outputs are compared against.

The tiny model (`TINY_ARGS`, `get_tiny_engine`) has random weights and the default model's
tokenizer, so text, chat and token-id requests all work while each step costs about a
millisecond: what the HTTP edge does, not what the model says, is under test there.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

API_KEY = "test-key-123"
TINY_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=49152, max_position_embeddings=1024, eos_token_id=0)
_tiny: Any = None
SERVER_ARGS = ["--max-total-tokens", "8192", "--log-level", "warning"]
_lock = threading.Lock()
_server: Server | None = None
_engine: Any = None


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log_path: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120, **kwargs)

    def server_info(self) -> dict[str, Any]:
        return httpx.get(self.url + "/get_server_info", headers=self.headers, timeout=30).json()

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Poll until no request runs or waits (aborts are asynchronous)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.server_info()["stats"]
            if stats["running"] == 0 and stats["waiting"] == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def get_server() -> Server:
    global _server
    with _lock:
        if _server is not None:
            return _server
        port = _free_port()
        log_path = f"/tmp/sgl-test-server-{port}.log"
        log = open(log_path, "w")  # noqa: SIM115 - kept open for the process's lifetime
        env = {**os.environ, "SGL_API_KEY": ""}  # the flag, not the environment, sets the key
        process = subprocess.Popen(
            [sys.executable, "-m", "sgl", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--api-key", API_KEY, *SERVER_ARGS], stdout=log, stderr=subprocess.STDOUT, env=env)
        atexit.register(_stop, process)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}: {open(log_path).read()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                _stop(process)
                raise RuntimeError(f"the server did not start: {open(log_path).read()[-3000:]}")
            time.sleep(0.3)
        _server = Server(url, process, log_path)
        return _server


def get_engine() -> Any:
    """The in-process reference engine, with the server's options."""
    global _engine
    with _lock:
        if _engine is None:
            import sgl

            _engine = sgl.Engine(max_total_tokens=8192)
            atexit.register(_engine.close)
        return _engine


def tiny_engine_options() -> dict[str, Any]:
    from sgl.backend.model_loader import resolve_model_path

    return dict(load_format="dummy", model_config=TINY_CONFIG, tokenizer=str(resolve_model_path(None)),
                device="cpu", max_total_tokens=4096)


def split_limits(**limits: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine options, server options): a bound the engine's config has (once the engine's own
    request limits exist: max_n, max_stop_strings, ...) is set on the engine, where the server
    reads it; the others are server options."""
    from sgl.config import EngineConfig

    engine = {k: v for k, v in limits.items() if k in EngineConfig.option_names()}
    return engine, {k: v for k, v in limits.items() if k not in engine}


def tiny_server_args() -> list[str]:
    """`sgl serve` flags for the tiny model (the CLI's JSON form of model_config)."""
    import json

    opts = tiny_engine_options()
    return ["--load-format", "dummy", "--model-config", json.dumps(opts["model_config"]),
            "--tokenizer", opts["tokenizer"], "--device", "cpu", "--max-total-tokens", "4096"]


def get_tiny_engine() -> Any:
    """One tiny in-process engine shared by the fast server tests (never closed by them)."""
    global _tiny
    with _lock:
        if _tiny is None:
            import sgl

            _tiny = sgl.Engine(**tiny_engine_options())
            atexit.register(_tiny.close)
        return _tiny


@dataclass
class TinyServer:
    """A `python -m sgl serve` subprocess on the tiny model, on a free port it chose itself."""

    process: subprocess.Popen
    url: str
    log_path: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        _stop(self.process)


def start_tiny_server(*flags: str, preexec_fn: Any = None, timeout: float = 120) -> TinyServer:
    """Start the server with `--port 0` and wait for its "serving ... on URL" line, which it
    prints only once the socket is bound. Its output goes to a file (a pipe nobody reads
    would fill up and block the server)."""
    import re
    import tempfile

    log_path = tempfile.mktemp(prefix="sgl-tiny-server-", suffix=".log")
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "sgl", "serve", "--port", "0", *tiny_server_args(),
                                    *flags], stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "SGL_API_KEY": ""}, preexec_fn=preexec_fn)
    atexit.register(_stop, process)
    server = TinyServer(process, "", log_path)
    deadline = time.monotonic() + timeout
    while True:
        found = re.search(r"serving .* on (http://\S+)", server.log())
        if found:
            server.url = found.group(1)
            return server
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            raise RuntimeError(f"the tiny server did not start: {server.log()[-3000:]}")
        time.sleep(0.1)
