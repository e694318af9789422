r"""The session core of ``cspan serve``: slots, the 80 ms frame loop, personas, Context Spans and records, behind
protocol-neutral inputs and outputs. Each wire protocol is a thin adapter (:mod:`cspan.server.adapters`).

Architecture (one process, one event loop)::

    client --protocol--> adapter (translates messages only) --inputs--> Session (per connection)
                                                                   |  start -> reserve a slot -> persona read
                                                                   v
    SessionHub frame loop (one asyncio task, 80 ms monotonic clock)
        for each live session: one queued user frame (or silence); their voice activity in one pass
                               -> Conversation.before_step (spans queued)
        ONE EngineThread.frame(pcm [N, 1920]) for all N slots (one batched step; the spans already read)
        for each live session: Conversation.after_step -> outputs (agent frame, events) -> its outbox
                               (events recorded: their writes queued, the outputs held behind them)
        for each live session: Conversation.read_spans (the next frame's spans, read and their step prepared
                               on the engine thread while the device idles until the next tick)
    Session outbox --outputs--> adapter.render -> wire messages -> client

The engine has ``batch_size = --max-sessions``; slot i of the batch belongs to at most one session. Slots with no
live session are fed silence and their outputs are discarded; a slot is reset (``engine.reset`` + ``set_persona``)
when a session starts on it. The clock never waits for a client: a session whose queue is empty hears silence for
that frame; a session sending faster than real time has its oldest queued frames dropped (and counted) once the
queue holds ``--max-queued-frames``. When the loop falls more than one frame behind (a slow step, a long persona
prefix), it skips ahead instead of bursting through the missed frames. Every engine call (persona prefixes,
Context Spans, steps) runs on the engine thread (:mod:`cspan.server.engine_thread`); nothing is read into the
model on the event loop. Every Context DB call runs on the Context DB's threads (:mod:`cspan.server.db_calls`); the
frame loop never waits for one: a session's writes (its profile and conversation row at the start, turns and span
outcomes, its end) go in order, and its outputs wait behind a pending one (at most ``--db-wait-s``), so that what
a client has seen is committed. A session is stepped (live) from its ``ready`` on: after its persona was read and
its start written.

Adapter contract
================

An adapter is one module in ``cspan/server/adapters/`` defining a subclass of
:class:`cspan.server.adapters.ProtocolAdapter` (``name``: the metrics label; ``path``: the WebSocket route). For
each accepted connection the app opens a :class:`Session` (``SessionHub.open``) and creates one adapter instance
holding it (``adapter.session``). The app does everything that is the same for all protocols: the Host and Origin
checks, the token (from ``adapter.credentials``, compared in constant time), accept, the receive loop and message
size limit, the sender task, the idle watchdog, the end of the session when the client leaves, and metrics labelled
by protocol.

What an adapter calls (inputs), from its ``opened()`` and ``receive(data)``:

- ``await session.start(StartRequest(...))``: reserve a slot and read the persona. The outcome arrives as an output:
  :class:`Ready` (the session is live; frame 0 is the next agent frame), or :class:`Busy` then :class:`Close`. An
  invalid request raises :class:`ClientError` (the session stays ``connected``).
- ``await session.set_voice_audio(data)``: before ``start``, a recording the client sent (the bytes of a file, any
  format libsndfile reads) as the session's voice (:mod:`cspan.server.voices`): :class:`VoiceSet` is queued (and
  returned), or :class:`ClientError` ``bad_voice_audio`` raised and the session keeps its voice.
- ``session.push_audio(pcm)``: the user's audio, float32 mono at 24 kHz, any length (cut into 1920-sample frames
  here; non-finite samples handled by :func:`cspan.core.audio.sanitize_pcm`). Raises :class:`ClientError`
  ``not_started`` before ``start``.
- ``session.update_profile(ProfileFields(...))``: new profile fields mid-conversation (router and Context DB).
- ``await session.stop()``: end gracefully: queued audio is played through, a running utterance is transcribed,
  then :class:`Ended` and :class:`Close`.
- ``session.client_error(code, message, detail)``: report a client mistake the adapter found (counted, sent as
  :class:`ErrorOut`; ``detail`` is for the adapter's own rendering, e.g. the offending event's id).
  :class:`ClientError` raised from ``receive`` is reported the same way by the app.
- ``session.set_tools(tools)``: this session's own tools (a client's functions) from now on (also
  ``StartRequest.tools``).
- ``session.put(item)`` with an :class:`AdapterItem`: the adapter's own output, handed back to its ``render`` in
  order with the session's outputs (e.g. what must follow the agent frames already queued).

What an adapter renders (outputs): ``adapter.render(item) -> list[str | bytes]`` is called by the sender, in order,
for every item of :data:`Outbound` except :class:`Close`: :class:`Ready`, :class:`Busy`, :class:`VoiceSet`,
:class:`AgentAudio`
(one per frame), the conversation events of :mod:`cspan.core.events` (``text``, ``user_text``, ``ret``,
``question``, ``span``, ``late``, ``no_span``, ``error``), :class:`Timing`, :class:`ErrorOut`, :class:`Ended`, and
the adapter's own :class:`AdapterItem`\ s.
It returns the wire messages to send (none to skip an item). :class:`Close` is done by the app: the socket closes
with its code once everything before it was sent.

The original server this replaces served one conversation at a time and stepped once per received frame
(reference digest, section 5.1).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from cspan.backends.context_db.models import check_coordinate, check_timezone
from cspan.core.audio import sanitize_pcm
from cspan.core.constants import FRAME_RATE, FRAME_S, FRAME_SIZE, MAX_SEED, SAMPLE_RATE
from cspan.core.errors import PersonaTooLongError, ProtocolError
from cspan.core.events import CONVERSATION_ENDED, ConversationEvent, ErrorEvent, LateEvent, NoSpanEvent, SpanEvent
from cspan.core.voice import VoicePrompt
from cspan.server.db_calls import DBCalls
from cspan.server.engine_thread import EngineThread, FrameResult, SpanHandoff
from cspan.server.records import event_write
from cspan.server.settings_common import Temperature, TopK
from cspan.server.throttle import ERROR_RATE, ErrorBudget
from cspan.server.voices import (
    VOICE_RECORDINGS_PER_SESSION,
    RecordingBudget,
    Voice,
    VoiceCatalog,
    prepare_recording,
    recording_name,
)

if TYPE_CHECKING:
    from cspan.backends.identity import Principal

logger = logging.getLogger(__name__)

OUTBOX_LIMIT = 500
"""Outputs waiting for a client that does not read; above this the session ends with ``slow_client``."""
FINISH_TIMEOUT_S = 3.0
"""How long the end of a session waits for outstanding transcripts before ``Ended``."""
OVERFLOW_REPORT_FRAMES = 50
"""At most one ``audio_overflow`` error per this many frames (4 s) while frames are being dropped."""
STOP_FLUSH_FRAMES = 12
"""After ``stop``, at most this many frames of silence are fed to end a running utterance (its final transcript)."""
PRUNE_EVERY_S = 3600.0
"""With ``--retention-days``, how often old rows are deleted (they are also deleted when the database is opened)."""
SHUTDOWN_WRITES_S = 5.0
"""At shutdown, how long the sessions' Context DB writes still queued may take before they are given up (logged)."""

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
CLOSE_INTERNAL = 1011
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN_ORIGIN = 4403
CLOSE_FORGOTTEN = 4410
FORGOTTEN_MESSAGE = "everything remembered about this user was erased (cspan db forget); start a new session"


# ---------------------------------------------------------------------------------------------------- inputs


