"""Defects of the bench review: outputs written into the dataset, a judge that is down, settings out of range, a
load run without sessions, the report's messages and empty --out folders left behind by failed runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture
def v1_copy(fixtures_dir: Path, tmp_path: Path) -> Path:
    """A writable copy of the fdb-v1 fixture (the shared one is read-only input)."""
    source = fixtures_dir / "fdb-v1"
    if not source.is_dir():
        pytest.skip(f"fixture not found: {source}")
    copy = tmp_path / "data"
    shutil.copytree(source, copy)
    for root, dirs, files in os.walk(copy):
        for name in [*dirs, *files]:
            os.chmod(os.path.join(root, name), 0o755 if name in dirs else 0o644)
    os.chmod(copy, 0o755)
    return copy


def _listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_fdb_v1_out_over_the_data_is_refused(v1_copy: Path, tmp_path: Path, cli, capsys) -> None:
    """`fdb-v1 run --out DATA` overwrote the benchmark's output.wav / output.json and added run.json into DATA."""
    before = _listing(v1_copy)
    link = tmp_path / "link"
    link.symlink_to(v1_copy)
    cases = {
        str(v1_copy): "is the --data folder",
        str(v1_copy / "pause_handling_example" / ".." / "."): "is the --data folder",
        str(link): "is the --data folder",
        str(v1_copy / "pause_handling_example" / "out"): "is inside the --data folder",
        str(tmp_path): "contains the --data folder",
    }
    run = ["bench", "fdb-v1", "run", "--data", str(v1_copy), "--checkpoint", str(tmp_path / "no-model"),
           "--tasks", "pause_handling_example"]  # fmt: skip
    for out, why in cases.items():
        assert cli(*run, "--out", out) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--out {out}: {why}" in err, err
    score = ["bench", "fdb-v1", "score", "--data", str(v1_copy), "--reuse-ratings"]
    for out, why in [
        (str(v1_copy), "is the --data folder"),
        (str(link), "is the --data folder"),
        (str(tmp_path), "contains the --data folder"),
        (str(v1_copy / "pause_handling_example" / "1" / "s"), "is inside the task folder"),
    ]:
        assert cli(*score, "--out", out) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--out {out}: {why}" in err, err
    assert _listing(v1_copy) == before  # nothing written, nothing overwritten
    # a folder of its own next to the task folders (the default DATA/scores) is fine
    assert cli(*score, "--tasks", "pause_handling_example", "--out", str(v1_copy / "scores2")) == 0
    assert (v1_copy / "scores2" / "pause_handling_example" / "summary.json").is_file()


def test_failed_run_leaves_no_empty_out_folder(tmp_path: Path, cli, capsys) -> None:
    out = tmp_path / "a" / "b"
    assert cli("bench", "fdb-v1", "score", "--data", str(tmp_path / "missing"), "--out", str(out)) == 1
    assert not (tmp_path / "a").exists()
    (tmp_path / "run").mkdir()
    assert cli("bench", "report", str(tmp_path / "run"), "--out", str(out)) == 1  # nothing to report
    capsys.readouterr()
    assert not (tmp_path / "a").exists() and (tmp_path / "run").is_dir()
