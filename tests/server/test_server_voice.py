"""Voices in ``cspan serve``: PersonaPlex's voices of a Hub snapshot's ``voices.tgz`` listed and spoken with
(``--voice NATF2``, ``voice_prompt=NATM1.wav``), and a voice cloned from a recording the client sends, on every
protocol (``/ws`` ``voice_audio``, ``/api/chat`` ``?voice_audio=`` with 0x06 pieces, ``/v1/realtime``
``session.cspan.voice_audio``). Too short, too long, silent, not audio: a clear error, and the session keeps its
voice. Real uvicorn servers on the tiny checkpoint."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch
import websockets
from personaplex_snapshot import REPO, personaplex_snapshot
from realtime_schema import connect_realtime as realtime_connect
from serve_client import Client, ServerThread, load_frames
from test_server_moshi import messages_until, raw_connect
from test_server_realtime_events import errors, metric, update

from cspan.core.prefix import persona_text

PROMPT = "You are a helpful assistant."  # the serve fixture's persona


def _wav(pcm: np.ndarray, rate: int = 24000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, pcm, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def greeting(fixture_file) -> Path:
    return fixture_file("audio", "greeting_24k.wav")


@pytest.fixture(scope="module")
def recordings(greeting: Path) -> dict[str, bytes]:
    """A good recording and the bad kinds, as a client would send them (file bytes)."""
    speech, rate = sf.read(greeting, dtype="float32")
    noise = np.random.default_rng(0).normal(0.0, 0.05, 31 * 8000).astype(np.float32)
    return {
        "good": greeting.read_bytes(),
        "short": _wav(speech[:rate]),
        "silent": _wav(np.zeros(3 * rate, dtype=np.float32)),
        "long": _wav(noise, 8000),
        "not_audio": b"this is not a recording at all, just text" * 40,
    }


def _name(data: bytes) -> str:
    return "recording-" + hashlib.sha256(data).hexdigest()[:12]


def _text_tokens(checkpoint: Any, prompt: str = PROMPT) -> int:
    return len(checkpoint.tokenizer.encode(persona_text(prompt)))


# ------------------------------------------------------------------------------------------------ named voices


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory, tiny_checkpoint_dir: Path, tiny_checkpoint, greeting: Path) -> dict[str, Any]:
    return personaplex_snapshot(tmp_path_factory.mktemp("pp-serve"), tiny_checkpoint_dir, tiny_checkpoint, greeting)


@pytest.fixture
def personaplex(snapshot, monkeypatch) -> Iterator[Any]:
    """``make(**settings)`` -> a server on ``nvidia/personaplex-7b-v1`` as the Hub snapshot provides it."""
    from cspan.core.checkpoint import load_checkpoint
    from cspan.server.serve import ServeSettings, create_app

    for name, value in snapshot["env"].items():
        monkeypatch.setenv(name, value)
    for name in ("HF_HUB_CACHE", "CSPAN_BASE", "CSPAN_VOICES_DIR", "CSPAN_CHECKPOINT"):
        monkeypatch.delenv(name, raising=False)
    checkpoint = load_checkpoint(REPO, dtype=torch.float32)
    servers: list[ServerThread] = []

    def make(**kwargs: Any) -> ServerThread:
        defaults = {"asr": "none", "router": "none", "max_sessions": 1, "text_prompt": PROMPT, "db": ":memory:"}
        settings = ServeSettings(**{**defaults, **kwargs})
        server = ServerThread(create_app(settings, checkpoint=checkpoint), settings).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.mark.timeout(300)
async def test_personaplex_voices_are_listed_and_spoken_with(personaplex, fixture_file) -> None:
    server = personaplex()
    info = httpx.get(server.url + "/info").json()
    assert info["voices"] == ["NATF2", "NATM1"] and info["default_voice"] is None  # never a default
    assert info["voice_recording"] == {"min_seconds": 2.0, "max_seconds": 30.0, "max_bytes": 8 * 1024 * 1024}
    server.stop()

    server = personaplex(voice="NATF2")
    assert httpx.get(server.url + "/info").json()["default_voice"] == "NATF2"
    checkpoint = server.hub.checkpoint
    frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))[:10]
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        ready = await client.start()
        assert ready["type"] == "ready" and ready["persona"]["voice"] == "NATF2"
        # PersonaPlex's layout: 11 embedding frames, 6 silence frames, the text, 6 silence frames
        assert ready["persona"]["prefix_frames"] == 11 + 6 + _text_tokens(checkpoint) + 6
        await client.stream(frames)
        bye = await client.stop()
    assert bye["stats"]["consumed_frames"] == len(frames)

    # PersonaPlex's client names voices as files; NATM1 is a recording in the archive, encoded when first asked for
    http, ws = await raw_connect(server, "?voice_prompt=NATM1.wav&text_prompt=Hi.")
    try:
        got = await messages_until(ws, lambda m: m[0] == 4)
        session = json.loads(got[-1][1:])
        assert session["persona"]["voice"] == "NATM1" and got[0] == b"\x00"
        assert session["persona"]["prefix_frames"] == 46 - 1 + 6 + _text_tokens(checkpoint, "Hi.") + 6
    finally:
        await ws.close()
        await http.close()


@pytest.mark.timeout(300)
async def test_serve_voice_recording_is_the_default_voice(serve, tiny_checkpoint, greeting) -> None:
    """``cspan serve --voice greeting_24k.wav``: the recording, encoded at start-up, is the default voice (named by
    its stem) and speaks as ``cspan infer --voice greeting_24k.wav`` does."""
    server = serve(voice=str(greeting))
    info = httpx.get(server.url + "/info").json()
    assert info["default_voice"] == "greeting_24k" and "greeting_24k" in info["voices"]
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        ready = await client.start()
        assert ready["persona"]["voice"] == "greeting_24k"
        assert ready["persona"]["prefix_frames"] == 46 + 1 + _text_tokens(tiny_checkpoint) + 1
        (session,) = server.hub.sessions
        expected = tiny_checkpoint.load_voice_prompt(greeting).codes
        assert torch.equal(session._start.voice.prompt.codes, expected)
        await client.stop()


# ------------------------------------------------------------------------------------------------ /ws


async def _send_recording(client: Client, data: bytes, *, piece: int = 64 * 1024) -> dict[str, Any]:
    """``voice_audio`` then the bytes in pieces; the server's answer (``voice`` or ``error``)."""
    await client.send_json({"type": "voice_audio", "size": len(data)})
    for k in range(0, len(data), piece):
        await client.ws.send(data[k : k + piece])
    _, answer = await client.recv_until(lambda k, m: k == "json" and m["type"] in ("voice", "error"))
    return answer


