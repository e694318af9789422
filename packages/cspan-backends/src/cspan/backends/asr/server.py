"""The ASR server behind ``cspan asr-serve``: FastAPI on uvicorn.

Endpoints:

- ``POST /transcribe``: multipart field ``file`` (any rate, WAV/FLAC/OGG, mono or stereo; a raw ``audio/*`` body
  works too), optional ``language`` -> ``{"text", "words": [{"text", "start_s", "end_s"}] | null, "duration_s"}``.
- ``POST /v1/audio/transcriptions``: the OpenAI audio API subset that matters here: multipart ``file``, ``model``
  (accepted, any value), ``language``, ``response_format`` = ``json`` | ``text`` | ``verbose_json``,
  ``timestamp_granularities[]`` = ``word`` / ``segment`` (with ``verbose_json``).
- ``GET /health`` -> ``{"ok": true, "engine", "model", ...}``.

Errors are JSON in the OpenAI shape ``{"error": {"message", "type", "code"}}``: 400 undecodable or malformed
upload (a header sample rate outside 1 kHz..768 kHz, NaN samples), 413 too long (``--max-seconds``) or too big
(``--max-upload-mb``), 415 unsupported content type, 421/403 a Host or Origin that is not this server's
(DNS-rebinding protection on a loopback bind), 503 with ``Retry-After`` when the queue is full, 500 when the
engine fails. Request headers must be complete within ``header_timeout_s`` (slowloris). A bad upload
never stops the server, and a client that abandons its upload costs one log line, no traceback.

Concurrency: at most ``max_concurrency`` clips are recognised at once, each in a worker thread (the event loop
stays free to accept and decode uploads); up to ``max_queue`` more wait; beyond that requests get 503 at once.
Unlike the original system's single-threaded ``HTTPServer``, one slow clip does not block health checks.
"""

# No `from __future__ import annotations`: FastAPI resolves endpoint annotations (Request) at runtime.

import asyncio
import hmac
import json
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from cspan.backends.asr.audio import AudioFormatError, AudioTooLongError, decode_audio
from cspan.backends.asr.base import Transcript
from cspan.backends.asr.engines import Engine, EngineInputError
from cspan.backends.errors import BackendError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""The ``Retry-After`` of a 503 (queue full), in seconds."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class ASRServerSettings:
    """Limits of the ASR server.

    Attributes:
        max_seconds: longest accepted clip, seconds (413 beyond).
        max_upload_bytes: largest accepted request body, bytes (413 beyond).
        max_concurrency: clips recognised at the same time (worker threads).
        max_queue: requests allowed to wait for a worker; more get 503 with ``Retry-After``.
        header_timeout_s: a connection whose request headers are not complete within this time is closed
            (:func:`~cspan.backends.http_server.header_timeout_protocol`).
    """

    max_seconds: float = 120.0
    max_upload_bytes: int = 50 * 1024 * 1024
    max_concurrency: int = 2
    max_queue: int = 32
    header_timeout_s: float = 10.0
    token: str | None = None
    """When set, every request but ``GET /health`` needs ``Authorization: Bearer <token>`` (401 otherwise)."""
    bind_host: str = "127.0.0.1"
    """The address the server binds: on a loopback one, only loopback Host names are answered
    (:class:`~cspan.backends.hostguard.HostGuard`)."""
    allowed_hosts: tuple[str, ...] = ()
    """More Host names to answer (``NAME``, ``NAME:PORT`` or ``*``)."""

    def __post_init__(self) -> None:
        limits = (self.max_seconds, self.max_upload_bytes, self.max_concurrency, self.max_queue, self.header_timeout_s)
        if not all(math.isfinite(v) for v in limits):
            raise ValueError(f"invalid ASR server limits (not finite): {limits}")
        if (
            self.max_seconds <= 0
            or self.max_upload_bytes <= 0
            or self.max_concurrency < 1
            or self.max_queue < 0
            or self.header_timeout_s <= 0
        ):
            raise ValueError(f"invalid ASR server limits: {self}")
        from cspan.backends.hostguard import HostGuard

        HostGuard(lambda *a: None, bind_host=self.bind_host, allowed_hosts=self.allowed_hosts)  # raises if malformed


