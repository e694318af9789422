"""The ``cspan serve`` app: the page and HTTP routes, the Host guard, and one WebSocket route per protocol adapter.

Routes: ``GET /`` and ``/static/<name>`` (the page), ``/health``, ``/info``, ``/metrics``, and each adapter's
``path`` (:mod:`cspan.server.adapters`). Every request passes the Host guard first (DNS rebinding,
:func:`cspan.server.auth.host_allowed`). Every WebSocket connection, whatever its protocol, goes through
:func:`serve_connection`: Origin check, credential, accept, a :class:`~cspan.server.session.Session`, the adapter's
receive loop, the sender, the idle watchdog.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from cspan.core.constants import FRAME_SIZE, SAMPLE_RATE
from cspan.core.voice import VOICE_MAX_SECONDS, VOICE_MIN_SECONDS
from cspan.server import throttle
from cspan.server.adapters import Connection, Credential, ProtocolAdapter, discover_adapters
from cspan.server.auth import (
    Authenticator,
    CredentialAuthenticator,
    ServeConfigError,
    bearer_token,
    check_bind,
    host_allowed,
    is_exposed,
    offered_subprotocols,
    origin_allowed,
)
from cspan.server.protocol import PROTOCOL_VERSION
from cspan.server.serve_settings import ServeSettings
from cspan.server.session import (
    CLOSE_FORBIDDEN_ORIGIN,
    CLOSE_POLICY,
    CLOSE_TRY_AGAIN_LATER,
    CLOSE_UNAUTHORIZED,
    ClientError,
    Close,
    Session,
    SessionHub,
)
from cspan.server.shared_backends import Backends, build_backends, build_transcriber
from cspan.server.throttle import ClientBudget
from cspan.server.voices import VOICE_AUDIO_MAX_BYTES
from cspan.server.ws_protocol import KEEPALIVE_TIMEOUT

logger = logging.getLogger(__name__)

CREDENTIAL_RECHECK_S = 5.0
"""How often a running session's credential and its user's erase generation are checked again: a revoked token, or
its user forgotten (``cspan db forget``), ends its sessions within this."""
CONFLICTING_CREDENTIALS = "conflicting credentials (two different tokens); give one"
"""Why a request or a handshake with two different tokens is refused (HTTP 401, WebSocket close 4401)."""
METRICS_OPEN_S = 60.0
"""On a loopback server with no credentials configured, ``/metrics`` asks the Context DB whether a token was issued
since (then it needs an admin token). While the database does not answer, its last answer "none issued" stands for
this long (s): the metrics that show the stall (``cspan_db_*``) stay readable by the local user during a short one,
and a token issued just before a stall gates them again at most this much later (loopback only: an exposed server
always requires a credential, and a token once seen issued is required for good)."""
CREDENTIALS_UNCHECKED = "credentials cannot be checked now; try again"
"""Why a request or a handshake is refused while the Context DB holding the issued tokens fails or does not answer
within ``--db-wait-s`` (HTTP 503, WebSocket close 1013)."""

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
    from cspan.core.devices import pick_device
    from cspan.core.engine import DuplexEngine
    from cspan.core.runtime import use_cpu_threads

    if checkpoint is None:
        device, dtype = pick_device(settings.device)
        checkpoint = load_checkpoint(
            settings.checkpoint or DEFAULT_CHECKPOINT,
            base=settings.base,
            device=device,
            dtype=dtype,
            fuse_lora=settings.fuse_lora,
        )
    if checkpoint.lm.device.type == "cpu":
        use_cpu_threads()  # before the engine thread's first operation: it takes the count then
    engine = DuplexEngine(
        checkpoint,
        batch_size=settings.max_sessions,
        temp=settings.temp,
        temp_text=settings.temp_text,
        cuda_graphs=None if settings.cuda_graphs else False,
        predict_user=False,  # the user's codes come from the microphone every frame
        persona_policy=settings.persona_policy,
        max_block_columns=settings.max_block_columns or None,
        kv_dtype=settings.kv_dtype,
    )
    return checkpoint, engine


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
            hosts = [v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"]
            host = hosts[0] if len(hosts) == 1 else None  # two Host fields name no one server (RFC 9112 3.2)
            server = scope.get("server") or (None, None)
            scheme = scope.get("scheme", "http")
            if not host_allowed(host, bind_host=self.bind_host, port=server[1], allowed=self.allowed, scheme=scheme):
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
        transcriber, retriever: backends to use instead of those built from ``settings`` (None disables one). A
            given retriever is scoped to each session's principal (``retriever.scoped(memory)``) when it can be.
        db: a :class:`~cspan.backends.context_db.ContextDB` (default: open ``settings.db``).
        authenticator: turns credentials into principals (default: a
            :class:`~cspan.server.auth.CredentialAuthenticator` of ``--token``, ``--token-file`` and the tokens
            issued in ``db``).

    Returns:
        The FastAPI app (``app.state.hub`` is the :class:`~cspan.server.session.SessionHub`). The model is loaded
        here; the tool bank is built (``hub.prepare()``) and the frame loop starts with the app's lifespan.

    Raises:
        CheckpointError: the checkpoint or default voice cannot be loaded. CspanError: a backend cannot be built
            (:class:`~cspan.server.auth.ServeConfigError` for the Context DB, a backend or the bind address).
    """
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from starlette.routing import WebSocketRoute

    from cspan.backends.errors import BackendError
    from cspan.server.metrics import ServerMetrics

    settings = settings or ServeSettings()
    adapters = discover_adapters()
    try:  # before the model: a bad Context DB, token file or backend fails in seconds, not minutes
        db = db if db is not None else settings.open_db()
        exposed = is_exposed(settings.host, settings.allow_host)
        credentials: object = authenticator is not None or settings.token or settings.token_file
        if not credentials and exposed and not settings.insecure_no_token:
            credentials = db.tokens()
        check_bind(
            settings.host, credentials, insecure_no_token=settings.insecure_no_token, allowed=settings.allow_host
        )
        if authenticator is None:
            authenticator = CredentialAuthenticator(
                db,
                token=settings.token,
                token_user=settings.token_user,
                token_file=settings.token_file,
                always=exposed and not settings.insecure_no_token,
            )
        if transcriber is _UNSET:
            transcriber = build_transcriber(settings)
    except BackendError as exc:
        raise ServeConfigError(f"backends (--db, --token-file, --asr): {exc}") from exc
    logger.info("Context DB: %s (%s)", db.where, db.dialect)

    async def backends() -> Backends:
        if retriever is _UNSET:
            return await build_backends(settings, transcriber)
        return Backends(transcriber=transcriber, retriever=retriever)

    checkpoint, engine = build_engine(settings, checkpoint)
    metrics = ServerMetrics(settings.max_sessions, [a.name for a in adapters])
    hub = SessionHub(settings, checkpoint, engine, db, metrics, backends)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        await hub.prepare()  # done already when run by cspan serve (make_server), which reports failures cleanly
        hub.start()
        try:
            yield
        finally:
            await hub.shutdown()

    app = FastAPI(  # no generated schema or docs pages: the routes are those of docs/PROTOCOL.md, nothing more
        title="cspan serve",
        version=str(PROTOCOL_VERSION),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        # No redirect of /info/ to /info: Starlette's is an absolute URL built from what this server sees, which
        # behind a reverse proxy is the wrong one (the path prefix the proxy strips is lost, http where the proxy
        # speaks https). The server sends no Location at all; the page's URLs are relative to it.
        redirect_slashes=False,
    )
    app.state.hub = hub
    app.state.settings = settings
    app.state.authenticator = authenticator

    def static(name: str) -> Response:
        return Response(_static_bytes(name), media_type=STATIC_FILES[name], headers=_PAGE_HEADERS)

    # Route functions carry no annotations: this module postpones them (PEP 563) and FastAPI would have to
    # resolve names that are imported lazily, above.
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def index():
        return static("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static_file(name: str):
        if name not in STATIC_FILES:
            return JSONResponse({"detail": "not found"}, status_code=404)
        return static(name)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: what some balancers' checks send
    async def health():
        """Liveness and capacity, for load balancers: 200 while a slot is free, 503 when full, draining or stopped
        (the body says which). An ``--mcp`` server that is down does not make it unhealthy (conversations go on,
        its tools answer with an error): ``cspan_mcp_servers`` of ``/metrics`` counts them by state; ``/health``
        needs no token and says nothing of the backends."""
        status, free = hub.health()
        body = {
            "status": status,
            "model": hub.public_model_name,
            "sample_rate": SAMPLE_RATE,
            "frame_size": FRAME_SIZE,
            "max_sessions": settings.max_sessions,
            "free_slots": free,
            "protocol_version": PROTOCOL_VERSION,
        }
        return JSONResponse(body, status_code=200 if status == "ok" else 503, headers={"Cache-Control": "no-store"})

    @app.get("/info")
    async def info():
        """What the page needs to build its form; no token, and never a 500 for the Context DB: while the one holding
        the issued tokens fails or does not answer within ``--db-wait-s`` (PostgreSQL away or frozen),
        ``token_required`` is None (cannot be checked now; a conversation gets 1013 until it answers) and the rest is
        as always."""
        try:
            token_required = await hub.db_calls.within(authenticator.required())
        except Exception as exc:  # the Context DB holding the tokens failed: the page still gets its form
            logger.warning("/info: cannot tell whether a token is required now: %s", exc)
            token_required = None
        return {
            "protocol_version": PROTOCOL_VERSION,
            "sample_rate": SAMPLE_RATE,
            "frame_size": FRAME_SIZE,
            "max_sessions": settings.max_sessions,
            "voices": hub.voice_names,
            "default_voice": hub.default_voice,
            "voice_recording": {
                "min_seconds": VOICE_MIN_SECONDS,
                "max_seconds": VOICE_MAX_SECONDS,
                "max_bytes": VOICE_AUDIO_MAX_BYTES,
            },
            "text_prompt": settings.text_prompt,
            "max_text_prompt_chars": settings.max_text_prompt_chars,
            "max_message_bytes": settings.max_message_kib * 1024,
            "token_required": token_required,
            "asr": hub.transcriber is not None,
            "retrieval": hub.retriever is not None,
            "protocols": {a.name: a.path for a in adapters},
        }

    async def metrics_endpoint(request):
        """Prometheus metrics; while credentials are required, only for a principal with the ``admin`` scope
        (``Authorization: Bearer TOKEN`` or ``?token=``; two different tokens: 401, as on the WebSockets). The
        shared ``--token`` and token-file credentials are checked without the Context DB, so they read the metrics
        during a stall too. An issued token that the Context DB cannot check now (it fails, PostgreSQL away, or does
        not answer within ``--db-wait-s``): 503, as a WebSocket gets 1013. A loopback server with no credentials
        configured asks the Context DB whether a token was issued since; when it cannot answer, its last answer
        "none" stands for :data:`METRICS_OPEN_S` (then 503)."""
        credential = _http_credential(request)
        if credential.conflicting:
            return JSONResponse(
                {"detail": CONFLICTING_CREDENTIALS}, status_code=401, headers={"WWW-Authenticate": "Bearer"}
            )
        within = hub.db_calls.within
        try:
            try:
                required = await within(authenticator.required())
            except Exception as exc:
                open_within = getattr(authenticator, "open_within", None)
                if open_within is None or not open_within(METRICS_OPEN_S):
                    raise
                logger.warning(
                    "/metrics: the Context DB cannot tell whether a token was issued (%s); its last answer, none, "
                    "less than %g s ago, stands",
                    exc,
                    METRICS_OPEN_S,
                )
                required = False
            principal = await within(authenticator.authenticate(credential.token, scope=None)) if required else None
        except Exception as exc:  # the Context DB holding the tokens failed or did not answer: not the client's fault
            logger.warning("could not check a credential (the Context DB): %s", exc)
            return JSONResponse({"detail": CREDENTIALS_UNCHECKED}, status_code=503, headers={"Retry-After": "5"})
        if required and (principal is None or not principal.allows("admin")):
            return JSONResponse(
                {"detail": "metrics need a token with the admin scope (Authorization: Bearer TOKEN)"},
                status_code=401 if principal is None else 403,
                headers={"WWW-Authenticate": "Bearer"} if principal is None else None,
            )
        body, content_type = metrics.render(hub.mcp_states())
        return Response(body, media_type=content_type)

    app.router.add_route("/metrics", metrics_endpoint, methods=["GET"], include_in_schema=False)

    for adapter in adapters:

        async def endpoint(websocket: Any, adapter: type[ProtocolAdapter] = adapter) -> None:
            await serve_connection(websocket, adapter, hub, authenticator, settings.allow_origin)

        app.router.routes.append(WebSocketRoute(adapter.path, endpoint))
    app.add_middleware(HostGuard, settings=settings, metrics=metrics)
    return app


def _http_credential(request: Any) -> Credential:
    """The credential of an HTTP request, for every route that takes one: ``Authorization: Bearer``, else
    ``?token=``; ``conflicting`` when two of those given differ (a repeated ``?token=`` too), as on the WebSockets."""
    return Credential.first_of(
        bearer_token(request.headers.get("authorization")), *request.query_params.getlist("token")
    )


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
    if credential.conflicting or len(set(websocket.query_params.getlist("token"))) > 1:
        metrics.auth_failures.labels(adapter_cls.name, "token").inc()
        await websocket.accept(subprotocol=credential.subprotocol)
        await websocket.close(code=CLOSE_UNAUTHORIZED, reason=f"unauthorized: {CONFLICTING_CREDENTIALS}")
        return
    try:
        principal = await hub.db_calls.within(authenticator.authenticate(credential.token, scope=None))
    except Exception as exc:  # the Context DB holding the tokens failed or did not answer: not the client's fault
        logger.warning("could not check a credential (the Context DB): %s", exc)
        await websocket.accept(subprotocol=credential.subprotocol)
        await websocket.close(code=CLOSE_TRY_AGAIN_LATER, reason=CREDENTIALS_UNCHECKED)
        return
    if principal is None or not principal.allows("session"):
        metrics.auth_failures.labels(adapter_cls.name, "token").inc()
        if principal is not None:
            reason = "the token lacks the session scope"
        else:
            reason = "missing token" if credential.token is None else "wrong token"
        await websocket.accept(subprotocol=credential.subprotocol)
        await websocket.close(code=CLOSE_UNAUTHORIZED, reason=f"unauthorized: {reason}")
        return
    await websocket.accept(subprotocol=credential.subprotocol)
    most = hub.settings.connections_per_user
    if hub.connections_of(principal.user_id) >= most:  # no await from here to hub.open: counted at once
        metrics.user_limit_refusals.labels(adapter_cls.name, "connections").inc()
        logger.info("refused a connection of %s: %d open, the limit per user", principal.user_id, most)
        await websocket.close(
            code=CLOSE_TRY_AGAIN_LATER,
            reason=f"this user's connections reached this server's limit ({most}, --max-connections-per-user)",
        )
        return
    loop = asyncio.get_running_loop()
    limit = hub.settings.max_message_kib * 1024
    budget = ClientBudget(hub.settings.max_messages_per_s, limit, VOICE_AUDIO_MAX_BYTES + limit)
    session = hub.open(adapter_cls.name, principal)
    adapter = adapter_cls(session, connection)
    sender = asyncio.ensure_future(_send(websocket, session, adapter, metrics))
    watchdog = asyncio.ensure_future(session.watchdog())
    recheck = asyncio.ensure_future(_recheck(session, authenticator, credential.token))
    gone = "disconnect"
    try:
        await _handle(session, adapter.opened())
        while True:
            reading = loop.time()
            message = await websocket.receive()
            # uvicorn queues the disconnect behind every message it has parsed (one read: thousands of small ones);
            # the sender learns of it at its next write, and the session ends then, not after the backlog.
            if message["type"] == "websocket.disconnect" or session.gone:
                if message.get("reason") == KEEPALIVE_TIMEOUT:  # it did not read the ping: it does not read
                    logger.warning("session %s: client does not read (no answer to the keepalive ping)", session.id)
                    gone = "slow_client"
                break
            data = message.get("bytes")
            if data is None:
                data = message.get("text")
            if data is None:
                continue
            metrics.wire_bytes.labels(adapter_cls.name, "in").inc(len(data))
            size = _message_bytes(data, limit)
            wait = budget.charge(size, waited_s=loop.time() - reading)
            if budget.over_s() >= throttle.OVER_BUDGET_END_S:
                await _end_over_budget(session, sender, hub.settings.max_messages_per_s)
                break
            if wait > 0.0:  # over its budget: read later, so TCP slows the client and the frame clock keeps time
                metrics.throttled_seconds.labels(adapter_cls.name).inc(wait)
                if await session.wait_gone(wait):
                    break
            if size > limit:  # refused before any adapter work: decoding scales with the message
                session.client_error(
                    "too_large",
                    f"a message of {size} bytes, over this server's limit of {limit} (--max-message-kib); send less "
                    "at once",
                )
                continue
            await _handle(session, adapter.receive(data))
    except Exception as exc:
        logger.debug("session %s: receive ended: %s", session.id, exc)
    finally:
        watchdog.cancel()
        recheck.cancel()
        await session.disconnected(gone)
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sender


async def _end_over_budget(session: Session, sender: asyncio.Future[None], messages_per_s: float) -> None:
    """End a session whose client stayed over its message budget for :data:`throttle.OVER_BUDGET_END_S`: reason
    ``over_budget``, close 1008, and wait (a few seconds at most) for the sender to deliver both."""
    logger.warning("session %s: the client stayed over its message budget; ending it", session.id)
    await session.end(
        "over_budget",
        code=CLOSE_POLICY,
        message=f"more than {messages_per_s:g} messages a second (or 16 of the largest a second in bytes) for "
        f"{throttle.OVER_BUDGET_END_S:g} s; send fewer, larger messages (audio in 20-100 ms pieces)",
    )
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.shield(sender), timeout=5.0)


