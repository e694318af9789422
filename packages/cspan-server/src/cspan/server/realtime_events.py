"""The OpenAI Realtime API events ``/v1/realtime`` accepts and sends, as our own pydantic models.

Source of the schema: the event types of the official ``openai`` Python SDK (``openai.types.realtime`` for the GA
interface, ``openai.types.beta.realtime`` for the beta one, which clients select with the header
``OpenAI-Beta: realtime=v1`` or the subprotocol ``openai-beta.realtime-v1``). The prose is ``docs/PROTOCOL.md``,
section "OpenAI Realtime API".

**Client events** are parsed by :func:`parse_client_event`. Unknown fields are ignored (SDKs add fields faster than
servers drop them); a field we read with the wrong type, a missing required field, invalid JSON or an unknown event
type raise :class:`RealtimeEventError`, which the adapter answers with an ``error`` event carrying the offending
``event_id``. The session goes on. ``session.update`` is parsed field by field: an invalid field is left out
(:attr:`SessionUpdate.problems`) and the valid ones are applied. Error messages are bounded in size whatever the
input (the first problems and a count; client values cut short).

**Server events** are the GA names and shapes; :func:`dump_event` writes one for a connection's dialect: the beta
dialect renames ``response.output_audio.*`` to ``response.audio.*``, ``response.output_audio_transcript.*`` to
``response.audio_transcript.*``, ``response.output_text.*`` to ``response.text.*``, ``conversation.item.added`` to
``conversation.item.created`` (and drops ``conversation.item.done``, which beta does not have), the assistant
content type ``output_audio`` to ``audio``, and ``output_modalities`` to ``modalities``.

**Extensions** (``cspan.*``): a client may add ``session.cspan`` to ``session.update`` (:class:`CspanOptions`: our
conversation events as ``cspan.<type>`` server events, the user's profile, a voice recording, test hooks); other clients never see
anything that is not in the published schema.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, TypeAdapter, ValidationError

from cspan.backends.untrusted import JSONInputError, loads
from cspan.core.constants import MAX_SEED
from cspan.server.session import ProfileFields, brief, type_problem

Dialect = Literal["ga", "beta"]
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"
"""The subprotocol a browser offers to select the beta interface (headers cannot be set from a browser)."""
INSECURE_KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
"""A browser client puts its key in the subprotocol ``openai-insecure-api-key.<key>``."""

OPENAI_VOICES = frozenset(
    {"alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage", "shimmer", "verse"}
)
"""The voice names of OpenAI's Realtime models: clients (LiveKit's plugin, pipecat) send one by default. A
``session.update`` naming one keeps this server's voice with a ``voice_not_applied`` warning instead of an error."""
MAX_EVENT_ID_CHARS = 512
"""Longest ``event_id`` a client event may have (a longer one is not echoed in the error)."""
MAX_TOOL_SCHEMA_NODES = 2048
"""JSON Schema objects (a tool's parameters, each property, ...) that the function tools of one ``session.update``
may have in all: each becomes a validated field of the router's tool bank, built on a worker thread (about 0.1 ms
each)."""
MAX_EVENT_DEPTH = 64
"""How deeply a client event's JSON arrays and objects may nest (the event itself is level 1). Deeper ones are
refused (``invalid_event``): a ``session.update`` keeps its tools and ``tool_choice`` and echoes them in every
``session.updated``, and a value nested past about 120 levels there cannot be serialised, so the session would
answer no ``session.update`` again."""
MAX_REPORTED_PROBLEMS = 4
"""An ``invalid_event`` error names this many problems of an event and counts the rest."""

