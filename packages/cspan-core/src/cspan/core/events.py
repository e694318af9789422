"""Conversation events: what happened, when, as typed records.

The same models are written to ``cspan infer``'s JSON (``docs/OUTPUT.md``) and sent over ``cspan serve``'s
WebSocket (``docs/PROTOCOL.md``). Times are seconds (float) on the conversation's own timeline (frame index
times 0.08 s), rounded to the microsecond (:data:`Seconds`); ``frame`` is the 12.5 Hz frame index.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

Seconds = Annotated[float, AfterValidator(lambda value: round(value, 6))]
"""A time on the conversation's timeline, rounded to the microsecond: ``frame * 0.08`` in binary floating point is
``3.7600000000000002`` at frame 47; an event holds (and writes) ``3.76``."""


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")
    frame: int = Field(description="frame index (12.5 Hz) at which the event happened")
    t: Seconds = Field(description="time in seconds, frame * 0.08")


class TextEvent(_Event):
    """An agent text token that renders as text (pieces of words; specials are not reported)."""

    type: Literal["text"] = "text"
    token: int
    text: str


class UserTextEvent(_Event):
    """A transcript of a user utterance: partial while it runs, final when it ended."""

    type: Literal["user_text"] = "user_text"
    utterance: int
    final: bool
    start_s: Seconds
    end_s: Seconds | None
    text: str


class RetEvent(_Event):
    """The model emitted ``<ret>`` (or one was forced). ``ignored`` says why nothing was started, if so."""

    type: Literal["ret"] = "ret"
    forced: bool = False
    plan: Literal["cache", "wait", "window"] | None = None
    ignored: str | None = None


class QuestionEvent(_Event):
    """The question that was routed for a ``<ret>``, with the transcription latency where one ran."""

    type: Literal["question"] = "question"
    text: str
    ret_frame: int
    asr_s: float | None = None


class SpanEvent(_Event):
    """A Context Span was injected at the head of ``frame``."""

    type: Literal["span"] = "span"
    text: str
    tool: str | None = None
    arguments: dict[str, Any] | None = None
    source: str | None = None
    question: str | None = None
    ret_frame: int | None = None
    asked_at: Seconds | None = Field(default=None, description="time the retrieval was asked (s)")
    injected_at: Seconds = Field(description="time the span was read (s)")
    backend_s: float | None = Field(default=None, description="wall-clock latency of the backend call (s)")
    n_frames: int
    truncated: bool = False
    prefill_ms: float
    deferred: bool = Field(
        default=False,
        description="the block is read together with this frame's position in the step's forward (prefill_ms is "
        "then the injection's host time)",
    )
    prefix_in_window: bool = True
    retrieval_id: int | None = Field(default=None, description="the backend's record of this retrieval, if any")


class LateEvent(_Event):
    """A reference arrived after the deadline and was dropped; ``error`` says why (the step that was still running,
    e.g. a transcriber that had not answered)."""

    type: Literal["late"] = "late"
    question: str | None = None
    text: str | None = None
    source: str | None = None
    seconds: float
    retrieval_id: int | None = None
    error: str | None = None


CONVERSATION_ENDED = "conversation ended"
"""The ``error`` of the :class:`NoSpanEvent` of a retrieval still running when its conversation ended (the client
stopped or left): the retrieval was cancelled (with this as the cancel message), no backend failed."""


class NoSpanEvent(_Event):
    """A retrieval finished with nothing to inject (nothing found, the backend failed, or the conversation ended
    first: see ``error``)."""

    type: Literal["no_span"] = "no_span"
    question: str | None = None
    error: str | None = None
    retrieval_id: int | None = None


class PersonaEvent(_Event):
    """What the session's persona policy did at the head of ``frame`` (``docs/ENGINE.md``, "The persona past the
    window"): ``pin`` (the prefix's entries became sink positions at the window's oldest end; once) or ``reprefix``
    (a copy of the prefix was read)."""

    type: Literal["persona"] = "persona"
    kind: Literal["pin", "reprefix"]
    position: int = Field(description="pin: the first position of the window; reprefix: the copy's first position")
    positions: int = Field(description="the prefix's positions (sinks, or the copy's columns)")


class ErrorEvent(_Event):
    """A stage failed; the conversation went on."""

    type: Literal["error"] = "error"
    stage: str
    message: str


EVENT_MODELS = (
    TextEvent,
    UserTextEvent,
    RetEvent,
    QuestionEvent,
    SpanEvent,
    LateEvent,
    NoSpanEvent,
    PersonaEvent,
    ErrorEvent,
)
"""Every conversation event model (a new event is added here, and every protocol's message union follows)."""
ConversationEvent = Annotated[Union[EVENT_MODELS], Field(discriminator="type")]  # noqa: UP007 (a tuple of models)

__all__ = [
    "CONVERSATION_ENDED",
    "EVENT_MODELS",
    "ConversationEvent",
    "ErrorEvent",
    "LateEvent",
    "NoSpanEvent",
    "PersonaEvent",
    "QuestionEvent",
    "RetEvent",
    "Seconds",
    "SpanEvent",
    "TextEvent",
    "UserTextEvent",
]
