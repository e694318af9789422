"""``cspan asr-serve``'s limits on a real uvicorn (in a thread, with the server's own configuration) and an engine
that blocks until released: a full queue is 503 with ``Retry-After`` (no traceback), and a client that trickles its
request headers (slowloris) is cut off at the header timeout."""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import soundfile as sf

from cspan.backends.asr.base import Transcript
from cspan.backends.asr.server import ASRServerSettings, uvicorn_config

pytest.importorskip("fastapi")
pytest.importorskip("httptools")


class BlockingEngine:
    """Recognises "hello" once ``release`` is set; counts the clips that started."""

    name = "blocking"
    model = "none"
    language = None

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = 0

    def transcribe(self, pcm: np.ndarray, sample_rate: int, *, language: str | None = None) -> Transcript:
        self.started += 1
        self.last = pcm
        self.release.wait(30)
        return Transcript(text="hello")


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, BlockingEngine]]:
    import uvicorn

    engine = BlockingEngine()
    settings = ASRServerSettings(max_concurrency=1, max_queue=1, header_timeout_s=0.5)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn_config(engine, host="127.0.0.1", port=port, settings=settings)
    config.log_level = logging.WARNING
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "asr-serve did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", engine
    engine.release.set()
    srv.should_exit = True
    thread.join(timeout=10)
    sock.close()


def _wav() -> bytes:
    buf = io.BytesIO()
    sf.write(buf, (0.1 * np.sin(np.arange(8000) / 5.0)).astype(np.float32), 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def test_a_full_queue_is_503_with_retry_after_and_no_traceback(server, caplog) -> None:
    url, engine = server
    engine.release.clear()

    def post() -> httpx.Response:
        return httpx.post(f"{url}/transcribe", files={"file": ("a.wav", _wav(), "audio/wav")}, timeout=30)

    with caplog.at_level(logging.INFO), ThreadPoolExecutor(max_workers=2) as pool:
        running = pool.submit(post)
        while engine.started < 1:
            time.sleep(0.01)
        queued = pool.submit(post)
        while httpx.get(f"{url}/health", timeout=5).json()["queued"] < 1:
            time.sleep(0.01)
        refused = [post() for _ in range(3)]
        openai = httpx.post(
            f"{url}/v1/audio/transcriptions", files={"file": ("a.wav", _wav(), "audio/wav")}, timeout=30
        )
        engine.release.set()
        assert running.result().json()["text"] == queued.result().json()["text"] == "hello"
    for r in [*refused, openai]:
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        error = r.json()["error"]
        assert error["code"] == "server_busy" and error["type"] == "server_error"
        assert error["message"] == "1 clips are being transcribed and 1 are waiting (the limit); retry after 1 s"
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR]


def test_trickled_request_headers_are_cut_off_at_the_header_timeout(server) -> None:
    url, engine = server
    engine.release.set()
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /transcribe HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        t0 = time.monotonic()
        closed = False
        while time.monotonic() - t0 < 4.0:
            try:
                sock.sendall(b"X-Slow: 1\r\n")
                sock.settimeout(0.1)
                if sock.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:  # reset by the server
                closed = True
                break
        assert closed, "the server kept a connection whose headers never completed"
        assert 0.4 < time.monotonic() - t0 < 2.5
    # an ordinary request still works
    r = httpx.post(f"{url}/transcribe", files={"file": ("a.wav", _wav(), "audio/wav")}, timeout=30)
    assert r.status_code == 200 and r.json()["text"] == "hello"


def test_an_upload_with_non_finite_samples_is_read_with_them_silent(server, caplog) -> None:
    """The project's one rule (cspan.core.audio.sanitize_pcm): NaN / infinite samples become silence, counted."""
    url, engine = server
    engine.release.set()
    x = (0.1 * np.sin(np.arange(16000) / 5.0)).astype(np.float32)
    x[:10] = np.nan
    x[500:503] = np.inf
    buf = io.BytesIO()
    sf.write(buf, x, 16000, format="WAV", subtype="FLOAT")
    with caplog.at_level(logging.WARNING, logger="cspan.backends.asr.audio"):
        r = httpx.post(f"{url}/transcribe", files={"file": ("nan.wav", buf.getvalue(), "audio/wav")}, timeout=30)
    assert r.status_code == 200 and r.json()["text"] == "hello"
    assert np.isfinite(engine.last).all() and (engine.last[:10] == 0).all() and engine.last.shape == (16000,)
    assert "the upload: 13 NaN or infinite samples read as silence" in caplog.messages