ERROR_CODES: dict[str, str] = {
    "bad_json": "a text message that is not a JSON object",
    "too_large": "a message above the server's size limit (``--max-message-kib``; sent without an ``event_id``)",
    "unknown_event": "a JSON object whose type is not a client event this server knows",
    "invalid_event": "a known event with a missing or ill-typed field (``param`` names it)",
    "binary_message": "a binary WebSocket message (Realtime events are JSON text)",
    "bad_audio": "``input_audio_buffer.append`` whose ``audio`` is not base64 of the session's format",
    "unsupported": "a field value or event this server does not implement (MCP tools, text-only output, ...)",
    "unknown_call_id": "a ``function_call_output`` whose ``call_id`` is not a call of this session",
    "late_call_output": "a ``function_call_output`` after its call timed out (the abstain clause was read)",
    "unknown_item": "an ``item_id`` that is not an item of this session",
    "response_cancel_not_active": "``response.cancel`` while no response is in progress, or naming another one "
    "(OpenAI's code)",
    "conversation_already_has_active_response": "``response.create`` while a response is in progress (OpenAI's code)",
    "session_live": "``instructions``, ``voice`` or ``cspan.voice_audio`` changed after the persona was read (not "
    "applied)",
    "invalid_instructions": "``instructions`` longer than the server allows",
    "bad_voice": "a voice name the server does not have (nor one of OpenAI's: those get a warning)",
    "bad_voice_audio": "``session.cspan.voice_audio`` that cannot be a voice (not base64, not audio, shorter than 2 s "
    "or longer than 30 s, silent): the session keeps its voice",
}
"""Every ``error.code`` the Realtime adapter sends for a client event, with its meaning (the session core's own
codes, e.g. ``audio_overflow`` or ``persona_failed``, pass through)."""

WARNING_CODES: dict[str, str] = {
    "voice_not_applied": "an OpenAI voice name (``alloy``, ``marin``, ...): this server's voice is kept",
    "tools_inert": "function tools on a server whose router never calls a client's function (``--router local`` "
    "or ``none``): accepted, never called",
}
"""What a ``cspan.warning`` extension event may say (sent to clients that asked for ``session.cspan.events``; the
server logs each once per session): something accepted that will not do what the client may expect. Warnings are
not ``error`` events because some clients (pipecat) end the session on any ``error`` they do not know."""


def new_id(prefix: str) -> str:
    """A random id like the API's (``event_...``, ``resp_...``, ``item_...``, ``call_...``)."""
    return f"{prefix}_{secrets.token_hex(10)}"


class RealtimeEventError(Exception):
    """A client event was refused: sent back as an ``error`` event (``code`` from :data:`ERROR_CODES`)."""

    def __init__(self, code: str, message: str, *, event_id: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.event_id = event_id
        self.param = param


# ---------------------------------------------------------------------------------------------------- client


class _In(BaseModel):
    """Strict: a field we read with another JSON type is refused, not converted (``"1"`` is no number; an integer
    is)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionTool(_In):
    """A function tool the client runs (``session.tools[]``): its JSON Schema joins the router's tool bank."""

    type: Literal["function"] = "function"
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str = Field(default="", max_length=4096)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class AudioFormatSpec(_In):
    """GA ``audio.*.format``: ``audio/pcm`` (24 kHz), ``audio/pcmu`` or ``audio/pcma`` (8 kHz)."""

    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
    rate: Literal[24000] | None = None


class AudioInputConfig(_In):
    format: AudioFormatSpec | None = None
    transcription: dict[str, Any] | None = None
    turn_detection: dict[str, Any] | None = None


class AudioOutputConfig(_In):
    format: AudioFormatSpec | None = None
    voice: str | dict[str, Any] | None = None
    speed: float | None = None


class AudioConfig(_In):
    input: AudioInputConfig | None = None
    output: AudioOutputConfig | None = None


class TestHooksOption(BaseModel):
    """``session.cspan.test``: forced ``<ret>`` and scheduled spans (seconds on the session's timeline: frame 0 is
    the first frame after the persona was read), and the seed. Refused unless the server has test hooks."""

    model_config = ConfigDict(extra="forbid", strict=True)

    force_ret_at: list[Annotated[float, Field(ge=0.0, le=3600.0)]] = Field(default_factory=list, max_length=16)
    spans: list[
        Annotated[
            tuple[Annotated[float, Field(ge=0.0, le=3600.0)], Annotated[str, Field(min_length=1)]],
            Strict(False),  # a JSON array is a tuple (its items stay strict)
        ]
    ] = Field(default_factory=list, max_length=16)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)


