"""Sessions: ``tests`` (the test suite), ``demo`` (the main job on the embedded defaults), ``lint``.

Each session builds a fresh virtualenv. Torch: where the interpreter running nox already has a CUDA build of
torch (a GPU machine), the virtualenv sees the system site-packages and keeps that build; otherwise it installs
``torch==2.13.0`` first (the CPU wheel that lies on this project's machines), so that the packages' ``torch>=2.4``
range installs nothing more. ``CSPAN_TORCH_SPEC`` overrides the requirement.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = False

PACKAGES = ["cspan-core", "cspan-backends", "cspan-server", "cspan-train", "cspan-bench"]
TORCH_SPEC = os.environ.get("CSPAN_TORCH_SPEC", "torch==2.13.0")
TEST_REQUIREMENTS = [
    "pytest>=8",
    "pytest-asyncio>=0.23",
    "pytest-timeout>=2.3",
    "websockets>=12",
    "playwright>=1.45",
    "transformers>=4.44",  # the optional transformers ASR engine is tested too
    "aiohttp>=3.10",  # Kyutai's moshi client (the /api/chat acceptance test) ...
    "einops>=0.7",  # ... and what importing its package needs beyond ours
    "openai>=3.57",  # its realtime client is tested against /v1/realtime
]
UPSTREAM_CLIENTS = ["moshi==0.2.13"]
"""Installed without their dependencies (they pin torch and numpy below ours): only their client code is used."""


def _host_has_cuda_torch() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


CUDA_HOST = _host_has_cuda_torch()
VENV_PARAMS = ["--system-site-packages"] if CUDA_HOST else []


def _install_project(session: nox.Session, *extra: str) -> None:
    if not CUDA_HOST:
        session.install(TORCH_SPEC)
    args: list[str] = []
    for pkg in PACKAGES:
        args += ["-e", f"packages/{pkg}"]
    session.install(*args, *extra)


@nox.session(python="3.11", venv_params=VENV_PARAMS)
def tests(session: nox.Session) -> None:
    """Install all five packages (editable) with the test tools and run pytest."""
    _install_project(session, *TEST_REQUIREMENTS)
    session.install("--no-deps", *UPSTREAM_CLIENTS)
    session.run("pytest", *(session.posargs or ["tests"]))


@nox.session(python="3.11", venv_params=VENV_PARAMS)
def demo(session: nox.Session) -> None:
    """Install, then run the main job on the embedded defaults (see README)."""
    _install_project(session)
    session.run("python", "scripts/demo.py", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the repository."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
