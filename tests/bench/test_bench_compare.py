"""``cspan bench report RUN --compare published``: the run beside the published rows, laid out like the paper."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cspan.bench import fdb_v1
from cspan.bench.errors import BenchDataError
from cspan.bench.fdb_v3 import V3Summary
from cspan.bench.published import TABLES, load_published
from cspan.bench.qa import QASummary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write(path: Path, model: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(model.model_dump_json(indent=2))  # type: ignore[attr-defined]


def qa_summary(task: str, ref: float, resp: float, delays: tuple[float, float, float] | None) -> QASummary:
    metrics: dict[str, float | None] = {"ref_acc": ref, "resp_acc": resp}
    if delays is not None:
        metrics.update(ttfat_s=delays[0], keyword_delay_s=delays[1], e2ekd_s=delays[2])
    config = {"judge": {"url": "http://judge/v1/chat/completions", "model": "judge-x"}, "timing": {"words": "asr"}}
    return QASummary(task=task, n=10, metrics=metrics, config=config)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    run = tmp_path / "model-b"
    write(run / "qa_llamaq" / "summary.json", qa_summary("llamaq", 0.8, 0.75, (0.5, 2.0, 2.5)))
    write(run / "qa_halueval" / "summary.json", qa_summary("halueval", 0.4, 0.3, (0.3, 3.0, 3.3)))
    write(run / "qa_gsm8k" / "summary.json", qa_summary("gsm8k", 0.7, 0.6, None))
    kinds = fdb_v1.TaskKind
    for task, kind, metrics in [
        ("candor_turn_taking", kinds.TURN_TAKING, {"tor": 0.9, "latency_s": 0.07}),
        ("candor_pause_handling", kinds.PAUSE_HANDLING, {"tor": 0.8}),
        ("synthetic_pause_handling", kinds.PAUSE_HANDLING, {"tor": 0.85}),
        ("pause_handling_example", kinds.PAUSE_HANDLING, {"tor": 1.0}),
        ("icc_backchannel", kinds.BACKCHANNEL, {"tor": 0.7, "frequency": 0.1, "jsd": 0.72}),
        ("synthetic_user_interruption", kinds.USER_INTERRUPTION, {"tor": 0.93, "rating": 3.9, "latency_s": 0.6}),
    ]:
        write(run / "fdb_v1" / task / "summary.json", fdb_v1.TaskSummary(task=task, kind=kind, n=5, metrics=metrics))
    v3_metrics = {
        "tool_selection": 0.85,
        "argument_accuracy": 0.57,
        "response_quality": 0.41,
        "pass_rate": 0.47,
        "take_turn_rate": 0.95,
        "task_completion_latency_s": 5.83,
        "interruption_rate": 0.737,
        "filler_rate": 0.96,
    }
    config = {"world": {"kind": "fdb-v3-release"}, "judge": {"model": "gpt-4o"}}
    write(run / "fdb_v3" / "summary.json", V3Summary(n=100, metrics=v3_metrics, config=config))
    rows = [{"n": n, "mean_ms": m, "sd_ms": 0.5, "p99_ms": m + 1} for n, m in [(0, 30.0), (16, 50.0), (600, 81.0)]]
    (run / "latency.json").write_text(
        json.dumps({"gpu": "NVIDIA H200", "torch": "2.13.0", "dtype": "bf16", "rows": rows})
    )
    return run


def test_published_data_is_consistent_and_sourced() -> None:
    data = load_published()
    assert set(data.tables) == set(TABLES)
    assert data.sources["seed-readme"].where.startswith("github.com/mindlogic-ai/Context-Spanning README.md at commit")
    v3 = {r.system: r for r in data.tables["fdb_v3"]}
    assert v3["GPT-Realtime"].values["tool_selection"] == 0.876 and v3["GPT-Realtime"].source == "fdb-v3"
    assert v3["Context Spanning"].values["filler_rate"] == 96.0
    qa = {r.system: r for r in data.tables["qa"]}
    assert qa["MoshiRAG (Gemma 3)"].values["triviaqa.ref"] == 73.7 and qa["MoshiRAG (Gemma 3)"].origin == "moshirag"
    v1 = {r.system: r for r in data.tables["fdb_v1"]}
    assert v1["MoshiRAG"].values["user_interruption.latency_s"] is None
    delay = {r.system: r for r in data.tables["qa_delay"]}
    assert delay["Vanilla Moshi"].values == {"ttfat_s": 0.0, "keyword_delay_s": 2.1, "e2ekd_s": 2.1}
    # every row says where in its source it was read; the delay rows not in the project's digest of MoshiRAG's
    # Table 1 (docs/reference/benchmarks.md 3.3) are marked unverified
    assert all(r.where for rows in data.tables.values() for r in rows)
    assert {r.system for r in data.tables["qa_delay"] if r.unverified} == {
        "Baichuan-Audio",
        "LLaMA-Omni2",
        "Qwen 2.5 Omni",
        "Vanilla Moshi fine-tuned on RAG data",
    }
    assert "Kyutai's own Full-Duplex-Bench re-implementation" in v1["MoshiRAG"].note


def test_report_puts_the_run_beside_the_published_rows(run: Path, cli, capsys) -> None:
    assert cli("bench", "report", str(run), "--compare", "published") == 0
    md = (run / "report.md").read_text()
    assert md.index("## Compared with the published tables") < md.index("## Context Span processing latency")

    # Table 1: systems as rows, the published ones with their source, the run last; percent with one decimal
    assert "| Model | Source | LlamaQ ref. ↑ | LlamaQ resp. ↑ | WebQ ref. ↑ |" in md
    assert (
        "| MoshiRAG (Gemma 3)† | seed-readme, from moshirag | 83.0 | 80.3 | 71.5 | 67.2 | 73.7 | 69.6 | 42.0 | 36.3 |"
        in md
    )
    assert "| **model-b** (this run) |  | 80.0 | 75.0 | – | – | – | – | 40.0 | 30.0 |" in md
    assert "| **model-b** (this run) |  | – | – | – | – | – | – | – | – | 70.0 | 60.0 |" in md  # GSM8K last
    # delays: macro-average over the QA sets present (LlamaQ, HaluEval): (0.5 + 0.3) / 2, (2 + 3) / 2, (2.5 + 3.3) / 2
    assert "| GLM-4-Voice | moshirag | 0.30 | 4.20 | 4.40 |" in md
    assert "| **model-b** (this run) |  | 0.40 | 2.50 | 2.90 |" in md
    assert "macro-average over llamaq, halueval; word times from asr" in md
    # rows that could not be checked against MoshiRAG's Table 1 are marked, with why
    assert "| Baichuan-Audio‡ | moshirag | 1.00 | 3.80 | 4.80 |" in md
    assert "- Baichuan-Audio‡: not verified against the source: the row is not in docs/reference" in md
    assert "‡ = values not verified against the source" in md

    # Table 2: metrics as rows grouped by task, the run first, then the published systems
    assert (
        "| Task | Metric | **model-b** (this run) | Context Spanning | PersonaPlex† | Moshi† | Gemini† | MoshiRAG |"
        in md
    )
    assert "| Turn-Taking | TOR ↑ | 0.900 | 0.899 | 0.992 | 0.941 | 0.655 | 0.830 |" in md
    assert "| Pause Handling | TOR, Candor ↓ | 0.800 | 0.824 | 0.662 | 0.980 | 0.310 | 0.560 |" in md
    assert "|  | TOR, synthetic ↓ | 0.850 | 0.861 | 0.584 | 0.985 | 0.255 | 0.320 |" in md
    assert "|  | Latency, s ↓ | 0.600 | 0.598 | 0.400 | 0.257 | 1.183 | – |" in md
    assert "pause task 'pause_handling_example' left out" in md
    assert "- MoshiRAG: measured with Kyutai's own Full-Duplex-Bench re-implementation" in md
    assert "Not compared" not in md  # the run has every table

    # Table 3: rates in percent, latency in seconds; what the run rests on
    assert (
        "| Tool Use | Tool selection ↑ | 0.850 | 0.855 | 0.738 | 0.876 | 0.786 | 0.817 | 0.797 | 0.794 | 0.803 |" in md
    )
    assert (
        "| Turn-Taking Dynamics | Take-turn rate, % ↑ | 95.0 | 95.0 | 94.0 | 96.0 | 92.0 | 78.0 | 94.0 | 96.0 | 100.0 |"
        in md
    )
    assert "|  | Filler rate, % ↓ | 96.0 | 96.0 | 92.3 | 16.9 | 8.9 | 31.7 | 44.3 | 88.0 | 26.9 |" in md
    assert "model-b (this run): n = 100; world: fdb-v3-release; judge: gpt-4o" in md

    # span latency, the README's layout
    assert "| **model-b** (this run) | mean ± sd | 30.0 ± 0.5 | 50.0 ± 0.5 | – | – | 81.0 ± 0.5 |" in md
    assert "| Context Spanning | mean ± sd | 34.7 ± 0.4 | 56.1 ± 0.2 | 57.5 ± 0.2 | 62.0 ± 0.3 | 86.1 ± 0.3 |" in md

    # sources with where they were read
    assert "- **seed-readme**: Context Spanning" in md and "c05344f7c08aa753ddf0690c34f9239d1493ec22" in md
    assert "- **fdb-v3**: Full-Duplex-Bench-v3" in md and "- **moshirag**: MoshiRAG" in md

    for table in ("qa", "math", "qa_delay", "fdb_v1", "fdb_v3", "span_latency"):
        path = run / f"compare_{table}.png"
        assert path.read_bytes()[:8] == PNG_MAGIC, table
        assert f"](compare_{table}.png)" in md
    # the spoken-QA section of the report itself, with the delays
    assert "| llamaq | 10 | 80.0 | 75.0 |" in md and "| 0.50 | 2.00 | 2.50 |" in md
    assert "wrote " in capsys.readouterr().out


@pytest.mark.parametrize(
    ("sets", "row", "notes"),
    [
        # QA sets without any delay: the delay table is there, the run's row empty, and why
        ({"webq": None, "llamaq": None}, "| – | – | – |", ["no delay values in llamaq, webq"]),
        # one set without: the mean is over the others, identity kept, the missing one named
        (
            {"webq": None, "llamaq": (0.5, 2.0, 2.5), "triviaqa": (0.25, 1.5, 1.75)},
            "| 0.38 | 1.75 | 2.12 |",
            ["macro-average over llamaq, triviaqa; word times from asr", "no delay values in webq"],
        ),
    ],
)
def test_the_delay_table_says_what_the_run_row_rests_on(tmp_path: Path, sets: dict, row: str, notes: list) -> None:
    from cspan.bench.report import build_report

    run = tmp_path / "model-c"
    for task, delays in sets.items():
        write(run / f"qa_{task}" / "summary.json", qa_summary(task, 0.6, 0.5, delays))
    md, _ = build_report(run, plots=False, compare="published")
    assert "### Table 1 (delays)." in md and f"| **model-c** (this run) |  {row}" in md
    for note in notes:
        assert f"- model-c (this run): {note}" in md
    assert (
        "Not compared (the run has no results for them): Table 1 (continued). Spoken math reasoning (accuracy, %); "
        "Table 2. Full-Duplex-Bench v1; Table 3. Full-Duplex-Bench v3 (tool calling under disfluency); Context Span "
        "processing latency (span prefill + one decoding step, ms)." in md
    )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"take_turn_rate": float("nan")}, "take_turn_rate = nan is not a % value"),
        ({"take_turn_rate": 120.0}, "take_turn_rate = 120.0 is not a % value (0 to 100)"),
        ({"pass_rate": 47.0}, "pass_rate = 47.0 is not a fraction value (0 to 1)"),
        ({"task_completion_latency_s": -1.0}, "is not a s value"),
    ],
)
def test_compare_file_values_are_checked_against_their_unit(run: Path, tmp_path: Path, values: dict, message: str):
    from cspan.bench.report import build_report

    mine = tmp_path / "mine.json"
    row = {"system": "Baseline", "source": "lab", "values": values}
    mine.write_text(json.dumps({"sources": {"lab": {"title": "t", "where": "w"}}, "tables": {"fdb_v3": [row]}}))
    with pytest.raises(BenchDataError, match=re.escape(message)):
        build_report(run, compare=mine)


def test_compare_with_a_file_and_bad_files(run: Path, tmp_path: Path) -> None:
    from cspan.bench.report import build_report

    mine = tmp_path / "mine.json"
    mine.write_text(
        json.dumps(
            {
                "sources": {"lab": {"title": "Our lab notebook", "where": "page 3"}},
                "tables": {"fdb_v3": [{"system": "Baseline", "source": "lab", "values": {"pass_rate": 0.5}}]},
            }
        )
    )
    md, written = build_report(run, tmp_path / "out", plots=False, compare=mine)
    assert "| Task | Metric | **model-b** (this run) | Baseline |" in md
    assert "|  | Pass rate ↑ | 0.470 | 0.500 |" in md and "- **lab**: Our lab notebook. page 3." in md
    assert [p.name for p in written] == ["report.md"]
    mine.write_text(json.dumps({"sources": {}, "tables": {"fdb_v3": [{"system": "X", "source": "lab", "values": {}}]}}))
    with pytest.raises(BenchDataError, match="unknown source 'lab'"):
        build_report(run, compare=mine)
    mine.write_text(json.dumps({"sources": {"s": {"title": "t", "where": "w"}}, "tables": {"nope": []}}))
    with pytest.raises(BenchDataError, match="unknown table 'nope'"):
        build_report(run, compare=mine)
    with pytest.raises(BenchDataError, match="not readable"):
        build_report(run, compare=tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"tables": {}}, "mine.json is not published-results JSON: sources: Field required (got {'tables': {}})"),
        (
            {"sources": {"lab": {"title": "t"}}},
            "mine.json is not published-results JSON: sources.lab.where: Field required (got {'title': 't'})",
        ),
        ({"sources": {}, "tables": []}, "mine.json is not published-results JSON: tables: Input should be a valid"),
        ("{not json", "mine.json is not JSON: Expecting property name enclosed in double quotes: line 1 column 2"),
    ],
)
def test_a_bad_compare_file_is_one_line_naming_the_file_and_the_field(
    run: Path, tmp_path: Path, content: dict | str, message: str
) -> None:
    from cspan.bench.report import build_report

    mine = tmp_path / "mine.json"
    mine.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(BenchDataError) as caught:
        build_report(run, compare=mine)
    assert str(caught.value).startswith(f"{tmp_path}/{message}") and "\n" not in str(caught.value)
    assert "validation error" not in str(caught.value)
