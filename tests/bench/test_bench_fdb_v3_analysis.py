"""Full-Duplex-Bench v3 response analysis (filler sentence, key-information onset) with a fake judge on 127.0.0.1.

The word-timed transcripts below were laid out by hand; the expected latencies and rates are worked out in the
comments (seconds on the input's timeline).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cspan.bench import fdb_v3, fdb_v3_analysis
from cspan.bench.fdb_v3 import V3Result
from cspan.bench.fdb_v3_analysis import PROMPT_VERSION, SYSTEM_PROMPT, parse_marks


def words(*items: tuple[str, float, float]) -> list[dict[str, Any]]:
    return [{"text": t, "timestamp": [a, b]} for t, a, b in items]


def call(function: str, t: float, **args: Any) -> dict[str, Any]:
    return {"function": function, "args": args, "timestamp_start": t}


SCENARIOS = [
    {"id": i, "domain": d, "difficulty": "easy", "dialogue": [{"user": "u", "ai": a}], "expected_tool_calls": calls}
    for i, d, a, calls in [
        ("ecom_01", "ecommerce_support", "Your order is on its way.", [{"function": "track_order", "args": {}}]),
        ("fin_01", "finance_billing", "It is 920 euros.", [{"function": "get_exchange_rate", "args": {}}]),
        ("house_01", "housing_location", "Three apartments match.", [{"function": "search_apartments", "args": {}}]),
        ("travel_01", "travel_identity", "Booked.", [{"function": "book_flight", "args": {}}]),
        ("shop_01", "ecommerce_support", "Found headphones.", [{"function": "search_products", "args": {}}]),
    ]
]

# A: calm, a filler then the key information. User ends 3.20; first word 3.90 -> first response 0.700; tool at 4.00
#    -> tool call 0.800; the judge marks words 0-4 filler, 5-9 key information -> key info at 6.10 -> 2.900.
A = {
    "example_id": "ecom_01",
    "transcript": "Sure let me check that. Your order 55123 arrives Friday.",
    "user_speech_end_rel": 3.2,
    "audio_agent_speech_start": 3.9,
    "actual_tool_calls": [call("track_order", 4.0, order_id="55123")],
    "asr_chunks": words(
        ("Sure", 3.90, 4.10),
        ("let", 4.15, 4.30),
        ("me", 4.30, 4.40),
        ("check", 4.40, 4.70),
        ("that.", 4.70, 4.95),
        ("Your", 6.10, 6.25),
        ("order", 6.25, 6.60),
        ("55123", 6.60, 7.40),
        ("arrives", 7.45, 7.90),
        ("Friday.", 7.90, 8.40),
    ),
}
# B: the agent starts at 2.50, before the user ends at 3.00 -> first response -0.500: an interruption, kept out of
#    every latency and the filler rate (its analysis still runs: key info at 5.00 -> 2.000, unused).
B = {
    "example_id": "fin_01",
    "transcript": "Okay one moment. It's 920 euros.",
    "user_speech_end_rel": 3.0,
    "audio_agent_speech_start": 2.5,
    "actual_tool_calls": [call("get_exchange_rate", 3.1, amount=1000, from_currency="USD", to_currency="EUR")],
    "asr_chunks": words(
        ("Okay", 2.50, 2.80),
        ("one", 2.85, 3.00),
        ("moment.", 3.00, 3.40),
        ("It's", 5.00, 5.20),
        ("920", 5.20, 5.90),
        ("euros.", 5.90, 6.30),
    ),
}
# C: no filler. User ends 1.00; first word 1.60 -> 0.600; tool at 1.30 -> 0.300; key info from word 0 -> 0.600.
C = {
    "example_id": "house_01",
    "transcript": "Three apartments match.",
    "user_speech_end_rel": 1.0,
    "audio_agent_speech_start": 1.6,
    "actual_tool_calls": [call("search_apartments", 1.3, city="Austin", bedrooms=2, max_price=2000)],
    "asr_chunks": words(("Three", 1.60, 1.90), ("apartments", 1.90, 2.50), ("match.", 2.50, 2.90)),
}
# D: silent: not turn-taken, the judge is not asked.
D = {"example_id": "travel_01", "transcript": "", "user_speech_end_rel": 2.0, "asr_chunks": []}
# E: the judge never answers usably -> no filler / key information; first response 1.50 - 1.00 = 0.500, no tool.
E = {
    "example_id": "shop_01",
    "transcript": "Hmm.",
    "user_speech_end_rel": 1.0,
    "audio_agent_speech_start": 1.5,
    "asr_chunks": words(("Hmm.", 1.50, 1.70)),
}
RESULTS = [A, B, C, D, E]
MARKS = {
    "Sure": {"filler": {"first": 0, "last": 4}, "key_info": {"first": 5, "last": 9}},
    "Okay": {"filler": {"first": 0, "last": 2}, "key_info": {"first": 3, "last": 5}},
    "Three": {"filler": None, "key_info": {"first": 0, "last": 2}},
}


def judge_replies(body: dict[str, Any]) -> dict[str, Any]:
    """The fake judge: marks by the reply's first word for the analysis prompt, "correct" for the v3 judges."""
    messages = body["messages"]
    if messages[0]["content"] == SYSTEM_PROMPT:
        first_word = messages[1]["content"].split("REPLY_WORDS:\n", 1)[1].split()[2]
        marks = MARKS.get(first_word)
        content = "```json\n" + json.dumps(marks) + "\n```" if marks else "I am not sure which words those are."
    else:
        content = json.dumps({"correct": True, "explanation": "fine"})
    return {"role": "assistant", "content": content}


