"""What the five distributions declare and ship (``packages/*/pyproject.toml``), read without building them.

A wheel holds everything under ``src/cspan`` (hatchling), so package data (``server/static/``,
``bench/data/published.json``, ``py.typed``) ships when it lies in the package folder; these tests check the
declarations that decide what an install outside the repository gets: the typed marker, versions and pins, the
verbs' entry points, and that every distribution declares (directly, through an extra, or through what it
depends on) each module it imports.
"""

from __future__ import annotations

import ast
import importlib
import sys
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["core", "backends", "server", "train", "bench"]

PROVIDED_BY = {
    "triton": "torch",  # a dependency of torch's CUDA wheels; imported only on a GPU
    "flashinfer": "flashinfer-python",  # cspan-core[flashinfer]
}
"""Imported modules whose distribution may not be installed where the tests run, and what provides them."""


@cache
def _project(name: str) -> dict[str, Any]:
    return tomllib.loads((REPO / "packages" / f"cspan-{name}" / "pyproject.toml").read_text(encoding="utf-8"))


def _src(name: str) -> Path:
    return REPO / "packages" / f"cspan-{name}" / "src" / "cspan" / name


def _imports(name: str, depth: int = 2) -> dict[str, str]:
    """Module (its first ``depth`` parts under ``cspan``, else its top level) -> one file of the package importing
    it."""
    found: dict[str, str] = {}
    for path in sorted(_src(name).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
            else:
                continue
            for mod in modules:
                parts = mod.split(".")
                top = ".".join(parts[:depth]) if parts[0] == "cspan" else parts[0]
                found.setdefault(top, str(path.relative_to(REPO)))
    return found


def _requirements(name: str, extras: set[str] | None = None) -> list[Requirement]:
    """cspan-NAME's dependencies and those of ``extras`` (every extra when None)."""
    project = _project(name)["project"]
    optional = project.get("optional-dependencies", {})
    chosen = optional if extras is None else {e: optional[e] for e in extras}
    return [Requirement(r) for r in [*project.get("dependencies", []), *(r for rs in chosen.values() for r in rs)]]


def _closure(name: str) -> set[str]:
    """Every distribution an install of cspan-NAME with all its extras can bring: the siblings through their
    pyproject.toml (with the extras named), the others through their installed metadata."""
    seen: set[str] = set()
    todo = [(r, r.extras) for r in _requirements(name)]
    while todo:
        req, extras = todo.pop()
        dist = canonicalize_name(req.name)
        key = f"{dist}[{','.join(sorted(extras))}]"
        if key in seen:
            continue
        seen.add(key)
        if dist.startswith("cspan-"):
            todo += [(r, r.extras) for r in _requirements(dist.removeprefix("cspan-"), set(extras))]
            continue
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in {"", *extras}):
                todo.append((sub, sub.extras))
    return {key.split("[")[0] for key in seen}


@pytest.mark.parametrize("name", PACKAGES)
def test_wheel_ships_the_package_folder_typed(name: str) -> None:
    """PEP 561: without ``py.typed`` a type checker treats every cspan name as Any (mypy: import-untyped)."""
    wheel = _project(name)["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert wheel == {"packages": ["src/cspan"]}  # the whole folder: static/, data/, py.typed
    assert (_src(name) / "py.typed").is_file()
    assert not (_src(name).parent / "__init__.py").exists()  # the namespace stays PEP 420


def test_versions_and_pins_agree() -> None:
    versions = {name: _project(name)["project"]["version"] for name in PACKAGES}
    for name in PACKAGES:
        assert importlib.import_module(f"cspan.{name}").__version__ == versions[name], name
        for req in _requirements(name):
            if req.name.startswith("cspan-"):
                assert str(req.specifier) == f"=={versions[req.name.removeprefix('cspan-')]}", (name, str(req))
        assert _project(name)["project"]["requires-python"] == ">=3.11"
        for path in _src(name).rglob("*.py"):  # the version is written in __init__.py only, read from there
            tree = ast.parse(path.read_text(encoding="utf-8"))
            copies = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == versions[name]]
            assert path.name == "__init__.py" or copies == [], f"{path.relative_to(REPO)} writes the version"


def test_one_console_script_and_loadable_verbs() -> None:
    for name in PACKAGES:
        project = _project(name)["project"]
        assert project.get("scripts", {}) == ({"cspan": "cspan.core.cli:main"} if name == "core" else {}), name
        for verb, target in project["entry-points"]["cspan.commands"].items():
            module, _, attr = target.partition(":")
            assert callable(getattr(importlib.import_module(module), attr)), (name, verb)


@pytest.mark.parametrize("name", PACKAGES)
def test_imports_are_declared(name: str) -> None:
    """Each module the package imports comes with an install of it (its extras included), siblings too."""
    declared = _closure(name)
    providers = metadata.packages_distributions()
    missing = []
    for module, where in sorted(_imports(name).items()):
        if module == f"cspan.{name}" or module in sys.stdlib_module_names or module == "__future__":
            continue
        if module.startswith("cspan."):
            dists = [f"cspan-{module.removeprefix('cspan.')}"]
        else:
            dists = providers.get(module) or [PROVIDED_BY.get(module, module)]
        if not any(canonicalize_name(d) in declared for d in dists):
            missing.append(f"{where} imports {module} ({' or '.join(dists)}), which cspan-{name} does not declare")
    assert missing == []


@pytest.mark.parametrize("name", ["server", "bench"])
def test_mcp_comes_with_the_tool_catalog(name: str) -> None:
    """A package building tool banks (``cspan.backends.tools.catalog``: ``--mcp`` on infer, serve and the bench
    runners) brings the MCP SDK, so that ``--mcp`` works on a plain install of it."""
    assert "cspan.backends.tools.catalog" in _imports(name, depth=4)
    assert "mcp" in _closure(name)
