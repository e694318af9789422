"""The Context DB: what the system remembers about a user and a conversation, in one SQLite file.

It holds per-user **profiles** (name, city, timezone, lat/lon, notes, persona), **conversations**, their
**turns** (user / agent / tool, with wall-clock time and model frame), the **spans** that were asked for
(reference text, tool and arguments, when asked, when injected or why dropped, latency), and per-user **facts**
(from the profile and regex-extracted from user turns such as "my name is Ada" or "I live in Leeds").
:meth:`ContextDB.working_text` renders the profile plus the recent turns as the compact text the router reads.

The original system (mindlogic-ai/Context-Spanning, ``duetaspan/runtime/backend/context_db.py``) kept all of
this in Python lists that vanished with the process; here the same information lives in SQLite (WAL mode,
``PRAGMA user_version``-style versioning in a ``schema_version`` table) so it survives restarts and can be shared
by several processes. ``":memory:"`` is accepted for throw-away sessions and tests.

Concurrency: one connection per :class:`ContextDB`, every statement under one lock, so a single instance may be
used from many threads. The ``a``-prefixed coroutine methods (``aadd_turn``, ``aworking_text`` ...) run the
matching synchronous method in a worker thread (:func:`asyncio.to_thread`), which is how async code should call
it; calling the synchronous methods from an event loop also works but blocks the loop for the statement's
duration (well under a millisecond for these small writes). Several :class:`ContextDB` instances or processes
may open the same file: WAL lets readers proceed during a write and ``busy_timeout`` makes writers wait their
turn instead of failing.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from cspan.backends.errors import BackendError

SCHEMA_VERSION = 1
"""Version of the tables below; bump it and add a step to ``_MIGRATIONS`` when the schema changes."""

TurnRole = Literal["user", "agent", "tool"]
DropReason = Literal["late", "no_span", "error"]

_SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS profiles (
    user_id    TEXT PRIMARY KEY,
    name       TEXT NOT NULL DEFAULT '',
    city       TEXT NOT NULL DEFAULT '',
    timezone   TEXT NOT NULL DEFAULT '',
    lat        REAL,
    lon        REAL,
    notes      TEXT NOT NULL DEFAULT '',
    persona    TEXT NOT NULL DEFAULT '',
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS conversations (
    id         TEXT PRIMARY KEY,
    user_id    TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at   REAL,
    checkpoint TEXT NOT NULL DEFAULT '',
    settings   TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS conversations_user ON conversations(user_id, started_at);
CREATE TABLE IF NOT EXISTS turns (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role            TEXT NOT NULL CHECK (role IN ('user', 'agent', 'tool')),
    text            TEXT NOT NULL,
    t               REAL NOT NULL,
    frame           INTEGER,
    meta            TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS turns_conversation ON turns(conversation_id, id);
CREATE TABLE IF NOT EXISTS spans (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    question        TEXT NOT NULL DEFAULT '',
    text            TEXT,
    tool            TEXT,
    arguments       TEXT NOT NULL DEFAULT '{}',
    source          TEXT NOT NULL DEFAULT 'none',
    asked_at        REAL NOT NULL,
    injected_at     REAL,
    frame           INTEGER,
    dropped         TEXT CHECK (dropped IS NULL OR dropped IN ('late', 'no_span', 'error')),
    latency_s       REAL,
    error           TEXT
);
CREATE INDEX IF NOT EXISTS spans_conversation ON spans(conversation_id, id);
CREATE TABLE IF NOT EXISTS facts (
    user_id TEXT NOT NULL,
    key     TEXT NOT NULL,
    value   TEXT NOT NULL,
    source  TEXT NOT NULL DEFAULT 'user',
    t       REAL NOT NULL,
    PRIMARY KEY (user_id, key)
);
"""

# version reached -> script that brings the previous version to it
_MIGRATIONS: dict[int, str] = {1: _SCHEMA_V1}


class ContextDBError(BackendError):
    """The Context DB file is unusable (newer schema, corrupt file, unknown conversation or span)."""


