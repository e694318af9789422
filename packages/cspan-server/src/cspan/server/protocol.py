"""The ``/ws`` wire protocol of ``cspan serve`` (its own protocol) as typed models (prose: ``docs/PROTOCOL.md``).

The adapter that speaks it is :mod:`cspan.server.adapters.ws`. Two kinds of WebSocket messages travel on ``/ws``:

- **binary**: audio, one 80 ms frame per message, 1920 samples at 24 kHz mono, in both directions. The server
  sends float32 little-endian (7680 bytes). The client may send float32 little-endian (7680 bytes) or signed
  16-bit little-endian (3840 bytes); the two lengths cannot be confused, so no header is needed. Before ``start``,
  after a :class:`VoiceAudioMessage`, binary messages carry the bytes of the client's voice recording instead.
- **text**: one JSON object with a ``type`` key. Client messages are :class:`StartMessage`,
  :class:`VoiceAudioMessage`, :class:`ContextMessage` and :class:`StopMessage`; server messages are
  :class:`ReadyMessage`, :class:`BusyMessage`, :class:`VoiceMessage`, :class:`ByeMessage`, :class:`SlotMessage`,
  :class:`ErrorMessage`, and the conversation events of :mod:`cspan.core.events` (``text``, ``user_text``, ``ret``,
  ``question``, ``span``, ``late``, ``no_span``), sent as they are.

Every client message is validated here; a violation raises :class:`~cspan.server.session.ClientError` carrying a
machine-readable ``code`` (:data:`ERROR_CODES`) that the server sends back in an ``error`` message. The session
always continues after a protocol error. The data models shared with the session core (``ProfileFields``,
``PersonaInfo``, ``ProfileInfo``, ``SessionStats``) live in :mod:`cspan.server.session`.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from cspan.backends.untrusted import JSONInputError, loads
from cspan.core.constants import FRAME_RATE, FRAME_SIZE, MAX_SEED, SAMPLE_RATE
from cspan.core.events import (
    EVENT_MODELS,
    ErrorEvent,
)
from cspan.server.session import (
    ClientError,
    PersonaInfo,
    ProfileFields,
    ProfileInfo,
    SamplingInfo,
    SamplingOptions,
    SessionStats,
    type_problem,
)
from cspan.server.voices import VOICE_AUDIO_MAX_BYTES

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change of the messages below (added optional fields are compatible)."""

FLOAT32_FRAME_BYTES = FRAME_SIZE * 4
"""7680: one frame of float32 little-endian samples."""
INT16_FRAME_BYTES = FRAME_SIZE * 2
"""3840: one frame of signed 16-bit little-endian samples (client to server only)."""
MAX_WEBSOCKET_MESSAGE_BYTES = 16 * 1024 * 1024
"""The WebSocket layer closes the connection (code 1009) on messages above this size; below it, messages above
``--max-message-kib`` get ``error too_large`` on every protocol (refused by the app before any adapter reads them)."""
CODECS = ("opus", "pcm")
"""Audio codecs of ``/ws``, negotiated in ``start.codecs`` (``ready.codec``). ``pcm``: one 80 ms frame per binary
message (float32 LE from the server; float32 or int16 LE from the client). ``opus``: Ogg/Opus at 24 kHz mono both
ways, a binary message holds Ogg bytes (the server sends the page(s) of one agent frame per message, the first with
the stream headers; the client may send pages in any chunking)."""
TOKEN_SUBPROTOCOL_PREFIX = "cspan.token."
"""A client may authenticate by offering the subprotocol ``cspan.token.<token>``; the server echoes it."""

ERROR_CODES: dict[str, str] = {
    "bad_json": "a text message is not a JSON object",
    "unknown_type": "a JSON message whose type is not a client message type",
    "invalid_message": "a known message type with missing, unknown, ill-typed or out-of-range fields",
    "too_large": "a message above the server's size limit (--max-message-kib)",
    "bad_frame": "a binary message that is not one frame (7680 bytes float32 or 3840 bytes int16) in a pcm session",
    "not_started": "audio or context before start",
    "already_started": "a second start in the same connection",
    "stopping": "audio after stop (ignored)",
    "bad_voice": "a voice name the server does not have",
    "bad_voice_audio": "a voice recording that cannot be a voice: over the size limit, not audio, shorter than 2 s or "
    "longer than 30 s, silent, or not the size announced; the session keeps its voice",
    "bad_audio": "audio that cannot be used: NaN or infinite samples (replaced by silence; reported once per "
    "session), or bytes that are not Ogg/Opus in an opus session (the decoder starts over)",
    "audio_overflow": "audio arrives faster than real time: the oldest queued frames are being dropped",
    "persona_failed": "the persona prefix could not be read; send start again",
    "backend": "a backend stage (asr, retrieval, span) failed; the conversation goes on",
    "internal": "an unexpected server error while handling a message; the session goes on",
}
"""Every ``error.code`` the server sends, with its meaning."""


