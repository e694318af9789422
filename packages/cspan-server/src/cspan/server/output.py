"""The JSON written by ``cspan infer --output-text`` (documented in ``docs/OUTPUT.md``), and
:class:`InferJsonStream`, which writes it with memory bounded over any duration.

Times are seconds on the output recording's timeline (``t = 0`` at the first sample of the output WAV, which
starts with ``lead_silence_s`` of silence before the input); ``input_offset_s`` converts to the input's own
timeline (``t_input = t - input_offset_s``). Frame indices are 12.5 Hz frames of the output.
"""

from __future__ import annotations

import shutil
from array import array
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field

from cspan.core.errors import OutputError
from cspan.core.events import ConversationEvent, PersonaEvent, SpanEvent, TextEvent, UserTextEvent
from cspan.core.files import drop_part, new_part, publish_part, write_error

OUTPUT_VERSION = 1


class AgentWord(BaseModel):
    """A word the agent said: its text and the time its first text token was emitted (s)."""

    text: str
    start_s: float
    frame: int


class UserTranscript(BaseModel):
    """The final transcript of one user utterance."""

    utterance: int
    start_s: float
    end_s: float | None
    text: str


class TimingStats(BaseModel):
    """Wall-clock statistics in milliseconds (these vary from run to run)."""

    count: int
    mean_ms: float
    p50_ms: float
    p99_ms: float
    max_ms: float


class Timing(BaseModel):
    """Per-frame timing: the engine step, and the span prefills."""

    frames: int
    step: TimingStats | None
    prefill: TimingStats | None
    realtime_factor: float = Field(description="audio seconds processed per wall-clock second")


class PersonaInfo(BaseModel):
    """How much of the model's attention window the persona prefix takes (frames of 80 ms)."""

    frames: int = Field(description="P: voice prompt + silences + text prompt frames")
    voice_frames: int
    text_tokens: int
    window: int | None = Field(description="the checkpoint's attention window in positions (None: unbounded)")
    voice: str | None = Field(
        None, description="the voice that spoke: as --voice named it, or the default voice's name (None: no voice)"
    )
    voice_file: str | None = Field(None, description="the file it was read from")
    voice_sha256: str | None = Field(None, description="the SHA-256 of that file's bytes")
    voice_form: str | None = Field(None, description="codes, embeddings (PersonaPlex's) or recording")
    voice_default: bool = Field(False, description="chosen because --voice was not given")


class ToolsInfo(BaseModel):
    """The tools the run's router could call (whatever ``--tools`` said, or left to the default)."""

    sets: list[str] = Field(description="the built-in tool sets in effect (empty with --router none)")
    names: list[str] = Field(description="every tool the router could call, built-in and MCP, sorted")


class WindowSummary(BaseModel):
    """What kept the conversation inside the model's attention window (``docs/ENGINE.md``, "The persona past the
    window"): the frames where the persona policy acted, and the memory spans read."""

    persona_policy: str
    context: int | None = Field(description="the attention window in positions (None: unbounded)")
    positions: int = Field(description="positions the session fed (frames, persona, spans, copies)")
    pinned_at_frame: int | None = Field(description="the frame from which the persona's entries were pinned")
    reprefix_frames: list[int] = Field(description="the frames at whose head a copy of the persona was read")
    memory_spans: int = Field(description="memory spans read (--memory-span)")


class CheckpointIdentity(BaseModel):
    """Which model produced the output."""

    source: str
    files: dict[str, str]
    dep_q: int
    num_parameters: int
    dtype: str
    device: str


class InferOutput(BaseModel):
    """Everything ``cspan infer`` reports besides the audio."""

    model_config = ConfigDict(extra="forbid")

    version: int = OUTPUT_VERSION
    input: str
    output_wav: str | None = Field(description="the audio written; None when it could not be written")
    sample_rate: int
    duration_s: float
    input_offset_s: float
    input_nonfinite_samples: int = Field(0, description="NaN or infinite input samples, read as silence")
    input_clipped_samples: int = Field(0, description="finite input samples beyond full scale, clipped to +-1.0")
    persona: PersonaInfo | None = None
    window: WindowSummary | None = None
    agent_text: str
    agent_words: list[AgentWord]
    user_transcripts: list[UserTranscript]
    events: list[ConversationEvent]
    timing: Timing
    settings: dict[str, Any]
    checkpoint: CheckpointIdentity
    tools: ToolsInfo | None = None


