"""Full-Duplex-Bench v3 scorers on small hand-built scenarios and results, with hand-computed values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cspan.bench import fdb_v3
from cspan.bench.errors import BenchDataError
from cspan.bench.fdb_v3 import ToolCall, V3Result, V3Scenario


def call(function: str, **args: Any) -> dict[str, Any]:
    return {"function": function, "args": args}


SCENARIOS = [
    {
        "id": "travel_01",
        "domain": "travel_identity",
        "difficulty": "medium",
        "title": "Search and book",
        "dialogue": [{"user": "Book me a flight to Vegas.", "ai": "I'll search flights to Las Vegas and book one."}],
        "expected_tool_calls": [
            call("search_flights", destination="Las Vegas", date="2026-08-20"),
            call("book_flight", flight_id="$RESULT_0.flights[0].flight_id", passenger_name="Alice Smith"),
        ],
        "disfluency_features": ["FILLER", "SELF_CORRECTION"],
        "state_rollback_test": True,
    },
    {
        "id": "finance_01",
        "domain": "finance_billing",
        "difficulty": "easy",
        "title": "Exchange rate",
        "expected_tool_calls": [call("get_exchange_rate", from_currency="USD", to_currency="EUR", amount=1000)],
        "disfluency_features": ["PAUSE"],
    },
    {
        "id": "shop_01",
        "domain": "ecommerce_support",
        "difficulty": "hard",
        "title": "Shoes",
        "expected_tool_calls": [
            call("search_products", query="running shoes"),
            call("add_to_cart", product_id="$RESULT_0.products[0].id", quantity=2),
            call("track_order", order_id="ORD_123"),
        ],
    },
    {
        "id": "housing_01",
        "domain": "housing_location",
        "difficulty": "easy",
        "title": "Apartments",
        "expected_tool_calls": [call("search_apartments", city="Austin", max_rent=2000)],
    },
]

RESULTS = [
    {  # all right, calm, with a filler sentence
        "example_id": "travel_01",
        "actual_tool_calls": [
            call("search_flights", destination="las vegas", date="2026-08-20"),
            call("book_flight", flight_id="FL123", passenger_name="alice_smith"),
        ],
        "transcript": "Let me check that for you. You're booked on flight FL123.",
        "user_speech_end_rel": 10.0,
        "audio_agent_speech_start": 11.5,
        "key_info_start_s": 14.0,
        "filler_sentence": "Let me check that for you.",
    },
    {  # right call (amount within 5 %) plus an extra one; spoke 0.8 s before the user finished
        "example_id": "finance_01",
        "actual_tool_calls": [
            call("get_exchange_rate", from_currency="usd", to_currency="eur", amount=1040),
            call("track_order", order_id="X"),
        ],
        "transcript": "That is 920 euros.",
        "user_speech_end_rel": 8.0,
        "audio_agent_speech_start": 7.2,
        "task_completion_latency_s": 3.0,
        "filler_sentence": "",
    },
    {  # wrong quantity, missing the third call
        "example_id": "shop_01",
        "actual_tool_calls": [
            call("search_products", query="Running Shoes"),
            call("add_to_cart", product_id="P9", quantity=3),
        ],
        "transcript": "Added to your cart.",
        "user_speech_end_rel": 5.0,
        "audio_agent_speech_start": 6.0,
        "task_completion_latency_s": 2.5,
        "filler_sentence": "",
    },
    {"example_id": "housing_01", "actual_tool_calls": [], "transcript": "", "asr_chunks": []},  # silent
    {"example_id": "not_a_scenario", "transcript": "hello"},
]


def scored() -> tuple[fdb_v3.V3Summary, list[fdb_v3.V3SampleScore]]:
    scenarios = fdb_v3.parse_scenarios({"scenarios": SCENARIOS})
    return fdb_v3.score_results(scenarios, [V3Result.model_validate(r) for r in RESULTS])


def test_per_sample_scores() -> None:
    _, samples = scored()
    travel, finance, shop, housing = samples
    assert (travel.tool_selection.score, travel.argument_accuracy.score, travel.passed) == (1.0, 1.0, True)
    # finance: 1 matched of 1 expected and 2 made -> R 1, P 0.5, F1 2*0.5/1.5 = 0.667; 1040 is within 5 % of 1000.
    assert (finance.tool_selection.recall, finance.tool_selection.precision, finance.tool_selection.score) == (
        1.0,
        0.5,
        0.667,
    )
    assert finance.argument_accuracy.score == 1.0
    assert not finance.passed and "unexpected tools: ['track_order']" in finance.failure_reason
    assert (finance.first_response_latency_s, finance.interrupted) == (-0.8, True)
    # shop: 2 of 3 expected, 2 made -> R 2/3, P 1, F1 0.8; arguments [1, 0 (quantity 3 vs 2), 0 (missing)] -> 0.333.
    assert shop.tool_selection.score == 0.8
    assert [d.score for d in shop.argument_accuracy.details] == [1.0, 0.0, 0.0]
    assert shop.argument_accuracy.score == 0.333
    assert shop.argument_accuracy.details[2].actual_args is None
    # housing: silent, nothing called -> R 0, P 1 (no calls), F1 0; not turn-taken, no timing.
    assert (housing.turn_taken, housing.tool_selection.score, housing.argument_accuracy.score) == (False, 0.0, 0.0)
    assert (housing.first_response_latency_s, housing.interrupted) == (None, None)
    assert travel.task_completion_latency_s == 4.0 and travel.has_filler is True and shop.has_filler is False


def test_summary_metrics() -> None:
    summary, _ = scored()
    m = summary.metrics
    assert summary.n == 4
    assert m["take_turn_rate"] == 0.75
    assert m["tool_selection"] == round((1.0 + 0.667 + 0.8) / 3, 3) == 0.822
    assert m["argument_accuracy"] == round((1.0 + 1.0 + 0.333) / 3, 3) == 0.778
    assert m["tool_selection_all"] == round((1.0 + 0.667 + 0.8 + 0.0) / 4, 3)
    assert m["argument_accuracy_all"] == round((1.0 + 1.0 + 0.333 + 0.0) / 4, 3)
    assert m["pass_rate"] == 0.25
    assert m["interruption_rate"] == round(1 / 3, 3)  # finance, of the three turn-taken timed samples
    assert m["response_latency_s"] == 1.25  # (1.5 + 1.0) / 2, interruption excluded
    assert m["task_completion_latency_s"] == 3.25  # (4.0 + 2.5) / 2
    assert m["filler_rate"] == 0.5  # travel yes, shop no; finance excluded as an interruption
    assert m["response_quality"] is None
    assert summary.counts == {
        "turn_taken": 3,
        "timed": 3,
        "interrupted": 1,
        "passed": 1,
        "completion_timed": 2,
        "filler_analysed": 2,
    }
    assert any("no judge configured" in n for n in summary.notes)
    assert any("not_a_scenario" in n for n in summary.notes)


def test_pass_rate_breakdowns() -> None:
    summary, _ = scored()
    b = summary.breakdowns
    assert b["domain"] == {
        "ecommerce_support": 0.0,
        "finance_billing": 0.0,
        "housing_location": 0.0,
        "travel_identity": 1.0,
    }
    assert b["difficulty"] == {"easy": 0.0, "hard": 0.0, "medium": 1.0}
    assert b["num_tools"] == {"1": 0.0, "2": 1.0, "3": 0.0}
    assert b["disfluency"] == {"FILLER": 1.0, "PAUSE": 0.0, "SELF_CORRECTION": 1.0}
    assert b["state_rollback"] == {"with_rollback": 1.0, "without_rollback": 0.0}


def test_tool_selection_edge_cases() -> None:
    tc = ToolCall.model_validate
    assert fdb_v3.tool_selection([], []).score == 1.0
    assert fdb_v3.tool_selection([], [tc(call("add_to_cart"))]).score == 0.0
    dup = fdb_v3.tool_selection([tc(call("track_order")), tc(call("track_order"))], [tc(call("track_order"))])
    assert (dup.recall, dup.precision, dup.score, dup.unmatched_expected) == (0.5, 1.0, 0.667, ["track_order"])


def test_arguments_pair_in_call_order() -> None:
    tc = ToolCall.model_validate
    expected = [tc(call("get_exchange_rate", amount=100)), tc(call("get_exchange_rate", amount=200))]
    actual = [tc(call("get_exchange_rate", amount=200)), tc(call("get_exchange_rate", amount=100))]
    # FIFO pairing (not best matching): 100 vs 200 and 200 vs 100 both fail.
    assert fdb_v3.argument_accuracy(expected, actual).score == 0.0
    assert fdb_v3.argument_accuracy([], actual).score == 1.0


def test_value_rules() -> None:
    match = fdb_v3.values_match
    assert match(1000, 1049.9) and match(1000, "1,040") and not match(1000, 1051)
    assert not match(1000, 1040, numeric_tolerance=0) and match(1000, 1000.0, numeric_tolerance=0)
    assert match(0, 0) and not match(0, 0.01)
    assert match("$RESULT_0.flights[0].flight_id", "anything")
    assert match("Driver_License", " driver license ") and not match("passport", "id card")
    verdict = fdb_v3.exact_match_arguments("f", {"a": 1, "b": "x"}, {"a": 1})
    assert not verdict.correct and "missing argument: b" in verdict.explanation


def test_response_quality_over_turn_taken_samples() -> None:
    scenarios = fdb_v3.parse_scenarios(SCENARIOS)
    asked: list[tuple[str, str]] = []

    def judge(intent: str, transcript: str) -> float | None:
        asked.append((intent, transcript))
        return {"That is 920 euros.": None}.get(transcript, 1.0)

    summary, samples = fdb_v3.score_results(
        scenarios, [V3Result.model_validate(r) for r in RESULTS[:4]], response_judge=judge
    )
    # travel 1.0, finance judge failure (excluded), shop 1.0; the silent sample scores 0 without asking the judge.
    assert summary.metrics["response_quality"] == 1.0
    assert samples[3].response_quality == 0.0
    assert asked[0] == ("I'll search flights to Las Vegas and book one.", RESULTS[0]["transcript"])
    assert len(asked) == 3


def test_cli_scores_a_results_file(tmp_path: Path, capsys) -> None:
    from cspan.core.cli import main

    path = tmp_path / "run" / "fdb_v3_results.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"provider": "cspan", "scenarios": SCENARIOS, "results": RESULTS}))
    assert main(["bench", "fdb-v3", "score", "--results", str(path)]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["benchmark"] == "fdb-v3" and summary["metrics"]["pass_rate"] == 0.25
    assert summary["config"]["numeric_tolerance"] == 0.05
    samples = json.loads((tmp_path / "run" / "samples.json").read_text())
    assert [s["example_id"] for s in samples] == ["travel_01", "finance_01", "shop_01", "housing_01"]
    assert "pass_rate 0.25" in capsys.readouterr().out


def test_cli_scores_a_result_folder_with_scenarios(tmp_path: Path) -> None:
    from cspan.core.cli import main

    for result in RESULTS[:2]:
        folder = tmp_path / "results" / f"{result['example_id']}_spk01"
        folder.mkdir(parents=True)
        (folder / "result_cspan.json").write_text(json.dumps(result))
    (tmp_path / "benchmark_data_v2.json").write_text(json.dumps({"benchmark_name": "v3", "scenarios": SCENARIOS}))
    out = tmp_path / "scores"
    rc = main(
        ["bench", "fdb-v3", "score", "--results", str(tmp_path / "results"),
         "--scenarios", str(tmp_path / "benchmark_data_v2.json"), "--out", str(out), "--numeric-tolerance", "0"]
    )  # fmt: skip
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    # Without tolerance 1040 != 1000, so the finance call's arguments fail: (1.0 + 0.0) / 2.
    assert summary["metrics"]["argument_accuracy"] == 0.5
    assert summary["n"] == 2


def test_results_need_scenarios(tmp_path: Path) -> None:
    from cspan.core.cli import main

    path = tmp_path / "results.json"
    path.write_text(json.dumps(RESULTS[:1]))
    assert main(["bench", "fdb-v3", "score", "--results", str(path)]) == 1
    with pytest.raises(BenchDataError, match="a scenario is malformed"):
        fdb_v3.parse_scenarios([{"domain": "x"}])
    assert V3Scenario.model_validate(SCENARIOS[0]).expected_intent().startswith("I'll search")


def _result_folder(root: Path, result: dict[str, Any], **extra: Any) -> Path:
    folder = root / f"{result['example_id']}_spk01"
    folder.mkdir(parents=True)
    (folder / "result_cspan.json").write_text(json.dumps({**result, **extra}))
    return folder


def test_score_reads_the_benchmark_folder_and_the_recordings_metadata_as_run_does(tmp_path: Path, cli) -> None:
    # --fdb-v3-dir with only the scenario file (no mock_apis.py / lk_agent_tool.py: scoring runs nothing), and the
    # recordings' own metadata.json over three of the scenarios, from the three places a run leaves it:
    # recorded in the result (travel_01), next to the result (finance_01), in DIR's fdb_v3_data_released (shop_01)
    v3 = tmp_path / "v3"
    (v3 / "fdb_v3_data_released" / "shop_01_spk01").mkdir(parents=True)
    (v3 / "benchmark_data_v2.json").write_text(json.dumps({"scenarios": SCENARIOS}))
    world = {"kind": "fdb-v3-release", "dir": str(v3), "sha256": {"mock_apis.py": "ab12"}}
    results = tmp_path / "out"
    only_search = {"expected_tool_calls": [call("search_flights", destination="Las Vegas", date="2026-08-20")]}
    _result_folder(results, RESULTS[0], world=world, recording_metadata=only_search)  # book_flight no longer wanted
    finance = _result_folder(results, RESULTS[1], world=world)
    (finance / "metadata.json").write_text(
        json.dumps({"expected_tool_calls": [call("get_exchange_rate", amount=1000), call("track_order")]})
    )
    _result_folder(results, RESULTS[2], world=world, folder="shop_01_spk01")
    (v3 / "fdb_v3_data_released" / "shop_01_spk01" / "metadata.json").write_text(
        json.dumps({"expected_tool_calls": SCENARIOS[2]["expected_tool_calls"][:1]})  # only search_products
    )
    rc = cli("bench", "fdb-v3", "score", "--results", str(results), "--fdb-v3-dir", str(v3))
    assert rc == 0
    samples = {s["example_id"]: s for s in json.loads((results / "samples.json").read_text())}
    # travel: 2 calls made, 1 expected -> precision 0.5, F1 0.667; finance: both calls now expected -> pass;
    # shop: search_products expected, 2 made -> F1 0.667
    assert samples["travel_01"]["tool_selection"]["score"] == 0.667 and samples["travel_01"]["num_tools"] == 1
    assert samples["finance_01"]["passed"] is True and samples["finance_01"]["num_tools"] == 2
    assert samples["shop_01"]["tool_selection"]["score"] == 0.667 and samples["shop_01"]["num_tools"] == 1
    summary = json.loads((results / "summary.json").read_text())
    assert summary["config"]["world"] == world  # what the results were run in, kept by the re-score

    # another world in one result: recorded as mixed
    (results / "shop_01_spk01" / "result_cspan.json").write_text(json.dumps({**RESULTS[2], "world": {"kind": "cspan"}}))
    assert cli("bench", "fdb-v3", "score", "--results", str(results), "--fdb-v3-dir", str(v3)) == 0
    mixed = json.loads((results / "summary.json").read_text())["config"]["world"]
    assert mixed == {"kind": "mixed", "worlds": [world, {"kind": "cspan"}]}


def test_score_input_errors_name_the_cause(tmp_path: Path, cli, capsys) -> None:
    results = tmp_path / "out"
    _result_folder(results, RESULTS[0])
    bare = tmp_path / "bare"
    bare.mkdir()
    assert cli("bench", "fdb-v3", "score", "--results", str(results), "--fdb-v3-dir", str(bare)) == 1
    assert f"--fdb-v3-dir {bare} holds no benchmark_data_v2.json" in capsys.readouterr().err
    assert cli("bench", "fdb-v3", "score", "--results", str(results), "--fdb-v3-dir", str(tmp_path / "nope")) == 1
    assert "is not a folder" in capsys.readouterr().err
    for empty in ("[]", '{"results": [], "scenarios": []}'):
        path = tmp_path / "empty.json"
        path.write_text(empty)
        assert cli("bench", "fdb-v3", "score", "--results", str(path), "--scenarios", str(path)) == 1
        assert "holds no results" in capsys.readouterr().err
    # results that name no scenario: nothing scored is an error, not an all-n/a summary
    path = tmp_path / "strangers.json"
    path.write_text(json.dumps({"scenarios": SCENARIOS, "results": [RESULTS[4]]}))
    assert cli("bench", "fdb-v3", "score", "--results", str(path)) == 1
    assert "none of the 1 result(s) names a known scenario" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--judge-attempts", "0", "'0' must be >= 1"),
        ("--judge-attempts", "two", "'two' is not an integer"),
        ("--numeric-tolerance", "-1", "'-1' must be >= 0"),
        ("--numeric-tolerance", "nan", "'nan' is not a finite number"),
        ("--judge-timeout-s", "0", "'0' must be > 0"),
        ("--judge-timeout-s", "inf", "'inf' is not a finite number"),
    ],
)
def test_flags_out_of_range_are_one_line_errors(cli, capsys, flag: str, value: str, message: str) -> None:
    for verb in (["fdb-v3", "score", "--results", "r.json"], ["qa", "--set", "llamaq"], ["fdb-v1", "score"]):
        if flag == "--numeric-tolerance" and verb[0] != "fdb-v3":
            continue
        with pytest.raises(SystemExit) as exc:
            cli("bench", *verb, flag, value)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].endswith(f"argument {flag}: {message}"), err