@pytest.mark.timeout(300)
async def test_ws_voice_recording_becomes_the_persona_voice(serve, tiny_checkpoint, recordings, greeting) -> None:
    server = serve()
    good = recordings["good"]
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        # bad before any good one: refused, the server's default voice stays
        answer = await _send_recording(client, recordings["short"])
        assert answer["code"] == "bad_voice_audio" and "1.00 s long" in answer["message"]
        assert "keeps its voice" in answer["message"]

        # start in the middle of a recording is refused; a new voice_audio drops the unfinished one
        await client.send_json({"type": "voice_audio", "size": len(good)})
        await ws.send(good[:1000])
        await client.send_json({"type": "start"})
        _, refused = await client.recv_until(lambda k, m: k == "json" and m["type"] == "error")
        assert refused["code"] == "invalid_message" and "1000 of" in refused["message"]
        answer = await _send_recording(client, good)
        assert answer["code"] == "bad_voice_audio" and "dropped" in answer["message"]  # the unfinished one
        _, voice = await client.recv_until(lambda k, m: k == "json" and m["type"] == "voice")
        assert voice == {
            "type": "voice",
            "voice": _name(good),
            "frames": 46,
            "seconds": pytest.approx(sf.info(greeting).duration, abs=1e-3),
            "loudness_lufs": voice["loudness_lufs"],
        }
        (session,) = server.hub.sessions
        expected = tiny_checkpoint.load_voice_prompt(greeting).codes  # what `--voice greeting.wav` reads
        assert torch.equal(session.recorded_voice.prompt.codes, expected)

        # every bad kind after it: refused with what is wrong, and the recording stays the voice
        for kind, says in [
            ("silent", "is silent"),
            ("long", "over the limit of 30 s"),
            ("not_audio", "cannot decode audio"),
        ]:
            answer = await _send_recording(client, recordings[kind])
            assert answer["code"] == "bad_voice_audio", (kind, answer)
            assert says in answer["message"] and f"keeps its voice ({_name(good)})" in answer["message"], kind
        await client.send_json({"type": "voice_audio", "size": 10})
        await ws.send(b"x" * 11)
        _, answer = await client.recv_until(lambda k, m: k == "json" and m["type"] == "error")
        assert answer["code"] == "bad_voice_audio" and "announced as 10 bytes" in answer["message"]
        await client.send_json({"type": "voice_audio", "size": 9 * 1024 * 1024})
        _, answer = await client.recv_until(lambda k, m: k == "json" and m["type"] == "error")
        assert answer["code"] == "invalid_message" and "voice_audio: size" in answer["message"]

        ready = await client.start()
        assert ready["persona"]["voice"] == _name(good)
        assert ready["persona"]["prefix_frames"] == 46 + 1 + _text_tokens(tiny_checkpoint) + 1  # Context Spanning
        await client.send_json({"type": "voice_audio", "size": 10})
        _, late = await client.recv_until(lambda k, m: k == "json" and m["type"] == "error")
        assert late["code"] == "already_started" and "before start" in late["message"]
        await client.stream(load_frames(greeting)[:8])
        bye = await client.stop()
    assert bye["stats"]["consumed_frames"] == 8
    assert metric(server, 'cspan_voice_recordings_total{protocol="cspan"}') == 1
    assert metric(server, 'cspan_protocol_errors_total{code="bad_voice_audio",protocol="cspan"}') == 6


