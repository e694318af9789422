"""``cspan serve``: live conversations in the browser over WebSocket, several at once on one batched engine.

Architecture (one process, one event loop)::

    browser tab --WS /ws--> Session (per connection: protocol, bounded audio queue, outbox, idle watchdog)
                                   |  start -> SessionManager.reserve(slot) -> persona prefix read between frames
                                   v
    SessionManager frame loop (one asyncio task, 80 ms monotonic clock)
        for each live session: one queued user frame (or silence) -> Conversation.before_step
        ONE DuplexEngine.step(pcm [N, 1920]) for all N slots (engine worker thread)
        for each live session: Conversation.after_step -> agent frame + events -> its outbox

The engine has ``batch_size = --max-sessions``; slot i of the batch belongs to at most one session. Slots with no
live session are fed silence and their outputs are discarded; a slot is reset (``engine.reset`` +
``set_persona``) when a session starts on it. The clock never waits for a client: a session whose queue is empty
hears silence for that frame; a session sending faster than real time has its oldest queued frames dropped (and
counted) once the queue holds ``--max-queued-frames``. When the loop falls more than one frame behind (a slow
step, a long persona prefix), it skips ahead instead of bursting through the missed frames.

All engine work (steps, persona prefixes) runs on one dedicated worker thread, so the event loop stays
responsive; Context Spans are read by the conversation runtime at the head of a frame, between two steps, on the
loop thread. Nothing else touches the engine.

The wire protocol is :mod:`cspan.server.protocol` and ``docs/PROTOCOL.md``; access control is
:mod:`cspan.server.auth`; metrics are :mod:`cspan.server.metrics`. The original server this replaces served one
conversation at a time and stepped once per received frame (reference digest, section 5.1).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cspan.core.constants import FRAME_RATE, FRAME_SIZE, SAMPLE_RATE
from cspan.server.auth import (
    authenticate,
    check_bind,
    offered_subprotocols,
    origin_allowed,
    validate_token,
)
from cspan.server.infer import DEFAULT_PERSONA, add_backend_arguments, add_model_arguments
from cspan.server.protocol import (
    CLOSE_FORBIDDEN_ORIGIN,
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_TRY_AGAIN_LATER,
    CLOSE_UNAUTHORIZED,
    MAX_WEBSOCKET_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    BusyMessage,
    ByeMessage,
    ContextMessage,
    ErrorMessage,
    PersonaInfo,
    ProfileFields,
    ProfileInfo,
    ProtocolCodeError,
    ReadyMessage,
    SessionStats,
    SlotMessage,
    StartMessage,
    StopMessage,
    decode_audio_frame,
    dumps,
    encode_audio_frame,
    event_to_wire,
    parse_client_message,
)

logger = logging.getLogger(__name__)

FRAME_S = 1.0 / FRAME_RATE
OUTBOX_LIMIT = 500
"""Messages waiting for a client that does not read; above this the session ends with ``slow_client``."""
FINISH_TIMEOUT_S = 3.0
"""How long the end of a session waits for outstanding transcripts before saying ``bye``."""
OVERFLOW_REPORT_FRAMES = 50
"""At most one ``audio_overflow`` error per this many frames (4 s) while frames are being dropped."""

STATIC_FILES: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
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


class ServeSettings(BaseModel):
    """Configuration of a ``cspan serve`` app (the CLI flags, kebab-case there; see ``cspan serve --help``).

    Attributes:
        checkpoint: Hub repo id, local folder or file (None: the released checkpoint).
        voice: default voice (a name in the checkpoint's voices, or a ``.pt`` file); None: the first voice; "":
            no voice prompt.
        text_prompt: default persona text prompt.
        host, port: where uvicorn listens.
        token: shared secret required on ``/ws`` (None: no authentication; only allowed on loopback unless
            ``insecure_no_token``).
        max_sessions: concurrent conversations = the engine's batch size.
        idle_timeout_s: a session (or a connection that never starts) with no audio for this long gets ``bye``.
        max_queued_frames: bound of each session's inbound audio queue (25 frames = 2 s).
        slot_every: also send ``slot`` every N frames (0: only for frames where a span was read).
        allowed_origins: extra browser origins allowed to open ``/ws`` (``*`` for any).
        max_text_prompt_chars: longest persona text prompt a client may send.
        allow_test_hooks: accept ``start.test`` (forced ``<ret>``, scheduled spans, seed). Tests only.
        temp, temp_text, seed, device, no_cuda_graphs: the engine (``seed + n`` for the n-th session).
        asr, asr_model, router, router_model, knowledge, db, listen_s, span_deadline_s: the backends, as for
            ``cspan infer``.
    """

    model_config = ConfigDict(extra="forbid")

    checkpoint: str | None = None
    voice: str | None = None
    text_prompt: str = DEFAULT_PERSONA
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    token: str | None = None
    insecure_no_token: bool = False
    max_sessions: int = Field(default=4, ge=1, le=256)
    idle_timeout_s: float = Field(default=60.0, gt=0)
    max_queued_frames: int = Field(default=25, ge=1, le=12500)
    slot_every: int = Field(default=0, ge=0)
    allowed_origins: list[str] = Field(default_factory=list)
    max_text_prompt_chars: int = Field(default=1000, ge=0, le=4000)
    allow_test_hooks: bool = False
    temp: float = 0.8
    temp_text: float = 0.7
    seed: int = 42424242
    device: str | None = None
    no_cuda_graphs: bool = False
    asr: str = "sphinx"
    asr_model: str | None = None
    router: str = "local"
    router_model: str | None = None
    knowledge: Path | None = None
    db: str = ":memory:"
    listen_s: float = 12.0
    span_deadline_s: float = 2.5


# ---------------------------------------------------------------------------------------------------- sessions


@dataclass
class _Close:
    code: int
    reason: str


@dataclass
class _StepResult:
    agent_pcm: np.ndarray  # [N, 1920] float32
    text_token: np.ndarray  # [N] int64
    is_ret: np.ndarray  # [N] bool
    valid: np.ndarray  # [N] bool
    step_ms: float


@dataclass
class _StartRequest:
    message: StartMessage
    voice_name: str | None
    voice_codes: Any
    text_prompt: str
    seed: int
    vad: Any = None


class Session:
    """One WebSocket connection: protocol handling, the bounded audio queue, the outbox and the idle watchdog.

    States: ``connected`` (no slot) -> ``starting`` (slot reserved, persona being read) -> ``live`` (in the frame
    loop) -> ``stopping`` (``stop`` received; queued audio is played through) -> ``closed``.
    """

    def __init__(self, manager: SessionManager, websocket: Any) -> None:
        self.manager = manager
        self.ws = websocket
        self.id = uuid.uuid4().hex
        self.state = "connected"
        self.slot: int | None = None
        self.inbox: collections.deque[np.ndarray] = collections.deque()
        self.outbox: asyncio.Queue[str | bytes | _Close] = asyncio.Queue()
        self.stats = SessionStats()
        self.last_audio = time.monotonic()
        self.conversation: Any = None
        self.conversation_id: str | None = None
        self.profile: Any = None
        self.profile_fields = ProfileFields()
        self.start_request: _StartRequest | None = None
        self.events: list[Any] = []
        self.ending = False
        self.ended = False
        self.gone = False
        self.sender_task: asyncio.Task[None] | None = None
        self._recorder: Callable[[Any], None] | None = None
        self._last_overflow_report = -(10**9)
        self._stopping_reported = False
        self._tasks: list[asyncio.Task[Any]] = []

    # -- outbound ---------------------------------------------------------------------------------------------

    def _put(self, item: str | bytes) -> None:
        if self.gone:
            return
        if self.outbox.qsize() >= OUTBOX_LIMIT:
            if not self.ending:
                logger.warning(
                    "session %s: client does not read (%d messages waiting); ending it", self.id, OUTBOX_LIMIT
                )
                while not self.outbox.empty():
                    self.outbox.get_nowait()
                self.ending = True
                self.spawn(self.end("slow_client", code=CLOSE_POLICY, message="the client did not read its messages"))
            return
        self.outbox.put_nowait(item)

    def send(self, message: BaseModel) -> None:
        """Queue a JSON server message."""
        self._put(dumps(message))

    def send_audio(self, pcm: np.ndarray) -> None:
        """Queue one agent frame (binary float32 LE)."""
        self._put(encode_audio_frame(pcm))

    def error(self, code: str, message: str, **fields: Any) -> None:
        """Queue an ``error`` message for a client mistake (the session goes on)."""
        self.stats.errors += 1
        self.manager.metrics.protocol_errors.labels(code).inc()
        self.send(ErrorMessage(code=code, message=message, **fields))

    def close(self, code: int, reason: str) -> None:
        """Queue a close after everything already queued."""
        self.outbox.put_nowait(_Close(code, reason[:120]))

    async def sender(self) -> None:
        """Drain the outbox to the socket until a close is sent or the client is gone."""
        try:
            while True:
                item = await self.outbox.get()
                if isinstance(item, _Close):
                    with contextlib.suppress(Exception):
                        await self.ws.close(code=item.code, reason=item.reason)
                    return
                if isinstance(item, bytes):
                    await self.ws.send_bytes(item)
                else:
                    await self.ws.send_text(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the client went away mid-send
            logger.debug("session %s: send failed: %s", self.id, exc)
            self.gone = True

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)
        return task

    # -- events from the conversation runtime -----------------------------------------------------------------

    def on_event(self, event: Any) -> None:
        """``Conversation.on_event``: buffer for the wire, record in the Context DB, count in the metrics."""
        self.events.append(event)
        self.manager.observe_event(self, event)
        if self._recorder is not None:
            self._recorder(event)

    def take_events(self) -> list[Any]:
        events, self.events = self.events, []
        return events

    def send_events(self, events: list[Any]) -> None:
        for ev in events:
            msg = event_to_wire(ev)
            if isinstance(msg, ErrorMessage):
                self.stats.errors += 1
            self.send(msg)

    # -- inbound ----------------------------------------------------------------------------------------------

    async def handle(self, message: dict[str, Any]) -> None:
        """Handle one ASGI ``websocket.receive`` message; never raises for a client mistake."""
        data = message.get("bytes")
        text = message.get("text")
        try:
            if data is not None:
                self.on_audio(data)
            elif text is not None:
                await self.on_text(text)
        except ProtocolCodeError as exc:
            self.error(exc.code, exc.message)
        except Exception as exc:
            logger.exception("session %s: error while handling a message", self.id)
            self.error("internal", f"{type(exc).__name__}: {exc}")

    def on_audio(self, data: bytes) -> None:
        pcm = decode_audio_frame(data)  # raises too_large / bad_frame
        if self.state == "connected":
            raise ProtocolCodeError("not_started", 'audio before start: send {"type": "start"} and wait for ready')
        if self.state in ("stopping", "closed"):
            if not self._stopping_reported:
                self._stopping_reported = True
                self.error("stopping", "audio after stop is ignored")
            return
        self.last_audio = time.monotonic()
        self.stats.user_frames += 1
        self.manager.metrics.user_frames.inc()
        if len(self.inbox) >= self.manager.settings.max_queued_frames:
            self.inbox.popleft()
            self.stats.dropped_frames += 1
            self.manager.metrics.user_frames_dropped.inc()
            if self.stats.frames - self._last_overflow_report >= OVERFLOW_REPORT_FRAMES:
                self._last_overflow_report = self.stats.frames
                self.error(
                    "audio_overflow",
                    f"audio arrives faster than the session consumes it (one frame per 80 ms tick): the queue holds "
                    f"{self.manager.settings.max_queued_frames} frames and the oldest are dropped "
                    f"({self.stats.dropped_frames} so far)",
                )
        self.inbox.append(pcm)

    async def on_text(self, text: str) -> None:
        msg = parse_client_message(text)
        if isinstance(msg, StartMessage):
            await self.on_start(msg)
        elif isinstance(msg, ContextMessage):
            self.on_context(msg)
        elif isinstance(msg, StopMessage):
            await self.on_stop()

    async def on_start(self, msg: StartMessage) -> None:
        mgr = self.manager
        if self.state != "connected":
            raise ProtocolCodeError("already_started", f"start while the session is {self.state}; send stop first")
        if msg.version is not None and msg.version != PROTOCOL_VERSION:
            raise ProtocolCodeError(
                "invalid_message", f"start.version {msg.version}: this server speaks protocol {PROTOCOL_VERSION}"
            )
        if msg.test is not None and not mgr.settings.allow_test_hooks:
            raise ProtocolCodeError("invalid_message", "start.test: test hooks are disabled on this server")
        prompt = mgr.settings.text_prompt if msg.text_prompt is None else msg.text_prompt
        if msg.text_prompt is not None and len(prompt) > mgr.settings.max_text_prompt_chars:
            raise ProtocolCodeError(
                "invalid_message",
                f"start.text_prompt: {len(prompt)} characters, over this server's limit of "
                f"{mgr.settings.max_text_prompt_chars}",
            )
        try:
            voice_name, voice_codes = mgr.voice(msg.voice)
        except KeyError:
            raise ProtocolCodeError(
                "bad_voice", f"start.voice {msg.voice!r}: not a voice of this server; use one of {mgr.voice_names}"
            ) from None
        self.profile_fields = msg.profile
        seed = msg.test.seed if msg.test is not None and msg.test.seed is not None else mgr.next_seed()
        slot = mgr.reserve(self)
        if slot is None:
            mgr.metrics.sessions_busy.inc()
            self.send(
                BusyMessage(
                    max_sessions=mgr.settings.max_sessions,
                    message=f"all {mgr.settings.max_sessions} conversation slots are in use; try again later",
                )
            )
            self.state = "closed"
            self.ending = self.ended = True
            self.close(CLOSE_TRY_AGAIN_LATER, "busy")
            return
        self.state = "starting"
        self.last_audio = time.monotonic()
        request = _StartRequest(msg, voice_name, voice_codes, prompt, seed)
        try:
            request.vad = await asyncio.to_thread(mgr.make_vad)
        except Exception as exc:
            logger.exception("session %s: voice activity detector failed to load", self.id)
            mgr.release(self)
            self.state = "connected"
            raise ProtocolCodeError("internal", f"voice activity detector failed: {exc}") from None
        if self.state != "starting":  # stopped or gone while the detector loaded
            return
        self.start_request = request
        mgr.request_start(self)

    def on_context(self, msg: ContextMessage) -> None:
        if self.state not in ("starting", "live", "stopping"):
            raise ProtocolCodeError("not_started", f"context while the session is {self.state}; send start first")
        new = msg.profile
        if new.user_id is not None and new.user_id != self.profile_fields.user_id:
            raise ProtocolCodeError("invalid_message", "context.profile.user_id cannot change during a conversation")
        merged = self.profile_fields.model_copy(update=new.model_dump(exclude_unset=True))
        self.profile_fields = merged
        if self.conversation is not None:
            self.profile = self.manager.make_profile(self, self.start_request.text_prompt if self.start_request else "")
            self.conversation.profile = self.profile
            self.manager.put_profile(self.profile)

    async def on_stop(self) -> None:
        if self.state == "live":
            self.state = "stopping"  # the frame loop plays the queue through, then ends the session
        elif self.state in ("connected", "starting"):
            await self.end("stop")

    # -- lifecycle ----------------------------------------------------------------------------------------------

    async def watchdog(self) -> None:
        """End the session after ``idle_timeout_s`` without audio (also a connection that never starts)."""
        timeout = self.manager.settings.idle_timeout_s
        while not self.ending:
            await asyncio.sleep(min(1.0, timeout / 4))
            if self.state == "starting":  # the server is reading the persona: not the client's idle time
                self.last_audio = time.monotonic()
            elif not self.ending and time.monotonic() - self.last_audio > timeout:
                await self.end("idle", message=f"no audio for {timeout:g} s")
                return

    async def end(self, reason: str, *, code: int = CLOSE_NORMAL, message: str = "") -> None:
        """End the session once: free the slot, finish the conversation, record, say ``bye`` and close.

        ``reason`` ``disconnect`` (the client is gone) skips the ``bye``.
        """
        if self.ended:
            return
        self.ended = True
        self.ending = True
        mgr = self.manager
        mgr.release(self)
        self.state = "closed"
        if self.conversation is not None:
            try:
                await asyncio.wait_for(self.conversation.finish(), timeout=FINISH_TIMEOUT_S)
            except TimeoutError:
                logger.info(
                    "session %s: transcripts still running after %.0f s; not waited for", self.id, FINISH_TIMEOUT_S
                )
            except Exception:
                logger.exception("session %s: finishing the conversation failed", self.id)
            if reason != "disconnect":
                self.send_events(self.take_events())
        mgr.end_conversation(self)
        mgr.metrics.sessions_ended.labels(reason).inc()
        self.stats.duration_s = round(self.stats.frames * FRAME_S, 3)
        if reason != "disconnect" and not self.gone:
            self.send(
                ByeMessage(
                    reason=reason,  # type: ignore[arg-type]
                    message=message,
                    session_id=self.id,
                    conversation_id=self.conversation_id,
                    stats=self.stats,
                )
            )
            self.close(code, reason)
        logger.info("session %s ended (%s): %s", self.id, reason, self.stats.model_dump())


# ---------------------------------------------------------------------------------------------------- manager


class SessionManager:
    """The engine, its slots, the shared backends and the frame loop.

    Args:
        settings: :class:`ServeSettings`.
        checkpoint: the loaded :class:`~cspan.core.checkpoint.Checkpoint`.
        engine: a :class:`~cspan.core.engine.DuplexEngine` with ``batch_size == settings.max_sessions``.
        transcriber, retriever: shared by all sessions (either may be None).
        db: the :class:`~cspan.backends.context_db.ContextDB`.
        metrics: :class:`~cspan.server.metrics.ServerMetrics`.
    """

    def __init__(
        self,
        settings: ServeSettings,
        checkpoint: Any,
        engine: Any,
        transcriber: Any,
        retriever: Any,
        db: Any,
        metrics: Any,
    ) -> None:
        self.settings = settings
        self.checkpoint = checkpoint
        self.engine = engine
        self.transcriber = transcriber
        self.retriever = retriever
        self.db = db
        self.metrics = metrics
        self.slots: list[Session | None] = [None] * engine.batch_size
        self.sessions: set[Session] = set()
        self._starts: collections.deque[Session] = collections.deque()
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cspan-engine")
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._session_counter = 0
        self._silence = np.zeros(FRAME_SIZE, dtype=np.float32)
        self._voices: dict[str, Any] = {}
        self.voice_files: dict[str, Any] = dict(getattr(checkpoint, "voices", {}) or {})
        default = settings.voice
        if default and default not in self.voice_files:
            path = Path(default).expanduser()
            if not path.is_file():
                from cspan.core.errors import CheckpointError

                raise CheckpointError(
                    f"--voice {default!r}: neither a voice of the checkpoint ({sorted(self.voice_files)}) nor a file"
                )
            self.voice_files[path.stem] = path
            default = path.stem
        if default is None and self.voice_files:
            default = min(self.voice_files)
        self.default_voice: str | None = default or None  # "" (--voice ''): no voice prompt by default
        self.model_name = str(settings.checkpoint or getattr(checkpoint, "source", None) or "default")
        self.voice(None)  # load the default voice now: a broken file fails at start-up, not in a session

    # -- voices, profiles, records -----------------------------------------------------------------------------

    @property
    def voice_names(self) -> list[str]:
        return sorted(self.voice_files)

    def voice(self, requested: str | None) -> tuple[str | None, Any]:
        """``(name, codes [8, P])`` of a requested voice (None: the default, "": none). Raises KeyError."""
        name = self.default_voice if requested is None else requested
        if not name:
            return None, None
        if name not in self.voice_files:
            raise KeyError(name)
        if name not in self._voices:
            from cspan.core.checkpoint import load_voice

            self._voices[name] = load_voice(self.voice_files[name], self.checkpoint)
        return name, self._voices[name]

    def next_seed(self) -> int:
        self._session_counter += 1
        return self.settings.seed + self._session_counter - 1

    def make_vad(self) -> Any:
        from cspan.core.vad import SileroVAD

        return SileroVAD()

    def make_profile(self, session: Session, text_prompt: str) -> Any:
        from cspan.backends.context_db import Profile

        f = session.profile_fields
        return Profile(
            user_id=f.user_id or f"session-{session.id[:12]}",
            name=f.name or "",
            city=f.location or "",
            timezone=f.timezone or "",
            lat=f.lat,
            lon=f.lon,
            notes=f.notes or "",
            persona=text_prompt,
        )

    def put_profile(self, profile: Any) -> None:
        try:
            self.db.put_profile(profile)
        except Exception as exc:
            logger.warning("Context DB: could not store the profile: %s", exc)

    def end_conversation(self, session: Session) -> None:
        if session.conversation_id is None:
            return
        try:
            self.db.end_conversation(session.conversation_id)
        except Exception as exc:
            logger.warning("Context DB: could not end conversation %s: %s", session.conversation_id, exc)

    def observe_event(self, session: Session, event: Any) -> None:
        """Metrics and per-session counters of a conversation event."""
        from cspan.core.events import ErrorEvent, LateEvent, NoSpanEvent, SpanEvent

        m = self.metrics
        if isinstance(event, SpanEvent):
            session.stats.spans += 1
            m.spans.labels("injected").inc()
            m.prefill_seconds.observe(event.prefill_ms / 1000.0)
        elif isinstance(event, LateEvent):
            m.spans.labels("late").inc()
        elif isinstance(event, NoSpanEvent):
            m.spans.labels("no_span").inc()
            if event.error:
                m.backend_errors.labels("retrieval").inc()
        elif isinstance(event, ErrorEvent):
            m.backend_errors.labels(event.stage).inc()

    # -- slots --------------------------------------------------------------------------------------------------

    def free_slots(self) -> int:
        return sum(s is None for s in self.slots)

    def reserve(self, session: Session) -> int | None:
        """Give ``session`` a free engine slot; None when all are taken."""
        for i, s in enumerate(self.slots):
            if s is None:
                self.slots[i] = session
                session.slot = i
                self.metrics.sessions_active.set(len(self.slots) - self.free_slots())
                return i
        return None

    def release(self, session: Session) -> None:
        """Free the session's slot (idempotent). Its engine row is reset when the next session starts on it."""
        i = session.slot
        if i is not None and self.slots[i] is session:
            self.slots[i] = None
        session.slot = None
        with contextlib.suppress(ValueError):
            self._starts.remove(session)
        self.metrics.sessions_active.set(len(self.slots) - self.free_slots())

    def request_start(self, session: Session) -> None:
        """Queue the persona prefix read of a session that reserved a slot (done by the frame loop)."""
        self._starts.append(session)
        self._wake.set()

    # -- the frame loop -----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the frame loop task (in the running event loop)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def _engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _live(self) -> list[Session]:
        return [s for s in self.slots if s is not None and s.state in ("live", "stopping")]

    async def _run(self) -> None:
        next_t: float | None = None
        while not self._closing:
            try:
                if self._starts:
                    await self._start_session(self._starts.popleft())
                    continue
                if not self._live():
                    self._wake.clear()
                    if not self._starts and not self._live():
                        await self._wake.wait()
                    next_t = None
                    continue
                now = time.monotonic()
                if next_t is None:
                    next_t = now
                elif now < next_t:
                    await asyncio.sleep(next_t - now)
                await self._tick()
                next_t += FRAME_S
                if time.monotonic() - next_t > FRAME_S:
                    self.metrics.clock_resyncs.inc()
                    next_t = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("frame loop: unexpected error; the loop goes on")
                await asyncio.sleep(FRAME_S)

    def _prepare_slot(self, req: _StartRequest, slot: int, name: str | None, city: str | None) -> Any:
        import torch

        t0 = time.perf_counter()
        self.engine.reset(slot, seed=req.seed)
        codes = req.voice_codes
        if codes is not None and isinstance(codes, torch.Tensor):
            codes = codes.to(self.engine.device)
        report = self.engine.set_persona(slot, req.text_prompt or None, codes, user_name=name, user_city=city)
        self.metrics.persona_prefill_seconds.observe(time.perf_counter() - t0)
        return report

    async def _start_session(self, session: Session) -> None:
        from cspan.core.runtime import Conversation, ConversationConfig
        from cspan.server.records import db_recorder

        req = session.start_request
        slot = session.slot
        if req is None or slot is None or session.state != "starting":
            return
        f = session.profile_fields
        try:
            report = await self._engine(self._prepare_slot, req, slot, f.name or None, f.location or None)
        except Exception as exc:
            logger.exception("session %s: persona prefix failed", session.id)
            self.release(session)
            if session.state == "starting":
                session.state = "connected"
                session.error("persona_failed", f"the persona prefix could not be read ({type(exc).__name__}: {exc})")
            return
        if session.state != "starting" or session.slot != slot:
            return
        profile = self.make_profile(session, req.text_prompt)
        self.put_profile(profile)
        try:
            conversation_id = self.db.start_conversation(
                profile.user_id,
                checkpoint=self.model_name,
                settings={"session_id": session.id, "voice": req.voice_name, "seed": req.seed, "app": "serve"},
            )
        except Exception as exc:
            logger.warning("Context DB: could not start a conversation: %s", exc)
            conversation_id = f"unrecorded-{session.id}"
        session.profile = profile
        session.conversation_id = conversation_id
        session._recorder = db_recorder(self.db, conversation_id)
        config = ConversationConfig(
            listen_s=self.settings.listen_s,
            span_deadline_s=self.settings.span_deadline_s,
            span_delay_s=None,
        )
        conversation = Conversation(
            self.engine,
            slot,
            tokenizer=getattr(self.checkpoint, "tokenizer", None),
            transcriber=self.transcriber,
            retriever=self.retriever,
            config=config,
            profile=profile,
            conversation_id=conversation_id,
            vad=req.vad,
            on_event=session.on_event,
        )
        hooks = req.message.test
        if hooks is not None:
            for t in hooks.force_ret_at:
                conversation.schedule_ret(round(t * FRAME_RATE))
            for span in hooks.spans:
                conversation.schedule_span(round(span.at * FRAME_RATE), span.text)
        session.conversation = conversation
        session.state = "live"
        session.last_audio = time.monotonic()  # the idle clock starts when the session is live
        self.metrics.sessions_started.inc()
        session.send(
            ReadyMessage(
                session_id=session.id,
                conversation_id=conversation_id,
                slot=slot,
                max_queued_frames=self.settings.max_queued_frames,
                idle_timeout_s=self.settings.idle_timeout_s,
                seed=req.seed,
                persona=PersonaInfo(
                    text_prompt=req.text_prompt,
                    voice=req.voice_name,
                    prefix_frames=int(report.num_frames),
                    prefill_ms=float(report.prefill_ms),
                ),
                profile=ProfileInfo(
                    user_id=profile.user_id,
                    name=profile.name,
                    location=profile.city,
                    timezone=profile.timezone,
                    lat=profile.lat,
                    lon=profile.lon,
                ),
            )
        )

    def _step_sync(self, pcm: np.ndarray) -> _StepResult:
        import torch

        t0 = time.perf_counter()
        out = self.engine.step(torch.from_numpy(pcm))
        agent = out.agent_pcm.detach().float().cpu().numpy()
        result = _StepResult(
            agent_pcm=agent,
            text_token=out.text_token.cpu().numpy(),
            is_ret=out.is_ret.cpu().numpy(),
            valid=out.valid.cpu().numpy(),
            step_ms=(time.perf_counter() - t0) * 1000.0,
        )
        return result

    async def _tick(self) -> None:
        """One 80 ms frame for every live session (see the module docstring)."""
        t0 = time.perf_counter()
        sessions: list[Session] = []
        for s in self._live():
            if s.state == "stopping" and not s.inbox:
                self.release(s)
                s.spawn(s.end("stop"))
            else:
                sessions.append(s)
        if not sessions:
            return
        pcm = np.zeros((self.engine.batch_size, FRAME_SIZE), dtype=np.float32)
        heads: dict[Session, tuple[int, list[Any]]] = {}
        for s in sessions:
            if s.inbox:
                frame = s.inbox.popleft()
                s.stats.consumed_frames += 1
            else:
                frame = self._silence
                s.stats.silence_frames += 1
                self.metrics.silence_frames.inc()
            pcm[s.slot] = frame
            k = s.conversation.frame
            try:
                await s.conversation.before_step(frame)
            except Exception as exc:
                logger.exception("session %s: frame head failed", s.id)
                s.send_events(s.take_events())
                s.error("internal", f"frame {k}: {type(exc).__name__}: {exc}")
                self.release(s)
                s.spawn(s.end("error", code=1011, message=str(exc)))
                continue
            heads[s] = (k, s.take_events())
        if not heads:
            return
        try:
            result: _StepResult = await self._engine(self._step_sync, pcm)
        except Exception as exc:  # the engine failed: end the sessions of this step rather than loop on the error
            logger.exception("frame loop: the engine step failed; ending %d session(s)", len(heads))
            for s in heads:
                s.error("internal", f"the engine failed ({type(exc).__name__}: {exc})")
                self.release(s)
                s.spawn(s.end("error", code=1011, message="the engine failed"))
            return
        self.metrics.frames.inc()
        self.metrics.step_seconds.observe(result.step_ms / 1000.0)
        live_count = len(heads)
        for s, (k, head) in heads.items():
            i = s.slot
            if i is None or s.state not in ("live", "stopping"):
                continue  # ended while the engine stepped
            valid = bool(result.valid[i])
            try:
                await s.conversation.after_step(
                    int(result.text_token[i]) if valid else None, bool(result.is_ret[i]) if valid else False
                )
            except Exception as exc:
                logger.exception("session %s: frame tail failed", s.id)
                s.error("internal", f"frame {k}: {type(exc).__name__}: {exc}")
            tail = s.take_events()
            s.send_events(head)
            s.send_audio(result.agent_pcm[i])
            s.stats.frames += 1
            self.metrics.session_frames.inc()
            prefill_ms = sum(float(getattr(ev, "prefill_ms", 0.0)) for ev in head if ev.type == "span")
            every = self.settings.slot_every
            if any(ev.type == "span" for ev in head) or (every and k % every == 0):
                total_ms = (time.perf_counter() - t0) * 1000.0
                s.send(
                    SlotMessage(
                        frame=k,
                        t=round(k * FRAME_S, 3),
                        step_ms=round(result.step_ms, 3),
                        prefill_ms=round(prefill_ms, 3),
                        total_ms=round(total_ms, 3),
                        over_budget=total_ms > FRAME_S * 1000.0,
                        live_sessions=live_count,
                        queued=len(s.inbox),
                        dropped_frames=s.stats.dropped_frames,
                        silence_frames=s.stats.silence_frames,
                    )
                )
            s.send_events(tail)

    # -- shutdown -------------------------------------------------------------------------------------------------

    async def end_all(self, reason: str = "shutdown", *, flush_s: float = 2.0) -> None:
        """End every session with ``bye`` (``reason``) and give their senders ``flush_s`` to deliver it."""
        sessions = list(self.sessions)
        for s in sessions:
            with contextlib.suppress(Exception):
                await s.end(reason, code=CLOSE_GOING_AWAY, message="the server is shutting down")
        senders = [s.sender_task for s in sessions if s.sender_task is not None and not s.sender_task.done()]
        if senders:
            await asyncio.wait(senders, timeout=flush_s)

    async def shutdown(self) -> None:
        """End every session (``bye`` reason ``shutdown``), stop the loop, release the engine thread and backends."""
        await self.end_all("shutdown")
        self._closing = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
        router = getattr(self.retriever, "router", None)
        for obj in (self.transcriber, router, getattr(router, "tools", None)):
            aclose = getattr(obj, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


# ---------------------------------------------------------------------------------------------------- the app


def _static_bytes(name: str) -> bytes:
    return resources.files("cspan.server").joinpath("static", name).read_bytes()


def _build_engine(settings: ServeSettings, checkpoint: Any) -> tuple[Any, Any]:
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
        cuda_graphs=False if settings.no_cuda_graphs else None,
        predict_user=False,  # the user's codes come from the microphone every frame
    )
    return checkpoint, engine


_UNSET: Any = object()


def create_app(
    settings: ServeSettings | None = None,
    *,
    checkpoint: Any = None,
    transcriber: Any = _UNSET,
    retriever: Any = _UNSET,
    db: Any = None,
    allow_test_hooks: bool | None = None,
) -> Any:
    """Build the FastAPI app: ``GET /``, ``/static/*``, ``/health``, ``/info``, ``/metrics``, ``WS /ws``.

    Args:
        settings: :class:`ServeSettings` (default: all defaults).
        checkpoint: an already loaded :class:`~cspan.core.checkpoint.Checkpoint` (default: load
            ``settings.checkpoint`` on the device ``pick_device`` chooses).
        transcriber, retriever: backends to use instead of those built from ``settings`` (None disables one).
        db: a :class:`~cspan.backends.context_db.ContextDB` (default: open ``settings.db``).
        allow_test_hooks: overrides ``settings.allow_test_hooks`` (accept ``start.test``; tests only).

    Returns:
        The app. The model is loaded here; the frame loop starts with the app's lifespan.

    Raises:
        CheckpointError: the checkpoint or default voice cannot be loaded.
        ServeConfigError: an invalid token.
    """
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from starlette.routing import WebSocketRoute

    from cspan.backends.context_db import ContextDB
    from cspan.server.infer import build_backends
    from cspan.server.metrics import ServerMetrics

    settings = settings or ServeSettings()
    if allow_test_hooks is not None:
        settings = settings.model_copy(update={"allow_test_hooks": allow_test_hooks})
    if settings.token:
        validate_token(settings.token)
    checkpoint, engine = _build_engine(settings, checkpoint)
    db = db if db is not None else ContextDB(settings.db)
    if transcriber is _UNSET or retriever is _UNSET:
        built_t, built_r = build_backends(argparse.Namespace(**settings.model_dump()), profile=None, db=db)
        transcriber = built_t if transcriber is _UNSET else transcriber
        retriever = built_r if retriever is _UNSET else retriever
    metrics = ServerMetrics(settings.max_sessions)
    manager = SessionManager(settings, checkpoint, engine, transcriber, retriever, db, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        manager.start()
        try:
            yield
        finally:
            await manager.shutdown()

    app = FastAPI(title="cspan serve", version=str(PROTOCOL_VERSION), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.manager = manager
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
        running = manager._task is not None and not manager._task.done()
        return {
            "status": "ok" if running else "stopped",
            "model": manager.model_name,
            "sample_rate": SAMPLE_RATE,
            "frame_size": FRAME_SIZE,
            "max_sessions": settings.max_sessions,
            "free_slots": manager.free_slots(),
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
            "voices": manager.voice_names,
            "default_voice": manager.default_voice,
            "text_prompt": settings.text_prompt,
            "max_text_prompt_chars": settings.max_text_prompt_chars,
            "token_required": bool(settings.token),
            "asr": manager.transcriber is not None,
            "retrieval": manager.retriever is not None,
        }

    @app.get("/metrics")
    async def metrics_endpoint():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    async def ws_endpoint(websocket: Any) -> None:
        """``WS /ws`` (a plain Starlette WebSocket route: the session is the protocol, no dependency injection)."""
        offered = offered_subprotocols(websocket.headers.get("sec-websocket-protocol"))
        auth = authenticate(settings.token, websocket.query_params, offered)
        if not origin_allowed(websocket.headers.get("origin"), websocket.headers.get("host"), settings.allowed_origins):
            metrics.auth_failures.labels("origin").inc()
            await websocket.accept(subprotocol=auth.subprotocol)
            await websocket.close(code=CLOSE_FORBIDDEN_ORIGIN, reason="origin not allowed (see --allow-origin)")
            return
        if not auth.ok:
            metrics.auth_failures.labels("token").inc()
            await websocket.accept(subprotocol=auth.subprotocol)
            await websocket.close(code=CLOSE_UNAUTHORIZED, reason=f"unauthorized: {auth.reason}")
            return
        await websocket.accept(subprotocol=auth.subprotocol)
        session = Session(manager, websocket)
        manager.sessions.add(session)
        sender = session.sender_task = asyncio.ensure_future(session.sender())
        watchdog = asyncio.ensure_future(session.watchdog())
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                await session.handle(message)
        except Exception as exc:
            logger.debug("session %s: receive ended: %s", session.id, exc)
        finally:
            session.gone = True
            watchdog.cancel()
            await session.end("disconnect")
            manager.sessions.discard(session)
            for task in list(session._tasks):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sender

    app.router.routes.append(WebSocketRoute("/ws", ws_endpoint))
    return app


# ---------------------------------------------------------------------------------------------------- the command


class _RedactTokens(logging.Filter):
    """Remove ``token=...`` from uvicorn's access log lines."""

    _pattern = re.compile(r"(token=)[^&\s\"]*")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self._pattern.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
        return True


def uvicorn_config(app: Any, settings: ServeSettings, **overrides: Any) -> Any:
    """The uvicorn configuration ``cspan serve`` uses (WebSocket size limit, no compression of PCM)."""
    import uvicorn

    for name in ("uvicorn.access", "uvicorn.error"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _RedactTokens) for f in log.filters):
            log.addFilter(_RedactTokens())
    kwargs: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "ws_max_size": MAX_WEBSOCKET_MESSAGE_BYTES,
        "ws_per_message_deflate": False,
        "ws_ping_interval": 20.0,
        "ws_ping_timeout": 20.0,
        "lifespan": "on",
        "timeout_graceful_shutdown": 5,
        "log_level": "info",
    }
    kwargs.update(overrides)
    return uvicorn.Config(app, **kwargs)


def make_server(config: Any) -> Any:
    """A ``uvicorn.Server`` for ``config`` that says ``bye`` (reason ``shutdown``) to every session before uvicorn
    closes the connections (plain uvicorn would close them with 1012 first)."""
    import uvicorn

    class _ServeServer(uvicorn.Server):
        """A uvicorn server that says ``bye`` (reason ``shutdown``) to every session before closing connections."""

        async def shutdown(self, sockets: Any = None) -> None:
            app = self.config.loaded_app if self.config.loaded else self.config.app
            manager = _find_manager(app)
            if manager is not None:
                with contextlib.suppress(Exception):
                    await manager.end_all("shutdown")
            await super().shutdown(sockets=sockets)

    return _ServeServer(config)


def _find_manager(app: Any) -> SessionManager | None:
    for _ in range(8):  # unwrap uvicorn's middleware wrappers
        state = getattr(app, "state", None)
        manager = getattr(state, "manager", None) if state is not None else None
        if isinstance(manager, SessionManager):
            return manager
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: must be >= 1")
    return n


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{value!r}: must be > 0")
    return x


def serve_command(parser: argparse.ArgumentParser) -> None:
    """Serve live conversations in the browser over WebSocket (several at once on one batched engine)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (non-loopback needs --token)")
    g.add_argument("--port", type=int, default=8080, help="port (0 picks a free one)")
    g.add_argument(
        "--token",
        default=os.environ.get("CSPAN_TOKEN") or None,
        help="shared secret required on /ws (env CSPAN_TOKEN); open the page as /?token=...",
    )
    g.add_argument(
        "--insecure-no-token", action="store_true", help="allow a non-loopback --host without a token (trusted LANs)"
    )
    g.add_argument("--max-sessions", type=_positive_int, default=4, help="concurrent conversations (engine batch)")
    g.add_argument("--idle-timeout-s", type=_positive_float, default=60.0, help="end sessions silent this long")
    g.add_argument(
        "--max-queued-frames", type=_positive_int, default=25, help="per-session audio queue bound (frames of 80 ms)"
    )
    g.add_argument("--slot-every", type=int, default=0, help="also send a slot timing message every N frames")
    g.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="another browser origin (scheme://host:port) allowed to open /ws; repeatable; '*' for any",
    )
    g.add_argument("--max-text-prompt-chars", type=int, default=1000, help="longest persona a client may send")
    g.add_argument("--test-hooks", action="store_true", help=argparse.SUPPRESS)
    add_model_arguments(parser)
    add_backend_arguments(parser)
    parser.set_defaults(handler=_handle)


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """The :class:`ServeSettings` of parsed ``cspan serve`` arguments."""
    return ServeSettings(
        checkpoint=args.checkpoint,
        voice=args.voice,
        text_prompt=args.text_prompt,
        host=args.host,
        port=args.port,
        token=args.token,
        insecure_no_token=args.insecure_no_token,
        max_sessions=args.max_sessions,
        idle_timeout_s=args.idle_timeout_s,
        max_queued_frames=args.max_queued_frames,
        slot_every=max(0, args.slot_every),
        allowed_origins=args.allow_origin,
        max_text_prompt_chars=args.max_text_prompt_chars,
        allow_test_hooks=args.test_hooks,
        temp=args.temp,
        temp_text=args.temp_text,
        seed=args.seed,
        device=args.device,
        no_cuda_graphs=args.no_cuda_graphs,
        asr=args.asr,
        asr_model=args.asr_model,
        router=args.router,
        router_model=args.router_model,
        knowledge=args.knowledge,
        db=args.db,
        listen_s=args.listen_s,
        span_deadline_s=args.span_deadline_s,
    )


def _handle(args: argparse.Namespace) -> int:

    settings = settings_from_args(args)
    if settings.token:
        validate_token(settings.token)
    check_bind(settings.host, settings.token, insecure_no_token=settings.insecure_no_token)
    if settings.allow_test_hooks:
        logger.warning("test hooks are enabled (--test-hooks): clients may force <ret> and spans")
    app = create_app(settings)
    server = make_server(uvicorn_config(app, settings))
    server.run()
    return 0


__all__ = [
    "ServeSettings",
    "Session",
    "SessionManager",
    "create_app",
    "make_server",
    "serve_command",
    "settings_from_args",
    "uvicorn_config",
]
