"""What one client's message may cost the others, on every protocol of ``cspan serve``: the size limit
(``--max-message-kib``), decoding off the event loop that runs every session's frame clock, and error messages that
do not grow with the input. Real uvicorn servers on the tiny checkpoint; raw WebSocket clients."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest
import websockets

CORRUPT_PAGE = b"OggS" + b"\x00" * 22 + b"\x00"
"""An Ogg page of 27 bytes without segments whose checksum (0) is wrong."""


async def json_until(ws: Any, kind: str, timeout: float = 60.0, field: str = "type") -> dict[str, Any]:
    """The next JSON text message whose ``field`` is ``kind`` (binary messages skipped)."""
    while True:
        msg = await asyncio.wait_for(ws.recv(), timeout)
        if isinstance(msg, str) and json.loads(msg).get(field) == kind:
            return json.loads(msg)


async def moshi_until(ws: Any, kind: int, timeout: float = 60.0) -> bytes:
    """The next ``/api/chat`` message of kind byte ``kind``."""
    while True:
        msg = await asyncio.wait_for(ws.recv(), timeout)
        if isinstance(msg, bytes) and msg[:1] == bytes([kind]):
            return msg


def ws_url(server: Any, path: str) -> str:
    return server.url.replace("http://", "ws://") + path


@pytest.mark.timeout(300)
async def test_every_protocol_refuses_a_message_over_the_limit_and_goes_on(serve) -> None:
    """One setting bounds a message on all three protocols: above it, the protocol's ``too_large`` error before any
    decoding, and the session answers its next message as before."""
    server = serve(max_message_kib=16, max_sessions=2)
    limit = 16 * 1024
    async with websockets.connect(ws_url(server, "/ws"), max_size=None) as ws:
        await ws.send(b'{"type": "start"}')  # JSON as binary: told to send it as text
        error = await json_until(ws, "error")
        assert error["code"] == "bad_frame" and "send JSON messages" in error["message"]
        for oversized in (
            b"\x00" * (limit + 1),
            json.dumps({"type": "start", "pad": "x" * limit}),
            "é" * (limit // 2 + 1),
        ):
            await ws.send(oversized)
            error = await json_until(ws, "error")
            assert error["code"] == "too_large" and "--max-message-kib" in error["message"], error
        await ws.send(json.dumps({"type": "start"}))
        await json_until(ws, "ready")
        await ws.send(b"\x00" * (limit + 7680))
        assert (await json_until(ws, "error"))["code"] == "too_large"
        await ws.send(json.dumps({"type": "stop"}))
        bye = await json_until(ws, "bye")
        assert bye["reason"] == "stop" and bye["stats"]["errors"] == 5

    async with websockets.connect(ws_url(server, "/api/chat"), max_size=None) as ws:
        assert await moshi_until(ws, 0) == b"\x00"
        for size in (limit + 1, limit * 4):
            await ws.send(b"\x01" + CORRUPT_PAGE * (size // 27 + 1))
            assert (await moshi_until(ws, 5)).startswith(b"\x05too_large: ")
        await ws.send(b"\x07")  # the session still reads its messages
        assert (await moshi_until(ws, 5)).startswith(b"\x05bad_message: ")

    async with websockets.connect(ws_url(server, "/v1/realtime"), max_size=None) as ws:
        await json_until(ws, "session.created")
        big = base64.b64encode(bytes(limit)).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "event_id": "a1", "audio": big}))
        error = (await json_until(ws, "error"))["error"]
        assert (error["code"], error.get("event_id"), error["type"]) == ("too_large", None, "invalid_request_error")
        await ws.send(json.dumps({"type": "session.update", "event_id": "u1", "session": {"instructions": "Hi."}}))
        assert (await json_until(ws, "session.updated"))["session"]["instructions"] == "Hi."
    assert server.hub.free_slots() == 2


@pytest.mark.timeout(300)
async def test_large_messages_are_decoded_off_the_event_loop(serve, monkeypatch) -> None:
    """Ogg/Opus pages (``/ws``, ``/api/chat``), a base64 append and a session.update with tools (``/v1/realtime``):
    a message above 8 KiB is decoded on a worker thread, a small one inline."""
    from cspan.server.adapters import realtime
    from cspan.server.opus import OggOpusDecoder

    where: list[tuple[str, int, bool]] = []

    def spy(name: str, fn: Any, size: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            try:
                asyncio.get_running_loop()
                on_loop = True
            except RuntimeError:
                on_loop = False
            where.append((name, size(args), on_loop))
            return fn(*args)

        return wrapper

    monkeypatch.setattr(OggOpusDecoder, "decode", spy("opus", OggOpusDecoder.decode, lambda a: len(a[1])))
    monkeypatch.setattr(realtime, "parse_client_event", spy("event", realtime.parse_client_event, lambda a: len(a[0])))
    decode_audio = realtime.RealtimeAdapter._decode_audio
    monkeypatch.setattr(realtime.RealtimeAdapter, "_decode_audio", spy("append", decode_audio, lambda a: len(a[1])))
    tools_of = realtime.RealtimeAdapter._tools_of
    monkeypatch.setattr(realtime.RealtimeAdapter, "_tools_of", spy("tools", tools_of, lambda a: 0))

    server = serve(max_sessions=2)
    async with websockets.connect(ws_url(server, "/ws"), max_size=None) as ws:
        await ws.send(json.dumps({"type": "start", "codecs": ["opus"]}))
        await json_until(ws, "ready")
        for n in (10, 400, 1000):  # 270 bytes, 10.5 KiB, 26 KiB
            await ws.send(CORRUPT_PAGE * n)
            await json_until(ws, "error")
    async with websockets.connect(ws_url(server, "/api/chat"), max_size=None) as ws:
        await moshi_until(ws, 0)
        for n in (1, 5000):
            await ws.send(b"\x01" + CORRUPT_PAGE * n)
            await moshi_until(ws, 5)
    async with websockets.connect(ws_url(server, "/v1/realtime"), max_size=None) as ws:
        await json_until(ws, "session.created")
        tool = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
        await ws.send(json.dumps({"type": "session.update", "session": {"tools": [tool]}}))
        await json_until(ws, "session.updated")
        for seconds in (0.08, 1.0):  # 5 KiB and 64 KiB of base64 pcm16
            audio = base64.b64encode(bytes(int(48000 * seconds))).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
        await ws.send(json.dumps({"type": "session.update", "event_id": "last", "session": {}}))
        await json_until(ws, "session.updated")

    assert where, "nothing was decoded"
    for name, size, on_loop in where:
        if name == "tools":
            assert not on_loop  # a schema becomes a model: always on a worker thread
        else:
            assert on_loop == (size <= 8 * 1024), (name, size, on_loop)
    assert {name for name, _, _ in where} == {"opus", "event", "append", "tools"}
    assert {(name, on_loop) for name, _, on_loop in where} >= {("opus", True), ("opus", False), ("append", False)}


@pytest.mark.timeout(300)
async def test_errors_do_not_grow_with_the_input(serve) -> None:
    """Thousands of problems in one message, or a huge value, give an error of a few hundred bytes (the first
    problems and a count), on every protocol."""
    server = serve(max_sessions=2)
    async with websockets.connect(ws_url(server, "/ws"), max_size=None) as ws:
        await ws.send(json.dumps({"type": "start", "codecs": ["opus"]}))
        await json_until(ws, "ready")
        for n in (5, 2400, 9000):  # up to 243 KB of corrupt pages
            await ws.send(CORRUPT_PAGE * n)
            error = await json_until(ws, "error")
            assert error["code"] == "bad_audio" and len(error["message"]) < 400, len(error["message"])
            assert error["message"].count("a corrupt Ogg page") == min(n, 3)
        await ws.send(json.dumps({"type": "context", "profile": {f"field{i}": i for i in range(3000)}}))
        error = await json_until(ws, "error")
        assert error["code"] == "invalid_message" and len(error["message"]) < 600
    async with websockets.connect(ws_url(server, "/api/chat"), max_size=None) as ws:
        await moshi_until(ws, 0)
        await ws.send(b"\x01" + CORRUPT_PAGE * 9000)
        error = await moshi_until(ws, 5)
        assert error.startswith(b"\x05bad_audio: ") and len(error) < 400
        assert error.decode().endswith("(and 8997 more problems in this message)")
    async with websockets.connect(ws_url(server, "/v1/realtime"), max_size=None) as ws:
        await json_until(ws, "session.created")
        for event in (
            {"type": "x" * 200_000, "event_id": "e" * 1000},
            {"type": "conversation.item.retrieve", "event_id": "r1", "item_id": "i" * 200_000},
            {"type": "session.update", "event_id": "u1", "session": {"voice": "v" * 200_000}},
        ):
            await ws.send(json.dumps(event))
            text = ""
            while '"type":"error"' not in text:
                text = await asyncio.wait_for(ws.recv(), 60)
            assert len(text) < 1500, len(text)


@pytest.mark.timeout(120)
async def test_a_client_over_its_message_budget_is_read_later_and_the_session_goes_on(serve) -> None:
    """``--max-messages-per-s``: a client that sends faster than its budget (one second's worth at once, then the
    rate) is read at the budget's pace, so the flood costs the event loop that runs every session's frame clock no
    more than the budget; nothing is dropped or refused, and the held-back time is on /metrics."""
    import httpx

    rate, burst, extra = 10, 10, 21
    server = serve(max_messages_per_s=rate)
    loop = asyncio.get_running_loop()
    async with websockets.connect(ws_url(server, "/v1/realtime")) as ws:
        await json_until(ws, "session.created")
        t0 = loop.time()
        for i in range(burst + extra - 1):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "event_id": f"a{i}", "audio": "AAAA"}))
        await ws.send(json.dumps({"type": "input_audio_buffer.clear", "event_id": "last"}))
        await json_until(ws, "input_audio_buffer.cleared")  # read after every append before it
        elapsed = loop.time() - t0
    assert elapsed >= 0.95 * extra / rate  # 2.1 s: the burst at once, the rest at the rate
    metrics = httpx.get(server.url + "/metrics").text
    line = next(
        x for x in metrics.splitlines() if x.startswith('cspan_client_throttled_seconds_total{protocol="realtime"}')
    )
    assert float(line.split()[-1]) >= 0.9 * extra / rate
    assert 'cspan_client_throttled_seconds_total{protocol="cspan"} 0.0' in metrics


@pytest.mark.timeout(120)
async def test_a_client_that_stays_over_its_budget_is_ended_with_the_reason(serve, monkeypatch) -> None:
    """A client that never comes back within its budget is ended after ``OVER_BUDGET_END_S`` (here 2 s) with reason
    ``over_budget``, a message naming the budget, and close 1008; held back for ever, its keepalive pongs would wait
    behind its own messages and the WebSocket layer would close it as a server failure (1011)."""
    from cspan.server import throttle

    monkeypatch.setattr(throttle, "OVER_BUDGET_END_S", 2.0)
    server = serve(max_messages_per_s=10)
    loop = asyncio.get_running_loop()
    async with websockets.connect(ws_url(server, "/v1/realtime")) as ws:
        await json_until(ws, "session.created")
        append = json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"})

        async def flood() -> None:
            while True:
                await ws.send(append)

        t0 = loop.time()
        flooding = asyncio.ensure_future(flood())
        try:
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if event["type"] == "error" and event["error"].get("param") == "over_budget":
                    break
            elapsed = loop.time() - t0
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    await asyncio.wait_for(ws.recv(), 30)
        finally:
            flooding.cancel()
    assert 2.0 <= elapsed < 10.0, elapsed  # the burst (1 s), then 2 s over the budget
    assert "more than 10 messages a second" in event["error"]["message"]
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    import httpx

    metrics = httpx.get(server.url + "/metrics").text
    assert 'cspan_sessions_ended_total{protocol="realtime",reason="over_budget"} 1.0' in metrics


def test_the_message_budget_refills_at_its_rates() -> None:
    """Token buckets that run into debt: the wait is the time until both the message and the byte budget are
    back at zero, and idle time refills them up to their bursts, never beyond."""
    from cspan.server.throttle import BYTE_BURST_MESSAGES, BYTE_RATE_MESSAGES, ClientBudget

    now = [0.0]
    budget = ClientBudget(100, 1000, clock=lambda: now[0])
    assert [budget.charge(10) for _ in range(100)] == [0.0] * 100  # the burst: one second's worth
    assert budget.charge(10) == pytest.approx(0.01)  # one message of debt at 100 a second
    now[0] += 10.0  # idle: back to the burst, not ten seconds' worth
    assert all(budget.charge(0) == 0.0 for _ in range(100)) and budget.charge(0) > 0.0
    now[0] += 10.0
    big = BYTE_BURST_MESSAGES * 1000
    assert budget.charge(big) == 0.0  # the byte burst at once
    assert budget.charge(BYTE_RATE_MESSAGES * 1000) == pytest.approx(1.0)  # then a second per 16 largest messages
    assert ClientBudget(100, 1000, min_burst_bytes=10**6, clock=lambda: 0.0).charge(10**6) == 0.0
    # how long a client stays over its budget: test_server_flood.py
