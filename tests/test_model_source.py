"""Models by name: Hugging Face ids resolve through huggingface_hub's cache, offline.

A hub cache is laid out in a tmp dir exactly as huggingface_hub writes it
(`models--org--name/refs/main` holding a commit, `snapshots/<commit>/` holding the files), and
every check runs in a subprocess whose environment sets HF_HUB_CACHE and HF_HUB_OFFLINE=1:
huggingface_hub reads them at import, as it would in a user's process. No network is used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_server_support import TINY_CONFIG

COMMIT = "0123456789abcdef0123456789abcdef01234567"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _repo(hub: Path, repo: str, files: dict[str, Path | str]) -> Path:
    """models--org--name with refs/main -> COMMIT and the files in snapshots/COMMIT/."""
    root = hub / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for name, content in files.items():
        if isinstance(content, Path):
            (snap / name).symlink_to(content)  # the hub links snapshot files to blobs
        else:
            (snap / name).write_text(content)
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sgl.backend.model_loader import resolve_model_path

    hub = tmp_path_factory.mktemp("hf") / "hub"
    _repo(hub, "org/smol-GGUF", {GGUF_NAME: resolve_model_path(None).resolve()})
    _repo(hub, "org/tiny", {"config.json": json.dumps({**TINY_CONFIG, "model_type": "llama",
                                                       "architectures": ["LlamaForCausalLM"]})})
    return hub


def _run(hub: Path, code: str, cwd: Path | None = None) -> dict:
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "HF_HOME": str(hub.parent)}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


RESOLVE = """
import json
from sgl.backend.model_source import resolve_hub_model
from sgl.errors import ModelLoadError
out = {}
def attempt(key, *args):
    try:
        out[key] = str(resolve_hub_model(*args))
    except ModelLoadError as exc:
        out[key] = "error: " + str(exc)
attempt("gguf", "org/smol-GGUF/%s")
attempt("folder", "org/tiny")
attempt("by_commit", "org/tiny", "%s")
attempt("missing_revision", "org/tiny", "v2")
attempt("missing_repo", "org/absent")
attempt("missing_file", "org/smol-GGUF/other.gguf")
print(json.dumps(out))
""" % (GGUF_NAME, COMMIT)


def test_ids_resolve_from_the_cache_offline(hub: Path) -> None:
    out = _run(hub, RESOLVE)
    snap = hub / "models--org--smol-GGUF" / "snapshots" / COMMIT
    assert out["gguf"] == str(snap / GGUF_NAME)
    assert out["folder"] == out["by_commit"] == str(hub / "models--org--tiny" / "snapshots" / COMMIT)
    for key in ("missing_revision", "missing_repo", "missing_file"):
        assert out[key].startswith("error: ") and "HF_HUB_OFFLINE" in out[key], out[key]
    assert "'v2'" in out["missing_revision"] and "hf download org/absent" in out["missing_repo"]


def test_parse_hub_id_and_local_paths_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl.backend.model_source import parse_hub_id

    hub = parse_hub_id("org/repo-GGUF/sub/file.Q4_K_M.gguf")
    assert hub is not None and (hub.repo, hub.filename) == ("org/repo-GGUF", "sub/file.Q4_K_M.gguf")
    assert parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct").filename is None
    for not_an_id in ("model.gguf", "/abs/org/name", "org/name/weights.bin", "../org/name", "org//name"):
        assert parse_hub_id(not_an_id) is None, not_an_id
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_hub_id("org/name") is None  # an existing local folder wins over the hub id


ENGINES = """
import json, sgl
from sgl.backend.model_loader import resolve_model_path
dummy = sgl.Engine("org/tiny", load_format="dummy", device="cpu", max_total_tokens=256)
shape = dummy.model_config.hf_config.hidden_size
dummy.close()
hub = sgl.Engine("org/smol-GGUF/%s", revision="main", device="cpu", max_total_tokens=512)
text = hub.generate_sync("The capital of France is", max_new_tokens=6, temperature=0).text
name = hub.config.model
hub.close()
local = sgl.Engine(str(resolve_model_path(None)), device="cpu", max_total_tokens=512)
same = local.generate_sync("The capital of France is", max_new_tokens=6, temperature=0).text
local.close()
print(json.dumps({"shape": shape, "text": text, "same": same, "name": name}))
""" % GGUF_NAME


@pytest.mark.slow
def test_engine_loads_models_by_id(hub: Path) -> None:
    out = _run(hub, ENGINES)
    assert out["shape"] == TINY_CONFIG["hidden_size"]  # the config came from the hub snapshot
    assert out["text"] == out["same"] and out["text"]  # the hub GGUF is the default model
    assert out["name"] == f"org/smol-GGUF/{GGUF_NAME}"  # the config keeps the id the user gave


def test_engine_error_names_the_offline_cache(hub: Path) -> None:
    code = ("import json, sgl\ntry:\n    sgl.Engine('org/absent', device='cpu')\n"
            "except sgl.errors.ModelLoadError as e:\n    print(json.dumps({'error': str(e)}))\n")
    out = _run(hub, code)
    assert "org/absent" in out["error"] and "not in the Hugging Face cache" in out["error"]


@pytest.mark.slow
def test_sgl_serve_takes_a_hub_id(hub: Path, tmp_path: Path) -> None:
    import re
    import time

    import httpx

    from sgl.backend.model_loader import resolve_model_path

    log_path = tmp_path / "serve.log"
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "SGL_API_KEY": ""}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sgl", "serve", "--port", "0", "--model", "org/tiny", "--load-format", "dummy",
             "--tokenizer", str(resolve_model_path(None)), "--device", "cpu", "--max-total-tokens", "512"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"serving .* on (http://\S+)", log_path.read_text())):
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.3)
        info = httpx.get(found.group(1) + "/get_model_info", timeout=30).json()
        assert info["model_path"] == "org/tiny" and info["vocab_size"] == TINY_CONFIG["vocab_size"]
    finally:
        process.terminate()
        process.wait(30)
