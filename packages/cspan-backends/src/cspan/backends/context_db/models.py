"""The records of the Context DB: profiles, conversations, turns, spans, facts and issued tokens."""

from __future__ import annotations

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