def analysis_requests(server: Any) -> list[dict[str, Any]]:
    return [b for b in server.requests if b["messages"][0]["content"] == SYSTEM_PROMPT]


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    root = tmp_path / "fdb_v3_data_released"
    for result in RESULTS:
        folder = root / f"{result['example_id']}_5f0c2a9e1b3d4c6a8e7f9012"
        folder.mkdir(parents=True)
        (folder / "result_cspan.json").write_text(json.dumps(result))
    (tmp_path / "benchmark_data_v2.json").write_text(json.dumps({"scenarios": SCENARIOS}))
    return root


def test_score_analyses_with_the_judge_and_aggregates(
    results_dir: Path, fake_chat_server, cli, capsys, monkeypatch
) -> None:
    server = fake_chat_server(judge_replies)
    out = results_dir.parent / "scores"
    argv = [
        "bench", "fdb-v3", "score", "--results", str(results_dir), "--provider", "cspan",
        "--scenarios", str(results_dir.parent / "benchmark_data_v2.json"), "--out", str(out),
        "--judge-url", server.url, "--judge-model", "judge-a", "--judge-attempts", "2",
        "--judge-key-env", "CSPAN_TEST_NO_SUCH_KEY",
    ]  # fmt: skip
    assert cli(*argv) == 0
    printed = capsys.readouterr().out
    assert "key-information analysis: 4 analysed, 0 reused, 1 silent (nothing to ask), 1 without a usable analysis" in (
        printed
    )

    # the judge saw A as numbered, timed words with the tool call, at temperature 0
    asked = analysis_requests(server)
    assert len(asked) == 5  # A, B, C, and E twice (an unusable reply is asked again); D is silent
    body = asked[0]
    assert body["model"] == "judge-a" and body["temperature"] == 0
    user = body["messages"][1]["content"]
    assert user.startswith('USER_SPEECH_END: 3.200\n\nTOOL_CALLS:\n- 4.000 track_order {"order_id": "55123"}\n')
    assert "\n0  3.90-4.10  Sure\n" in user and user.endswith("\n9  7.90-8.40  Friday.")

    a = json.loads((results_dir / "ecom_01_5f0c2a9e1b3d4c6a8e7f9012" / "latency_tool_analysis_cspan.json").read_text())
    assert a["turn_take_success"] is True
    assert (a["first_response_latency_s"], a["tool_call_latency_s"], a["task_completion_latency_s"]) == (0.7, 0.8, 2.9)
    assert a["filler_sentence"] == "Sure let me check that." and (a["filler_start_time"], a["filler_end_time"]) == (
        3.9,
        4.95,
    )
    assert a["key_info_sentence"] == "Your order 55123 arrives Friday."
    assert (a["key_info_start_time"], a["key_info_end_time"]) == (6.1, 8.4)
    assert a["judge"]["model"] == "judge-a" and a["judge"]["prompt_version"] == PROMPT_VERSION
    c = json.loads((results_dir / "house_01_5f0c2a9e1b3d4c6a8e7f9012" / "latency_tool_analysis_cspan.json").read_text())
    assert (c["filler_sentence"], c["task_completion_latency_s"], c["tool_call_latency_s"]) == ("", 0.6, 0.3)
    e = json.loads((results_dir / "shop_01_5f0c2a9e1b3d4c6a8e7f9012" / "latency_tool_analysis_cspan.json").read_text())
    assert e["filler_sentence"] is None and e["task_completion_latency_s"] is None
    assert any("no usable reply" in n for n in e["notes"])
    d = json.loads(
        (results_dir / "travel_01_5f0c2a9e1b3d4c6a8e7f9012" / "latency_tool_analysis_cspan.json").read_text()
    )
    assert d["turn_take_success"] is False and d["filler_sentence"] is None

    summary = json.loads((out / "summary.json").read_text())
    m = summary["metrics"]
    assert m["take_turn_rate"] == 0.8  # A, B, C, E of 5
    assert m["interruption_rate"] == 0.25  # B of the 4 timed turn-taken samples
    assert m["response_latency_s"] == 0.6  # (0.7 + 0.6 + 0.5) / 3
    assert m["tool_call_latency_s"] == 0.55  # (0.8 + 0.3) / 2; E called no tool
    assert m["task_completion_latency_s"] == 1.75  # (2.9 + 0.6) / 2; B interrupted, E not analysed
    assert m["filler_rate"] == 0.5  # A yes, C no; B interrupted, E not analysed
    # ... and the summary says these rest on 2 of the 3 calm samples
    notes = summary["notes"]
    assert any(n.startswith("task-completion latency from 2 of 3 turn-taken, non-interrupted samples") for n in notes)
    assert any(n.startswith("filler rate from 2 of 3 turn-taken, non-interrupted samples") for n in notes)
    assert summary["config"]["analysis"]["judge"] == {
        "url": server.url + "/chat/completions",
        "model": "judge-a",
        "prompt_version": PROMPT_VERSION,
    }
    report = json.loads((out / fdb_v3_analysis.REPORT_FILE).read_text())
    assert [r["example_id"] for r in report["per_scenario"]] == [
        "ecom_01",
        "fin_01",
        "house_01",
        "shop_01",
        "travel_01",
    ]

    # scored again with the same judge: the analyses are reused, but E's failed one is asked again (twice: the
    # reply is still unusable) and still counts as without a usable analysis
    before = len(analysis_requests(server))
    assert cli(*argv) == 0
    assert len(analysis_requests(server)) == before + 2
    assert "1 analysed, 4 reused, 1 without a usable analysis" in capsys.readouterr().out
    # the judge now answers for E: "Hmm." is the key information, no filler -> first response = key info = 0.500
    monkeypatch.setitem(MARKS, "Hmm.", {"filler": None, "key_info": {"first": 0, "last": 0}})
    assert cli(*argv) == 0
    assert "1 analysed, 4 reused, 0 without a usable analysis" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metrics"]["task_completion_latency_s"] == 1.333  # (2.9 + 0.6 + 0.5) / 3
    assert summary["metrics"]["filler_rate"] == 0.333  # A of A, C, E
    assert not [n for n in summary["notes"] if "of 3 turn-taken" in n]
    # and a fourth run with the same judge asks nothing
    before = len(analysis_requests(server))
    assert cli(*argv) == 0
    assert len(analysis_requests(server)) == before
    assert "0 analysed, 5 reused, 0 without a usable analysis" in capsys.readouterr().out
    # another judge model: analysed again (the four that spoke; D is silent)
    assert cli(*[a if a != "judge-a" else "judge-b" for a in argv]) == 0
    assert len(analysis_requests(server)) == before + 4


