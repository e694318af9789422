"""Grouping a full-duplex conversation into the OpenAI Realtime API's items and responses (small state machines).

The Realtime API is turn-based: the user's speech becomes *user message items*, and the model answers in
*responses* (``response.created`` ... ``response.done``) whose output items carry the audio and its transcript. A
full-duplex model has no turns of its own: it produces one 80 ms agent frame and at most one text token every
frame, whether it speaks or not. The machines here draw the turns:

:class:`ResponseStream` (the agent). A response opens at the first rendered text piece of the agent (its inner
monologue runs a little ahead of its voice), with the frame of audio just before it, and closes after
:data:`QUIET_FRAMES` frames without a text piece (the audio of those frames, the voice's tail, is part of it).
Agent frames outside a response (silence) are not sent, as the API sends nothing while the model is silent. The
client may also open a response (``response.create``: it closes the same way, empty if the agent says nothing) or
cancel one (``response.cancel``: the response ends ``cancelled`` and the agent's output is dropped until its turn
ends). A function call of the router ends the open response with a ``function_call`` item, as the API's responses
that call a function end with the call.

:class:`UserSpeech` (the user). The session's voice activity tracker (:class:`cspan.core.vad.UtteranceTracker`)
gives ``input_audio_buffer.speech_started`` / ``speech_stopped``; an utterance that ended is committed as a user
message item, and the transcriber's transcripts become ``conversation.item.input_audio_transcription.delta`` /
``completed`` for that item.

Both write to one :class:`ItemLog` (the conversation's item order, for ``previous_item_id``, and the items a client
may truncate, delete or retrieve). Every method returns the server events to send, in order; nothing here does I/O.
"""

from __future__ import annotations

import base64
import collections
import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from cspan.core.constants import FRAME_MS
from cspan.server.realtime_events import (
    ArgumentsDelta,
    ArgumentsDone,
    AudioDelta,
    AudioDone,
    Committed,
    ContentPart,
    ContentPartEvent,
    FunctionCallItem,
    FunctionCallOutputItem,
    Item,
    ItemEvent,
    MessageItem,
    OutputItemEvent,
    RealtimeEventError,
    Response,
    ResponseEvent,
    ServerEvent,
    SpeechStarted,
    SpeechStopped,
    StatusDetails,
    TextDelta,
    TextDone,
    TranscriptDelta,
    TranscriptDone,
    TranscriptionCompleted,
    TranscriptionDelta,
    Usage,
    new_id,
)
from cspan.server.session import brief

QUIET_FRAMES = 10
"""A response closes after this many frames (0.8 s) without agent text: a pause long enough to end a turn, and
long enough for the voice to finish the last word it wrote."""
MAX_RESPONSE_TEXT_TOKENS = 4096
"""A response that reaches this many text tokens without a pause ends ``incomplete`` (reason ``max_output_tokens``,
OpenAI's status for a response cut at its token limit) and a new one carries on at once: an agent that
never pauses would otherwise grow one transcript for the whole session (4096 tokens: over five minutes of speech
at 12.5 text tokens per second at most)."""
ITEM_LOG_SIZE = 1000
"""Items remembered for ``conversation.item.truncate`` / ``delete`` / ``retrieve`` (oldest forgotten first)."""
ITEM_LOG_CHARS = 1024 * 1024
"""Characters of text (message text and transcripts, function names, arguments and outputs) that the items
remembered may hold in all: counted when an item is added, and again as its text grows (an assistant message's
transcript deltas, a user item's transcript, a function call's arguments); past it the oldest are forgotten first,
as past :data:`ITEM_LOG_SIZE`. A client's ``conversation.item.create`` may carry up to ``--max-message-kib`` of
text: without this bound 1000 of them would keep a quarter of a gigabyte per connection."""
UTTERANCES_KEPT = ITEM_LOG_SIZE
"""User utterances whose item id and transcript state :class:`UserSpeech` remembers (the latest; each committed one
is an item of the log, so an utterance forgotten here is past anything a client can still refer to)."""


