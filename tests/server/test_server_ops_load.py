"""``cspan bench serve`` (the load client, a subprocess as operators run it) against a real server: real-time clients
on ``/ws`` and ``/v1/realtime`` with malformed messages and abrupt disconnects injected; the report says what each
session saw, the server's memory over time, and the server is unharmed afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

TOKEN = "load-test-token-123"


def bench_serve(server, out: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "cspan.core.cli", "bench", "serve", "--url", server.url, "--token", TOKEN,
           "--clients", "2", "--out", str(out), *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    assert (
        "2 client(s): " in proc.stdout
        and " session attempt(s), 0 refused" in proc.stdout
        and (out / "serve-load.png").stat().st_size > 10_000
    )
    return json.loads((out / "serve-load.json").read_text())


@pytest.mark.timeout(400)
def test_load_client_reports_lateness_drops_errors_and_memory(serve, fixture_file, tmp_path: Path) -> None:
    server = serve(max_sessions=2, token=TOKEN, idle_timeout_s=30.0)
    audio = str(fixture_file("audio", "question_weather_24k.wav"))
    report = bench_serve(
        server, tmp_path / "ws", "--protocol", "ws", "--seconds", "7", "--audio", audio,
        "--malformed-per-min", "60", "--disconnects-per-min", "30", "--seed", "3",
    )  # fmt: skip
    sessions = report["sessions"]
    summary = report["summary"]
    assert summary["sessions"] == len(sessions) >= 3 and summary["disconnects_injected"] >= 1
    for s in sessions:
        assert s["protocol"] == "ws" and s["ended"] in ("stop", "disconnect"), s
        assert s["frames_sent"] > 0 and s["agent_frames"] > 0 and s["conversation_id"]
        assert 0.0 <= s["lateness_ms"]["p50"] <= s["lateness_ms"]["p99"] <= s["lateness_ms"]["max"]
        assert s["agent_gaps"] is not None
        if s["ended"] == "stop":
            assert s["dropped_frames"] == 0  # real-time paced: the server's queue never overflows
    # every malformed message got an error and nothing else did (those in flight at a disconnect may go unanswered)
    assert 0 < summary["errors"] <= summary["malformed_sent"]
    assert summary["errors"] >= summary["malformed_sent"] - summary["disconnects_injected"]
    samples = report["server"]["samples"]
    assert len(samples) >= 5 and all(x["rss_bytes"] > 50e6 for x in samples)  # the server process's memory
    assert max(x["sessions_active"] for x in samples) >= 1
    counters = report["server"]["counters"]
    ended = sum(v for k, v in counters.items() if k.startswith("cspan_sessions_ended_total"))
    assert ended == len(sessions)
    assert (
        counters['cspan_sessions_ended_total{protocol="cspan",reason="disconnect"}'] == summary["disconnects_injected"]
    )

    report = bench_serve(server, tmp_path / "realtime", "--protocol", "realtime", "--seconds", "4")
    assert report["summary"]["sessions"] == 2 and report["summary"]["errors"] == 0
    assert all(s["ended"] == "stop" and s["frames_sent"] > 0 for s in report["sessions"])
    assert report["server"]["counters"]['cspan_sessions_started_total{protocol="realtime"}'] == 2

    health = httpx.get(server.url + "/health").json()  # unharmed: every slot free again
    assert health["status"] == "ok" and health["free_slots"] == 2
