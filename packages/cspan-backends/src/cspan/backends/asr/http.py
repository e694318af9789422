"""``HTTPTranscriber``: the plain ``POST /transcribe`` protocol, and the HTTP machinery both remote transcribers share.

Protocol (kept from the original system's ``duetaspan/align/asr.py`` and ``runtime/asr_server.py``): a multipart
POST with the field ``file`` = a 16-bit PCM WAV at the clip's own sample rate, optional form field ``language``;
the answer is JSON ``{"text": ...}`` (``cspan asr-serve`` adds ``words``). Unlike the original, failures raise
:class:`~cspan.backends.errors.TranscriberError` instead of returning empty text.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import numpy as np

from cspan.backends.asr.audio import AudioFormatError, as_mono_float32, check_sample_rate, encode_wav
from cspan.backends.asr.base import MAX_TRANSCRIPT_WORDS, Transcript, Word, clean_asr_text
from cspan.backends.errors import TranscriberError
from cspan.backends.http_client import (
    DEFAULT_MAX_REPLY_BYTES,
    HTTPFailure,
    HTTPPolicy,
    HTTPReply,
    LoopClients,
    off_loop,
    request,
)
from cspan.backends.untrusted import JSONInputError, json_kind, loads, sanitize_text
from cspan.backends.urls import redact_url

log = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8990/transcribe"


class RemoteTranscriber:
    """Shared HTTP plumbing: an ``httpx.AsyncClient`` per event loop, the backends' request policy, error mapping, reply parsing.

    Every request follows :mod:`cspan.backends.http_client`: connection failures retried (at most
    ``max_attempts`` tries, sleeping ``backoff_s * 2**(n-1)`` seconds after the n-th failure), a 429 or 503 with
    ``Retry-After`` waited out and sent again when the wait ends before the deadline (a transcription changes
    nothing on the server; otherwise a request that reached the server is never repeated), ``timeout_s`` as the
    overall deadline of one request (connecting, sending the
    clip, and reading the whole reply: a server trickling its answer fails at the deadline), and the reply body
    bounded to ``max_reply_bytes`` after decompression. The transcript's text is made one line without control
    characters and cut to :data:`~cspan.backends.asr.base.MAX_TRANSCRIPT_CHARS`
    (:func:`~cspan.backends.asr.base.clean_asr_text`).

    Use as ``async with`` or call :meth:`aclose` to release connections. A client passed in is used as is and
    never closed here.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 10.0,
        connect_timeout_s: float = 2.0,
        max_attempts: int = 3,
        backoff_s: float = 0.25,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        headers: Mapping[str, str] | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"transcriber endpoint must be an http(s) URL, got {redact_url(endpoint)!r}")
        self.endpoint = endpoint
        self.policy = HTTPPolicy(
            deadline_s=float(timeout_s),
            connect_timeout_s=float(connect_timeout_s),
            max_attempts=int(max_attempts),
            backoff_s=float(backoff_s),
            max_reply_bytes=int(max_reply_bytes),
        )
        self.timeout_s = self.policy.deadline_s
        self.max_attempts = self.policy.max_attempts
        self.backoff_s = self.policy.backoff_s
        self._headers = dict(headers or {})
        # one client per event loop (a client passed in is used as is): several threads or asyncio.run calls may
        # share this transcriber
        timeout = self.policy.timeout()
        self._clients = LoopClients(lambda: httpx.AsyncClient(timeout=timeout), client=client)

    def _get_client(self) -> httpx.AsyncClient:
        return self._clients.get()

    async def aclose(self) -> None:
        """Close the client this transcriber opened for the running event loop (those of other loops are dropped;
        a client passed in is left open)."""
        await self._clients.aclose()

    async def __aenter__(self) -> RemoteTranscriber:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _error(self, message: str, status: int | None = None) -> TranscriberError:
        where = redact_url(self.endpoint)  # messages and logs: no credential in the URL
        return TranscriberError(f"{where}: {message}", endpoint=where, status=status)

    def _wav_upload(self, pcm: np.ndarray, sample_rate: int) -> tuple[np.ndarray, bytes | None]:
        """Validate the clip and encode it; returns ``(pcm [S], wav bytes)`` or ``(pcm, None)`` for an empty clip."""
        try:
            pcm = as_mono_float32(pcm)
            sample_rate = check_sample_rate(sample_rate)
        except AudioFormatError as exc:
            raise self._error(f"cannot send this clip: {exc}") from exc
        if pcm.size == 0:
            return pcm, None
        return pcm, encode_wav(pcm, sample_rate)

    async def _post(self, *, files: dict[str, Any], data: Mapping[str, Any]) -> HTTPReply:
        """POST multipart ``files`` + ``data`` under the request policy; returns a 2xx reply.

        Raises:
            TranscriberError: no connection after ``max_attempts`` tries, no complete reply within ``timeout_s``, a
                reply over ``max_reply_bytes``, a transport failure (``status`` None), a 429 or 503 whose
                ``Retry-After`` does not fit the deadline, or an HTTP status >= 400 (``status`` set, the server's
                message quoted).
        """
        try:
            reply = await request(
                self._get_client(), "POST", self.endpoint, policy=self.policy, headers=self._headers,
                files=files, data=dict(data), idempotent=True,  # a transcription changes nothing: safe to send again
            )  # fmt: skip
        except HTTPFailure as exc:
            raise self._error(_failure_message(exc), status=exc.status) from None
        if reply.status >= 400:
            raise self._error(f"HTTP {reply.status}: {_server_message(reply)}", status=reply.status)
        return reply

    def _json(self, reply: HTTPReply) -> dict[str, Any]:
        """The reply as a JSON object with a string ``text`` (one-line errors naming what is wrong)."""
        try:
            payload = loads(reply.body)
        except JSONInputError as exc:
            raise self._error(
                f"HTTP {reply.status} with a body that is not JSON ({exc}): {reply.shown(120)!r}", status=reply.status
            ) from None
        if not isinstance(payload, dict):
            raise self._error(
                f"the answer is {json_kind(payload)}, not an object with a field 'text'", status=reply.status
            )
        if not isinstance(payload.get("text"), str):
            what = "has no field 'text'" if "text" not in payload else f"has 'text' as {json_kind(payload['text'])}"
            raise self._error(f"the answer {what}; a transcript needs 'text' as a string", status=reply.status)
        return payload

    def _words(self, items: Any, status: int, *, text_key: str, start_key: str, end_key: str) -> list[Word] | None:
        """Parse a JSON list of word objects (at most :data:`MAX_TRANSCRIPT_WORDS` kept); ``None`` when the server
        sent none."""
        if items is None:
            return None
        if not isinstance(items, list):
            raise self._error(f"'words' is {json_kind(items)}, not a list of word objects", status=status)
        words = []
        for i, w in enumerate(items[:MAX_TRANSCRIPT_WORDS]):
            try:
                text, start, end = w[text_key], w[start_key], w[end_key]
            except (TypeError, KeyError):
                raise self._error(
                    f"words[{i}] is not an object with {text_key!r}, {start_key!r} and {end_key!r}", status=status
                ) from None
            times_ok = all(isinstance(t, int | float) and not isinstance(t, bool) for t in (start, end))
            if not (isinstance(text, str) and times_ok and 0 <= start <= end < math.inf):
                raise self._error(
                    f"words[{i}] needs a string {text_key!r} and times {start_key!r} <= {end_key!r} in seconds "
                    f"(finite, >= 0); got {text_key}={_brief(text)}, {start_key}={_brief(start)}, "
                    f"{end_key}={_brief(end)}",
                    status=status,
                )
            words.append(Word(text=sanitize_text(text, 200), start_s=start, end_s=end))
        return words


