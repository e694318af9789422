"""``/v1/realtime``: the OpenAI Realtime API (WebSocket, the published event schema), with the client's tools.

Point an OpenAI SDK at the server (``base_url="http://HOST:PORT/v1"``) and use its realtime client; the prose is
``docs/PROTOCOL.md`` ("OpenAI Realtime API"), the events :mod:`cspan.server.realtime_events`, the audio formats
:mod:`cspan.server.realtime_audio`, the grouping into items and responses :mod:`cspan.server.realtime_turns`.

The session starts at the first ``input_audio_buffer.append`` (or ``response.create``): the persona prefix is then
read with the ``instructions`` and ``voice`` of the ``session.update``\\ s so far, and the model listens and speaks
full duplex from there. The client's function ``tools`` join the router's tool bank for this session: when a
``<ret>``'s router picks one, the call goes to the client as a ``function_call`` item, and the
``function_call_output`` it sends back is read as a Context Span, as is (after ``(tool result)``); a call that
fails or is not answered within ``--client-tool-timeout-s`` is read as the abstain clause, and the conversation goes
on. Everything sent to the client goes through the session's outbox, in order with the agent's frames.

Credentials: ``Authorization: Bearer <token>`` (the SDKs send their API key there), the subprotocol
``openai-insecure-api-key.<token>`` (browsers), or ``?token=``. The beta event names are spoken to a client that
sends ``OpenAI-Beta: realtime=v1`` or offers the subprotocol ``openai-beta.realtime-v1``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import ValidationError

from cspan.backends.untrusted import JSONInputError, loads
from cspan.core.events import (
    ErrorEvent as CoreErrorEvent,
)
from cspan.core.events import (
    LateEvent,
    NoSpanEvent,
    PersonaEvent,
    QuestionEvent,
    RetEvent,
    SpanEvent,
    TextEvent,
    UserTextEvent,
)
from cspan.server.adapters import Connection, Credential, ProtocolAdapter, off_loop
from cspan.server.auth import bearer_token
from cspan.server.realtime_audio import GA_FORMATS, GA_NAMES, AudioFormat, InputAudio, OutputAudio
from cspan.server.realtime_events import (
    BETA_SUBPROTOCOL,
    INSECURE_KEY_SUBPROTOCOL_PREFIX,
    OPENAI_VOICES,
    ConversationCreated,
    ConversationItemCreate,
    ConversationItemDelete,
    ConversationItemRetrieve,
    ConversationItemTruncate,
    CspanEvent,
    Dialect,
    ErrorDetail,
    ErrorEvent,
    FunctionCallItem,
    FunctionCallItemIn,
    FunctionCallOutputItem,
    FunctionCallOutputItemIn,
    FunctionTool,
    InputAudioBufferAppend,
    InputAudioBufferClear,
    InputAudioBufferCommit,
    ItemDeleted,
    ItemEvent,
    ItemTruncated,
    MessageItem,
    OutputAudioBufferClear,
    OutputCleared,
    RealtimeEventError,
    ResponseCancel,
    ResponseCreate,
    ServerEvent,
    SessionConfig,
    SessionEvent,
    SessionUpdate,
    dump_event,
    error_event,
    function_tools,
    new_id,
    parse_client_event,
)
from cspan.server.realtime_events import (
    Cleared as ClearedEvent,
)
from cspan.server.realtime_events import (
    ContentPart as ContentPartOut,
)
from cspan.server.realtime_turns import ITEM_LOG_SIZE, ItemLog, ResponseStream, UserSpeech
from cspan.server.session import (
    AdapterItem,
    AgentAudio,
    Busy,
    ClientError,
    Ended,
    ErrorOut,
    Outbound,
    ProfileFields,
    Ready,
    SamplingOptions,
    StartRequest,
    Timing,
    VoiceSet,
    brief,
)

logger = logging.getLogger(__name__)

SERVER_ERROR_CODES = frozenset({"internal", "persona_failed", "busy", "backend", "session_ended"})
"""Codes sent with ``error.type`` ``server_error`` (the others are ``invalid_request_error``)."""


@dataclass
class _Config:
    """The session's effective configuration (what ``session.updated`` reports)."""

    instructions: str | None = None
    voice: str | None = None
    input_format: AudioFormat = "pcm16"
    output_format: AudioFormat = "pcm16"
    modality: Literal["audio", "text"] = "audio"
    tools: list[FunctionTool] = field(default_factory=list)
    tool_choice: Any = "auto"
    events: bool = False
    profile: ProfileFields = field(default_factory=ProfileFields)
    temperature: float | None = None
    test: Any = None