class CspanOptions(BaseModel):
    """``session.cspan``: this server's extensions (ignored by the published schema).

    Attributes:
        events: also send our conversation events (``ret``, ``question``, ``span``, ``late``, ``no_span``) as
            ``cspan.ret``, ``cspan.span``, ... server events, and ``cspan.ready`` when the persona was read.
        profile: the user's profile (the fields of ``/ws``'s ``profile``, checked the same way).
        test: test hooks.
        voice_audio: a recording of the user's voice to speak with, base64 of a file (2 to 30 s of speech, any
            format libsndfile reads), before the first audio; it replaces ``voice``.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    events: bool | None = None
    profile: ProfileFields | None = None
    test: TestHooksOption | None = None
    voice_audio: str | None = Field(default=None, min_length=1)


class SessionConfig(_In):
    """``session.update``'s ``session``: the GA fields and the beta ones (either dialect's client may send either).

    Only what this server uses is typed; other fields are accepted and ignored.
    """

    type: Literal["realtime", "transcription"] | None = None
    model: str | None = None
    instructions: str | None = None
    voice: str | dict[str, Any] | None = None
    input_audio_format: Literal["pcm16", "g711_ulaw", "g711_alaw"] | None = None
    output_audio_format: Literal["pcm16", "g711_ulaw", "g711_alaw"] | None = None
    audio: AudioConfig | None = None
    output_modalities: list[Literal["text", "audio"]] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    input_audio_transcription: dict[str, Any] | None = None
    turn_detection: dict[str, Any] | None = None
    temperature: float | None = None
    cspan: CspanOptions | None = None


def function_tools(config: SessionConfig, event_id: str | None = None) -> list[FunctionTool] | None:
    """The validated function tools of a ``session.update`` (None: ``tools`` not given; ``[]`` clears them).

    Raises:
        RealtimeEventError: ``invalid_event`` for a malformed or repeated tool, ``unsupported`` for another tool
            type (``mcp``: the server's own tools come from its tool bank).
    """
    from cspan.backends.tools.bank import tool_name_key

    if config.tools is None:
        return None
    tools: list[FunctionTool] = []
    for i, raw in enumerate(config.tools):
        kind = raw.get("type", "function")
        if kind != "function":
            raise RealtimeEventError(
                "unsupported",
                f"session.tools[{i}]: tools of type {brief(kind)} are not supported; give function tools (the "
                "server's own tools are in its tool bank)",
                event_id=event_id,
                param=f"session.tools[{i}].type",
            )
        try:
            tool = FunctionTool.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            where = ".".join(str(p)[:64] for p in err["loc"])
            raise RealtimeEventError(
                "invalid_event",
                f"session.tools[{i}].{where}: {err['msg']}",
                event_id=event_id,
                param=f"session.tools[{i}].{where}",
            ) from None
        same = [t.name for t in tools if tool_name_key(t.name) == tool_name_key(tool.name)]
        if same:  # the router would read one for the other ("Lookup-Order" is lookup_order)
            alias = "" if same[0] == tool.name else f" (read by the router as {same[0]!r})"
            raise RealtimeEventError(
                "invalid_event",
                f"session.tools[{i}]: a second tool named {tool.name!r}{alias}",
                event_id=event_id,
                param=f"session.tools[{i}].name",
            )
        tools.append(tool)
    nodes = sum(_json_objects(t.parameters) for t in tools)
    if nodes > MAX_TOOL_SCHEMA_NODES:
        raise RealtimeEventError(
            "invalid_event",
            f"session.tools: the parameter schemas have {nodes} JSON objects in all (each property is one), over this "
            f"server's limit of {MAX_TOOL_SCHEMA_NODES}; send fewer or smaller tools (tools not applied)",
            event_id=event_id,
            param="session.tools",
        )
    return tools


def _nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON arrays and objects nest in ``value`` more than ``limit`` levels deep (``value`` is level 1;
    iterative: any depth)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _json_objects(value: Any) -> int:
    """How many JSON objects a JSON value holds, itself included (iterative: any depth)."""
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            count += 1
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


class _Event(_In):
    event_id: str | None = Field(default=None, max_length=MAX_EVENT_ID_CHARS)


class SessionUpdate(_Event):
    """``session.update``. ``problems``: ``(param, message)`` of each field left out because it was invalid (set
    by :func:`parse_client_event`, which reads the session field by field); the others are in ``session``."""

    type: Literal["session.update"]
    session: SessionConfig
    problems: list[tuple[str, str]] = Field(default_factory=list, exclude=True)


class InputAudioBufferAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str


class InputAudioBufferCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class InputAudioBufferClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class OutputAudioBufferClear(_Event):
    type: Literal["output_audio_buffer.clear"]


ItemId = Annotated[str, Field(min_length=1, max_length=64)]
"""A client-chosen item or call id (unique in the session)."""


class ContentPartIn(_In):
    """A content part of a client's message item; ``input_text`` / ``output_text`` carry ``text``, ``input_audio`` /
    ``output_audio`` a ``transcript`` (their audio is not read: the model hears the session's audio only); other
    types are accepted and left out."""

    type: str = Field(max_length=64)
    text: str | None = None
    transcript: str | None = None


class MessageItemIn(_In):
    type: Literal["message"]
    id: ItemId | None = None
    role: Literal["user", "assistant", "system"]
    content: list[ContentPartIn] = Field(default_factory=list, max_length=64)


class FunctionCallItemIn(_In):
    type: Literal["function_call"]
    id: ItemId | None = None
    call_id: ItemId | None = None
    name: str = Field(max_length=64)
    arguments: str = ""


class FunctionCallOutputItemIn(_In):
    """The client's result of a function call: ``output`` is read as a Context Span, as is. ``status``
    ``incomplete``, or an ``output`` that is a JSON object with an ``error`` key, is a failed call."""

    type: Literal["function_call_output"]
    id: ItemId | None = None
    call_id: ItemId
    output: str
    status: Literal["completed", "incomplete", "in_progress"] | None = None


ItemIn = Annotated[MessageItemIn | FunctionCallItemIn | FunctionCallOutputItemIn, Field(discriminator="type")]


class ConversationItemCreate(_Event):
    type: Literal["conversation.item.create"]
    previous_item_id: ItemId | None = None
    item: ItemIn


class ConversationItemTruncate(_Event):
    type: Literal["conversation.item.truncate"]
    item_id: ItemId
    content_index: int = Field(ge=0)
    audio_end_ms: int = Field(ge=0)


class ConversationItemDelete(_Event):
    type: Literal["conversation.item.delete"]
    item_id: ItemId


class ConversationItemRetrieve(_Event):
    type: Literal["conversation.item.retrieve"]
    item_id: ItemId


class ResponseParams(_In):
    metadata: dict[str, str] | None = None
    conversation: str | None = None
    output_modalities: list[Literal["text", "audio"]] | None = None
    modalities: list[Literal["text", "audio"]] | None = None


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseParams | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = Field(default=None, max_length=64)


ClientEvent = Annotated[
    SessionUpdate
    | InputAudioBufferAppend
    | InputAudioBufferCommit
    | InputAudioBufferClear
    | OutputAudioBufferClear
    | ConversationItemCreate
    | ConversationItemTruncate
    | ConversationItemDelete
    | ConversationItemRetrieve
    | ResponseCreate
    | ResponseCancel,
    Field(discriminator="type"),
]
CLIENT_EVENT_TYPES = (
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "output_audio_buffer.clear",
    "conversation.item.create",
    "conversation.item.truncate",
    "conversation.item.delete",
    "conversation.item.retrieve",
    "response.create",
    "response.cancel",
)
_client_adapter: TypeAdapter[Any] = TypeAdapter(ClientEvent)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(text: str, data: Any) -> bool:
    """Whether the parsed ``data`` of ``text`` holds half a UTF-16 surrogate pair (a ``\\ud800`` escape alone):
    Python's JSON parser keeps it in a ``str``, which then cannot be sent back as UTF-8 (an echoed ``event_id``,
    item or instruction would end the connection)."""
    if _SURROGATE_ESCAPE.search(text) is None:
        return False
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_client_event(text: str) -> Any:
    """Parse one client event (a JSON text message).

    Returns:
        The event's model (one of :data:`ClientEvent`). A ``session.update`` is read field by field: a field that
        is not valid is left out of its ``session`` and named in its ``problems``.

    Raises:
        RealtimeEventError: ``bad_json``, ``unknown_event`` or ``invalid_event``, with the event's ``event_id`` when
            it has one and, for a bad field, ``param`` (its dotted path); the message names at most
            :data:`MAX_REPORTED_PROBLEMS` problems and counts the others.
    """
    try:
        data = loads(text)
    except JSONInputError as exc:
        raise RealtimeEventError("bad_json", f"the message is not valid JSON ({exc}); send one JSON object") from None
    if _has_lone_surrogate(text, data):
        raise RealtimeEventError(
            "bad_json",
            "the message is not valid JSON text (a \\u escape of half a UTF-16 surrogate pair is no character)",
        )
    if not isinstance(data, dict):
        raise RealtimeEventError("bad_json", f"expected a JSON object with a 'type' key, got {type(data).__name__}")
    raw_id = data.get("event_id")
    event_id = raw_id if isinstance(raw_id, str) and len(raw_id) <= MAX_EVENT_ID_CHARS else None
    problem = type_problem(data, CLIENT_EVENT_TYPES, "client event")
    if problem is not None:
        raise RealtimeEventError(
            "unknown_event",
            f"{problem}; this server accepts {', '.join(CLIENT_EVENT_TYPES)}",
            event_id=event_id,
            param="type",
        )
    kind = data["type"]
    if _nested_deeper_than(data, MAX_EVENT_DEPTH):
        raise RealtimeEventError(
            "invalid_event",
            f"{kind}: arrays and objects nested more than {MAX_EVENT_DEPTH} levels deep, over this server's limit; "
            "send a flatter event (not applied)",
            event_id=event_id,
        )
    if kind == "session.update":
        return _session_update(data, event_id)
    try:
        return _client_adapter.validate_python(data)
    except ValidationError as exc:
        raise _invalid(exc, kind, event_id) from None


_ITEM_TAGS = ("message", "function_call", "function_call_output")


def _param(loc: tuple[Any, ...], kind: str) -> str | None:
    """A pydantic error location as the field's dotted path (union tags left out, each part cut short)."""
    parts = [str(p)[:64] for p in loc if str(p) != kind]
    if len(parts) >= 2 and parts[0] == "item" and parts[1] in _ITEM_TAGS:
        del parts[1]  # the union's tag, not a field
    return ".".join(parts) or None


def _invalid(exc: ValidationError, kind: str, event_id: str | None) -> RealtimeEventError:
    errors = exc.errors(include_url=False)
    parts = [f"{_param(e['loc'], kind) or '(event)'}: {e['msg']}" for e in errors[:MAX_REPORTED_PROBLEMS]]
    more = len(errors) - len(parts)
    message = f"{kind}: " + "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
    return RealtimeEventError("invalid_event", message, event_id=event_id, param=_param(errors[0]["loc"], kind))


_MAX_ROUNDS = 32


def _session_update(data: dict[str, Any], event_id: str | None) -> SessionUpdate:
    """``session.update`` with every invalid field of its ``session`` left out (and named in ``problems``)."""
    session = data.get("session")
    if not isinstance(session, dict):
        raise RealtimeEventError(
            "invalid_event", "session.update: session: Input should be an object", event_id=event_id, param="session"
        )
    try:
        envelope = SessionUpdate.model_validate({**data, "session": {}})
    except ValidationError as exc:
        raise _invalid(exc, "session.update", event_id) from None
    problems: list[tuple[str, str]] = []
    for _ in range(_MAX_ROUNDS):
        try:
            config = SessionConfig.model_validate(session)
            break
        except ValidationError as exc:
            for err in exc.errors(include_url=False):
                path = _drop(session, err["loc"])
                if path is None or any(_related(path, p) for p, _ in problems):
                    continue  # removed already, or the consequence of an earlier removal
                problems.append((path, f"session.update: session.{path}: {err['msg']}; not applied"))
    else:
        raise RealtimeEventError(
            "invalid_event", "session.update: the session could not be read", event_id=event_id, param="session"
        )
    if len(problems) > MAX_REPORTED_PROBLEMS:
        rest = len(problems) - MAX_REPORTED_PROBLEMS + 1
        problems[MAX_REPORTED_PROBLEMS - 1 :] = [("session", f"session.update: {rest} more invalid fields not applied")]
    problems = [("session" if p == "session" else f"session.{p}", m) for p, m in problems]
    return envelope.model_copy(update={"session": config, "problems": problems})


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _drop(root: dict[str, Any], loc: tuple[Any, ...]) -> str | None:
    """Remove what a validation error points at from ``root``: the deepest object member on its path, or the list
    on its path (a list is taken whole). Returns its dotted path (None: nothing left to remove there)."""
    parent: dict[str, Any] | None = None
    key = ""
    node: Any = root
    path: list[str] = []
    for part in loc:
        if not (isinstance(node, dict) and isinstance(part, str) and part in node):
            break
        parent, key, node = node, part, node[part]
        path.append(part[:64])
        if isinstance(node, list):
            break
    if parent is None:
        return None
    del parent[key]
    return ".".join(path)


# ---------------------------------------------------------------------------------------------------- server


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContentPart(_Out):
    """A content part of a message item (``input_audio`` for the user, ``output_audio`` for the agent)."""

    type: Literal["input_audio", "output_audio", "input_text", "output_text"]
    transcript: str | None = None
    text: str | None = None


class MessageItem(_Out):
    id: str
    object: Literal["realtime.item"] = "realtime.item"
    type: Literal["message"] = "message"
    status: Literal["completed", "incomplete", "in_progress"] = "completed"
    role: Literal["user", "assistant", "system"]
    content: list[ContentPart] = Field(default_factory=list)


class FunctionCallItem(_Out):
    id: str
    object: Literal["realtime.item"] = "realtime.item"
    type: Literal["function_call"] = "function_call"
    status: Literal["completed", "incomplete", "in_progress"] = "completed"
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Out):
    id: str
    object: Literal["realtime.item"] = "realtime.item"
    type: Literal["function_call_output"] = "function_call_output"
    status: Literal["completed", "incomplete", "in_progress"] = "completed"
    call_id: str
    output: str


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem


