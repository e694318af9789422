"""Shared test configuration: the fixtures folder, markers, and skipping of gpu/browser tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("CSPAN_FIXTURES") or REPO_ROOT.parent / "shared" / "fixtures").expanduser().resolve()

# The Context DB defaults to a file in the user's data directory (persistent memory): tests, and the commands they
# run as subprocesses, keep theirs in memory unless they name a file.
os.environ.setdefault("CSPAN_DB", ":memory:")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _has_browser() -> bool:
    if os.environ.get("CSPAN_SKIP_BROWSER"):
        return False
    return shutil.which("chromium") is not None or shutil.which("chromium-browser") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = _has_cuda()
    browser = _has_browser()
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)"))
        if "browser" in item.keywords and not browser:
            item.add_marker(pytest.mark.skip(reason="needs Debian's chromium (installed by .ci/run)"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The shared fixtures folder (``$CSPAN_FIXTURES``, else ``../shared/fixtures`` from the repository root)."""
    if not FIXTURES.is_dir():
        pytest.skip(f"fixtures folder not found at {FIXTURES}")
    return FIXTURES


def fixture_path(*parts: str) -> Path:
    """Path inside the fixtures folder; skips the test when that file is genuinely absent."""
    path = FIXTURES.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"fixture not found: {path}")
    return path


@pytest.fixture(scope="session")
def fixture_file():
    """``fixture_file("reference", "mimi-small", "codes.safetensors")`` -> Path (skips if absent)."""
    return fixture_path


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``cspan model tiny`` checkpoint (dep_q 16, seed 0), written once per test session by the real command."""
    out = tmp_path_factory.mktemp("tiny-checkpoint") / "tiny"
    cmd = [sys.executable, "-m", "cspan.core.cli", "model", "tiny", str(out), "--seed", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return out


@pytest.fixture
def open_tmp_path() -> Iterator[Path]:
    """A new folder that every user can enter (mode 755, and so is every folder above it), for what other users could
    read: pytest's ``tmp_path`` lies in a folder only its owner may enter. Skips where no such folder can be made."""
    import stat
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="cspan-open-"))
    try:
        folder.chmod(0o755)
        shut = [p for p in folder.resolve().parents if not p.stat().st_mode & stat.S_IXOTH]
        if shut:
            pytest.skip(f"{shut[0]} (above the temporary folder) is closed to other users")
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