def test_the_benchmarks_own_analysis_files_are_read_without_a_judge(results_dir: Path, cli) -> None:
    # a record in the reference's format (no judge stamp) next to A: scoring without a judge uses it
    folder = results_dir / "ecom_01_5f0c2a9e1b3d4c6a8e7f9012"
    (folder / "latency_tool_analysis_cspan.json").write_text(
        json.dumps(
            {
                "example_id": "ecom_01",
                "user_speech_end_rel": 3.2,
                "turn_take_success": True,
                "first_response_latency_s": 0.7,
                "filler_sentence": "Sure let me check that.",
                "key_info_start_time": 6.1,
                "task_completion_latency_s": 2.9,
            }
        )
    )
    out = results_dir.parent / "scores"
    rc = cli(
        "bench", "fdb-v3", "score", "--results", str(results_dir), "--out", str(out),
        "--scenarios", str(results_dir.parent / "benchmark_data_v2.json"),
    )  # fmt: skip
    assert rc == 0
    m = json.loads((out / "summary.json").read_text())["metrics"]
    assert (m["task_completion_latency_s"], m["filler_rate"]) == (2.9, 1.0)


def test_analysis_without_a_judge_fills_the_timing_only() -> None:
    analysis = fdb_v3_analysis.analyze(V3Result.model_validate(A), None, "cspan")
    assert analysis is not None
    assert (analysis.first_response_latency_s, analysis.tool_call_latency_s) == (0.7, 0.8)
    assert analysis.agent_first_word_time == 3.9 and analysis.first_tool_name == "track_order"
    assert analysis.filler_sentence is None and analysis.task_completion_latency_s is None
    assert fdb_v3_analysis.analyze(V3Result(example_id="x"), None) is None  # no user speech end: skipped
    # what the scorer then reads: nothing changes without an analysis
    assert fdb_v3_analysis.apply(V3Result.model_validate(A), analysis).filler_sentence is None


