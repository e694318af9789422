"""What the conversation runtime needs from a backend, as structural protocols.

``cspan.backends`` satisfies these without importing ``cspan.core`` (DESIGN.md section 2): any object with the
right methods and attributes works, so tests and applications can also plug in their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


class WordLike(Protocol):
    """A transcribed word with its time in seconds from the start of the transcribed clip."""

    text: str
    start_s: float
    end_s: float


class TranscriptLike(Protocol):
    """A transcription result: the text, and word timings where the transcriber provides them."""

    text: str
    words: Sequence[WordLike] | None


@runtime_checkable
class Transcriber(Protocol):
    """Speech to text.

    ``transcribe(pcm, sample_rate)`` takes float32 mono samples in [-1, 1] (shape ``[S]``) at ``sample_rate`` Hz and
    returns a :class:`TranscriptLike`. It may raise; the runtime logs the failure and goes on.
    """

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> TranscriptLike: ...


class TranscriptStream(Protocol):
    """One utterance transcribed as it is heard (what :meth:`StreamingTranscriber.open_stream` returns).

    ``feed(pcm)`` adds float32 mono samples ``[S]`` at the stream's rate and never blocks (the recognizer decodes in
    the background, as it can); ``await partial()`` is the transcript of everything fed so far; ``await finish()`` is
    the final transcript of everything fed, after which the stream is closed; ``cancel()`` drops the utterance (no
    transcript; the recognizer frees what it held; a partial still waiting may be cancelled). Word times count from
    the first sample fed. ``partial`` and ``finish`` may raise (the recognizer failed): the runtime then transcribes
    the utterance's audio with ``transcribe`` instead. Cancelling the task awaiting ``partial`` must leave the
    stream usable.
    """

    def feed(self, pcm: np.ndarray) -> None: ...
    async def partial(self) -> TranscriptLike: ...
    async def finish(self) -> TranscriptLike: ...
    def cancel(self) -> None: ...


@runtime_checkable
class StreamingTranscriber(Transcriber, Protocol):
    """A :class:`Transcriber` that can also transcribe an utterance incrementally: ``open_stream(sample_rate)``
    returns a :class:`TranscriptStream`. Optional: the runtime uses it when the transcriber has it (each partial
    then costs the audio since the last, the final only the tail) and re-transcribes the whole utterance with
    ``transcribe`` otherwise."""

    def open_stream(self, sample_rate: int) -> TranscriptStream: ...


class RetrievalLike(Protocol):
    """The answer to one ``<ret>``: the reference to inject (``None`` when there is nothing to say).

    ``question`` is the text that was routed; ``source`` names where the reference came from (``tool:<name>``,
    ``llm``, ``local:...``); ``error`` describes a failure (then ``reference`` is ``None``).
    """

    question: str | None
    reference: str | None
    tool: str | None
    arguments: dict[str, Any] | None
    source: str | None
    error: str | None


@runtime_checkable
class Retriever(Protocol):
    """Question (or audio to transcribe) to reference.

    ``retrieve`` must not raise on backend failures: it returns a result whose ``reference`` is ``None`` and whose
    ``error`` says why. On the live clock ``deadline_s`` is what is left of the span deadline: a result with a true
    ``late`` attribute (and the ``question`` it had) is reported as ``late``, and the runtime cancels a call still
    running shortly after the deadline. On the offline clock ``deadline_s`` is ``math.inf`` (no wall-clock limit:
    lateness is judged on frames) and the call is awaited. ``after_span`` says whether all of the user's speech the
    question comes from was heard after the last Context Span of the conversation was read (False when none was
    read, None when unknown): only such speech can answer that span's question, such as "yes" to a confirmation.

    Optional: ``async record_cut(*, why, asked_at, waited_s, profile, conversation_id)``. A ``<ret>`` waiting for the
    user's utterance to end (or for its final transcript) has not called ``retrieve`` yet; when the conversation ends
    then, the runtime calls ``record_cut`` where the retriever has it, for its record (``why`` the reason,
    ``asked_at`` the ``<ret>``'s time in seconds since the epoch, ``waited_s`` the seconds since). It must not raise
    on backend failures; the runtime logs anything it raises.
    """

    async def retrieve(
        self,
        *,
        audio: np.ndarray | None = None,
        sample_rate: int | None = None,
        question: str | None = None,
        profile: Any = None,
        agent_said: str = "",
        conversation_id: Any = None,
        deadline_s: float | None = None,
        after_span: bool | None = None,
    ) -> RetrievalLike: ...
