"""The ``cspan serve`` app: the page and HTTP routes, the Host guard, and one WebSocket route per protocol adapter.

Routes: ``GET /`` and ``/static/<name>`` (the page), ``/health``, ``/info``, ``/metrics``, and each adapter's
``path`` (:mod:`cspan.server.adapters`). Every request passes the Host guard first (DNS rebinding,
:func:`cspan.server.auth.host_allowed`). Every WebSocket connection, whatever its protocol, goes through
:func:`serve_connection`: Origin check, credential, accept, a :class:`~cspan.server.session.Session`, the adapter's
receive loop, the sender, the idle watchdog.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from cspan.core.constants import FRAME_SIZE, SAMPLE_RATE
from cspan.server.adapters import Connection, ProtocolAdapter, discover_adapters
from cspan.server.auth import (
    Authenticator,
    ServeConfigError,
    TokenAuthenticator,
    host_allowed,
    offered_subprotocols,
    origin_allowed,
)
from cspan.server.protocol import PROTOCOL_VERSION
from cspan.server.serve_settings import ServeSettings
from cspan.server.session import (
    CLOSE_FORBIDDEN_ORIGIN,
    CLOSE_UNAUTHORIZED,
    ClientError,
    Close,
    Session,
    SessionHub,
)

logger = logging.getLogger(__name__)

STATIC_FILES: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "ogg-opus.js": "text/javascript; charset=utf-8",
    "mic-worklet.js": "text/javascript; charset=utf-8",
    "player-worklet.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
"""The page's files (package data under ``cspan/server/static``), served at ``/`` and ``/static/<name>``."""

_PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self' ws: wss:; "
        "img-src 'self' data: blob:; media-src 'self' blob:; object-src 'none'; base-uri 'none'; "
        "frame-ancestors 'none'"
    ),
}


def _static_bytes(name: str) -> bytes:
    return resources.files("cspan.server").joinpath("static", name).read_bytes()


def build_engine(settings: ServeSettings, checkpoint: Any) -> tuple[Any, Any]:
    """``(checkpoint, engine)``: the checkpoint (loaded from ``settings.checkpoint`` unless given) and a
    ``DuplexEngine`` of batch ``settings.max_sessions``."""
    from cspan.core.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
    from cspan.core.engine import DuplexEngine
    from cspan.server.infer import pick_device

    if checkpoint is None:
        device, dtype = pick_device(settings.device)
        checkpoint = load_checkpoint(settings.checkpoint or DEFAULT_CHECKPOINT, device=device, dtype=dtype)
    engine = DuplexEngine(
        checkpoint,
        batch_size=settings.max_sessions,
        temp=settings.temp,
        temp_text=settings.temp_text,
        cuda_graphs=None if settings.cuda_graphs else False,
        predict_user=False,  # the user's codes come from the microphone every frame
    )
    return checkpoint, engine


def build_backends(settings: ServeSettings, db: Any) -> tuple[Any, Any]:
    """``(transcriber, retriever)`` shared by all sessions (the one place serve builds them, tool bank included)."""
    from cspan.server.infer import build_backends as build

    return build(argparse.Namespace(**settings.model_dump()), profile=None, db=db)


