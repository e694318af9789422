"""``/ws``: this project's own protocol (JSON events; PCM frames or Ogg/Opus, negotiated in ``start``;
``docs/PROTOCOL.md``, models in :mod:`cspan.server.protocol`)."""

from __future__ import annotations

import dataclasses

from pydantic import BaseModel

from cspan.server.adapters import Connection, Credential, ProtocolAdapter, off_loop
from cspan.server.auth import bearer_token
from cspan.server.opus import OGG_CAPTURE, OggOpusDecoder, OggOpusEncoder
from cspan.server.protocol import (
    CODECS,
    PROTOCOL_VERSION,
    TOKEN_SUBPROTOCOL_PREFIX,
    BusyMessage,
    ByeMessage,
    ContextMessage,
    ErrorMessage,
    ProtocolCodeError,
    ReadyMessage,
    SlotMessage,
    StartMessage,
    VoiceAudioMessage,
    VoiceMessage,
    decode_audio_frame,
    dumps,
    encode_audio_frame,
    event_to_wire,
    parse_client_message,
)
from cspan.server.session import (
    AgentAudio,
    Busy,
    ClientError,
    Ended,
    ErrorOut,
    Outbound,
    Ready,
    SamplingOptions,
    Session,
    StartRequest,
    Timing,
    VoiceSet,
)
from cspan.server.voices import VoiceUpload


class CspanAdapter(ProtocolAdapter):
    """``/ws``: binary messages are one 80 ms PCM frame each way (or Ogg/Opus, or before ``start`` the pieces of a
    voice recording), text messages are JSON (``start``, ``voice_audio``, ``context``, ``stop`` in; ``ready``,
    ``busy``, ``voice``, ``slot``, ``error``, ``bye`` and the conversation events out)."""

    name = "cspan"
    path = "/ws"

    def __init__(self, session: Session, connection: Connection) -> None:
        super().__init__(session, connection)
        self.codec = "pcm"
        self._decoder: OggOpusDecoder | None = None
        self._encoder: OggOpusEncoder | None = None
        self._upload: VoiceUpload | None = None

    @classmethod
    def credential(cls, connection: Connection) -> Credential:
        """The subprotocol ``cspan.token.<token>`` (echoed, as browsers require), else the query ``?token=``, else
        ``Authorization: Bearer`` (what a program other than a browser sends, as on the other protocols); two that
        differ conflict."""
        offered = [p for p in connection.subprotocols if p.startswith(TOKEN_SUBPROTOCOL_PREFIX)]
        tokens = [p[len(TOKEN_SUBPROTOCOL_PREFIX) :] for p in offered]
        return Credential.first_of(
            *tokens,
            connection.query.get("token"),
            bearer_token(connection.headers.get("authorization")),
            subprotocol=offered[0] if offered else None,
        )

    async def receive(self, data: bytes | str) -> None:
        if isinstance(data, bytes):
            if self._upload is not None:
                await self._voice_piece(self._upload, data)
            else:
                await self._audio(data)
            return
        msg = await off_loop(len(data), parse_client_message, data)
        if isinstance(msg, VoiceAudioMessage):
            self._announce_voice(msg.size)
        elif isinstance(msg, StartMessage):
            if self._upload is not None:
                raise ProtocolCodeError(
                    "invalid_message",
                    f"start while a voice recording is being sent ({self._upload.received} of {self._upload.size} "
                    "bytes so far): send the rest of it first, or a new voice_audio",
                )
            request = _start_request(msg)
            if self.session.state == "connected":
                self._negotiate(msg.codecs)
            await self.session.start(request)
        elif isinstance(msg, ContextMessage):
            self.session.update_profile(msg.profile)
        else:
            await self.session.stop()

    def _announce_voice(self, size: int) -> None:
        """``voice_audio``: the next ``size`` bytes of binary messages are a recording (an unfinished one is
        dropped)."""
        if self.session.state != "connected":
            raise ProtocolCodeError(
                "already_started",
                f"voice_audio while the session is {self.session.state}: the persona is read with the voice it had; "
                "send the recording before start",
            )
        if self._upload is not None:
            self.session.client_error(
                "bad_voice_audio",
                f"the voice recording announced before was not complete ({self._upload.received} of "
                f"{self._upload.size} bytes): dropped for the new one",
            )
        self._upload = VoiceUpload(size)

    async def _voice_piece(self, upload: VoiceUpload, data: bytes) -> None:
        """One binary message of an announced voice recording; the last one makes it the session's voice."""
        try:
            whole = upload.add(data)
        except ValueError as exc:
            self._upload = None
            raise ClientError(
                "bad_voice_audio", f"{exc}: the recording is dropped and the session keeps its voice"
            ) from None
        if whole is None:
            return
        self._upload = None
        await self.session.set_voice_audio(whole)

    def render(self, item: Outbound) -> list[bytes | str]:
        if isinstance(item, AgentAudio):
            if self._encoder is not None:
                data = self._encoder.encode(item.pcm)
                return [data] if data else []
            return [encode_audio_frame(item.pcm)]
        message = _message(item)
        if isinstance(message, ReadyMessage) and self.codec == "opus":
            message = message.model_copy(update={"codec": "opus", "audio_formats": ["ogg-opus"]})
        return [dumps(message)]

    def _negotiate(self, offered: list[str]) -> None:
        """The first offered codec this server has (``pcm`` when none is known)."""
        self.codec = next((c for c in offered if c in CODECS), "pcm")
        if self.codec == "opus":
            self._decoder, self._encoder = OggOpusDecoder(), OggOpusEncoder()
        else:
            self._decoder = self._encoder = None

    async def _audio(self, data: bytes) -> None:
        if self._decoder is None:
            if data[:4] == OGG_CAPTURE:
                raise ProtocolCodeError(
                    "bad_frame", "an Ogg page in a pcm session: offer 'opus' in start.codecs to send Ogg/Opus"
                )
            self.session.push_audio(decode_audio_frame(data))
            return
        pcm, problem = await off_loop(len(data), self._decoder.decode, data)
        self.session.push_audio(pcm)
        if problem:
            if data[:1] == b"{":
                problem += (
                    " (this binary message looks like JSON: send JSON messages as text WebSocket messages; binary "
                    "messages are Ogg/Opus audio in this session)"
                )
            raise ProtocolCodeError("bad_audio", problem)