def test_mark_parsing() -> None:
    assert parse_marks('{"filler": null, "key_info": {"first": 0, "last": 2}}', 3).key_info == (0, 2)
    assert parse_marks('Here: {"filler": [0, 1], "key_info": [2, 2]}', 3).filler == (0, 1)
    for bad in (
        '{"filler": null}',  # no key_info
        '{"filler": null, "key_info": {"first": 1, "last": 3}}',  # past the last word
        '{"filler": {"first": 0, "last": 1}, "key_info": {"first": 1, "last": 2}}',  # overlap
        '{"filler": null, "key_info": {"first": "0", "last": 1}}',  # not an integer
        "no json",
    ):
        with pytest.raises(ValueError):
            parse_marks(bad, 3)


def test_tool_call_latency_and_speech_start_fallback() -> None:
    result = V3Result.model_validate({**C, "audio_agent_speech_start": None})
    assert fdb_v3.first_response_latency(result) == 0.6  # from the first ASR word
    assert fdb_v3.tool_call_latency(result) == 0.3
    assert fdb_v3.tool_call_latency(V3Result.model_validate(E)) is None


def test_a_judge_that_is_down_stops_early_and_exits_non_zero(results_dir: Path, fake_chat_server, cli, capsys) -> None:
    state = {"up": False}

    def replies(body: dict[str, Any]) -> dict[str, Any]:
        return judge_replies(body) if state["up"] else {"role": "assistant", "content": None}  # no text: a failure

    server = fake_chat_server(replies)
    out = results_dir.parent / "scores"
    argv = [
        "bench", "fdb-v3", "score", "--results", str(results_dir), "--out", str(out),
        "--scenarios", str(results_dir.parent / "benchmark_data_v2.json"),
        "--judge-url", server.url, "--judge-attempts", "3", "--judge-timeout-s", "5",
    ]  # fmt: skip
    assert cli(*argv) == 1
    captured = capsys.readouterr()
    # two requests failed in a row (A, B): the judge is taken as down and nothing more is sent
    assert len(server.requests) == 2
    assert "4 analysed, 0 reused, 1 silent (nothing to ask), 4 without a usable analysis" in captured.out
    assert "was taken as down after 0 answered request(s)" in captured.err
    # the outputs are written and say so; the records are marked as not analysed
    summary = json.loads((out / "summary.json").read_text())
    assert any("was taken as down" in n for n in summary["notes"])
    assert summary["metrics"]["filler_rate"] is None and summary["metrics"]["response_quality"] is None
    # the judge is back: every failed analysis is asked again, and the run succeeds
    state["up"] = True
    assert cli(*argv) == 0
    assert "4 analysed, 1 reused, 1 without a usable analysis" in capsys.readouterr().out  # E's reply is unusable
    assert json.loads((out / "summary.json").read_text())["metrics"]["filler_rate"] == 0.5


