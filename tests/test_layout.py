"""The package's shape: public names, the dependency direction, and the install layout."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import sgl

ROOT = Path(__file__).resolve().parents[1]


def test_import_sgl_does_not_import_torch() -> None:
    code = "import sys, sgl; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_public_names_exist_and_are_unique() -> None:
    assert len(sgl.__all__) == len(set(sgl.__all__))
    for name in sgl.__all__:
        assert hasattr(sgl, name), name
    for name in ("Engine", "function", "gen", "select", "gen_int", "gen_string",
                 "system", "user", "assistant", "set_default_backend", "SamplingParams"):
        assert name in sgl.__all__, name


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_dependency_direction() -> None:
    """sgl reaches the backend only through two lazy seams (sgl/engine.py for the engine,
    sgl/cli.py for the server); the backend may import sgl's small leaf modules only."""
    leaf = {"sgl.errors", "sgl.sampling", "sgl.outputs", "sgl.config", "sgl.constraints", "sgl._seq",
            "sgl._spec"}
    for path in (ROOT / "sgl").rglob("*.py"):
        imported = {m for m in _imports(path) if m.startswith("sgl.backend")}
        seams = {"engine.py": {"sgl.backend.runtime"}, "cli.py": {"sgl.backend.server"}}
        allowed = imported <= seams.get(path.name, set())
        assert not imported or allowed, f"{path} imports {imported}"
    for path in (ROOT / "backend").rglob("*.py"):
        assert "sgl" not in _imports(path), f"{path} imports the whole sgl package"
        front = {m for m in _imports(path) if m.startswith("sgl.") and not m.startswith("sgl.backend")}
        assert front <= leaf, f"{path} imports {front - leaf}"


def test_pyproject_lists_every_package() -> None:
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapping = cfg["package-dir"]
    found = set()
    for top, folder in (("sgl", "sgl"), ("sgl.backend", "backend")):
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((top, *rel)))
    assert found <= listed, f"packages missing from pyproject.toml: {found - listed}"
    assert mapping["sgl.backend"] == "backend" and mapping["sgl.grammars"] == "grammars"
