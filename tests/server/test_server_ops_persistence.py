"""Persistence by default: ``cspan serve`` killed with SIGKILL in the middle of a conversation loses nothing it had
committed. What a client has received (a final transcript, a Context Span) was written to the SQLite file (WAL)
before it was sent, so after a restart every such turn and span is there, and the user's memory carries over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import websockets
from serve_client import Client, load_frames
from serve_process import ServeProcess, serve_args


@pytest.mark.timeout(420)
async def test_sigkill_mid_conversation_keeps_every_committed_turn_and_span(
    tiny_checkpoint_dir: Path, fixture_file, tmp_path: Path
) -> None:
    knowledge = tmp_path / "notes"
    knowledge.mkdir()
    (knowledge / "weather.md").write_text("The weather in London today is sunny and warm.\n")
    db = tmp_path / "data" / "context.sqlite"  # its folder does not exist yet: made at start
    args = serve_args(
        tiny_checkpoint_dir, "--port", "0", "--db", str(db), "--asr", "sphinx", "--router", "local",
        "--knowledge", str(knowledge), "--span-deadline-s", "30", "--test-hooks",
    )  # fmt: skip
    frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))
    silence = [np.zeros(1920, dtype=np.float32)] * 100

    first = ServeProcess(*args, name="first").start()
    try:
        async with websockets.connect(first.ws(), max_size=None) as ws:
            client = Client(ws)
            ready = await client.start(profile={"name": "Ada", "location": "Leeds"}, test={"force_ret_at": [4.0]})
            assert ready["type"] == "ready"
            await client.stream(frames + silence[:20])

            def done() -> bool:
                finals = [m for m in client.received.json("user_text") if m["final"]]
                return bool(finals) and bool(client.received.json("span"))

            if not done():
                await client.recv_until(lambda k, m: done(), timeout=120)
            await client.stream(silence[:10])  # mid-conversation: the session is live, audio still flowing
            first.signal(signal.SIGKILL)
            assert first.wait() == -signal.SIGKILL
    finally:
        first.kill()
    finals = [m["text"] for m in client.received.json("user_text") if m["final"]]
    spans = client.received.json("span")
    assert any("london" in t for t in finals) and "sunny" in spans[0]["text"]
    assert Path(str(db) + "-wal").exists()  # the file was in WAL mode; nothing was checkpointed at exit

    # a restart on the same file: it opens (the WAL is recovered) and serves; the user's memory carries over
    second = ServeProcess(*args, name="second").start()
    try:
        second.wait_healthy()
        export = subprocess.run(
            [sys.executable, "-m", "cspan.core.cli", "db", "export", "local", "--db", str(db)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ},
        )
        assert export.returncode == 0, export.stderr
        stored = json.loads(export.stdout)
        (conversation,) = [c for c in stored["conversations"] if c["id"] == ready["conversation_id"]]
        assert conversation["ended_at"] is None  # killed: it never ended
        turns = [t["text"] for t in conversation["turns"] if t["role"] == "user"]
        for text in finals:
            assert text in turns, (text, turns)
        stored_spans = [s for s in conversation["spans"] if s["injected_at"] is not None]
        assert [s["text"] for s in stored_spans] == [s["text"] for s in spans]
        assert [s["frame"] for s in stored_spans] == [s["frame"] for s in spans]
        assert stored["profile"]["name"] == "Ada"
        async with websockets.connect(second.ws(), max_size=None) as ws:
            again = await Client(ws).start()  # no profile given: what was remembered is used
            assert again["type"] == "ready" and again["profile"]["name"] == "Ada"
            assert again["profile"]["location"] == "Leeds"
            await Client(ws).stop()
    finally:
        second.signal(signal.SIGTERM)
        try:
            second.wait(timeout=60)
        finally:
            second.kill()
