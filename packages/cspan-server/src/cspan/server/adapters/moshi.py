"""``/api/chat``: the Moshi protocol, as upstream Moshi and PersonaPlex serve it (reference digest, section 6), so
that their clients (``python -m moshi.client``, the Moshi and PersonaPlex web UIs) talk to ``cspan serve``.

Every WebSocket message is binary; its first byte is the kind:

====  ==========  ======================================================================================
byte  kind        here
====  ==========  ======================================================================================
0x00  handshake   server -> client, the single byte, once the persona is read (as PersonaPlex: upstream sends
                  it at once); clients treat any 0x00 as "connected"
0x01  audio       both ways: Ogg/Opus pages, 24 kHz mono (sphn, as upstream)
0x02  text        server -> client: one UTF-8 piece of the agent's text (word-start marks as spaces)
0x03  control     client -> server: accepted and ignored (as upstream)
0x04  metadata    server -> client: UTF-8 JSON: ``{"type": "session", ...}`` after the handshake, then the
                  conversation events other than text (``span`` with the reference, ``user_text``, ``ret``,
                  ``question``, ``late``, ``no_span``, backend ``error``), and ``{"type": "bye", ...}`` at the end;
                  upstream clients ignore these
0x05  error       server -> client: UTF-8 ``"<code>: <message>"``; the session goes on (after a refused start
                  the bye metadata says ``refused`` and the connection closes with 1008)
0x06  voice       client -> server (this server's addition): a piece of the voice recording announced with
                  ``?voice_audio=BYTES``
====  ==========  ======================================================================================

Query parameters (PersonaPlex's): ``text_prompt``, ``voice_prompt`` (a voice name, with or without ``.pt`` /
``.wav``), ``seed`` (else ``text_seed``, else ``audio_seed``; the engine has one generator per session), and the
session's sampling: ``text_temperature``, ``text_topk``, ``audio_temperature``, ``audio_topk`` (PersonaPlex ignores
them; here each session samples with its own, in the same batched step; a bad value refuses the start with a
``0x05`` error). ``repetition_penalty``, ``repetition_penalty_context`` and ``pad_mult`` are not applied: the
``session`` metadata lists them under ``not_applied`` and gives the sampling in effect under ``sampling``.
This server's addition: ``voice_audio=BYTES``, a recording of the user's voice (a file of that many
bytes, 2 to 30 s of speech, any format libsndfile reads) that the client sends as ``0x06`` messages before anything
else; the conversation starts once it has arrived, with that voice (a ``0x04`` ``{"type": "voice", ...}`` says
so), or, when it cannot be a voice, with the ``voice_prompt`` or default voice after a ``0x05 bad_voice_audio``.
``token``: the server's token when it has one (or ``Authorization: Bearer``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pydantic import ValidationError

from cspan.core.constants import MAX_SEED
from cspan.core.events import TextEvent
from cspan.server.adapters import Connection, Credential, ProtocolAdapter, off_loop
from cspan.server.auth import bearer_token
from cspan.server.opus import OggOpusDecoder, OggOpusEncoder
from cspan.server.protocol import dumps
from cspan.server.session import (
    CLOSE_POLICY,
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
    brief,
)
from cspan.server.voices import VOICE_AUDIO_MAX_BYTES, VoiceUpload

HANDSHAKE, AUDIO, TEXT, CONTROL, METADATA, ERROR, VOICE = 0, 1, 2, 3, 4, 5, 6
SAMPLING_PARAMETERS = ("text_temperature", "text_topk", "audio_temperature", "audio_topk")
"""PersonaPlex's sampling query parameters, applied to the session (:class:`SamplingOptions`)."""
NOT_APPLIED = ("repetition_penalty", "repetition_penalty_context", "pad_mult")
"""PersonaPlex's query parameters that change nothing here (PersonaPlex ignores them too)."""


