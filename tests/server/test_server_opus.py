"""Ogg/Opus on ``/ws``: negotiated in ``start.codecs`` (PCM the fallback), both ways through sphn; packet loss, corrupt
pages and the wrong codec get an ``error`` and never end the session."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import websockets
from serve_client import load_frames

FRAME = 1920


class OpusClient:
    """A ``/ws`` client that speaks Ogg/Opus (sphn both ways) and keeps what it received."""

    def __init__(self, ws) -> None:  # type: ignore[no-untyped-def]
        import sphn

        self.ws = ws
        self.writer = sphn.OpusStreamWriter(24000)
        self.reader = sphn.OpusStreamReader(24000)
        self.pcm: list[np.ndarray] = []
        self.binary_bytes = 0
        self.events: list[dict] = []

    async def recv(self) -> tuple[str, object]:
        data = await self.ws.recv()
        if isinstance(data, bytes):
            self.binary_bytes += len(data)
            pcm = self.reader.append_bytes(data)
            self.pcm.append(pcm)
            return "audio", pcm
        msg = json.loads(data)
        self.events.append(msg)
        return "json", msg

    async def until(self, predicate) -> dict:  # type: ignore[no-untyped-def]
        while True:
            kind, msg = await self.recv()
            if kind == "json" and predicate(msg):
                return msg  # type: ignore[return-value]

    def page(self, frame: np.ndarray) -> bytes:
        return self.writer.append_pcm(np.ascontiguousarray(frame, dtype=np.float32))

    def samples(self) -> int:
        return sum(p.size for p in self.pcm)

    def errors(self) -> list[str]:
        return [m["code"] for m in self.events if m["type"] == "error"]


@pytest.mark.timeout(300)
async def test_opus_both_ways(serve, fixture_file) -> None:
    server = serve()
    frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        c = OpusClient(ws)
        await ws.send(json.dumps({"type": "start", "codecs": ["opus", "pcm"]}))
        ready = await c.until(lambda m: m["type"] in ("ready", "error"))
        assert (ready["type"], ready["codec"], ready["audio_formats"]) == ("ready", "opus", ["ogg-opus"])
        data = b"".join(c.page(f) for f in frames)
        for k in range(0, len(data), 700):  # Ogg bytes in any chunking
            await ws.send(data[k : k + 700])
        await ws.send(json.dumps({"type": "stop"}))
        bye = await c.until(lambda m: m["type"] == "bye")
    stats = bye["stats"]
    assert stats["user_frames"] == stats["consumed_frames"] == len(frames)
    assert stats["errors"] == 0 and not c.errors()
    assert c.samples() == stats["frames"] * FRAME  # every agent frame, decoded to the sample
    assert c.binary_bytes < stats["frames"] * FRAME * 4 / 8  # far below float32 PCM (7680 bytes a frame)
    audio = np.concatenate(c.pcm)
    assert np.isfinite(audio).all() and np.abs(audio).max() <= 1.0


@pytest.mark.parametrize(
    ("codecs", "expect"),
    [(None, "pcm"), (["pcm"], "pcm"), (["flac", "opus"], "opus"), (["flac", "aac"], "pcm"), ([], "pcm")],
)
async def test_codec_negotiation_falls_back_to_pcm(serve, codecs, expect) -> None:  # type: ignore[no-untyped-def]
    server = serve()
    start: dict = {"type": "start"}
    if codecs is not None:
        start["codecs"] = codecs
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        await ws.send(json.dumps(start))
        while True:
            msg = await ws.recv()
            if isinstance(msg, str) and json.loads(msg)["type"] == "ready":
                break
        assert json.loads(msg)["codec"] == expect
        audio = await ws.recv()
        assert isinstance(audio, bytes) and (len(audio) == 7680) == (expect == "pcm")


@pytest.mark.timeout(300)
async def test_loss_corruption_and_wrong_codec_keep_the_session(serve, fixture_file) -> None:
    server = serve()
    frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))[:20]
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        c = OpusClient(ws)
        await ws.send(json.dumps({"type": "start", "codecs": ["opus"]}))
        await c.until(lambda m: m["type"] == "ready")
        pages = [c.page(f) for f in frames]
        corrupt = bytearray(pages[6])
        corrupt[30:42] = b"\xff" * 12
        bad = {
            3: None,  # lost in transit
            6: bytes(corrupt),  # a corrupt page
            9: frames[9].astype("<f4").tobytes(),  # PCM in an opus session (the wrong codec)
            12: b"hello",
        }
        for k, page in enumerate(pages):
            if k in bad:
                if bad[k] is not None:
                    await ws.send(bad[k])
                continue
            await ws.send(page)
        await ws.send(json.dumps({"type": "stop"}))
        bye = await c.until(lambda m: m["type"] == "bye")
    assert c.errors() == ["bad_audio", "bad_audio", "bad_audio"], c.events
    messages = [m["message"] for m in c.events if m["type"] == "error"]
    assert re.search(r"a corrupt Ogg page \(checksum mismatch, page \d+\)$", messages[0]), messages[0]
    assert "7680 bytes that are not an Ogg page were dropped" in messages[1]
    assert "5 bytes that are not an Ogg page were dropped" in messages[2]
    stats = bye["stats"]
    assert stats["errors"] == 3
    assert stats["consumed_frames"] == stats["user_frames"] == len(frames) - len(bad)  # the good pages, all of them


@pytest.mark.timeout(300)
async def test_a_vorbis_file_in_two_messages_is_one_error(serve) -> None:
    """PROTOCOL.md: another codec's Ogg stream is named once per session, however it is cut into messages."""
    server = serve()
    vorbis = _vorbis_file()
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        c = OpusClient(ws)
        await ws.send(json.dumps({"type": "start", "codecs": ["opus"]}))
        await c.until(lambda m: m["type"] == "ready")
        await ws.send(vorbis[: len(vorbis) // 2])
        await ws.send(vorbis[len(vorbis) // 2 :])
        await ws.send(json.dumps({"type": "stop"}))
        bye = await c.until(lambda m: m["type"] == "bye")
    assert c.errors() == ["bad_audio"] and bye["stats"]["errors"] == 1, c.events
    (error,) = [m for m in c.events if m["type"] == "error"]
    assert "Ogg pages of a Vorbis stream, not Opus" in error["message"]


async def test_ogg_in_a_pcm_session_says_how_to_negotiate(serve) -> None:
    import sphn

    server = serve()
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "start"}))
        while True:
            msg = await ws.recv()
            if isinstance(msg, str) and json.loads(msg)["type"] == "ready":
                break
        await ws.send(sphn.OpusStreamWriter(24000).append_pcm(np.zeros(FRAME, np.float32)))
        while True:
            msg = await ws.recv()
            if isinstance(msg, str) and json.loads(msg)["type"] == "error":
                break
    error = json.loads(msg)
    assert error["code"] == "bad_frame" and "start.codecs" in error["message"]


def test_ogg_checksum_matches_sphn_pages() -> None:
    """Our page checksum (which the decoder checks) agrees with what sphn writes, and catches one flipped bit."""
    import sphn

    from cspan.server.opus import OggOpusDecoder, ogg_crc

    writer = sphn.OpusStreamWriter(24000)
    data = b"".join(writer.append_pcm(np.full(FRAME, 0.1 * k, np.float32)) for k in range(5))
    pages = [b"OggS" + p for p in data.split(b"OggS")[1:]]
    assert len(pages) >= 6
    for page in pages:
        assert ogg_crc(page) == int.from_bytes(page[22:26], "little")
        flipped = bytearray(page)
        flipped[-1] ^= 0x01
        assert ogg_crc(flipped) != int.from_bytes(page[22:26], "little")
    decoder = OggOpusDecoder()
    pcm, problem = decoder.decode(data[:50])  # part of a page: nothing yet, nothing wrong
    assert pcm.size == 0 and problem is None
    pcm, problem = decoder.decode(data[50:])
    assert pcm.size == 5 * FRAME and problem is None


def _bitwise_ogg_crc(page: bytes) -> int:
    """RFC 3533's checksum, bit by bit (polynomial 0x04C11DB7, MSB first, initial 0, no final xor)."""
    crc = 0
    for i, byte in enumerate(page):
        crc ^= (0 if 22 <= i < 26 else byte) << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) & 0xFFFFFFFF if crc & 0x80000000 else (crc << 1) & 0xFFFFFFFF
    return crc