@pytest.mark.timeout(300)
async def test_ws_start_voice_name_replaces_the_recording(serve, recordings) -> None:
    """A voice name in start wins over the recording; a connection may send at most 8 recordings."""
    server = serve()
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        assert (await _send_recording(client, recordings["good"]))["type"] == "voice"
        for _ in range(7):
            assert "1.00 s long" in (await _send_recording(client, recordings["short"]))["message"]
        answer = await _send_recording(client, recordings["good"])
        assert answer["code"] == "bad_voice_audio" and "more than 8 voice recordings" in answer["message"]
        assert f"keeps its voice ({_name(recordings['good'])})" in answer["message"]
        ready = await client.start(voice="tiny1")
        assert ready["persona"]["voice"] == "tiny1"
        await client.stop()


@pytest.mark.timeout(300)
async def test_ws_recordings_are_counted_per_user_over_connections(serve, recordings, tmp_path) -> None:
    """Opening more connections does not buy more recordings: a user may send 16 a minute over all its connections
    (each is decoded, and a good one Mimi-encoded on the engine thread every session's clock shares); another user
    is not affected, and the window moves on."""
    from cspan.backends.context_db import ContextDB
    from cspan.backends.identity import issue_token

    with ContextDB(tmp_path / "context.sqlite") as db:
        ada, bob = (issue_token(db, user)[1] for user in ("ada", "bob"))
        ops = issue_token(db, "ops", scopes=["admin"])[1]
    server = serve(db=str(tmp_path / "context.sqlite"))
    url = server.ws_url + "?token="
    async with websockets.connect(url + ada, max_size=None) as ws1, websockets.connect(url + ada) as ws2:
        for ws in (ws1, ws2):  # 8 on each connection, the most one connection may send: 16 in all
            client = Client(ws)
            for _ in range(8):
                assert "1.00 s long" in (await _send_recording(client, recordings["short"]))["message"]
        async with websockets.connect(url + ada, max_size=None) as ws3:  # a third connection of ada's: refused
            answer = await _send_recording(Client(ws3), recordings["good"])
            assert answer["code"] == "bad_voice_audio", answer
            assert "more than 16 voice recordings of this user in 60 s over all its connections" in answer["message"]
            assert answer["message"].endswith("the session keeps its voice")
            async with websockets.connect(url + bob, max_size=None) as ws4:  # bob's own budget
                assert (await _send_recording(Client(ws4), recordings["good"]))["type"] == "voice"
            budget = server.hub.recordings
            budget.clock = lambda: time.monotonic() + budget.window_s  # a minute later: ada may again
            assert (await _send_recording(Client(ws3), recordings["good"]))["type"] == "voice"
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ops}"}).text
    assert 'cspan_voice_recordings_total{protocol="cspan"} 2.0' in text.splitlines()
    assert 'cspan_protocol_errors_total{code="bad_voice_audio",protocol="cspan"} 17.0' in text.splitlines()


# ------------------------------------------------------------------------------------------------ /api/chat


