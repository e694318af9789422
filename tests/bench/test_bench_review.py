"""Defects of the bench review: outputs written into the dataset, a judge that is down, settings out of range, a
load run without sessions, the report's messages and empty --out folders left behind by failed runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture
def v1_copy(v1_dir: Path, tmp_path: Path) -> Path:
    """A writable copy of the fdb-v1 fixture (the shared one is read-only input)."""
    copy = tmp_path / "data"
    shutil.copytree(v1_dir, copy)
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


def test_qa_out_over_the_data_and_a_dead_backend_are_refused_before_any_work(tmp_path: Path, cli, capsys) -> None:
    """`bench qa --out DATA` wrote q1/ and summary.json into the dataset, and a `--router` URL where nothing answers
    played every item and scored 0 % (fdb-v1 / fdb-v3 runs alike): both are refused before anything loads, the URL
    shown without its credentials."""
    data = tmp_path / "set"
    (data / "audios").mkdir(parents=True)
    (data / "meta.json").write_text('[{"id": "q1", "question": "Capital of France?", "answers": ["Paris"]}]')
    qa = ["bench", "qa", "--set", "llamaq", "--data", str(data), "--checkpoint", str(tmp_path / "no-model")]
    for out, why in ((data, "is the --data folder"), (data / "out", "is inside the --data folder")):
        assert cli(*qa, "--out", str(out)) == 2
        assert f"--out {out}: {why}" in capsys.readouterr().err
    dead = "http://bob:hunter2pw@127.0.0.1:9/v1"
    assert cli(*qa, "--out", str(tmp_path / "o"), "--router", dead, "--router-model", "m") == 1
    err = capsys.readouterr().err.strip()
    assert "--router http://bob:***@127.0.0.1:9/v1: nothing answers there" in err and "hunter2pw" not in err
    (tmp_path / "v1").mkdir()
    run = ["bench", "fdb-v1", "run", "--data", str(tmp_path / "v1"), "--checkpoint", str(tmp_path / "m"), "--out"]
    assert cli(*run, str(tmp_path / "o2"), "--asr", "http://127.0.0.1:9/v1/audio") == 1
    assert "--asr http://127.0.0.1:9/v1/audio: nothing answers there" in capsys.readouterr().err
    # a router without a transcriber is refused with the URL redacted too (was shown as given)
    assert cli(*run, str(tmp_path / "o3"), "--asr", "none", "--router", dead + "?api_key=SECRET2") == 2
    err = capsys.readouterr().err
    assert "--router http://bob:***@127.0.0.1:9/v1?api_key=*** needs the user's words" in err, err
    assert "hunter2pw" not in err and "SECRET2" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set", "v1"] and sorted(p.name for p in data.iterdir()) == [
        "audios",
        "meta.json",
    ]


def test_a_bad_icc_gt_is_refused_before_the_model_loads(v1_dir: Path, tmp_path: Path, cli, capsys) -> None:
    """`fdb-v1 run --icc-gt` naming no file rendered every sample, then stopped with "X is missing" (exit 1, the flag
    unnamed); a ground truth with a non-number in it was a ValueError traceback (run and score)."""
    from cspan.bench import fdb_v1
    from cspan.bench.errors import BenchDataError

    (tmp_path / "words.json").write_text('{"0": [0.5, "a"]}')
    (tmp_path / "nan.json").write_text('{"0": [0.5, NaN]}')
    (tmp_path / "text.json").write_text('{"0": "12"}')
    out = tmp_path / "o"
    run = ["bench", "fdb-v1", "run", "--data", str(v1_dir), "--checkpoint", str(tmp_path / "no-model")]
    for name, why in [("missing.json", "is missing"), *((n, "lists of finite numbers") for n in ("words.json",
                      "nan.json", "text.json"))]:  # fmt: skip
        gt = tmp_path / name
        assert cli(*run, "--out", str(out), "--icc-gt", str(gt)) == 2  # a setting, before the checkpoint is read
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--icc-gt {gt}: {gt}" in err and why in err, err
        assert not out.exists()
        if name != "missing.json":
            with pytest.raises(BenchDataError, match="lists of finite numbers"):
                fdb_v1.load_icc_gt(gt)
    good = fdb_v1.load_icc_gt(v1_dir / "icc_gt_distribution.json")  # the benchmark's own file reads as before
    assert len(good["0"]) == 115 and good["0"][0] == pytest.approx(0.008097165991916766)


def test_a_broken_example_stops_a_run_before_its_first_item(v1_copy: Path, tmp_path: Path, cli, capsys) -> None:
    """A corrupt input.wav in the second example stopped `fdb-v1 run` after the first was rendered (no summary), and
    a missing question audio stopped `qa` after q1: every input is checked before anything renders."""
    second = v1_copy / "smooth_turn_taking_example" / "1" / "input.wav"
    second.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    out = tmp_path / "o"
    run = ["bench", "fdb-v1", "run", "--data", str(v1_copy), "--checkpoint", str(tmp_path / "no-model")]
    assert cli(*run, "--out", str(out), "--asr", "none", "--router", "none") == 1
    err = capsys.readouterr().err
    assert f"1 of 3 input file(s) cannot be played: {second} is not readable audio" in err, err
    assert "nothing was rendered" in err and not out.exists()
    data = tmp_path / "set"
    data.mkdir()
    (data / "meta.json").write_text(
        '[{"id": "q1", "question": "Capital of France?", "answers": ["Paris"]},'
        ' {"id": "q2", "question": "Capital of Italy?", "answers": ["Rome"]}]'
    )
    (data / "audios").mkdir()
    shutil.copyfile(v1_copy / "pause_handling_example" / "1" / "input.wav", data / "audios" / "q1.wav")
    qa = ["bench", "qa", "--set", "llamaq", "--data", str(data), "--out", str(out), "--asr", "none"]
    assert cli(*qa, "--router", "none", "--checkpoint", str(tmp_path / "no-model")) == 1
    err = capsys.readouterr().err
    assert "1 of 2 item(s) have no audio: ['q2']" in err and not out.exists()


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


NOT_A_URL = (
    "is not an http(s) URL: give the server's address, e.g. http://127.0.0.1:8080 (https:// for TLS; the clients "
    "use its ws:// paths themselves)"
)  # bench serve's --url (was tried, and reported as "no cspan serve answers there", exit 1)


@pytest.mark.parametrize(
    ("verb", "flag", "value", "message"),
    [
        ("latency", "--pace-ms", "nan", "'nan' is not a finite number"),
        ("latency", "--pace-ms", "inf", "'inf' is not a finite number"),
        ("latency", "--pace-ms", "-1", "'-1' is out of range: give 0 to 60000"),
        ("latency", "--threads", "-1", "'-1' is out of range: give 1 to 1024"),
        ("latency", "--threads", "0", "'0' is out of range: give 1 to 1024"),
        ("latency", "--iters", "0", "'0' is out of range: give >= 1"),
        ("latency", "--n", "-1", "'-1' is out of range: give 0 or >= 3"),
        ("latency", "--n", "2", "'2' is out of range: give 0 or >= 3"),
        ("latency", "--fill", "-1", "'-1' is out of range: give >= 0"),
        ("latency", "--seed", "-1", "'-1' is out of range: give 0 to 9223372036854775807"),
        ("capacity", "--frames", "0", "'0' is out of range: give >= 1"),
        ("capacity", "--batch-size", "0", "'0' must be >= 1"),
        ("fdb-v1 run", "--output-rate", "-16000", "'-16000' is out of range: give 8000 to 192000"),
        ("fdb-v1 run", "--output-rate", "0", "'0' is out of range: give 8000 to 192000"),
        ("fdb-v1 run", "--output-rate", "10000000", "'10000000' is out of range: give 8000 to 192000"),
        ("fdb-v1 run", "--tail-s", "1e9", "'1e9' is out of range: give 0 to 600"),
        ("fdb-v1 run", "--temp", "nan", "'nan' is not a finite number"),
        ("fdb-v1 run", "--temp", "-1", "'-1' is out of range: give 0 or 0.001 to 10"),
        ("fdb-v1 run", "--temp-text", "0.0001", "'0.0001' is out of range: give 0 or 0.001 to 10"),
        ("fdb-v1 run", "--output-offset-frames", "-1", "'-1' is out of range: give 0 to 125"),
        ("fdb-v1 run", "--output-offset-frames", "100000", "'100000' is out of range: give 0 to 125"),
        ("fdb-v1 run", "--seed", "-1", "'-1' is out of range: give 0 to 9223372036854775807"),
        ("fdb-v1 run", "--seed", str(2**63), f"'{2**63}' is out of range: give 0 to 9223372036854775807"),
        ("fdb-v1 run", "--listen-s", "100", "'100' is out of range: give 0.001 to 60"),  # infer's ranges
        ("fdb-v1 run", "--span-deadline-s", "1e9", "'1e9' is out of range: give 0.001 to 600"),
        ("fdb-v1 run", "--limit", "0", "'0' must be >= 1"),
        ("fdb-v1 run", "--limit", "-1", "'-1' must be >= 1"),
        ("serve", "--clients", "0", "'0' is out of range: give 1 to 1024"),
        ("serve", "--clients", "2000", "'2000' is out of range: give 1 to 1024"),
        ("serve", "--seconds", "1e9", "'1e9' is out of range: give 0.1 to 86400"),
        ("serve", "--seconds", "nan", "'nan' is not a finite number"),
        ("serve", "--url", "notaurl", f"'notaurl' {NOT_A_URL}"),
        ("serve", "--url", "ws://127.0.0.1:8080", f"'ws://127.0.0.1:8080' {NOT_A_URL}"),
        ("serve", "--url", "http://127.0.0.1:port", f"'http://127.0.0.1:port' {NOT_A_URL}"),
    ],
)
def test_bench_settings_out_of_range_exit_2_naming_the_flag(
    tmp_path: Path, cli, capsys, verb: str, flag: str, value: str, message: str
) -> None:
    """`--pace-ms nan` wrote NaN into latency.json, `--pace-ms inf` and `--threads -1` were tracebacks, `--output-rate`
    / `--tail-s` / `--temp` out of range failed late or ran silently with another value: all are refused up front."""
    base = {
        "latency": ["--checkpoint", str(tmp_path / "m"), "--out", str(tmp_path / "o" / "l.json")],
        "capacity": ["--checkpoint", str(tmp_path / "m")],
        "fdb-v1 run": ["--data", str(tmp_path), "--checkpoint", str(tmp_path / "m"), "--out", str(tmp_path / "o")],
        "serve": ["--out", str(tmp_path / "o")],
    }[verb]
    with pytest.raises(SystemExit) as exc:
        cli("bench", *verb.split(), *base, flag, value)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"argument {flag}: {message}"), err  # argparse's usage, then the one-line error
    assert not (tmp_path / "o").exists()


def test_bench_range_errors_of_combined_settings_exit_2(tiny_checkpoint_dir: Path, tmp_path: Path, cli, capsys) -> None:
    """--span-sessions beyond the batch, --n beyond the model's context, --tasks naming no task: exit 2 (was 1)."""
    out = tmp_path / "o" / "l.json"
    latency = ["bench", "latency", "--checkpoint", str(tiny_checkpoint_dir), "--out", str(out), "--quiet"]
    assert cli(*latency, "--batch-size", "2", "--span-sessions", "3") == 2
    assert "--span-sessions 3: between 0 and the smallest batch size [2]" in capsys.readouterr().err
    assert cli(*latency, "--n", "100000", "--iters", "1") == 2
    assert "--n [100000]: a span must fit the model's context" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # the failed run left no empty --out folder
    assert cli("bench", "capacity", "--checkpoint", str(tiny_checkpoint_dir), "--span-interval", "-1") == 2
    assert "--span-interval -1: give a number of seconds > 0" in capsys.readouterr().err
    (tmp_path / "d").mkdir()
    for verb in (["run", "--checkpoint", str(tiny_checkpoint_dir)], ["score"]):
        assert cli("bench", "fdb-v1", *verb, "--data", str(tmp_path / "d"), "--out", str(tmp_path / "o"),
                   "--tasks", "bogus") == 2  # fmt: skip
        assert "--tasks 'bogus': cannot tell the task from the name; write bogus=KIND" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_bench_serve_without_any_session_exits_1(tmp_path: Path, cli, capsys) -> None:
    """A server that answers /health but where no session ran reported success ('lateness p50 None', exit 0)."""
    import threading
    import time

    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, object]:
        return {"status": "ok", "free_slots": 4}

    port = _closed_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        out = tmp_path / "sl"
        rc = cli("bench", "serve", "--url", f"http://127.0.0.1:{port}", "--clients", "1", "--seconds", "0.5",
                 "--sample-s", "0.2", "--out", str(out))  # fmt: skip
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no session ran against" in err[0] and "(0 attempt(s), 0 refused)" in err[0], err
    assert not out.exists()  # nothing written that reads as a result
    assert cli("bench", "serve", "--url", f"http://127.0.0.1:{port}", "--out", "/proc/sl") == 1
    err = capsys.readouterr().err.strip()
    assert "/proc/sl/serve-load.json: cannot write" in err and "summary.json" not in err, err  # the file it writes