class Profile(BaseModel):
    """Who the user is, as the page or the command line tells us.

    ``timezone`` is an IANA name ("Europe/London"); ``lat``/``lon`` are degrees (WGS84); ``notes`` is free text
    the user wants the agent to know (the page's "Knowledge" field); ``persona`` is the agent's persona line.
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
    """One conversation row: who, when, which checkpoint, and its settings (any JSON object)."""

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
    ("late" | "no_span" | "error"), ``latency_s`` from asking to having the reference."""

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
    """A remembered fact about a user: ``key`` ("name", "city", ...), ``value``, where it came from."""

    key: str
    value: str
    source: str = "user"
    t: float


_FACT_TRIGGERS: list[tuple[str, re.Pattern[str]]] = [
    ("name", re.compile(r"\b(?:my name is|my name's|call me|i am called|i'm called)\s+(.*)", re.I)),
    (
        "city",
        re.compile(
            r"\b(?:i live in|i'm living in|i am living in|i'm based in|i am based in|i'm from|i am from)\s+(.*)", re.I
        ),
    ),
]
# words that end a name or a place in running speech ("my name is ada and ...", "i live in leeds now")
_FACT_STOP = frozenset(
    [
        "and",
        "but",
        "so",
        "because",
        "which",
        "who",
        "i",
        "i'm",
        "im",
        "me",
        "my",
        "you",
        "we",
        "they",
        "he",
        "she",
        "it",
        "is",
        "was",
        "am",
        "are",
        "now",
        "today",
        "currently",
        "right",
        "with",
        "near",
        "at",
        "for",
        "since",
        "by",
        "to",
        "of",
        "the",
        "a",
        "an",
        "um",
        "uh",
        "er",
        "like",
        "actually",
        "though",
        "too",
        "also",
    ]
)
_FACT_LABELS = {"name": "the user's name is", "city": "the user lives in"}


def extract_facts(text: str) -> dict[str, str]:
    """Facts stated in one user turn: ``{"name": "Ada Lovelace", "city": "Leeds"}`` (title-cased, may be empty).

    Only explicit first-person statements count ("my name is ...", "call me ...", "I live in ...", "I'm from
    ..."): the value is at most three words after the trigger, ending at punctuation or at a function word
    ("and", "now", "i" ...). Source: the regex facts of the original Context DB (mindlogic-ai/Context-Spanning
    ``duetaspan/runtime/backend/context_db.py``), narrowed so that "I'm in a meeting" is not a place.
    """
    found: dict[str, str] = {}
    for key, pattern in _FACT_TRIGGERS:
        m = pattern.search(text)
        if not m:
            continue
        clause = re.split(r"[,.;:!?\"()]", m.group(1), maxsplit=1)[0]
        words: list[str] = []
        for word in clause.split():
            if word.lower() in _FACT_STOP or not re.fullmatch(r"[^\W\d_][\w'\-]*", word):
                if words or word.lower() not in ("the",):
                    break
                continue
            words.append(word[:1].upper() + word[1:])
            if len(words) == 3:
                break
        if words:
            found[key] = " ".join(words)
    return found


def fact_sentence(key: str, value: str) -> str:
    """A fact as a short sentence for retrieval and prompts ("the user's name is Ada")."""
    label = _FACT_LABELS.get(key, f"the user's {key.replace('_', ' ')} is")
    return f"{label} {value}"