async def _moshi_with_recording(server: ServerThread, data: bytes, query: str = "") -> tuple[list[bytes], Any, Any]:
    http, ws = await raw_connect(server, f"?voice_audio={len(data)}{query}")
    for k in range(0, len(data), 100_000):
        await ws.send_bytes(b"\x06" + data[k : k + 100_000])
    got = await messages_until(ws, lambda m: m[0] == 4 and json.loads(m[1:])["type"] == "session")
    return got, http, ws


@pytest.mark.timeout(300)
async def test_moshi_voice_recording(serve, tiny_checkpoint, recordings) -> None:
    server = serve()
    good = recordings["good"]
    got, http, ws = await _moshi_with_recording(server, good, "&voice_prompt=tiny1.pt&text_prompt=Hi.")
    try:
        voice = json.loads(got[0][1:])
        assert (voice["type"], voice["voice"], voice["frames"]) == ("voice", _name(good), 46)
        assert got[1] == b"\x00"
        session = json.loads(got[2][1:])
        assert session["persona"]["voice"] == _name(good)  # the recording, not voice_prompt
        assert session["persona"]["prefix_frames"] == 46 + 1 + _text_tokens(tiny_checkpoint, "Hi.") + 1
    finally:
        await ws.close()
        await http.close()
    await _until_free(server)

    # every bad kind: 0x05 bad_voice_audio saying what is wrong, and the conversation starts with voice_prompt's voice
    for kind, says in [
        ("silent", b"is silent"),
        ("short", b"1.00 s long"),
        ("long", b"over the limit of 30 s"),
        ("not_audio", b"cannot decode audio"),
    ]:
        got, http, ws = await _moshi_with_recording(server, recordings[kind], "&voice_prompt=tiny1")
        try:
            assert got[0].startswith(b"\x05bad_voice_audio: ") and says in got[0], (kind, got[0])
            assert b"object at 0x" not in got[0], got[0]  # libsndfile's name for the bytes is not the client's
            assert json.loads(got[-1][1:])["persona"]["voice"] == "tiny1", kind
        finally:
            await ws.close()
            await http.close()
        await _until_free(server)

    http, ws = await raw_connect(server, "?voice_audio=lots")
    try:
        got = await messages_until(ws, lambda m: m[0] == 4)
        assert got[0].startswith(b"\x05invalid_message: voice_audio=") and b'"refused"' in got[1]
    finally:
        await ws.close()
        await http.close()


async def _until_free(server: ServerThread) -> None:
    for _ in range(600):
        if server.hub.free_slots() == server.hub.engine.batch_size:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the slot was not freed")


# ------------------------------------------------------------------------------------------------ /v1/realtime


@pytest.mark.timeout(300)
async def test_realtime_voice_recording(serve, recordings, fixture_file) -> None:
    """The recording's base64 must fit --max-message-kib (1024 here, for the 31 s WAV, refused for its length)."""
    server = serve(max_message_kib=1024)
    good = recordings["good"]
    ws, client = await realtime_connect(server)
    try:
        b64 = base64.b64encode(good).decode()
        effective, after = await update(client, "v1", {"cspan": {"events": True, "voice_audio": b64}})
        assert effective["audio"]["output"]["voice"] == _name(good) and not errors(after)
        (voice,) = [e for e in client.events if e["type"] == "cspan.voice"]
        assert voice["voice"] == _name(good) and voice["frames"] == 46

        for k, (value, says) in enumerate(
            [
                ("@@not base64@@", "not base64"),
                (base64.b64encode(recordings["silent"]).decode(), "is silent"),
                (base64.b64encode(recordings["short"]).decode(), "1.00 s long"),
                (base64.b64encode(recordings["long"]).decode(), "over the limit of 30 s"),
                (base64.b64encode(recordings["not_audio"]).decode(), "cannot decode audio"),
            ]
        ):
            effective, after = await update(client, f"b{k}", {"cspan": {"voice_audio": value}})
            assert errors(after) == [("bad_voice_audio", "session.cspan.voice_audio", f"b{k}")]
            assert says in after[0]["error"]["message"]
            assert effective["audio"]["output"]["voice"] == _name(good)  # kept

        frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))[:6]
        pcm16 = (np.concatenate(frames) * 32767).astype("<i2").tobytes()
        await client.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16).decode()})
        await client.until(lambda e: e["type"] == "cspan.ready")
        (session,) = server.hub.sessions
        assert session._start.voice.name == _name(good)
        _, after = await update(client, "late", {"cspan": {"voice_audio": b64}})
        assert errors(after) == [("session_live", "session.cspan.voice_audio", "late")]
    finally:
        await ws.close()
