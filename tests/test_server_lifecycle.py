"""`sgl serve` as a process: it announces itself only once bound, Ctrl-C ends open streams
properly and exits at once, and stalled sockets cannot lock clients out. Real subprocesses on
the tiny model (`python -m sgl serve --port 0 ...`)."""

from __future__ import annotations

import json
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from test_server_support import TinyServer, start_tiny_server, tiny_server_args

pytestmark = [pytest.mark.slow]


def _stream_events(url: str, path: str, payload: dict[str, Any], started: threading.Event,
                   out: list[str]) -> None:
    """Collect the `data:` payloads of one stream; set `started` after the first two."""
    with httpx.stream("POST", url + path, json=payload, timeout=30) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                if len(out) == 2:
                    started.set()


def test_announces_only_once_bound_and_refuses_a_taken_port() -> None:
    server = start_tiny_server("--max-connections", "2")
    try:
        # The line names the port the OS picked for --port 0, so it can only have been written
        # after the bind; and the socket must accept at once.
        assert server.port != 0
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        _refuses_a_third_connection_while_two_are_busy(server)
        taken = subprocess.run([sys.executable, "-m", "sgl", "serve", "--port", str(server.port),
                                *tiny_server_args()], capture_output=True, text=True, timeout=120)
        assert taken.returncode == 1, taken.stderr
        assert "could not listen" in taken.stderr and "Traceback" not in taken.stderr
        assert "serving" not in taken.stderr
    finally:
        server.stop()


def test_ctrl_c_ends_every_open_stream_with_abort_and_done_then_exits() -> None:
    server = start_tiny_server()
    streams = {  # long generations that are still running when Ctrl-C comes
        "completion": ("/v1/completions", {"prompt": "Once", "max_tokens": 900, "ignore_eos": True,
                                           "stream": True}),
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 900,
                                          "ignore_eos": True, "stream": True}),
        "native": ("/generate", {"text": "Once", "stream": True,
                                 "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}),
    }
    events: dict[str, list[str]] = {name: [] for name in streams}
    started = {name: threading.Event() for name in streams}
    threads = [threading.Thread(target=_stream_events, args=(server.url, path, payload, started[name], events[name]))
               for name, (path, payload) in streams.items()]
    try:
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started.values()), server.log()
        sent = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        for t in threads:
            t.join(10)
        server.process.wait(10)
        took = time.monotonic() - sent
    finally:
        server.stop()
    assert server.process.returncode == 0, server.log()
    assert took < 4.0, f"took {took:.1f} s to stop"
    log = server.log()
    assert "Traceback" not in log and "sgl: stopped" in log, log
    for name, got in events.items():
        assert got[-1] == "[DONE]", (name, got[-3:])
        final = json.loads(got[-2])
        reason = (final["meta_info"]["finish_reason"]["type"] if name == "native"
                  else final["choices"][0]["finish_reason"])
        assert reason == "abort", (name, final)


def _refuses_a_third_connection_while_two_are_busy(server: TinyServer) -> None:
    """At the cap with every connection running a request, a newcomer gets 503 (there is no
    idle one to evict); the running streams are untouched."""
    outs: list[list[str]] = [[], []]
    started = [threading.Event(), threading.Event()]
    payload = {"text": "Once", "stream": True, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    threads = [threading.Thread(target=_stream_events, args=(server.url, "/generate", payload, started[i], outs[i]))
               for i in range(2)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 503
    for t in threads:
        t.join(60)
    assert all(out[-1] == "[DONE]" for out in outs)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def _raise_own_file_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))


def _server_file_limit() -> None:  # runs in the server's process before exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))


def _stall(port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /heal")  # half a request line, then nothing
        socks.append(s)
    return socks


def test_half_open_sockets_do_not_lock_out_health_or_running_streams() -> None:
    """600 stalled sockets against a server limited to 512 open files used to exhaust its
    descriptors (accept() failing, /health timing out); now the longest-idle ones are
    evicted past the cap, and each is closed anyway once the header timeout passes."""
    _raise_own_file_limit(1200)
    server: TinyServer = start_tiny_server("--header-timeout", "2", preexec_fn=_server_file_limit)
    socks: list[socket.socket] = []
    try:
        assert "max_connections lowered" in server.log()  # the cap fits the 512 descriptors
        out: list[str] = []
        started = threading.Event()
        stream = threading.Thread(target=_stream_events, args=(server.url, "/generate", {
            "text": "Once", "stream": True, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}},
            started, out))
        stream.start()
        assert started.wait(60)
        socks = _stall(server.port, 600)
        for _ in range(3):
            begin = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            assert time.monotonic() - begin < 3.0
        stream.join(60)
        assert out[-1] == "[DONE]" and json.loads(out[-2])["meta_info"]["finish_reason"]["type"] == "length"
        newest = socks[-1]  # never evicted (others were older): the header timeout closes it
        newest.settimeout(10)
        assert newest.recv(100) == b""
        assert "Too many open files" not in server.log()
    finally:
        for s in socks:
            s.close()
        server.stop()
