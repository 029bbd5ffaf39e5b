"""Local-server safety, /health and the server's options, in process on the tiny model.

A keyless server refuses what a web page could send it: a foreign Origin, a foreign Host name
(DNS rebinding), a non-JSON body; `--allowed-origins` / `--allowed-hosts` widen that and give
CORS headers. State changes only by POST. /health turns 503 when the engine cannot serve.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator

import pytest
from starlette.testclient import TestClient

import sgl
from sgl.backend.server import ServerOptions, create_app
from sgl.backend.server.guard import split_host
from sgl.config import EngineConfig
from test_server_support import get_tiny_engine, tiny_engine_options

GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}


@pytest.fixture(scope="module")
def keyless() -> Iterator[TestClient]:
    with TestClient(create_app(get_tiny_engine())) as c:  # TestClient's own origin: http://testserver
        yield c


def _refused(response: Any, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"], response.text


@pytest.mark.parametrize("origin", ["http://evil.example", "http://localhost:3000", "https://testserver",
                                    "null", "http://127.0.0.1:8080", "file://"])
def test_keyless_server_refuses_other_origins(keyless: TestClient, origin: str) -> None:
    _refused(keyless.post("/generate", json=GEN, headers={"origin": origin}), 403, "--allowed-origins")
    _refused(keyless.get("/v1/models", headers={"origin": origin}), 403, "Origin")


@pytest.mark.parametrize("origin", ["http://testserver", "http://localhost", "http://127.0.0.1:80",
                                    "http://[::1]"])
def test_keyless_server_accepts_its_own_origin_and_no_origin(keyless: TestClient, origin: str) -> None:
    assert keyless.post("/generate", json=GEN, headers={"origin": origin}).status_code == 200
    assert keyless.post("/generate", json=GEN).status_code == 200  # curl, SDKs: no Origin at all


@pytest.mark.parametrize("host, ok", [
    ("evil.example", False), ("evil.example:30000", False), ("127.0.0.1.nip.io", False),
    ("localhost", True), ("localhost:30000", True), ("127.0.0.1:30000", True), ("[::1]:30000", True),
    ("[::1]", True), ("10.1.2.3", True), ("app.localhost:8000", True), ("testserver", True),
])
def test_keyless_server_refuses_foreign_host_names(keyless: TestClient, host: str, ok: bool) -> None:
    response = keyless.get("/v1/models", headers={"host": host})
    if ok:
        assert response.status_code == 200, response.text
    else:
        _refused(response, 403, "DNS-rebinding")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_keyless_json_routes_take_only_json(keyless: TestClient, content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type else {}
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        request = keyless.build_request("POST", path, content=b'{"text": "hi"}', headers=headers)
        assert request.headers.get("content-type") == content_type  # None: no header at all
        _refused(keyless.send(request), 415, "application/json")
    ok = keyless.post("/generate", content=b'{"text": "hi", "sampling_params": {"max_new_tokens": 1}}',
                      headers={"content-type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200


def test_state_changes_only_by_post(keyless: TestClient) -> None:
    _refused(keyless.get("/flush_cache"), 405, "GET is not allowed")
    assert keyless.post("/flush_cache").status_code == 200  # no body: no content type needed


def test_allowed_origins_and_hosts_widen_the_guard_and_get_cors() -> None:
    options = ServerOptions(allowed_origins=("https://app.example",), allowed_hosts=("api.internal",))
    with TestClient(create_app(get_tiny_engine(), options=options)) as c:
        ok = c.post("/generate", json=GEN, headers={"origin": "https://app.example/"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example/"
        pre = c.options("/v1/chat/completions", headers={
            "origin": "https://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "content-type"})
        assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in pre.headers["access-control-allow-methods"]
        _refused(c.post("/generate", json=GEN, headers={"origin": "https://evil.example"}), 403, "Origin")
        assert "access-control-allow-origin" not in c.get("/v1/models").headers
        assert c.get("/v1/models", headers={"host": "api.internal:30000"}).status_code == 200
        _refused(c.get("/v1/models", headers={"host": "other.internal"}), 403, "Host")
    anything = ServerOptions(allowed_origins="*", allowed_hosts="*")
    with TestClient(create_app(get_tiny_engine(), options=anything)) as c:
        response = c.get("/v1/models", headers={"origin": "http://x.example", "host": "y.example"})
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "http://x.example"


def test_with_an_api_key_the_key_is_the_protection() -> None:
    options = ServerOptions(allowed_origins=("https://app.example",))
    with TestClient(create_app(get_tiny_engine(), api_key="k", options=options)) as c:
        key = {"authorization": "Bearer k"}
        assert c.get("/v1/models", headers={**key, "origin": "http://elsewhere", "host": "my.dns"}).status_code == 200
        assert c.get("/v1/models", headers={"origin": "http://elsewhere"}).status_code == 401
        pre = c.options("/generate", headers={"origin": "https://app.example",
                                              "access-control-request-method": "POST"})
        assert pre.status_code == 204  # a preflight carries no key: answered before the key check


def test_split_host() -> None:
    assert split_host("Example.COM:80") == ("example.com", 80)
    assert split_host("[::1]:8000") == ("::1", 8000) and split_host("[::1]") == ("::1", None)
    assert split_host("::1") == ("::1", None) and split_host("localhost.") == ("localhost", None)


def test_health_turns_503_when_the_engine_thread_dies_or_closes() -> None:
    """/health used to answer 200 after the engine thread died, so nothing restarted it."""
    engine = sgl.Engine(**tiny_engine_options())
    try:
        with TestClient(create_app(engine)) as c:
            assert c.get("/health").status_code == 200
            engine._rt.core._inbox.put(("submit", [object()]))  # a bug in the loop: the thread dies
            deadline = time.monotonic() + 10
            while engine._rt.core.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            response = c.get("/health")
            assert response.status_code == 503 and "crash" in response.json()["error"]["message"]
            assert c.post("/generate", json=GEN).status_code == 503
            engine.close()
            _refused(c.get("/health"), 503, "closed")
    finally:
        engine.close()


def test_a_non_boolean_flag_no_longer_kills_the_engine(keyless: TestClient) -> None:
    """`"skip_special_tokens": 0` crashed the engine thread; every later request got 503."""
    for path, payload in (("/generate", {"text": "hi", "sampling_params": {"skip_special_tokens": 0}}),
                          ("/v1/completions", {"prompt": "hi", "skip_special_tokens": 0})):
        assert keyless.post(path, json=payload).status_code == 400
    assert keyless.get("/health").status_code == 200
    assert keyless.post("/generate", json=GEN).status_code == 200


def test_server_options_are_validated() -> None:
    for bad in (dict(max_n=0), dict(max_batch=-1), dict(header_timeout="10"), dict(max_n=True),
                dict(max_connections=2.5), dict(allowed_hosts=(1,))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerOptions(**bad)
    assert ServerOptions(allowed_origins=" http://a , http://b ").allowed_origins == ("http://a", "http://b")


def test_help_describes_every_engine_and_server_option_with_its_default() -> None:
    from sgl.cli import build_parser, engine_option_help

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = serve.format_help()
    flags = {a.dest: a for a in serve._actions}
    helps = engine_option_help()
    for f in dataclasses.fields(EngineConfig):
        assert f.name in flags, f"--{f.name} is missing"
        assert not helps[f.name].startswith("engine option"), f"{f.name} has no description"
        assert "(default: " in flags[f.name].help
    for name in ("max_total_tokens", "chunked_prefill_size", "max_running_requests", "dtype"):
        assert "CPU" in helps[name] and "CUDA" in helps[name], helps[name]  # device-dependent defaults
    for f in dataclasses.fields(ServerOptions):
        assert ServerOptions.flag(f.name) in text and "(default: " in flags[f.name].help
    args = vars(build_parser().parse_args(["serve", "--max-n", "8", "--allowed-origins", "a,b",
                                           "--no-disable-overlap-schedule", "--header-timeout", "2.5"]))
    assert args["max_n"] == 8 and args["allowed_origins"] == "a,b" and args["header_timeout"] == 2.5
    assert args["disable_overlap_schedule"] is False and "max_batch" not in args


def test_operations_doc_lists_every_server_option() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    for f in dataclasses.fields(ServerOptions):
        assert f"`{ServerOptions.flag(f.name)}`" in doc, f"docs/operations.md does not list {f.name}"