CALLS_KEPT = ITEM_LOG_SIZE
"""Answered (or timed-out) client function calls remembered, to refuse a second or late output for them with
``late_call_output`` (the latest; each call is a ``function_call`` item of the log, so a call forgotten here has
left the log too, and an output for it is ``unknown_call_id`` like any call the conversation no longer holds)."""


@dataclass
class _Call:
    """A client function call in flight: made by the router's tool, answered by ``function_call_output``."""

    name: str
    arguments: dict[str, Any]
    future: asyncio.Future[str]
    call_id: str | None = None
    timed_out: bool = False


@dataclass
class _Emit(AdapterItem):
    """Server events decided by ``receive``, sent in order with the session's outputs."""

    events: list[ServerEvent]


@dataclass
class _Command(AdapterItem):
    """``response.create`` / ``response.cancel`` / ``output_audio_buffer.clear``: their effect depends on where
    the agent's output stands (applied when rendered)."""

    event: Any


@dataclass
class _Output(AdapterItem):
    """The client changed the output format or modality (applied from the next agent frame rendered)."""

    format: AudioFormat
    modality: Literal["audio", "text"]


@dataclass
class _FunctionCall(AdapterItem):
    """The router called a client tool (its ``function_call`` item is made when rendered)."""

    call: _Call


def _dialect(connection: Connection) -> Dialect:
    beta = "realtime=v1" in connection.headers.get("openai-beta", "") or BETA_SUBPROTOCOL in connection.subprotocols
    return "beta" if beta else "ga"


def _base64(text: str) -> bytes:
    """Base64 text -> bytes (``session.cspan.voice_audio``).

    Raises:
        ClientError: ``bad_voice_audio`` when it is not base64.
    """
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ClientError("bad_voice_audio", f"not base64 ({exc}); the session keeps its voice") from None


def _function_call_output(item: FunctionCallOutputItemIn) -> str:
    """The text read for a function's output: as is, or "" (the abstain clause) for a failed call."""
    if item.status == "incomplete":
        return ""
    text = item.output
    with contextlib.suppress(JSONInputError):
        data = loads(text)
        if isinstance(data, dict) and data.get("error"):
            return ""
    return text


