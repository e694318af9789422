"""``cspan bench report``: Markdown tables and PNG plots from score files written by the scorers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cspan.bench import fdb_v1, fdb_v3, report
from cspan.bench.errors import BenchDataError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

LATENCY = {
    "gpu": "NVIDIA H200",
    "torch": "2.13.0",
    "dtype": "bfloat16",
    "rows": [
        {"n": 16, "mean_ms": 56.1, "sd_ms": 0.2, "p99_ms": 56.3},
        {"n": 0, "mean_ms": 34.7, "sd_ms": 0.4, "p99_ms": 35.2},
        {"n": 600, "mean_ms": 86.1, "sd_ms": 0.3, "p99_ms": 86.3},
    ],
    "step": {"mean_ms": 34.7, "sd_ms": 0.4, "p99_ms": 35.2},
}


@pytest.fixture
def run_dir(tmp_path: Path, v1_dir: Path) -> Path:
    run = tmp_path / "model-a"
    scores = run / "fdb-v1"
    for name, kind in [
        ("pause_handling_example", fdb_v1.TaskKind.PAUSE_HANDLING),
        ("smooth_turn_taking_example", fdb_v1.TaskKind.TURN_TAKING),
        ("user_interruption_example", fdb_v1.TaskKind.USER_INTERRUPTION),
    ]:
        fdb_v1.write_task_score(fdb_v1.score_task(v1_dir / name, kind, reuse_ratings=True, write_ratings=False), scores)
    gt = [1.0 / 51] * 51
    bc = [
        fdb_v1.score_backchannel("0", [(1.0, 1.4)], fdb_v1.OutputTranscript(), 10.0, gt),
        fdb_v1.score_backchannel("1", [(1.0, 4.5)], fdb_v1.OutputTranscript(), 10.0, gt),
    ]
    fdb_v1.write_task_score(fdb_v1.TaskScore(fdb_v1.summarize_backchannel("icc_backchannel", bc), bc), scores)
    scenarios = fdb_v3.parse_scenarios(
        [
            {
                "id": "a",
                "domain": "travel_identity",
                "difficulty": "easy",
                "expected_tool_calls": [{"function": "track_order", "args": {"order_id": "1"}}],
            },
            {
                "id": "b",
                "domain": "ecommerce_support",
                "difficulty": "easy",
                "expected_tool_calls": [{"function": "add_to_cart", "args": {}}],
            },
        ]
    )
    results = [
        fdb_v3.V3Result(
            example_id="a",
            actual_tool_calls=[fdb_v3.ToolCall(function="track_order", args={"order_id": "1"})],
            transcript="Your order ships today.",
            user_speech_end_rel=2.0,
            audio_agent_speech_start=3.0,
            task_completion_latency_s=4.5,
            filler_sentence="",
        ),
        fdb_v3.V3Result(example_id="b", transcript=""),
    ]
    summary, samples = fdb_v3.score_results(scenarios, results)
    fdb_v3.write_v3_score(summary, samples, run / "fdb-v3")
    (run / "latency.json").write_text(json.dumps(LATENCY))
    return run


def test_report_tables(run_dir: Path) -> None:
    markdown, written = report.build_report(run_dir)
    assert written[0] == run_dir / "report.md" and (run_dir / "report.md").read_text() == markdown
    # Span latency, the seed's layout: one column per n (sorted), mean ± sd and P99 rows.
    assert "| n (frames) | 0 | 16 | 600 |" in markdown
    assert "| mean ± sd, ms | 34.7 ± 0.4 | 56.1 ± 0.2 | 86.1 ± 0.3 |" in markdown
    assert "| P99, ms | 35.2 | 56.3 | 86.3 |" in markdown
    assert "GPU NVIDIA H200, torch 2.13.0, dtype bfloat16" in markdown
    assert "Plain step: 34.7 ± 0.4 ms, P99 35.2 ms." in markdown
    assert "P99 over the 80 ms frame budget at n = 600." in markdown
    # Full-Duplex-Bench v1: one headline row for the run, columns in the benchmark's order.
    header = next(line for line in markdown.splitlines() if line.startswith("| Run | Pause"))
    assert header == (
        "| Run | Pause TOR ↓ | BC TOR (icc) ↓ | BC Freq (icc) ↑ | BC JSD (icc) ↓ | TT TOR ↑ | TT Lat (s) ↓ "
        "| UI TOR ↑ | UI Rating ↑ | UI Lat (s) ↓ |"
    )
    bc = json.loads((run_dir / "fdb-v1" / "icc_backchannel" / "summary.json").read_text())["metrics"]
    row = f"| fdb-v1 | 1.000 | 0.500 | 0.050 | {bc['jsd']:.3f} | 1.000 | 1.350 | 1.000 | 4.000 | 4.080 |"
    assert row in markdown
    assert f"JSD {bc['jsd']:.3f} ± {bc['jsd_std']:.3f}" in markdown
    # Full-Duplex-Bench v3: the paper's columns; one of two samples passes, one turn taken.
    assert (
        "| Run | Tool Sel ↑ | Arg Acc ↑ | Resp Qual ↑ | Pass@1 ↑ | Turn-take ↑ | Latency (s) ↓ | Interrupt ↓ | Filler ↓ |"
        in markdown
    )
    assert "| fdb-v3 | 1.000 | 1.000 | – | 0.500 | 50.0 % | 4.50 | 0.0 % | 0.0 % |" in markdown
    assert "| Run | ecommerce_support | travel_identity |" in markdown
    assert "response quality skipped: no judge configured" in markdown


def test_report_plots(run_dir: Path) -> None:
    _, written = report.build_report(run_dir, run_dir / "out")
    names = sorted(p.name for p in written)
    assert names == ["fdb_v1_tasks.png", "fdb_v3_metrics.png", "latency_vs_span.png", "report.md"]
    import matplotlib.image as mpimg

    for path in written[1:]:
        assert path.read_bytes()[:8] == PNG_MAGIC
        height, width = mpimg.imread(str(path)).shape[:2]
        assert width > 300 and height > 200
    assert "![latency vs span length](latency_vs_span.png)" in (run_dir / "out" / "report.md").read_text()


def test_report_without_latency_and_with_a_bad_file(tmp_path: Path) -> None:
    summary = fdb_v1.summarize_pause("synthetic_pause_handling", [fdb_v1.PauseSample(id="1", tor=0, n_words=0)])
    fdb_v1.write_task_score(fdb_v1.TaskScore(summary, []), tmp_path)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "summary.json").write_text("{not json")
    markdown, written = report.build_report(tmp_path, plots=False)
    assert [p.name for p in written] == ["report.md"]
    assert "| Run | Pause TOR (synthetic) ↓ |" in markdown
    assert "_No latency.json in this run: span latency not measured._" in markdown
    assert "broken/summary.json: JSONDecodeError" in markdown


def test_report_needs_score_files(tmp_path: Path) -> None:
    with pytest.raises(BenchDataError, match=r"holds no summary\.json"):
        report.build_report(tmp_path)
    with pytest.raises(BenchDataError, match="does not exist"):
        report.build_report(tmp_path / "missing")


def test_cli_report(run_dir: Path, capsys) -> None:
    from cspan.core.cli import main

    assert main(["bench", "report", str(run_dir), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "## Full-Duplex-Bench v1" in out and "wrote " in out
    assert not (run_dir / "fdb_v1_tasks.png").exists()
    assert main(["bench", "report", str(run_dir / "nothing-here")]) == 1


def test_latency_file_names(tmp_path: Path) -> None:
    (tmp_path / "span_latency.json").write_text(json.dumps({**LATENCY, "rows": LATENCY["rows"][:1]}))
    (tmp_path / "fdb_latency.json").write_text(json.dumps({"summary": {"first_response": 1.2}}))
    markdown, _ = report.build_report(tmp_path, plots=False)
    assert "| n (frames) | 16 |" in markdown
    assert "fdb_latency" not in markdown
    assert "Skipped files" not in markdown


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("[]", "not a span-latency report (no 'rows' list in a JSON object)"),
        ('{"gpu": "cpu"}', "not a span-latency report (no 'rows' list in a JSON object)"),
        ('{"rows": []}', "no span-latency rows ('rows' is empty)"),
        ('{"rows": [{"n": 16}]}', "not a span-latency report (rows.0.mean_ms: Field required"),
    ],
)
def test_an_unusable_latency_json_is_listed_as_skipped(tmp_path: Path, content: str, reason: str) -> None:
    summary = fdb_v1.summarize_pause("synthetic_pause_handling", [fdb_v1.PauseSample(id="1", tor=0, n_words=0)])
    fdb_v1.write_task_score(fdb_v1.TaskScore(summary, []), tmp_path)
    (tmp_path / "latency.json").write_text(content)
    markdown, _ = report.build_report(tmp_path, plots=False)
    assert "_No usable latency.json in this run (see Skipped files): span latency not measured._" in markdown
    assert f"Skipped files:\n\n- {tmp_path / 'latency.json'}: {reason}" in markdown