class ItemLog:
    """The conversation's items in order (the last :data:`ITEM_LOG_SIZE`, holding at most :data:`ITEM_LOG_CHARS`
    characters of text), and the audio frames sent for each assistant message.

    What the log keeps of an item (its characters, its audio frames) goes with it when it is deleted or forgotten.
    An item's id may then be given to another (a client deletes an item and creates another under its id), so a
    writer that holds an item, such as :class:`ResponseStream` streaming a message, asks :meth:`holds` before it
    writes: a deleted item's later frames and text are not counted, and never land on the item that took its id.
    """

    def __init__(self, max_items: int = ITEM_LOG_SIZE, max_chars: int = ITEM_LOG_CHARS) -> None:
        self.items: collections.OrderedDict[str, Item] = collections.OrderedDict()
        self.max_items = max_items
        self.max_chars = max_chars
        self.chars = 0  # text characters of the items remembered, as each was added (see ITEM_LOG_CHARS)
        self._chars: dict[str, int] = {}
        self._audio_frames: dict[str, int] = {}

    @property
    def last_id(self) -> str | None:
        """The id of the last item in conversation order (None in an empty conversation)."""
        return next(reversed(self.items), None)

    def add(self, item: Item, *, after: str | None = None) -> str | None:
        """Put ``item`` in the conversation: at the end, or right after the item ``after`` (``"root"``: first), as
        OpenAI's ``previous_item_id`` places a client's item. Returns the id of the item now before it (the
        ``previous_item_id`` its ``conversation.item.added`` reports; None when it is first).

        Raises:
            ValueError: an item with this id is in the log already (ids are unique; callers check client ids), or
                ``after`` names no item of the log (callers check it first and report ``unknown_item``).
        """
        if item.id in self.items:
            raise ValueError(f"item {item.id!r} is in the conversation already")
        if after is not None and after != "root" and after not in self.items:
            raise ValueError(f"no item {after!r} in the conversation to place {item.id!r} after")
        if after is None:  # at the end (every item of the server's own)
            previous = self.last_id
            self.items[item.id] = item
        else:  # the items after its place move behind it (a client's insertion mid-conversation)
            order = list(self.items)
            at = 0 if after == "root" else order.index(after) + 1
            self.items[item.id] = item
            for key in order[at:]:
                self.items.move_to_end(key)
            previous = order[at - 1] if at else None
        self._count(item.id, _text_chars(item))
        return previous

    def holds(self, item: Item) -> bool:
        """Whether ``item`` itself is in the log: False once it was deleted or forgotten, even where another item
        now has its id."""
        return self.items.get(item.id) is item

    def replace(self, item: Item) -> None:
        """Put ``item`` in the place of the item of its id (the same item, grown or finished), counting its text
        anew against :data:`ITEM_LOG_CHARS` (the oldest items, this one among them, may be forgotten).

        Raises:
            KeyError: no item of its id is in the log (callers check :meth:`holds` first).
        """
        if item.id not in self.items:
            raise KeyError(f"no item {item.id!r} in the conversation to replace")
        self.items[item.id] = item
        self._count(item.id, _text_chars(item) - self._chars.get(item.id, 0))

    def grow(self, item_id: str, chars: int) -> None:
        """``chars`` more characters of text were sent for the item ``item_id`` (a transcript delta of a message
        in progress; :meth:`replace` with the finished item counts it exactly): counted against
        :data:`ITEM_LOG_CHARS` as they come. Nothing for an item not in the log."""
        if item_id in self.items:
            self._count(item_id, chars)

    def _count(self, item_id: str, chars: int) -> None:
        """Add ``chars`` (may be negative) to what the item holds, then forget the oldest items past the bounds."""
        self._chars[item_id] = self._chars.get(item_id, 0) + chars
        self.chars += chars
        while len(self.items) > self.max_items or (self.chars > self.max_chars and len(self.items) > 1):
            old, _ = self.items.popitem(last=False)
            self._forget(old)

    def _forget(self, item_id: str) -> None:
        self.chars -= self._chars.pop(item_id, 0)
        self._audio_frames.pop(item_id, None)

    def function_call(self, call_id: str) -> FunctionCallItem | None:
        """The ``function_call`` item of ``call_id`` in the log (the router's or the client's), if any."""
        return next((i for i in self.items.values() if isinstance(i, FunctionCallItem) and i.call_id == call_id), None)

    def has_output(self, call_id: str) -> bool:
        """Whether a ``function_call_output`` of ``call_id`` is in the log."""
        return any(isinstance(i, FunctionCallOutputItem) and i.call_id == call_id for i in self.items.values())

    def add_audio_frame(self, item_id: str) -> None:
        """One more 80 ms audio delta was sent for the assistant message ``item_id`` (nothing is counted for an item
        not in the log: a deleted item's frames are not kept)."""
        if item_id in self.items:
            self._audio_frames[item_id] = self._audio_frames.get(item_id, 0) + 1

    def audio_ms(self, item_id: str) -> int:
        """Milliseconds of audio sent for the assistant message ``item_id`` (what a truncation may keep)."""
        return round(self._audio_frames.get(item_id, 0) * FRAME_MS)

    def get(self, item_id: str, *, event_id: str | None = None, param: str = "item_id") -> Item:
        """The item ``item_id``. Raises :class:`RealtimeEventError` ``unknown_item``."""
        item = self.items.get(item_id)
        if item is None:
            raise RealtimeEventError(
                "unknown_item", f"no item {item_id!r} in this conversation", event_id=event_id, param=param
            )
        return item

    def delete(self, item_id: str, *, event_id: str | None = None) -> None:
        self.get(item_id, event_id=event_id)
        del self.items[item_id]
        self._forget(item_id)


