"""Transcriber clients and audio helpers of cspan.backends.asr (in-process; the server has its own test file)."""

from __future__ import annotations

import io
import json
import logging
import socket
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
import soundfile as sf

from cspan.backends.asr import (
    HTTPTranscriber,
    OpenAITranscriber,
    PocketSphinxTranscriber,
    Transcriber,
    Transcript,
    Word,
    clean_asr_text,
    transcriber_from_url,
)
from cspan.backends.asr.audio import (
    AudioFormatError,
    AudioTooLongError,
    as_mono_float32,
    decode_audio,
    encode_wav,
    resample,
)
from cspan.backends.asr.openai import transcriptions_url
from cspan.backends.errors import TranscriberError


@pytest.fixture(scope="module")
def weather(fixture_file) -> tuple[np.ndarray, int]:
    pcm, sr = sf.read(fixture_file("audio", "question_weather_24k.wav"), dtype="float32")
    return pcm, sr


# --- text and data model ------------------------------------------------------------------------------------


def test_clean_asr_text_strips_qwen3_language_prefix() -> None:
    assert clean_asr_text("language English<asr_text>What is the weather?") == "What is the weather?"
    assert clean_asr_text("  language None<asr_text> ") == ""
    assert clean_asr_text("language Korean<asr_text>안녕하세요</asr_text>") == "안녕하세요"
    assert clean_asr_text("the language is English") == "the language is English"


def test_word_rejects_end_before_start() -> None:
    assert Word(text="hi", start_s=0.5, end_s=0.7).end_s == 0.7
    with pytest.raises(ValueError, match="before start_s"):
        Word(text="hi", start_s=0.7, end_s=0.5)


# --- audio helpers ------------------------------------------------------------------------------------------


