"""``Conversation``: the frame-clock runtime around the duplex engine, shared by ``infer``, ``serve`` and benchmarks.

One :class:`Conversation` follows one session of a :class:`~cspan.core.engine.DuplexEngine`. The application
drives the clock: for every 80 ms frame it calls :meth:`Conversation.before_step` with the user's frame (this
applies due Context Spans at the head of the frame, runs voice activity and utterance transcription), steps the
engine (one batched step for all live sessions), then calls :meth:`Conversation.after_step` with this session's
row of the output (agent text, ``<ret>``). :func:`run_conversation` is that loop for a single session.

``<ret>`` policy (after the original Context Spanning runtime, ``runtime/frame_stream.py``, with its timing
constants): when the model emits ``<ret>`` (or one is forced),

1. a *fresh* final transcript (the last utterance ended at most ``fresh_transcript_s`` ago and the user is not
   speaking now) becomes the question;
2. otherwise, while the user is still speaking (or a final transcript is on its way), wait up to ``ret_wait_s``
   for the utterance to end, cutting it after 0.4 s of silence instead of 0.72 s; when the wait runs out with the
   user silent and the final still on its way, wait for it up to ``ret_wait_s`` more (the window below would queue
   behind it on the same transcriber, then transcribe up to ``listen_s`` seconds again);
3. otherwise (or when the wait runs out) the retriever transcribes the last ``listen_s`` seconds of user audio.

Utterance transcripts (``user_text``): a partial every 1.6 s while the user speaks, and a final when the utterance
ends. A transcriber that streams (``open_stream``, :class:`~cspan.core.protocols.StreamingTranscriber`) is given each
utterance's audio as it is heard, so a partial or the final costs only what it has not heard yet; any other
transcriber gets the utterance so far as one clip each time (the final's clip is what ``<ret>`` waits for). If a
stream fails, that utterance falls back to whole clips.

Only one retrieval is pending at a time; a ``<ret>`` meanwhile is reported as ignored. Backend calls run as
asyncio tasks concurrently with the frame loop. A reference is injected at the head of a frame, and dropped as
``late`` when more than ``span_deadline_s`` passed since the ``<ret>``; a ``late`` event keeps the question.

Two clocks. *Live* (``span_delay_s=None``; ``serve`` and ``infer --realtime``): nothing ever blocks the frame
loop; transcripts and references are applied at the first frame head after they arrive, and the deadline is wall
clock: the retriever gets what is left of it as its ``deadline_s`` (and reports ``late`` itself, with the question
it had), and a retrieval still running ``LATE_GRACE_S`` after the deadline is cancelled. *Offline*
(``span_delay_s`` set; ``infer`` by default): backend latency acts on the frame clock only, so the same input and
seed give the same conversation whatever the machine's speed or load: utterance transcripts are awaited at the
frame that asks for them, a reference is applied exactly ``span_delay_s`` after the retrieval was asked (the loop
waits for the backend there, however long it takes in wall-clock time; the backends' own timeouts bound that wait),
the retriever is given no wall-clock deadline (``deadline_s=math.inf``, overriding any default it was built with),
and ``late`` is judged on frames alone (``span_delay_s`` plus any wait for the question, against
``span_deadline_s``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from cspan.core.constants import FRAME_RATE, FRAME_S, FRAME_SIZE, PAD, RET, SAMPLE_RATE, SPAN_CLOSE, SPAN_OPEN
from cspan.core.events import (
    CONVERSATION_ENDED,
    ConversationEvent,
    ErrorEvent,
    LateEvent,
    NoSpanEvent,
    PersonaEvent,
    QuestionEvent,
    RetEvent,
    SpanEvent,
    TextEvent,
    UserTextEvent,
)
from cspan.core.protocols import RetrievalLike, Retriever, Transcriber
from cspan.core.vad import SileroVAD, Utterance, UtteranceTracker, voice_probabilities

logger = logging.getLogger(__name__)

LATE_GRACE_S = 2 * FRAME_S
"""Live clock: how long past its deadline a retrieval that has not reported ``late`` itself is left running."""
TRAILING_FRAMES = 4
"""Frames of audio past an utterance's last voiced frame that its final transcript is given (0.32 s; the silence
that ended it is at least 5 frames, so they are always there): the end of the last word, which the detector's
drop can cut (the demo's question read "... does not like really open on sunday" cut there, "... does the library
open on sunday" with this tail)."""
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""A SentencePiece byte-fallback piece: one byte of a character outside the vocabulary."""
SPAN_REPORTS_KEPT = 256
"""The engine's reports of the latest Context Spans a :class:`Conversation` keeps (``span_reports``)."""
HIDDEN_TEXT_IDS = frozenset({0, 1, 2, PAD, RET, SPAN_OPEN, SPAN_CLOSE})
"""Text ids that are not rendered as agent text (EPAD, BOS, EOS, PAD, ``<ret>``, span markers)."""


class _Tokenizer(Protocol):
    def id_to_piece(self, i: int) -> str: ...
    def decode(self, ids: list[int]) -> str: ...


def decode_agent_text(tokenizer: _Tokenizer, tokens: Iterable[int]) -> str:
    """The agent's text tokens (ids >= 0, in the order it said them), decoded as one text: specials, ``<ret>`` and
    span markers removed, the ends stripped. The one rule for what "the agent said" renders to
    (:meth:`Conversation.agent_text`, ``cspan infer``'s ``agent_text``)."""
    ids = [t for t in tokens if t not in HIDDEN_TEXT_IDS]
    return tokenizer.decode(ids).strip() if ids else ""


class _VoiceActivity(Protocol):
    def is_voiced(self, frame: np.ndarray) -> bool: ...
    def reset(self) -> None: ...


@dataclass
class ConversationConfig:
    """Timing and policy of a conversation (seconds unless stated).

    Attributes:
        listen_s: audio window transcribed when no utterance transcript can be used.
        span_deadline_s: a reference applied later than this after its ``<ret>`` is dropped as late
            (``None``: never); wall clock when live, frames when offline.
        span_delay_s: offline clock: apply each reference exactly this long after the retrieval was asked
            (deterministic; the retriever gets ``deadline_s=math.inf``). ``None``: live clock, apply on arrival.
        ret_wait_s: how long a ``<ret>`` waits for the running utterance to end (and, once, for a final transcript
            still on its way when that runs out).
        fresh_transcript_s: a final transcript at most this old (and the user silent) is used as is.
        partial_transcripts: transcribe running utterances every 1.6 s (``user_text`` partials): what a streaming
            transcriber heard so far, or the utterance so far transcribed whole.
        agent_said_tokens: how many recent agent text tokens are passed to the router as "already said".
        vad_threshold: Silero speech probability for a voiced frame.
        keep_history: keep every event (:attr:`Conversation.events`) and every agent text token (for
            :meth:`Conversation.agent_text`), as the benchmarks' short sessions do. False (``cspan serve``, where
            events go to the client as they happen, and ``cspan infer``, which spools them next to its JSON) keeps
            memory bounded over any duration: no event list, and only the last ``agent_said_tokens`` text tokens.
    """

    listen_s: float = 12.0
    span_deadline_s: float | None = 2.5
    span_delay_s: float | None = None
    ret_wait_s: float = 1.0
    fresh_transcript_s: float = 3.0
    partial_transcripts: bool = True
    agent_said_tokens: int = 64
    vad_threshold: float = 0.5
    keep_history: bool = True


@dataclass
class _Final:
    text: str
    start_frame: int
    end_frame: int
    utterance: int


@dataclass
class _Unread:
    """A Context Span queued in the engine and not read yet: the engine's report, and its ``span`` event as known
    at injection (completed from the report, and moved to its frame, when a step reads it)."""

    report: Any
    event: SpanEvent


@dataclass
class _Transcription:
    """A transcript asked of the transcriber: ``seq`` orders the requests (a later one heard more of the
    utterance)."""

    task: asyncio.Task[Any]
    utterance: int
    final: bool
    start: int
    end: int | None
    seq: int


@dataclass
class _Stream:
    """A running utterance's transcript stream (:class:`~cspan.core.protocols.TranscriptStream`); it has heard the
    frames before ``fed``."""

    stream: Any
    fed: int


@dataclass
class _Pending:
    ret_frame: int
    forced: bool
    plan: str
    ret_wall: float = field(default_factory=time.time)  # when the <ret> came, seconds since the epoch
    wait_until: int | None = None
    extended: bool = False
    task: asyncio.Task[RetrievalLike] | None = None
    asked_frame: int | None = None
    asked_wall: float | None = None
    question: str | None = None
    apply_frame: int | None = None
    done_wall: float | None = None

    @property
    def backend_s(self) -> float | None:
        if self.asked_wall is None or self.done_wall is None:
            return None
        return self.done_wall - self.asked_wall


@dataclass
class Conversation:
    """Frame-clock runtime for one session of a duplex engine (see the module docstring).

    Args:
        engine: the :class:`~cspan.core.engine.DuplexEngine` (anything with ``inject_span(i, text)``).
        session: this conversation's batch row in the engine.
        tokenizer: SentencePiece processor of the checkpoint (renders agent text).
        transcriber: for utterance transcripts (``user_text``); ``None`` disables them.
        retriever: answers ``<ret>``; ``None`` means ``<ret>`` is reported and ignored.
        config: :class:`ConversationConfig`.
        profile: passed through to the retriever (the user's profile).
        conversation_id: passed through to the retriever.
        vad: voice activity detector; default a :class:`~cspan.core.vad.SileroVAD`. It runs only while the
            conversation :attr:`listens` (has a transcriber or a retriever: nothing else reads it).
        on_event: called with every event as it happens (also collected in :attr:`events` with
            ``config.keep_history``).

    What the engine's persona policy does (``engine.take_window_events``, where the engine has it: the re-reads and
    the pin of :mod:`cspan.core.window`) is reported as ``persona`` events at the frame of the step that did it.
    """

    engine: Any
    session: int = 0
    tokenizer: _Tokenizer | None = None
    transcriber: Transcriber | None = None
    retriever: Retriever | None = None
    config: ConversationConfig = field(default_factory=ConversationConfig)
    profile: Any = None
    conversation_id: Any = None
    vad: _VoiceActivity | None = None
    on_event: Callable[[ConversationEvent], None] | None = None
    events: list[ConversationEvent] = field(default_factory=list)
    span_reports: collections.deque[Any] = field(default_factory=lambda: collections.deque(maxlen=SPAN_REPORTS_KEPT))

    def __post_init__(self) -> None:
        if self.vad is None:
            self.vad = SileroVAD(threshold=self.config.vad_threshold)
        self.utterances = UtteranceTracker()
        keep_frames = math.ceil(max(self.config.listen_s, 30.0) * FRAME_RATE)
        self._audio: collections.deque[np.ndarray] = collections.deque(maxlen=keep_frames)
        self._audio_start = 0  # frame index of self._audio[0]
        keep = None if self.config.keep_history else max(1, self.config.agent_said_tokens)
        self._agent_tokens: collections.deque[int] = collections.deque(maxlen=keep)
        self._window_events = getattr(self.engine, "take_window_events", None)
        self._span_reads = getattr(self.engine, "take_span_reads", None)
        self._unread: list[_Unread] = []  # Context Spans queued, their step not run yet
        self._utf8 = bytearray()  # byte-fallback pieces (<0xE2>...) of a character not complete yet
        self._last_final: _Final | None = None
        self._last_span_frame: int | None = None  # where the last Context Span was read
        self._pending: _Pending | None = None
        self._asr_tasks: list[_Transcription] = []
        self._asr_seq = 0  # the next request's seq
        self._asr_shown: dict[int, int] = {}  # utterance -> seq of its newest transcript emitted (while others wait)
        self._streams: dict[int, _Stream] = {}  # utterance -> its transcript stream, while it runs
        self._forced_spans: dict[int, list[tuple[str, str]]] = collections.defaultdict(list)
        self._forced_rets: set[int] = set()
        self.frame = 0

    # ------------------------------------------------------------------------------------------------ scheduling
    def schedule_span(self, frame: int, text: str, *, source: str = "given") -> None:
        """Inject ``text`` as a Context Span at the head of ``frame`` (or of the next frame to start, when ``frame``
        has started already) without any backend (its ``span`` event says ``source``: ``given`` for ``--span``,
        ``memory`` for a memory span)."""
        self._forced_spans[frame].append((text, source))

    def schedule_ret(self, frame: int) -> None:
        """Behave as if the model emitted ``<ret>`` at ``frame``."""
        self._forced_rets.add(frame)

    @property
    def offline(self) -> bool:
        return self.config.span_delay_s is not None

    @property
    def listens(self) -> bool:
        """Whether voice activity is used: utterance transcripts (a transcriber) or the ``<ret>`` policy (a
        retriever) read it; without either, :meth:`before_step` skips the detector."""
        return self.transcriber is not None or self.retriever is not None

    @property
    def busy(self) -> bool:
        """Whether a retrieval is pending (or waiting for its question)."""
        return self._pending is not None

    # ---------------------------------------------------------------------------------------------- frame hooks
    async def before_step(self, user_pcm: np.ndarray, voiced: bool | None = None) -> None:
        """Head of the frame: apply due spans and retrievals, then voice activity and utterance transcripts.

        Args:
            user_pcm: this frame's user audio, float32 ``[1920]`` at 24 kHz.
            voiced: this frame's voice activity when the caller already ran this conversation's detector on
                ``user_pcm`` (:func:`voice_activity` does it for many conversations in one pass); None runs it here.
        """
        i = self.frame
        await self.read_spans()

        frame = np.asarray(user_pcm, dtype=np.float32).reshape(-1)
        if len(self._audio) == self._audio.maxlen:
            self._audio_start += 1
        self._audio.append(frame)
        if voiced is None:
            voiced = self.listens and self.vad.is_voiced(frame)
        for ev in self.utterances.update(i, voiced):
            utt = ev.utterance
            if ev.kind == "started":
                self._open_stream(utt)
            elif ev.kind == "dropped":
                self._drop_stream(utt.index)
            elif ev.kind == "partial" and self.config.partial_transcripts:
                await self._transcribe(utt, final=False)
            elif ev.kind == "ended":
                await self._transcribe(utt, final=True)
        if self.utterances.current is not None:
            self._feed_stream(self.utterances.current)
        await self._collect_transcripts(block=False)
        await self._service_wait(i)

    async def read_spans(self) -> None:
        """Inject what is due at the head of frame :attr:`frame` (the next to run): the spans scheduled for it and a
        finished retrieval, with their events at that frame. :meth:`before_step` does it first; a server may call
        it earlier, between the previous frame and this one, so the engine reads the span's step ready-made
        (``DuplexEngine.prepare``) when the frame starts. A retrieval that finishes after this call is injected by
        the next one (:meth:`before_step`'s)."""
        i = self.frame
        for due in sorted(f for f in self._forced_spans if f <= i):  # a frame already under way counts as due now
            for text, source in self._forced_spans.pop(due):
                self._inject(text, source=source, tool=None, arguments=None, question=None, ret_frame=None, asked=None)
        await self._service_retrieval(i)

    async def after_step(self, text_token: int | None, is_ret: bool = False) -> None:
        """Tail of the frame: record the agent's text token and handle ``<ret>`` (emitted or forced).

        Args:
            text_token: the text token of the agent frame returned by this step, or ``None`` when the engine
                returned no frame yet.
            is_ret: whether that token is ``<ret>``.
        """
        i = self.frame
        self._report_reads(i)
        if text_token is not None and text_token >= 0:
            self._agent_tokens.append(int(text_token))
            if text_token not in HIDDEN_TEXT_IDS and self.tokenizer is not None:
                piece = self._render_piece(self.tokenizer.id_to_piece(int(text_token)))
                if piece is not None:
                    self._emit(TextEvent(frame=i, t=i * FRAME_S, token=int(text_token), text=piece))
        if self._window_events is not None:
            for ev in self._window_events(self.session):
                self._emit(
                    PersonaEvent(frame=i, t=i * FRAME_S, kind=ev.kind, position=ev.position, positions=ev.positions)
                )
        forced = i in self._forced_rets
        self._forced_rets.discard(i)
        if is_ret or forced:
            await self._on_ret(i, forced=forced and not is_ret)
        self.frame += 1

    def _render_piece(self, piece: str) -> str | None:
        """The text a SentencePiece piece adds: the word-start mark as a space; byte-fallback pieces collected until
        they form a whole UTF-8 character (None while one is incomplete; bytes that cannot form one are replaced
        with U+FFFD)."""
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte is None:
            head = self._utf8.decode("utf-8", errors="replace")
            self._utf8.clear()
            return head + piece.replace("\u2581", " ")
        self._utf8.append(int(byte.group(1), 16))
        try:
            text = self._utf8.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.reason == "unexpected end of data" and len(self._utf8) < 4:
                return None
            text = self._utf8.decode("utf-8", errors="replace")
        self._utf8.clear()
        return text

    async def finish(self) -> None:
        """End of the input: drop the running utterance's transcript stream, wait for outstanding transcripts; report
        a retrieval not read yet as a ``no_span`` with :data:`CONVERSATION_ENDED`. One still running is cancelled with
        that message and waited for (the retriever records the cut: the Context DB's span row dropped
        ``cancelled``), and so is one that still waited for the user's utterance (the retriever's ``record_cut``);
        one whose reference was ready but not read gives its ``retrieval_id``, for its record to be marked so too,
        and so does a Context Span queued in the engine whose step never ran. Cancelled while it waits
        (``asyncio.wait_for`` with a bound), it cancels the transcripts still running."""
        for utterance in list(self._streams):
            self._drop_stream(utterance)
        try:
            await self._collect_transcripts(block=True)
        except asyncio.CancelledError:  # the caller stopped waiting (a server's bound on an ending session)
            self._cancel_transcripts()
            raise
        for unread in self._unread:  # queued, never read: the conversation ended first
            self._ended(unread.event.question, unread.event.retrieval_id)
        self._unread = []
        p = self._pending
        if p is not None:
            self._pending = None
            retrieval_id = None
            running = p.task is not None and not p.task.done()
            if running:
                p.task.cancel(CONVERSATION_ENDED)
            elif p.task is not None and not p.task.cancelled() and p.task.exception() is None:
                result = p.task.result()
                if (getattr(result, "reference", None) or "").strip():
                    retrieval_id = getattr(result, "span_id", None)
            self._ended(p.question, retrieval_id)
            if running:
                await asyncio.wait([p.task])
            elif p.task is None:  # it waited for the user's utterance: the retriever was never asked
                await self._record_cut(p)

    async def _record_cut(self, p: _Pending) -> None:
        """The record of a ``<ret>`` the end of the conversation cut before the retriever was asked, where the
        retriever keeps records (its optional ``record_cut``; :class:`~cspan.core.protocols.Retriever`)."""
        record_cut = getattr(self.retriever, "record_cut", None)
        if record_cut is None:
            return
        try:
            await record_cut(
                why=CONVERSATION_ENDED,
                asked_at=p.ret_wall,
                waited_s=time.time() - p.ret_wall,
                profile=self.profile,
                conversation_id=self.conversation_id,
            )
        except Exception:  # a record that fails must not stop the conversation's end
            logger.exception("recording the <ret> of frame %d that the conversation's end cut failed", p.ret_frame)

    # ------------------------------------------------------------------------------------------------ internals
    def _cancel_transcripts(self) -> None:
        """Cancel the transcripts still running, and take the errors of those that ended, unread: the conversation
        is over, and a transcript left running would go on past its transcriber (a server closes it at shutdown) and
        end in an error nobody reads (asyncio's "Task exception was never retrieved")."""
        for entry in self._asr_tasks:
            if not entry.task.cancel() and not entry.task.cancelled():
                entry.task.exception()
        self._asr_tasks = []

    def _ended(self, question: str | None, retrieval_id: int | None) -> None:
        """The ``no_span`` of a retrieval or span the end of the conversation cut (:data:`CONVERSATION_ENDED`)."""
        f = self.frame
        self._emit(
            NoSpanEvent(frame=f, t=f * FRAME_S, question=question, error=CONVERSATION_ENDED, retrieval_id=retrieval_id)
        )

    def _emit(self, event: ConversationEvent) -> None:
        if self.config.keep_history:
            self.events.append(event)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # an observer must never stop the conversation
                logger.exception("event observer failed on %s", event.type)

    def agent_text(self, last_tokens: int | None = None) -> str:
        """Decoded text of everything the agent said (or of its last ``last_tokens`` text tokens), specials,
        ``<ret>`` and span markers removed."""
        if self.tokenizer is None:
            return ""
        tokens = list(self._agent_tokens)
        return decode_agent_text(self.tokenizer, tokens if last_tokens is None else tokens[-last_tokens:])

    def agent_said(self) -> str:
        """What the agent already said, for the router: its last ``agent_said_tokens`` text tokens, decoded."""
        return self.agent_text(self.config.agent_said_tokens)

    def _user_audio(self, start: int, end: int) -> np.ndarray:
        start = max(start, self._audio_start)
        end = min(end, self._audio_start + len(self._audio))
        if end <= start:
            return np.zeros(0, dtype=np.float32)
        frames = [self._audio[k - self._audio_start] for k in range(start, end)]
        return np.concatenate(frames)

    async def _transcribe(self, utt: Utterance, *, final: bool) -> None:
        """Transcribe the utterance's frames (``utt.start .. utt.end - 1`` for the final, to the current frame for a
        partial) and :data:`TRAILING_FRAMES` more where they were heard already: voice activity ends an utterance
        where the detector's probability drops, which can be inside its last syllable, and a recognizer given the
        audio cut there misreads the last words. With the utterance's transcript stream (a streaming transcriber)
        only what it has not heard yet is decoded; otherwise the whole clip is."""
        if self.transcriber is None:
            return
        utterance = utt.index
        pending = [t for t in self._asr_tasks if t.utterance == utterance and not t.final and not t.task.done()]
        if pending and not final:
            return  # the partial still running covers this one: a recognizer slower than the partials' pace does
            # not pile up passes over ever longer audio (the next partial or the final comes later)
        for t in pending:  # the final is what counts now: a queued partial is dropped before it decodes
            t.task.cancel()
        heard = self.frame + 1
        end = utt.end if final else None
        clip = (utt.start, heard if end is None else min(end + TRAILING_FRAMES, heard))
        entry = self._streams.get(utterance)
        if entry is not None:
            self._feed_stream(utt)
            if final:
                del self._streams[utterance]
            coro = self._stream_transcript(utterance, entry, clip, final=final)
        else:
            coro = self.transcriber.transcribe(self._user_audio(*clip), SAMPLE_RATE)
        task = asyncio.ensure_future(coro)
        self._asr_tasks.append(_Transcription(task, utterance, final, utt.start, end, self._asr_seq))
        self._asr_seq += 1
        if self.offline:
            await self._collect_transcripts(block=True)

    # ---------------------------------------------------------------------------------- utterance transcript streams
    def _open_stream(self, utt: Utterance) -> None:
        """A transcriber that streams (``open_stream``: :class:`~cspan.core.protocols.StreamingTranscriber`) hears
        the utterance as it goes: its partials and final then cost only what it has not heard yet."""
        open_stream = getattr(self.transcriber, "open_stream", None)
        if open_stream is None:
            return
        try:
            stream = open_stream(SAMPLE_RATE)
        except Exception as exc:
            logger.warning("utterance %d: no transcript stream (%s: %s); transcribing it whole", utt.index,
                           type(exc).__name__, exc)  # fmt: skip
            return
        self._streams[utt.index] = _Stream(stream, fed=utt.start)

    def _feed_stream(self, utt: Utterance) -> None:
        """Give the utterance's stream the frames heard since, up to :data:`TRAILING_FRAMES` past the last voiced
        one (silence after that joins the utterance only if voice comes back, and the final's clip ends there)."""
        entry = self._streams.get(utt.index)
        if entry is None:
            return
        upto = min(self.frame + 1, utt.last_voiced + 1 + TRAILING_FRAMES)
        if upto <= entry.fed:
            return
        try:
            entry.stream.feed(self._user_audio(entry.fed, upto))
        except Exception as exc:
            logger.warning("utterance %d: the transcript stream refused audio (%s: %s); transcribing it whole",
                           utt.index, type(exc).__name__, exc)  # fmt: skip
            self._drop_stream(utt.index)
            return
        entry.fed = upto

    def _drop_stream(self, utterance: int) -> None:
        """The utterance is dropped (too short, or the conversation ended): its stream frees what it holds."""
        entry = self._streams.pop(utterance, None)
        if entry is not None:
            try:
                entry.stream.cancel()
            except Exception:
                logger.exception("utterance %d: cancelling its transcript stream failed", utterance)

    async def _stream_transcript(self, utterance: int, entry: _Stream, clip: tuple[int, int], *, final: bool) -> Any:
        """The stream's partial or final transcript; if the stream fails (the recognizer's process died, say), the
        clip transcribed whole instead, and the rest of the utterance goes without the stream."""
        try:
            return await (entry.stream.finish() if final else entry.stream.partial())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("utterance %d: the transcript stream failed (%s: %s); transcribing it whole", utterance,
                           type(exc).__name__, exc)  # fmt: skip
            if self._streams.get(utterance) is entry:  # a partial failed: the final will not use the stream either
                self._drop_stream(utterance)
            assert self.transcriber is not None
            return await self.transcriber.transcribe(self._user_audio(*clip), SAMPLE_RATE)

    async def _collect_transcripts(self, *, block: bool) -> None:
        """Emit the transcripts finished (all of them with ``block``). They finish in any order (a recognizer
        shared by sessions answers as it can): one older than a transcript of its utterance already emitted (a
        partial after its final, or after a later partial) is dropped, so a client never sees the text go back."""
        still: list[_Transcription] = []
        for entry in self._asr_tasks:
            task, utterance, final, start, end = entry.task, entry.utterance, entry.final, entry.start, entry.end
            if block and not task.done():
                await asyncio.wait([task])
            if not task.done():
                still.append(entry)
                continue
            i = self.frame
            if task.cancelled():  # a partial the final made redundant
                continue
            try:
                text = (task.result().text or "").strip()
            except Exception as exc:
                self._emit(ErrorEvent(frame=i, t=i * FRAME_S, stage="asr", message=f"{type(exc).__name__}: {exc}"))
                continue
            if entry.seq < self._asr_shown.get(utterance, -1):
                continue
            self._asr_shown[utterance] = entry.seq
            self._emit(
                UserTextEvent(
                    frame=i,
                    t=i * FRAME_S,
                    utterance=utterance,
                    final=final,
                    start_s=start * FRAME_S,
                    end_s=None if end is None else end * FRAME_S,
                    text=text,
                )
            )
            if final and text and end is not None:
                self._last_final = _Final(text=text, start_frame=start, end_frame=end, utterance=utterance)
        self._asr_tasks = still
        waiting = {entry.utterance for entry in still}
        self._asr_shown = {u: seq for u, seq in self._asr_shown.items() if u in waiting}

    async def _on_ret(self, i: int, *, forced: bool) -> None:
        if self._pending is not None:
            self._emit(RetEvent(frame=i, t=i * FRAME_S, forced=forced, ignored="a retrieval is already pending"))
            return
        if self.retriever is None:
            self._emit(RetEvent(frame=i, t=i * FRAME_S, forced=forced, ignored="no retriever configured"))
            return
        fresh_frames = self.config.fresh_transcript_s * FRAME_RATE
        last = self._last_final
        speaking = self.utterances.current is not None
        final_on_its_way = any(entry.final for entry in self._asr_tasks)
        if last is not None and not speaking and not final_on_its_way and (i + 1 - last.end_frame) <= fresh_frames:
            self._emit(RetEvent(frame=i, t=i * FRAME_S, forced=forced, plan="cache"))
            self._pending = _Pending(ret_frame=i, forced=forced, plan="cache")
            self._ask(question=last.text, heard_from=last.start_frame)
        elif speaking or final_on_its_way:
            self._emit(RetEvent(frame=i, t=i * FRAME_S, forced=forced, plan="wait"))
            self.utterances.request_cut()
            wait = round(self.config.ret_wait_s * FRAME_RATE)
            self._pending = _Pending(ret_frame=i, forced=forced, plan="wait", wait_until=i + wait)
        else:
            self._emit(RetEvent(frame=i, t=i * FRAME_S, forced=forced, plan="window"))
            self._pending = _Pending(ret_frame=i, forced=forced, plan="window")
            self._ask_window()

    async def _service_wait(self, i: int) -> None:
        p = self._pending
        if p is None or p.plan != "wait" or p.task is not None:
            return
        last = self._last_final
        recent = last is not None and last.end_frame > p.ret_frame - self.config.fresh_transcript_s * FRAME_RATE
        silent = self.utterances.current is None
        final_on_its_way = any(entry.final for entry in self._asr_tasks)
        if recent and silent and not final_on_its_way:
            self._ask(question=last.text, heard_from=last.start_frame)
            return
        if p.wait_until is not None and i >= p.wait_until:
            if silent and final_on_its_way and not p.extended:  # the utterance ended; its final is nearly done
                p.extended = True
                p.wait_until = i + round(self.config.ret_wait_s * FRAME_RATE)
                return
            p.plan = "window"
            self._ask_window()

    def _ask_window(self) -> None:
        keep = round(self.config.listen_s * FRAME_RATE)
        end = self.frame + 1
        audio = self._user_audio(end - keep, end)
        start = max(end - keep, self._audio_start)
        # speech the window cuts into was heard from its utterance's start (the tail of a request is the request)
        for utt in (*self.utterances.finished, self.utterances.current):
            if utt is not None and utt.start < start and (utt.end is None or utt.end > start):
                start = utt.start
        self._ask(audio=audio, heard_from=start)

    def _ask(self, *, heard_from: int, question: str | None = None, audio: np.ndarray | None = None) -> None:
        """Start the retrieval of the pending ``<ret>``, for ``question`` or ``audio`` heard from frame
        ``heard_from`` on: the retriever is told whether all of it came after the last Context Span was read
        (``after_span``: only such speech can answer a span's question, such as a confirmation)."""
        p = self._pending
        assert p is not None
        i = self.frame
        p.asked_frame = i
        p.asked_wall = time.monotonic()
        p.question = question
        if question is not None:
            self._emit(QuestionEvent(frame=i, t=i * FRAME_S, text=question, ret_frame=p.ret_frame))
        deadline = self.config.span_deadline_s
        if self.offline:
            remaining: float | None = math.inf  # judged on the frame clock (_service_retrieval), whatever the default
        elif deadline is None:
            remaining = None
        else:
            remaining = max(0.0, deadline - (i - p.ret_frame) * FRAME_S)
        retriever = self.retriever
        assert retriever is not None
        p.task = asyncio.ensure_future(
            retriever.retrieve(
                audio=audio,
                sample_rate=SAMPLE_RATE if audio is not None else None,
                question=question,
                profile=self.profile,
                agent_said=self.agent_said(),
                conversation_id=self.conversation_id,
                deadline_s=remaining,
                after_span=self._last_span_frame is not None and heard_from >= self._last_span_frame,
            )
        )
        p.task.add_done_callback(lambda _t: setattr(p, "done_wall", time.monotonic()))
        if self.config.span_delay_s is not None:
            p.apply_frame = i + max(1, round(self.config.span_delay_s * FRAME_RATE))

    async def _service_retrieval(self, i: int) -> None:
        p = self._pending
        if p is None or p.task is None:
            return
        deadline = self.config.span_deadline_s
        elapsed = (i - p.ret_frame) * FRAME_S
        if self.offline:
            # Offline clock: the reference is due at its fixed frame, however long the backend takes in wall-clock
            # time; lateness is a matter of frames only (below), so machine speed and load change nothing.
            if p.apply_frame is None or i < p.apply_frame:
                return
            if not p.task.done():
                await asyncio.wait([p.task])
        elif not p.task.done():
            if deadline is not None and elapsed > deadline + LATE_GRACE_S:
                # the retriever did not report late itself: stop waiting for it (the message is its record's reason)
                p.task.cancel(f"the retrieval took longer than the span deadline of {deadline:g} s")
                self._finish_late(i, p, None, seconds=elapsed)
            return
        try:
            result = p.task.result()
        except Exception as exc:
            self._pending = None
            self._emit(NoSpanEvent(frame=i, t=i * FRAME_S, question=p.question, error=f"{type(exc).__name__}: {exc}"))
            return
        if p.question is None and getattr(result, "question", None):
            p.question = result.question
            self._emit(
                QuestionEvent(
                    frame=i,
                    t=i * FRAME_S,
                    text=result.question or "",
                    ret_frame=p.ret_frame,
                    asr_s=getattr(result, "asr_s", None),  # the retriever transcribed it
                )
            )
        if getattr(result, "late", False) or (deadline is not None and elapsed > deadline):
            self._finish_late(i, p, result, seconds=elapsed)
            return
        reference = (getattr(result, "reference", None) or "").strip()
        retrieval_id = getattr(result, "span_id", None)
        self._pending = None
        if not reference:
            error = getattr(result, "error", None)
            self._emit(NoSpanEvent(frame=i, t=i * FRAME_S, question=p.question, error=error, retrieval_id=retrieval_id))
            return
        self._inject(
            reference,
            source=getattr(result, "source", None),
            tool=getattr(result, "tool", None),
            arguments=getattr(result, "arguments", None),
            question=p.question,
            ret_frame=p.ret_frame,
            asked=p,
            retrieval_id=retrieval_id,
        )

    def _finish_late(self, i: int, p: _Pending, result: RetrievalLike | None, *, seconds: float) -> None:
        self._pending = None
        self._emit(
            LateEvent(
                frame=i,
                t=i * FRAME_S,
                question=p.question or getattr(result, "question", None) or None,
                text=getattr(result, "reference", None) if result is not None else None,
                source=getattr(result, "source", None) if result is not None else None,
                seconds=seconds,
                retrieval_id=getattr(result, "span_id", None) if result is not None else None,
                error=(getattr(result, "error", None) if result is not None else None)
                or f"the retrieval took longer than the span deadline of {self.config.span_deadline_s:g} s",
            )
        )

    def _inject(
        self,
        text: str,
        *,
        source: str | None,
        tool: str | None,
        arguments: dict[str, Any] | None,
        question: str | None,
        ret_frame: int | None,
        asked: _Pending | None,
        retrieval_id: int | None = None,
    ) -> None:
        """Queue ``text`` as a Context Span for the session's next step. Its ``span`` event is sent for the frame
        whose step reads it (:meth:`_report_reads`), where the engine says which step read which span
        (``take_span_reads``); with an engine that does not, at once, for this frame."""
        i = self.frame
        try:
            report = self.engine.inject_span(self.session, text)
        except Exception as exc:
            self._emit(ErrorEvent(frame=i, t=i * FRAME_S, stage="span", message=f"{type(exc).__name__}: {exc}"))
            return
        self.span_reports.append(report)
        event = SpanEvent(
            frame=i,
            t=i * FRAME_S,
            text=text,
            tool=tool,
            arguments=arguments,
            source=source,
            question=question,
            ret_frame=ret_frame,
            asked_at=None if asked is None or asked.asked_frame is None else asked.asked_frame * FRAME_S,
            injected_at=i * FRAME_S,
            backend_s=None if asked is None else asked.backend_s,
            n_frames=0,  # from the report (with prefill_ms, deferred, truncated, prefix_in_window) when read
            prefill_ms=0.0,
            deferred=False,
            retrieval_id=retrieval_id,
        )
        unread = _Unread(report, event)
        if self._span_reads is None:
            self._read(i, unread)
        else:
            self._unread.append(unread)

    def _report_reads(self, i: int) -> None:
        """After frame ``i``'s step: the ``span`` events of the spans it read (frame ``i``: read at its head), and
        an ``error`` (stage ``span``) for each the engine refused (an engine on another thread reports that on
        the span's report: ``error``)."""
        if self._span_reads is None or not self._unread:
            return
        read = {r.seq for r in self._span_reads(self.session)}
        waiting: list[_Unread] = []
        for unread in self._unread:
            error = getattr(unread.report, "error", None)
            if error is not None:
                self._emit(ErrorEvent(frame=i, t=i * FRAME_S, stage="span", message=f"{type(error).__name__}: {error}"))
            elif getattr(unread.report, "seq", None) in read:
                self._read(i, unread)
            else:  # queued behind a persona prefix, or held back by the engine's column budget
                waiting.append(unread)
        self._unread = waiting

    def _read(self, i: int, unread: _Unread) -> None:
        """The ``span`` event of a span read at the head of frame ``i``."""
        report = unread.report
        self._last_span_frame = i
        self._emit(
            unread.event.model_copy(
                update={
                    "frame": i,
                    "t": i * FRAME_S,
                    "injected_at": i * FRAME_S,
                    "n_frames": int(report.n),
                    "truncated": bool(getattr(report, "truncated", False)),
                    "prefill_ms": float(getattr(report, "prefill_ms", 0.0)),
                    "deferred": bool(getattr(report, "deferred", False)),
                    "prefix_in_window": bool(getattr(report, "prefix_in_window", True)),
                }
            )
        )


def use_cpu_threads() -> int:
    """Give torch one intra-op thread for an engine that steps on the CPU, unless ``OMP_NUM_THREADS`` chooses
    (torch's default, which follows it, is then kept). Returns the count in use. Call it before the first step:
    each thread takes the count on its first parallel operation.

    Why one (docs/PERFORMANCE.md, "CPU, 2 cores"): the CPU path runs the tiny checkpoint, whose operations are too
    small to split across threads; one thread steps as fast as two on an idle machine and leaves the other core to
    the event loop (voice activity, sockets, backends), where a second intra-op thread, spinning against them and
    against other processes, made the frame several times slower.
    """
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    torch.set_num_threads(1)
    return 1


def voice_activity(conversations: Sequence[Conversation], frames: Sequence[np.ndarray]) -> list[bool | None]:
    """Each conversation's voice activity for its next frame, the Silero detectors of all of them in one pass
    (:func:`cspan.core.vad.voice_probabilities`; several sessions cost little more than one). Give each result to
    that conversation's :meth:`Conversation.before_step` (``voiced=``) with the same frame.

    Returns:
        per conversation, True/False, or None where it has another kind of detector (its ``before_step`` runs it)
        or does not :attr:`~Conversation.listens`.
    """
    chosen = [k for k, c in enumerate(conversations) if c.listens and isinstance(c.vad, SileroVAD)]
    probabilities = voice_probabilities(
        [conversations[k].vad for k in chosen], [np.asarray(frames[k], dtype=np.float32).reshape(-1) for k in chosen]
    )
    voiced: list[bool | None] = [None] * len(conversations)
    for k, probability in zip(chosen, probabilities, strict=True):
        voiced[k] = probability >= conversations[k].vad.threshold
    return voiced


async def run_conversation(
    engine: Any,
    conversation: Conversation,
    frames: Iterable[np.ndarray],
    *,
    realtime: bool = False,
    on_frame: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
) -> None:
    """Drive one session (``conversation.session``) through ``frames`` (float32 ``[1920]`` each) on the 12.5 Hz clock.

    For each frame: ``before_step`` -> ``engine.step`` -> ``after_step`` -> ``on_frame(index, user, agent)``. The
    engine's other sessions (``engine.batch_size`` > 1) are given silence in those steps.
    With ``realtime`` the loop paces itself to 80 ms per frame; otherwise it runs as fast as it can.
    """
    import torch

    t0 = time.monotonic()
    i = conversation.session
    pcm = torch.zeros(getattr(engine, "batch_size", 1), FRAME_SIZE)
    for k, user in enumerate(frames):
        user = np.asarray(user, dtype=np.float32)
        if user.shape != (FRAME_SIZE,):
            raise ValueError(f"frame {k}: expected {FRAME_SIZE} samples, got shape {user.shape}")
        await conversation.before_step(user)
        pcm[i] = torch.from_numpy(user)
        out = await asyncio.to_thread(engine.step, pcm)  # the event loop keeps serving backend tasks meanwhile
        valid = bool(out.valid[i])
        token = int(out.text_token[i]) if valid else None
        await conversation.after_step(token, bool(out.is_ret[i]) if valid else False)
        if on_frame is not None:
            on_frame(k, user, out.agent_pcm[i].detach().float().cpu().numpy())
        if realtime:
            delay = t0 + (k + 1) * FRAME_S - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        else:
            await asyncio.sleep(0)  # let backend tasks run
    await conversation.finish()