def test_report_names_a_file_given_as_run_folder_and_the_file_it_writes(tmp_path: Path, cli, capsys) -> None:
    (tmp_path / "dlg").mkdir()
    (tmp_path / "dlg" / "d1.json").write_text("{}")
    assert cli("bench", "report", str(tmp_path / "dlg" / "d1.json")) == 1
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"run folder {tmp_path / 'dlg' / 'd1.json'} is a file, not a folder; give the folder that "
                        "holds the run's summary.json and latency.json files"), err  # fmt: skip
    assert cli("bench", "report", str(tmp_path / "dlg"), "--out", "/proc/rep") == 1
    err = capsys.readouterr().err.strip()
    assert "/proc/rep/report.md: cannot write" in err and "summary.json" not in err, err


def test_run_out_inside_the_checkpoint_or_the_notes_is_refused(tiny_checkpoint_dir: Path, tmp_path: Path, cli, capsys):
    """A run's --out in the --checkpoint folder or the --knowledge notes would write among what the run reads
    (docs/OUTPUT.md, "Outputs never overwrite what the run reads"): refused before anything loads, nothing written."""
    data = tmp_path / "set"
    (data / "audios").mkdir(parents=True)
    (data / "meta.json").write_text('[{"id": "q1", "question": "Capital of France?", "answers": ["Paris"]}]')
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint_dir, ckpt)
    notes = tmp_path / "kn"
    notes.mkdir()
    (notes / "a.md").write_text("note")
    before = _listing(tmp_path)
    qa = ["bench", "qa", "--set", "llamaq", "--data", str(data), "--checkpoint", str(ckpt), "--knowledge", str(notes)]
    for out, why in (
        (ckpt / "run", f"lies inside the --checkpoint folder {ckpt}"),
        (notes, "is the --knowledge folder"),
        (notes / "run", f"lies inside the --knowledge folder {notes}"),
    ):
        assert cli(*qa, "--out", str(out)) == 2
        err = capsys.readouterr().err
        assert f"--out {out}: {why}, which the run reads" in err and err.count("\n") == 1, err
    assert _listing(tmp_path) == before and not (ckpt / "run").exists()