def _text_chars(item: Item) -> int:
    """The characters of text an item holds (what :data:`ITEM_LOG_CHARS` bounds)."""
    if isinstance(item, MessageItem):
        return sum(len(p.text or "") + len(p.transcript or "") for p in item.content)
    if isinstance(item, FunctionCallItem):
        return len(item.name) + len(item.arguments)
    if isinstance(item, FunctionCallOutputItem):
        return len(item.output)
    return 0


class ResponseStream:
    """The agent's side: frames and text pieces in, response events out (see the module docstring).

    Args:
        log: the conversation's :class:`ItemLog`.
        conversation_id: echoed in every response.
        modality: ``"audio"`` (audio deltas with transcript deltas) or ``"text"`` (text deltas only).
        audio_config: the response's ``audio.output`` (format and voice), echoed.
        quiet_frames: frames without text that close a response.
        max_text_tokens: text tokens that end a response ``incomplete`` (:data:`MAX_RESPONSE_TEXT_TOKENS`).

    Call, in the order the frames happened: :meth:`audio` for every agent frame, :meth:`text` for every rendered
    text piece of that frame; and :meth:`create`, :meth:`cancel`, :meth:`function_call`, :meth:`finish` when the
    client or the router asks.
    """

    def __init__(
        self,
        log: ItemLog,
        *,
        conversation_id: str | None = None,
        modality: Literal["audio", "text"] = "audio",
        audio_config: dict[str, Any] | None = None,
        quiet_frames: int = QUIET_FRAMES,
        max_text_tokens: int = MAX_RESPONSE_TEXT_TOKENS,
    ) -> None:
        self.log = log
        self.max_text_tokens = max_text_tokens
        self.conversation_id = conversation_id
        self.modality = modality
        self.audio_config = audio_config
        self.quiet_frames = quiet_frames
        self.response: Response | None = None
        self.last_response_id: str | None = None
        self._message: MessageItem | None = None
        self._pieces: list[str] = []
        self._quiet = 0
        self._since_text = quiet_frames  # frames since the agent's last text piece (its turn ends at quiet_frames)
        self._muted = False
        self._pre_roll: bytes | None = None
        self._text_tokens = 0
        self._audio_frames = 0

    @property
    def active(self) -> bool:
        """Whether a response is in progress."""
        return self.response is not None

    # -- inputs from the conversation ---------------------------------------------------------------------------

    def audio(self, data: bytes) -> list[ServerEvent]:
        """One agent frame, already in the client's output format."""
        self._since_text += 1
        if self._muted:
            self._quiet += 1
            if self._quiet >= self.quiet_frames:
                self._muted = False
            return []
        if self.response is None:
            self._pre_roll = data
            return []
        if self._quiet >= self.quiet_frames:
            self._pre_roll = data
            return self._close("completed")
        self._quiet += 1
        return self._audio_delta(data)

    def text(self, piece: str) -> list[ServerEvent]:
        """One rendered text piece of the agent (the frame's :meth:`audio` came first)."""
        self._quiet = 0
        self._since_text = 0
        if self._muted:
            return []
        events: list[ServerEvent] = []
        if self.response is None:
            events += self._open(None)
        if self._message is None:
            events += self._open_message()
            if self._pre_roll is not None:
                events += self._audio_delta(self._pre_roll)
        self._pre_roll = None
        if not self._pieces:
            piece = piece.lstrip()
        if not piece:
            return events
        self._pieces.append(piece)
        self._text_tokens += 1
        msg = self._message
        assert msg is not None and self.response is not None
        if self.log.holds(msg):  # a message the client deleted is not counted (nor one that took its id)
            self.log.grow(msg.id, len(piece))
        fields = dict(response_id=self.response.id, item_id=msg.id, output_index=len(self.response.output) - 1)
        if self.modality == "text":
            events.append(TextDelta(content_index=0, delta=piece, **fields))
        else:
            events.append(TranscriptDelta(content_index=0, delta=piece, **fields))
        if self._text_tokens >= self.max_text_tokens:  # the agent goes on in a new response: no audio frame lost
            events += self._close("incomplete", reason="max_output_tokens") + self._open(None)
        return events

    # -- inputs from the client and the router ------------------------------------------------------------------

    def create(self, metadata: dict[str, str] | None = None, *, event_id: str | None = None) -> list[ServerEvent]:
        """``response.create``: open a response now (it fills with the agent's next words).

        Raises:
            RealtimeEventError: ``conversation_already_has_active_response`` (OpenAI's code and wording) while one is
                in progress.
        """
        if self.response is not None:
            raise RealtimeEventError(
                "conversation_already_has_active_response",
                f"Conversation already has an active response in progress: {self.response.id}. Wait until the "
                "response is finished before creating a new one (or send response.cancel).",
                event_id=event_id,
            )
        self._muted = False
        self._quiet = 0
        return self._open(metadata)

    def cancel(self, response_id: str | None = None, *, event_id: str | None = None) -> list[ServerEvent]:
        """``response.cancel``: end the response ``cancelled``; the agent's output is dropped until its turn ends
        (when the agent is not in a turn, a response the client opened before its words, its next words open a response
        as usual).

        Raises:
            RealtimeEventError: ``response_cancel_not_active`` (OpenAI's code; its messages begin "Cancellation
                failed", as OpenAI's do) when none is in progress or ``response_id`` names another.
        """
        if self.response is None:
            raise RealtimeEventError(
                "response_cancel_not_active", "Cancellation failed: no active response found", event_id=event_id
            )
        if response_id is not None and response_id != self.response.id:
            raise RealtimeEventError(
                "response_cancel_not_active",
                f"Cancellation failed: {brief(response_id)} is not the response in progress ({self.response.id}); "
                "nothing was cancelled",
                event_id=event_id,
                param="response_id",
            )
        events = self._close("cancelled", reason="client_cancelled")
        self._muted = self._since_text < self.quiet_frames  # no words for as long: no turn of the agent's to cut
        self._quiet = 0
        return events

    def function_call(self, name: str, arguments: dict[str, Any] | str) -> tuple[list[ServerEvent], str, str]:
        """The router called the client's tool ``name``: the open response (or a new one) ends with the call.

        Returns:
            ``(events, call_id, item_id)``.
        """
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        events: list[ServerEvent] = []
        if self.response is None:
            events += self._open(None)
        events += self._close_message()
        response = self.response
        assert response is not None
        call_id = new_id("call")
        item = FunctionCallItem(id=new_id("item"), call_id=call_id, name=name, arguments="", status="in_progress")
        index = len(response.output)
        response.output.append(item)
        previous = self.log.add(item)
        events += [
            OutputItemEvent(type="response.output_item.added", response_id=response.id, output_index=index, item=item),
            ItemEvent(type="conversation.item.added", item=item, previous_item_id=previous),
        ]
        done = item.model_copy(update={"arguments": args, "status": "completed"})
        response.output[index] = done
        if self.log.holds(item):
            self.log.replace(done)
        fields = dict(response_id=response.id, item_id=item.id, output_index=index, call_id=call_id)
        events += [
            ArgumentsDelta(delta=args, **fields),
            ArgumentsDone(name=name, arguments=args, **fields),
            OutputItemEvent(type="response.output_item.done", response_id=response.id, output_index=index, item=done),
            ItemEvent(type="conversation.item.done", item=done, previous_item_id=previous),
        ]
        events += self._close("completed")
        return events, call_id, item.id

    def finish(self) -> list[ServerEvent]:
        """The session ends: an open response ends ``incomplete``."""
        return self._close("incomplete") if self.response is not None else []

    # -- internals ----------------------------------------------------------------------------------------------

    def _open(self, metadata: dict[str, str] | None) -> list[ServerEvent]:
        self.response = Response(
            id=new_id("resp"),
            conversation_id=self.conversation_id,
            output_modalities=[self.modality],
            audio={"output": self.audio_config} if self.audio_config and self.modality == "audio" else None,
            metadata=metadata,
        )
        self.last_response_id = self.response.id
        self._text_tokens = self._audio_frames = 0
        self._quiet = 0
        return [ResponseEvent(type="response.created", response=self.response.model_copy(deep=True))]

    def _open_message(self) -> list[ServerEvent]:
        response = self.response
        assert response is not None
        kind = "output_text" if self.modality == "text" else "output_audio"
        self._message = MessageItem(id=new_id("item"), role="assistant", status="in_progress", content=[])
        self._pieces = []
        index = len(response.output)
        response.output.append(self._message)
        previous = self.log.add(self._message)
        part = {"type": "text", "text": ""} if kind == "output_text" else {"type": "audio", "transcript": ""}
        return [
            OutputItemEvent(
                type="response.output_item.added", response_id=response.id, output_index=index, item=self._message
            ),
            ItemEvent(type="conversation.item.added", item=self._message, previous_item_id=previous),
            ContentPartEvent(
                type="response.content_part.added",
                response_id=response.id,
                item_id=self._message.id,
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def _audio_delta(self, data: bytes) -> list[ServerEvent]:
        if self.modality == "text":
            return []
        events: list[ServerEvent] = []
        if self._message is None:
            events += self._open_message()
        response, msg = self.response, self._message
        assert response is not None and msg is not None
        self._audio_frames += 1
        if self.log.holds(msg):  # a message the client deleted mid-response: its frames are not counted
            self.log.add_audio_frame(msg.id)
        events.append(
            AudioDelta(
                response_id=response.id,
                item_id=msg.id,
                output_index=len(response.output) - 1,
                content_index=0,
                delta=base64.b64encode(data).decode("ascii"),
            )
        )
        return events

    def _close_message(self, status: Literal["completed", "incomplete"] = "completed") -> list[ServerEvent]:
        """End the assistant message in progress: ``completed``, or ``incomplete`` when its response was cancelled or
        cut short (OpenAI's item status for an interrupted message)."""
        msg, response = self._message, self.response
        if msg is None or response is None:
            return []
        self._message = None
        text = "".join(self._pieces)
        index = response.output.index(msg)
        fields = dict(response_id=response.id, item_id=msg.id, output_index=index, content_index=0)
        if self.modality == "text":
            content = ContentPart(type="output_text", text=text)
            events: list[ServerEvent] = [TextDone(text=text, **fields)]
            part = {"type": "text", "text": text}
        else:
            content = ContentPart(type="output_audio", transcript=text)
            events = [AudioDone(**fields), TranscriptDone(transcript=text, **fields)]
            part = {"type": "audio", "transcript": text}
        done = msg.model_copy(update={"status": status, "content": [content]})
        response.output[index] = done
        if self.log.holds(msg):  # not when the client deleted it, nor onto an item it created under the same id
            self.log.replace(done)
        events += [
            ContentPartEvent(type="response.content_part.done", part=part, **fields),
            OutputItemEvent(type="response.output_item.done", response_id=response.id, output_index=index, item=done),
            ItemEvent(type="conversation.item.done", item=done),
        ]
        return events

    def _close(self, status: str, *, reason: str | None = None) -> list[ServerEvent]:
        events = self._close_message("completed" if status == "completed" else "incomplete")
        response = self.response
        if response is None:
            return events
        self.response = None
        self._pre_roll = None
        response.status = status  # type: ignore[assignment]
        if status != "completed":
            response.status_details = StatusDetails(type=status, reason=reason)  # type: ignore[arg-type]
        text_tokens = self._text_tokens
        response.usage = Usage(
            total_tokens=text_tokens + self._audio_frames,
            output_tokens=text_tokens + self._audio_frames,
            output_token_details={"text_tokens": text_tokens, "audio_tokens": self._audio_frames},
        )
        events.append(ResponseEvent(type="response.done", response=response))
        return events


class _Utterance(Protocol):
    index: int
    start: int
    end: int | None


class _Tracker(Protocol):
    current: _Utterance | None
    finished: list[Any]


@dataclass
class _UserUtterance:
    """What :class:`UserSpeech` reported of one utterance."""

    item_id: str
    committed: bool = False
    partial: str = ""
    released: bool = False
    """The client deleted the committed item: its id is free again and later transcripts leave the log alone."""


class UserSpeech:
    """The user's side: voice activity and transcripts in, speech and user-item events out.

    Memory is bounded over any duration: the records of the latest :data:`UTTERANCES_KEPT` utterances are kept
    (their item ids stay reserved); a transcript of an utterance older than that (none comes so late) is dropped.

    Args:
        log: the conversation's :class:`ItemLog`.
    """

    def __init__(self, log: ItemLog) -> None:
        self.log = log
        self._utterances: collections.OrderedDict[int, _UserUtterance] = collections.OrderedDict()
        self._ids: dict[str, int] = {}  # item id -> utterance, of the utterances kept
        self._newest = -1
        self._active: _Utterance | None = None

    def item_id(self, utterance: int) -> str:
        """The user item id of utterance ``utterance`` (made on first use)."""
        return self._record(utterance).item_id

    def reserved(self, item_id: str) -> bool:
        """Whether ``item_id`` is the id of a user utterance (committed or still to be): a client may not take it.
        The id of a committed item the client deleted is free again (:meth:`release`)."""
        return item_id in self._ids

    def release(self, item_id: str) -> None:
        """The client deleted the item ``item_id``: if it is a committed utterance's, its id may be taken again (as
        LiveKit's plugin does, deleting an item and creating it again under the same id to update it), and the
        utterance's later transcripts are still sent but no longer written into the log (where the id may now name
        the client's item)."""
        utterance = self._ids.get(item_id)
        record = self._utterances.get(utterance) if utterance is not None else None
        if record is not None and record.committed:
            record.released = True
            del self._ids[item_id]

    def _forgotten(self, utterance: int) -> bool:
        return utterance <= self._newest - UTTERANCES_KEPT and utterance not in self._utterances

    def _record(self, utterance: int) -> _UserUtterance:
        record = self._utterances.get(utterance)
        if record is None:
            record = self._utterances[utterance] = _UserUtterance(new_id("item"))
            self._ids[record.item_id] = utterance
            self._newest = max(self._newest, utterance)
            while len(self._utterances) > UTTERANCES_KEPT:
                _, old = self._utterances.popitem(last=False)
                self._ids.pop(old.item_id, None)  # a released one is gone already
        return record

    def poll(self, tracker: _Tracker) -> list[ServerEvent]:
        """Compare the voice activity tracker with what was reported; call once per frame."""
        events: list[ServerEvent] = []
        current = tracker.current
        active = self._active
        if active is not None and current is not active:
            self._active = None
            end = active.end if active.end is not None else active.start
            events.append(SpeechStopped(audio_end_ms=round(end * FRAME_MS), item_id=self.item_id(active.index)))
            # an utterance too short to count (not in ``finished``) is not committed
            if any(u is active for u in list(tracker.finished)[-4:]) and not self._record(active.index).committed:
                events += self._commit(active.index)
        if current is not None and self._active is None:
            self._active = current
            events.append(
                SpeechStarted(audio_start_ms=round(current.start * FRAME_MS), item_id=self.item_id(current.index))
            )
        return events

    def transcript(
        self, utterance: int, text: str, *, final: bool, start_s: float, end_s: float | None
    ) -> list[ServerEvent]:
        """A transcript of the utterance (``final``: of the whole utterance, else of its beginning)."""
        events: list[ServerEvent] = []
        if self._forgotten(utterance):
            return events
        record = self._record(utterance)
        item_id = record.item_id
        if final:
            if not record.committed:
                events += self._commit(utterance)
            seconds = max(0.0, (end_s if end_s is not None else start_s) - start_s)
            item = None if record.released else self.log.items.get(item_id)
            if item is not None:  # a later retrieve gives the transcript, as OpenAI's (unless the client deleted it)
                self.log.replace(
                    item.model_copy(update={"content": [ContentPart(type="input_audio", transcript=text)]})
                )
            events.append(
                TranscriptionCompleted(
                    item_id=item_id, transcript=text, usage={"type": "duration", "seconds": round(seconds, 3)}
                )
            )
            record.partial = ""
            return events
        before = record.partial
        if text.startswith(before) and len(text) > len(before):
            events.append(TranscriptionDelta(item_id=item_id, delta=text[len(before) :]))
            record.partial = text
        return events

    def _commit(self, utterance: int) -> list[ServerEvent]:
        record = self._record(utterance)
        record.committed = True
        item = MessageItem(id=record.item_id, role="user", content=[ContentPart(type="input_audio", transcript=None)])
        previous = self.log.add(item)
        return [
            Committed(item_id=item.id, previous_item_id=previous),
            ItemEvent(type="conversation.item.added", item=item, previous_item_id=previous),
            ItemEvent(type="conversation.item.done", item=item, previous_item_id=previous),
        ]


__all__ = [
    "FRAME_MS",
    "ITEM_LOG_CHARS",
    "ITEM_LOG_SIZE",
    "QUIET_FRAMES",
    "UTTERANCES_KEPT",
    "ItemLog",
    "ResponseStream",
    "UserSpeech",
]
