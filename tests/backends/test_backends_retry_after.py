"""A 429 or 503 with ``Retry-After`` (RFC 9110 §10.2.3) against a real server (tests/hostile_http.py, sockets on
127.0.0.1): the wait is slept and the request sent again when it fits the deadline, else the call fails at once
saying what the server asked; a request that may not be safe to repeat is never sent again."""

from __future__ import annotations

import asyncio
import time
from email.utils import formatdate

import httpx
import numpy as np
import pytest
from hostile_http import HostileServer

from cspan.backends.asr import HTTPTranscriber, OpenAITranscriber
from cspan.backends.errors import RouterError, TranscriberError
from cspan.backends.http_client import (
    MAX_RETRY_AFTER_S,
    HTTPFailure,
    HTTPPolicy,
    advised_wait_s,
    request,
    retry_after_s,
)
from cspan.backends.router import LLMRouter, RouteRequest
from cspan.backends.tools import ToolBank

CLIP = (0.1 * np.sin(np.linspace(0, 200, 16000)).astype(np.float32), 16000)
ANSWER = "What is the weather in London?"


@pytest.fixture(scope="module")
def hostile():
    server = HostileServer().start()
    yield server
    server.stop()


@pytest.fixture
def fresh(hostile):
    """The server with its request counts reset (a refusing mode refuses its odd-numbered requests)."""
    hostile.requests.clear()
    return hostile


async def _answer(server: HostileServer, kind: str, mode: str, timeout_s: float) -> str:
    """What one client of ``kind`` gets from ``mode``: the router's answer or the transcript's text."""
    if kind == "router":
        async with LLMRouter(server.url(mode), "m", ToolBank(), api_key="", timeout_s=timeout_s) as router:
            result = await router.route(RouteRequest(question="what is the weather in London?"))
        return result.reference or ""
    if kind == "openai":
        transcriber = OpenAITranscriber(server.url(mode), api_key="", timeout_s=timeout_s)
    else:
        transcriber = HTTPTranscriber(server.url(mode, "/transcribe"), timeout_s=timeout_s)
    async with transcriber:
        return (await transcriber.transcribe(*CLIP)).text


@pytest.mark.parametrize(
    ("kind", "mode"),
    [("router", "limited"), ("router", "limited_date"), ("openai", "limited"), ("plain", "busy")],
)
async def test_a_retry_after_within_the_deadline_is_waited_out(fresh, kind, mode, caplog) -> None:
    t0 = time.monotonic()
    assert await _answer(fresh, kind, mode, timeout_s=8.0) == ANSWER
    elapsed = time.monotonic() - t0
    assert fresh.requests[mode] == 2  # refused once, then answered
    # Retry-After: 1, or a date 2 s ahead at a one-second resolution (a wait of 1 to 2 s)
    assert 0.95 <= elapsed < (3.0 if mode == "limited_date" else 2.5), elapsed
    waited = [r.getMessage() for r in caplog.records if "asked to retry after" in r.getMessage()]
    assert len(waited) == 1 and "waiting (1/2)" in waited[0], waited


@pytest.mark.parametrize("kind", ["router", "openai", "plain"])
async def test_a_retry_after_beyond_the_deadline_fails_at_once(fresh, kind) -> None:
    t0 = time.monotonic()
    error = RouterError if kind == "router" else TranscriberError
    with pytest.raises(error) as info:
        await _answer(fresh, kind, "limited_long", timeout_s=5.0)
    elapsed = time.monotonic() - t0
    message = str(info.value)
    assert elapsed < 1.0, elapsed  # not slept, not held to the deadline
    assert fresh.requests["limited_long"] == 1
    assert "HTTP 429 (Too Many Requests): the server asked to retry after 3600 s, longer than the" in message
    assert "s left before the deadline; not waited" in message
    assert "it said: " in message and "\x1b" not in message and "\n" not in message  # the server's words, inert
    if kind == "router":
        assert "Fix: the server is rate-limiting or overloaded" in message
    else:
        assert info.value.status == 429


async def test_an_absurd_retry_after_is_capped_and_refused(fresh) -> None:
    async with httpx.AsyncClient() as client:
        with pytest.raises(HTTPFailure) as info:
            await request(client, "GET", fresh.url("limited_absurd"), policy=HTTPPolicy(deadline_s=5.0))
    assert info.value.kind == "refused" and info.value.status == 429
    assert f"asked to retry after {MAX_RETRY_AFTER_S:g} s" in str(info.value)


async def test_a_request_not_safe_to_repeat_is_never_sent_again(fresh) -> None:
    policy = HTTPPolicy(deadline_s=5.0)
    async with httpx.AsyncClient() as client:
        t0 = time.monotonic()
        with pytest.raises(HTTPFailure, match=r"retry after 1 s, not sent again: a POST may not be safe to repeat"):
            await request(client, "POST", fresh.url("limited"), policy=policy, json={})
        assert time.monotonic() - t0 < 0.9 and fresh.requests["limited"] == 1
        # the same by GET (idempotent by its method) is waited out
        fresh.requests.clear()
        reply = await request(client, "GET", fresh.url("limited"), policy=policy)
        assert reply.status == 200 and fresh.requests["limited"] == 2


