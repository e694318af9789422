"""Real file-system faults for tests: a folder that cannot be written (even by root), a small or read-only file
system. As root (CI), a folder is made immutable with ``chattr +i`` and file systems are tmpfs mounts; as another
user, ``chmod 0o555`` does the first and the others skip."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def read_only_folder(path: Path) -> Iterator[Path]:
    """``path`` (created) made unwritable for the duration: creating a file in it fails with EACCES or EPERM."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make a folder read-only as root (chattr +i: {made.stderr.strip()})")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@contextlib.contextmanager
def tmpfs(path: Path, *, size_kb: int = 64, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size_kb`` mounted at ``path`` (created) for the duration; skips where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size_kb}k" + (",ro" if read_only else "")
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root (CI runs as root)")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(folder: Path) -> Path:
    """Write a file in ``folder`` until its file system is full; returns the file."""
    filler = folder / "filler.bin"
    with contextlib.suppress(OSError), filler.open("wb") as f:
        while True:
            f.write(b"\0" * 16384)
            f.flush()
    return filler