class ErrorDetail(_Out):
    type: Literal["invalid_request_error", "server_error"] = "invalid_request_error"
    code: str
    message: str
    param: str | None = None
    event_id: str | None = Field(default=None, description="the client event that caused the error")


class StatusDetails(_Out):
    type: Literal["completed", "cancelled", "incomplete", "failed"]
    reason: Literal["turn_detected", "client_cancelled", "max_output_tokens", "content_filter"] | None = None
    error: dict[str, Any] | None = None


class Usage(_Out):
    """Token counts of a response: text tokens are the agent's text tokens, audio tokens its 80 ms frames."""

    total_tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    input_token_details: dict[str, int] = Field(
        default_factory=lambda: {"text_tokens": 0, "audio_tokens": 0, "cached_tokens": 0}
    )
    output_token_details: dict[str, int] = Field(default_factory=lambda: {"text_tokens": 0, "audio_tokens": 0})


class Response(_Out):
    id: str
    object: Literal["realtime.response"] = "realtime.response"
    status: Literal["in_progress", "completed", "cancelled", "incomplete", "failed"] = "in_progress"
    status_details: StatusDetails | None = None
    output: list[Item] = Field(default_factory=list)
    conversation_id: str | None = None
    output_modalities: list[str] = Field(default_factory=lambda: ["audio"])
    audio: dict[str, Any] | None = None
    max_output_tokens: int | Literal["inf"] = "inf"
    metadata: dict[str, str] | None = None
    usage: Usage | None = None