async def test_the_waits_are_bounded_and_the_caller_s_deadline_counts(fresh) -> None:
    async with httpx.AsyncClient() as client:
        # no wait allowed: the first refusal is the answer
        with pytest.raises(HTTPFailure, match=r"refused again after 0 wait\(s\); not sent again"):
            await request(client, "GET", fresh.url("busy"), policy=HTTPPolicy(deadline_s=5.0, max_retry_after_waits=0))
        assert fresh.requests["busy"] == 1
        # the request's own deadline allows a 1 s wait, the caller's (0.5 s from now) does not
        fresh.requests.clear()
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        with pytest.raises(HTTPFailure, match=r"HTTP 503 \(Service Unavailable\): .* longer than the 0\.\d s left"):
            await request(
                client, "GET", fresh.url("busy"), policy=HTTPPolicy(deadline_s=5.0), deadline_at=loop.time() + 0.5
            )
        assert time.monotonic() - t0 < 0.5 and fresh.requests["busy"] == 1


def test_retry_after_values() -> None:
    now = 1_000_000_000.0  # 2001-09-09T01:46:40Z
    assert retry_after_s("120") == 120.0 and retry_after_s(" 0 ") == 0.0
    assert retry_after_s(formatdate(now + 30, usegmt=True), now) == 30.0  # IMF-fixdate
    assert retry_after_s("Sunday, 09-Sep-01 01:47:10 GMT", now) == 30.0  # obsolete RFC 850
    assert retry_after_s("Sun Sep  9 01:47:10 2001", now) == 30.0  # asctime, no zone: GMT
    assert retry_after_s(formatdate(now - 30, usegmt=True), now) == 0.0  # a date past: at once
    assert retry_after_s("9" * 5000) == MAX_RETRY_AFTER_S  # no int() overflow, no 4300-digit error
    assert retry_after_s("Fri, 31 Dec 9999 23:59:59 GMT", now) == MAX_RETRY_AFTER_S
    for bad in (None, "", "-5", "1.5", "soon", "١٢", "Sun, 99 Foo 2001 99:99:99 GMT"):
        assert retry_after_s(bad, now) is None, bad


@pytest.mark.parametrize("kind", ["router", "openai"])
async def test_retry_after_ms_is_read_first(fresh, kind, caplog) -> None:
    """OpenAI's and Azure OpenAI's ``retry-after-ms`` (300 here) is the wait, before ``Retry-After`` (3 s here), as
    OpenAI's own client reads them."""
    t0 = time.monotonic()
    assert await _answer(fresh, kind, "limited_ms", timeout_s=8.0) == ANSWER
    elapsed = time.monotonic() - t0
    assert fresh.requests["limited_ms"] == 2
    assert 0.28 <= elapsed < 2.5, elapsed
    waited = [r.getMessage() for r in caplog.records if "asked to retry after" in r.getMessage()]
    assert len(waited) == 1 and "retry after 0.3 s" in waited[0], waited


@pytest.mark.parametrize("kind", ["router", "openai"])
async def test_a_refusal_without_retry_after_is_retried_after_the_backoff(fresh, kind, caplog) -> None:
    """A 429 that advises no wait is sent again after the policy's backoff (0.25 s, then 0.5), within the
    deadline and the waits' bound (was: the 429 was the answer at once)."""
    t0 = time.monotonic()
    assert await _answer(fresh, kind, "limited_bare", timeout_s=8.0) == ANSWER
    assert fresh.requests["limited_bare"] == 2
    assert 0.24 <= time.monotonic() - t0 < 2.5
    waited = [r.getMessage() for r in caplog.records if "with no Retry-After" in r.getMessage()]
    assert len(waited) == 1 and "retrying in 0.25 s (1/2)" in waited[0], waited


async def test_a_refusal_without_retry_after_is_the_answer_once_the_waits_are_spent(fresh) -> None:
    async with httpx.AsyncClient() as client:
        t0 = time.monotonic()
        reply = await request(client, "GET", fresh.url("limited_bare_always"), policy=HTTPPolicy(deadline_s=5.0))
        assert reply.status == 429 and fresh.requests["limited_bare_always"] == 3  # two backoffs, then the 429
        assert 0.7 <= time.monotonic() - t0 < 3.0
        # a POST is never sent again, and a backoff past the deadline is not slept
        fresh.requests.clear()
        reply = await request(client, "POST", fresh.url("limited_bare_always"), policy=HTTPPolicy(deadline_s=5.0))
        assert reply.status == 429 and fresh.requests["limited_bare_always"] == 1
        fresh.requests.clear()
        t0 = time.monotonic()
        policy = HTTPPolicy(deadline_s=5.0, backoff_s=10.0)
        reply = await request(client, "GET", fresh.url("limited_bare_always"), policy=policy)
        assert reply.status == 429 and fresh.requests["limited_bare_always"] == 1
        assert time.monotonic() - t0 < 1.0


def test_advised_wait_values() -> None:
    h = httpx.Headers
    assert advised_wait_s(h({"Retry-After-Ms": "250", "Retry-After": "3"})) == 0.25
    assert advised_wait_s(h({"retry-after-ms": "12.5"})) == 0.0125
    assert advised_wait_s(h({"retry-after": "3"})) == 3.0
    for bad in ("-1", "nan", "inf", "soon", ""):  # an unreadable retry-after-ms falls back to Retry-After
        assert advised_wait_s(h({"retry-after-ms": bad, "retry-after": "2"})) == 2.0, bad
        assert advised_wait_s(h({"retry-after-ms": bad})) is None, bad
    assert advised_wait_s(h({"retry-after-ms": "1e12"})) == MAX_RETRY_AFTER_S
    assert advised_wait_s(h({})) is None