class ClientError(ProtocolError):
    """A client mistake, with the machine-readable ``code`` every protocol reports (``error`` on ``/ws``).

    Codes: ``not_started``, ``already_started``, ``stopping``, ``invalid_message``, ``bad_voice``, ``bad_voice_audio``,
    ``audio_overflow``, ``persona_failed``, ``internal``, and those of the adapters (``bad_json``, ``bad_frame``,
    ``too_large``, ``bad_audio``, ...). The session always goes on.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


MAX_ERROR_CHARS = 1000
"""Longest error message sent to a client (longer ones are cut): an error never grows with the input."""


def brief(value: Any, limit: int = 60) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters (a client's value may be huge)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 1]}… ({len(text)} characters)"


_JSON_KINDS = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", list: "an array"}


def type_problem(data: dict[str, Any], known: Collection[str], noun: str) -> str | None:
    """Why a client's JSON object is none of the ``known`` kinds, in words (None when it is one): it has no
    ``"type"`` (``message has no "type"``), its ``"type"`` is not a string (``"type" must be a string, got null``)
    or names no known kind (``unknown message type 'dance'``). ``noun``: what the protocol calls one (message,
    event). Each protocol that reads JSON messages (``/ws``, ``/v1/realtime``) words its ``type`` errors so."""
    if "type" not in data:
        return f'{noun} has no "type"'
    kind = data["type"]
    if not isinstance(kind, str):
        return f'"type" must be a string, got {_JSON_KINDS.get(type(kind), "an object")}'
    if kind not in known:
        return f"unknown {noun} type {brief(kind)}"
    return None


class _Fields(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True, strict=True)  # a client's JSON, as is


class ProfileFields(_Fields):
    """Who the user is (all optional). ``location`` is a free-text place ("London"), ``timezone`` an IANA name.

    Whose profile this is comes from the connection's credential (the session's principal), never from a message:
    a ``user_id`` field is refused.
    """

    name: str | None = Field(default=None, max_length=80)
    location: str | None = Field(default=None, max_length=120)
    timezone: str | None = Field(default=None, max_length=64)
    lat: float | None = None
    lon: float | None = None
    notes: str | None = Field(default=None, max_length=2000)

    @model_validator(mode="before")
    @classmethod
    def _no_user_id(cls, data: Any) -> Any:
        if isinstance(data, dict) and "user_id" in data:
            raise ValueError(
                "user_id: the Context DB user is the one the credential (token) names, not a message field; remove it"
            )
        return data

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, value: str | None) -> str | None:
        return check_timezone(value) if value else None  # the Context DB's rule: one for every profile write

    @field_validator("lat", "lon")
    @classmethod
    def _coordinate(cls, value: float | None, info: ValidationInfo) -> float | None:
        return None if value is None else check_coordinate(str(info.field_name), value)


@dataclass
class StartRequest:
    """What a client asks for when it starts a conversation (every protocol maps its own fields here).

    Attributes:
        voice: a voice name of the server; None: the recording the client sent (:meth:`Session.set_voice_audio`),
            else the server's default; "": no voice prompt.
        text_prompt: the persona; None: the server's default; "": none.
        profile: the user's profile fields.
        seed: the session's sampling seed (None: the server's next seed).
        sampling: the session's sampling temperatures and top-k (each None: the server's default).
        force_ret_at, spans: test hooks (seconds on the session's timeline): forced ``<ret>``, and
            ``(seconds, text)`` Context Spans injected without a backend. Refused unless the server has test hooks.
        test: the client used its protocol's test hooks (refused unless the server has them).
        tools: this session's own tools (:class:`~cspan.backends.tools.bank.Tool`, e.g. a Realtime client's
            functions made with ``callback_tool``), added to the router's tool bank for this session only; the span
            deadline grows by ``--client-tool-timeout-s`` while there are any.
    """

    voice: str | None = None
    text_prompt: str | None = None
    profile: ProfileFields = field(default_factory=ProfileFields)
    seed: int | None = None
    sampling: SamplingOptions = field(default_factory=lambda: SamplingOptions())
    force_ret_at: list[float] = field(default_factory=list)
    spans: list[tuple[float, str]] = field(default_factory=list)
    test: bool = False
    tools: list[Any] = field(default_factory=list)

    @property
    def has_test_hooks(self) -> bool:
        return bool(self.test or self.force_ret_at or self.spans)


# ---------------------------------------------------------------------------------------------------- outputs


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingOptions(BaseModel):
    """A client's sampling parameters for its session (PersonaPlex's names; each None: the server's default).
    Temperatures: 0 (greedy) or 0.001 to 10; top-k: 0 (every token) to ``cspan.core.constants.MAX_TOP_K``. Strict,
    as a client's JSON (query parameters, which are text, are read with ``strict=False``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text_temperature: Temperature | None = None
    text_topk: TopK | None = None
    audio_temperature: Temperature | None = None
    audio_topk: TopK | None = None


class SamplingInfo(_Data):
    """The sampling parameters a session runs with (its own, or the server's defaults)."""

    text_temperature: float
    text_topk: int
    audio_temperature: float
    audio_topk: int

    @classmethod
    def of(cls, sampling: Any) -> SamplingInfo:
        """From a :class:`cspan.core.sampling.SessionSampling`."""
        text, audio = sampling.text, sampling.audio
        return cls(
            text_temperature=text.temperature,
            text_topk=text.top_k,
            audio_temperature=audio.temperature,
            audio_topk=audio.top_k,
        )


class PersonaInfo(_Data):
    """The persona the session was started with."""

    text_prompt: str
    voice: str | None
    prefix_frames: int = Field(description="frames of the persona prefix read before frame 0")
    prefill_ms: float = Field(description="host time of queueing the prefix (ms); the step after it reads it")


class ProfileInfo(_Data):
    """The profile the router and the Context DB see."""

    user_id: str
    name: str = ""
    location: str = ""
    timezone: str = ""
    lat: float | None = None
    lon: float | None = None


class SessionStats(_Data):
    """Counters of one session (frames are 80 ms)."""

    frames: int = Field(default=0, description="agent frames sent (frames the session was live)")
    user_frames: int = Field(default=0, description="user audio frames received and queued")
    consumed_frames: int = Field(default=0, description="user frames fed to the model")
    dropped_frames: int = Field(default=0, description="user frames dropped because the queue was full")
    silence_frames: int = Field(default=0, description="frames the model heard silence (no user frame queued)")
    spans: int = Field(default=0, description="Context Spans read")
    errors: int = Field(default=0, description="error messages sent")
    duration_s: float = Field(default=0.0, description="frames * 0.08")


@dataclass(frozen=True)
class Ready:
    """The session is live: the persona was read; frame 0 is the next agent frame."""

    session_id: str
    conversation_id: str
    slot: int
    seed: int
    max_queued_frames: int
    idle_timeout_s: float
    persona: PersonaInfo
    profile: ProfileInfo
    sampling: SamplingInfo


@dataclass(frozen=True)
class Busy:
    """Every slot is taken (a :class:`Close` with 1013 follows)."""

    max_sessions: int
    message: str


@dataclass(frozen=True)
class VoiceSet:
    """A recording the client sent is the session's voice now (for a start without a voice name).

    Attributes:
        voice: its name, ``recording-`` and 12 hex digits of its SHA-256 (``PersonaInfo.voice`` once started).
        frames: Mimi frames of the voice prompt (12.5 per second).
        seconds: length of the recording.
        loudness_lufs: its integrated loudness before it was normalised to -24 LUFS.
    """

    voice: str
    frames: int
    seconds: float
    loudness_lufs: float


@dataclass(frozen=True)
class AgentAudio:
    """The agent's frame ``frame``: ``pcm`` float32 [1920] at 24 kHz."""

    frame: int
    pcm: np.ndarray


@dataclass(frozen=True)
class Timing:
    """Timing of one frame (for every frame at whose head a span was read, and every ``--slot-every`` frames)."""

    frame: int
    t: float
    step_ms: float
    prefill_ms: float
    total_ms: float
    over_budget: bool
    live_sessions: int
    queued: int
    dropped_frames: int
    silence_frames: int


@dataclass(frozen=True)
class ErrorOut:
    """A client mistake or a server failure in this session (``code`` as :class:`ClientError`); it goes on.
    ``detail``: what the adapter that reported it attached (e.g. the offending event's id)."""

    code: str
    message: str
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Ended:
    """The session ended (``reason``: stop, idle, shutdown, slow_client, over_budget, revoked, forgotten, error,
    refused: a start refused on a protocol whose connection is its start, ``/api/chat``); a :class:`Close` follows."""

    reason: str
    message: str
    session_id: str
    conversation_id: str | None
    stats: SessionStats


@dataclass(frozen=True)
class Close:
    """Close the connection with ``code`` once everything before was sent (done by the app, not rendered)."""

    code: int
    reason: str