class _ServerEvent(_Out):
    event_id: str = Field(default_factory=lambda: new_id("event"))


class ErrorEvent(_ServerEvent):
    type: Literal["error"] = "error"
    error: ErrorDetail


class SessionEvent(_ServerEvent):
    type: Literal["session.created", "session.updated"]
    session: dict[str, Any]


class ConversationCreated(_ServerEvent):
    type: Literal["conversation.created"] = "conversation.created"
    conversation: dict[str, Any]


class SpeechStarted(_ServerEvent):
    type: Literal["input_audio_buffer.speech_started"] = "input_audio_buffer.speech_started"
    audio_start_ms: int
    item_id: str


class SpeechStopped(_ServerEvent):
    type: Literal["input_audio_buffer.speech_stopped"] = "input_audio_buffer.speech_stopped"
    audio_end_ms: int
    item_id: str


class Committed(_ServerEvent):
    type: Literal["input_audio_buffer.committed"] = "input_audio_buffer.committed"
    item_id: str
    previous_item_id: str | None = None


class Cleared(_ServerEvent):
    type: Literal["input_audio_buffer.cleared"] = "input_audio_buffer.cleared"


class OutputCleared(_ServerEvent):
    """``output_audio_buffer.cleared``: ``response_id`` (required by the published schema) is the response whose
    audio was cleared: the one in progress, else the last one ("" before any)."""

    type: Literal["output_audio_buffer.cleared"] = "output_audio_buffer.cleared"
    response_id: str


