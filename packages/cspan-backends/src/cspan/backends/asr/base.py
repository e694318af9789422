"""What every transcriber returns, and the protocol they share.

A transcriber turns a clip of user speech into text when the model emits ``<ret>`` (see ``docs/ARCHITECTURE.md``).
``cspan.core`` states the same protocol on its side; the classes here satisfy it structurally, without importing
the core.
"""

from __future__ import annotations

import re
from typing import Protocol, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from cspan.backends.untrusted import sanitize_text

MAX_TRANSCRIPT_CHARS = 2000
"""Longest transcript text, in characters (about two minutes of fast speech; a question is rarely a tenth of it).
Longer text, which only a broken or hostile transcriber produces, is cut at a word boundary and ends in ``...``."""
MAX_TRANSCRIPT_WORDS = 1000
"""Most word timings kept from one transcript; later ones are dropped."""


class Word(BaseModel):
    """One recognised word and where it lies in the clip.

    Times are seconds from the start of the clip that was transcribed (whatever its sample rate).
    """

    model_config = ConfigDict(frozen=True)

    text: str
    start_s: float = Field(ge=0.0)
    end_s: float = Field(ge=0.0)

    @model_validator(mode="after")
    def _ordered(self) -> Word:
        if self.end_s < self.start_s:
            raise ValueError(f"word {self.text!r}: end_s {self.end_s} is before start_s {self.start_s}")
        return self


class Transcript(BaseModel):
    """The text of a clip, and its words with timings when the engine offers them (``None`` otherwise)."""

    model_config = ConfigDict(frozen=True)

    text: str
    words: list[Word] | None = None


@runtime_checkable
class Transcriber(Protocol):
    """Anything that transcribes a clip asynchronously.

    ``pcm`` is float32 mono audio in [-1, 1], shape ``[S]`` (``[1, S]`` is accepted too), at ``sample_rate`` Hz
    (any rate; implementations resample). Implementations raise
    :class:`~cspan.backends.errors.TranscriberError` on failure; they never turn an error into empty text.
    """

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> Transcript: ...


# Qwen3-ASR (its vLLM server and its transformers checkpoints) prefixes the text with the detected language:
# "language English<asr_text>What is the weather like". Seen in the original system's duetaspan/align/asr.py.
_ASR_PREFIX = re.compile(r"^\s*language\s+[^<]*<asr_text>", re.IGNORECASE)
_ASR_SUFFIX = re.compile(r"</asr_text>\s*$", re.IGNORECASE)


def clean_asr_text(text: str) -> str:
    """A transcriber's text as the rest of the system reads it: Qwen3-ASR's ``language X<asr_text>`` prefix (and a
    closing tag, if any) stripped, then made one line without control or format characters (ESC, NUL, bidi
    overrides...) and cut to :data:`MAX_TRANSCRIPT_CHARS` (:func:`cspan.backends.untrusted.sanitize_text`)."""
    text = _ASR_PREFIX.sub("", text, count=1)
    text = _ASR_SUFFIX.sub("", text, count=1)
    return sanitize_text(text, MAX_TRANSCRIPT_CHARS)
