"""`cspan asr-serve` as a real uvicorn subprocess, reached through the real transcriber clients."""

from __future__ import annotations

import asyncio
import io
import os
import socket
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
