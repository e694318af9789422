"""The Moshi protocol at ``/api/chat`` (``cspan.server.adapters.moshi``), driven by Kyutai's own client code from the
``moshi`` package (0.2.13: ``moshi.client.run`` and its ``Connection``, with their sphn Ogg/Opus handling) with a
recording in place of the microphone; and the protocol's edges with a raw client."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import types
from typing import Any, ClassVar

import httpx
import numpy as np
import pytest
from serve_client import load_frames

FRAME = 1920


class FakeStream:
    """``sounddevice.InputStream`` / ``OutputStream`` without a sound card: an input stream plays ``feed`` (frames of
    [1920]) into the client's callback at real-time pace from a thread, as PortAudio would; an output stream plays
    nothing (the client's decoded audio stays in its queue, where the test reads it)."""

    feed: ClassVar[list[np.ndarray]] = []

    def __init__(self, *, samplerate: float, channels: int, blocksize: int, callback: Any) -> None:
        self.callback = callback
        self.blocksize = blocksize
        self.is_input = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def __enter__(self) -> FakeStream:
        if self.is_input:
            self._thread = threading.Thread(target=self._play, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()

    def _play(self) -> None:
        t0 = time.monotonic()
        for k, frame in enumerate(self.feed):
            if self._stop.is_set():
                return
            self.callback(np.ascontiguousarray(frame[:, None], dtype=np.float32), self.blocksize, None, None)
            delay = t0 + (k + 1) * 0.08 - time.monotonic()
            if delay > 0:
                time.sleep(delay)


def fake_sounddevice() -> types.ModuleType:
    sd = types.ModuleType("sounddevice")

    def input_stream(**kwargs: Any) -> FakeStream:
        stream = FakeStream(**kwargs)
        stream.is_input = True
        return stream

    sd.InputStream = input_stream  # type: ignore[attr-defined]
    sd.OutputStream = FakeStream  # type: ignore[attr-defined]
    return sd


@pytest.fixture
def moshi_client(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``moshi.client`` with a fake ``sounddevice`` (no PortAudio needed)."""
    sd = fake_sounddevice()
    monkeypatch.setitem(sys.modules, "sounddevice", sd)
    client = pytest.importorskip("moshi.client", reason="pip install --no-deps moshi==0.2.13 (see noxfile)")
    monkeypatch.setattr(client, "sd", sd)
    return client


class CapturingPrinter:
    """A ``moshi.client_utils`` printer that keeps what the client prints."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.logs: list[tuple[str, str]] = []

    def print_token(self, token: str, color: str | None = None) -> None:
        self.tokens.append(token)

    def log(self, level: str, msg: str) -> None:
        self.logs.append((level, msg))

    def print_header(self) -> None: ...
    def print_pending(self) -> None: ...
    def print_lag(self) -> None: ...


def decoded_samples(connection: Any) -> int:
    queued = connection._output_queue.qsize() * FRAME
    rest = 0 if connection._all_pcm_data is None else int(connection._all_pcm_data.shape[-1])
    return queued + rest


def moshi_metric(server: Any, name: str, token: str | None = None) -> float:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    text = httpx.get(server.url + "/metrics", headers=headers).text
    for line in text.splitlines():
        if line.startswith(f'{name}{{protocol="moshi"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.timeout(300)
async def test_kyutai_client_holds_a_conversation(serve, fixture_file, moshi_client, monkeypatch) -> None:
    """``python -m moshi.client``'s own code: connects to /api/chat, streams the recording as Ogg/Opus, decodes the
    agent's Ogg/Opus and prints its text pieces; the session ends when the microphone goes quiet (idle)."""
    server = serve(idle_timeout_s=1.5)
    frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))
    monkeypatch.setattr(FakeStream, "feed", frames + [np.zeros(FRAME, np.float32)] * 10)
    printer = CapturingPrinter()
    connections: list[Any] = []
    real = moshi_client.Connection

    def keep(*args: Any, **kwargs: Any) -> Any:
        connections.append(real(*args, **kwargs))
        return connections[-1]

    monkeypatch.setattr(moshi_client, "Connection", keep)
    args = argparse.Namespace(url=None, host="127.0.0.1", port=server.port, https=False)
    await asyncio.wait_for(moshi_client.run(printer, args), timeout=240)  # returns when the server closes

    (connection,) = connections
    frames_sent = moshi_metric(server, "cspan_session_frames_total")
    assert moshi_metric(server, "cspan_user_frames_total") == len(frames) + 10  # every frame of the recording...
    assert frames_sent >= len(frames) + 10  # ...was heard (the session idles out once its queue is played)
    assert decoded_samples(connection) == frames_sent * FRAME  # every agent frame decoded, to the sample
    assert printer.tokens and all(isinstance(t, str) for t in printer.tokens)
    assert ("warning", "unknown message kind 0") in printer.logs  # the handshake, which this client only logs
    assert not [m for level, m in printer.logs if level == "error"], printer.logs
    assert server.hub.free_slots() == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheme", ["ws://", "http://"])
async def test_kyutai_client_reaches_a_server_with_a_token_through_its_url(
    serve, fixture_file, moshi_client, monkeypatch, scheme
) -> None:
    """``moshi.client`` has no token option and appends ``/api/chat`` to ``--url``: the address with the token and a
    final ``#`` (docs/PROTOCOL.md) reaches a server that requires a token."""
    token = "moshi-url-token-123"
    server = serve(token=token, idle_timeout_s=1.0)
    frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))[:12]
    monkeypatch.setattr(FakeStream, "feed", frames)
    printer = CapturingPrinter()
    url = f"{scheme}127.0.0.1:{server.port}/api/chat?token={token}#"
    args = argparse.Namespace(url=url, host=None, port=None, https=False)
    await asyncio.wait_for(moshi_client.run(printer, args), timeout=240)
    assert ("info", "connected!") in printer.logs
    assert not [m for level, m in printer.logs if level == "error"], printer.logs
    assert moshi_metric(server, "cspan_user_frames_total", token) == len(frames)