@pytest.mark.parametrize("size", [27, 28, 31, 282, 4097])
def test_ogg_checksum_is_rfc_3533s(size: int) -> None:
    from cspan.server.opus import ogg_crc

    rng = np.random.default_rng(size)
    for _ in range(3):
        page = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert ogg_crc(page) == _bitwise_ogg_crc(page)
        assert ogg_crc(bytearray(page)) == ogg_crc(page[:22] + b"\xff\xff\xff\xff" + page[26:])  # field ignored


@pytest.mark.parametrize("bad_pages", [1, 3, 4, 2000])
def test_decoder_reports_the_first_problems_and_a_count(bad_pages: int) -> None:
    """Corrupt pages among good ones: the good ones decode, and the report names at most three problems whatever
    the number (an error never grows with the input)."""
    import sphn

    from cspan.server.opus import OggOpusDecoder

    writer = sphn.OpusStreamWriter(24000)
    good = b"".join(writer.append_pcm(np.full(FRAME, 0.1, np.float32)) for _ in range(3))
    corrupt = b"OggS" + b"\x00" * 22 + b"\x00"  # 27 bytes, no segments, checksum 0 (wrong)
    cut = good.index(b"OggS", good.index(b"OggS", 4) + 4)  # after the two header pages
    pcm, problem = OggOpusDecoder().decode(good[:cut] + corrupt * bad_pages + good[cut:])
    assert pcm.size == 3 * FRAME
    assert problem is not None and problem.count("a corrupt Ogg page") == min(bad_pages, 3)
    assert len(problem) < 400
    if bad_pages > 3:
        assert problem.endswith(f"(and {bad_pages - 3} more problems in this message)")


