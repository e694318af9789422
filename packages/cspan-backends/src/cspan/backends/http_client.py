"""How the backends call another server over HTTP (the router LLM, the transcribers): one retry policy, one overall
deadline per request, bounded replies. Each client maps :class:`HTTPFailure` to its own error type.

- **Retry**: when no connection was made (``httpx.ConnectError``, ``httpx.ConnectTimeout``): at most
  ``max_attempts`` tries, sleeping ``backoff_s * 2**(n-1)`` seconds after the n-th failure. A request that reached
  the server is repeated only when the server refused it with 429 (Too Many Requests) or 503 (Service Unavailable)
  and only an idempotent one (RFC 9110 §9.2.2: by its method, or as its caller declares). The wait is the
  server's: ``retry-after-ms`` (milliseconds, as OpenAI's and Azure OpenAI's APIs send it; read first, as OpenAI's
  client does), else ``Retry-After`` (delta-seconds or an HTTP-date, RFC 9110 §10.2.3); it is slept when it ends
  before the deadline (at most ``max_retry_after_waits`` times), else the request fails at once saying what the
  server asked. A refusal that advises no wait is retried after ``backoff_s * 2**n`` (n: the waits so far), within
  the same bounds; when that does not fit, the refusal is returned as any reply is.
- **Deadline**: ``deadline_s`` bounds the whole request (connecting, retries and their waits, sending, the reply's
  headers and its whole body), so a server that trickles its reply a byte at a time holds the caller no longer
  than that. httpx's own per-read timeout is only a backstop.
- **Size**: the reply body is read as a stream and refused as soon as it passes ``max_reply_bytes``, counted after
  decompression: ``gzip`` and ``deflate`` are decoded here in bounded steps (a gzip bomb stops at the limit, it is
  never inflated whole), other content codings are refused (requests ask for ``gzip, deflate`` only).
- **Event loops**: an ``httpx.AsyncClient``'s pooled connections belong to the event loop that opened them;
  :class:`LoopClients` keeps one client per loop, so one backend object serves several ``asyncio.run`` calls and
  threads that each run their own loop.
- **CPU**: :func:`off_loop` runs linear-time work on a large reply (JSON decoding) in a worker thread, so that a
  big reply does not stall the event loop that paces a live conversation's frames.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import Any, Literal, NamedTuple, TypeVar

import httpx

from cspan.backends.untrusted import sanitize_text
from cspan.backends.urls import redact_url

__all__ = [
    "DEFAULT_MAX_REPLY_BYTES",
    "INLINE_BYTES",
    "MAX_RETRY_AFTER_S",
    "HTTPFailure",
    "HTTPPolicy",
    "HTTPReply",
    "LoopClients",
    "NoAnswer",
    "advised_wait_s",
    "backend_answers",
    "network_cause",
    "off_loop",
    "request",
    "retry_after_s",
    "unanswered",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_REPLY_BYTES = 1 << 20
"""Largest reply body read from a backend by default, in bytes after decompression (1 MiB: a chat completion or a
transcript with word timings is a few KB)."""
INLINE_BYTES = 16 * 1024
""":func:`off_loop` runs work on inputs up to this size on the event loop, larger ones in a worker thread."""
MAX_RETRY_AFTER_S = 86_400.0
"""The longest ``Retry-After`` read as given, in seconds (a day); a longer one, or a date further ahead, reads as
this (a request is never held that long: the wait must end before its deadline)."""

FailureKind = Literal["connect", "deadline", "too_large", "transport", "refused"]
_REFUSALS = {429: "Too Many Requests", 503: "Service Unavailable"}
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})  # RFC 9110 §9.2.2
T = TypeVar("T")


@dataclass(frozen=True)
class HTTPPolicy:
    """Limits of one request to a backend.

    Attributes:
        deadline_s: the whole request, retries and reading the body included (s).
        connect_timeout_s: one connection attempt (s).
        max_attempts: connection attempts in all.
        backoff_s: wait after the first failed connection attempt (s); doubled after each further one.
        max_retry_after_waits: times a 429 or 503 is waited out (its ``Retry-After``, or the backoff when it
            advises none) and an idempotent request sent again; 0 never waits.
        max_reply_bytes: the largest reply body read, in bytes after decompression.
    """

    deadline_s: float = 10.0
    connect_timeout_s: float = 2.0
    max_attempts: int = 3
    backoff_s: float = 0.25
    max_retry_after_waits: int = 2
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES

    def __post_init__(self) -> None:
        for name in ("deadline_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        if not (math.isfinite(self.backoff_s) and self.backoff_s >= 0):
            raise ValueError(f"backoff_s must be a finite number of seconds >= 0, got {self.backoff_s!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_retry_after_waits < 0:
            raise ValueError(f"max_retry_after_waits must be >= 0, got {self.max_retry_after_waits}")
        if self.max_reply_bytes < 1024:
            raise ValueError(f"max_reply_bytes must be at least 1024, got {self.max_reply_bytes}")

    def timeout(self) -> httpx.Timeout:
        """The httpx timeout of a client used under this policy (a backstop: the deadline governs)."""
        return httpx.Timeout(self.deadline_s + 1.0, connect=self.connect_timeout_s)


@dataclass(frozen=True)
class HTTPReply:
    """A complete reply: ``status``, ``body`` (decompressed, at most ``max_reply_bytes``) and ``headers``."""

    status: int
    body: bytes
    headers: httpx.Headers

    def shown(self, limit: int = 200) -> str:
        """The start of the body as text, for error messages (at most ``limit`` characters)."""
        return self.body[: limit * 4].decode("utf-8", "replace")[:limit]


class HTTPFailure(Exception):
    """A request that produced no usable reply; ``str()`` is one line saying why.

    Attributes:
        kind: ``"connect"`` (no connection after every attempt), ``"deadline"`` (no complete reply within
            ``deadline_s``), ``"too_large"`` (the body passed ``max_reply_bytes``), ``"transport"`` (the
            connection failed after it was made, or a body that cannot be decoded), ``"refused"`` (a 429 or 503
            whose ``Retry-After`` is not waited out: past the deadline, the waits used up, or a request that is
            not idempotent; the message says after how long the server asked to be asked again).
        attempts: requests sent, connection attempts included.
        status: the HTTP status of a ``"refused"`` failure, else None.
    """

    def __init__(self, kind: FailureKind, message: str, *, attempts: int = 1, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.attempts = attempts
        self.status = status


def advised_wait_s(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """The wait a refusal's headers ask for, in seconds: ``retry-after-ms`` (a non-negative number of
    milliseconds: OpenAI's and Azure OpenAI's APIs; read first, as OpenAI's Python client does), else
    ``Retry-After`` (:func:`retry_after_s`); None when neither is there or readable. ``headers`` is
    case-insensitive (httpx's)."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            value = float(ms)
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value >= 0:
            return min(value / 1000.0, MAX_RETRY_AFTER_S)
    return retry_after_s(headers.get("retry-after"), now)


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """The wait a ``Retry-After`` header asks for, in seconds (RFC 9110 §10.2.3).

    Args:
        value: the header: delta-seconds (``"120"``) or an HTTP-date (``"Fri, 31 Dec 1999 23:59:59 GMT"``; the
            obsolete RFC 850 and asctime forms too, a date without zone read as GMT).
        now: the current time as a Unix timestamp (default ``time.time()``), for a date.

    Returns:
        The wait: 0 for a date already past, at most :data:`MAX_RETRY_AFTER_S`; None when ``value`` is None or
        neither form (a negative or fractional number included), so that the header is ignored.
    """
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        # a long digit string is absurd, not an error (and int() refuses more than 4300 digits)
        return min(float(value), MAX_RETRY_AFTER_S) if len(value) <= 12 else MAX_RETRY_AFTER_S
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # asctime, or "-0000": GMT as HTTP-dates are
        when = when.replace(tzinfo=UTC)
    seconds = when.timestamp() - (time.time() if now is None else now)
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


class _TooLarge(Exception):
    pass


class _BoundedDecoder:
    """Content decoding of a reply body with a cap on the decoded size (identity, gzip or deflate)."""

    def __init__(self, coding: str, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.coding = coding
        self._z: Any = None
        if coding in ("gzip", "x-gzip"):
            self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif coding == "deflate":
            self._z = zlib.decompressobj(zlib.MAX_WBITS)
        elif coding not in ("", "identity"):
            raise HTTPFailure("transport", f"the reply's content coding {coding!r} is not supported (gzip, deflate)")
        self._first = True

    def _count(self, data: bytes) -> bytes:
        self.size += len(data)
        if self.size > self.limit:
            raise _TooLarge()
        return data

    def feed(self, data: bytes) -> bytes:
        if self._z is None:
            return self._count(data)
        out = []
        try:
            while data:
                try:
                    chunk = self._z.decompress(data, self.limit - self.size + 1)
                except zlib.error:
                    if not (self._first and self.coding == "deflate"):
                        raise
                    self._z = zlib.decompressobj(-zlib.MAX_WBITS)  # raw deflate, as some servers send it
                    chunk = self._z.decompress(data, self.limit - self.size + 1)
                self._first = False
                out.append(self._count(chunk))
                data = self._z.unconsumed_tail
        except zlib.error as exc:
            raise HTTPFailure("transport", f"the reply's {self.coding} body is damaged ({exc})") from None
        return b"".join(out)

    def flush(self) -> bytes:
        if self._z is None:
            return b""
        try:
            return self._count(self._z.flush())
        except zlib.error as exc:
            raise HTTPFailure("transport", f"the reply's {self.coding} body is damaged ({exc})") from None


async def request(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    policy: HTTPPolicy,
    headers: dict[str, str] | None = None,
    idempotent: bool | None = None,
    deadline_at: float | None = None,
    **kwargs: Any,
) -> HTTPReply:
    """Send one request under ``policy`` and read the whole (bounded) reply.

    Args:
        client: the HTTP client (its connection pool is reused).
        method, url: what to request.
        policy: retry, deadline and size limits.
        headers: extra request headers (``Accept-Encoding`` is set here).
        idempotent: whether the request may be sent again after a 429 or 503; None decides by
            the method (GET, HEAD, OPTIONS, TRACE, PUT, DELETE are). Declare True only for a request that changes
            nothing on the server whatever its method (a chat completion, a transcription).
        deadline_at: the event loop's time (``loop.time()``) at which the caller's own deadline ends, when it has
            one around this request: a ``Retry-After`` wait must end before it too.
        **kwargs: the body, as ``httpx.AsyncClient.stream`` takes it (``json=``, ``files=``, ``data=``).

    Returns:
        The :class:`HTTPReply`, whatever its status (the caller judges 4xx/5xx), but a 429 or 503, which is
        waited out when it may be; one with an advised wait that is not is raised.

    Raises:
        HTTPFailure: see its ``kind``.
    """
    sent = {**(headers or {}), "Accept-Encoding": "gzip, deflate"}
    if idempotent is None:
        idempotent = method.upper() in _IDEMPOTENT
    loop = asyncio.get_running_loop()
    end = min(loop.time() + policy.deadline_s, math.inf if deadline_at is None else deadline_at)
    attempts = failed = waits = 0  # requests sent, connection failures, Retry-After waits
    try:
        async with asyncio.timeout(policy.deadline_s):
            while True:
                attempts += 1
                try:
                    reply = await _exchange(client, method, url, policy, sent, kwargs)
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    failed += 1
                    if failed >= policy.max_attempts:
                        raise HTTPFailure(
                            "connect",
                            f"could not connect after {failed} attempt(s) ({type(exc).__name__}: {exc})",
                            attempts=attempts,
                        ) from None
                    delay = policy.backoff_s * 2 ** (failed - 1)
                    log.warning(
                        "%s: connection failed (%s), attempt %d/%d; retrying in %.2f s",
                        redact_url(url),
                        exc,
                        failed,
                        policy.max_attempts,
                        delay,
                    )
                    await asyncio.sleep(delay)
                    continue
                if reply.status not in _REFUSALS:
                    return reply
                wait = advised_wait_s(reply.headers)
                left = end - loop.time()
                if wait is None:  # nothing advised: back off as after a failed connection, if that fits
                    delay = policy.backoff_s * 2**waits
                    if not idempotent or waits >= policy.max_retry_after_waits or delay >= left:
                        return reply
                    waits += 1
                    log.warning(
                        "%s: HTTP %d with no Retry-After; retrying in %.2f s (%d/%d)",
                        redact_url(url),
                        reply.status,
                        delay,
                        waits,
                        policy.max_retry_after_waits,
                    )
                    await asyncio.sleep(delay)
                    continue
                if not idempotent:
                    why = f"not sent again: a {method.upper()} may not be safe to repeat"
                elif waits >= policy.max_retry_after_waits:
                    why = f"refused again after {waits} wait(s); not sent again"
                elif wait >= left:
                    why = f"longer than the {max(left, 0.0):.1f} s left before the deadline; not waited"
                else:
                    waits += 1
                    log.warning(
                        "%s: HTTP %d, the server asked to retry after %g s; waiting (%d/%d)",
                        redact_url(url),
                        reply.status,
                        wait,
                        waits,
                        policy.max_retry_after_waits,
                    )
                    await asyncio.sleep(wait)
                    continue
                said = sanitize_text(reply.shown(), 160) or "(empty body)"
                raise HTTPFailure(
                    "refused",
                    f"HTTP {reply.status} ({_REFUSALS[reply.status]}): the server asked to retry after {wait:g} s, "
                    f"{why} (it said: {said})",
                    attempts=attempts,
                    status=reply.status,
                )
    except TimeoutError:
        raise HTTPFailure(
            "deadline",
            f"no complete reply within {policy.deadline_s:g} s (the server is slow, overloaded, or sends its reply "
            "too slowly)",
            attempts=attempts,
        ) from None
    except httpx.TimeoutException as exc:  # httpx's backstop fired before the deadline
        raise HTTPFailure(
            "deadline", f"no complete reply within {policy.deadline_s:g} s ({type(exc).__name__})", attempts=attempts
        ) from None
    except httpx.HTTPError as exc:
        raise HTTPFailure(
            "transport", f"the request failed after connecting ({type(exc).__name__}: {exc})", attempts=attempts
        ) from None
    except _TooLarge:
        raise HTTPFailure(
            "too_large",
            f"the reply is over the limit of {policy.max_reply_bytes} bytes; refused without reading the rest",
            attempts=attempts,
        ) from None


async def _exchange(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    policy: HTTPPolicy,
    headers: dict[str, str],
    kwargs: dict[str, Any],
) -> HTTPReply:
    async with client.stream(method, url, headers=headers, timeout=policy.timeout(), **kwargs) as resp:
        declared = resp.headers.get("content-length", "").strip()
        if declared.isdigit() and int(declared) > policy.max_reply_bytes:
            raise _TooLarge()
        codings = [c.strip().lower() for c in resp.headers.get("content-encoding", "").split(",") if c.strip()]
        codings = [c for c in codings if c != "identity"]
        if len(codings) > 1:
            raise HTTPFailure("transport", f"the reply's content codings {codings} are not supported (one at most)")
        if resp.is_stream_consumed:  # a reply made in memory (httpx.MockTransport), already decoded by httpx
            return HTTPReply(
                status=resp.status_code,
                body=_BoundedDecoder("", policy.max_reply_bytes).feed(resp.content),
                headers=resp.headers,
            )
        decoder = _BoundedDecoder(codings[0] if codings else "", policy.max_reply_bytes)
        chunks = [decoder.feed(raw) async for raw in resp.aiter_raw()]
        chunks.append(decoder.flush())
        return HTTPReply(status=resp.status_code, body=b"".join(chunks), headers=resp.headers)


class LoopClients:
    """The ``httpx.AsyncClient`` of each event loop that uses a backend (the router LLM, a transcriber).

    An ``httpx.AsyncClient``'s pooled connections belong to the loop that opened them: a client kept across loops
    (a second ``asyncio.run``, a thread running its own loop) reuses a dead loop's sockets ("Event loop is closed"),
    and one client swapped as threads take turns leaves the replaced client's connections open and can hand one
    thread another loop's client. So each loop gets its own, made on first use; the table is safe to use from
    several threads, and the clients of closed loops are let go (their sockets close when they are collected).

    Args:
        make: makes a new client; called on the loop that will use it.
        client: a caller's client: returned on every loop as is, never closed here.
    """

    def __init__(self, make: Callable[[], httpx.AsyncClient], *, client: httpx.AsyncClient | None = None) -> None:
        self._make = make
        self.client = client
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def get(self) -> httpx.AsyncClient:
        """The client for the running event loop: the caller's, else this loop's own (made now if it has none).

        Raises:
            RuntimeError: no event loop is running (call it from a coroutine).
        """
        if self.client is not None:
            return self.client
        loop = asyncio.get_running_loop()
        with self._lock:
            for dead in [other for other in self._clients if other.is_closed()]:
                del self._clients[dead]  # a client holds its loop: the weak key alone would never let it go
            client = self._clients.get(loop)
            if client is None or client.is_closed:
                client = self._clients[loop] = self._make()
        return client

    def __len__(self) -> int:
        """How many loops have a client of their own."""
        with self._lock:
            return len(self._clients)

    async def aclose(self) -> None:
        """Close the running loop's own client and let those of other loops go (a client cannot be closed from
        another loop; their sockets close when they are collected). A caller's client is left open."""
        with self._lock:
            mine = self._clients.pop(asyncio.get_running_loop(), None)
            self._clients.clear()
        if mine is not None:
            await mine.aclose()


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: on the event loop when ``size`` <= :data:`INLINE_BYTES`, else in a worker thread (for
    linear-time work on a reply, such as JSON decoding, whose cost grows with ``size``)."""
    if size <= INLINE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def backend_answers(urls: list[str], timeout_s: float) -> list[BaseException | None]:
    """Whether an HTTP server answers at each of ``urls``, all asked at once: ``None`` when a status line and
    headers arrive within ``timeout_s`` (any status counts; the body is never read, so a server that trickles or
    floods its body cannot hold the check), else the exception (``TimeoutError`` at the deadline)."""
    import httpx

    async def one(client: httpx.AsyncClient, url: str) -> BaseException | None:
        try:
            async with asyncio.timeout(timeout_s), client.stream("GET", url):
                return None
        except Exception as exc:
            return exc

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), follow_redirects=False) as client:
        return list(await asyncio.gather(*(one(client, url) for url in urls)))


def network_cause(exc: BaseException) -> str:
    """The root cause of a failed request in words ("connection refused", "name or service not known"): the first
    ``OSError`` with an errno along the exception's chain, else the exception's own text."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return os.strerror(seen.errno).lower() if seen.errno > 0 else str(seen.strerror or seen).lower()
        seen = seen.__cause__ or seen.__context__
    return str(exc) or type(exc).__name__


class NoAnswer(NamedTuple):
    """Why nothing answered at a backend URL: ``why`` in words, ``timed_out`` when it was the deadline."""

    why: str
    timed_out: bool


async def unanswered(urls: Mapping[str, str], timeout_s: float) -> dict[str, NoAnswer]:
    """Of ``urls`` (``{flag: url}``; an ``openai+`` prefix is dropped), those where nothing answers HTTP within
    ``timeout_s`` (:func:`backend_answers`), by flag. The one start-up check of a backend URL (``cspan infer``,
    ``serve`` and the bench runners phrase what to do)."""
    answers = await backend_answers([url.removeprefix("openai+") for url in urls.values()], timeout_s)
    found = {}
    for flag, answer in zip(urls, answers, strict=True):
        if isinstance(answer, TimeoutError | httpx.TimeoutException):
            found[flag] = NoAnswer(f"no answer within {timeout_s:g} s", True)
        elif answer is not None:
            found[flag] = NoAnswer(network_cause(answer), False)
    return found