async def raw_connect(server: Any, query: str = "") -> Any:
    import aiohttp

    http = aiohttp.ClientSession()
    ws = await http.ws_connect(f"ws://127.0.0.1:{server.port}/api/chat{query}", max_msg_size=0)
    return http, ws


async def messages_until(ws: Any, predicate: Any, timeout: float = 60.0) -> list[bytes]:
    import aiohttp

    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while True:
        msg = await asyncio.wait_for(ws.receive(), max(0.1, deadline - time.monotonic()))
        if msg.type != aiohttp.WSMsgType.BINARY:
            got.append(b"")
            return got
        got.append(msg.data)
        if predicate(msg.data):
            return got


@pytest.mark.timeout(300)
async def test_query_parameters_handshake_metadata_and_errors(serve, fixture_file) -> None:
    """PersonaPlex's query parameters pick the persona and seed; 0x00 comes once the persona is read, then a
    ``session`` metadata message; Context Spans go out as 0x04 JSON; bad messages get 0x05 and the session goes on."""
    import sphn

    server = serve(test_hooks=True)
    frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))
    query = (
        "?text_prompt=You%20answer%20briefly.&voice_prompt=tiny1.pt&seed=7&text_temperature=0.9"
        "&audio_topk=100&text_topk=&pad_mult=0&repetition_penalty=1.0&email=x%40y.z&worker_auth_id=1"
    )
    http, ws = await raw_connect(server, query)
    try:
        got = await messages_until(ws, lambda m: m[0] == 4)
        assert got[0] == b"\x00" and len(got) == 2
        info = json.loads(got[1][1:])
        assert info["type"] == "session" and info["seed"] == 7
        assert info["persona"]["voice"] == "tiny1" and info["persona"]["text_prompt"] == "You answer briefly."
        assert info["not_applied"] == ["pad_mult", "repetition_penalty"]
        engine = server.hub.engine
        defaults = {"text_topk": engine.text_params.top_k, "audio_temperature": engine.audio_params.temperature}
        assert info["sampling"] == {"text_temperature": 0.9, "audio_topk": 100, **defaults}
        (session,) = engine.sampling  # a one-session server: slot 0
        assert (session.text.temperature, session.audio.top_k) == (0.9, 100)
        assert session.audio.temperature == engine.audio_params.temperature

        writer = sphn.OpusStreamWriter(24000)
        bad = [b"", b"\x07abc", b"\x01" + b"not ogg at all", b"\x01" + frames[0].tobytes()]
        for k, frame in enumerate(frames[:12]):
            await ws.send_bytes(b"\x01" + writer.append_pcm(frame))
            if k < len(bad):
                await ws.send_bytes(bad[k])
        await ws.send_str("hello")
        await ws.send_bytes(b"\x03\x01")  # control endTurn: ignored
        errors: list[str] = []
        audio = 0

        def count(m: bytes) -> bool:
            nonlocal audio
            if m[0] == 5:
                errors.append(m[1:].decode())
            audio += m[0] == 1
            return len(errors) >= 5 and audio >= 12

        await messages_until(ws, count)
        assert [e.split(":")[0] for e in errors] == [
            "bad_message",
            "bad_message",
            "bad_audio",
            "bad_audio",
            "bad_message",
        ]
        assert server.hub.free_slots() == 0  # still live after every bad message
        # the session's row of the engine has sampled with them (device tensors, written at its first step)
        state = engine.state
        assert state.text_temp[0].item() == pytest.approx(0.9) and state.audio_top_k[0].item() == 100
        assert state.text_top_k[0].item() == engine.text_params.top_k
    finally:
        await ws.close()
        await http.close()