class AdapterItem:
    """Base of the items an adapter queues itself with :meth:`Session.put`; they reach its ``render`` in order with
    the session's outputs."""


Outbound = Ready | Busy | VoiceSet | AgentAudio | ConversationEvent | Timing | ErrorOut | Ended | Close | AdapterItem
"""Every item a session puts in its outbox."""


# ---------------------------------------------------------------------------------------------------- sessions


@dataclass
class _Start:
    request: StartRequest
    voice: Voice | None
    text_prompt: str
    seed: int
    sampling: Any  # cspan.core.sampling.SessionSampling
    vad: Any = None


class Session:
    """One connection's conversation: the state machine, the bounded audio queue, the outbox, the idle clock.

    States: ``connected`` (no slot) -> ``starting`` (slot reserved, persona being read) -> ``live`` (in the frame
    loop) -> ``stopping`` (``stop`` received; queued audio is played through) -> ``closed``.

    Args:
        hub: the :class:`SessionHub`.
        protocol: the adapter's name (metrics label).
        principal: who the connection's credential says the client is; ``memory`` is that principal's Context
            DB memory (:class:`~cspan.backends.context_db.UserMemory`), the only one the session reads or writes.
    """

    def __init__(self, hub: SessionHub, protocol: str, principal: Principal) -> None:
        self.hub = hub
        self.protocol = protocol
        self.principal = principal
        self.memory = hub.db.user(principal)  # its a-methods run on the hub's Context DB threads
        self.stored_profile: Any = None
        self.id = uuid.uuid4().hex
        self.state = "connected"
        self.slot: int | None = None
        self.inbox: collections.deque[np.ndarray] = collections.deque()
        self.outbox: asyncio.Queue[Outbound] = asyncio.Queue()
        self.stats = SessionStats()
        self.last_audio = time.monotonic()
        self.conversation: Any = None
        self.conversation_id: str | None = None
        self.profile: Any = None
        self.profile_fields = ProfileFields()
        self.ending = False
        self.user_forgotten = False  # a write was refused: its user was forgotten since the session began
        self.ended = False
        self.started = False  # reached ready (cspan_sessions_started_total): its end counts in _ended_total
        self._gone = asyncio.Event()
        self._errors = ErrorBudget()
        self._start: _Start | None = None
        self._events: list[ConversationEvent] = []
        self.writes = hub.db_calls.session(self.id, send=self._release, on_forgotten=self.forgotten)
        self._start_write: Callable[[], None] | None = None  # the start's writes, until they succeeded
        self.memory_span: Any = None  # its MemorySpan (--memory-span), once live
        self._partial = np.zeros(0, dtype=np.float32)
        self._last_overflow_report = -(10**9)
        self._stopping_reported = False
        self.stop_requested = False  # the client sent stop (audio after it gets one ``stopping`` error)
        self._not_started_reported = False
        self._nonfinite_reported = False
        self._flushed = 0
        self._tasks: list[asyncio.Task[Any]] = []
        self.recorded_voice: Voice | None = None
        self.voice_recordings = 0  # recordings the client sent (each is decoded, and a good one Mimi-encoded)

    # -- the connection ---------------------------------------------------------------------------------------

    @property
    def gone(self) -> bool:
        """The client is gone (its socket closed, or a send to it failed): nothing more is sent."""
        return self._gone.is_set()

    @gone.setter
    def gone(self, value: bool) -> None:
        if value:
            self._gone.set()
        else:
            self._gone.clear()

    async def wait_gone(self, timeout: float) -> bool:
        """Wait ``timeout`` seconds, or less if the client goes; returns whether it is gone. The receive loop
        waits so while its client is held back (over its message budget)."""
        if not self.gone:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gone.wait(), timeout)
        return self.gone

    # -- outputs ----------------------------------------------------------------------------------------------

    def put(self, item: Outbound) -> None:
        """Queue one output for the adapter, behind the session's pending Context DB write if there is one (held until
        it is done, or ``--db-wait-s``: :mod:`cspan.server.db_calls`). A client that stops reading ends the session
        (``slow_client``)."""
        if self.gone or self.writes.hold(item):
            return
        self._deliver(item)

    def _deliver(self, item: Outbound, *, released: bool = False) -> None:
        """Put ``item`` in the outbox now (or, past :data:`OUTBOX_LIMIT`, end the session: ``slow_client``).

        ``released``: a message that was held behind a Context DB write (:meth:`_release`); it is queued whatever
        the outbox holds. The backlog a release makes is the server's doing, not a client that does not read, and
        it is bounded: at most ``--db-wait-s`` (10 s at most) of the session's messages are held."""
        if self.gone:
            return
        if not released and self.outbox.qsize() >= OUTBOX_LIMIT and not isinstance(item, Close):
            if not self.ending:
                logger.warning(
                    "session %s: client does not read (%d outputs waiting); ending it", self.id, OUTBOX_LIMIT
                )
                while not self.outbox.empty():
                    self.outbox.get_nowait()
                self.ending = True
                self.spawn(self.end("slow_client", code=CLOSE_POLICY, message="the client did not read its messages"))
            return
        self.outbox.put_nowait(item)

    def _release(self, item: Outbound) -> None:
        """Deliver a message held behind a Context DB write (not counted against the client: :meth:`_deliver`)."""
        self._deliver(item, released=True)

    def client_error(self, code: str, message: str, detail: dict[str, Any] | None = None) -> None:
        """Report a client mistake (or a failure in this session): counted, and sent as :class:`ErrorOut` (the
        message cut to :data:`MAX_ERROR_CHARS`) within the session's error budget
        (:class:`~cspan.server.throttle.ErrorBudget`); over it, counted only, and the next error sent says how many
        were not."""
        self.count_error(code)
        suffix = self.error_admitted()
        if suffix is None:
            return
        room = MAX_ERROR_CHARS - len(suffix)
        if len(message) > room:
            message = message[: room - 1] + "…"
        self.put(ErrorOut(code=code, message=message + suffix, detail=detail or {}))

    def error_admitted(self) -> str | None:
        """Whether one more ``error`` may be sent to the client (the caller counted it already): None if not (over
        the error budget), else what to append to its message (how many errors were not sent before it, or "")."""
        unsent = self._errors.admit()
        if unsent is None:
            return None
        return f" ({unsent} more errors before this one were not sent: over {ERROR_RATE:g} a second)" if unsent else ""

    def count_error(self, code: str) -> None:
        """Count a client mistake that the adapter reports in its own rendering (:meth:`client_error` counts and
        sends)."""
        self.stats.errors += 1
        self.hub.metrics.protocol_errors.labels(self.protocol, code).inc()

    def _close(self, code: int, reason: str) -> None:
        self.put(Close(code, reason[:120]))

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run ``coro`` as a task the session waits for when the connection ends."""
        task = asyncio.ensure_future(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)
        return task

    def _on_event(self, event: ConversationEvent) -> None:
        """``Conversation.on_event``: collected, then published by the frame loop (after the step completes them)."""
        self._events.append(event)
        if self.memory_span is not None:
            self.memory_span.on_event(event)

    def _take_events(self) -> list[ConversationEvent]:
        events, self._events = self._events, []
        return events

    def record(self, what: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        """Queue a Context DB write of this session (:attr:`writes`: in order, off the event loop). While the start's
        writes (the profile and the conversation row, :meth:`record_start`) have not succeeded (the database was
        away when they ran), they are run again first, on the same thread: a conversation started during an outage
        is recorded from the first write after it, not lost with every turn that needs its row."""

        def run() -> Any:
            start = self._start_write
            if start is not None:
                start()
                self._start_write = None
            return fn(*args, **kwargs)

        self.writes.write(what, run)

    def record_start(self, start: Callable[[], None]) -> None:
        """Queue the start's writes (``start``: the profile, then the conversation row; idempotent), kept to be run
        again before each later write until they succeed (:meth:`record`)."""
        self._start_write = start
        self.record("start a conversation", lambda: None)

    def _publish(self, events: list[ConversationEvent], *, send: bool = True) -> None:
        """Count, record in the Context DB (queued: :attr:`writes`) and (unless ``send`` is False) queue conversation
        events; an event that is recorded is sent once its write is done."""
        for ev in events:
            self.hub.observe_event(self, ev)
            write = event_write(self.memory, self.conversation_id, ev) if self.conversation_id is not None else None
            if write is not None:
                self.record(*write)
            if isinstance(ev, ErrorEvent):
                self.stats.errors += 1
            if send:
                self.put(ev)

    # -- inputs -----------------------------------------------------------------------------------------------

    def push_audio(self, pcm: np.ndarray) -> None:
        """Queue user audio: float32 mono at 24 kHz, any length (cut into frames of 1920 samples).

        Raises:
            ClientError: ``not_started`` before ``start`` (once per connection: a client streaming its microphone
                before a start that was refused gets one error, not one per frame; later audio before a start is
                dropped silently). After the client's ``stop`` audio is ignored (reported once, code ``stopping``);
                after an end for another reason (shutdown, forget, slow client, ...: the client gets or got ``bye``)
                it is ignored silently. NaN or infinite samples become silence (reported once, code ``bad_audio``).
        """
        if self.state == "connected":
            if self._not_started_reported:
                return
            self._not_started_reported = True
            raise ClientError(
                "not_started",
                "audio before start is dropped (reported once): start the conversation and wait until it is ready",
            )
        if self.state in ("stopping", "closed"):
            if self.stop_requested and not self._stopping_reported:
                self._stopping_reported = True
                self.client_error("stopping", "audio after stop is ignored")
            return
        self.last_audio = time.monotonic()
        pcm, nonfinite = sanitize_pcm(np.asarray(pcm, dtype=np.float32).reshape(-1))
        if nonfinite and not self._nonfinite_reported:
            self._nonfinite_reported = True
            self.client_error(
                "bad_audio", f"{nonfinite} NaN or infinite samples were replaced by silence (reported once)"
            )
        if self._partial.size:
            pcm = np.concatenate([self._partial, pcm])
        whole = pcm.size // FRAME_SIZE
        self._partial = pcm[whole * FRAME_SIZE :].copy()
        for k in range(whole):
            self._queue_frame(pcm[k * FRAME_SIZE : (k + 1) * FRAME_SIZE])

    def _queue_frame(self, frame: np.ndarray) -> None:
        hub = self.hub
        self.stats.user_frames += 1
        hub.metrics.user_frames.labels(self.protocol).inc()
        limit = hub.settings.max_queued_frames
        if len(self.inbox) >= limit:
            self.inbox.popleft()
            self.stats.dropped_frames += 1
            hub.metrics.user_frames_dropped.labels(self.protocol).inc()
            if self.stats.frames - self._last_overflow_report >= OVERFLOW_REPORT_FRAMES:
                self._last_overflow_report = self.stats.frames
                self.client_error(
                    "audio_overflow",
                    f"audio arrives faster than the session consumes it (one frame per 80 ms tick): the queue holds "
                    f"{limit} frames and the oldest are dropped ({self.stats.dropped_frames} so far)",
                )
        self.inbox.append(frame)
        if hub.unpaced:
            hub._wake.set()

    async def set_voice_audio(self, data: bytes) -> VoiceSet:
        """Make a recording the client sent (the bytes of a file: 2 to 30 s of speech, any format libsndfile reads,
        at most :data:`~cspan.server.voices.VOICE_AUDIO_MAX_BYTES`) the voice of this session's persona, for a
        ``start`` without a voice name, and queue :class:`VoiceSet` (also returned). Read off the event loop;
        Mimi-encoded on the engine thread.

        Raises:
            ClientError: ``already_started`` after ``start`` (the persona is read already); ``bad_voice_audio``: too
                large, not audio, too short or too long, silent (the message says which), or more than
                :data:`~cspan.server.voices.VOICE_RECORDINGS_PER_SESSION` on one session or more than
                :data:`~cspan.server.voices.VOICE_RECORDINGS_PER_USER` of its user in a minute, over all the user's
                connections (:class:`~cspan.server.voices.RecordingBudget`); the session keeps the voice it had.
        """
        from cspan.core.errors import AudioInputError

        if self.state != "connected":
            raise ClientError(
                "already_started",
                f"a voice recording while the session is {self.state}: the persona is read with the voice it had; "
                "send the recording before start",
            )
        kept = f" ({self.recorded_voice.name})" if self.recorded_voice is not None else ""
        self.voice_recordings += 1
        if self.voice_recordings > VOICE_RECORDINGS_PER_SESSION:
            raise ClientError(
                "bad_voice_audio",
                f"more than {VOICE_RECORDINGS_PER_SESSION} voice recordings on one connection (each is decoded and "
                f"encoded on the server); the session keeps its voice{kept}",
            )
        budget, user = self.hub.recordings, self.principal.user_id
        if not budget.take(user):
            raise ClientError(
                "bad_voice_audio",
                f"more than {budget.per_window} voice recordings of this user in {budget.window_s:g} s over all its "
                f"connections (each is decoded and encoded on the server); send it again later; the session keeps "
                f"its voice{kept}",
            )
        async with budget.lock(user):  # one at a time per user: the engine thread runs frames between them
            try:
                audio = await asyncio.to_thread(prepare_recording, data)
            except AudioInputError as exc:
                raise ClientError("bad_voice_audio", f"{exc}; the session keeps its voice{kept}") from None
            codes = await self.hub.engine_thread.encode_voice(audio)
        name = recording_name(data)
        voice = Voice(name, VoicePrompt(source=Path(name), codes=codes))
        if self.state == "connected":  # not started (or gone) while it was read
            self.recorded_voice = voice
        self.hub.metrics.voice_recordings.labels(self.protocol).inc()
        done = VoiceSet(
            voice=name,
            frames=int(codes.shape[-1]),
            seconds=round(audio.samples / SAMPLE_RATE, 3),
            loudness_lufs=round(audio.loudness_lufs, 2),
        )
        self.put(done)
        return done

    async def start(self, request: StartRequest) -> None:
        """Reserve a slot and have the frame loop read the persona (then :class:`Ready`), or :class:`Busy`.

        Raises:
            ClientError: ``already_started``, ``invalid_message`` (test hooks on a server without them, a persona
                over ``--max-text-prompt-chars``), ``bad_voice``, ``internal`` (the voice activity detector failed).
        """
        hub = self.hub
        settings = hub.settings
        if self.state != "connected":
            raise ClientError("already_started", f"start while the session is {self.state}; stop first")
        if request.has_test_hooks and not settings.test_hooks:
            raise ClientError("invalid_message", "test hooks are disabled on this server")
        if request.seed is not None and not 0 <= request.seed <= MAX_SEED:
            raise ClientError("invalid_message", f"seed {request.seed}: must be in [0, 2**63)")
        prompt = settings.text_prompt if request.text_prompt is None else request.text_prompt
        if request.text_prompt is not None and len(prompt) > settings.max_text_prompt_chars:
            raise ClientError(
                "invalid_message",
                f"text_prompt: {len(prompt)} characters, over this server's limit of {settings.max_text_prompt_chars}",
            )
        if request.voice is None and self.recorded_voice is not None:
            voice: Voice | None = self.recorded_voice
        else:
            voice = await hub.voice(request.voice)
        self.profile_fields = request.profile
        seed = request.seed if request.seed is not None else hub.next_seed()
        sampling = hub.sampling(request.sampling)
        per_user = settings.max_sessions_per_user
        over_user = bool(per_user) and hub.slots_of(self.principal.user_id) >= per_user
        if hub.draining or over_user or hub.reserve(self) is None:
            hub.metrics.sessions_busy.labels(self.protocol).inc()
            if hub.draining:
                message = "this server is shutting down; connect again (another replica will take the conversation)"
            elif over_user:
                hub.metrics.user_limit_refusals.labels(self.protocol, "sessions").inc()
                message = (
                    f"this user's conversations reached this server's limit per user ({per_user}, "
                    "--max-sessions-per-user); end one first"
                )
            else:
                message = f"all {settings.max_sessions} conversation slots are in use; try again later"
            self.put(Busy(max_sessions=settings.max_sessions, message=message))
            self.state = "closed"
            self.ending = self.ended = True
            self._close(CLOSE_TRY_AGAIN_LATER, "busy")
            return
        self.state = "starting"
        self.last_audio = time.monotonic()
        start = _Start(request, voice, prompt, seed, sampling)
        try:
            start.vad = await asyncio.to_thread(hub.make_vad)
        except Exception as exc:
            logger.exception("session %s: voice activity detector failed to load", self.id)
            hub.release(self)
            self.state = "connected"
            raise ClientError("internal", f"voice activity detector failed: {exc}") from None
        calls = hub.db_calls
        try:
            self.stored_profile = await calls.within(calls.run(self.memory.get_profile))
        except Exception as exc:  # the conversation goes on without what was remembered
            logger.warning("Context DB: could not read the profile of %s: %s", self.principal.user_id, exc)
        if self.state != "starting":  # stopped or gone while the detector loaded
            return
        self._start = start
        hub.request_start(self)

    def set_tools(self, tools: list[Any]) -> None:
        """This session's own tools from now on (see ``StartRequest.tools``); ``[]`` removes them. A retrieval
        already running keeps the tools it started with."""
        if self._start is not None:
            self._start.request.tools = list(tools)
        if self.conversation is not None:
            self.conversation.retriever = self.hub.retriever_for(self, tools)
            self.conversation.config.span_deadline_s = self.hub.span_deadline_s(tools)

    async def set_sampling(self, options: SamplingOptions) -> SamplingInfo:
        """Change the given sampling parameters of this started session, from the engine's next step on (before
        ``start``, give them in :class:`StartRequest`). Returns the parameters now in effect.

        Raises:
            ClientError: ``not_started`` before the start was accepted; ``invalid_message`` for values the engine
                refuses.
        """
        start = self._start
        if start is None or self.slot is None or self.state not in ("starting", "live", "stopping"):
            raise ClientError(
                "not_started", f"sampling change while the session is {self.state}; give it with the start"
            )
        start.sampling = self.hub.sampling(options, start.sampling)
        await self.hub.engine_thread.set_sampling(self.slot, start.sampling)
        return SamplingInfo.of(start.sampling)

    def update_profile(self, fields: ProfileFields) -> None:
        """Replace the given profile fields; the router and the Context DB see them from the next retrieval on.

        Raises:
            ClientError: ``not_started`` before ``start``.
        """
        if self.state not in ("starting", "live", "stopping"):
            raise ClientError("not_started", f"profile update while the session is {self.state}; start first")
        self.profile_fields = self.profile_fields.model_copy(update=fields.model_dump(exclude_unset=True))
        if self.conversation is not None:
            self.profile = self.hub.make_profile(self, self._start.text_prompt if self._start else "")
            self.conversation.profile = self.profile
            changes = self.hub.profile_changes(self, self._start.text_prompt if self._start else "")
            self.record("store the profile", self.memory.merge_profile, changes)

    async def stop(self) -> None:
        """End the conversation: queued audio is played through (and a running utterance ended), then ``Ended``."""
        if not self.ending:
            self.stop_requested = True
        if self.state == "live":
            self.state = "stopping"  # the frame loop plays the queue through, then ends the session
        elif self.state in ("connected", "starting"):
            await self.end("stop")

    # -- lifecycle --------------------------------------------------------------------------------------------

    async def watchdog(self) -> None:
        """End the session after ``idle_timeout_s`` without audio (also a connection that never starts). The idle
        time counts from the last audio received or, while audio is still queued, from now."""
        timeout = self.hub.settings.idle_timeout_s
        while not self.ending:
            await asyncio.sleep(min(1.0, timeout / 4))
            if self.state == "starting" or self.inbox:  # reading the persona, or playing queued audio: not idle
                self.last_audio = time.monotonic()
            elif not self.ending and time.monotonic() - self.last_audio > timeout:
                await self.end("idle", message=f"no audio for {timeout:g} s")
                return

    async def end(self, reason: str, *, code: int = CLOSE_NORMAL, message: str = "") -> None:
        """End the session once: free the slot, finish the conversation, record, :class:`Ended` and :class:`Close`.

        The conversation's end time (epoch seconds: when the session ended here, however late the database takes the
        write) is written after the session's other writes, and :class:`Ended` is sent once it is (or after
        ``--db-wait-s``). A session whose client is gone (:meth:`disconnected`) records everything but sends nothing.
        Counted in ``cspan_sessions_ended_total`` once the session reached ``ready``, else in
        ``cspan_sessions_unstarted_total``.
        """
        if self.ended:
            return
        self.ended = True
        self.ending = True
        hub = self.hub
        hub.release(self)
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
            self._publish(self._take_events(), send=not self.gone)
        if self.conversation_id is not None:
            self.record(
                f"end conversation {self.conversation_id}",
                self.memory.end_conversation,
                self.conversation_id,
                ended_at=time.time(),  # now, not when the write runs (after a stalled database answers)
            )
        await self.writes.settle(hub.db_calls.wait_s)
        counter = hub.metrics.sessions_ended if self.started else hub.metrics.sessions_unstarted
        counter.labels(self.protocol, reason).inc()
        self.stats.duration_s = round(self.stats.frames * FRAME_S, 3)
        if not self.gone:
            self.put(
                Ended(
                    reason=reason,
                    message=message,
                    session_id=self.id,
                    conversation_id=self.conversation_id,
                    stats=self.stats.model_copy(),
                )
            )
            self._close(code, reason)
        logger.info("session %s (%s) ended (%s): %s", self.id, self.protocol, reason, self.stats.model_dump())

    async def end_forgotten(self) -> None:
        """End the session because its user was forgotten (``cspan db forget``) after it began: reason ``forgotten``,
        close 4410. The Context DB refuses its writes already, so nothing it holds is written back."""
        if not self.ending:
            logger.info("session %s: %s was forgotten (cspan db forget); ending it", self.id, self.principal.user_id)
            await self.end("forgotten", code=CLOSE_FORGOTTEN, message=FORGOTTEN_MESSAGE)

    def forgotten(self) -> None:
        """A write of this session was refused because its user was forgotten: :meth:`end_forgotten` in a task,
        spawned once (later refusals, before the task runs, only find the flag set)."""
        if not self.ending and not self.user_forgotten:
            self.user_forgotten = True
            self.spawn(self.end_forgotten())

    async def disconnected(self, reason: str = "disconnect") -> None:
        """The client is gone: end the session (recording what happened) and wait for its tasks. ``reason``:
        ``disconnect``, or ``slow_client`` when the WebSocket keepalive closed the connection (the client did not
        read the ping); nothing is sent either way."""
        self.gone = True
        await self.end(reason)
        self.hub.sessions.discard(self)
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


# ---------------------------------------------------------------------------------------------------- the hub


def public_model_name(checkpoint: str) -> str:
    """``checkpoint`` as clients may see it: a Hub repo id (``nvidia/personaplex-7b-v1``) as it is; a local file or
    folder (one that exists here) by its last component, without the folders above it."""
    path = Path(checkpoint).expanduser()
    try:
        local = path.exists()
    except OSError:  # a name too long for a path, say
        local = False
    return path.name if local and path.name else checkpoint


class SessionHub:
    """The engine, its slots, the shared backends and the frame loop.

    Args:
        settings: :class:`~cspan.server.serve_settings.ServeSettings`.
        checkpoint: the loaded :class:`~cspan.core.checkpoint.Checkpoint`.
        engine: a :class:`~cspan.core.engine.DuplexEngine` with ``batch_size == settings.max_sessions``.
        db: the :class:`~cspan.backends.context_db.ContextDB`; each session reads and writes only its principal's
            memory (``db.user(principal)``). Its calls run on the hub's threads (:attr:`db_calls`, made its
            ``executor`` here, given back at :meth:`shutdown`), never on the event loop.
        metrics: :class:`~cspan.server.metrics.ServerMetrics`.
        backends: ``async backends() -> Backends`` (:class:`cspan.server.shared_backends.Backends`: the transcriber, the shared
            retriever and tool bank, ``for_session(memory, tools)``, ``aclose()``), awaited once by
            :meth:`prepare` on the event loop that serves (MCP sessions belong to it).
    """

    def __init__(
        self,
        settings: Any,
        checkpoint: Any,
        engine: Any,
        db: Any,
        metrics: Any,
        backends: Callable[[], Awaitable[Any]],
    ) -> None:
        self.settings = settings
        self.checkpoint = checkpoint
        self.engine = engine
        self.engine_thread = EngineThread(engine)
        self.db = db
        self.metrics = metrics
        self.db_calls = DBCalls(settings.db_wait_s, metrics)
        db.executor = self.db_calls.executor  # the retriever's, memory tools' and token lookups' calls too
        self.backends: Any = None
        self._build_backends = backends
        self.draining = False
        self._prune: asyncio.Task[None] | None = None
        self.slots: list[Session | None] = [None] * engine.batch_size
        self.sessions: set[Session] = set()
        self._starts: collections.deque[Session] = collections.deque()
        self._wake = asyncio.Event()
        self.unpaced = bool(getattr(settings, "unpaced", False))  # tests: the clients' audio is the clock
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._session_counter = 0
        self._silence = np.zeros(FRAME_SIZE, dtype=np.float32)
        self.voices = VoiceCatalog(checkpoint, settings.voice)  # the default is loaded now: a broken file fails here
        self.recordings = RecordingBudget()  # clients' voice recordings, per user over all its connections
        self.voices.check_default_persona(settings.text_prompt)  # and one that leaves no room to talk
        self.model_name = str(settings.checkpoint or getattr(checkpoint, "source", None) or "default")
        """The checkpoint as given (a Hub repo id or a local path): what the Context DB records of a conversation."""
        self.public_model_name = public_model_name(self.model_name)
        """What clients are told (``/health``, a Realtime session's ``model``): a local path's last component only,
        so that the server's file system is not shown to anyone who asks."""

    @property
    def running(self) -> bool:
        """Whether the frame loop runs."""
        return self._task is not None and not self._task.done()

    async def prepare(self) -> None:
        """Build the backends (tool bank, MCP servers, router) on this event loop; once.

        Raises:
            CspanError: a backend cannot be built (an MCP server does not start, two tools share a name).
        """
        if self.backends is None:
            self.backends = await self._build_backends()

    @property
    def transcriber(self) -> Any:
        """The shared transcriber (None without one, or before :meth:`prepare`)."""
        return getattr(self.backends, "transcriber", None)

    @property
    def retriever(self) -> Any:
        """The shared retriever, whose router sees the shared tool bank (None without retrieval)."""
        return getattr(self.backends, "retriever", None)

    def retriever_for(self, session: Session, tools: list[Any]) -> Any:
        """The retriever of ``session``: its principal's memory, its own router over the shared tool bank plus the
        principal's memory tools and ``tools`` (e.g. a client's functions; an LLM router's time limit then grows by
        ``--client-tool-timeout-s``: a client's function is part of the routing time; the local router picks its
        tools by rule and never calls a client's). None without retrieval."""
        if self.backends is None:
            return None
        extra_s = self.settings.client_tool_timeout_s if tools else 0.0
        return self.backends.for_session(session.memory, tools, extra_timeout_s=extra_s)

    def tool_names(self) -> set[str]:
        """The names of this server's own tools that a session's router sees (a client's function may not take
        one)."""
        return self.backends.tool_names() if self.backends is not None else set()

    def mcp_states(self) -> dict[str, int]:
        """How many ``--mcp`` servers are ``up``, ``reconnecting`` and ``down`` (all 0 without any, or before
        :meth:`prepare`)."""
        from cspan.backends.tools.bank import MCP_STATES

        bank = getattr(self.backends, "bank", None)
        return bank.mcp_states() if bank is not None else dict.fromkeys(MCP_STATES, 0)

    def health(self) -> tuple[str, int]:
        """``(status, free slots)``: ``ok`` (a slot is free), ``full``, ``draining`` (shutting down) or ``stopped``."""
        free = self.free_slots()
        if not self.running:
            return "stopped", free
        if self.draining:
            return "draining", free
        return ("ok" if free else "full"), free

    def connections_of(self, user_id: str) -> int:
        """The connections of ``user_id`` open now, started or not: sessions whose client is not gone. A session
        whose client closed no longer counts while it ends (its transcripts and Context DB writes can take seconds):
        a client that closes and connects again at once is not refused for the connection it just closed."""
        return sum(s.principal.user_id == user_id and not s.gone for s in self.sessions)

    def slots_of(self, user_id: str) -> int:
        """The engine slots ``user_id``'s sessions hold now."""
        return sum(s is not None and s.principal.user_id == user_id for s in self.slots)

    def open(self, protocol: str, principal: Principal) -> Session:
        """A new session for an accepted connection of ``protocol``."""
        session = Session(self, protocol, principal)
        self.sessions.add(session)
        return session

    # -- voices, profiles, records -----------------------------------------------------------------------------

    @property
    def voice_names(self) -> list[str]:
        """The server's named voices (``GET /info``)."""
        return self.voices.names

    def sampling(self, options: SamplingOptions, base: Any = None) -> Any:
        """The :class:`cspan.core.sampling.SessionSampling` of ``options`` over ``base`` (default: the engine's
        defaults, from ``--temp`` / ``--temp-text``).

        Raises:
            ClientError: ``invalid_message`` for values the engine refuses.
        """
        from cspan.core.sampling import SamplingParams, SessionSampling

        engine = self.engine
        if base is None:
            base = SessionSampling(engine.text_params, engine.audio_params)

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        o = options
        try:
            text = SamplingParams(
                pick(o.text_temperature, base.text.temperature), pick(o.text_topk, base.text.top_k)
            ).check("text", engine.lm.text_linear.out_features)
            audio = SamplingParams(
                pick(o.audio_temperature, base.audio.temperature), pick(o.audio_topk, base.audio.top_k)
            ).check("audio", engine.lm.card)
        except ValueError as exc:
            raise ClientError("invalid_message", str(exc)) from None
        return SessionSampling(text, audio)

    @property
    def default_voice(self) -> str | None:
        """The voice of a session that names none (None: no voice prompt)."""
        return self.voices.default

    async def voice(self, requested: str | None) -> Voice | None:
        """The named voice ``requested`` (None: the default; "": none), loaded the first time it is asked for.

        Raises:
            ClientError: ``bad_voice``: not a voice of this server, or its file cannot be read.
        """
        from cspan.core.errors import CspanError

        try:
            return await self.voices.get(requested, self.engine_thread)
        except KeyError:
            raise ClientError(
                "bad_voice", f"voice {brief(requested)}: not a voice of this server; use one of {self.voice_names}"
            ) from None
        except CspanError as exc:
            logger.error("voice %s cannot be loaded: %s", requested, exc)
            raise ClientError("bad_voice", f"voice {brief(requested)} cannot be loaded on this server: {exc}") from None

    def next_seed(self) -> int:
        self._session_counter += 1
        return self.settings.seed + self._session_counter - 1

    def span_deadline_s(self, tools: list[Any]) -> float:
        """The span deadline of a session: ``--span-deadline-s``, plus ``--client-tool-timeout-s`` while the session
        has tools of its own (a client's function call is part of the retrieval)."""
        return self.settings.span_deadline_s + (self.settings.client_tool_timeout_s if tools else 0.0)

    def make_vad(self) -> Any:
        from cspan.core.vad import SileroVAD

        return SileroVAD()

    def make_profile(self, session: Session, text_prompt: str) -> Any:
        """The session's :class:`~cspan.backends.context_db.Profile`: the principal's stored profile with the
        fields the client gave over it (:meth:`profile_changes`); ``user_id`` is the principal's. When the start
        could not read the stored profile (the database did not answer within ``--db-wait-s``, or failed) it is the
        client's fields alone, for the whole conversation; the stored one is not erased for that: the session
        writes only its :meth:`profile_changes`."""
        from cspan.backends.context_db import Profile

        base = session.stored_profile or Profile()
        return base.model_copy(
            update={**self.profile_changes(session, text_prompt), "user_id": session.principal.user_id}
        )

    @staticmethod
    def profile_changes(session: Session, text_prompt: str) -> dict[str, Any]:
        """What the session changes in the stored profile (``UserMemory.merge_profile``): the fields the client
        gave (not None) and the persona; every other stored field is kept."""
        f = session.profile_fields
        given = {
            "name": f.name,
            "city": f.location,
            "timezone": f.timezone,
            "lat": f.lat,
            "lon": f.lon,
            "notes": f.notes,
        }
        return {**{k: v for k, v in given.items() if v is not None}, "persona": text_prompt}

    def observe_event(self, session: Session, event: ConversationEvent) -> None:
        """Metrics and per-session counters of a conversation event."""
        m = self.metrics
        if isinstance(event, SpanEvent):
            session.stats.spans += 1
            m.spans.labels("injected").inc()
            m.prefill_seconds.observe(event.prefill_ms / 1000.0)
        elif isinstance(event, LateEvent):
            m.spans.labels("late").inc()
        elif isinstance(event, NoSpanEvent) and event.error == CONVERSATION_ENDED:
            m.spans.labels("cancelled").inc()  # cut by the session's end, as its span row says: no failure
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
        """Start the frame loop task (in the running event loop), and the hourly retention task with
        ``--retention-days``."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        if self._prune is None and getattr(self.settings, "retention_days", None):
            self._prune = asyncio.ensure_future(self._prune_loop())

    async def _prune_loop(self) -> None:
        while True:
            await asyncio.sleep(PRUNE_EVERY_S)
            try:
                removed = await self.db.aprune()
                logger.info("Context DB retention (%g days): removed %s", self.settings.retention_days, removed)
            except Exception as exc:
                logger.warning("Context DB retention failed: %s", exc)

    async def drain(self, timeout_s: float, *, give_up: Callable[[], bool] = lambda: False) -> None:
        """Take no new conversation (``/health`` answers 503, ``start`` answers busy) and wait up to ``timeout_s``
        (or until ``give_up()``) for the running ones to end."""
        self.draining = True
        running = len(self.slots) - self.free_slots()
        shown = logging.getLogger("uvicorn.error")  # beside uvicorn's own shutdown lines, shown by default
        if running and timeout_s > 0:
            shown.info(
                "draining: no new conversations; %d running may go on for up to %g s (a second SIGTERM or Ctrl-C "
                "ends them now)",
                running,
                timeout_s,
            )
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while self.free_slots() < len(self.slots) and time.monotonic() < deadline and not give_up():
            await asyncio.sleep(0.1)
        left = len(self.slots) - self.free_slots()
        if running:
            shown.info("drained after %.1f s: %d conversation(s) still running end now", time.monotonic() - t0, left)

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
                if self.unpaced:
                    await self._frames_queued()
                    await self._tick()
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

    async def _frames_queued(self) -> None:
        """``--unpaced`` (tests): wait until every live session has a frame queued or is stopping, or one frame's
        time has passed without (then the tick feeds silence, as the paced loop does)."""
        while not self._closing and not self._starts:
            if all(s.inbox or s.state == "stopping" for s in self._live()):
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), FRAME_S)
            except TimeoutError:
                return

    async def _start_session(self, session: Session) -> None:
        """Read the persona of a session that reserved a slot (on the engine thread; the frame loop waits for it),
        then queue its profile and conversation row and let :meth:`_go_live` wait for them: the frame loop does not
        (the slot stays out of the live set, not stepped, until then)."""
        req = session._start
        slot = session.slot
        if req is None or slot is None or session.state != "starting":
            return
        profile = self.make_profile(session, req.text_prompt)
        t0 = time.perf_counter()
        try:
            report = await self.engine_thread.prepare(
                slot,
                seed=req.seed,
                sampling=req.sampling,
                text_prompt=req.text_prompt,
                voice=req.voice.prompt if req.voice is not None else None,
                user_name=profile.name or None,
                user_city=profile.city or None,
            )
        except Exception as exc:
            if isinstance(exc, PersonaTooLongError):  # the client's prompt: said to it, no server fault
                logger.info("session %s: persona refused: %s", session.id, exc)
                why = (
                    f"the persona takes {exc.frames} of the model's {exc.window} positions and leaves no room to "
                    "talk: shorten the text prompt (an emoji or a rare character takes several tokens) or the voice"
                )
            else:
                logger.exception("session %s: persona prefix failed", session.id)
                why = f"the persona prefix could not be read ({type(exc).__name__}: {exc})"
            self.release(session)
            if session.state == "starting":
                session.state = "connected"
                session.client_error("persona_failed", why)
            return
        self.metrics.persona_prefill_seconds.observe(time.perf_counter() - t0)
        if session.state != "starting" or session.slot != slot:
            return
        session.profile = self.make_profile(session, req.text_prompt)  # the client may have updated it meanwhile
        session.conversation_id = uuid.uuid4().hex  # made here: Ready needs no answer from the database
        # only the fields given, over what is stored when the write runs: a start that could not read the stored
        # profile (the database did not answer) must not erase it
        changes = self.profile_changes(session, req.text_prompt)
        start_conversation = functools.partial(
            session.memory.start_conversation,
            session.conversation_id,
            started_at=time.time(),  # now, not when the write runs (after a stalled database answers)
            checkpoint=self.model_name,
            settings={
                "session_id": session.id,
                "protocol": session.protocol,
                "voice": req.voice.name if req.voice is not None else None,
                "seed": req.seed,
                "app": "serve",
            },
        )

        def start() -> None:  # both idempotent: run again before each later write until they succeed
            session.memory.merge_profile(changes)
            start_conversation()

        session.record_start(start)
        session.spawn(self._go_live(session, slot, report))

    async def _go_live(self, session: Session, slot: int, report: Any) -> None:
        """Once the start's writes are done (or ``--db-wait-s`` passed: the conversation is unrecorded until the
        database answers), make ``session`` live and send :class:`Ready`; nothing if it ended meanwhile (a refused
        write: its user was forgotten since the start read the profile)."""
        from cspan.core.runtime import Conversation, ConversationConfig

        await session.writes.settle(self.db_calls.wait_s)
        req = session._start
        if req is None or session.state != "starting" or session.slot != slot or session.ending:
            return
        profile = self.make_profile(session, req.text_prompt)
        if profile != session.profile:  # the client updated it while the start was written
            session.profile = profile
            changes = self.profile_changes(session, req.text_prompt)
            session.record("store the profile", session.memory.merge_profile, changes)
        conversation_id = session.conversation_id
        if getattr(self.settings, "memory_span", False):
            from cspan.server.memory_span import MemorySpan

            session.memory_span = MemorySpan(getattr(self.engine_thread.engine, "context", None))
        tools = req.request.tools
        config = ConversationConfig(
            listen_s=self.settings.listen_s,
            span_deadline_s=self.span_deadline_s(tools),
            span_delay_s=None,
            keep_history=False,  # events go to the client as they happen: memory stays bounded over any duration
        )
        conversation = Conversation(
            SpanHandoff(self.engine_thread),
            slot,
            tokenizer=getattr(self.checkpoint, "tokenizer", None),
            transcriber=self.transcriber,
            retriever=self.retriever_for(session, tools),
            config=config,
            profile=profile,
            conversation_id=conversation_id,
            vad=req.vad,
            on_event=session._on_event,
        )
        for t in req.request.force_ret_at:
            conversation.schedule_ret(round(t * FRAME_RATE))
        for t, text in req.request.spans:
            conversation.schedule_span(round(t * FRAME_RATE), text)
        session.conversation = conversation
        session.state = "live"
        session.last_audio = time.monotonic()  # the idle clock starts when the session is live
        session.started = True
        self.metrics.sessions_started.labels(session.protocol).inc()
        session.put(
            Ready(
                session_id=session.id,
                conversation_id=conversation_id,
                slot=slot,
                seed=req.seed,
                max_queued_frames=self.settings.max_queued_frames,
                idle_timeout_s=self.settings.idle_timeout_s,
                persona=PersonaInfo(
                    text_prompt=req.text_prompt,
                    voice=req.voice.name if req.voice is not None else None,
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
                sampling=SamplingInfo.of(req.sampling),
            )
        )
        self._wake.set()  # the frame loop may be asleep with no live session

    def _next_frame(self, s: Session) -> np.ndarray | None:
        """The user frame ``s`` feeds at this tick: its oldest queued frame, or silence; None once a stopping
        session is done (its queue played through and no utterance left running)."""
        if s.inbox:
            s.stats.consumed_frames += 1
            return s.inbox.popleft()
        if s.state == "stopping":
            utterances = getattr(s.conversation, "utterances", None)
            if utterances is None or utterances.current is None or s._flushed >= STOP_FLUSH_FRAMES:
                return None
            utterances.request_cut()  # silence until the running utterance ends: its final transcript
            s._flushed += 1
        s.stats.silence_frames += 1
        self.metrics.silence_frames.inc()
        return self._silence

    @staticmethod
    def _voice_activity(feeding: list[tuple[Session, np.ndarray]]) -> list[bool | None]:
        """The sessions' voice activity for their frames in one pass of the detector
        (:func:`cspan.core.runtime.voice_activity`); on a failure each session's ``before_step`` runs its own
        detector (and a session whose detector fails ends alone)."""
        from cspan.core.runtime import voice_activity

        try:
            return voice_activity([s.conversation for s, _ in feeding], [frame for _, frame in feeding])
        except Exception:
            logger.exception("frame loop: batched voice activity failed; running each session's detector")
            return [None] * len(feeding)

    async def _tick(self) -> None:
        """One 80 ms frame for every live session (see the module docstring)."""
        t0 = time.perf_counter()
        pcm = np.zeros((self.engine_thread.batch_size, FRAME_SIZE), dtype=np.float32)
        feeding: list[tuple[Session, np.ndarray]] = []
        for s in self._live():
            frame = self._next_frame(s)
            if frame is None:
                self.release(s)
                s.spawn(s.end("stop"))
                continue
            pcm[s.slot] = frame
            feeding.append((s, frame))
        voiced = self._voice_activity(feeding)
        heads: dict[Session, tuple[int, list[ConversationEvent]]] = {}
        for (s, frame), frame_voiced in zip(feeding, voiced, strict=True):
            k = s.conversation.frame
            try:
                await s.conversation.before_step(frame, voiced=frame_voiced)
            except Exception as exc:
                logger.exception("session %s: frame head failed", s.id)
                self._fail(s, f"frame {k}: {type(exc).__name__}: {exc}")
                continue
            heads[s] = (k, s._take_events())
        if not heads:
            return
        try:
            live = [False] * self.engine_thread.batch_size
            for s in heads:
                if s.slot is not None:
                    live[s.slot] = True
            result: FrameResult = await self.engine_thread.frame(pcm, live)
        except Exception as exc:  # the engine failed: end the sessions of this step rather than loop on the error
            logger.exception("frame loop: the engine step failed; ending %d session(s)", len(heads))
            for s in heads:
                self._fail(s, f"the engine failed ({type(exc).__name__}: {exc})")
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
                s.client_error("internal", f"frame {k}: {type(exc).__name__}: {exc}")
            if s.memory_span is not None:
                self._memory_due(s, i)
            tail = s._take_events()
            # the spans this step read (and those the engine refused) are events of the frame's head
            head += [ev for ev in tail if _span_outcome(ev)]
            tail = [ev for ev in tail if not _span_outcome(ev)]
            s._publish(head)
            s.put(AgentAudio(frame=k, pcm=result.agent_pcm[i]))
            s.stats.frames += 1
            self.metrics.session_frames.labels(s.protocol).inc()
            spans_here = [ev for ev in head if isinstance(ev, SpanEvent)]
            every = self.settings.slot_every
            if spans_here or (every and k % every == 0):
                total_ms = (time.perf_counter() - t0) * 1000.0
                s.put(
                    Timing(
                        frame=k,
                        t=round(k * FRAME_S, 3),
                        step_ms=round(result.step_ms, 3),
                        prefill_ms=round(sum(ev.prefill_ms for ev in spans_here), 3),
                        total_ms=round(total_ms, 3),
                        over_budget=total_ms > FRAME_S * 1000.0,
                        live_sessions=live_count,
                        queued=len(s.inbox),
                        dropped_frames=s.stats.dropped_frames,
                        silence_frames=s.stats.silence_frames,
                    )
                )
            s._publish(tail)
        for s in heads:  # the next frame's spans, handed to the engine now: it prepares their step between frames
            if s.conversation is None or s.state not in ("live", "stopping"):
                continue
            try:
                await s.conversation.read_spans()
            except Exception as exc:
                logger.exception("session %s: reading spans failed", s.id)
                self._fail(s, f"frame {s.conversation.frame}: {type(exc).__name__}: {exc}")

    def _memory_due(self, s: Session, slot: int) -> None:
        """After ``s``'s step: when its Context Spans left the window, read the memory span (off the frame loop:
        the Context DB is read on its threads, for at most ``--db-wait-s``; the span is read at the first frame
        head after it)."""
        due = s.memory_span.after_step(int(self.engine_thread.engine.positions[slot]))
        if due is None:
            return
        s.memory_span.reading = True
        s.spawn(self._read_memory(s, due.left))

    async def _read_memory(self, s: Session, left: list[str]) -> None:
        from cspan.server.memory_span import memory_summary

        calls = self.db_calls
        try:
            text = await calls.within(calls.run(memory_summary, s.memory, s.conversation_id, s.profile, left))
        except Exception as exc:  # the Context DB failed: the conversation goes on without its memory span
            logger.warning("session %s: memory span: the Context DB failed: %s", s.id, exc)
            text = ""
        finally:
            s.memory_span.reading = False
        if text and s.conversation is not None and s.state == "live":
            s.conversation.schedule_span(s.conversation.frame, text, source="memory")

    def _fail(self, s: Session, message: str) -> None:
        """End ``s`` after a server failure in its frame (reason ``error``)."""
        s._publish(s._take_events())
        s.client_error("internal", message)
        self.release(s)
        s.spawn(s.end("error", code=CLOSE_INTERNAL, message=message))

    # -- shutdown -------------------------------------------------------------------------------------------------

    async def end_all(self, reason: str = "shutdown", *, flush_s: float = 2.0) -> None:
        """End every session with ``Ended`` (``reason``), all at once (each waits for its Context DB writes at most
        ``--db-wait-s``), and give their senders ``flush_s`` to deliver it."""
        sessions = list(self.sessions)
        await asyncio.gather(
            *(s.end(reason, code=CLOSE_GOING_AWAY, message="the server is shutting down") for s in sessions),
            return_exceptions=True,
        )
        deadline = time.monotonic() + flush_s
        while any(not s.outbox.empty() and not s.gone for s in sessions) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def shutdown(self) -> None:
        """End every session (reason ``shutdown``), stop the loop, give the Context DB writes still queued
        :data:`SHUTDOWN_WRITES_S` (then give them up, logged), release the engine thread, the database's threads
        and the backends."""
        self.draining = True
        await self.end_all("shutdown")
        self._closing = True
        self._wake.set()
        for task in (self._task, self._prune):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.engine_thread.shutdown()
        await self.db_calls.close(SHUTDOWN_WRITES_S)
        if self.db.executor is self.db_calls.executor:
            self.db.executor = None
        if self.backends is not None:
            with contextlib.suppress(Exception):
                await self.backends.aclose()


def _span_outcome(event: ConversationEvent) -> bool:
    """Whether ``event`` says what became of a Context Span the frame's step was to read (``span``, or the engine's
    refusal: an ``error`` of stage ``span``): sent with the frame's head events, as the step read it at its head."""
    return isinstance(event, SpanEvent) or (isinstance(event, ErrorEvent) and event.stage == "span")


__all__ = [
    "CLOSE_FORBIDDEN_ORIGIN",
    "CLOSE_GOING_AWAY",
    "CLOSE_INTERNAL",
    "CLOSE_NORMAL",
    "CLOSE_POLICY",
    "CLOSE_TRY_AGAIN_LATER",
    "CLOSE_UNAUTHORIZED",
    "AdapterItem",
    "AgentAudio",
    "Busy",
    "ClientError",
    "Close",
    "Ended",
    "ErrorOut",
    "Outbound",
    "PersonaInfo",
    "ProfileFields",
    "ProfileInfo",
    "Ready",
    "Session",
    "SessionHub",
    "SessionStats",
    "StartRequest",
    "Timing",
    "VoiceSet",
    "brief",
]