def _encode(pcm: np.ndarray, sr: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, pcm, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


@pytest.mark.parametrize(("fmt", "subtype"), [("WAV", "PCM_16"), ("FLAC", None), ("OGG", "VORBIS")])
def test_decode_audio_mixes_stereo_to_mono(fmt: str, subtype: str | None) -> None:
    sr = 44100
    t = np.arange(sr // 2) / sr
    left = 0.5 * np.sin(2 * np.pi * 440 * t)
    stereo = np.stack([left, np.zeros_like(left)], axis=1).astype(np.float32)
    pcm, rate = decode_audio(_encode(stereo, sr, fmt, subtype))
    assert rate == sr and pcm.dtype == np.float32 and pcm.ndim == 1
    assert abs(pcm.size - t.size) <= 1024  # Vorbis may pad a little
    # Mean of the two channels: half the left channel's level (RMS 0.5/sqrt(2)/2).
    rms = float(np.sqrt(np.mean(pcm[1000 : t.size - 1000] ** 2)))
    assert rms == pytest.approx(0.25 / np.sqrt(2), rel=0.05)


def test_decode_audio_rejects_garbage_and_overlong() -> None:
    with pytest.raises(AudioFormatError, match="not a readable audio file"):
        decode_audio(b"RIFF\x00\x00garbage-not-audio" * 10)
    with pytest.raises(AudioFormatError, match="empty"):
        decode_audio(b"")
    long_wav = _encode(np.zeros(8000 * 12, np.float32), 8000, "WAV", "PCM_16")
    with pytest.raises(AudioTooLongError, match=r"12\.0 s") as info:
        decode_audio(long_wav, max_seconds=10)
    assert info.value.duration_s == pytest.approx(12.0) and info.value.limit_s == 10


def test_encode_wav_is_16bit_and_round_trips(weather) -> None:
    pcm, sr = weather
    wav = encode_wav(pcm, sr)
    info = sf.info(io.BytesIO(wav))
    assert (info.format, info.subtype, info.samplerate, info.channels) == ("WAV", "PCM_16", sr, 1)
    back, rate = decode_audio(wav)
    assert rate == sr and back.shape == pcm.shape
    assert np.max(np.abs(back - pcm)) < 1.0 / 16000


def test_as_mono_float32_shapes_and_dtypes(caplog) -> None:
    assert as_mono_float32(np.zeros((1, 10), np.float64)).shape == (10,)
    assert as_mono_float32(np.full(4, 16384, np.int16))[0] == pytest.approx(0.5)
    with pytest.raises(AudioFormatError, match="mono"):
        as_mono_float32(np.zeros((2, 10), np.float32))
    # the project's one rule for non-finite samples (cspan.core.audio.sanitize_pcm): silence, counted, clipped
    with caplog.at_level(logging.WARNING, logger="cspan.backends.asr.audio"):
        out = as_mono_float32(np.array([0.5, np.nan, np.inf, -np.inf, 3.0, 1e300], np.float64), "the clip")
    assert out.dtype == np.float32 and out.tolist() == [0.5, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert [r.getMessage() for r in caplog.records] == ["the clip: 4 NaN or infinite samples read as silence"]
    assert resample(np.zeros(24000, np.float32), 24000, 16000).shape == (16000,)


# --- embedded pocketsphinx ----------------------------------------------------------------------------------


async def test_pocketsphinx_transcribes_weather_with_word_times(weather) -> None:
    pytest.importorskip("pocketsphinx")
    pcm, sr = weather
    transcriber = PocketSphinxTranscriber()
    assert isinstance(transcriber, Transcriber)
    result = await transcriber.transcribe(pcm, sr)
    assert isinstance(result, Transcript)
    words = [w.text for w in result.words]
    assert "weather" in words and "london" in words
    assert result.text == " ".join(words)
    duration = pcm.size / sr
    starts = [w.start_s for w in result.words]
    assert starts == sorted(starts)
    assert all(0.0 <= w.start_s < w.end_s <= duration + 0.02 for w in result.words)
    weather_word = result.words[words.index("weather")]
    assert 0.2 < weather_word.start_s < weather_word.end_s < 1.5  # it is the 4th word of a 2.9 s clip
    empty = await transcriber.transcribe(np.zeros(0, np.float32), 16000)
    assert empty.text == "" and empty.words == []
    with pytest.raises(TranscriberError, match="mono") as info:
        await transcriber.transcribe(np.zeros((2, 100), np.float32), 16000)
    assert info.value.endpoint == "pocketsphinx"


# --- remote clients against httpx's in-memory transport (a stand-in for vLLM) --------------------------------


def _multipart_fields(request: httpx.Request) -> dict[str, list[str]]:
    """Form fields (not files) of a multipart request, parsed with the standard library's email parser."""
    from email.parser import BytesParser

    ctype = request.headers["content-type"]
    message = BytesParser().parsebytes(b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + request.content)
    fields: dict[str, list[str]] = {}
    for part in message.get_payload():
        name = part.get_param("name", header="content-disposition")
        if part.get_filename() is None:
            fields.setdefault(name, []).append(part.get_payload(decode=True).decode())
        else:
            fields.setdefault(name, []).append(f"<file {part.get_filename()} {part.get_content_type()}>")
    return fields


def _fake_vllm(seen: list[httpx.Request], *, verbose_ok: bool):
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        fields = _multipart_fields(request)
        if fields.get("response_format") == ["verbose_json"] and not verbose_ok:
            return httpx.Response(
                400,
                json={
                    "object": "error",
                    "message": "Currently only support response_format `text` or `json`",
                    "code": 400,
                },
            )
        if fields.get("response_format") == ["verbose_json"]:
            words = [{"word": "weather", "start": 0.5, "end": 0.9}]
            return httpx.Response(200, json={"text": "language English<asr_text>What is the weather?", "words": words})
        return httpx.Response(200, json={"text": "language English<asr_text>What is the weather?"})

    return handler


async def test_openai_transcriber_request_and_prefix_strip(weather, monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    seen: list[httpx.Request] = []
    client = httpx.AsyncClient(transport=httpx.MockTransport(_fake_vllm(seen, verbose_ok=True)))
    t = OpenAITranscriber("http://asr.local:8000/v1", language="en", client=client)
    result = await t.transcribe(*weather)
    assert result == Transcript(text="What is the weather?", words=None)
    request = seen[0]
    assert str(request.url) == "http://asr.local:8000/v1/audio/transcriptions"
    assert request.headers["authorization"] == "Bearer sk-test"
    fields = _multipart_fields(request)
    assert fields["model"] == ["qwen3-asr"] and fields["language"] == ["en"]
    assert fields["file"] == ["<file audio.wav audio/wav>"]
    await client.aclose()


async def test_openai_word_timestamps_and_fallback_for_servers_without_them(weather) -> None:
    seen: list[httpx.Request] = []
    client = httpx.AsyncClient(transport=httpx.MockTransport(_fake_vllm(seen, verbose_ok=True)))
    t = OpenAITranscriber("http://asr.local", api_key="", word_timestamps=True, client=client)
    result = await t.transcribe(*weather)
    assert result.words == [Word(text="weather", start_s=0.5, end_s=0.9)]
    assert "authorization" not in seen[0].headers
    assert _multipart_fields(seen[0])["timestamp_granularities[]"] == ["word"]

    seen.clear()
    old_vllm = httpx.AsyncClient(transport=httpx.MockTransport(_fake_vllm(seen, verbose_ok=False)))
    t = OpenAITranscriber("http://asr.local", api_key="", word_timestamps=True, client=old_vllm)
    first = await t.transcribe(*weather)
    second = await t.transcribe(*weather)
    assert first == second == Transcript(text="What is the weather?", words=None)
    formats = [_multipart_fields(r)["response_format"][0] for r in seen]
    assert formats == ["verbose_json", "json", "json"]  # asks once, then remembers
    await client.aclose()
    await old_vllm.aclose()


async def test_http_error_status_raises_with_endpoint_and_status(weather) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"text": "", "error": "CUDA out of memory"})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    t = HTTPTranscriber("http://asr.local:8990", client=client)
    assert t.endpoint == "http://asr.local:8990/transcribe"
    with pytest.raises(TranscriberError, match="HTTP 500: CUDA out of memory") as info:
        await t.transcribe(*weather)
    assert (info.value.endpoint, info.value.status) == ("http://asr.local:8990/transcribe", 500)

    def not_json(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="<html>proxy</html>")

    t = HTTPTranscriber("http://asr.local:8990", client=httpx.AsyncClient(transport=httpx.MockTransport(not_json)))
    with pytest.raises(TranscriberError, match="not JSON"):
        await t.transcribe(*weather)
    await client.aclose()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_connection_refused_is_retried_with_backoff_then_raises(weather, caplog) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/transcribe"
    t = HTTPTranscriber(url, max_attempts=3, backoff_s=0.01)
    with caplog.at_level(logging.WARNING, logger="cspan.backends.asr.http"), pytest.raises(TranscriberError) as info:
        await t.transcribe(*weather)
    await t.aclose()
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 2  # 3 attempts, 2 waits
    assert "retrying in 0.01 s" in retries[0] and "retrying in 0.02 s" in retries[1]
    assert info.value.endpoint == url and info.value.status is None
    assert "after 3 attempt(s)" in str(info.value) and "cspan asr-serve" in str(info.value)


async def test_a_credential_in_the_url_stays_out_of_errors_and_retry_logs(weather, caplog) -> None:
    """The ASR URL's password and secret query parameters were in the TranscriberError (and its endpoint) and in
    the WARNING line of every retry; the query stays at the end of the endpoint (was '...?key=x/transcribe')."""
    url = f"http://ann:pw4321@127.0.0.1:{_closed_port()}?api_key=SECRET3"
    retry = {"max_attempts": 2, "backoff_s": 0.01}
    for t in (HTTPTranscriber(url, **retry), transcriber_from_url(url.replace("?", "/v1?"), api_key="", **retry)):
        endpoint = urlsplit(t.endpoint)
        assert endpoint.query == "api_key=SECRET3", t.endpoint
        assert endpoint.path in ("/transcribe", "/v1/audio/transcriptions"), t.endpoint
        with caplog.at_level(logging.WARNING), pytest.raises(TranscriberError) as info:
            await t.transcribe(*weather)
        await t.aclose()
        said = [str(info.value), info.value.endpoint or "", *(r.getMessage() for r in caplog.records)]
        assert "ann:***@127.0.0.1" in str(info.value) and "api_key=***" in str(info.value), said
        assert not any("pw4321" in m or "SECRET3" in m for m in said), said
        caplog.clear()


async def test_read_timeout_is_not_retried(weather) -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ReadTimeout("timed out", request=request)

    t = OpenAITranscriber(
        "http://asr.local", api_key="", timeout_s=1.5, client=httpx.AsyncClient(transport=httpx.MockTransport(handler))
    )
    with pytest.raises(TranscriberError, match=r"no complete reply within 1\.5 s"):
        await t.transcribe(*weather)
    assert len(calls) == 1


def test_transcriber_from_url_and_endpoint_normalisation() -> None:
    assert isinstance(transcriber_from_url("http://h:8990"), HTTPTranscriber)
    o = transcriber_from_url("http://h:8000/v1", api_key="")
    assert isinstance(o, OpenAITranscriber) and o.endpoint == "http://h:8000/v1/audio/transcriptions"
    assert o.model == "qwen3-asr"
    o = transcriber_from_url("openai+http://h:8990", model="whisper-1", api_key="")
    assert o.endpoint == "http://h:8990/v1/audio/transcriptions" and o.model == "whisper-1"
    assert transcriptions_url("http://h/v1/audio/transcriptions/") == "http://h/v1/audio/transcriptions"
    assert transcriptions_url("http://h/v1?api-version=2") == "http://h/v1/audio/transcriptions?api-version=2"
    with pytest.raises(ValueError, match="sphinx"):
        transcriber_from_url("ftp://h")
    assert json.loads(Transcript(text="a", words=[Word(text="a", start_s=0, end_s=0.1)]).model_dump_json())["words"]


@pytest.mark.parametrize("seconds", [0.001, 0.01, 0.05])
async def test_sphinx_on_a_clip_too_short_to_decode_returns_empty_text(seconds):
    from cspan.backends.asr import PocketSphinxTranscriber

    pcm = (0.1 * np.random.default_rng(0).standard_normal(int(24_000 * seconds))).astype(np.float32)
    result = await PocketSphinxTranscriber().transcribe(pcm, 24_000)
    assert result.text == "" and result.words == []


class _KeepAliveASR:
    """A ``POST /transcribe`` server on 127.0.0.1 (HTTP/1.1, connections kept alive) that counts the connections
    its clients open."""

    def __init__(self) -> None:
        import http.server
        import threading

        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with server.lock:
                    server.connections += 1

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                body = json.dumps({"text": "hello"}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.lock = threading.Lock()
        self.connections = 0
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/transcribe"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_transcriber_shared_by_threads_keeps_one_client_per_event_loop() -> None:
    """Two threads, each running its own event loop, take turns with one transcriber (a server's engine thread and a
    library user's worker, say). The transcriber kept one client and swapped it whenever the loop changed: every
    turn opened a new connection and left the replaced client, and its connection, open (and two threads swapping
    at once could hand one of them the other loop's client). Now each loop keeps its own client, as the router's."""
    import asyncio
    import threading

    server = _KeepAliveASR()
    loops = [asyncio.new_event_loop() for _ in range(2)]
    threads = [threading.Thread(target=loop.run_forever, daemon=True) for loop in loops]
    for thread in threads:
        thread.start()

    def on(loop: asyncio.AbstractEventLoop, coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=30)

    pcm = np.zeros(1600, np.float32)
    try:
        for t in (HTTPTranscriber(server.url), OpenAITranscriber(server.url.replace("/transcribe", "/v1"), api_key="")):
            before = server.connections
            for _ in range(3):
                for loop in loops:
                    assert on(loop, t.transcribe(pcm, 16000)).text == "hello"
            assert server.connections - before == 2  # one kept-alive connection per loop, not one per turn
            clients = [on(loop, _client_of(t)) for loop in loops]
            assert clients[0] is not clients[1] and not any(c.is_closed for c in clients)
            on(loops[0], t.aclose())
            assert clients[0].is_closed
        t = HTTPTranscriber(server.url)
        for _ in range(4):  # asyncio.run per call: a new loop each time
            assert asyncio.run(t.transcribe(pcm, 16000)).text == "hello"
        assert len(t._clients) == 1  # the clients of closed loops are let go
    finally:
        for loop in loops:
            loop.call_soon_threadsafe(loop.stop)
        for thread in threads:
            thread.join(timeout=10)
        server.close()


async def _client_of(t: HTTPTranscriber | OpenAITranscriber) -> httpx.AsyncClient:
    return t._get_client()