@pytest.mark.timeout(300)
async def test_span_goes_out_as_metadata(serve, fixture_file) -> None:
    """A Context Span (here scheduled by the server's test hook) reaches the Moshi client as 0x04 JSON. The server
    reads it between two frames: injected and its step prepared on the engine thread after the frame before, so the
    step that reads it builds nothing itself (``DuplexEngine.prepare``)."""
    import sphn

    server = serve()
    frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))
    http, ws = await raw_connect(server)
    try:
        await messages_until(ws, lambda m: m[0] == 4)
        hub = server.hub
        engine = hub.engine_thread.engine
        built: list[str] = []  # who built the inputs of a step reading a block: "prepare" or "step"
        step_inputs, prepare = engine._step_inputs, engine.prepare
        where = ["step"]

        def spy_inputs(head):
            if head.blocks:
                built.append(where[0])
            return step_inputs(head)

        def spy_prepare():
            where[0] = "prepare"
            try:
                prepare()
            finally:
                where[0] = "step"

        engine._step_inputs, engine.prepare = spy_inputs, spy_prepare
        (session,) = [s for s in hub.sessions if s.protocol == "moshi"]
        order: list[str] = []  # the frame heads (event loop) and the preparations (engine thread), in order
        before_step = session.conversation.before_step

        async def spy_head(*args, **kwargs):
            order.append("head")
            return await before_step(*args, **kwargs)

        session.conversation.before_step = spy_head
        spied_prepare = engine.prepare
        engine.prepare = lambda: order.append("prepare") or spied_prepare()
        session.conversation.schedule_span(session.conversation.frame + 3, "The library opens at ten.")
        writer = sphn.OpusStreamWriter(24000)
        spans: list[dict] = []

        def span(m: bytes) -> bool:
            if m[0] == 4:
                data = json.loads(m[1:])
                if data.get("type") == "span":
                    spans.append(data)
            return bool(spans)

        for frame in frames[:6]:
            await ws.send_bytes(b"\x01" + writer.append_pcm(frame))
        await messages_until(ws, span)
        assert spans[0]["text"] == "The library opens at ten." and spans[0]["n_frames"] > 2
        assert built == ["prepare"]  # the span's step was prepared, and read as prepared
        assert order.count("prepare") == 1 and order[order.index("prepare") + 1] == "head"  # before the frame's head
    finally:
        await ws.close()
        await http.close()


async def test_refused_starts_close_with_a_reason(serve) -> None:
    """A start refused for what the client asked: ``0x05`` naming it, the ``bye`` metadata with reason ``refused``
    (not ``error``, which is a server failure), close 1008."""
    server = serve(max_text_prompt_chars=100)
    for query, expect in [
        ("?voice_prompt=NATF2.pt", "bad_voice"),
        ("?seed=banana", "invalid_message"),
        ("?seed=" + str(2**64), "invalid_message"),
        ("?text_seed=" + "9" * 5000, "invalid_message"),
        ("?text_prompt=" + "a" * 101, "invalid_message"),
        ("?text_temperature=hot", "invalid_message: text_temperature='hot': Input should be a valid number"),
        ("?audio_topk=501", "invalid_message: audio_topk='501': Input should be less than or equal to 500"),
        ("?audio_temperature=0.0001", "invalid_message: audio_temperature='0.0001': Value error, use 0 for greedy"),
    ]:
        http, ws = await raw_connect(server, query)
        try:
            got = await messages_until(ws, lambda m: False, timeout=30)
        finally:
            await ws.close()
            await http.close()
        assert got[0][0] == 5 and got[0][1:].decode().startswith(expect), (query, got[:2])
        assert len(got[0]) < 300  # the client's value is quoted cut short
        bye = json.loads(got[1][1:])
        assert got[1][0] == 4 and (bye["type"], bye["reason"]) == ("bye", "refused"), bye
        assert got[-1] == b""  # closed by the server
        assert ws.close_code == 1008
    assert server.hub.free_slots() == 1
    metrics = httpx.get(server.url + "/metrics").text
    assert 'cspan_sessions_unstarted_total{protocol="moshi",reason="refused"} 8.0' in metrics  # never ready
    assert "cspan_sessions_ended_total{" not in metrics
    assert 'reason="error"' not in metrics


async def test_token_and_busy(serve) -> None:
    import aiohttp

    token = "moshi-token-12345"
    server = serve(token=token)
    async with aiohttp.ClientSession() as http:
        for query, headers in [("", {}), ("?token=wrong-token-123", {}), ("", {"Authorization": "Bearer nope-nope-1"})]:
            async with http.ws_connect(f"ws://127.0.0.1:{server.port}/api/chat{query}", headers=headers) as ws:
                msg = await ws.receive()
                assert msg.type == aiohttp.WSMsgType.CLOSE and ws.close_code == 4401
        url = f"ws://127.0.0.1:{server.port}/api/chat"
        async with http.ws_connect(url, headers={"Authorization": f"Bearer {token}"}) as first:
            assert (await first.receive()).data == b"\x00"
            async with http.ws_connect(url + f"?token={token}") as second:  # max_sessions=1
                msg = await second.receive()
                assert msg.data[0] == 5 and msg.data[1:].decode().startswith("busy")
                assert (await second.receive()).type == aiohttp.WSMsgType.CLOSE and second.close_code == 1013
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {token}"}).text
    assert 'cspan_auth_failures_total{protocol="moshi",reason="token"} 3.0' in metrics
    assert 'cspan_sessions_busy_total{protocol="moshi"} 1.0' in metrics
