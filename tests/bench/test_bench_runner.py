"""`cspan bench fdb-v1 run`: outputs on the input's timeline, output.json, scores, a summary, resuming."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

from cspan.bench.errors import BenchDataError, BenchSettingsError
from cspan.bench.fdb_v1 import TaskKind
from cspan.bench.fdb_v1_run import resolve_input_tasks, task_prompt


def _dataset(root: Path, fixture_file) -> Path:
    """candor_turn_taking/{0,1}/ with input.wav (two short fixture recordings, the second at 16 kHz like most of
    the benchmark) and turn_taking.json."""
    for i, name in enumerate(["question_weather_24k.wav", "question_exchange_24k.wav"]):
        sample = root / "candor_turn_taking" / str(i)
        sample.mkdir(parents=True)
        if i == 0:
            shutil.copyfile(fixture_file("audio", name), sample / "input.wav")
        else:
            pcm, sr = sf.read(fixture_file("audio", name), dtype="float32")
            sf.write(sample / "input.wav", soxr.resample(pcm, sr, 16000), 16000, subtype="PCM_16")
        turn = [{"text": "[TURN-TAKING]", "timestamp": [2.5 + 0.1 * i, 2.9]}]
        (sample / "turn_taking.json").write_text(json.dumps(turn))
    (root / "candor_turn_taking" / "notes").mkdir()  # a folder without input.wav is not a sample
    return root


def _run_args(checkpoint: Path, data: Path, out: Path) -> list[str]:
    """``cspan bench fdb-v1 run`` of ``data`` into ``out``: no router, sphinx transcripts, quiet."""
    return [
        "bench", "fdb-v1", "run", "--checkpoint", str(checkpoint), "--data", str(data), "--out", str(out),
        "--router", "none", "--asr", "sphinx", "--quiet",
    ]  # fmt: skip


@pytest.mark.slow
def test_fdb_v1_run_renders_transcribes_scores_and_resumes(tiny_checkpoint_dir, fixture_file, tmp_path, cli, capsys):
    data, out = _dataset(tmp_path / "data", fixture_file), tmp_path / "out"
    args = _run_args(tiny_checkpoint_dir, data, out)
    assert cli(*args) == 0
    printed = capsys.readouterr().out
    assert "rendered 2, kept 0, transcribed 2" in printed
    assert "| Run | TT TOR (candor) ↑ | TT Lat (s) (candor) ↓ |" in printed

    task_out = out / "candor_turn_taking"
    mtimes = {}
    for i in ("0", "1"):
        sample = task_out / i
        # the inputs travel with the output, so OUT is a dataset in the benchmark's layout
        assert (sample / "input.wav").read_bytes() == (data / "candor_turn_taking" / i / "input.wav").read_bytes()
        assert json.loads((sample / "turn_taking.json").read_text())[0]["text"] == "[TURN-TAKING]"
        # output.wav: same rate and same length as the input, the agent one frame (80 ms) late
        info_in, info_out = sf.info(sample / "input.wav"), sf.info(sample / "output.wav")
        assert info_out.samplerate == info_in.samplerate == (24000, 16000)[int(i)]
        assert info_out.frames == info_in.frames and info_out.channels == 1
        agent, rate = sf.read(sample / "output.wav", dtype="float32")
        first_frame = int(0.08 * rate)
        assert np.all(np.abs(agent[: first_frame - 40]) < 1e-3) and np.abs(agent[first_frame:]).max() > 0.01
        # output.json in the benchmark's format
        transcript = json.loads((sample / "output.json").read_text())
        assert set(transcript) == {"text", "chunks"} and isinstance(transcript["chunks"], list)
        # per-sample record with the score
        record = json.loads((sample / "run.json").read_text())
        assert record["complete"] is True and record["id"] == i and record["kind"] == "turn_taking"
        assert record["settings"]["prompt"] == "You enjoy having a good conversation."
        assert record["prefix_frames"] > 0
        assert record["frames"] == -(-round(info_in.duration * 24000) // 1920)
        assert record["score"]["id"] == i and record["score"]["tor"] in (0, 1)
        assert record["score"]["turn_end_s"] == pytest.approx(2.5 + 0.1 * int(i))
        mtimes[i] = (sample / "output.wav").stat().st_mtime_ns
    assert not (task_out / "notes").exists()

    summary = json.loads((task_out / "summary.json").read_text())
    assert summary["benchmark"] == "fdb-v1" and summary["kind"] == "turn_taking" and summary["n"] == 2
    assert summary["metrics"]["tor"] in (0.0, 0.5, 1.0)
    assert summary["config"]["render"]["checkpoint"]["source"] == str(tiny_checkpoint_dir)
    samples = json.loads((task_out / "samples.json").read_text())
    assert [s["id"] for s in samples] == ["0", "1"]
    assert "TT TOR" in (out / "summary.md").read_text()

    # resuming: nothing is rendered again, the same outputs are scored again
    assert cli(*args) == 0
    assert "rendered 0, kept 2, transcribed 0" in capsys.readouterr().out
    for i in ("0", "1"):
        assert (task_out / i / "output.wav").stat().st_mtime_ns == mtimes[i]


def test_resolve_input_tasks(tmp_path: Path, fixture_file) -> None:
    data = _dataset(tmp_path / "data", fixture_file)
    (task,) = resolve_input_tasks(data)
    assert task.name == "candor_turn_taking" and task.kind is TaskKind.TURN_TAKING
    assert [p.name for p in task.samples] == ["0", "1"]
    # a task folder given directly, and a name that needs its kind spelled out
    (direct,) = resolve_input_tasks(data / "candor_turn_taking")
    assert direct.samples == task.samples
    shutil.copytree(data / "candor_turn_taking", data / "mine")
    (named,) = resolve_input_tasks(data, ["mine=pause_handling"])
    assert named.kind is TaskKind.PAUSE_HANDLING and len(named.samples) == 2
    with pytest.raises(BenchSettingsError, match="KIND"):  # a bad --tasks: exit status 2
        resolve_input_tasks(data, ["mine"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BenchDataError, match="no task folders"):
        resolve_input_tasks(empty)


def test_task_prompts_follow_personaplex() -> None:
    assert task_prompt(TaskKind.USER_INTERRUPTION).startswith("You are a wise and friendly teacher.")
    for kind in (TaskKind.PAUSE_HANDLING, TaskKind.BACKCHANNEL, TaskKind.TURN_TAKING):
        assert task_prompt(kind) == "You enjoy having a good conversation."
    assert task_prompt(TaskKind.TURN_TAKING, "Be brief.") == "Be brief."


@pytest.mark.slow
def test_fdb_v1_run_scores_only_the_samples_it_ran(tiny_checkpoint_dir, fixture_file, tmp_path, cli, capsys):
    out = tmp_path / "out"
    args = _run_args(tiny_checkpoint_dir, _dataset(tmp_path / "data", fixture_file), out)
    assert cli(*args) == 0
    capsys.readouterr()
    # a second run over the first sample only: the summary is of that sample, not of what an earlier run left
    assert cli(*args, "--limit", "1") == 0
    assert "rendered 0, kept 1" in capsys.readouterr().out
    task_out = out / "candor_turn_taking"
    assert json.loads((task_out / "summary.json").read_text())["n"] == 1
    assert [s["id"] for s in json.loads((task_out / "samples.json").read_text())] == ["0"]


@pytest.mark.slow
def test_fdb_v1_run_says_why_it_renders_an_older_releases_samples_again(
    tiny_checkpoint_dir, fixture_file, tmp_path, cli, capsys, caplog
):
    """A release that recorded fewer settings (e3b68c5's run.json has no checkpoint.voice_file, voice_sha256,
    voice_form, voice_default) wrote a finished sample: the resumed run renders it again, as the settings differ,
    and says so when it finds it (a run of hours can still be stopped) and in its notes; it rendered it again
    without a word."""
    from cspan.bench.session import settings_key

    data = _dataset(tmp_path / "data", fixture_file)
    out = tmp_path / "out"
    args = [
        "bench", "fdb-v1", "run", "--checkpoint", str(tiny_checkpoint_dir), "--data", str(data), "--out", str(out),
        "--router", "none", "--asr", "none", "--quiet",
    ]  # fmt: skip
    assert cli(*args) == 0
    capsys.readouterr()
    record_path = out / "candor_turn_taking" / "0" / "run.json"
    record = json.loads(record_path.read_text())
    for name in ("voice_file", "voice_sha256", "voice_form", "voice_default"):
        del record["settings"]["checkpoint"][name]
    record["settings_key"] = settings_key(record["settings"])
    record_path.write_text(json.dumps(record))

    with caplog.at_level("WARNING"):
        assert cli(*args) == 0
    printed = capsys.readouterr().out
    assert "rendered 1, kept 1" in printed
    assert (
        "note: 1 finished output(s) rendered again: they had been rendered with other settings (checkpoint.voice_default, "
        "checkpoint.voice_file, checkpoint.voice_form, checkpoint.voice_sha256)" in printed
    )
    (warning,) = [
        r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "other settings" in r.getMessage()
    ]
    assert str(out / "candor_turn_taking" / "0") in warning and "stop now" in warning
    assert cli(*args) == 0  # rendered with this run's settings now: kept, nothing said
    printed = capsys.readouterr().out
    assert "rendered 0, kept 2" in printed and "rendered again" not in printed
