"""``cspan bench serve`` (the load client, a subprocess as operators run it) against a real server: real-time clients
on ``/ws`` and ``/v1/realtime`` with malformed messages and abrupt disconnects injected; the report says what each
session saw, the server's memory over time, and the server is unharmed afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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
    # completed: the sessions that ran to their end, not those the client cut
    assert summary["completed"] == sum(s["ended"] == "stop" for s in sessions)
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
    assert summary["metrics_unread"] is None  # the shared token has every scope: /metrics was read
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


@pytest.mark.timeout(200)
def test_load_client_stops_flooding_a_server_that_died_and_fails(serve, tmp_path: Path) -> None:
    """The server stops in the middle of the run: each client backs off (1 s, 2 s, 4 s...) instead of reconnecting
    in a loop, the failed attempts are counted and folded into one record, and the command exits with status 1
    naming the cause (the report of what ran is written)."""
    server = serve(max_sessions=2, token=TOKEN, idle_timeout_s=30.0)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "cspan.core.cli", "bench", "serve", "--url", server.url, "--token", TOKEN,
           "--protocol", "moshi", "--clients", "2", "--seconds", "10", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ})
    try:
        deadline = time.monotonic() + 60
        while httpx.get(server.url + "/health").json()["free_slots"] > 0:  # both sessions are live
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        server.stop()  # its socket closes: every connection from now on is refused
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr
    assert stderr.count("\n") == 1 and stderr.startswith(
        f"cspan bench serve: error: --url {server.url}: the server stopped answering during the run (2 session(s) completed, "
    )
    # a client that reconnects while the server shuts down may have its handshake cut (no HTTP response) before
    # the socket closes and later connections are refused
    shutdown_errors = ("error (ConnectionRefusedError", "error (InvalidMessage")
    assert any(f"failed: {e}" in stderr for e in shutdown_errors), stderr
    assert f"{out / 'serve-load.json'} covers what ran" in stderr
    report = json.loads((out / "serve-load.json").read_text())
    summary, sessions = report["summary"], report["sessions"]
    failed = [s for s in sessions if s["ended"].startswith("error")]
    assert all(s["ended"].startswith(shutdown_errors) for s in failed), failed
    # identical failures in a row are one record: per client, the refused connections retried after 1, 2, 4 s (at
    # most 4 tries in the ~7 s left), plus at most one cut handshake
    per_client = {c: [s for s in failed if s["client"] == c] for c in (0, 1)}
    assert all(1 <= len(records) <= 2 for records in per_client.values()), failed
    assert all(1 <= sum(s["repeats"] for s in records) <= 5 for records in per_client.values()), failed
    assert summary["session_errors"] == sum(s["repeats"] for s in failed) and summary["server_answering"] is False
    # a client that reconnects while the server shuts down may be refused ("shutting down") before the socket closes
    assert summary["completed"] == 2 and summary["refused"] <= 2
    assert summary["sessions"] == 2 + summary["refused"] + summary["session_errors"]
    assert summary["first_session_error"].startswith(shutdown_errors)
    line = f"2 client(s): {summary['sessions']} session attempt(s), {summary['refused']} refused, "
    assert f"{line}{summary['session_errors']} failed" in stdout
    assert (out / "serve-load.json").stat().st_size < 20_000


def test_load_client_backs_off_from_a_dead_url_and_folds_its_failures() -> None:
    """A client of a port where nothing listens: tries at 0, 1 and 3 s (waits 1 s, then 2 s, capped by the run's
    end), one record of three attempts."""
    import asyncio
    import socket

    from cspan.bench.serve_load import Client, LoadSettings, load_frames

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    client = Client(0, LoadSettings(url=f"http://127.0.0.1:{port}", protocol="ws"), load_frames([]), time.monotonic())
    t0 = time.monotonic()
    asyncio.run(client.run(t0 + 5.0))
    assert 3.9 <= time.monotonic() - t0 < 6.0  # the end of the run caps the last wait (a loaded machine is slower)
    [record] = client.records
    assert record.repeats == 3 and record.ended.startswith("error (ConnectionRefusedError") and record.failed


async def test_load_client_says_why_metrics_were_not_read() -> None:
    """With a session token (no admin scope) /metrics answers 403: the report's server samples were all empty and
    nothing said why. Now the summary's ``metrics_unread`` (and a warning on stderr) says why."""
    from cspan.bench.serve_load import LoadSettings, _metrics_problem, _sample

    def answer(status: int, body: str):
        return httpx.AsyncClient(
            base_url="http://s", transport=httpx.MockTransport(lambda request: httpx.Response(status, text=body))
        )

    samples: list = []
    settings = LoadSettings(url="http://s", protocol="ws", clients=1, seconds=1.0, audio=[], token="t")
    async with answer(
        403, '{"detail":"metrics need a token with the admin scope (Authorization: Bearer TOKEN)"}'
    ) as http:
        assert await _sample(settings, http, samples, 0.0) == {}
        assert await _metrics_problem(http) == (
            "/metrics answered 403: pass a token with the admin scope (--token) to read it"
        )
    assert samples[0].rss_bytes is None and samples[0].sessions_active is None
    async with answer(200, "cspan_sessions_active 2.0\nprocess_resident_memory_bytes 1e8\n") as http:
        assert await _sample(settings, http, samples, 0.0) == {
            "cspan_sessions_active": 2.0,
            "process_resident_memory_bytes": 1e8,
        }
    assert samples[1].sessions_active == 2.0 and samples[1].rss_bytes == 1e8

    def refuse(request):
        raise httpx.ConnectError("refused")

    async with httpx.AsyncClient(base_url="http://s", transport=httpx.MockTransport(refuse)) as http:
        assert await _metrics_problem(http) == "/metrics could not be read (ConnectError: refused)"


@pytest.mark.timeout(300)
def test_load_client_counts_a_connection_over_the_users_limit_as_refused(serve, tmp_path: Path) -> None:
    """Two clients of one token on a server that allows each user one connection: the second client's connections
    are closed at once with 1013 (``--max-connections-per-user``), which the report counts as refusals that name
    the limit, not as failed sessions."""
    server = serve(max_sessions=2, token=TOKEN, idle_timeout_s=30.0, max_connections_per_user=1)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "cspan.core.cli", "bench", "serve", "--url", server.url, "--token", TOKEN,
           "--protocol", "ws", "--clients", "2", "--seconds", "4", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "serve-load.json").read_text())
    summary, sessions = report["summary"], report["sessions"]
    refused = [s for s in sessions if s["ended"].startswith("refused")]
    assert refused and summary["refused"] == sum(s["repeats"] for s in refused), sessions
    assert all(s["ended"] == "refused (1013 this user's connections reached this server's limit (1, "
               "--max-connections-per-user))" for s in refused), refused  # fmt: skip
    assert summary["session_errors"] == 0 and summary["completed"] >= 1, summary
