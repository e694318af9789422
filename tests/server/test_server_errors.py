"""``cspan serve`` survives bad clients: token refusals (4401), malformed / unknown / oversized / out-of-order
messages (``error``, session goes on), audio floods (bounded, counted), idle sessions (``bye``)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import websockets
from serve_client import Client, load_frames
from websockets.exceptions import ConnectionClosed

TOKEN = "s3cret-token_0123"


async def closed_code(url: str, **kwargs) -> int:
    """Connect, then wait for the server to close; the close code."""
    async with websockets.connect(url, max_size=None, **kwargs) as ws:
        with pytest.raises(ConnectionClosed) as info:
            await ws.recv()
    return info.value.rcvd.code


async def test_token_required(serve) -> None:
    server = serve(token=TOKEN)
    assert await closed_code(server.ws_url) == 4401
    assert await closed_code(server.ws_url + "?token=wrong-token-000") == 4401
    assert await closed_code(server.ws_url, subprotocols=["cspan.token.wrong-token-000"]) == 4401
    assert await closed_code(server.ws_url, additional_headers={"Authorization": "Bearer wrong-token-000"}) == 4401
    assert server.hub.free_slots() == 1  # refused before any session work

    async with websockets.connect(server.ws_url + f"?token={TOKEN}", max_size=None) as ws:
        assert (await Client(ws).start())["type"] == "ready"
        await Client(ws).stop()
    async with websockets.connect(server.ws_url, subprotocols=[f"cspan.token.{TOKEN}"], max_size=None) as ws:
        assert ws.subprotocol == f"cspan.token.{TOKEN}"  # echoed, as browsers require
        assert (await Client(ws).start())["type"] == "ready"
        await Client(ws).stop()
    headers = {"Authorization": f"Bearer {TOKEN}"}  # what a program sends, as on the other protocols
    async with websockets.connect(server.ws_url, additional_headers=headers, max_size=None) as ws:
        assert (await Client(ws).start())["type"] == "ready"

    assert httpx.get(server.url + "/metrics").status_code == 401  # operators' numbers: the token's admin scope
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert 'cspan_auth_failures_total{protocol="cspan",reason="token"} 4.0' in metrics


async def test_foreign_origin_refused(serve) -> None:
    server = serve(allow_origin=["https://app.example.org"])
    assert await closed_code(server.ws_url, origin="http://evil.example.com") == 4403
    async with websockets.connect(server.ws_url, origin=f"http://127.0.0.1:{server.port}") as ws:
        assert (await Client(ws).start())["type"] == "ready"
    async with websockets.connect(server.ws_url, origin="https://app.example.org") as ws:
        assert (await Client(ws).start())["type"] == "ready"


async def test_bad_messages_get_errors_and_the_session_goes_on(serve, fixture_file) -> None:
    server = serve()
    frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)

        async def expect_error(payload: str | bytes) -> dict:
            await ws.send(payload)
            _, msg = await client.recv_until(lambda k, m: k == "json" and m["type"] == "error")
            return msg

        assert (await expect_error(frames[0].tobytes()))["code"] == "not_started"
        for frame in frames[1:4]:  # a microphone streaming on before start: reported once, not once per frame
            await ws.send(frame.tobytes())
        assert (await expect_error(json.dumps({"type": "stop", "extra": 1})))["code"] == "invalid_message"
        assert (await client.start())["type"] == "ready"
        await client.stream(frames[:3])
        cases = [
            ("{not json", "bad_json"),
            ("[1, 2, 3]", "bad_json"),
            (json.dumps({"type": "dance"}), "unknown_type"),
            (json.dumps({"no": "type"}), "unknown_type"),
            (b"\x00" * (10 * 1024 * 1024), "too_large"),
            (b"\x00" * 1000, "bad_frame"),
            (b"\x00" * 7681, "bad_frame"),
            ("x" * (300 * 1024), "too_large"),  # above --max-message-kib (256)
            ("x" * (70 * 1024), "bad_json"),  # under it: read
            (json.dumps({"type": "start"}), "already_started"),
            (json.dumps({"type": "context", "profile": {"lat": 500}}), "invalid_message"),
            (json.dumps({"type": "context", "profile": {"timezone": "Mars/Olympus"}}), "invalid_message"),
        ]
        for payload, code in cases:
            msg = await expect_error(payload)
            assert msg["code"] == code, (payload[:40], msg)
            assert msg["message"]
            await client.stream(frames[3:5])  # still streaming after every error
        await ws.send(json.dumps({"type": "context", "profile": {"name": "Bo", "timezone": "Asia/Tokyo"}}))
        await client.stream(frames[5:8])
        bye = await client.stop()

    stats = bye["stats"]
    streamed = 3 + 2 * len(cases) + 3
    assert stats["user_frames"] == stats["consumed_frames"] == streamed
    assert stats["errors"] == len(cases) + 2
    assert stats["frames"] == len(client.received.audio()) >= streamed
    ready = client.received.json("ready")[0]
    assert ready["profile"]["user_id"] == "local"  # no credentials configured: the one local user
    profile = server.hub.db.user("local").get_profile()
    assert profile.name == "Bo" and profile.timezone == "Asia/Tokyo"


async def test_start_refusals(serve) -> None:
    server = serve(test_hooks=False, max_text_prompt_chars=50)
    async with websockets.connect(server.ws_url) as ws:
        client = Client(ws)
        for fields, code in [
            ({"test": {"force_ret_at": [1.0]}}, "invalid_message"),
            ({"voice": "nobody"}, "bad_voice"),
            ({"text_prompt": "y" * 51}, "invalid_message"),
            ({"version": 99}, "invalid_message"),
        ]:
            msg = await client.start(**fields)
            assert (msg["type"], msg["code"]) == ("error", code), msg
        # JSON that Python's parser refuses after the syntax: a number past the int-conversion limit, deep nesting
        for raw, why in [
            ('{"type": "start", "seed": 1' + "0" * 5000 + "}", "a number is longer than 4300 digits (5001 digits)"),
            ('{"type": "start", "text_prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
            ('{"type": "start", "seed": NaN}', "NaN is not a JSON number"),
        ]:
            await ws.send(raw)
            _, msg = await client.recv_until(lambda k, m: k == "json" and m["type"] in ("ready", "error"))
            assert (msg["type"], msg["code"]) == ("error", "bad_json"), msg
            assert why in msg["message"] and "ValueError" not in msg["message"], msg
        ready = await client.start(voice="", text_prompt="You help.")
        assert ready["type"] == "ready"
        persona = ready["persona"]
        assert (persona["text_prompt"], persona["voice"]) == ("You help.", None)
        assert persona["prefix_frames"] > 0


async def test_audio_flood_is_bounded(serve) -> None:
    server = serve(max_queued_frames=5)
    frame = (0.1 * np.sin(np.arange(1920) / 7.0)).astype("<f4").tobytes()
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        assert (await client.start())["type"] == "ready"
        for _ in range(60):  # 4.8 s of audio at once
            await ws.send(frame)
        bye = await client.stop()
    stats = bye["stats"]
    assert stats["user_frames"] == 60
    assert stats["dropped_frames"] > 0
    assert stats["consumed_frames"] + stats["dropped_frames"] == 60
    assert any(m["code"] == "audio_overflow" for m in client.received.json("error"))
    assert "cspan_user_frames_dropped_total" in httpx.get(server.url + "/metrics").text


async def test_idle_session_gets_bye(serve) -> None:
    server = serve(idle_timeout_s=0.5)
    async with websockets.connect(server.ws_url) as ws:
        client = Client(ws)
        assert (await client.start())["type"] == "ready"
        _, bye = await client.recv_until(lambda k, m: k == "json" and m["type"] == "bye")
        with pytest.raises(ConnectionClosed) as info:
            await client.recv()
    assert bye["reason"] == "idle"
    assert info.value.rcvd.code == 1000
    assert server.hub.free_slots() == 1
    # a connection that never starts times out too
    async with websockets.connect(server.ws_url) as ws:
        client = Client(ws)
        _, bye = await client.recv_until(lambda k, m: k == "json" and m["type"] == "bye")
    assert bye["reason"] == "idle" and bye["stats"]["frames"] == 0


async def test_a_message_without_a_string_type_is_told_so(serve) -> None:
    """``{"foo": 1}`` was answered ``unknown message type None``: a JSON object with no ``type``, or one that is not a
    string, is told which, on both protocols that read JSON messages (``/api/chat`` reads none); the session goes on."""
    from test_server_limits import json_until, ws_url

    server = serve(max_sessions=2)
    cases = [
        ({"foo": 1}, 'message has no "type"'),
        ({"type": None}, '"type" must be a string, got null'),
        ({"type": 5}, '"type" must be a string, got a number'),
        ({"type": ["start"]}, '"type" must be a string, got an array'),
        ({"type": "dance"}, "unknown message type 'dance'"),
    ]
    async with websockets.connect(ws_url(server, "/ws"), max_size=None) as ws:
        for payload, problem in cases:
            await ws.send(json.dumps(payload))
            error = await json_until(ws, "error")
            assert error["code"] == "unknown_type"
            assert error["message"] == f"{problem}; client messages are start, voice_audio, context, stop", error
        await ws.send(json.dumps({"type": "start"}))
        await json_until(ws, "ready")

    async with websockets.connect(ws_url(server, "/v1/realtime"), max_size=None) as ws:
        await json_until(ws, "session.created")
        for payload, problem in cases:
            await ws.send(json.dumps({**payload, "event_id": "e1"}))
            error = (await json_until(ws, "error"))["error"]
            assert (error["code"], error["event_id"], error["param"]) == ("unknown_event", "e1", "type"), error
            problem = problem.replace("message", "client event")
            assert error["message"].startswith(f"{problem}; this server accepts session.update, "), error
        await ws.send(json.dumps({"type": "session.update", "event_id": "u1", "session": {"instructions": "Hi."}}))
        assert (await json_until(ws, "session.updated"))["session"]["instructions"] == "Hi."


async def test_a_value_of_another_json_type_is_refused_not_converted(serve) -> None:
    """``{"type": "voice_audio", "size": true}`` was read as 1 and ``"10"`` as 10 (pydantic's lax mode): a value of
    another JSON type is refused with the protocol's error naming the field, on both protocols that read JSON
    messages, and the session goes on; an integer is still a number (``/api/chat``'s query parameters, text by
    nature, are read as numbers: ``test_server_moshi``)."""
    from test_server_limits import json_until, ws_url

    server = serve(max_sessions=2)
    cases = [
        ({"type": "voice_audio", "size": True}, "voice_audio: size: Input should be a valid integer"),
        ({"type": "voice_audio", "size": "10"}, "voice_audio: size: Input should be a valid integer"),
        ({"type": "voice_audio", "size": 10.0}, "voice_audio: size: Input should be a valid integer"),
        (
            {"type": "start", "sampling": {"text_topk": "25"}},
            "start: sampling.text_topk: Input should be a valid integer",
        ),
        ({"type": "start", "profile": {"lat": True}}, "start: profile.lat: Input should be a valid number"),
        ({"type": "context", "profile": {"name": 7}}, "context: profile.name: Input should be a valid string"),
    ]
    async with websockets.connect(ws_url(server, "/ws"), max_size=None) as ws:
        for payload, problem in cases:
            await ws.send(json.dumps(payload))
            error = await json_until(ws, "error")
            assert (error["code"], error["message"]) == ("invalid_message", problem), error
        await ws.send(json.dumps({"type": "start", "sampling": {"text_temperature": 1}, "profile": {"lat": 51}}))
        ready = await json_until(ws, "ready")
        assert (ready["sampling"]["text_temperature"], ready["profile"]["lat"]) == (1.0, 51.0)

    beta = {"OpenAI-Beta": "realtime=v1"}  # its session object has temperature
    async with websockets.connect(ws_url(server, "/v1/realtime"), max_size=None, additional_headers=beta) as ws:
        await json_until(ws, "session.created")
        truncate = {"type": "conversation.item.truncate", "event_id": "t1", "item_id": "i1"}
        await ws.send(json.dumps({**truncate, "content_index": "0", "audio_end_ms": 0}))
        error = (await json_until(ws, "error"))["error"]
        assert (error["code"], error["event_id"], error["param"]) == ("invalid_event", "t1", "content_index"), error
        session = {"temperature": "0.6", "instructions": "Hi.", "cspan": {"events": "true"}}
        await ws.send(json.dumps({"type": "session.update", "event_id": "u1", "session": session}))
        assert (await json_until(ws, "session.updated"))["session"]["instructions"] == "Hi."  # the valid fields
        errors = [(await json_until(ws, "error"))["error"] for _ in range(2)]
        assert sorted((e["code"], e["param"]) for e in errors) == [
            ("invalid_event", "session.cspan.events"),
            ("invalid_event", "session.temperature"),
        ], errors
        await ws.send(json.dumps({"type": "session.update", "event_id": "u2", "session": {"temperature": 1}}))
        assert (await json_until(ws, "session.updated"))["session"]["temperature"] == 1.0