@pytest.mark.parametrize(
    ("chunks", "speech_start", "problem"),
    [
        (words(("Three", 1.6, 1.9), ("apartments", float("nan"), 2.5)), 1.6, "asr_chunks[1] has no finite"),
        ([{"text": "Three", "timestamp": [1.6, None]}], 1.6, "asr_chunks[0] has no finite"),
        (words(("Three", 1.6, 1.9), ("match.", 2.5, 2.4)), 1.6, "asr_chunks[1] has no finite"),
        ([{"text": "Three"}], 1.6, "asr_chunks[0] is not {text, timestamp"),
        (words(("Three", 1.6, 1.9), ("Oh", 0.4, 0.6)), 1.6, "starts at 0.400 s, before audio_agent_speech_start"),
    ],
)
def test_bad_word_times_skip_one_result_not_the_run(
    results_dir: Path, fake_chat_server, cli, capsys, chunks: list[Any], speech_start: float, problem: str
) -> None:
    folder = results_dir / "house_01_5f0c2a9e1b3d4c6a8e7f9012"
    (folder / "result_cspan.json").write_text(
        json.dumps({**C, "asr_chunks": chunks, "audio_agent_speech_start": speech_start})
    )
    server = fake_chat_server(judge_replies)
    out = results_dir.parent / "scores"
    rc = cli(
        "bench", "fdb-v3", "score", "--results", str(results_dir), "--out", str(out),
        "--scenarios", str(results_dir.parent / "benchmark_data_v2.json"), "--judge-url", server.url,
        "--judge-attempts", "2",
    )  # fmt: skip
    assert rc == 0
    record = json.loads((folder / "latency_tool_analysis_cspan.json").read_text())
    assert record["filler_sentence"] is None and record["task_completion_latency_s"] is None
    (note,) = [n for n in record["notes"] if n.startswith("bad word times")]
    assert str(folder / "result_cspan.json") in note and "(house_01)" in note and problem in note
    # C was never sent to the judge; the others were analysed as before
    asked = [b["messages"][1]["content"] for b in analysis_requests(server)]
    assert not any("Three" in a for a in asked) and len(asked) == 4  # A, B, E twice
    text = (out / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in summary.json"))
    assert summary["metrics"]["task_completion_latency_s"] == 2.9  # A only: C bad, E unusable
    json.loads((out / "samples.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in samples.json"))
    assert "2 without a usable analysis" in capsys.readouterr().out


def test_words_are_sent_in_time_order(results_dir: Path, fake_chat_server, cli) -> None:
    # A's words shuffled: the judge sees them sorted by start, and the key information is read from the sorted list
    folder = results_dir / "ecom_01_5f0c2a9e1b3d4c6a8e7f9012"
    shuffled = A["asr_chunks"][5:] + A["asr_chunks"][:5]
    (folder / "result_cspan.json").write_text(json.dumps({**A, "asr_chunks": shuffled}))
    server = fake_chat_server(judge_replies)
    rc = cli(
        "bench", "fdb-v3", "score", "--results", str(results_dir), "--out", str(results_dir.parent / "scores"),
        "--scenarios", str(results_dir.parent / "benchmark_data_v2.json"), "--judge-url", server.url,
    )  # fmt: skip
    assert rc == 0
    user = analysis_requests(server)[0]["messages"][1]["content"]
    assert "\n0  3.90-4.10  Sure\n" in user and user.endswith("\n9  7.90-8.40  Friday.")
    record = json.loads((folder / "latency_tool_analysis_cspan.json").read_text())
    assert (record["task_completion_latency_s"], record["agent_first_word_time"]) == (2.9, 3.9)


def test_non_finite_times_in_results_read_as_missing() -> None:
    result = V3Result.model_validate({**A, "user_speech_end_rel": float("nan"), "audio_agent_speech_start": "inf"})
    assert result.user_speech_end_rel is None and result.audio_agent_speech_start is None
    assert fdb_v3_analysis.analyze(result, None) is None  # nothing to measure from
    assert fdb_v3.first_response_latency(result) is None
    chunks = [{"text": "x", "timestamp": [float("nan"), 1.0]}, {"text": "y", "timestamp": [2.0, 2.5]}]
    assert fdb_v3.agent_speech_start(V3Result(example_id="x", asr_chunks=chunks)) == 2.0
    calls = [call("track_order", float("inf"))]
    assert fdb_v3.tool_call_latency(V3Result.model_validate({**C, "actual_tool_calls": calls})) is None


@pytest.mark.parametrize(
    "content",
    ["{not json", "[]", json.dumps({"filler_sentence": "Sure"}), json.dumps({"example_id": "ecom_01", "judge": 3})],
)
def test_an_unreadable_record_is_kept_aside_not_overwritten(
    results_dir: Path, fake_chat_server, cli, capsys, content: str
) -> None:
    folder = results_dir / "ecom_01_5f0c2a9e1b3d4c6a8e7f9012"
    (folder / "latency_tool_analysis_cspan.json").write_text(content)
    out = results_dir.parent / "scores"
    scenarios = str(results_dir.parent / "benchmark_data_v2.json")
    base = ["bench", "fdb-v3", "score", "--results", str(results_dir), "--out", str(out), "--scenarios", scenarios]
    assert cli(*base) == 0  # without a judge: read nothing from it, touch nothing
    assert (folder / "latency_tool_analysis_cspan.json").read_text() == content
    server = fake_chat_server(judge_replies)
    assert cli(*base, "--judge-url", server.url) == 0
    kept = folder / "latency_tool_analysis_cspan.unreadable.json"
    assert kept.read_text() == content
    assert f"unreadable record(s) kept as {kept}" in capsys.readouterr().out
    assert json.loads((folder / "latency_tool_analysis_cspan.json").read_text())["task_completion_latency_s"] == 2.9


def test_the_benchmarks_own_records_are_reused_even_when_sparse(results_dir: Path, fake_chat_server, cli) -> None:
    # the reference's records carry neither turn_take_success nor our judge stamp: read and reused, never rewritten
    records = {
        "ecom_01": {
            "example_id": "ecom_01",
            "filler_sentence": "Sure let me check that.",
            "task_completion_latency_s": 2.5,
        },
        "house_01": {"example_id": "house_01", "filler_sentence": "", "task_completion_latency_s": 0.8},
    }
    for example, record in records.items():
        path = results_dir / f"{example}_5f0c2a9e1b3d4c6a8e7f9012" / "latency_tool_analysis_cspan.json"
        path.write_text(json.dumps(record))
    server = fake_chat_server(judge_replies)
    out = results_dir.parent / "scores"
    rc = cli(
        "bench", "fdb-v3", "score", "--results", str(results_dir), "--out", str(out),
        "--scenarios", str(results_dir.parent / "benchmark_data_v2.json"), "--judge-url", server.url,
    )  # fmt: skip
    assert rc == 0
    for example, record in records.items():
        path = results_dir / f"{example}_5f0c2a9e1b3d4c6a8e7f9012" / "latency_tool_analysis_cspan.json"
        assert json.loads(path.read_text()) == record
    assert not any("Sure" in b["messages"][1]["content"] for b in analysis_requests(server))
    m = json.loads((out / "summary.json").read_text())["metrics"]
    assert (m["task_completion_latency_s"], m["filler_rate"]) == (1.65, 0.5)  # (2.5 + 0.8) / 2; A yes, C no
