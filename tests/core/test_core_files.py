"""Output files (:mod:`cspan.core.files`): atomic files and folders, and write failures as one clear error that
names the destination and the cause, with nothing partial left behind (issue 22, F7/F8)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fs_faults import read_only_folder, tmpfs

from cspan.core.errors import OutputError
from cspan.core.files import atomic_file, atomic_folder, check_writable


def _leftovers(folder: Path) -> list[Path]:
    return sorted(folder.iterdir())


def test_atomic_folder_full_disk_leaves_nothing(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", size_kb=64) as small:
        out = small / "ckpt"
        with pytest.raises(OutputError, match="no space left on device") as err, atomic_folder(out) as tmp:
            (tmp / "a.bin").write_bytes(b"\0" * 16384)
            (tmp / "b.bin").write_bytes(b"\0" * 200_000)
        assert str(out) in str(err.value) and ".part" not in str(err.value)
        assert _leftovers(small) == []


def test_atomic_folder_publishes_whole_and_replaces_files(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    with atomic_folder(out) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "x.txt").write_text("1")
        assert not out.exists()  # nothing visible until the block ends
    assert (out / "sub" / "x.txt").read_text() == "1" and oct(out.stat().st_mode & 0o777) != "0o700"
    (out / "keep.txt").write_text("k")
    with pytest.raises(OutputError, match="not empty"), atomic_folder(out):
        pass
    with atomic_folder(out, replace_files=True) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "x.txt").write_text("2")
    assert (out / "sub" / "x.txt").read_text() == "2" and (out / "keep.txt").read_text() == "k"
    assert [p.name for p in _leftovers(tmp_path)] == ["ckpt"]


def test_atomic_file_maps_a_library_error_to_its_cause(tmp_path: Path) -> None:
    """safetensors and torch.save wrap ENOSPC in their own errors; the message still says "no space left"."""
    from safetensors.torch import save_file

    with tmpfs(tmp_path / "small", size_kb=64) as small:
        for write in (
            lambda p: save_file({"w": torch.zeros(100_000)}, str(p)),
            lambda p: torch.save({"w": torch.zeros(100_000)}, p),
        ):
            with pytest.raises(OutputError, match="no space left on device"), atomic_file(small / "w.bin") as part:
                write(part)
            assert _leftovers(small) == []


def test_check_writable_names_path_and_cause(tmp_path: Path) -> None:
    with read_only_folder(tmp_path / "ro") as ro, pytest.raises(OutputError) as err:
        check_writable(ro / "x.wav")
    assert str(err.value).startswith(f"{ro / 'x.wav'}: cannot write: ")
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match="not a directory"):
        check_writable(tmp_path / "file" / "x.wav")
    with pytest.raises(OutputError, match="no space left on device: the output needs about"):
        check_writable(tmp_path / "x.wav", need_bytes=2**62)


def _cspan(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cspan.core.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd)


def test_model_tiny_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """Issue 22 (F8): `cspan model tiny full/tinyx` on a 200 KiB file system gave a SafetensorError traceback and a
    partial folder; a read-only folder is refused before the models are built."""
    with read_only_folder(tmp_path / "ro"):
        done = _cspan("model", "tiny", "ro/t", cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("cspan model tiny: error: ro/t: cannot write: ") and not _leftovers(tmp_path / "ro")
    with tmpfs(tmp_path / "full", size_kb=200) as full:
        for target in ("full/tinyx", "full"):  # a folder on the full file system, and the mount point itself
            done = _cspan("model", "tiny", target, cwd=tmp_path)
            assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
            assert done.stderr.startswith(f"cspan model tiny: error: {target}")
            assert "cannot write: no space left on device" in done.stderr
            assert _leftovers(full) == []


def test_atomic_folder_into_a_mounted_empty_folder(tmp_path: Path) -> None:
    """An existing folder (here a file system mounted on it: renaming onto it would fail) is kept and filled."""
    with tmpfs(tmp_path / "mnt", size_kb=256) as mnt:
        with atomic_folder(mnt) as tmp:
            assert tmp.parent == mnt
            (tmp / "voices").mkdir()
            (tmp / "voices" / "a.pt").write_bytes(b"1")
            (tmp / "config.json").write_text("{}")
        assert sorted(p.name for p in mnt.iterdir()) == ["config.json", "voices"]
        (mnt / "config.json").unlink()
        (mnt / "voices" / "a.pt").unlink()
        (mnt / "voices").rmdir()
        with (
            pytest.raises(OutputError, match=f"{mnt}: cannot write: no space left on device"),
            atomic_folder(mnt) as tmp,
        ):
            (tmp / "big.bin").write_bytes(b"\0" * 400_000)
        assert list(mnt.iterdir()) == []