def _norm(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9']+", text.lower()))


class ContextDB:
    """SQLite-backed Context DB (see the module docstring for what it stores and how to use it from async code).

    Args:
        path: a database file (created with its parent folder if missing) or ``":memory:"``.
        busy_timeout_s: how long a writer waits for another connection's write lock, in seconds.

    Raises:
        ContextDBError: the file was written by a newer schema, or is not a Context DB / not SQLite.
    """

    def __init__(self, path: str | Path = ":memory:", *, busy_timeout_s: float = 10.0) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).expanduser().parent.mkdir(parents=True, exist_ok=True)
            self.path = str(Path(self.path).expanduser())
        self._lock = threading.RLock()
        try:
            self._conn = sqlite3.connect(
                self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            self._conn.row_factory = sqlite3.Row
            self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            self.journal_mode = str(self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]).lower()
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._conn.execute("PRAGMA foreign_keys = ON")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise ContextDBError(
                f"cannot open Context DB {self.path!r}: {exc}. Fix: point --context-db at a Context DB file "
                "or a new path."
            ) from exc

    # ------------------------------------------------------------------ plumbing

    def _migrate(self) -> None:
        with self._tx() as c:
            c.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = c.execute("SELECT version FROM schema_version").fetchone()
            current = int(row[0]) if row else 0
            if current > SCHEMA_VERSION:
                raise ContextDBError(
                    f"Context DB {self.path!r} has schema version {current}, newer than this cspan-backends "
                    f"({SCHEMA_VERSION}). Fix: upgrade cspan-backends or use another --context-db file."
                )
            for version in range(current + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[version].split(";"):
                    if statement.strip():
                        c.execute(statement)
            if row is None:
                c.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            elif current != SCHEMA_VERSION:
                c.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction under the instance lock (BEGIN IMMEDIATE takes the file's write lock up front)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def schema_version(self) -> int:
        """The schema version stored in the file (equals :data:`SCHEMA_VERSION` once opened)."""
        return int(self._read("SELECT version FROM schema_version")[0][0])

    def close(self) -> None:
        """Close the connection (checkpointing the WAL into the main file)."""
        with self._lock:
            self._conn.close()

    def __enter__(self) -> ContextDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ profiles and facts

    def put_profile(self, profile: Profile) -> None:
        """Insert or replace ``profile`` (keyed by ``user_id``); its name and city also become facts."""
        now = time.time()
        with self._tx() as c:
            c.execute(
                "INSERT INTO profiles (user_id, name, city, timezone, lat, lon, notes, persona, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(user_id) DO UPDATE SET name=excluded.name, "
                "city=excluded.city, timezone=excluded.timezone, lat=excluded.lat, lon=excluded.lon, "
                "notes=excluded.notes, persona=excluded.persona, updated_at=excluded.updated_at",
                (
                    profile.user_id,
                    profile.name,
                    profile.city,
                    profile.timezone,
                    profile.lat,
                    profile.lon,
                    profile.notes,
                    profile.persona,
                    now,
                ),
            )
            for key, value in (("name", profile.name), ("city", profile.city)):
                if value:
                    self._upsert_fact(c, profile.user_id, key, value, "profile", now)

    def get_profile(self, user_id: str = "default") -> Profile | None:
        """The stored profile of ``user_id``, or None."""
        rows = self._read("SELECT * FROM profiles WHERE user_id = ?", (user_id,))
        if not rows:
            return None
        r = rows[0]
        return Profile(
            user_id=r["user_id"],
            name=r["name"],
            city=r["city"],
            timezone=r["timezone"],
            lat=r["lat"],
            lon=r["lon"],
            notes=r["notes"],
            persona=r["persona"],
        )

    @staticmethod
    def _upsert_fact(c: sqlite3.Connection, user_id: str, key: str, value: str, source: str, t: float) -> None:
        c.execute(
            "INSERT INTO facts (user_id, key, value, source, t) VALUES (?, ?, ?, ?, ?) ON CONFLICT(user_id, key) "
            "DO UPDATE SET value=excluded.value, source=excluded.source, t=excluded.t",
            (user_id, key, value, source, t),
        )

    def set_fact(self, user_id: str, key: str, value: str, *, source: str = "user") -> None:
        """Remember ``key = value`` for ``user_id`` (replacing an older value of the same key)."""
        with self._tx() as c:
            self._upsert_fact(c, user_id, key, value, source, time.time())

    def facts(self, user_id: str = "default") -> list[Fact]:
        """All facts of ``user_id``, oldest first."""
        rows = self._read("SELECT key, value, source, t FROM facts WHERE user_id = ? ORDER BY t, rowid", (user_id,))
        return [Fact(key=r["key"], value=r["value"], source=r["source"], t=r["t"]) for r in rows]

    # ------------------------------------------------------------------ conversations and turns

    def start_conversation(
        self,
        user_id: str = "default",
        *,
        conversation_id: str | None = None,
        checkpoint: str = "",
        settings: dict[str, Any] | None = None,
        started_at: float | None = None,
    ) -> str:
        """Create a conversation and return its id (a new uuid4 hex unless ``conversation_id`` is given).

        Starting an id that already exists is a no-op that returns the id, so a reconnecting client can resume.
        """
        cid = conversation_id or uuid.uuid4().hex
        with self._tx() as c:
            c.execute(
                "INSERT OR IGNORE INTO conversations (id, user_id, started_at, checkpoint, settings) "
                "VALUES (?, ?, ?, ?, ?)",
                (cid, user_id, started_at or time.time(), checkpoint, json.dumps(settings or {})),
            )
        return cid

    def end_conversation(self, conversation_id: str, *, ended_at: float | None = None) -> None:
        """Record when the conversation ended (epoch seconds, default now)."""
        with self._tx() as c:
            c.execute("UPDATE conversations SET ended_at = ? WHERE id = ?", (ended_at or time.time(), conversation_id))

    def get_conversation(self, conversation_id: str) -> Conversation | None:
        """The conversation row, or None."""
        rows = self._read("SELECT * FROM conversations WHERE id = ?", (conversation_id,))
        if not rows:
            return None
        r = rows[0]
        return Conversation(
            id=r["id"],
            user_id=r["user_id"],
            started_at=r["started_at"],
            ended_at=r["ended_at"],
            checkpoint=r["checkpoint"],
            settings=json.loads(r["settings"] or "{}"),
        )

    def conversations(self, user_id: str | None = None) -> list[Conversation]:
        """Conversations (of one user, or all), oldest first."""
        sql = "SELECT id FROM conversations" + (" WHERE user_id = ?" if user_id else "") + " ORDER BY started_at, id"
        ids = [r[0] for r in self._read(sql, (user_id,) if user_id else ())]
        return [c for c in (self.get_conversation(i) for i in ids) if c is not None]

    def add_turn(
        self,
        conversation_id: str,
        role: TurnRole,
        text: str,
        *,
        t: float | None = None,
        frame: int | None = None,
        meta: dict[str, Any] | None = None,
        dedupe: bool = False,
    ) -> int:
        """Append a turn and return its id.

        User turns also update the user's facts (:func:`extract_facts`). With ``dedupe``, a turn whose text equals
        (case and punctuation aside) the latest turn of the same role is not added again; that turn's id is
        returned instead.

        Raises:
            ContextDBError: the conversation does not exist (start it with :meth:`start_conversation`).
            ValueError: ``role`` is not user / agent / tool.
        """
        if role not in ("user", "agent", "tool"):
            raise ValueError(f"turn role must be 'user', 'agent' or 'tool', got {role!r}")
        now = time.time() if t is None else t
        with self._tx() as c:
            conv = c.execute("SELECT user_id FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
            if conv is None:
                raise ContextDBError(
                    f"conversation {conversation_id!r} is not in the Context DB {self.path!r}. "
                    "Fix: call start_conversation() first."
                )
            if dedupe:
                last = c.execute(
                    "SELECT id, text FROM turns WHERE conversation_id = ? AND role = ? ORDER BY id DESC LIMIT 1",
                    (conversation_id, role),
                ).fetchone()
                if last is not None and _norm(last["text"]) == _norm(text):
                    return int(last["id"])
            cur = c.execute(
                "INSERT INTO turns (conversation_id, role, text, t, frame, meta) VALUES (?, ?, ?, ?, ?, ?)",
                (conversation_id, role, text, now, frame, json.dumps(meta or {})),
            )
            if role == "user":
                for key, value in extract_facts(text).items():
                    self._upsert_fact(c, conv["user_id"], key, value, "user", now)
            return int(cur.lastrowid)

    def turns(self, conversation_id: str, *, last: int | None = None) -> list[Turn]:
        """The conversation's turns in order (only the ``last`` n when given)."""
        if last is None:
            rows = self._read("SELECT * FROM turns WHERE conversation_id = ? ORDER BY id", (conversation_id,))
        else:
            rows = self._read(
                "SELECT * FROM (SELECT * FROM turns WHERE conversation_id = ? ORDER BY id DESC LIMIT ?) ORDER BY id",
                (conversation_id, last),
            )
        return [
            Turn(
                id=r["id"],
                conversation_id=r["conversation_id"],
                role=r["role"],
                text=r["text"],
                t=r["t"],
                frame=r["frame"],
                meta=json.loads(r["meta"] or "{}"),
            )
            for r in rows
        ]

    def last_user_text(self, conversation_id: str) -> str:
        """Text of the latest user turn, or ""."""
        rows = self._read(
            "SELECT text FROM turns WHERE conversation_id = ? AND role = 'user' ORDER BY id DESC LIMIT 1",
            (conversation_id,),
        )
        return rows[0][0] if rows else ""

    # ------------------------------------------------------------------ spans

    def add_span(
        self,
        conversation_id: str,
        *,
        question: str,
        text: str | None,
        tool: str | None = None,
        arguments: dict[str, Any] | None = None,
        source: str = "none",
        asked_at: float | None = None,
        latency_s: float | None = None,
        error: str | None = None,
        dropped: DropReason | None = None,
    ) -> int:
        """Record one retrieval and return its id. ``text`` is the reference (None when there was none);
        ``dropped`` may be set at once (e.g. "no_span"), or later with :meth:`mark_span_dropped`.

        Raises:
            ContextDBError: the conversation does not exist.
        """
        with self._tx() as c:
            if c.execute("SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)).fetchone() is None:
                raise ContextDBError(
                    f"conversation {conversation_id!r} is not in the Context DB {self.path!r}. "
                    "Fix: call start_conversation() first."
                )
            cur = c.execute(
                "INSERT INTO spans (conversation_id, question, text, tool, arguments, source, asked_at, latency_s, "
                "error, dropped) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    conversation_id,
                    question,
                    text,
                    tool,
                    json.dumps(arguments or {}, ensure_ascii=False, default=str),
                    source,
                    asked_at if asked_at is not None else time.time(),
                    latency_s,
                    error,
                    dropped,
                ),
            )
            return int(cur.lastrowid)

    def mark_span_injected(self, span_id: int, *, injected_at: float | None = None, frame: int | None = None) -> None:
        """Record that span ``span_id`` was injected (epoch seconds, default now; ``frame`` at 12.5 Hz).

        Raises:
            ContextDBError: no such span.
        """
        self._update_span(span_id, "injected_at = ?, frame = ?, dropped = NULL", (injected_at or time.time(), frame))

    def mark_span_dropped(self, span_id: int, reason: DropReason, *, error: str | None = None) -> None:
        """Record that span ``span_id`` was not injected: "late" (past the deadline), "no_span" (nothing to
        say) or "error" (a backend failed; ``error`` says how).

        Raises:
            ContextDBError: no such span.
            ValueError: unknown reason.
        """
        if reason not in ("late", "no_span", "error"):
            raise ValueError(f"drop reason must be 'late', 'no_span' or 'error', got {reason!r}")
        if error is None:
            self._update_span(span_id, "dropped = ?, injected_at = NULL", (reason,))
        else:
            self._update_span(span_id, "dropped = ?, injected_at = NULL, error = ?", (reason, error))

    def _update_span(self, span_id: int, assignments: str, params: tuple[Any, ...]) -> None:
        with self._tx() as c:
            cur = c.execute(f"UPDATE spans SET {assignments} WHERE id = ?", (*params, span_id))
            if cur.rowcount == 0:
                raise ContextDBError(f"span {span_id} is not in the Context DB {self.path!r}")

    def spans(self, conversation_id: str, *, last: int | None = None) -> list[SpanRecord]:
        """The conversation's spans in order (only the ``last`` n when given)."""
        rows = self._read(
            "SELECT * FROM (SELECT * FROM spans WHERE conversation_id = ? ORDER BY id DESC LIMIT ?) ORDER BY id",
            (conversation_id, -1 if last is None else last),
        )
        return [
            SpanRecord(
                id=r["id"],
                conversation_id=r["conversation_id"],
                question=r["question"],
                text=r["text"],
                tool=r["tool"],
                arguments=json.loads(r["arguments"] or "{}"),
                source=r["source"],
                asked_at=r["asked_at"],
                injected_at=r["injected_at"],
                frame=r["frame"],
                dropped=r["dropped"],
                latency_s=r["latency_s"],
                error=r["error"],
            )
            for r in rows
        ]

    # ------------------------------------------------------------------ router view

    def profile_line(self, user_id: str, profile: Profile | None = None) -> str:
        """``profile: user=Ada, place=Leeds, timezone=Europe/London, the user's ... `` from the profile and facts."""
        profile = profile or self.get_profile(user_id) or Profile(user_id=user_id)
        parts: list[str] = []
        if profile.name:
            parts.append(f"user={profile.name}")
        if profile.place_label():
            parts.append(f"place={profile.place_label()}")
        if profile.timezone:
            parts.append(f"timezone={profile.timezone}")
        shown = {profile.name.lower(), profile.city.lower()}
        for fact in self.facts(user_id):
            if fact.value.lower() not in shown:
                parts.append(fact_sentence(fact.key, fact.value))
        if profile.notes:
            parts.append("notes=" + " ".join(profile.notes.split()))
        return "profile: " + ", ".join(parts) if parts else ""

    def working_text(
        self,
        conversation_id: str,
        *,
        max_chars: int = 1400,
        recent: int = 10,
        profile: Profile | None = None,
    ) -> str:
        """What the router reads about this conversation, at most ``max_chars`` characters.

        One ``profile: ...`` line (user, place, timezone, facts, notes) then the last ``recent`` turns as
        ``user: ...`` / ``agent: ...`` / ``tool: ...`` lines, oldest first. When over budget the oldest turns are
        dropped first; the profile line is kept (cut to the budget if it alone is too long). ``profile``
        overrides the stored profile (e.g. the page's live settings). Unknown conversations give the profile
        line only, or "".
        """
        conv = self.get_conversation(conversation_id)
        user_id = conv.user_id if conv else (profile.user_id if profile else "default")
        head = self.profile_line(user_id, profile)[:max_chars]
        lines = [f"{t.role}: {' '.join(t.text.split())}" for t in self.turns(conversation_id, last=recent)]
        budget = max_chars - (len(head) + 1 if head else 0)
        kept: list[str] = []
        for line in reversed(lines):
            if len(line) + 1 > budget:
                break
            kept.append(line)
            budget -= len(line) + 1
        body = list(reversed(kept))
        return "\n".join(([head] if head else []) + body)

    # ------------------------------------------------------------------ async wrappers (run in a worker thread)

    async def aput_profile(self, profile: Profile) -> None:
        """:meth:`put_profile` in a worker thread."""
        await asyncio.to_thread(self.put_profile, profile)

    async def aget_profile(self, user_id: str = "default") -> Profile | None:
        """:meth:`get_profile` in a worker thread."""
        return await asyncio.to_thread(self.get_profile, user_id)

    async def aset_fact(self, user_id: str, key: str, value: str, *, source: str = "user") -> None:
        """:meth:`set_fact` in a worker thread."""
        await asyncio.to_thread(self.set_fact, user_id, key, value, source=source)

    async def afacts(self, user_id: str = "default") -> list[Fact]:
        """:meth:`facts` in a worker thread."""
        return await asyncio.to_thread(self.facts, user_id)

    async def astart_conversation(self, user_id: str = "default", **kwargs: Any) -> str:
        """:meth:`start_conversation` in a worker thread."""
        return await asyncio.to_thread(self.start_conversation, user_id, **kwargs)

    async def aget_conversation(self, conversation_id: str) -> Conversation | None:
        """:meth:`get_conversation` in a worker thread."""
        return await asyncio.to_thread(self.get_conversation, conversation_id)

    async def aadd_turn(self, conversation_id: str, role: TurnRole, text: str, **kwargs: Any) -> int:
        """:meth:`add_turn` in a worker thread."""
        return await asyncio.to_thread(self.add_turn, conversation_id, role, text, **kwargs)

    async def aturns(self, conversation_id: str, *, last: int | None = None) -> list[Turn]:
        """:meth:`turns` in a worker thread."""
        return await asyncio.to_thread(self.turns, conversation_id, last=last)

    async def aadd_span(self, conversation_id: str, **kwargs: Any) -> int:
        """:meth:`add_span` in a worker thread."""
        return await asyncio.to_thread(self.add_span, conversation_id, **kwargs)

    async def amark_span_injected(self, span_id: int, **kwargs: Any) -> None:
        """:meth:`mark_span_injected` in a worker thread."""
        await asyncio.to_thread(self.mark_span_injected, span_id, **kwargs)

    async def amark_span_dropped(self, span_id: int, reason: DropReason, **kwargs: Any) -> None:
        """:meth:`mark_span_dropped` in a worker thread."""
        await asyncio.to_thread(self.mark_span_dropped, span_id, reason, **kwargs)

    async def aspans(self, conversation_id: str, *, last: int | None = None) -> list[SpanRecord]:
        """:meth:`spans` in a worker thread."""
        return await asyncio.to_thread(self.spans, conversation_id, last=last)

    async def aworking_text(self, conversation_id: str, **kwargs: Any) -> str:
        """:meth:`working_text` in a worker thread."""
        return await asyncio.to_thread(self.working_text, conversation_id, **kwargs)