class ApiError(Exception):
    """An error answered to the client as ``{"error": {"message", "type", "code"}}`` with ``status``."""

    def __init__(self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers

    def payload(self) -> dict[str, Any]:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "code": self.code}}


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    """The client closed the connection before its upload was complete."""


class BodyLimitMiddleware:
    """Pure ASGI middleware: refuse request bodies over ``limit`` bytes.

    A declared ``Content-Length`` over the limit is answered 413 before anything is read; a body that grows past
    the limit while streaming raises inside ``receive`` and the endpoint turns that into 413.
    """

    def __init__(self, app: Callable[..., Awaitable[None]], limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope.get("headers", []):
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.limit:
                    err = ApiError(413, "upload_too_large", _too_large_message(declared, self.limit))
                    await _send_json(send, err.status, err.payload())
                    return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge()
            return message

        await self.app(scope, limited_receive, send)


def _too_large_message(size: int | None, limit: int) -> str:
    what = "the upload" if size is None else f"the upload of {size} bytes"
    return (
        f"{what} exceeds this server's limit of {limit} bytes; send a shorter or compressed clip "
        "(FLAC/OGG), or raise --max-upload-mb"
    )


async def _send_json(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _Gate:
    """Admission control: ``concurrency`` running, ``queue`` waiting, the rest refused (503)."""

    def __init__(self, concurrency: int, queue: int) -> None:
        self.concurrency = concurrency
        self.queue = queue
        self.running = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(concurrency)

    async def run(self, executor: ThreadPoolExecutor, fn: Callable[[], Transcript]) -> Transcript:
        if self.running + self.waiting >= self.concurrency + self.queue:
            raise ApiError(
                503,
                "server_busy",
                f"{self.running} clips are being transcribed and {self.waiting} are waiting (the limit); retry "
                f"after {RETRY_AFTER_S} s",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(executor, fn)

        def _release(_: object) -> None:
            # Released when the thread is done, even if the client went away: the bound holds on real work.
            self.running -= 1
            self._sem.release()

        future.add_done_callback(_release)
        return await asyncio.shield(future)


def create_app(engine: Engine, settings: ASRServerSettings | None = None) -> Any:
    """Build the FastAPI application serving ``engine`` (see the module docstring for the endpoints).

    Requires the ``server`` extra (fastapi, python-multipart). Returns the ASGI app (``fastapi.FastAPI``), wrapped
    in :class:`BodyLimitMiddleware` and :class:`~cspan.backends.hostguard.HostGuard` (DNS-rebinding protection).
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from starlette.datastructures import UploadFile
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect

    from cspan.backends import __version__
    from cspan.backends.hostguard import HostGuard

    settings = settings or ASRServerSettings()
    executor = ThreadPoolExecutor(max_workers=settings.max_concurrency, thread_name_prefix="asr-engine")
    gate = _Gate(settings.max_concurrency, settings.max_queue)

    @asynccontextmanager
    async def lifespan(app: Any):
        log.info(
            "ASR server ready: engine %s, model %s, %d workers, clips up to %g s",
            engine.name,
            engine.model,
            settings.max_concurrency,
            settings.max_seconds,
        )
        yield
        executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="cspan asr-serve", version=__version__, lifespan=lifespan)

    if settings.token:
        expected = settings.token.encode()

        @app.middleware("http")
        async def _require_token(request: Request, call_next: Any) -> Any:
            if request.url.path != "/health":
                scheme, _, given = request.headers.get("authorization", "").partition(" ")
                ok = hmac.compare_digest(given.strip().encode(), expected)  # constant time on the token
                if not (ok and scheme.lower() == "bearer"):
                    err = ApiError(401, "unauthorized", "missing or wrong bearer token (Authorization: Bearer ...)")
                    return JSONResponse(err.payload(), status_code=401)
            return await call_next(request)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.payload(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(_ClientGone)
    async def _client_gone(request: Request, exc: _ClientGone) -> Response:
        # Nobody is listening any more: log one line, answer nothing useful (the server never sends it).
        log.info("%s %s: the client went away during the upload", request.method, request.url.path)
        return Response(status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ApiError(exc.status_code, "http_error", f"{request.method} {request.url.path}: {exc.detail}")
        return JSONResponse(err.payload(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def read_upload(request: Request, *, allow_raw: bool) -> tuple[bytes, dict[str, list[str]]]:
        """The uploaded file's bytes and the other form fields (``name -> values``)."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        limit = settings.max_upload_bytes
        try:
            if ctype == "multipart/form-data":
                try:
                    form = await request.form(max_files=1, max_fields=32)
                except (_BodyTooLarge, ClientDisconnect):
                    raise
                except Exception as exc:  # starlette's MultiPartException, malformed boundaries, ...
                    raise ApiError(400, "malformed_multipart", f"could not parse the multipart body: {exc}") from exc
                try:
                    upload = form.get("file")
                    if not isinstance(upload, UploadFile):
                        raise ApiError(
                            400,
                            "missing_file",
                            "multipart field 'file' is missing: send the audio as the form field 'file'",
                        )
                    data = await upload.read()
                    fields: dict[str, list[str]] = {}
                    for key, value in form.multi_items():
                        if isinstance(value, str):
                            fields.setdefault(key, []).append(value)
                finally:
                    await form.close()
            elif allow_raw and (ctype.startswith("audio/") or ctype == "application/octet-stream"):
                data = await request.body()
                fields = {k: request.query_params.getlist(k) for k in request.query_params}
            else:
                expected = "multipart/form-data" + (" or an audio/* body" if allow_raw else "")
                raise ApiError(415, "unsupported_media_type", f"content type {ctype or 'none'!r}: send {expected}")
        except _BodyTooLarge as exc:
            raise ApiError(413, "upload_too_large", _too_large_message(None, limit)) from exc
        except ClientDisconnect as exc:
            raise _ClientGone() from exc
        if len(data) > limit:
            raise ApiError(413, "upload_too_large", _too_large_message(len(data), limit))
        return data, fields

    async def recognise(data: bytes, language: str | None) -> tuple[Transcript, float]:
        try:
            pcm, sample_rate = await asyncio.to_thread(
                decode_audio, data, max_seconds=settings.max_seconds, name="the upload"
            )
        except AudioTooLongError as exc:
            raise ApiError(413, "audio_too_long", str(exc)) from exc
        except AudioFormatError as exc:
            raise ApiError(400, "invalid_audio", str(exc)) from exc
        duration_s = pcm.size / sample_rate
        started = time.perf_counter()
        try:
            transcript = await gate.run(executor, lambda: _engine_call(engine, pcm, sample_rate, language))
        except ApiError:  # the queue is full (503): the client's answer, not an engine failure
            raise
        except EngineInputError as exc:
            raise ApiError(400, "unsupported_request", str(exc)) from exc
        except (BackendError, RuntimeError) as exc:
            log.exception("engine %s failed on a %.2f s clip", engine.name, duration_s)
            raise ApiError(500, "engine_error", f"the {engine.name} engine failed: {exc}") from exc
        except Exception as exc:  # a bug, not the client's fault: JSON 500 with the cause, full traceback in the log
            log.exception("engine %s failed unexpectedly on a %.2f s clip", engine.name, duration_s)
            raise ApiError(
                500, "engine_error", f"the {engine.name} engine failed: {type(exc).__name__}: {exc}"
            ) from exc
        log.info("transcribed %.2f s in %.2f s: %r", duration_s, time.perf_counter() - started, transcript.text[:80])
        return transcript, duration_s

    def first(fields: dict[str, list[str]], name: str) -> str | None:
        values = [v for v in fields.get(name, []) if v.strip()]
        return values[0].strip() if values else None

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "ok": True,
            "engine": engine.name,
            "model": engine.model,
            "language": engine.language,
            "max_seconds": settings.max_seconds,
            "max_concurrency": settings.max_concurrency,
            "running": gate.running,
            "queued": gate.waiting,
        }

    @app.post("/transcribe")
    async def transcribe(request: Request) -> dict[str, Any]:
        data, fields = await read_upload(request, allow_raw=True)
        transcript, duration_s = await recognise(data, first(fields, "language"))
        words = None if transcript.words is None else [w.model_dump() for w in transcript.words]
        return {"text": transcript.text, "words": words, "duration_s": duration_s}

    @app.post("/v1/audio/transcriptions")
    async def openai_transcriptions(request: Request) -> Response:
        data, fields = await read_upload(request, allow_raw=False)
        response_format = first(fields, "response_format") or "json"
        if response_format not in ("json", "text", "verbose_json"):
            raise ApiError(
                400,
                "unsupported_response_format",
                f"response_format {response_format!r} is not supported here; use json, text or verbose_json",
            )
        granularities = set(fields.get("timestamp_granularities[]", []) + fields.get("timestamp_granularities", []))
        unknown = granularities - {"word", "segment"}
        if unknown:
            raise ApiError(
                400, "invalid_granularity", f"timestamp_granularities {sorted(unknown)}: use word or segment"
            )
        language = first(fields, "language")
        transcript, duration_s = await recognise(data, language)
        if response_format == "text":
            return PlainTextResponse(transcript.text)
        if response_format == "json":
            return JSONResponse({"text": transcript.text})
        body: dict[str, Any] = {
            "task": "transcribe",
            "language": language or engine.language or "unknown",
            "duration": duration_s,
            "text": transcript.text,
        }
        if "word" in granularities:
            body["words"] = [{"word": w.text, "start": w.start_s, "end": w.end_s} for w in (transcript.words or [])]
        if "segment" in granularities or not granularities:
            body["segments"] = [{"id": 0, "start": 0.0, "end": duration_s, "text": transcript.text}]
        return JSONResponse(body)

    return HostGuard(
        BodyLimitMiddleware(app, settings.max_upload_bytes),
        bind_host=settings.bind_host,
        allowed_hosts=settings.allowed_hosts,
    )


def _engine_call(engine: Engine, pcm: np.ndarray, sample_rate: int, language: str | None) -> Transcript:
    return engine.transcribe(pcm, sample_rate, language=language)


def serve(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 8990,
    settings: ASRServerSettings | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Run the server in the foreground with uvicorn until interrupted (blocking). ``sock``: the socket of
    :func:`~cspan.backends.http_server.bind_socket` for ``host``:``port`` (bound here when None).

    Raises:
        ListenError: ``host``:``port`` cannot be bound (a busy port, a host name that does not resolve).
    """
    import uvicorn

    from cspan.backends.http_server import bind_socket

    sock = sock or bind_socket(host, port)
    uvicorn.Server(uvicorn_config(engine, host=host, port=port, settings=settings)).run(sockets=[sock])


def uvicorn_config(
    engine: Engine, *, host: str = "127.0.0.1", port: int = 8990, settings: ASRServerSettings | None = None
) -> Any:
    """The ``uvicorn.Config`` of :func:`serve`: the app of :func:`create_app`, the header timeout
    (``settings.header_timeout_s``), idle keep-alive connections closed after 5 s."""
    import uvicorn

    from cspan.backends.http_server import uvicorn_http

    settings = settings or ASRServerSettings()
    return uvicorn.Config(
        create_app(engine, settings),
        host=host,
        port=port,
        http=uvicorn_http(settings.header_timeout_s),
        timeout_keep_alive=5,
        log_level="info",
        access_log=False,
        lifespan="on",
    )