class HTTPTranscriber(RemoteTranscriber):
    """Transcribe through a plain ``POST /transcribe`` server such as ``cspan asr-serve``.

    Args:
        url: the endpoint; a bare ``http://host:port`` gets ``/transcribe`` appended.
        language: optional language code sent as the form field ``language`` (``"en"``); ``None`` sends nothing.
        timeout_s, connect_timeout_s, max_attempts, backoff_s, client: see :class:`RemoteTranscriber`.

    ``transcribe(pcm [S] float32, sample_rate Hz)`` returns the server's text (Qwen3-ASR's language prefix
    stripped) and its ``words`` (``text``, ``start_s``, ``end_s``) when it sends them. Raises
    :class:`~cspan.backends.errors.TranscriberError`.
    """

    def __init__(self, url: str = DEFAULT_URL, *, language: str | None = None, **kwargs: Any) -> None:
        parts = urlsplit(url)
        if parts.path in ("", "/"):  # a bare host; a query stays at the end
            url = urlunsplit(parts._replace(path="/transcribe"))
        super().__init__(url, **kwargs)
        self.language = language

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> Transcript:
        """Send ``pcm`` ``[S]`` (float32, ``sample_rate`` Hz) as a 16-bit WAV; return its :class:`Transcript`."""
        pcm, wav = self._wav_upload(pcm, sample_rate)
        if wav is None:
            return Transcript(text="")
        data = {"language": self.language} if self.language else {}
        reply = await self._post(files={"file": ("audio.wav", wav, "audio/wav")}, data=data)
        return await off_loop(len(reply.body), self._transcript, reply)

    def _transcript(self, reply: HTTPReply) -> Transcript:
        payload = self._json(reply)
        words = self._words(payload.get("words"), reply.status, text_key="text", start_key="start_s", end_key="end_s")
        return Transcript(text=clean_asr_text(payload["text"]), words=words)


def _brief(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, str | int | float | bool) or value is None else json_kind(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _failure_message(exc: HTTPFailure) -> str:
    if exc.kind == "connect":
        return f"{exc}; is the ASR server running? Start one with `cspan asr-serve` or fix the URL"
    if exc.kind == "deadline":
        return f"{exc}; check the server, or raise the transcriber's timeout for long clips"
    if exc.kind == "refused":
        return f"{exc}; the server is busy or rate-limiting: lower the load on it, or raise the transcriber's timeout"
    return str(exc)


def _server_message(reply: HTTPReply) -> str:
    """The error text of a failed reply: OpenAI's ``error.message``, FastAPI's ``detail``, or the raw body."""
    try:
        payload = loads(reply.body)
    except JSONInputError:
        return sanitize_text(reply.shown(300), 300) or "(empty body)"
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and err.get("message"):
            return sanitize_text(str(err["message"]), 300)
        if isinstance(err, str) and err:
            return sanitize_text(err, 300)
        if payload.get("detail"):
            return sanitize_text(str(payload["detail"]), 300)
        if payload.get("message"):
            return sanitize_text(str(payload["message"]), 300)
    return sanitize_text(str(payload)[:1000], 300)