async def _recheck(session: Session, authenticator: Authenticator, token: str | None) -> None:
    """Every :data:`CREDENTIAL_RECHECK_S` while ``session`` runs, check again what it stands on:

    - its credential: once it no longer authenticates as its principal with the ``session`` scope (a token revoked
      with ``cspan users revoke`` on any replica, removed from the token file after SIGHUP, or its user's tokens
      forgotten), end it with reason ``revoked``, close 4401. Not for the local principal (no credentials configured
      when it started). A static credential (``--token``, the token file) is checked without the Context DB.
    - its user's memory: once the user was forgotten (``cspan db forget``, from any process or replica) after the
      session first read or wrote it, end it with reason ``forgotten``, close 4410 (its writes are refused already).

    Single-flight: a check still waiting on the Context DB after ``--db-wait-s`` is not abandoned for a new one (each
    would take another of the database's few threads while it does not answer); the next rounds wait for it again,
    and use its answer when it comes. A failing Context DB, or one that does not answer, keeps the session (logged
    once per outage), as it is not the client's fault."""
    wait_s = session.hub.db_calls.wait_s
    failing = False
    check: asyncio.Future[str | None] | None = None
    try:
        while not session.ending:
            await asyncio.sleep(CREDENTIAL_RECHECK_S)
            if check is None:
                check = asyncio.ensure_future(_check_again(session, authenticator, token))
            try:
                outcome = await asyncio.wait_for(asyncio.shield(check), wait_s)
            except Exception as exc:
                why = str(exc)
                if not check.done():  # still waiting on the database: kept for the next round
                    why = f"the Context DB did not answer within {wait_s:g} s (--db-wait-s)"
                else:
                    check = None  # it failed: the next round asks again
                if not failing:  # once per outage, not every few seconds for every session
                    logger.warning(
                        "session %s: could not check its credential and memory again (goes on): %s", session.id, why
                    )
                failing = True
                continue
            check = None
            failing = False
            if session.ending:
                return
            if outcome == "revoked":
                logger.info("session %s: the credential of %s was revoked", session.id, session.principal.user_id)
                await session.end("revoked", code=CLOSE_UNAUTHORIZED, message="the credential was revoked")
                return
            if outcome == "forgotten":
                await session.end_forgotten()
                return
    finally:
        if check is not None and not check.done():
            check.cancel()  # one still waiting for a thread is dropped; one running ends on its thread


