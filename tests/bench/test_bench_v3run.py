"""`cspan bench fdb-v3 run`: a scenario through the full loop with an LLM router over the 12 mock tools."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import soundfile as sf

from cspan.bench.errors import BenchDataError
from cspan.bench.fdb_v3 import V3Result, V3Scenario
from cspan.bench.fdb_v3_run import find_samples, user_speech_end

SCENARIOS = {
    "scenarios": [
        {
            "id": "ecom_001",
            "domain": "ecommerce_support",
            "difficulty": "easy",
            "title": "Track an order",
            "dialogue": [{"user": "Where is my order 55123?", "ai": "Your order 55123 is on its way."}],
            "expected_tool_calls": [{"function": "track_order", "args": {"order_id": "55123"}}],
            "disfluency_features": ["fillers"],
            "state_rollback_test": False,
        }
    ]
}
FOLDER = "ecom_001_5f0c2a9e1b3d4c6a8e7f9012"


@pytest.mark.slow
def test_fdb_v3_run_records_tool_calls_and_scores(
    tiny_checkpoint_dir, fixture_file, fake_chat_server, tool_call_message, tmp_path, cli, capsys
) -> None:
    # the router LLM asks for track_order once, then has nothing more to do
    server = fake_chat_server(
        [tool_call_message("track_order", {"order_id": "55123"}), {"role": "assistant", "content": ""}]
    )
    data = tmp_path / "fdb_v3_data_released"
    (data / FOLDER).mkdir(parents=True)
    shutil.copyfile(fixture_file("audio", "question_exchange_24k.wav"), data / FOLDER / "input.wav")
    scenarios = tmp_path / "benchmark_data_v2.json"
    scenarios.write_text(json.dumps(SCENARIOS))
    out = tmp_path / "out"
    rc = cli(
        "bench", "fdb-v3", "run", "--checkpoint", str(tiny_checkpoint_dir), "--data", str(data), "--out", str(out),
        "--scenarios", str(scenarios), "--router", server.url, "--router-model", "fake-router",
        "--force-ret", "input-end", "--tail-s", "2", "--quiet",
    )  # fmt: skip
    assert rc == 0
    assert "fdb-v3: 1 scenario recording(s), rendered 1" in capsys.readouterr().out

    # the router LLM was offered exactly the 12 mock tools
    offered = {t["function"]["name"] for t in server.requests[0]["tools"]}
    assert len(offered) == 12 and "track_order" in offered and "get_time" not in offered

    result_path = out / FOLDER / "result_cspan.json"
    raw = json.loads(result_path.read_text())
    result = V3Result.model_validate(raw)
    assert result.example_id == "ecom_001"
    assert [(c.function, c.args) for c in result.actual_tool_calls] == [("track_order", {"order_id": "55123"})]
    call = raw["actual_tool_calls"][0]
    assert 0 <= call["timestamp_start"] <= raw["input_duration_s"] + 2
    assert raw["domain"] == "ecommerce_support" and raw["num_expected_calls"] == 1
    span = next(e for e in raw["retrieval_events"] if e["type"] == "span")
    assert span["tool"] == "track_order" and span["text"].startswith("(tool result)")
    assert raw["input_asr_chunks"] and raw["user_speech_end_rel"] == user_speech_end(raw["input_asr_chunks"])
    assert raw["transcript"] == result.transcript and raw["complete"] is True
    info = sf.info(out / FOLDER / "output_cspan.wav")
    assert info.samplerate == 24000 and info.duration == pytest.approx(raw["input_duration_s"] + 2, abs=1e-3)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmark"] == "fdb-v3" and summary["n"] == 1
    assert summary["metrics"]["pass_rate"] == 1.0
    assert summary["metrics"]["tool_selection_all"] == 1.0 and summary["metrics"]["argument_accuracy_all"] == 1.0
    assert summary["config"]["router_model"] == "fake-router"

    # resumed: the finished scenario is kept, the router is not asked again
    asked = len(server.requests)
    rc = cli(
        "bench", "fdb-v3", "run", "--checkpoint", str(tiny_checkpoint_dir), "--data", str(data), "--out", str(out),
        "--scenarios", str(scenarios), "--router", server.url, "--router-model", "fake-router",
        "--force-ret", "input-end", "--tail-s", "2", "--quiet",
    )  # fmt: skip
    assert rc == 0 and "rendered 0, kept 1" in capsys.readouterr().out
    assert len(server.requests) == asked


def test_user_speech_end_is_the_word_before_the_first_long_gap() -> None:
    chunks = [
        {"text": "um", "timestamp": [0.1, 0.3]},
        {"text": "book", "timestamp": [0.5, 0.8]},
        {"text": "it", "timestamp": [0.9, 1.0]},
        {"text": "actually", "timestamp": [3.2, 3.6]},
        {"text": "wait", "timestamp": [6.0, 6.2]},
    ]
    assert user_speech_end(chunks) == 1.0
    assert user_speech_end(chunks[:3]) == 1.0
    assert user_speech_end(chunks[3:]) == 3.6
    assert user_speech_end([]) is None


def test_find_samples_resolves_example_ids(tmp_path: Path) -> None:
    for name in (FOLDER, "travel_002_speaker7", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "input.wav").write_bytes(b"")
    (tmp_path / "other" / "metadata.json").write_text(json.dumps({"example_id": "fin_003"}))
    (tmp_path / "no_audio").mkdir()
    scenarios = {"travel_002": V3Scenario(id="travel_002")}
    found = {s.folder.name: s.example_id for s in find_samples(tmp_path, scenarios)}
    assert found == {FOLDER: "ecom_001", "travel_002_speaker7": "travel_002", "other": "fin_003"}
    with pytest.raises(BenchDataError):
        find_samples(tmp_path / "no_audio")