class MoshiAdapter(ProtocolAdapter):
    """``/api/chat``: Kyutai's Moshi protocol (see the module docstring)."""

    name = "moshi"
    path = "/api/chat"

    def __init__(self, session: Session, connection: Connection) -> None:
        super().__init__(session, connection)
        self._decoder = OggOpusDecoder()
        self._encoder = OggOpusEncoder()
        self._not_applied = sorted(k for k in NOT_APPLIED if k in connection.query)
        self._upload: VoiceUpload | None = None

    @classmethod
    def credential(cls, connection: Connection) -> Credential:
        """``?token=`` (what a browser can send), else ``Authorization: Bearer``; two that differ conflict."""
        return Credential.first_of(connection.query.get("token"), bearer_token(connection.headers.get("authorization")))

    async def opened(self) -> None:
        """Start at once from the query parameters (the protocol has no start message), or once the voice recording
        of ``?voice_audio=BYTES`` has arrived."""
        size = self.connection.query.get("voice_audio")
        if size is None:
            await self._start()
            return
        try:
            bytes_ = int(size)
        except ValueError:
            bytes_ = 0
        if not 1 <= bytes_ <= VOICE_AUDIO_MAX_BYTES:
            message = f"voice_audio={brief(size)}: the recording's size in bytes, 1 to {VOICE_AUDIO_MAX_BYTES}"
            self.session.client_error("invalid_message", message)
            await self.session.end("refused", code=CLOSE_POLICY, message=message)
            return
        self._upload = VoiceUpload(bytes_)

    async def _start(self) -> None:
        try:
            await self.session.start(self._start_request())
        except ClientError as exc:
            self.session.client_error(exc.code, exc.message)
            await self.session.end("refused", code=CLOSE_POLICY, message=exc.message)

    async def _voice_piece(self, data: bytes) -> None:
        """One ``0x06`` piece of the recording; once it is whole (or refused), the conversation starts."""
        upload = self._upload
        if upload is None:
            raise ClientError(
                "bad_message", "0x06 voice: announce a recording with ?voice_audio=BYTES and send it before audio"
            )
        try:
            whole = upload.add(data)
        except ValueError as exc:
            self._upload = None
            self.session.client_error("bad_voice_audio", f"{exc}: the recording is dropped")
            await self._start()
            return
        if whole is None:
            return
        self._upload = None
        try:
            await self.session.set_voice_audio(whole)
        except ClientError as exc:
            self.session.client_error(exc.code, exc.message)
        await self._start()

    async def receive(self, data: bytes | str) -> None:
        if isinstance(data, str) or not data:
            raise ClientError("bad_message", "send binary messages whose first byte is the kind (0x01 audio)")
        kind = data[0]
        if kind == VOICE:
            await self._voice_piece(data[1:])
        elif self._upload is not None:
            raise ClientError(
                "not_started",
                f"message kind 0x{kind:02x} while the voice recording is being sent ({self._upload.received} of "
                f"{self._upload.size} bytes): send all of it (0x06) first",
            )
        elif kind == AUDIO:
            pcm, problem = await off_loop(len(data), self._decoder.decode, data[1:])
            self.session.push_audio(pcm)
            if problem:
                raise ClientError("bad_audio", problem)
        elif kind != CONTROL:  # control (start, endTurn, pause, restart) is ignored, as upstream
            raise ClientError("bad_message", f"message kind 0x{kind:02x}: a client sends 0x01 audio (or 0x03 control)")

    def render(self, item: Outbound) -> list[bytes | str]:
        if isinstance(item, AgentAudio):
            data = self._encoder.encode(item.pcm)
            return [bytes([AUDIO]) + data] if data else []
        if isinstance(item, TextEvent):
            return [bytes([TEXT]) + item.text.encode("utf-8")]
        if isinstance(item, Ready):
            info = {
                "type": "session",
                "session_id": item.session_id,
                "conversation_id": item.conversation_id,
                "seed": item.seed,
                "persona": item.persona.model_dump(),
                "sampling": item.sampling.model_dump(),
                "not_applied": self._not_applied,
            }
            return [bytes([HANDSHAKE]), _metadata(info)]
        if isinstance(item, Busy):
            return [bytes([ERROR]) + f"busy: {item.message}".encode()]
        if isinstance(item, ErrorOut):
            return [bytes([ERROR]) + f"{item.code}: {item.message}".encode()]
        if isinstance(item, Ended):
            info = {"type": "bye", "reason": item.reason, "message": item.message, "stats": item.stats.model_dump()}
            return [_metadata(info)]
        if isinstance(item, Timing):
            return []
        if isinstance(item, VoiceSet):
            return [_metadata({"type": "voice", **dataclasses.asdict(item)})]
        return [bytes([METADATA]) + dumps(item).encode("utf-8")]  # span (with its reference), user_text, ...

    def _start_request(self) -> StartRequest:
        q = self.connection.query
        voice = q.get("voice_prompt") if self.session.recorded_voice is None else None
        if voice is not None:
            voice = voice.strip()
            for suffix in (".pt", ".wav"):
                voice = voice.removesuffix(suffix)
        seed = None
        for name in ("seed", "text_seed", "audio_seed"):
            if q.get(name) not in (None, ""):
                seed = _seed(name, q[name])
                break
        return StartRequest(voice=voice, text_prompt=q.get("text_prompt"), seed=seed, sampling=_sampling(q))


def _sampling(query: Any) -> SamplingOptions:
    """The sampling query parameters (empty ones: the server's defaults).

    Raises:
        ClientError: ``invalid_message`` naming the parameter, its value and the accepted range.
    """
    given = {name: query[name] for name in SAMPLING_PARAMETERS if query.get(name) not in (None, "")}
    try:
        return SamplingOptions.model_validate(given, strict=False)  # query parameters are text: "0.7" is 0.7
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        name = str(err["loc"][0])
        raise ClientError("invalid_message", f"{name}={brief(given.get(name, ''))}: {err['msg']}") from None


def _seed(name: str, value: str) -> int | None:
    try:
        seed = int(value)
    except ValueError:
        raise ClientError("invalid_message", f"{name}={brief(value)}: not an integer") from None
    if seed < 0:  # PersonaPlex's UI sends -1 for "no seed"
        return None
    if seed > MAX_SEED:
        raise ClientError("invalid_message", f"{name}={brief(value)}: above 2**63 - 1")
    return seed


def _metadata(info: dict[str, Any]) -> bytes:
    return bytes([METADATA]) + json.dumps(info, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


ADAPTER = MoshiAdapter