def _start_request(msg: StartMessage) -> StartRequest:
    if msg.version is not None and msg.version != PROTOCOL_VERSION:
        raise ProtocolCodeError(
            "invalid_message", f"start.version {msg.version}: this server speaks protocol {PROTOCOL_VERSION}"
        )
    hooks = msg.test
    return StartRequest(
        voice=msg.voice,
        text_prompt=msg.text_prompt,
        profile=msg.profile,
        seed=hooks.seed if hooks is not None else None,
        sampling=msg.sampling or SamplingOptions(),
        force_ret_at=list(hooks.force_ret_at) if hooks is not None else [],
        spans=[(s.at, s.text) for s in hooks.spans] if hooks is not None else [],
        test=hooks is not None,
    )


def _message(item: Outbound) -> BaseModel:
    if isinstance(item, VoiceSet):
        return VoiceMessage(**dataclasses.asdict(item))
    if isinstance(item, Ready):
        return ReadyMessage(
            session_id=item.session_id,
            conversation_id=item.conversation_id,
            slot=item.slot,
            max_queued_frames=item.max_queued_frames,
            idle_timeout_s=item.idle_timeout_s,
            seed=item.seed,
            persona=item.persona,
            profile=item.profile,
            sampling=item.sampling,
        )
    if isinstance(item, Busy):
        return BusyMessage(max_sessions=item.max_sessions, message=item.message)
    if isinstance(item, Timing):
        return SlotMessage(**item.__dict__)
    if isinstance(item, ErrorOut):
        return ErrorMessage(code=item.code, message=item.message)
    if isinstance(item, Ended):
        return ByeMessage(
            reason=item.reason,  # type: ignore[arg-type]
            message=item.message,
            session_id=item.session_id,
            conversation_id=item.conversation_id,
            stats=item.stats,
        )
    return event_to_wire(item)  # a conversation event, sent as it is


ADAPTER = CspanAdapter
