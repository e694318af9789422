"""`cspan asr-serve` as a real uvicorn subprocess, reached through the real transcriber clients."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from cspan.backends.asr import HTTPTranscriber, OpenAITranscriber, Transcript
from cspan.backends.asr.engines import EngineLoadError, TransformersEngine, load_engine
from cspan.backends.asr.server import ApiError, _Gate
from cspan.backends.errors import TranscriberError

pytest.importorskip("pocketsphinx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


SERVER_LOGS: dict[str, Path] = {}
"""The log file of each running asr-serve, by base URL."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cspan(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "cspan.core.cli", *args], env=env, **kwargs)


@pytest.fixture(scope="module")
def asr_server(tmp_path_factory) -> Iterator[str]:
    """`cspan asr-serve --engine sphinx` on a free port, with small limits; yields its base URL."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("asr") / "server.log"
    with open(log_path, "wb") as log:
        proc = _cspan(
            "-v",  # INFO lines too: the test of an abandoned upload reads them
            "asr-serve",
            "--engine",
            "sphinx",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-seconds",
            "10",
            "--max-upload-mb",
            "1",
            "--concurrency",
            "2",
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"asr-serve exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"asr-serve did not come up:\n{log_path.read_text()}")
            time.sleep(0.2)
        SERVER_LOGS[base] = log_path
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def weather(fixture_file) -> tuple[np.ndarray, int]:
    pcm, sr = sf.read(fixture_file("audio", "question_weather_24k.wav"), dtype="float32")
    return pcm, sr


async def test_both_clients_transcribe_the_weather_question(asr_server, weather) -> None:
    health = httpx.get(f"{asr_server}/health").json()
    assert health["ok"] is True and health["engine"] == "sphinx" and health["language"] == "en"
    async with (
        HTTPTranscriber(f"{asr_server}/transcribe", timeout_s=120) as plain,
        OpenAITranscriber(asr_server, api_key="", word_timestamps=True, timeout_s=120) as openai,
    ):
        # Both at once: the server decodes them on two worker threads.
        a, b = await asyncio.gather(plain.transcribe(*weather), openai.transcribe(*weather))
    for result in (a, b):
        assert isinstance(result, Transcript)
        assert "weather" in result.text.split()
        assert [w.text for w in result.words] == result.text.split()
        assert all(0 <= w.start_s < w.end_s <= 3.0 for w in result.words)
    assert a == b  # same audio, same engine, same words and times through either API


def _flac_stereo_48k(pcm: np.ndarray, sr: int) -> bytes:
    import soxr

    x = soxr.resample(pcm, sr, 48000)
    buf = io.BytesIO()
    sf.write(buf, np.stack([x, 0.5 * x], axis=1), 48000, format="FLAC")
    return buf.getvalue()


def test_bad_uploads_get_4xx_json_and_the_server_keeps_serving(asr_server, weather) -> None:
    url = f"{asr_server}/transcribe"
    corrupt = httpx.post(url, files={"file": ("a.wav", b"RIFF$\x00\x00\x00WAVEfmt garbage" * 20, "audio/wav")})
    assert corrupt.status_code == 400
    assert corrupt.json()["error"]["code"] == "invalid_audio"

    twelve_seconds = io.BytesIO()
    sf.write(twelve_seconds, np.zeros(8000 * 12, np.float32), 8000, format="WAV", subtype="PCM_16")
    too_long = httpx.post(
        f"{asr_server}/v1/audio/transcriptions",
        files={"file": ("long.wav", twelve_seconds.getvalue(), "audio/wav")},
        data={"model": "qwen3-asr"},
    )
    assert too_long.status_code == 413
    assert too_long.json()["error"]["code"] == "audio_too_long"
    assert "12.0 s" in too_long.json()["error"]["message"]

    too_big = httpx.post(url, files={"file": ("big.wav", b"\x00" * (2 * 1024 * 1024), "audio/wav")})
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "upload_too_large"

    def chunks():  # no Content-Length: the limit is enforced while the body streams in
        for _ in range(40):
            yield b"\x00" * 65536

    streamed = httpx.post(url, content=chunks(), headers={"content-type": "audio/wav"})
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "upload_too_large"

    no_file = httpx.post(url, data={"language": "en"}, files={"other": ("x.txt", b"x", "text/plain")})
    assert no_file.status_code == 400 and "'file'" in no_file.json()["error"]["message"]

    srt = httpx.post(
        f"{asr_server}/v1/audio/transcriptions",
        files={"file": ("a.wav", b"x", "audio/wav")},
        data={"response_format": "srt"},
    )
    assert srt.status_code == 400 and srt.json()["error"]["code"] == "unsupported_response_format"

    # Still serving: health, and a stereo 48 kHz FLAC (mixed to mono, resampled) is transcribed.
    assert httpx.get(f"{asr_server}/health").json()["ok"] is True
    flac = httpx.post(url, files={"file": ("q.flac", _flac_stereo_48k(*weather), "audio/flac")}, timeout=60)
    assert flac.status_code == 200, flac.text
    body = flac.json()
    assert "weather" in body["text"].split() and body["duration_s"] == pytest.approx(2.93, abs=0.01)


async def test_client_errors_carry_endpoint_and_status(asr_server, weather) -> None:
    t = OpenAITranscriber(asr_server, api_key="", language="ko")
    with pytest.raises(TranscriberError, match="HTTP 400") as info:
        await t.transcribe(*weather)
    await t.aclose()
    assert info.value.status == 400 and info.value.endpoint == f"{asr_server}/v1/audio/transcriptions"
    assert "not served" in str(info.value)

    t = HTTPTranscriber(f"{asr_server}/no-such-path")
    with pytest.raises(TranscriberError, match="HTTP 404") as info:
        await t.transcribe(*weather)
    await t.aclose()
    assert info.value.status == 404


async def test_gate_bounds_concurrency_and_refuses_beyond_the_queue() -> None:
    gate = _Gate(concurrency=1, queue=1)
    release = threading.Event()
    started = threading.Event()

    def blocking() -> Transcript:
        started.set()
        release.wait(30)
        return Transcript(text="done")

    with ThreadPoolExecutor(max_workers=2) as pool:
        first = asyncio.ensure_future(gate.run(pool, blocking))
        await asyncio.to_thread(started.wait, 30)
        second = asyncio.ensure_future(gate.run(pool, lambda: Transcript(text="second")))
        await asyncio.sleep(0)  # let it enter the queue
        assert (gate.running, gate.waiting) == (1, 1)
        with pytest.raises(ApiError) as info:
            await gate.run(pool, lambda: Transcript(text="third"))
        assert info.value.status == 503
        release.set()
        assert (await first).text == "done"
        assert (await second).text == "second"
    assert (gate.running, gate.waiting) == (0, 0)


def test_transformers_engine_missing_model_exits_with_a_clear_message(tmp_path: Path) -> None:
    missing = tmp_path / "Qwen3-ASR-1.7B"
    out = _cspan(
        "asr-serve",
        "--engine",
        "transformers",
        "--model",
        str(missing),
        "--port",
        str(_free_port()),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = out.communicate(timeout=120)
    assert out.returncode == 2, stderr
    assert str(missing) in stderr and "--engine sphinx" in stderr
    with pytest.raises(EngineLoadError, match="needs --model PATH"):
        load_engine("transformers", model=None)


def test_transformers_engine_without_transformers_names_the_install(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(EngineLoadError) as info:
        TransformersEngine.load(tmp_path)
    assert "pip install 'cspan-backends[transformers]'" in str(info.value)
    assert "pip install transformers" in str(info.value) and "--engine sphinx" in str(info.value)


def test_token_protects_everything_but_health(fixture_file):
    from fastapi.testclient import TestClient

    from cspan.backends.asr.engines import load_engine
    from cspan.backends.asr.server import ASRServerSettings, create_app

    settings = ASRServerSettings(token="s3cret", allowed_hosts=("testserver",))  # TestClient's Host
    app = create_app(load_engine("sphinx", workers=1), settings)
    wav = fixture_file("audio", "question_weather_24k.wav").read_bytes()
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        files = {"file": ("q.wav", wav, "audio/wav")}
        r = client.post("/transcribe", files=files)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        r = client.post("/transcribe", files=files, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = client.post("/transcribe", files=files, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and "weather" in r.json()["text"].lower()


def test_public_bind_without_token_is_refused():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", "asr-serve", "--host", "0.0.0.0", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--token" in out.stderr


def _wav_header(rate: int, samples: int = 1600) -> bytes:
    """A 16-bit mono WAV whose header claims ``rate`` Hz (libsndfile cannot write such rates itself)."""
    data = bytes(2 * samples)
    fmt = struct.pack("<IHHIIHH", 16, 1, 1, rate, (rate * 2) % 2**32, 2, 16)
    return (
        b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + fmt + b"data" + struct.pack("<I", len(data)) + data
    )


def test_absurd_header_sample_rates_get_json_4xx(asr_server) -> None:
    for rate in (2_000_000_000, 999, 1_000_000):
        for path in ("/transcribe", "/v1/audio/transcriptions"):
            r = httpx.post(f"{asr_server}{path}", files={"file": ("x.wav", _wav_header(rate), "audio/wav")}, timeout=60)
            assert r.status_code == 400, (rate, path, r.text)
            assert r.json()["error"]["code"] == "invalid_audio" and "sample rate" in r.json()["error"]["message"]
    assert httpx.get(f"{asr_server}/health", timeout=10).status_code == 200


def test_dns_rebinding_is_refused(asr_server) -> None:
    port = asr_server.rsplit(":", 1)[1]
    wav = _wav_header(16000)
    for host in (f"rebind.example:{port}", "rebind.example", f"localhost:{int(port) + 1}", "127.0.0.1", ""):
        r = httpx.get(f"{asr_server}/health", headers={"Host": host}, timeout=10)
        assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed", host
        r = httpx.post(
            f"{asr_server}/transcribe", files={"file": ("x.wav", wav, "audio/wav")}, headers={"Host": host}, timeout=10
        )
        assert r.status_code == 421, host
    for origin in (f"http://rebind.example:{port}", "null", f"http://localhost:{int(port) + 1}"):
        r = httpx.get(f"{asr_server}/health", headers={"Origin": origin}, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", origin
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"LOCALHOST:{port}"):
        assert httpx.get(f"{asr_server}/health", headers={"Host": host}, timeout=10).status_code == 200
    ok = httpx.get(f"{asr_server}/health", headers={"Origin": f"http://127.0.0.1:{port}"}, timeout=10)
    assert ok.status_code == 200


def test_abandoned_upload_leaves_no_traceback(asr_server) -> None:
    port = int(asr_server.rsplit(":", 1)[1])
    body = _wav_header(16000, samples=200_000)
    for content_type in ("audio/wav", "multipart/form-data; boundary=xyz"):
        prefix = b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
        payload = body if content_type == "audio/wav" else prefix + body
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            head = (
                f"POST /transcribe HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(payload) + 1000}\r\n\r\n"
            )
            sock.sendall(head.encode() + payload[: len(payload) // 2])  # then hang up half-way
    deadline = time.monotonic() + 10
    log = SERVER_LOGS[asr_server]
    while "went away" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    text = log.read_text()
    assert "went away during the upload" in text and "Traceback" not in text
    assert httpx.get(f"{asr_server}/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--max-upload-mb", "inf"],
            "--max-upload-mb / CSPAN_ASR_SERVE_MAX_UPLOAD_MB: Input should be a finite number",
        ),
        (["--port", "99999"], "--port / CSPAN_ASR_SERVE_PORT: Input should be less than or equal to 65535"),
        (["--max-seconds", "nan"], "finite number"),
        (["--concurrency", "0"], "greater than or equal to 1"),
        (["--allowed-host", "bad host"], "--allowed-host / CSPAN_ASR_SERVE_ALLOWED_HOST: allowed host"),
    ],
)
def test_out_of_range_settings_are_one_line_errors(flags: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", "asr-serve", *flags], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
