"""Every package imports, and the one-way dependency rule of docs/ARCHITECTURE.md holds."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["core", "backends", "server", "train", "bench"]


@pytest.mark.parametrize("name", PACKAGES)
def test_package_imports(name: str) -> None:
    __import__(f"cspan.{name}")


def test_namespace_has_no_init() -> None:
    for name in PACKAGES:
        assert not (REPO / "packages" / f"cspan-{name}" / "src" / "cspan" / "__init__.py").exists()
    import cspan

    assert getattr(cspan, "__file__", None) is None  # PEP 420 namespace package


def _imports_in_subprocess(code: str) -> dict[str, bool]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_backends_does_not_import_torch_or_core() -> None:
    code = (
        "import json, sys, pkgutil, importlib\n"
        "import cspan.backends as b\n"
        "for m in pkgutil.walk_packages(b.__path__, 'cspan.backends.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'core': 'cspan.core' in sys.modules}))\n"
    )
    seen = _imports_in_subprocess(code)
    assert seen == {"torch": False, "core": False}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("core", ("cspan.backends", "cspan.server", "cspan.train", "cspan.bench")),
        ("backends", ("torch", "cspan.core", "cspan.server", "cspan.train", "cspan.bench")),
        ("train", ("cspan.server", "cspan.bench")),
        ("server", ("cspan.train", "cspan.bench")),
        ("bench", ("cspan.server", "cspan.train")),
    ],
)
def test_no_forbidden_imports(package: str, forbidden: tuple[str, ...]) -> None:
    src = REPO / "packages" / f"cspan-{package}" / "src" / "cspan" / package
    offenders = []
    for path in sorted(src.rglob("*.py")):
        for mod in _imported_modules(path):
            if any(mod == f or mod.startswith(f + ".") for f in forbidden):
                offenders.append(f"{path.relative_to(REPO)} imports {mod}")
    assert offenders == []


def test_cli_lists_installed_verbs() -> None:
    out = subprocess.run([sys.executable, "-m", "cspan.core.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "model" in out.stdout


def test_cli_unknown_verb_exits_2_with_list() -> None:
    out = subprocess.run([sys.executable, "-m", "cspan.core.cli", "no-such-verb"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "invalid choice" in out.stderr and "model" in out.stderr


def test_main_py_works_like_cspan() -> None:
    out = subprocess.run([sys.executable, str(REPO / "main.py"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "verbs" in out.stdout
