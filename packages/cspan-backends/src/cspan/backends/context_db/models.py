"""The records of the Context DB: profiles, conversations, turns, spans, facts and issued tokens."""

from __future__ import annotations

import math
import zoneinfo
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, Field

from cspan.backends.errors import BackendError

TurnRole = Literal["user", "agent", "tool"]
DropReason = Literal["late", "no_span", "error", "cancelled"]


class ContextDBError(BackendError):
    """The Context DB is unusable (newer schema, corrupt file, unreachable server) or a row is not the caller's
    (unknown conversation or span); the message names the database and the fix."""


class UserForgotten(ContextDBError):
    """A write through a memory opened before its user was forgotten (``cspan db forget``): refused, nothing written.

    A session that began before the erase holds what it read then (the profile, its conversation); writing any of it
    back would undo the erase, so the session must end and a new one start from nothing."""


MAX_FACT_KEY_CHARS = 60
"""The longest fact key (``set_fact``, the ``remember_fact`` tool's ``key``)."""
MAX_FACT_VALUE_CHARS = 300
"""The longest fact value (``set_fact``, the ``remember_fact`` tool's ``value``)."""
MAX_TURN_CHARS = 65536
"""The longest turn text (``add_turn``): about an hour of speech in one utterance."""


def check_text(argument: str, value: Any, *, max_chars: int, min_chars: int = 0) -> str:
    """``value`` if it is a string of ``min_chars`` to ``max_chars`` characters.

    Raises:
        ValueError: naming ``argument``: not a string (None included), empty, or too long (nothing is written).
    """
    if not isinstance(value, str):
        raise ValueError(f"{argument} must be a string, got {type(value).__name__}; nothing was written")
    if len(value) < min_chars or (min_chars and not value.strip()):
        raise ValueError(f"{argument} must not be empty; nothing was written")
    if len(value) > max_chars:
        raise ValueError(f"{argument} has {len(value)} characters, the limit is {max_chars}; nothing was written")
    return value


COORDINATE_LIMITS = {"lat": 90.0, "lon": 180.0}
"""The largest absolute latitude and longitude, in degrees (WGS84)."""


@lru_cache(maxsize=1)
def _iana_timezones() -> frozenset[str]:
    return frozenset(zoneinfo.available_timezones())


def check_timezone(value: str) -> str:
    """``value`` if it is an IANA timezone name this machine knows ("Europe/London"), or empty.

    Raises:
        ValueError: an unknown name ("Mars/Olympus", a zone-database folder such as "Europe").
    """
    if value and value not in _iana_timezones():
        raise ValueError(f"unknown IANA timezone {value!r} (for example 'Europe/London')")
    return value


def check_coordinate(field: str, value: float) -> float:
    """``value`` if it is a finite number of degrees within ``field``'s range (``lat``: -90 to 90, ``lon``: -180
    to 180).

    Raises:
        ValueError: NaN, an infinity, or a value out of range.
    """
    limit = COORDINATE_LIMITS[field]
    if not (math.isfinite(value) and -limit <= value <= limit):
        raise ValueError(f"{field} must be a finite number of degrees from {-limit:g} to {limit:g}, got {value!r}")
    return value


def check_profile_fields(fields: Mapping[str, Any]) -> None:
    """The rule every profile write follows (the Context DB's, a server client's ``profile``): ``timezone`` an IANA
    name (or empty), ``lat``/``lon`` finite degrees within range (or None). Fields not in ``fields`` are not checked
    (a stored row is read as it is).

    Raises:
        ValueError: naming the first field that breaks it.
    """
    for field in ("lat", "lon"):
        value = fields.get(field)
        if value is not None:
            try:
                check_coordinate(field, float(value))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"profile field {field!r}: {exc}") from None
    timezone = fields.get("timezone")
    if timezone:
        try:
            check_timezone(str(timezone))
        except ValueError as exc:
            raise ValueError(f"profile field 'timezone': {exc}") from None


class Profile(BaseModel):
    """Who the user is, as the page or the command line tells us.

    ``timezone`` is an IANA name ("Europe/London"); ``lat``/``lon`` are degrees (WGS84); ``notes`` is free text
    the user wants the agent to know (the page's "Knowledge" field); ``persona`` is the agent's persona line.
    ``user_id`` is informative only: a :class:`~cspan.backends.context_db.UserMemory` stores a profile under its
    own principal's id, whatever this field says.
    """

    user_id: str = "default"
    name: str = ""
    city: str = ""
    timezone: str = ""
    lat: float | None = None
    lon: float | None = None
    notes: str = ""
    persona: str = ""

    def place_label(self) -> str:
        """The city, else the leaf of the timezone ("Europe/London" -> "London"), else ""."""
        if self.city:
            return self.city
        if self.timezone and "/" in self.timezone:
            return self.timezone.rsplit("/", 1)[-1].replace("_", " ")
        return ""


class Conversation(BaseModel):
    """One conversation row: whose, when, which checkpoint, and its settings (any JSON object).

    ``id`` is unique per user (two users may each have a conversation "c1"; they are different rows)."""

    id: str
    user_id: str
    started_at: float
    ended_at: float | None = None
    checkpoint: str = ""
    settings: dict[str, Any] = Field(default_factory=dict)


class Turn(BaseModel):
    """One turn: ``role`` user / agent / tool, ``t`` epoch seconds, ``frame`` the model frame (12.5 Hz) or None."""

    id: int
    conversation_id: str
    role: TurnRole
    text: str
    t: float
    frame: int | None = None
    meta: dict[str, Any] = Field(default_factory=dict)


class SpanRecord(BaseModel):
    """One retrieval: the question, the reference (``text``, None when there was nothing), tool and arguments,
    ``asked_at`` epoch seconds, ``injected_at`` (epoch seconds, with the model ``frame``) or ``dropped``
    ("late" | "no_span" | "error" | "cancelled": cut before it finished, by the end of its conversation), ``latency_s``
    from asking to having the reference (to the cut, when cancelled), ``error`` what failed or why it was cut."""

    id: int
    conversation_id: str
    question: str = ""
    text: str | None = None
    tool: str | None = None
    arguments: dict[str, Any] = Field(default_factory=dict)
    source: str = "none"
    asked_at: float
    injected_at: float | None = None
    frame: int | None = None
    dropped: DropReason | None = None
    latency_s: float | None = None
    error: str | None = None


class Fact(BaseModel):
    """A remembered fact about a user: ``key`` ("name", "city", ...), ``value``, where it came from, when (epoch s)."""

    key: str
    value: str
    source: str = "user"
    t: float


class TokenRecord(BaseModel):
    """An issued per-user token as stored: never the token itself, only its public ``id`` and metadata.

    ``scopes`` are the permissions the token grants (see :data:`cspan.backends.identity.SCOPES`); times are epoch
    seconds; ``revoked_at`` is None while the token is valid.
    """

    id: str
    user_id: str
    scopes: list[str] = Field(default_factory=list)
    label: str = ""
    created_at: float
    last_used_at: float | None = None
    revoked_at: float | None = None
