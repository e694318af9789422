"""The JSON written by ``cspan infer --output-text`` (documented in ``docs/OUTPUT.md``).

Times are seconds on the output recording's timeline (``t = 0`` at the first sample of the output WAV, which
starts with ``lead_silence_s`` of silence before the input); ``input_offset_s`` converts to the input's own
timeline (``t_input = t - input_offset_s``). Frame indices are 12.5 Hz frames of the output.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cspan.core.events import ConversationEvent

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


class WindowSummary(BaseModel):
    """What kept the conversation inside the model's attention window (``docs/ENGINE.md``, "The persona past the
    window"): the frames where the persona policy acted, and the memory spans read."""

    persona_policy: str
    context: int | None = Field(description="the attention window in positions (None: unbounded)")
    positions: int = Field(description="positions the session fed (frames, persona, spans, copies)")
    pinned_at_frame: int | None = Field(description="the frame from which the persona's entries were pinned")
    reprefix_frames: list[int] = Field(description="the frames at whose head a copy of the persona was read")
    memory_spans: int = Field(description="memory spans read (--memory-span)")


def window_summary(engine: Any, events: list[Any], policy: str) -> WindowSummary:
    """The :class:`WindowSummary` of session 0 of ``engine`` from the conversation's ``events``."""
    persona = [e for e in events if getattr(e, "type", None) == "persona"]
    return WindowSummary(
        persona_policy=policy,
        context=engine.context,
        positions=int(engine.positions[0]),
        pinned_at_frame=next((e.frame for e in persona if e.kind == "pin"), None),
        reprefix_frames=[e.frame for e in persona if e.kind == "reprefix"],
        memory_spans=sum(getattr(e, "type", None) == "span" and e.source == "memory" for e in events),
    )


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