class ItemEvent(_ServerEvent):
    """``conversation.item.added`` / ``conversation.item.done`` (beta: ``conversation.item.created`` / not sent)."""

    type: Literal["conversation.item.added", "conversation.item.done", "conversation.item.retrieved"]
    item: Item
    previous_item_id: str | None = None


class ItemTruncated(_ServerEvent):
    type: Literal["conversation.item.truncated"] = "conversation.item.truncated"
    item_id: str
    content_index: int
    audio_end_ms: int


class ItemDeleted(_ServerEvent):
    type: Literal["conversation.item.deleted"] = "conversation.item.deleted"
    item_id: str


class TranscriptionDelta(_ServerEvent):
    type: Literal["conversation.item.input_audio_transcription.delta"] = (
        "conversation.item.input_audio_transcription.delta"
    )
    item_id: str
    content_index: int = 0
    delta: str


class TranscriptionCompleted(_ServerEvent):
    type: Literal["conversation.item.input_audio_transcription.completed"] = (
        "conversation.item.input_audio_transcription.completed"
    )
    item_id: str
    content_index: int = 0
    transcript: str
    usage: dict[str, Any] = Field(description="``{type: duration, seconds}``: the utterance's length")


class TranscriptionFailed(_ServerEvent):
    type: Literal["conversation.item.input_audio_transcription.failed"] = (
        "conversation.item.input_audio_transcription.failed"
    )
    item_id: str
    content_index: int = 0
    error: dict[str, Any]


