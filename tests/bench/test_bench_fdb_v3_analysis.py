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


def test_score_analyses_with_the_judge_and_aggregates(results_dir: Path, fake_chat_server, cli, capsys) -> None:
    server = fake_chat_server(judge_replies)
    out = results_dir.parent / "scores"
    argv = [
        "bench", "fdb-v3", "score", "--results", str(results_dir), "--provider", "cspan",
        "--scenarios", str(results_dir.parent / "benchmark_data_v2.json"), "--out", str(out),
        "--judge-url", server.url, "--judge-model", "judge-a", "--judge-attempts", "2",
        "--judge-key-env", "CSPAN_TEST_NO_SUCH_KEY",
    ]  # fmt: skip
    assert cli(*argv) == 0
    assert "key-information analysis: 5 analysed, 0 reused, 1 without a usable judge reply" in capsys.readouterr().out

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

    # scored again with the same judge: every analysis is reused, the judge is not asked for one
    before = len(analysis_requests(server))
    assert cli(*argv) == 0
    assert len(analysis_requests(server)) == before
    # another judge model: analysed again
    assert cli(*[a if a != "judge-a" else "judge-b" for a in argv]) == 0
    assert len(analysis_requests(server)) == before + 5


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