class RealtimeAdapter(ProtocolAdapter):
    """``/v1/realtime``: OpenAI Realtime client events in, server events out (see the module docstring)."""

    name = "realtime"
    path = "/v1/realtime"

    @classmethod
    def credential(cls, connection: Connection) -> Credential:
        """``Authorization: Bearer``, else the subprotocol ``openai-insecure-api-key.<token>``, else ``?token=``;
        two that differ conflict. Browsers need one offered subprotocol echoed: ``realtime`` when offered (what
        OpenAI's server echoes)."""
        offered = connection.subprotocols
        keys = [p for p in offered if p.startswith(INSECURE_KEY_SUBPROTOCOL_PREFIX)]
        key = keys[0] if keys else None
        echo = "realtime" if "realtime" in offered else next((p for p in offered if p != key), key)
        return Credential.first_of(
            bearer_token(connection.headers.get("authorization")),
            *(k[len(INSECURE_KEY_SUBPROTOCOL_PREFIX) :] for k in keys),
            connection.query.get("token"),
            subprotocol=echo,
        )

    def __init__(self, session: Any, connection: Connection) -> None:
        super().__init__(session, connection)
        self.dialect = _dialect(connection)
        self.hub = session.hub
        self.config = _Config()
        self.items = ItemLog()
        self.user = UserSpeech(self.items)
        self.responses = ResponseStream(
            self.items, conversation_id=f"conv_{session.id}", audio_config=self._audio_output()
        )
        self.audio_in = InputAudio(self.config.input_format)
        self.audio_out = OutputAudio(self.config.output_format)
        self.session_id = f"sess_{session.id}"
        self._calls: dict[str, _Call] = {}
        self._last_call: dict[str, str] = {}
        self._client_tools: list[Any] = []
        self._warned: set[str] = set()

    # -- inbound ------------------------------------------------------------------------------------------------

    async def opened(self) -> None:
        """``session.created`` (with this server's defaults) and ``conversation.created``."""
        self._emit(
            SessionEvent(type="session.created", session=self._session_object()),
            ConversationCreated(conversation={"id": f"conv_{self.session.id}", "object": "realtime.conversation"}),
        )

    async def receive(self, data: bytes | str) -> None:
        event_id = None
        try:
            if isinstance(data, bytes):
                raise RealtimeEventError(
                    "binary_message", "binary messages are not Realtime events: send JSON text (audio as base64)"
                )
            event = await off_loop(len(data), parse_client_event, data)
            event_id = event.event_id
            await self._handle(event)
        except RealtimeEventError as exc:
            self._error(exc)
        except ClientError as exc:  # the session core refused (not_started, audio_overflow, bad_voice, ...)
            self._error(RealtimeEventError(exc.code, exc.message, event_id=event_id))
        except Exception as exc:  # a bug: reported with the event's id, and the session goes on
            logger.exception("session %s: a realtime event failed", self.session.id)
            # the exception's text stays in the server's log: it may name paths or other internals
            message = (
                f"an unexpected server error ({type(exc).__name__}); the server log has it (session {self.session.id})"
            )
            self._error(RealtimeEventError("internal", message, event_id=event_id))

    async def _handle(self, event: Any) -> None:
        if isinstance(event, InputAudioBufferAppend):
            await self._append(event)
        elif isinstance(event, SessionUpdate):
            await self._session_update(event)
        elif isinstance(event, ConversationItemCreate):
            self._item_create(event)
        elif isinstance(event, ResponseCreate):
            await self._ensure_started()
            self.session.put(_Command(event))
        elif isinstance(event, (ResponseCancel, OutputAudioBufferClear)):
            self.session.put(_Command(event))
        elif isinstance(event, InputAudioBufferClear):
            self.audio_in.clear()
            self._emit(ClearedEvent(type="input_audio_buffer.cleared"))
        elif isinstance(event, InputAudioBufferCommit):
            raise RealtimeEventError(
                "unsupported",
                "the server detects the user's turns itself (server VAD, always on): input_audio_buffer.commit has "
                "no effect",
                event_id=event.event_id,
            )
        elif isinstance(event, ConversationItemTruncate):
            self._truncate(event)
        elif isinstance(event, ConversationItemDelete):
            self.items.delete(event.item_id, event_id=event.event_id)
            self.user.release(event.item_id)  # a deleted user item's id may be given again
            self._emit(ItemDeleted(item_id=event.item_id))
        elif isinstance(event, ConversationItemRetrieve):
            item = self.items.get(event.item_id, event_id=event.event_id)
            self._emit(ItemEvent(type="conversation.item.retrieved", item=item))

    async def _append(self, event: InputAudioBufferAppend) -> None:
        pcm = await off_loop(len(event.audio), self._decode_audio, event.audio, event.event_id)
        await self._ensure_started()
        if pcm.size:
            self.session.push_audio(pcm)

    def _decode_audio(self, audio: str, event_id: str | None) -> np.ndarray:
        """Base64 audio of the input format -> float32 at 24 kHz (cost grows with the chunk: run by off_loop)."""
        try:
            raw = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RealtimeEventError(
                "bad_audio", f"audio is not base64 ({exc})", event_id=event_id, param="audio"
            ) from None
        return self.audio_in.decode(raw)

    async def _ensure_started(self) -> None:
        """Start the conversation (read the persona) if it has not started yet."""
        if self.session.state != "connected":
            return
        c = self.config
        test = c.test
        await self.session.start(
            StartRequest(
                voice=c.voice,
                text_prompt=c.instructions,
                profile=c.profile,
                seed=test.seed if test is not None else None,
                sampling=SamplingOptions(audio_temperature=c.temperature),
                force_ret_at=list(test.force_ret_at) if test is not None else [],
                spans=[(t, text) for t, text in test.spans] if test is not None else [],
                test=test is not None,
                tools=self._router_tools(),
            )
        )

    async def _session_update(self, event: SessionUpdate) -> None:
        """Apply every valid field, then ``session.updated``, then one ``error`` per field not applied (invalid, a
        voice this server does not have, instructions or voice after the persona was read, ...) and a
        ``cspan.warning`` per field accepted that will not do what the client may expect."""
        new, event_id = event.session, event.event_id
        if new.type == "transcription":
            raise RealtimeEventError(
                "unsupported", "transcription-only sessions are not supported", event_id=event_id, param="session.type"
            )
        problems = [RealtimeEventError("invalid_event", m, event_id=event_id, param=p) for p, m in event.problems]
        warnings: list[tuple[str, str, str]] = []

        def refuse(code: str, message: str, param: str) -> None:
            problems.append(RealtimeEventError(code, message, event_id=event_id, param=param))

        tools: list[FunctionTool] | None = None
        bank_tools: list[Any] = []
        recorded: VoiceSet | None = None
        if new.tools is not None:
            try:  # schemas become validated models: cost grows with them, so off the event loop
                tools, bank_tools = await asyncio.to_thread(self._tools_of, new, event_id, self.hub.tool_names())
            except RealtimeEventError as exc:
                problems.append(exc)
        c = self.config
        settings = self.hub.settings
        started = self.session.state != "connected"
        if new.instructions is not None and new.instructions != c.instructions:
            if len(new.instructions) > settings.max_text_prompt_chars:
                refuse(
                    "invalid_instructions",
                    f"instructions of {len(new.instructions)} characters, over this server's limit of "
                    f"{settings.max_text_prompt_chars}; not applied",
                    "session.instructions",
                )
            elif started:
                refuse(
                    "session_live",
                    "instructions changed after the conversation started: the persona was read with the earlier "
                    "ones (send session.update before the first audio); not applied",
                    "session.instructions",
                )
            else:
                c.instructions = new.instructions
        voice, voice_param = new.voice, "session.voice"
        if voice is None and new.audio is not None and new.audio.output is not None:
            voice, voice_param = new.audio.output.voice, "session.audio.output.voice"  # the field the client sent
        voice_name = voice.get("id") if isinstance(voice, dict) else voice
        current = self._voice()
        if voice_name is not None and voice_name != current:
            if not isinstance(voice_name, str) or voice_name not in self.hub.voice_names:
                if isinstance(voice_name, str) and voice_name in OPENAI_VOICES:
                    warnings.append(
                        (
                            "voice_not_applied",
                            f"voice {voice_name!r} is one of OpenAI's; this server speaks with its own voices "
                            f"({', '.join(self.hub.voice_names) or 'none'}) and keeps {current!r}",
                            voice_param,
                        )
                    )
                else:
                    refuse(
                        "bad_voice",
                        f"voice {brief(voice_name)} is not a voice of this server "
                        f"({', '.join(self.hub.voice_names) or 'none'}); not applied",
                        voice_param,
                    )
            elif started:
                refuse(
                    "session_live",
                    "voice changed after the conversation started: the persona was read with the earlier one; not "
                    "applied",
                    voice_param,
                )
            else:
                c.voice = voice_name
        audio_in = new.audio.input if new.audio is not None else None
        audio_out = new.audio.output if new.audio is not None else None
        in_fmt = new.input_audio_format or (GA_FORMATS[audio_in.format.type] if audio_in and audio_in.format else None)
        out_fmt = new.output_audio_format or (
            GA_FORMATS[audio_out.format.type] if audio_out and audio_out.format else None
        )
        if in_fmt is not None and in_fmt != c.input_format:
            c.input_format = in_fmt
            self.audio_in = InputAudio(in_fmt)
        modalities = new.output_modalities or new.modalities
        modality = c.modality if not modalities else "audio" if "audio" in modalities else "text"
        if (out_fmt is not None and out_fmt != c.output_format) or modality != c.modality:
            c.output_format = out_fmt or c.output_format
            c.modality = modality
            self.session.put(_Output(c.output_format, modality))  # frames already queued keep their format
        if new.tool_choice is not None:
            c.tool_choice = new.tool_choice
        if new.temperature is not None and new.temperature != c.temperature:
            try:  # the speech's sampling temperature (the text keeps the server's)
                options = SamplingOptions(audio_temperature=new.temperature)
                if started:
                    await self.session.set_sampling(options)
                c.temperature = options.audio_temperature
            except ValidationError as exc:
                message = exc.errors(include_url=False)[0]["msg"]
                refuse(
                    "invalid_event", f"temperature {new.temperature!r}: {message}; not applied", "session.temperature"
                )
            except ClientError as exc:
                refuse(exc.code, f"temperature: {exc.message}; not applied", "session.temperature")
        if tools is not None:
            c.tools = tools
            self._client_tools = bank_tools
            if tools and self._tools_inert():
                warnings.append(
                    (
                        "tools_inert",
                        "this server's router never calls a client's function (--router local or none; an LLM "
                        "router, --router URL, does): the tools are accepted and will not be called",
                        "session.tools",
                    )
                )
        if tools is not None or new.tool_choice is not None:
            self.session.set_tools(self._router_tools())
        options = new.cspan
        if options is not None:
            if options.events is not None:
                c.events = options.events
            if options.test is not None:
                if not settings.test_hooks:
                    refuse("invalid_event", "test hooks are disabled on this server; not applied", "session.cspan.test")
                elif started:
                    refuse(
                        "session_live", "test hooks must come before the first audio; not applied", "session.cspan.test"
                    )
                else:
                    c.test = options.test
            if options.profile is not None:
                try:
                    if started:
                        self.session.update_profile(options.profile)
                    c.profile = c.profile.model_copy(update=options.profile.model_dump(exclude_unset=True))
                except ClientError as exc:
                    refuse(exc.code, f"{exc.message}; not applied", "session.cspan.profile")
            if options.voice_audio is not None:
                param = "session.cspan.voice_audio"
                if started:
                    refuse(
                        "session_live",
                        "a voice recording after the conversation started: the persona was read with the earlier "
                        "voice; not applied",
                        param,
                    )
                else:
                    try:
                        recorded = await self.session.set_voice_audio(
                            await off_loop(len(options.voice_audio), _base64, options.voice_audio)
                        )
                        c.voice = None  # the recording is the voice from now on (a later voice name replaces it)
                    except ClientError as exc:
                        refuse(exc.code, exc.message, param)
        self._emit(SessionEvent(type="session.updated", session=self._session_object()))
        if recorded is not None:
            self._emit(*self._extension("cspan.voice", dataclasses.asdict(recorded)))
        for exc in problems:
            self._error(exc)
        for code, message, param in warnings:
            self._warn(code, message, param, event_id)

    def _item_create(self, event: ConversationItemCreate) -> None:
        event_id = event.event_id
        if event.previous_item_id is not None and event.previous_item_id != "root":
            self.items.get(event.previous_item_id, event_id=event_id, param="previous_item_id")
        item = event.item
        if item.id is not None and (item.id in self.items.items or self.user.reserved(item.id)):
            raise RealtimeEventError(
                "invalid_event",
                f"an item with id {item.id!r} is in this conversation already: give a new id, or none",
                event_id=event_id,
                param="item.id",
            )
        if isinstance(item, FunctionCallOutputItemIn):
            call = self._calls.get(item.call_id)
            if call is None and self.items.function_call(item.call_id) is None:
                raise RealtimeEventError(
                    "unknown_call_id",
                    f"no function call {item.call_id!r} in this session",
                    event_id=event_id,
                    param="item.call_id",
                )
            if call is None and self.items.has_output(item.call_id):  # the client's own call, answered already
                raise RealtimeEventError(
                    "late_call_output",
                    f"call {item.call_id!r} has an output in this conversation already",
                    event_id=event_id,
                    param="item.call_id",
                )
            if call is not None:  # the router's call, waiting for this output (else the client's own call item)
                if call.timed_out or call.future.done():
                    why = (
                        f"was not answered within {self.hub.settings.client_tool_timeout_s:g} s: the abstain clause "
                        "was read instead"
                        if call.timed_out
                        else "has an output already: the first one was read"
                    )
                    raise RealtimeEventError(
                        "late_call_output", f"call {item.call_id!r} {why}", event_id=event_id, param="item.call_id"
                    )
                call.future.set_result(_function_call_output(item))
            stored: Any = FunctionCallOutputItem(id=item.id or new_id("item"), call_id=item.call_id, output=item.output)
        elif isinstance(item, FunctionCallItemIn):
            call_id = item.call_id or new_id("call")
            if call_id in self._calls or self.items.function_call(call_id) is not None:
                raise RealtimeEventError(
                    "invalid_event",
                    f"a function call {call_id!r} is in this conversation already: give a new call_id",
                    event_id=event_id,
                    param="item.call_id",
                )
            stored = FunctionCallItem(
                id=item.id or new_id("item"), call_id=call_id, name=item.name, arguments=item.arguments
            )
        else:  # a message: kept in the conversation's items; the model hears audio only
            parts = [
                ContentPartOut(type=p.type, text=p.text, transcript=p.transcript)  # type: ignore[arg-type]
                for p in item.content
                if p.type in ("input_text", "output_text", "input_audio", "output_audio")
            ]
            stored = MessageItem(id=item.id or new_id("item"), role=item.role, content=parts)
        previous = self.items.add(stored, after=event.previous_item_id)
        self._emit(
            ItemEvent(type="conversation.item.added", item=stored, previous_item_id=previous),
            ItemEvent(type="conversation.item.done", item=stored, previous_item_id=previous),
        )

    def _truncate(self, event: ConversationItemTruncate) -> None:
        """``conversation.item.truncate``: acknowledged for an assistant message's audio part within the audio sent
        (the model's context keeps what it said; a client truncates what its user heard)."""
        item = self.items.get(event.item_id, event_id=event.event_id)
        if not (isinstance(item, MessageItem) and item.role == "assistant"):
            raise RealtimeEventError(
                "unknown_item", f"{event.item_id!r} is not an assistant message", event_id=event.event_id
            )
        if event.content_index != 0:
            raise RealtimeEventError(
                "invalid_event",
                f"content_index {event.content_index}: an assistant message of this server has one content part (0)",
                event_id=event.event_id,
                param="content_index",
            )
        sent_ms = self.items.audio_ms(item.id)
        if event.audio_end_ms > sent_ms:
            raise RealtimeEventError(
                "invalid_event",
                f"audio_end_ms {event.audio_end_ms} is past the end of the {sent_ms} ms of audio sent for {item.id!r}",
                event_id=event.event_id,
                param="audio_end_ms",
            )
        self._emit(ItemTruncated(item_id=item.id, content_index=0, audio_end_ms=event.audio_end_ms))

    # -- client tools -------------------------------------------------------------------------------------------

    def _tools_of(
        self, new: SessionConfig, event_id: str | None, taken: set[str]
    ) -> tuple[list[FunctionTool], list[Any]]:
        """The function tools of a ``session.update`` and the router-bank tools made of them (runs on a worker thread:
        each schema becomes a validated model).

        Raises:
            RealtimeEventError: see :func:`~cspan.server.realtime_events.function_tools` and :meth:`_bank_tools`.
        """
        tools = function_tools(new, event_id) or []
        return tools, self._bank_tools(tools, event_id, taken)

    def _router_tools(self) -> list[Any]:
        """The client's functions the router may call: none while ``tool_choice`` is ``"none"`` (OpenAI's meaning: no
        function is called; the tools stay declared and come back with ``"auto"``)."""
        return [] if self.config.tool_choice == "none" else self._client_tools

    def _tools_inert(self) -> bool:
        """Whether this server's router never calls a client's function (no router, or the local one: it picks its
        own tools by rule)."""
        from cspan.backends.router import LocalRouter

        retriever = self.hub.retriever
        return retriever is None or isinstance(getattr(retriever, "router", None), LocalRouter)

    def _bank_tools(self, specs: list[FunctionTool], event_id: str | None, taken: set[str]) -> list[Any]:
        """The client's function tools as tools of the router's bank (their execution is a call to the client).

        Raises:
            RealtimeEventError: ``invalid_event`` for a name in ``taken`` (the server's own tools) or one the
                router reads as such (:func:`~cspan.backends.tools.bank.tool_name_key`: ``GET_TIME`` for
                ``get_time``), or parameters that are not an object schema.
        """
        from cspan.backends.errors import ToolError
        from cspan.backends.tools.bank import tool_name_key
        from cspan.backends.tools.catalog import callback_tool

        timeout = self.hub.settings.client_tool_timeout_s
        own = {tool_name_key(name): name for name in taken}
        tools = []
        for i, spec in enumerate(specs):
            server_tool = own.get(tool_name_key(spec.name))
            if server_tool is not None:  # the router reads GET_TIME or get-time as get_time
                same = "" if server_tool == spec.name else f" (read by the router as {server_tool!r})"
                raise RealtimeEventError(
                    "invalid_event",
                    f"session.tools[{i}]: {spec.name!r} is the name of one of this server's own tools{same}; rename "
                    "it (tools not applied)",
                    event_id=event_id,
                    param=f"session.tools[{i}].name",
                )

            async def call(arguments: dict[str, Any], name: str = spec.name) -> str:
                return await self._call_client(name, arguments)

            try:
                tools.append(callback_tool(spec.name, spec.description, spec.parameters, call, timeout_s=timeout + 1.0))
            except ToolError as exc:
                raise RealtimeEventError(
                    "invalid_event",
                    f"session.tools[{i}].parameters: {exc} (tools not applied)",
                    event_id=event_id,
                    param=f"session.tools[{i}].parameters",
                ) from None
        return tools

    async def _call_client(self, name: str, arguments: dict[str, Any]) -> str:
        """Send the call to the client and wait for its output (``""``, the abstain clause, on timeout or failure)."""
        call = _Call(name, arguments, asyncio.get_running_loop().create_future())
        self.session.put(_FunctionCall(call))
        try:
            return await asyncio.wait_for(asyncio.shield(call.future), self.hub.settings.client_tool_timeout_s)
        except TimeoutError:
            call.timed_out = True
            logger.info("session %s: function %s (%s) not answered in time", self.session.id, name, call.call_id)
            return ""

    # -- outbound -----------------------------------------------------------------------------------------------

    def render(self, item: Outbound) -> list[bytes | str]:
        events = self._events(item)
        return [text for text in (dump_event(e, self.dialect) for e in events) if text is not None]

    def _events(self, item: Outbound) -> list[ServerEvent]:
        if isinstance(item, AgentAudio):
            events = self.responses.audio(self.audio_out.encode(item.pcm))
            conversation = self.session.conversation
            if conversation is not None:
                events += self.user.poll(conversation.utterances)
            return events
        if isinstance(item, TextEvent):
            return self.responses.text(item.text)
        if isinstance(item, UserTextEvent):
            return self.user.transcript(
                item.utterance, item.text, final=item.final, start_s=item.start_s, end_s=item.end_s
            )
        if isinstance(item, _Emit):
            return item.events
        if isinstance(item, _FunctionCall):
            call = item.call
            events, call.call_id, _ = self.responses.function_call(call.name, call.arguments)
            self._calls[call.call_id] = call
            self._last_call[call.name] = call.call_id
            self._forget_calls()
            return events
        if isinstance(item, _Command):
            return self._command(item.event)
        if isinstance(item, _Output):
            events = self.responses.finish() if item.modality != self.responses.modality else []
            self.audio_out = OutputAudio(item.format)
            self.responses.modality = item.modality
            self.responses.audio_config = self._audio_output()
            return events
        if isinstance(item, ErrorOut):
            detail = item.detail
            kind = "server_error" if item.code in SERVER_ERROR_CODES else "invalid_request_error"
            return [
                ErrorEvent(
                    error=ErrorDetail(
                        type=kind,
                        code=item.code,
                        message=item.message,
                        param=detail.get("param"),
                        event_id=detail.get("event_id"),
                    )
                )
            ]
        if isinstance(item, CoreErrorEvent):
            return [
                ErrorEvent(
                    error=ErrorDetail(type="server_error", code="backend", message=f"{item.stage}: {item.message}")
                )
            ]
        if isinstance(item, VoiceSet):  # reported after the session.updated of its session.update
            return []
        if isinstance(item, Ready):
            return self._extension("cspan.ready", {k: getattr(item, k) for k in ("conversation_id", "seed", "slot")})
        if isinstance(item, SpanEvent):
            data = item.model_dump(mode="json", exclude={"type"})
            data["call_id"] = self._last_call.get(item.tool) if item.tool else None
            return self._extension("cspan.span", data)
        if isinstance(item, (RetEvent, QuestionEvent, LateEvent, NoSpanEvent, PersonaEvent)):
            return self._extension(f"cspan.{item.type}", item.model_dump(mode="json", exclude={"type"}))
        if isinstance(item, Timing):
            return self._extension("cspan.slot", dataclasses.asdict(item))
        if isinstance(item, Busy):
            return [ErrorEvent(error=ErrorDetail(type="server_error", code="busy", message=item.message))]
        if isinstance(item, Ended):
            for call in self._calls.values():
                if not call.future.done():
                    call.future.set_result("")
            return [
                *self.responses.finish(),
                ErrorEvent(
                    error=ErrorDetail(
                        type="server_error",
                        code="session_ended",
                        message=f"the session ended ({item.reason}){': ' + item.message if item.message else ''}",
                        param=item.reason,
                    )
                ),
            ]
        return []

    def _forget_calls(self) -> None:
        """Keep the latest :data:`CALLS_KEPT` calls that are over (answered or timed out) and every one still
        waiting: the record stays bounded over any duration."""
        excess = len(self._calls) - CALLS_KEPT
        if excess > 0:
            over = [call_id for call_id, c in self._calls.items() if c.timed_out or c.future.done()]
            for call_id in over[:excess]:
                del self._calls[call_id]

    def _command(self, event: Any) -> list[ServerEvent]:
        """A client event applied where the agent's output stands (see :class:`_Command`)."""
        try:
            if isinstance(event, ResponseCreate):
                params = event.response
                return self.responses.create(params.metadata if params else None, event_id=event.event_id)
            if isinstance(event, ResponseCancel):
                return self.responses.cancel(event.response_id, event_id=event.event_id)
            if isinstance(event, OutputAudioBufferClear):
                events = self.responses.cancel(event_id=event.event_id) if self.responses.active else []
                return [*events, OutputCleared(response_id=self.responses.last_response_id or "")]
        except RealtimeEventError as exc:  # sent here, in order with this command's place in the output
            self.session.count_error(exc.code)
            suffix = self.session.error_admitted()
            if suffix is None:  # over the session's error budget: counted, not sent
                return []
            exc.message += suffix
            return [error_event(exc)]
        return []

    def _extension(self, kind: str, data: dict[str, Any]) -> list[ServerEvent]:
        return [CspanEvent(type=kind, **data)] if self.config.events else []

    # -- helpers --------------------------------------------------------------------------------------------------

    def _emit(self, *events: ServerEvent) -> None:
        self.session.put(_Emit(list(events)))

    def _error(self, exc: RealtimeEventError) -> None:
        """Count the refused event and send its ``error`` (with the event's id) after what is queued."""
        self.session.client_error(exc.code, exc.message, {"event_id": exc.event_id, "param": exc.param})

    def _warn(self, code: str, message: str, param: str, event_id: str | None) -> None:
        """A ``cspan.warning`` (to a client that asked for ``session.cspan.events``) for something accepted that will
        not do what the client may expect; logged once per session and code. Never an ``error`` event: some clients
        (pipecat) end the session on an error they do not know. Its ``event_id`` is its own, as every server
        event's; ``client_event_id`` is the client event's (left out when it had none: the openai SDK sends none),
        as an ``error`` event's ``error.event_id``."""
        if code not in self._warned:
            self._warned.add(code)
            logger.warning("session %s (realtime): %s: %s", self.session.id, code, message)
        data = {"code": code, "message": message, "param": param, "client_event_id": event_id}
        self._emit(*self._extension("cspan.warning", data))

    def _voice(self) -> str | None:
        """The voice the persona will be read with: the one named, else the client's recording, else the default."""
        recorded = self.session.recorded_voice
        return self.config.voice or (recorded.name if recorded is not None else None) or self.hub.default_voice

    def _audio_output(self) -> dict[str, Any]:
        return {"format": self._format(self.config.output_format), "voice": self._voice()}

    @staticmethod
    def _format(fmt: AudioFormat) -> dict[str, Any]:
        return {"type": GA_NAMES[fmt], "rate": 24000} if fmt == "pcm16" else {"type": GA_NAMES[fmt]}

    def _session_object(self) -> dict[str, Any]:
        """The effective session as ``session.created`` / ``session.updated`` report it (in the dialect's shape)."""
        c = self.config
        settings = self.hub.settings
        voice = self._voice()
        instructions = settings.text_prompt if c.instructions is None else c.instructions
        transcription = {"model": "cspan"} if self.hub.transcriber is not None else None
        turn_detection = {
            "type": "server_vad",
            "threshold": 0.5,
            "prefix_padding_ms": 0,
            "silence_duration_ms": 720,
            "create_response": True,
            "interrupt_response": False,
        }
        tools = [t.model_dump() for t in c.tools]
        common = {
            "id": self.session_id,
            "object": "realtime.session",
            "model": self.hub.public_model_name,
            "instructions": instructions,
            "tools": tools,
            "tool_choice": c.tool_choice,
        }
        if self.dialect == "beta":
            return {
                **common,
                "modalities": ["audio", "text"] if c.modality == "audio" else ["text"],
                "voice": voice,
                "input_audio_format": c.input_format,
                "output_audio_format": c.output_format,
                "input_audio_transcription": transcription,
                "turn_detection": turn_detection,
                "temperature": c.temperature if c.temperature is not None else self.hub.engine.audio_params.temperature,
                "max_response_output_tokens": "inf",
            }
        return {
            "type": "realtime",
            **common,
            "output_modalities": [c.modality],
            "audio": {
                "input": {
                    "format": self._format(c.input_format),
                    "transcription": transcription,
                    "turn_detection": turn_detection,
                    "noise_reduction": None,
                },
                "output": {"format": self._format(c.output_format), "voice": voice, "speed": 1.0},
            },
            "max_output_tokens": "inf",
            "tracing": None,
            "truncation": "disabled",
        }


ADAPTER = RealtimeAdapter
