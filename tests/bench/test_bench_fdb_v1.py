"""Full-Duplex-Bench v1 scorers: the fixture values of EXPECTED.md and hand-computed backchannel cases."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from cspan.bench import fdb_v1
from cspan.bench.errors import BenchDataError
from cspan.bench.fdb_v1 import Chunk, OutputTranscript, TaskKind


def words(*spans: tuple[float | None, float | None], prefix: str = "w") -> OutputTranscript:
    chunks = [Chunk(text=f"{prefix}{i}", timestamp=span) for i, span in enumerate(spans)]
    return OutputTranscript(text=" ".join(c.text for c in chunks), chunks=chunks)


@pytest.fixture(scope="module")
def icc_gt(v1_dir: Path) -> dict[str, list[float]]:
    return fdb_v1.load_icc_gt(v1_dir / "icc_gt_distribution.json")


# --- EXPECTED.md ---------------------------------------------------------------------------------------------------


def test_pause_handling_fixture(v1_dir: Path) -> None:
    score = fdb_v1.score_task(v1_dir / "pause_handling_example", TaskKind.PAUSE_HANDLING)
    assert score.summary.metrics == {"tor": 1.0}
    (sample,) = score.samples
    assert sample.n_words == 12
    output = fdb_v1.read_output_json(v1_dir / "pause_handling_example" / "1" / "output.json")
    assert fdb_v1.response_span_s(output.chunks) == pytest.approx(4.68)


def test_turn_taking_fixture(v1_dir: Path) -> None:
    score = fdb_v1.score_task(v1_dir / "smooth_turn_taking_example", TaskKind.TURN_TAKING)
    assert score.summary.metrics["tor"] == 1.0
    # Same float as the reference prints: 3.36 - 2.0100000000000016.
    assert score.summary.metrics["latency_s"] == 1.3499999999999983
    assert score.samples[0].turn_end_s == 2.0100000000000016


def test_user_interruption_fixture(v1_dir: Path) -> None:
    task = v1_dir / "user_interruption_example"
    score = fdb_v1.score_task(task, TaskKind.USER_INTERRUPTION, reuse_ratings=True, write_ratings=False)
    (sample,) = score.samples
    assert sample.tor == 1
    assert sample.interrupt_end_s == 13.144
    assert sample.latency_s == pytest.approx(4.08, abs=1e-9)
    assert sample.rating == 4
    assert score.summary.metrics == {"tor": 1.0, "latency_s": sample.latency_s, "rating": 4.0}
    output = fdb_v1.read_output_json(task / "1" / "output.json")
    assert len(output.chunks) == 32
    assert output.chunks[0].start == 17.224
    assert output.chunks[-1].end == pytest.approx(28.124)


def test_user_interruption_without_judge_notes_the_skip(v1_dir: Path) -> None:
    score = fdb_v1.score_task(v1_dir / "user_interruption_example", TaskKind.USER_INTERRUPTION)
    assert score.summary.metrics["rating"] is None
    assert score.summary.metrics["tor"] == 1.0
    assert any("no judge configured" in note for note in score.summary.notes)


@pytest.mark.parametrize(
    ("gt_id", "predictions", "duration", "bins", "expected"),
    [
        ("0", [(2.0, 2.5), (10.1, 10.6)], 23.0, 116, 0.786792356),
        ("1", [(1.0, 1.3), (5.2, 5.6), (12.0, 12.4)], 28.6, 144, 0.746734159),
        ("0", [(0.0, 23.0)], 23.0, 116, 0.297434899),
    ],
)
def test_backchannel_jsd_fixture_table(icc_gt, gt_id, predictions, duration, bins, expected) -> None:
    assert fdb_v1.backchannel_histogram(predictions, duration).size == bins
    assert fdb_v1.backchannel_jsd(predictions, duration, icc_gt[gt_id]) == pytest.approx(expected, abs=1e-6)


# --- the shared take-over rule -------------------------------------------------------------------------------------


def test_take_turn_thresholds() -> None:
    assert fdb_v1.take_turn([]) == 0
    # Three words inside 0.9 s: no take-over; a fourth word, or a 1.0 s span, makes it one.
    assert fdb_v1.take_turn(words((0.0, 0.3), (0.3, 0.6), (0.6, 0.9)).chunks) == 0
    assert fdb_v1.take_turn(words((0.0, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8)).chunks) == 1
    assert fdb_v1.take_turn(words((0.0, 0.5), (0.5, 1.0)).chunks) == 1
    # A last word without an end falls back to its start: 0.0 -> 0.5 span, one word short of four.
    assert fdb_v1.take_turn(words((0.0, 0.2), (0.5, None)).chunks) == 0


def test_turn_taking_latency_is_clipped_and_only_for_takeovers() -> None:
    early = fdb_v1.score_turn_taking("a", words((1.0, 1.5), (1.5, 2.5)), turn_end_s=2.0)
    assert (early.tor, early.latency_s) == (1, 0.0)
    quiet = fdb_v1.score_turn_taking("b", words((3.0, 3.2)), turn_end_s=2.0)
    assert (quiet.tor, quiet.latency_s) == (0, None)
    summary = fdb_v1.summarize_turn_taking("t", [early, quiet])
    assert summary.metrics == {"tor": 0.5, "latency_s": 0.0}
    none_took = fdb_v1.summarize_turn_taking("t", [quiet])
    assert none_took.metrics["latency_s"] is None and none_took.notes


# --- backchannel, by hand ------------------------------------------------------------------------------------------


def test_words_in_segment_overlap_rule() -> None:
    out = OutputTranscript(
        chunks=[
            Chunk(text="inside", timestamp=(1.1, 1.3)),
            Chunk(text="over_end", timestamp=(1.9, 2.2)),
            Chunk(text="over_start", timestamp=(0.8, 1.05)),
            Chunk(text="before", timestamp=(0.2, 0.9)),
            Chunk(text="after", timestamp=(2.1, 2.4)),
            Chunk(text="no_start", timestamp=(None, 1.5)),
            Chunk(text="no_end_inside", timestamp=(1.5, None)),
            Chunk(text="no_end_at_end", timestamp=(2.0, None)),
        ]
    )
    assert fdb_v1.words_in_segment(out.chunks, 1.0, 2.0) == ["inside", "over_end", "over_start", "no_end_at_end"]


def test_segment_take_turn_rule() -> None:
    assert fdb_v1.segment_take_turn(2, 0.9) == 0
    assert fdb_v1.segment_take_turn(3, 0.9) == 1
    assert fdb_v1.segment_take_turn(0, 1.0) == 1
    assert fdb_v1.segment_take_turn(4, 0.3) == 1


def test_histogram_uses_float_truncation() -> None:
    # 0.6 / 0.2 = 2.9999999999999996 -> bin 2; 1.2 / 0.2 = 5.999999999999999 -> bin 5.
    hist = fdb_v1.backchannel_histogram([(0.6, 0.6), (1.2, 1.2)], 2.0)
    assert hist.size == 11
    assert list(np.flatnonzero(hist > 0.1)) == [2, 5]


def test_resize_distribution_is_linear_and_not_renormalised() -> None:
    assert fdb_v1.resize_distribution([0.0, 1.0, 0.0], 5).tolist() == [0.0, 0.5, 1.0, 0.5, 0.0]


def _hand_jsd_two_bins(n_bins: int) -> float:
    """JS distance between "two of n bins hit once, 1e-10 everywhere" and a uniform ground truth, written out."""
    eps = 1e-10
    total = 2 * (1 + eps) + (n_bins - 2) * eps
    a, b, q = (1 + eps) / total, eps / total, 1.0 / n_bins
    kl_p = 2 * a * math.log(a / ((a + q) / 2)) + (n_bins - 2) * b * math.log(b / ((b + q) / 2))
    kl_q = 2 * q * math.log(q / ((a + q) / 2)) + (n_bins - 2) * q * math.log(q / ((b + q) / 2))
    return math.sqrt((kl_p + kl_q) / 2)


def test_backchannel_early_stop_over_three_seconds() -> None:
    # Segment 1 (0.4 s, one word) is a backchannel; segment 2 lasts 3.5 s: TOR = 1 and the scan stops, so segment 3
    # is neither scanned nor counted.
    segments = [(1.0, 1.4), (2.0, 5.5), (6.0, 6.3)]
    out = words((1.1, 1.3), (2.1, 2.5), (2.5, 3.0), (6.0, 6.2))
    gt = [1.0 / 51] * 51
    sample = fdb_v1.score_backchannel("7", segments, out, 10.0, gt)
    assert sample.tor == 1
    assert sample.predictions == [(1.0, 1.4)]
    assert sample.frequency == pytest.approx(1 / 10.0)
    # (1.0, 1.4) fills bins int(5.0) = 5 and int(6.999...) = 6 of int(10 / 0.2) + 1 = 51.
    assert sample.jsd == pytest.approx(_hand_jsd_two_bins(51), abs=1e-9)


def test_backchannel_last_segment_wins() -> None:
    # Segment 1: 1.5 s with two words -> TOR 1; segment 2: 0.4 s with one word -> TOR 0. The last one decides.
    segments = [(1.0, 2.5), (4.0, 4.4)]
    out = words((1.2, 1.8), (1.8, 2.3), (4.1, 4.3))
    gt = [1.0 / 51] * 51
    sample = fdb_v1.score_backchannel("3", segments, out, 10.0, gt)
    assert sample.tor == 0
    assert sample.predictions == segments
    assert sample.frequency == pytest.approx(2 / 10.0)
    # Bins: 5..12 for (1.0, 2.5) and 20..22 for (4.0, 4.4): 8 + 3 bins hit once each.
    hits = 11
    eps = 1e-10
    total = hits * (1 + eps) + (51 - hits) * eps
    a, b, q = (1 + eps) / total, eps / total, 1 / 51
    kl_p = hits * a * math.log(2 * a / (a + q)) + (51 - hits) * b * math.log(2 * b / (b + q))
    kl_q = hits * q * math.log(2 * q / (a + q)) + (51 - hits) * q * math.log(2 * q / (b + q))
    assert sample.jsd == pytest.approx(math.sqrt((kl_p + kl_q) / 2), abs=1e-9)
    # Reversed order: now the long-ish segment is last and TOR becomes 1.
    flipped = fdb_v1.score_backchannel("3", [(4.0, 4.4), (5.0, 6.5)], words((4.1, 4.3), (5.2, 5.8)), 10.0, gt)
    assert flipped.tor == 1


def test_backchannel_without_segments() -> None:
    sample = fdb_v1.score_backchannel("0", [], OutputTranscript(), 5.0, [0.5, 0.5])
    assert (sample.tor, sample.frequency, sample.jsd) == (0, 0.0, 1.0)


def test_backchannel_summary_is_mean_and_population_std() -> None:
    gt = [1.0 / 51] * 51
    a = fdb_v1.score_backchannel("1", [(1.0, 1.4)], words((1.1, 1.2)), 10.0, gt)
    b = fdb_v1.score_backchannel("2", [(1.0, 4.5)], words((1.1, 1.2)), 10.0, gt)
    summary = fdb_v1.summarize_backchannel("bc", [a, b])
    assert summary.metrics["tor"] == 0.5 and summary.metrics["tor_std"] == 0.5
    assert summary.metrics["frequency"] == pytest.approx(0.05) and summary.metrics["frequency_std"] == pytest.approx(
        0.05
    )
    assert summary.metrics["jsd"] == pytest.approx((a.jsd + 1.0) / 2)
    assert summary.metrics["jsd_std"] == pytest.approx(abs(1.0 - a.jsd) / 2)


# --- task folders --------------------------------------------------------------------------------------------------


def test_backchannel_task_folder_with_silero(tmp_path: Path, v1_dir: Path, icc_gt) -> None:
    src = v1_dir / "smooth_turn_taking_example" / "1"
    sample_dir = tmp_path / "icc_backchannel" / "0"
    sample_dir.mkdir(parents=True)
    for name in ("output.wav", "output.json"):
        shutil.copy(src / name, sample_dir / name)
    (tmp_path / "icc_backchannel" / "notes").mkdir()  # not all digits: ignored, as in the reference
    score = fdb_v1.score_task(tmp_path / "icc_backchannel", TaskKind.BACKCHANNEL, icc_gt=icc_gt)
    (sample,) = score.samples
    from cspan.bench.transcribe import read_audio_mono
    from cspan.bench.vad import speech_segments

    pcm, sr = read_audio_mono(sample_dir / "output.wav")
    segments = speech_segments(pcm, sr)
    expected = fdb_v1.score_backchannel(
        "0", segments, fdb_v1.read_output_json(sample_dir / "output.json"), 10.4, icc_gt["0"]
    )
    assert sample == expected
    # The response is speech from 3.4 s on in segments shorter than 3 s: all are counted and the last takes the turn.
    assert segments and all(end - start <= 3.0 for start, end in segments)
    assert segments[0][0] == pytest.approx(3.4, abs=0.15)
    assert sample.tor == 1 and len(sample.predictions) == len(segments)
    assert sample.frequency == pytest.approx(len(segments) / 10.4)


def test_backchannel_requires_ground_truth(tmp_path: Path) -> None:
    (tmp_path / "icc_backchannel" / "0").mkdir(parents=True)
    with pytest.raises(BenchDataError, match=r"icc_gt_distribution\.json"):
        fdb_v1.score_task(tmp_path / "icc_backchannel", TaskKind.BACKCHANNEL)


def test_missing_output_json_names_the_file(tmp_path: Path) -> None:
    sample = tmp_path / "candor_pause_handling" / "5"
    sample.mkdir(parents=True)
    (sample / "output.wav").write_bytes(b"")
    with pytest.raises(BenchDataError, match=r"5/output.json is missing"):
        fdb_v1.score_task(tmp_path / "candor_pause_handling", TaskKind.PAUSE_HANDLING)


def test_infer_task_kind() -> None:
    assert fdb_v1.infer_task_kind("candor_pause_handling") is TaskKind.PAUSE_HANDLING
    assert fdb_v1.infer_task_kind("synthetic_pause_handling") is TaskKind.PAUSE_HANDLING
    assert fdb_v1.infer_task_kind("icc_backchannel") is TaskKind.BACKCHANNEL
    assert fdb_v1.infer_task_kind("candor_turn_taking") is TaskKind.TURN_TAKING
    assert fdb_v1.infer_task_kind("synthetic_user_interruption") is TaskKind.USER_INTERRUPTION
    assert fdb_v1.infer_task_kind("scores") is None


def test_cli_scores_fixture_layout(tmp_path: Path, v1_dir: Path, capsys) -> None:
    from cspan.core.cli import main

    out = tmp_path / "run"
    rc = main(["bench", "fdb-v1", "score", "--data", str(v1_dir), "--out", str(out), "--reuse-ratings"])
    assert rc == 0
    summaries = {p.parent.name: json.loads(p.read_text()) for p in out.glob("*/summary.json")}
    assert set(summaries) == {"pause_handling_example", "smooth_turn_taking_example", "user_interruption_example"}
    assert summaries["smooth_turn_taking_example"]["metrics"]["latency_s"] == 1.3499999999999983
    assert summaries["user_interruption_example"]["metrics"]["rating"] == 4.0
    assert summaries["pause_handling_example"]["kind"] == "pause_handling"
    samples = json.loads((out / "user_interruption_example" / "samples.json").read_text())
    assert samples[0]["id"] == "1" and samples[0]["tor"] == 1
    assert "latency_s 1.35" in capsys.readouterr().out


def test_cli_transcribes_missing_output_json_with_pocketsphinx(tmp_path: Path, v1_dir: Path) -> None:
    import soundfile as sf

    from cspan.core.cli import main

    # A 4.5 s cut of the turn-taking fixture's output (kept short: pocketsphinx is slow on a busy machine): silent
    # for the first 1.4 s, then speech.
    pcm, sr = sf.read(str(v1_dir / "smooth_turn_taking_example" / "1" / "output.wav"), dtype="float32")
    sample = tmp_path / "data" / "candor_turn_taking" / "1"
    sample.mkdir(parents=True)
    sf.write(str(sample / "output.wav"), pcm[2 * sr : int(6.5 * sr)], sr, subtype="PCM_16")
    (sample / "turn_taking.json").write_text(json.dumps([{"text": "[TURN-TAKING]", "timestamp": [0.5, 0.9]}]))
    rc = main(["bench", "fdb-v1", "score", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "scores")])
    assert rc == 0
    written = json.loads((sample / "output.json").read_text())
    assert set(written) == {"text", "chunks"}
    chunks = [Chunk.model_validate(c) for c in written["chunks"]]
    assert chunks, "pocketsphinx recognised nothing in 3 s of speech"
    assert written["text"] == " ".join(c.text for c in chunks)
    assert chunks[0].start >= 1.0 and chunks[-1].end <= 4.5 + 1e-6
    assert all(a.start <= b.start for a, b in itertools.pairwise(chunks))
    summary = json.loads((tmp_path / "scores" / "candor_turn_taking" / "summary.json").read_text())
    expected = fdb_v1.score_turn_taking("1", OutputTranscript(**written), 0.5)
    assert expected.tor == 1
    assert summary["metrics"] == {"tor": 1.0, "latency_s": chunks[0].start - 0.5}
    assert summary["config"]["asr"] == "sphinx"


def test_cli_notes_sample_folders_without_an_output(tmp_path: Path, v1_dir: Path, capsys) -> None:
    from cspan.core.cli import main

    # a run cut short: sample 1 rendered, sample 2 only has its copied inputs; a second task has no output at all
    data = tmp_path / "data"
    task = data / "candor_turn_taking"
    shutil.copytree(v1_dir / "smooth_turn_taking_example" / "1", task / "1")
    (task / "2").mkdir()
    shutil.copyfile(v1_dir / "smooth_turn_taking_example" / "1" / "input.wav", task / "2" / "input.wav")
    shutil.copyfile(v1_dir / "smooth_turn_taking_example" / "1" / "turn_taking.json", task / "2" / "turn_taking.json")
    idle = data / "candor_pause_handling" / "7"
    idle.mkdir(parents=True)
    shutil.copyfile(v1_dir / "pause_handling_example" / "1" / "input.wav", idle / "input.wav")
    rc = main(["bench", "fdb-v1", "score", "--data", str(data), "--out", str(tmp_path / "scores")])
    assert rc == 0
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "scores" / "candor_turn_taking" / "summary.json").read_text())
    assert summary["n"] == 1
    assert any("not scored" in note and "2" in note for note in summary["notes"]), summary["notes"]
    idle_summary = json.loads((tmp_path / "scores" / "candor_pause_handling" / "summary.json").read_text())
    assert idle_summary["n"] == 0 and any("not scored" in note for note in idle_summary["notes"])
    assert printed.count("not scored") == 2
