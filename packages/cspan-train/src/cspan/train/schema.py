"""The training dialogue format: ``NAME.json`` (this schema) next to ``NAME.wav`` (stereo: left user, right agent).

A dialogue file holds the word-timed turns of both speakers, optionally a persona (text prompt, voice prompt) and the
user's profile. A grounded agent turn (``"ret": true``) carries the reference the agent's answer depends on (what a
router or tool returned: it becomes the Context Span), optionally the tool call that produced it, and the index of
the first word that needs it (``body_word``). Example::

    {
      "persona": "You are Ada, a park ranger.",
      "voice": "tiny0",
      "profile": {"name": "Priya", "city": "Sydney"},
      "turns": [
        {"speaker": "user", "words": [{"word": "when", "start": 0.40, "end": 0.62}, ...]},
        {"speaker": "agent", "ret": true, "reference": "The Silver Spoon Cafe opens at seven thirty AM.",
         "tool": "lookup_hours", "arguments": {"place": "Silver Spoon Cafe"}, "body_word": 4,
         "words": [{"word": "let", "start": 2.10, "end": 2.25}, ...]}
      ]
    }

Times are seconds from the start of the audio. :func:`load_dialogue` validates a file and raises
:class:`~cspan.train.errors.DataError` naming the file and the field (``turns[1].words[0].start``);
:func:`dialogue_json_schema` is the JSON Schema (``cspan prepare --print-schema`` prints it).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import DataError

SCHEMA_ID = "https://cspan.dev/schemas/dialogue-1.json"
"""``$id`` of the dialogue JSON Schema (version 1 of the format)."""


class _Strict(BaseModel):
    # strict: no coercion, so a file passes exactly when it fits the printed JSON Schema ("ret": "false" is not
    # true, "start": true is not 1.0 s); an int still reads as a float
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Word(_Strict):
    """One spoken word: its text and its start/end times in seconds (``0 <= start <= end``)."""

    word: str = Field(min_length=1, description="the word as spoken (tokenised as is, without surrounding spaces)")
    start: float = Field(ge=0.0, description="start time in seconds from the start of the audio")
    end: float = Field(ge=0.0, description="end time in seconds (>= start)")

    @field_validator("word")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the word is blank; remove the entry or give its text")
        return value

    @model_validator(mode="after")
    def _ordered(self) -> Word:
        if self.end < self.start:
            raise ValueError(f"end ({self.end} s) is before start ({self.start} s)")
        return self


class Turn(_Strict):
    """One turn of one speaker. Only agent turns go into the text stream; ``ret`` marks a grounded agent turn."""

    speaker: Literal["user", "agent"] = Field(description="who speaks: 'user' (left channel) or 'agent' (right)")
    words: list[Word] = Field(min_length=1, description="the words of the turn, in time order")
    ret: bool = Field(default=False, description="agent turn grounded on a reference: <ret> precedes its first word")
    reference: str | None = Field(default=None, description="the reference text (becomes the Context Span)")
    tool: str | None = Field(default=None, description="the tool that produced the reference (metadata)")
    arguments: dict[str, Any] | None = Field(default=None, description="the tool call's arguments (metadata)")
    body_word: int | None = Field(
        default=None,
        ge=0,
        description="index in words of the first word that needs the reference (default len(words) // 3)",
    )

    @model_validator(mode="after")
    def _grounding(self) -> Turn:
        starts = [w.start for w in self.words]
        for j in range(1, len(starts)):
            if starts[j] < starts[j - 1]:
                raise ValueError(
                    f"words[{j}] starts at {starts[j]} s, before words[{j - 1}] ({starts[j - 1]} s); sort the words "
                    "by start time"
                )
        if self.ret:
            if self.speaker != "agent":
                raise ValueError("'ret' is only allowed on agent turns (the agent asks for the reference)")
            if self.reference is None or not self.reference.strip():
                raise ValueError("a turn with 'ret': true needs a non-empty 'reference'")
            if self.body_word is not None and self.body_word >= len(self.words):
                raise ValueError(f"body_word {self.body_word} is outside the turn's {len(self.words)} words")
        else:
            extra = [
                name for name in ("reference", "tool", "arguments", "body_word") if getattr(self, name) is not None
            ]
            if extra:
                raise ValueError(f"{', '.join(extra)} given on a turn without 'ret': true; set 'ret': true or remove")
        return self

    @property
    def body_index(self) -> int:
        """Index of the first word that needs the reference (``body_word``, default ``len(words) // 3``)."""
        return self.body_word if self.body_word is not None else len(self.words) // 3


class Profile(_Strict):
    """The user's profile; name and city go into the persona prefix as the engine's ``set_persona`` does."""

    name: str | None = Field(default=None, description="the user's name ('The user's name is X.')")
    city: str | None = Field(default=None, description="the user's city ('The user is in Y.')")
    timezone: str | None = Field(default=None, description="IANA timezone (metadata)")


class Dialogue(_Strict):
    """One training dialogue (see the module docstring)."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        json_schema_extra={"$id": SCHEMA_ID, "$schema": "https://json-schema.org/draft/2020-12/schema"},
    )

    persona: str | None = Field(default=None, description="the persona text prompt (wrapped <system> ... <system>)")
    voice: str | None = Field(
        default=None,
        description="voice prompt: a .pt voice file or a 2-30 s recording (relative to the JSON), or a voice name of "
        "the checkpoint as cspan infer --voice takes it (voices/, PersonaPlex's voices.tgz); training needs Mimi "
        "codes, so a PersonaPlex voice in embeddings form only is refused",
    )
    profile: Profile | None = Field(default=None, description="the user's profile")
    turns: list[Turn] = Field(min_length=1, description="the turns of both speakers")
    meta: dict[str, Any] | None = Field(default=None, description="free-form metadata, ignored by training")


def dialogue_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a dialogue file."""
    return Dialogue.model_json_schema()


def _field_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def load_dialogue(path: str | os.PathLike[str]) -> Dialogue:
    """Read and validate one dialogue file.

    Raises:
        DataError: unreadable file, invalid JSON, or a field that breaks the schema; the message names the file
            and the field (``turns[2].words[0].start``) and says what is expected.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"dialogue file {str(path)!r}: cannot be read ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"dialogue file {str(path)!r}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    except RecursionError:
        raise DataError(f"dialogue file {str(path)!r}: not valid JSON (arrays or objects nested too deeply)") from None
    except ValueError:  # Python's integer-string conversion limit (the same reason cspan.backends.untrusted gives)
        raise DataError(
            f"dialogue file {str(path)!r}: not valid JSON (a number is longer than {sys.get_int_max_str_digits()} "
            "digits)"
        ) from None
    return validate_dialogue(data, str(path))


def validate_dialogue(data: Any, where: str = "dialogue") -> Dialogue:
    """Validate parsed JSON as a :class:`Dialogue`.

    Raises:
        DataError: naming ``where`` and the first invalid fields (up to 5).
    """
    if isinstance(data, dict) and "alignments" in data and "turns" not in data:
        raise DataError(
            f'dialogue file {where!r} is kyutai-labs/moshi-finetune\'s annotate.py output ({{"alignments": [[word, '
            "[start, end], speaker], ...]}), which cspan prepare does not read: write its words as turns "
            '({"turns": [{"speaker": "user" | "agent", "words": [{"word", "start", "end"}, ...]}, ...]}) and put the '
            "audio with left = user, right = agent (moshi-finetune's stereo is left = Moshi, right = user: swap the "
            "channels); docs/TRAINING.md"
        )
    try:
        return Dialogue.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors()[:5]:
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            problems.append(f"field {_field_path(tuple(err.get('loc', ())))}: {msg}")
        more = f" (and {exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
        raise DataError(f"dialogue file {where!r}: " + "; ".join(problems) + more) from None


__all__ = [
    "SCHEMA_ID",
    "Dialogue",
    "Profile",
    "Turn",
    "Word",
    "dialogue_json_schema",
    "load_dialogue",
    "validate_dialogue",
]
