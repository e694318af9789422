"""``cspan serve`` / ``cspan infer`` against a hostile backend (tests/hostile_http.py): the start-up check that
``--asr`` / ``--router`` answer reads headers only, so a trickling or endless body cannot hold it, and a server that
sends no headers fails at the deadline; in a live session a transcriber that trickles its reply ends in a ``late``
event that says which step was running."""

from __future__ import annotations

import socket
import time

import httpx
import numpy as np
import pytest
import websockets
from hostile_http import HostileServer
from serve_client import Client

from cspan.backends.asr import OpenAITranscriber
from cspan.backends.http_client import backend_answers
from cspan.server.settings_common import check_backends_answer


@pytest.fixture(scope="module")
def hostile():
    server = HostileServer().start()
    yield server
    server.stop()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_headers_are_an_answer_and_no_body_is_read(hostile) -> None:
    modes = ["ok", "trickle", "huge_chunked", "gzip_bomb", "stall", "trickle_head"]
    t0 = time.monotonic()
    answers = await backend_answers([hostile.url(mode) for mode in modes], 0.8)
    assert time.monotonic() - t0 < 3.0
    assert answers[:4] == [None, None, None, None]
    assert isinstance(answers[4], TimeoutError | httpx.TimeoutException)  # no status line at all
    assert isinstance(answers[5], TimeoutError | httpx.TimeoutException)  # a status line at 5 bytes a second


def test_check_backends_answer_names_the_flag_and_the_cause(hostile) -> None:
    closed = f"http://127.0.0.1:{_closed_port()}/v1"

    class Settings:
        def backend_urls(self) -> dict[str, str]:
            return {"--asr": hostile.url("trickle"), "--router": hostile.url("stall"), "--mcp": closed}

    lines = check_backends_answer(Settings(), timeout_s=0.5)
    assert lines[0] == f"--router {hostile.url('stall')}: no answer within 0.5 s"
    assert lines[1].startswith(f"--mcp {closed}: does not answer (") and len(lines) == 2


async def test_a_trickling_transcriber_in_a_session_is_a_late_event_that_says_why(serve, hostile) -> None:
    transcriber = OpenAITranscriber(hostile.url("trickle"), api_key="", timeout_s=30.0)
    server = serve(transcriber=transcriber, router="local", span_deadline_s=0.5)
    silence = [np.zeros(1920, dtype=np.float32)] * 30
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        assert (await client.start(test={"force_ret_at": [0.3]}))["type"] == "ready"
        await client.stream(silence)
        if not client.received.json("late"):
            await client.recv_until(lambda k, m: k == "json" and m["type"] in ("late", "span", "no_span"), timeout=30)
        await client.stop()
    (late,) = client.received.json("late")
    assert late["error"].startswith("retrieval missed its 0.5 s deadline in the asr step"), late
    assert not client.received.json("span") and not client.received.json("no_span")
    await transcriber.aclose()