@pytest.mark.parametrize("split", [1, 2, 3])
def test_decoder_keeps_a_capture_pattern_split_across_messages(split: int) -> None:
    import sphn

    from cspan.server.opus import OggOpusDecoder

    data = b"".join(sphn.OpusStreamWriter(24000).append_pcm(np.full(FRAME, 0.1, np.float32)) for _ in range(2))
    decoder = OggOpusDecoder()
    pcm, problem = decoder.decode(b"garbage" + data[:split])
    assert pcm.size == 0 and problem is not None and "7 bytes that are not an Ogg page" in problem
    pcm, problem = decoder.decode(data[split:])
    assert pcm.size == 2 * FRAME and problem is None


def _vorbis_file() -> bytes:
    """A second of noise as an OGG/Vorbis file (as libsndfile writes it)."""
    import io

    import soundfile as sf

    vorbis = io.BytesIO()
    sf.write(vorbis, np.random.default_rng(0).normal(0, 0.1, 24000), 24000, format="OGG", subtype="VORBIS")
    return vorbis.getvalue()


def test_another_codecs_ogg_stream_is_named_once_and_opus_decodes_after_it() -> None:
    """An OGG/Vorbis file sent as it is, in two messages: every page refused, the codec named once (its audio pages
    are known by their stream's serial number, in the next message too: was a second report there), and the Opus
    stream that follows decodes."""
    import sphn

    from cspan.server.opus import OggOpusDecoder

    vorbis = _vorbis_file()
    decoder = OggOpusDecoder()
    pcm, problem = decoder.decode(vorbis[: len(vorbis) // 2])
    assert pcm.size == 0
    assert problem == (
        "audio is not a valid Ogg/Opus stream: Ogg pages of a Vorbis stream, not Opus (encode the audio as Opus, "
        "or offer 'pcm' and send PCM)"
    )
    pcm, problem = decoder.decode(vorbis[len(vorbis) // 2 :])
    assert pcm.size == 0 and problem is None
    writer = sphn.OpusStreamWriter(24000)
    pcm, problem = decoder.decode(b"".join(writer.append_pcm(np.full(FRAME, 0.1, np.float32)) for _ in range(3)))
    assert problem is None and pcm.size == 3 * FRAME