async def _check_again(session: Session, authenticator: Authenticator, token: str | None) -> str | None:
    """One round of :func:`_recheck`: ``"revoked"``, ``"forgotten"`` or None (unbounded: the caller bounds it)."""
    if session.principal.source != "local":
        principal = await authenticator.authenticate(token)
        if principal is None or principal.user_id != session.principal.user_id:
            return "revoked"
    return "forgotten" if await session.memory.awas_forgotten() else None


def _message_bytes(data: bytes | str, limit: int) -> int:
    """The size of a message in bytes (text: UTF-8), exact wherever it may exceed ``limit`` (a text too short or too
    long to need it is not encoded)."""
    if isinstance(data, bytes) or len(data) > limit or len(data) * 4 <= limit:
        return len(data)
    return len(data.encode("utf-8", errors="surrogatepass"))


async def _handle(session: Session, call: Any) -> None:
    """Await one adapter call; a client mistake or an unexpected error is reported and the session goes on."""
    try:
        await call
    except ClientError as exc:
        session.client_error(exc.code, exc.message)
    except Exception as exc:
        logger.exception("session %s: error while handling a message", session.id)
        # the exception's text stays in the server's log: it may name paths or other internals
        session.client_error(
            "internal",
            f"an unexpected server error ({type(exc).__name__}); the server log has it (session {session.id})",
        )


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
    except (UnicodeError, TypeError):  # a message the server made that cannot be sent: a bug, not the client
        logger.exception("session %s: %s could not send a message; the connection is given up", session.id, name)
        session.gone = True
    except Exception as exc:  # the client went away mid-send
        logger.debug("session %s: send failed: %s", session.id, exc)
        session.gone = True


__all__ = [
    "STATIC_FILES",
    "HostGuard",
    "build_engine",
    "create_app",
    "serve_connection",
]
