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


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when this returns: nothing listens there


def test_fdb_v1_score_with_a_judge_that_is_down_finishes_and_records_failures(
    v1_copy: Path, tmp_path: Path, cli, capsys
) -> None:
    """The judge on a closed port aborted the run (exit 1, nothing written); with several items and
    --judge-attempts 1 it stopped at the first failed request. docs/BENCH.md: the run finishes with what it has,
    every summary says so, each failed judgement is recorded as failed, and the judge is given up after two requests
    in a row failed."""
    import json

    task = v1_copy / "user_interruption_example"
    for i in ("2", "3", "4"):
        shutil.copytree(task / "1", task / i)
    for rating in task.glob("*/rating.json"):
        rating.unlink()
    out = tmp_path / "fs2"
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    rc = cli("bench", "fdb-v1", "score", "--data", str(v1_copy), "--out", str(out), "--tasks",
             "user_interruption_example", "pause_handling_example", "--judge-url", url, "--judge-timeout-s", "1",
             "--judge-attempts", "1")  # fmt: skip
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "was taken as down after 0 answered request(s): 2 requests in a row failed" in err[-1]
    samples = json.loads((out / "user_interruption_example" / "samples.json").read_text())
    assert [(s["id"], s["tor"], s["rating"], s["judge_failed"]) for s in samples] == [
        (i, 1, None, True) for i in ("1", "2", "3", "4")
    ]
    summary = json.loads((out / "user_interruption_example" / "summary.json").read_text())
    assert summary["metrics"] == {"tor": 1.0, "latency_s": 4.08, "rating": None}
    assert summary["counts"] == {"took_turn": 4, "rated": 0}
    assert summary["notes"][0].startswith("relevance rating failed for 4 sample(s)")
    assert "4 request(s) failed" in summary["notes"][1]  # 2 sent, 2 refused at once while the judge was down
    pause = json.loads((out / "pause_handling_example" / "summary.json").read_text())
    assert pause["metrics"] == {"tor": 1.0} and "taken as down" in pause["notes"][-1]
    assert not list(task.glob("*/rating.json"))  # a failed judgement is never stored as an answer