class ResponseEvent(_ServerEvent):
    type: Literal["response.created", "response.done"]
    response: Response


class OutputItemEvent(_ServerEvent):
    type: Literal["response.output_item.added", "response.output_item.done"]
    response_id: str
    output_index: int
    item: Item


class ContentPartEvent(_ServerEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    part: dict[str, Any]


class AudioDelta(_ServerEvent):
    type: Literal["response.output_audio.delta"] = "response.output_audio.delta"
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    delta: str = Field(description="base64 audio in the session's output format")


class AudioDone(_ServerEvent):
    type: Literal["response.output_audio.done"] = "response.output_audio.done"
    response_id: str
    item_id: str
    output_index: int
    content_index: int


class TranscriptDelta(_ServerEvent):
    type: Literal["response.output_audio_transcript.delta"] = "response.output_audio_transcript.delta"
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    delta: str


class TranscriptDone(_ServerEvent):
    type: Literal["response.output_audio_transcript.done"] = "response.output_audio_transcript.done"
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    transcript: str


class TextDelta(_ServerEvent):
    """``response.output_text.delta``: the agent's text when the client asked for text output only."""

    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    delta: str


class TextDone(_ServerEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDelta(_ServerEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    response_id: str
    item_id: str
    output_index: int
    call_id: str
    delta: str


class ArgumentsDone(_ServerEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    response_id: str
    item_id: str
    output_index: int
    call_id: str
    name: str
    arguments: str


class CspanEvent(_ServerEvent):
    """An extension event (``cspan.ready``, ``cspan.span``, ...), sent only to clients that asked for them."""

    model_config = ConfigDict(extra="allow")

    type: str


ServerEvent = (
    ErrorEvent
    | SessionEvent
    | ConversationCreated
    | SpeechStarted
    | SpeechStopped
    | Committed
    | Cleared
    | OutputCleared
    | ItemEvent
    | ItemTruncated
    | ItemDeleted
    | TranscriptionDelta
    | TranscriptionCompleted
    | TranscriptionFailed
    | ResponseEvent
    | OutputItemEvent
    | ContentPartEvent
    | AudioDelta
    | AudioDone
    | TranscriptDelta
    | TranscriptDone
    | TextDelta
    | TextDone
    | ArgumentsDelta
    | ArgumentsDone
    | CspanEvent
)

_BETA_TYPES = {
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "conversation.item.added": "conversation.item.created",
}
_BETA_CONTENT = {"output_audio": "audio", "output_text": "text"}


def _beta_item(item: dict[str, Any]) -> dict[str, Any]:
    for part in item.get("content") or ():
        part["type"] = _BETA_CONTENT.get(part["type"], part["type"])
    return item


def event_dict(event: ServerEvent, dialect: Dialect = "ga") -> dict[str, Any] | None:
    """A server event as the JSON object sent to a client of ``dialect`` (None: not sent in that dialect)."""
    data = event.model_dump(mode="json", exclude_none=True)
    if dialect == "ga":
        return data
    kind = data["type"]
    if kind == "conversation.item.done":
        return None
    data["type"] = _BETA_TYPES.get(kind, kind)
    if "item" in data:
        _beta_item(data["item"])
    if isinstance(data.get("part"), dict):
        part = data["part"]
        part["type"] = _BETA_CONTENT.get(part.get("type"), part.get("type"))
    if "response" in data:
        response = data["response"]
        response["modalities"] = response.pop("output_modalities", ["audio", "text"])
        response.pop("audio", None)
        response["max_output_tokens"] = response.get("max_output_tokens", "inf")
        for item in response.get("output") or ():
            _beta_item(item)
    return data


def dump_event(event: ServerEvent, dialect: Dialect = "ga") -> str | None:
    """:func:`event_dict` as compact JSON text (None: not sent in that dialect)."""
    data = event_dict(event, dialect)
    return None if data is None else json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def error_event(exc: RealtimeEventError) -> ErrorEvent:
    """The ``error`` event for a refused client event."""
    return ErrorEvent(error=ErrorDetail(code=exc.code, message=exc.message, param=exc.param, event_id=exc.event_id))


__all__ = [
    "BETA_SUBPROTOCOL",
    "CLIENT_EVENT_TYPES",
    "ERROR_CODES",
    "INSECURE_KEY_SUBPROTOCOL_PREFIX",
    "MAX_EVENT_DEPTH",
    "MAX_TOOL_SCHEMA_NODES",
    "OPENAI_VOICES",
    "WARNING_CODES",
    "ClientEvent",
    "CspanOptions",
    "Dialect",
    "FunctionTool",
    "RealtimeEventError",
    "ServerEvent",
    "SessionConfig",
    "dump_event",
    "error_event",
    "event_dict",
    "function_tools",
    "new_id",
    "parse_client_event",
]