class HostGuard:
    """ASGI middleware: answer only requests whose ``Host`` names this server (:func:`~cspan.server.auth.host_allowed`);
    others get 403 (HTTP) or a refused handshake (WebSocket) before any route runs."""

    def __init__(self, app: Any, settings: ServeSettings, metrics: Any) -> None:
        self.app = app
        self.bind_host = settings.host
        self.allowed = list(settings.allow_host)
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"), None)
            server = scope.get("server") or (None, None)
            if not host_allowed(host, bind_host=self.bind_host, port=server[1], allowed=self.allowed):
                self.metrics.host_refused.inc()
                logger.warning("refused a request for Host %r (see --allow-host)", host)
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008, "reason": "host not allowed"})
                    return
                body = b"host not allowed: this server answers only its own host names (see --allow-host)\n"
                await send(
                    {
                        "type": "http.response.start",
                        "status": 403,
                        "headers": [
                            (b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", b"%d" % len(body)),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


_UNSET: Any = object()


def create_app(
    settings: ServeSettings | None = None,
    *,
    checkpoint: Any = None,
    transcriber: Any = _UNSET,
    retriever: Any = _UNSET,
    db: Any = None,
    authenticator: Authenticator | None = None,
) -> Any:
    """Build the app: the page, ``/health``, ``/info``, ``/metrics`` and every protocol adapter's route.

    Args:
        settings: :class:`~cspan.server.serve_settings.ServeSettings` (default: all defaults).
        checkpoint: an already loaded :class:`~cspan.core.checkpoint.Checkpoint` (default: load
            ``settings.checkpoint`` on the device ``pick_device`` chooses).
        transcriber, retriever: backends to use instead of those built from ``settings`` (None disables one).
        db: a :class:`~cspan.backends.context_db.ContextDB` (default: open ``settings.db``).
        authenticator: turns credentials into principals (default: :class:`~cspan.server.auth.TokenAuthenticator`
            of ``settings.token``).

    Returns:
        The FastAPI app (``app.state.hub`` is the :class:`~cspan.server.session.SessionHub`). The model is loaded
        here; the frame loop starts with the app's lifespan.

    Raises:
        CheckpointError: the checkpoint or default voice cannot be loaded. CspanError: a backend cannot be built
            (:class:`~cspan.server.auth.ServeConfigError` for the Context DB or a backend error).
    """
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from starlette.routing import WebSocketRoute

    from cspan.backends.context_db import ContextDB
    from cspan.backends.errors import BackendError
    from cspan.server.metrics import ServerMetrics

    settings = settings or ServeSettings()
    authenticator = authenticator or TokenAuthenticator(settings.token)
    adapters = discover_adapters()
    try:  # before the model: a bad Context DB or backend fails in seconds, not minutes
        db = db if db is not None else ContextDB(settings.db)
        if transcriber is _UNSET or retriever is _UNSET:
            built_t, built_r = build_backends(settings, db)
            transcriber = built_t if transcriber is _UNSET else transcriber
            retriever = built_r if retriever is _UNSET else retriever
    except BackendError as exc:
        raise ServeConfigError(f"backends (--db, --asr, --router, --knowledge): {exc}") from exc
    checkpoint, engine = build_engine(settings, checkpoint)
    metrics = ServerMetrics(settings.max_sessions, [a.name for a in adapters])
    hub = SessionHub(settings, checkpoint, engine, transcriber, retriever, db, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        hub.start()
        try:
            yield
        finally:
            await hub.shutdown()

    app = FastAPI(title="cspan serve", version=str(PROTOCOL_VERSION), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.hub = hub
    app.state.settings = settings

    def static(name: str) -> Response:
        return Response(_static_bytes(name), media_type=STATIC_FILES[name], headers=_PAGE_HEADERS)

    # Route functions carry no annotations: this module postpones them (PEP 563) and FastAPI would have to
    # resolve names that are imported lazily, above.
    @app.get("/", include_in_schema=False)
    async def index():
        return static("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static_file(name: str):
        if name not in STATIC_FILES:
            return JSONResponse({"detail": "not found"}, status_code=404)
        return static(name)

    @app.get("/health")
    async def health():
        """Liveness and capacity."""
        return {
            "status": "ok" if hub.running else "stopped",
            "model": hub.model_name,
            "sample_rate": SAMPLE_RATE,
            "frame_size": FRAME_SIZE,
            "max_sessions": settings.max_sessions,
            "free_slots": hub.free_slots(),
            "protocol_version": PROTOCOL_VERSION,
        }

    @app.get("/info")
    async def info():
        """What the page needs to build its form."""
        return {
            "protocol_version": PROTOCOL_VERSION,
            "sample_rate": SAMPLE_RATE,
            "frame_size": FRAME_SIZE,
            "max_sessions": settings.max_sessions,
            "voices": hub.voice_names,
            "default_voice": hub.default_voice,
            "text_prompt": settings.text_prompt,
            "max_text_prompt_chars": settings.max_text_prompt_chars,
            "token_required": authenticator.required,
            "asr": hub.transcriber is not None,
            "retrieval": hub.retriever is not None,
            "protocols": {a.name: a.path for a in adapters},
        }

    @app.get("/metrics")
    async def metrics_endpoint():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    for adapter in adapters:

        async def endpoint(websocket: Any, adapter: type[ProtocolAdapter] = adapter) -> None:
            await serve_connection(websocket, adapter, hub, authenticator, settings.allow_origin)

        app.router.routes.append(WebSocketRoute(adapter.path, endpoint))
    app.add_middleware(HostGuard, settings=settings, metrics=metrics)
    return app


async def serve_connection(
    websocket: Any,
    adapter_cls: type[ProtocolAdapter],
    hub: SessionHub,
    authenticator: Authenticator,
    allowed_origins: list[str],
) -> None:
    """One WebSocket connection of any protocol, from the handshake to the end of its session."""
    metrics = hub.metrics
    headers = {k.lower(): v for k, v in websocket.headers.items()}
    connection = Connection(
        path=adapter_cls.path,
        query=dict(websocket.query_params),
        headers=headers,
        subprotocols=tuple(offered_subprotocols(headers.get("sec-websocket-protocol"))),
    )
    credential = adapter_cls.credential(connection)
    if not origin_allowed(headers.get("origin"), headers.get("host"), allowed_origins):
        metrics.auth_failures.labels(adapter_cls.name, "origin").inc()
        await websocket.accept(subprotocol=credential.subprotocol)
        await websocket.close(code=CLOSE_FORBIDDEN_ORIGIN, reason="origin not allowed (see --allow-origin)")
        return
    principal = authenticator.authenticate(credential.token)
    if principal is None:
        metrics.auth_failures.labels(adapter_cls.name, "token").inc()
        reason = "missing token" if credential.token is None else "wrong token"
        await websocket.accept(subprotocol=credential.subprotocol)
        await websocket.close(code=CLOSE_UNAUTHORIZED, reason=f"unauthorized: {reason}")
        return
    await websocket.accept(subprotocol=credential.subprotocol)
    session = hub.open(adapter_cls.name, principal)
    adapter = adapter_cls(session, connection)
    sender = asyncio.ensure_future(_send(websocket, session, adapter, metrics))
    watchdog = asyncio.ensure_future(session.watchdog())
    try:
        await _handle(session, adapter.opened())
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            data = message.get("bytes")
            if data is None:
                data = message.get("text")
            if data is None:
                continue
            metrics.wire_bytes.labels(adapter_cls.name, "in").inc(len(data))
            await _handle(session, adapter.receive(data))
    except Exception as exc:
        logger.debug("session %s: receive ended: %s", session.id, exc)
    finally:
        watchdog.cancel()
        await session.disconnected()
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sender


async def _handle(session: Session, call: Any) -> None:
    """Await one adapter call; a client mistake or an unexpected error is reported and the session goes on."""
    try:
        await call
    except ClientError as exc:
        session.client_error(exc.code, exc.message)
    except Exception as exc:
        logger.exception("session %s: error while handling a message", session.id)
        session.client_error("internal", f"{type(exc).__name__}: {exc}")


async def _send(websocket: Any, session: Session, adapter: ProtocolAdapter, metrics: Any) -> None:
    """Drain the session's outbox through the adapter to the socket until a :class:`Close` or the client is gone."""
    name = adapter.name
    try:
        while True:
            item = await session.outbox.get()
            if isinstance(item, Close):
                with contextlib.suppress(Exception):
                    await websocket.close(code=item.code, reason=item.reason)
                return
            try:
                messages = adapter.render(item)
            except Exception:
                logger.exception("session %s: %s could not render %s", session.id, name, type(item).__name__)
                continue
            for message in messages:
                if isinstance(message, bytes):
                    await websocket.send_bytes(message)
                    metrics.wire_bytes.labels(name, "out").inc(len(message))
                else:
                    await websocket.send_text(message)
                    metrics.wire_bytes.labels(name, "out").inc(len(message.encode("utf-8")))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the client went away mid-send
        logger.debug("session %s: send failed: %s", session.id, exc)
        session.gone = True


__all__ = ["STATIC_FILES", "HostGuard", "build_backends", "build_engine", "create_app", "serve_connection"]
