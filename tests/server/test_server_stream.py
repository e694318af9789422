"""``cspan serve`` end to end: a real uvicorn server on 127.0.0.1 with the tiny checkpoint, a websockets client
streaming a recording frame by frame, the embedded transcriber and router, and a forced ``<ret>``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import websockets
from serve_client import Client, load_frames

from cspan.server.infer import DEFAULT_PERSONA
from cspan.server.protocol import PROTOCOL_VERSION, parse_server_message

WEATHER_NOTE = "The weather in London today is cloudy with light rain and fourteen degrees."


def check_protocol_order(items: list[tuple[str, object]]) -> None:
    """Every JSON event of frame k arrives after k agent frames (events from the head of frame k) or k + 1
    (events from its tail, and ``slot``); ``ready`` comes first and ``bye`` last; frame indices never decrease."""
    kinds = [m["type"] if k == "json" else "audio" for k, m in items]
    assert kinds[0] == "ready" and kinds[-1] == "bye"
    audio_before = 0
    last_frame = -1
    for kind, msg in items:
        if kind == "audio":
            audio_before += 1
            continue
        parse_server_message(json.dumps(msg))  # every message is a valid server message
        if "frame" in msg and msg["frame"] is not None:
            assert audio_before in (msg["frame"], msg["frame"] + 1), (msg, audio_before)
            assert msg["frame"] >= last_frame, msg
            last_frame = msg["frame"]


@pytest.mark.timeout(300)
async def test_stream_question_with_forced_ret(serve, fixture_file, tmp_path: Path) -> None:
    """Agent audio for every frame, user_text, and (forced <ret>) ret -> question -> span -> slot, in order; the
    Context DB holds the conversation, the user turn and the injected span."""
    knowledge = tmp_path / "knowledge"
    knowledge.mkdir()
    (knowledge / "weather.md").write_text(WEATHER_NOTE + "\n")
    server = serve(
        asr="sphinx", router="local", knowledge=knowledge, span_deadline_s=600.0, text_prompt=DEFAULT_PERSONA
    )
    frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))
    assert len(frames) == 37

    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        ready = await client.start(
            version=PROTOCOL_VERSION,
            profile={"name": "Ada", "location": "London", "timezone": "Europe/London"},
            test={"force_ret_at": [4.0]},
        )
        assert ready["type"] == "ready", ready
        assert ready["protocol_version"] == PROTOCOL_VERSION
        assert (ready["sample_rate"], ready["frame_size"]) == (24000, 1920)
        assert ready["persona"]["voice"] == "tiny0" and ready["persona"]["text_prompt"] == DEFAULT_PERSONA
        assert ready["persona"]["prefix_frames"] > 0
        assert ready["profile"]["name"] == "Ada" and ready["profile"]["location"] == "London"

        await client.stream(frames)
        seen: set[str] = set()

        def done(kind: str, msg: dict) -> bool:
            if kind == "json":
                assert msg["type"] not in ("late", "no_span"), msg
                if msg["type"] == "span" or (msg["type"] == "user_text" and msg["final"]):
                    seen.add(msg["type"])
            return seen == {"span", "user_text"}

        await client.recv_until(done)
        bye = await client.stop()

    rec = client.received
    stats = bye["stats"]
    assert bye["reason"] == "stop"
    assert stats["user_frames"] == stats["consumed_frames"] == len(frames)
    assert stats["dropped_frames"] == 0
    assert stats["frames"] == len(rec.audio()) >= len(frames)
    assert stats["spans"] == 1
    assert all(a.shape == (1920,) and np.isfinite(a).all() for a in rec.audio())
    check_protocol_order(rec.items)

    finals = [m for m in rec.json("user_text") if m["final"]]
    assert any("weather" in m["text"] or "london" in m["text"] for m in finals), finals
    (ret,) = rec.json("ret")
    assert ret["forced"] is True and ret["frame"] == 50  # 4.0 s on the session's timeline
    (question,) = rec.json("question")
    (span,) = rec.json("span")
    assert question["ret_frame"] == ret["frame"]
    assert "weather" in question["text"] or "london" in question["text"]
    assert span["text"] == WEATHER_NOTE
    assert span["question"] == question["text"]
    assert span["frame"] >= question["frame"] >= ret["frame"]
    tokenizer = server.hub.checkpoint.tokenizer
    assert span["n_frames"] == len(tokenizer.encode(WEATHER_NOTE)) + 2  # <span> ids </span>, one per column
    assert span["prefill_ms"] >= 0.0
    order = rec.types()
    assert order.index("ret") < order.index("question") < order.index("span")
    (slot,) = [m for m in rec.json("slot") if m["frame"] == span["frame"]]
    assert slot["prefill_ms"] == pytest.approx(span["prefill_ms"], abs=1e-3)
    assert slot["live_sessions"] == 1
    assert len(rec.json("text")) > 0 and all(m["text"] for m in rec.json("text"))

    db = server.hub.db
    conversation = db.get_conversation(ready["conversation_id"])
    assert conversation is not None and conversation.ended_at is not None
    assert any(t.role == "user" and "london" in t.text for t in db.turns(ready["conversation_id"]))
    spans = db.spans(ready["conversation_id"])
    assert len(spans) == 1 and spans[0].injected_at is not None


async def test_int16_frames_and_periodic_slot_messages(serve, fixture_file) -> None:
    """3840-byte int16 frames are accepted like float32 frames; ``slot_every=2`` adds a ``slot`` every 2 frames."""
    server = serve(slot_every=2)
    frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))[:6]
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        assert (await client.start())["type"] == "ready"
        for frame in frames:
            await ws.send((np.clip(frame, -1, 1) * 32767).astype("<i2").tobytes())
            client.sent_frames += 1
            await client.recv_until(lambda k, m: k == "audio")
        bye = await client.stop()
    assert bye["stats"]["user_frames"] == bye["stats"]["consumed_frames"] == 6
    assert bye["stats"]["errors"] == 0
    assert not client.received.json("error")
    slots = client.received.json("slot")
    assert [m["frame"] for m in slots] == list(range(0, bye["stats"]["frames"], 2))
    assert all(m["prefill_ms"] == 0.0 and m["live_sessions"] == 1 and m["step_ms"] > 0 for m in slots)