# ---------------------------------------------------------------------------------------------------- client


class _ClientModel(BaseModel):
    """Strict: a JSON value of another type is refused, not converted (``true`` or ``"10"`` is no integer; an integer
    is a number)."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True, strict=True)


class ScheduledSpan(_ClientModel):
    """Test hook: inject ``text`` as a Context Span at ``at`` seconds of the session (no backend)."""

    at: float = Field(ge=0.0, le=3600.0)
    text: str = Field(min_length=1, max_length=2000)


class StartHooks(_ClientModel):
    """Test-only fields of ``start``; refused unless the server runs with test hooks (``test_hooks=True`` in its
    settings, hidden flag ``--test-hooks``). Times are seconds on the session's timeline (frame
    0 = the first frame after ``ready``)."""

    force_ret_at: list[Annotated[float, Field(ge=0.0, le=3600.0)]] = Field(default_factory=list, max_length=16)
    spans: list[ScheduledSpan] = Field(default_factory=list, max_length=16)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)


class StartMessage(_ClientModel):
    """``start``: begin the conversation. The server answers ``ready`` (or ``busy`` when all slots are taken).

    ``voice``: a name from ``GET /info``'s ``voices``; ``""`` for no voice prompt; omitted/null for the recording
    sent with ``voice_audio``, else the server's default. ``text_prompt``: the persona; omitted/null for the server's
    default, ``""`` for none. ``codecs``: see :data:`CODECS`.
    """

    type: Literal["start"]
    version: int | None = Field(default=None, description="the protocol version the client speaks")
    profile: ProfileFields = Field(default_factory=ProfileFields)
    voice: str | None = Field(default=None, max_length=64)
    text_prompt: str | None = Field(default=None, max_length=4000)
    codecs: list[Annotated[str, Field(max_length=32)]] = Field(
        default_factory=lambda: ["pcm"],
        max_length=8,
        description="audio codecs the client can use both ways, preferred first: 'opus' (Ogg/Opus), 'pcm'; the "
        "server picks the first it has (unknown names are skipped; none known: pcm) and says which in ready.codec",
    )
    sampling: SamplingOptions | None = Field(
        default=None,
        description="this session's sampling: text_temperature, text_topk, audio_temperature, audio_topk (each "
        "omitted: the server's default; temperature 0 = greedy, else 0.001 to 10; top-k 0 = every token, up to 500)",
    )
    test: StartHooks | None = None


class VoiceAudioMessage(_ClientModel):
    """``voice_audio``: before ``start``, a recording of the user's voice to speak with: the next binary messages
    carry its ``size`` bytes (the file as it is: 2 to 30 s of speech, any format libsndfile reads: WAV, FLAC, OGG
    Vorbis/Opus, MP3; in pieces of any size up to ``--max-message-kib``). Once they have all arrived the server
    answers ``voice`` (the recording is the session's voice for a ``start`` without a voice name) or ``error``
    ``bad_voice_audio`` (the session keeps its voice). A new ``voice_audio`` drops an unfinished one."""

    type: Literal["voice_audio"]
    size: int = Field(ge=1, le=VOICE_AUDIO_MAX_BYTES, description="bytes of the recording that follow")


class ContextMessage(_ClientModel):
    """``context``: update the profile mid-conversation (fields given replace the current ones). The persona prefix
    already read is not changed; the new profile is what the router and the Context DB see from now on."""

    type: Literal["context"]
    profile: ProfileFields


class StopMessage(_ClientModel):
    """``stop``: end the conversation. Audio already queued is still played through; then ``bye``."""

    type: Literal["stop"]


ClientMessage = Annotated[StartMessage | VoiceAudioMessage | ContextMessage | StopMessage, Field(discriminator="type")]
CLIENT_MESSAGE_TYPES = ("start", "voice_audio", "context", "stop")
_client_adapter: TypeAdapter[Any] = TypeAdapter(ClientMessage)


ProtocolCodeError = ClientError
"""The error of a refused client message (``code`` from :data:`ERROR_CODES`); the session core's ``ClientError``."""


MAX_REPORTED_PROBLEMS = 4
"""An ``invalid_message`` error names this many problems and counts the rest."""


def _describe(exc: ValidationError, kind: str) -> str:
    errors = exc.errors(include_url=False)
    parts = []
    for err in errors[:MAX_REPORTED_PROBLEMS]:
        where = ".".join(str(p)[:64] for p in err["loc"] if p != kind) or "(message)"
        parts.append(f"{where}: {err['msg']}")
    more = len(errors) - len(parts)
    return f"{kind}: " + "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def parse_client_message(text: str) -> StartMessage | VoiceAudioMessage | ContextMessage | StopMessage:
    """Parse one JSON text message from a client.

    Args:
        text: the message as received.

    Returns:
        The validated model.

    Raises:
        ClientError: with ``code`` ``bad_json``, ``unknown_type`` or ``invalid_message`` and a message naming the
            field and the fix (its size bounded: the first problems and a count).
    """
    try:
        data = loads(text)
    except JSONInputError as exc:
        raise ProtocolCodeError("bad_json", f"text message is not valid JSON ({exc}); send one JSON object") from None
    if not isinstance(data, dict):
        raise ProtocolCodeError("bad_json", f"expected a JSON object with a 'type' key, got {type(data).__name__}")
    problem = type_problem(data, CLIENT_MESSAGE_TYPES, "message")
    if problem is not None:
        raise ProtocolCodeError("unknown_type", f"{problem}; client messages are {', '.join(CLIENT_MESSAGE_TYPES)}")
    kind = data["type"]
    try:
        return _client_adapter.validate_python(data)
    except ValidationError as exc:
        raise ProtocolCodeError("invalid_message", _describe(exc, str(kind))) from None


def decode_audio_frame(data: bytes) -> np.ndarray:
    """One client audio frame -> float32 ``[1920]``.

    Accepts 7680 bytes (float32 little-endian) or 3840 bytes (int16 little-endian, scaled by 1/32768). The samples
    are returned as sent; the session core replaces non-finite ones by silence and clips to [-1, 1]
    (:func:`cspan.core.audio.sanitize_pcm`).

    Raises:
        ClientError: ``bad_frame`` for any other length (saying so when the bytes look like a JSON message).
    """
    n = len(data)
    if n == FLOAT32_FRAME_BYTES:
        return np.frombuffer(data, dtype="<f4").astype(np.float32)
    if n == INT16_FRAME_BYTES:
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    if data[:1] == b"{":
        raise ProtocolCodeError(
            "bad_frame",
            f"a binary message of {n} bytes that looks like JSON: send JSON messages (start, context, stop) as text "
            "WebSocket messages; binary messages are audio",
        )
    raise ProtocolCodeError(
        "bad_frame",
        f"binary message of {n} bytes is not one frame: send {FRAME_SIZE} samples at {SAMPLE_RATE} Hz as "
        f"{FLOAT32_FRAME_BYTES} bytes (float32 LE) or {INT16_FRAME_BYTES} bytes (int16 LE)",
    )


def encode_audio_frame(pcm: np.ndarray) -> bytes:
    """Agent frame float32 ``[1920]`` -> 7680 bytes float32 little-endian."""
    return np.ascontiguousarray(pcm, dtype="<f4").tobytes()


# ---------------------------------------------------------------------------------------------------- server


class _ServerModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReadyMessage(_ServerModel):
    """``ready``: the session is live; frame 0 of its timeline is the next frame the server sends."""

    type: Literal["ready"] = "ready"
    protocol_version: int = PROTOCOL_VERSION
    session_id: str
    conversation_id: str = Field(description="the Context DB conversation")
    slot: int = Field(description="the engine batch row of this session")
    sample_rate: int = SAMPLE_RATE
    frame_size: int = FRAME_SIZE
    frame_rate: float = FRAME_RATE
    codec: str = Field(default="pcm", description="the audio codec of this session, both ways (see CODECS)")
    audio_formats: list[str] = Field(
        default_factory=lambda: ["f32le", "s16le"], description="what the client may send: f32le/s16le, or ogg-opus"
    )
    max_queued_frames: int
    idle_timeout_s: float
    seed: int
    persona: PersonaInfo
    profile: ProfileInfo
    sampling: SamplingInfo = Field(description="the sampling parameters the session runs with")


class BusyMessage(_ServerModel):
    """``busy``: every session slot is taken; the server closes with code 1013 (try again later)."""

    type: Literal["busy"] = "busy"
    max_sessions: int
    message: str


class VoiceMessage(_ServerModel):
    """``voice``: the recording sent with ``voice_audio`` is the session's voice now."""

    type: Literal["voice"] = "voice"
    voice: str = Field(description="its name: recording- and 12 hex digits of its SHA-256 (ready.persona.voice)")
    frames: int = Field(description="Mimi frames of the voice prompt (12.5 per second)")
    seconds: float = Field(description="length of the recording")
    loudness_lufs: float = Field(description="its loudness before it was normalised to -24 LUFS")


class ByeMessage(_ServerModel):
    """``bye``: the session ended; the server closes the connection right after."""

    type: Literal["bye"] = "bye"
    reason: Literal["stop", "idle", "shutdown", "slow_client", "over_budget", "revoked", "forgotten", "error"]
    message: str = ""
    session_id: str | None = None
    conversation_id: str | None = None
    stats: SessionStats


class SlotMessage(_ServerModel):
    """``slot``: timing of one frame, sent for every frame at whose head a span was read (and every N frames with
    ``--slot-every N``)."""

    type: Literal["slot"] = "slot"
    frame: int
    t: float
    step_ms: float = Field(description="the batched engine step of this frame (ms)")
    prefill_ms: float = Field(
        description="host time of injecting this session's spans read in this frame (ms); the read is in step_ms"
    )
    total_ms: float = Field(description="the whole frame: head, step, tail (ms)")
    over_budget: bool = Field(description="total_ms above 80 ms")
    live_sessions: int
    queued: int = Field(description="user frames waiting in this session's queue")
    dropped_frames: int
    silence_frames: int


class ErrorMessage(_ServerModel):
    """``error``: a client message was refused (``code`` from :data:`ERROR_CODES`) or a backend stage failed
    (``code`` ``backend`` with ``stage``). The session goes on."""

    type: Literal["error"] = "error"
    code: str
    message: str
    stage: str | None = None
    frame: int | None = None
    t: float | None = None


SERVER_MODELS = (
    ReadyMessage,
    BusyMessage,
    VoiceMessage,
    ByeMessage,
    SlotMessage,
    ErrorMessage,
    *(event for event in EVENT_MODELS if event is not ErrorEvent),  # a backend failure goes out as ErrorMessage
)
"""Every message model the server sends on ``/ws``."""
ServerMessage = Annotated[Union[SERVER_MODELS], Field(discriminator="type")]  # noqa: UP007 (a tuple of models)
SERVER_MESSAGE_TYPES = tuple(model.model_fields["type"].default for model in SERVER_MODELS)
server_message_adapter: TypeAdapter[Any] = TypeAdapter(ServerMessage)


def parse_server_message(text: str) -> Any:
    """Parse a server JSON message into its model (for clients and tests). Raises ``pydantic.ValidationError``."""
    return server_message_adapter.validate_json(text)


def event_to_wire(event: Any) -> BaseModel:
    """A conversation event -> the server message sent for it (core ``error`` events become ``ErrorMessage``
    with code ``backend``)."""
    if isinstance(event, ErrorEvent):
        return ErrorMessage(code="backend", stage=event.stage, message=event.message, frame=event.frame, t=event.t)
    return event


def dumps(message: BaseModel) -> str:
    """Serialise a server message (compact JSON; floats that are not finite become null)."""
    data = message.model_dump(mode="json")
    return json.dumps(_finite(data), separators=(",", ":"), ensure_ascii=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


__all__ = [
    "CLIENT_MESSAGE_TYPES",
    "CODECS",
    "ERROR_CODES",
    "FLOAT32_FRAME_BYTES",
    "INT16_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "SERVER_MESSAGE_TYPES",
    "BusyMessage",
    "ByeMessage",
    "ContextMessage",
    "ErrorMessage",
    "ProfileFields",
    "ProtocolCodeError",
    "ReadyMessage",
    "SessionStats",
    "SlotMessage",
    "StartHooks",
    "StartMessage",
    "StopMessage",
    "VoiceAudioMessage",
    "VoiceMessage",
    "decode_audio_frame",
    "dumps",
    "encode_audio_frame",
    "event_to_wire",
    "loads",
    "parse_client_message",
    "parse_server_message",
]