def timing_stats(values_ms: list[float]) -> TimingStats | None:
    """Summarise a list of durations (ms); ``None`` when empty."""
    if not values_ms:
        return None
    import numpy as np

    arr = np.asarray(values_ms, dtype=np.float64)
    return TimingStats(
        count=len(arr),
        mean_ms=float(arr.mean()),
        p50_ms=float(np.percentile(arr, 50)),
        p99_ms=float(np.percentile(arr, 99)),
        max_ms=float(arr.max()),
    )


SPOOLED = ("agent_words", "user_transcripts", "events")
"""The lists of :class:`InferOutput` that grow with the conversation, in the document's field order."""
_ITEM_INDENT = " " * 4
"""A list item's indent in ``InferOutput.model_dump_json(indent=2)``: its lines sit two levels deep."""


class InferJsonStream:
    """What ``cspan infer`` reports of a conversation, gathered event by event with memory bounded over any duration.

    Give it every :class:`~cspan.core.events.ConversationEvent` as it happens (:meth:`on_event`, the
    conversation's ``on_event`` hook). The lists that grow with the conversation (``agent_words``,
    ``user_transcripts``, ``events``) go to spool files in a temporary folder next to the JSON's destination
    (:func:`cspan.core.files.new_part`: on the output's file system, removed if the process exits or is killed),
    each item already formatted as :meth:`write` places it. In memory stay only the word being said, the counters,
    the span prefill times (one float per span) and the frames where the persona policy acted (one per window).
    :meth:`write` publishes the JSON (temporary file and rename), copying the spool files in pieces; the file is
    byte for byte ``InferOutput(...).model_dump_json(indent=2) + "\\n"`` of the same values.

    With ``path`` None (no ``--output-text``) nothing is spooled; the counters are kept.

    A spool file that cannot be written (a full disk) is not fatal: the spool is removed, the conversation goes on,
    and :attr:`error` holds the :class:`OutputError` naming ``path``, which :meth:`write` raises.

    Raises:
        OutputError: (constructor) the spool folder cannot be made next to ``path``.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.error: OutputError | None = None
        self.spans = 0
        self.memory_spans = 0
        self.pinned_at_frame: int | None = None
        self.reprefix_frames: list[int] = []
        self.prefill_ms = array("d")
        self.counts = dict.fromkeys(SPOOLED, 0)
        self._word: AgentWord | None = None
        self._spool: Path | None = None
        self._finished: Path | None = None  # the whole JSON, written by finish() and not yet published
        self._files: dict[str, IO[bytes]] = {}
        if path is not None:
            try:
                self._spool = new_part(path, folder=True)
                self._files = {name: (self._spool / name).open("wb") for name in SPOOLED}
            except OSError as exc:
                self.drop()
                raise OutputError.from_os_error(path, exc) from None

    @property
    def spooling(self) -> bool:
        """Whether the lists are being written (a ``path``, and no write failed)."""
        return self._spool is not None

    def on_event(self, event: ConversationEvent) -> None:
        """Count ``event`` and spool it (and the word or transcript it makes)."""
        if isinstance(event, TextEvent):
            if event.text.startswith(" ") or self._word is None:
                self._end_word()
                self._word = AgentWord(text=event.text.strip(), start_s=event.t, frame=event.frame)
            else:
                self._word.text += event.text
        elif isinstance(event, UserTextEvent) and event.final:
            transcript = UserTranscript(
                utterance=event.utterance, start_s=event.start_s, end_s=event.end_s, text=event.text
            )
            self._spool_item("user_transcripts", transcript)
        elif isinstance(event, SpanEvent):
            self.spans += 1
            self.memory_spans += event.source == "memory"
            self.prefill_ms.append(event.prefill_ms)
        elif isinstance(event, PersonaEvent):
            if event.kind == "pin" and self.pinned_at_frame is None:
                self.pinned_at_frame = event.frame
            elif event.kind == "reprefix":
                self.reprefix_frames.append(event.frame)
        self._spool_item("events", event)

    def window(self, engine: Any, policy: str) -> WindowSummary:
        """The :class:`WindowSummary` of session 0 of ``engine`` (its ``context`` and ``positions``)."""
        return WindowSummary(
            persona_policy=policy,
            context=engine.context,
            positions=int(engine.positions[0]),
            pinned_at_frame=self.pinned_at_frame,
            reprefix_frames=list(self.reprefix_frames),
            memory_spans=self.memory_spans,
        )

    def write(self, document: InferOutput) -> None:
        """Write the JSON to ``path``: ``document`` (with its spooled lists empty) with the spooled lists in their
        places, through a temporary file renamed into place (:meth:`finish`, then :meth:`publish`); the spool is
        removed either way.

        Raises:
            OutputError: the spool or the file could not be written (names ``path`` and the cause).
        """
        try:
            self.finish(document)
            self.publish()
        finally:
            self.drop()

    def finish(self, document: InferOutput) -> None:
        """Write the whole JSON to a temporary file next to ``path``, not yet in place (:meth:`publish` renames
        it). The spool stays until :meth:`drop`, so a second call (a ``document`` that changed) writes it again.

        Raises:
            OutputError: the spool or the file could not be written (names ``path`` and the cause); the temporary
                file is removed.
        """
        assert self.path is not None, "nothing to write: the stream has no path"
        self._drop_finished()
        self._end_word()
        self._close_files()
        if self.error is not None:
            raise self.error
        assert self._spool is not None
        text = document.model_dump_json(indent=2) + "\n"
        try:
            part = new_part(self.path)
        except OSError as exc:
            raise OutputError.from_os_error(self.path, exc) from None
        self._finished = part
        try:
            with part.open("wb") as out:
                done = 0
                for name in SPOOLED:
                    empty = f'\n  "{name}": []'  # a top-level key: no JSON string holds a raw newline
                    at = text.index(empty, done) + len(empty) - 1  # the list's "]"
                    out.write(text[done:at].encode("utf-8"))
                    done = at
                    if self.counts[name]:
                        out.write(b"\n")
                        with (self._spool / name).open("rb") as items:
                            shutil.copyfileobj(items, out)
                        out.write(b"\n  ")
                out.write(text[done:].encode("utf-8"))
        except Exception as exc:
            self._drop_finished()
            raise write_error(self.path, exc) from exc
        except BaseException:
            self._drop_finished()
            raise

    def publish(self) -> None:
        """Rename the file :meth:`finish` wrote onto ``path``.

        Raises:
            OutputError: the rename failed (names ``path`` and the cause); the temporary file is removed.
        """
        assert self.path is not None and self._finished is not None, "finish() first"
        try:
            publish_part(self._finished, self.path)
        except OSError as exc:
            self._drop_finished()
            raise write_error(self.path, exc) from None
        self._finished = None

    def drop(self) -> None:
        """Close and remove the spool, and a finished file not published (a failed or interrupted run; :meth:`write`
        does it too)."""
        self._drop_finished()
        try:
            self._close_files()
        except OSError:
            pass
        if self._spool is not None:
            drop_part(self._spool)
            self._spool = None

    # ------------------------------------------------------------------------------------------------ internals
    def _drop_finished(self) -> None:
        part, self._finished = self._finished, None
        if part is not None:
            drop_part(part)

    def _end_word(self) -> None:
        word, self._word = self._word, None
        if word is not None and word.text:
            self._spool_item("agent_words", word)

    def _spool_item(self, name: str, item: BaseModel) -> None:
        if self._spool is None:
            return
        separator = ",\n" if self.counts[name] else ""
        text = separator + _ITEM_INDENT + item.model_dump_json(indent=2).replace("\n", "\n" + _ITEM_INDENT)
        try:
            self._files[name].write(text.encode("utf-8"))
        except Exception as exc:  # a full disk, or any failure to write: the JSON is lost, the conversation goes on
            self._fail(exc)
            return
        self.counts[name] += 1

    def _close_files(self) -> None:
        files, self._files = self._files, {}
        try:
            for f in files.values():
                f.close()  # flushes: a full disk says so here too
        except Exception as exc:
            for f in files.values():
                try:
                    f.close()
                except OSError:
                    pass
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        assert self.path is not None
        if self.error is None:
            self.error = write_error(self.path, exc, near=self._spool)
        self.drop()
