"""``UserMemory``: everything the Context DB holds about one principal, and no way to reach anyone else's rows.

Every statement here carries ``user_id = ?`` bound to the principal the memory was opened for
(:meth:`ContextDB.user`); ids that come from outside (a conversation id from a client, a span id from an event)
only ever select among this user's rows. A conversation id is unique per user: two users may both have a
conversation "c1", and they are different rows. Asking for another user's conversation or span behaves exactly as
asking for one that does not exist.

Erasure: :meth:`UserMemory.forget` (``cspan db forget``, from any process or replica) raises the user's generation
in ``erasures``. A memory takes the generation it sees at its first read or write; once the stored one differs, its
writes raise :class:`UserForgotten` and nothing is written, so a session that began before the erase cannot write
back what it held (``cspan serve`` then ends it). Every write checks the generation in its own transaction: SQLite
serialises writers (``BEGIN IMMEDIATE``); on PostgreSQL (read committed) a write takes a shared advisory lock on the
user without waiting (refused while an erase holds it) and ``forget`` an exclusive one, so no write that checked
before an erase commits after it. A memory belongs to one session: after an erase, open a new one
(``ContextDB.user(id)``); a memory made per call (the deprecated ``ContextDB`` methods) pins at each call and is
never refused.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import threading
import time
import unicodedata
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

from pydantic import ValidationError

from cspan.backends.context_db.facts import extract_facts, fact_sentence, normalised
from cspan.backends.context_db.models import (
    MAX_FACT_KEY_CHARS,
    MAX_FACT_VALUE_CHARS,
    MAX_TURN_CHARS,
    ContextDBError,
    Conversation,
    DropReason,
    Fact,
    Profile,
    SpanRecord,
    TokenRecord,
    Turn,
    TurnRole,
    UserForgotten,
    check_profile_fields,
    check_text,
)
from cspan.backends.context_db.schema import SCHEMA_VERSION
from cspan.backends.context_db.workers import run_in

if TYPE_CHECKING:
    from cspan.backends.context_db.connection import Connection, Transaction

MAX_ID_CHARS = 200
"""Longest accepted user or conversation id, in characters."""

PROFILE_FIELDS = ("name", "city", "timezone", "lat", "lon", "notes", "persona")
"""The stored fields of a :class:`Profile` (:meth:`UserMemory.merge_profile` changes any of them)."""

_ERASE_LOCK = 0x63737062  # PostgreSQL advisory lock class of one user's erase (with hashtext(user_id)): "cspb"


def check_id(value: object, what: str) -> str:
    """``value`` in Unicode NFC if it is a usable id (a non-empty string of at most :data:`MAX_ID_CHARS` printable
    characters, without spaces at either end: ``" ada"`` would be a user apart from ``"ada"`` that no one can tell
    from it; so would ``"jose\u0301"``, the decomposed ``"josé"``, which is why the id is composed).

    Raises:
        ValueError: naming ``what`` and the problem.
    """
    if isinstance(value, str) and value and value != value.strip():
        raise ValueError(f"{what} must not start or end with white space, got {value[:60]!r}")
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS or not value.isprintable():
        shown = repr(value)
        if len(shown) > 60:  # a long value is cut in the message, its length said
            shown = f"{shown[:57]}... ({len(value)} characters)" if isinstance(value, str) else shown[:57] + "..."
        raise ValueError(f"{what} must be 1 to {MAX_ID_CHARS} printable characters, got {shown}")
    return unicodedata.normalize("NFC", value)


def _profile(r: dict[str, Any]) -> Profile:
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


def _conversation(r: dict[str, Any]) -> Conversation:
    return Conversation(
        id=r["id"],
        user_id=r["user_id"],
        started_at=r["started_at"],
        ended_at=r["ended_at"],
        checkpoint=r["checkpoint"],
        settings=json.loads(r["settings"] or "{}"),
    )


def _turn(r: dict[str, Any]) -> Turn:
    return Turn(
        id=r["id"],
        conversation_id=r["conversation_id"],
        role=r["role"],
        text=r["text"],
        t=r["t"],
        frame=r["frame"],
        meta=json.loads(r["meta"] or "{}"),
    )


def _span(r: dict[str, Any]) -> SpanRecord:
    return SpanRecord(
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


def token_record(r: dict[str, Any]) -> TokenRecord:
    """A ``tokens`` row as a :class:`TokenRecord` (the hash is left out)."""
    return TokenRecord(
        id=r["id"],
        user_id=r["user_id"],
        scopes=[s for s in (r["scopes"] or "").split(",") if s],
        label=r["label"],
        created_at=r["created_at"],
        last_used_at=r["last_used_at"],
        revoked_at=r["revoked_at"],
    )


MAX_PROVISIONAL_SPANS = 64
"""Provisional span ids (:meth:`UserMemory.provisional_span_id`) one memory keeps, the oldest forgotten first (a
session has at most a few rows waiting for the database at once)."""


_PROVISIONAL_IDS = itertools.count(1)  # one sequence for the process: no two memories promise one id


@dataclass
class _ProvisionalSpan:
    """A span row promised under a provisional id: its row id once written, and the outcome marked before that."""

    row: int | None = None
    outcome: tuple[str, tuple[Any, ...]] | None = None  # the UPDATE's assignments and parameters


class UserMemory:
    """The Context DB as one user sees it: profile, facts, conversations, turns and spans of ``user_id`` only.

    Get one from :meth:`ContextDB.user` (with a :class:`~cspan.backends.identity.Principal` or a user id); it is a
    cheap view over the store's connection, so a server makes one per session. The ``a``-prefixed coroutines run the
    matching method in a worker thread of ``executor`` (:func:`~cspan.backends.context_db.workers.run_in`; None:
    asyncio's default executor, :func:`asyncio.to_thread`), which is how async code should call it.
    """

    def __init__(self, conn: Connection, user_id: str, *, executor: Executor | None = None) -> None:
        self._conn = conn
        self.user_id = check_id(user_id, "user id")
        self.executor = executor
        self._generation: int | None = None  # the erase generation this memory belongs to: set at first use
        self._pin_lock = threading.Lock()
        self._erase_key = hashlib.sha256(self.user_id.encode()).hexdigest()  # its key in erasures (not the id)
        self._provisional: collections.OrderedDict[int, _ProvisionalSpan] = collections.OrderedDict()
        self._provisional_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"UserMemory(user_id={self.user_id!r}, db={self._conn.where!r})"

    # ------------------------------------------------------------------ erase generation

    def _read_generation(self, tx: Transaction | None = None) -> int:
        """The stored erase generation (0: never forgotten), in ``tx`` or by a read of its own."""
        query, params = "SELECT generation FROM erasures WHERE user_hash = ?", (self._erase_key,)
        rows = tx.execute(query, params).rows if tx is not None else self._conn.read(query, params)
        return int(rows[0]["generation"]) if rows else 0

    def _pin(self, generation: int | None = None) -> int:
        """The generation of this memory: the first one seen (``generation``, else read now). The read runs
        outside ``_pin_lock``: a write holds a connection when it pins (SQLite's one, under its lock; one of
        PostgreSQL's pool), and a read waits for one (every connection may be held by writes waiting to pin)."""
        if self._generation is None:
            seen = self._read_generation() if generation is None else generation
            with self._pin_lock:
                if self._generation is None:
                    self._generation = seen
        return self._generation

    def _lock_user(self, tx: Transaction, *, exclusive: bool = False) -> None:
        """PostgreSQL: the user's erase lock for this transaction, exclusive for :meth:`forget` (it waits for the
        writes under way), shared for a write, which does not wait: an erase holding it means the write would be
        refused anyway, and a blocked write would hold up its session (and a database thread) for the erase's length.
        SQLite serialises writers already (``BEGIN IMMEDIATE``)."""
        if tx.dialect != "postgresql":
            return
        if exclusive:
            tx.execute("SELECT pg_advisory_xact_lock(?::integer, hashtext(?))", (_ERASE_LOCK, self.user_id))
            return
        rows = tx.execute(
            "SELECT pg_try_advisory_xact_lock_shared(?::integer, hashtext(?)) AS got", (_ERASE_LOCK, self.user_id)
        ).rows
        if not rows[0]["got"]:
            raise UserForgotten(
                f"user {self.user_id!r} is being forgotten (cspan db forget); nothing was written to the Context DB "
                f"{self._conn.where!r}. Fix: start a new session."
            )

    def _guard(self, tx: Transaction) -> None:
        """Start of every write: refuse it (:class:`UserForgotten`) when the user was forgotten since this memory's
        first use, or is being forgotten now (PostgreSQL: the shared lock it holds until the transaction ends
        keeps an erase waiting until this write is done)."""
        self._lock_user(tx)
        stored = self._read_generation(tx)
        if self._pin(stored) != stored:
            raise UserForgotten(
                f"user {self.user_id!r} was forgotten (cspan db forget) after this memory was opened; nothing was "
                f"written to the Context DB {self._conn.where!r}. Fix: start a new session."
            )

    @contextlib.contextmanager
    def _write(self) -> Iterator[Transaction]:
        """A write transaction of this user's rows, refused by :meth:`_guard` before anything is written."""
        with self._conn.write() as tx:
            self._guard(tx)
            yield tx

    def was_forgotten(self) -> bool:
        """Whether this user was forgotten since this memory's first read or write (its writes are then refused);
        False for a memory not used yet."""
        if self._generation is None:
            return False
        return self._read_generation() != self._generation

    # ------------------------------------------------------------------ profile and facts

    def put_profile(self, profile: Profile) -> Profile:
        """Insert or replace this user's profile (every field: an empty one erases what was stored; to change some
        fields only, use :meth:`merge_profile`); its name and city also become facts. Returns the stored profile
        (``user_id`` is this memory's, whatever ``profile.user_id`` said).

        Raises:
            TypeError: ``profile`` is not a :class:`Profile` (to change some fields from a dict, use
                :meth:`merge_profile`).
            ValueError: a ``lat``/``lon`` out of range or not finite, or an unknown IANA ``timezone``
                (:func:`~cspan.backends.context_db.models.check_profile_fields`); nothing was written.
            UserForgotten: the user was forgotten since this memory's first use; nothing was written.
        """
        if not isinstance(profile, Profile):
            raise TypeError(
                f"put_profile() takes a Profile, got {type(profile).__name__}; build one with Profile(name=..., "
                "city=...), or change some fields with merge_profile({...})"
            )
        check_profile_fields(profile.model_dump())
        profile = profile.model_copy(update={"user_id": self.user_id})
        now = time.time()
        with self._write() as tx:
            self._store_profile(tx, profile, now)
            for key, value in (("name", profile.name), ("city", profile.city)):
                if value:
                    self._upsert_fact(tx, key, value, "profile", now)
        return profile

    def merge_profile(self, changes: Mapping[str, Any]) -> Profile:
        """Change only the given fields of this user's stored profile, in one transaction (read, overlay, write):
        a field not in ``changes`` keeps what is stored, whoever wrote it (a profile made by a session that could
        not read the stored one erases nothing). ``changes`` maps :data:`PROFILE_FIELDS` names to values (``""``
        empties a text field; ``lat``/``lon`` are degrees); a given name or city also becomes a fact. With no stored
        profile the fields not given are empty. Returns the stored profile.

        Values are validated and coerced as :class:`Profile` fields are (``"51.5"`` becomes ``51.5`` for ``lat``),
        then checked as :meth:`put_profile` checks them (only the fields given: a stored value is kept as it is).

        Raises:
            ValueError: a key of ``changes`` is not a profile field, or a value is not valid for its field (a
                ``lat``/``lon`` out of range or not finite, an unknown IANA ``timezone``; nothing was written).
            UserForgotten: the user was forgotten since this memory's first use; nothing was written.
        """
        unknown = sorted(set(changes) - set(PROFILE_FIELDS))
        if unknown:
            raise ValueError(f"not profile fields: {', '.join(unknown)}; known: {', '.join(PROFILE_FIELDS)}")
        try:
            checked = Profile.model_validate(dict(changes))
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            field = ".".join(str(part) for part in err.get("loc", ())) or "(changes)"
            shown = repr(err.get("input"))
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise ValueError(f"profile field {field!r}: {err.get('msg')} (got {shown}); nothing was written") from None
        changes = {key: getattr(checked, key) for key in changes}
        check_profile_fields(changes)
        now = time.time()
        with self._write() as tx:
            lock = ""  # SQLite: BEGIN IMMEDIATE serialises writers already
            if tx.dialect == "postgresql":
                # a row to lock even for a user without a profile yet (the merge stores one anyway): a second merge
                # of the same user (another session, another thread of the pool, a replica) waits for this one's
                # commit here, then overlays its changes on this one's instead of on an empty profile
                tx.execute(
                    "INSERT INTO profiles (user_id, updated_at) VALUES (?, ?) ON CONFLICT (user_id) DO NOTHING",
                    (self.user_id, now),
                )
                lock = " FOR UPDATE"
            rows = tx.execute(f"SELECT * FROM profiles WHERE user_id = ?{lock}", (self.user_id,)).rows
            stored = _profile(rows[0]) if rows else Profile(user_id=self.user_id)
            profile = stored.model_copy(update={**changes, "user_id": self.user_id})
            self._store_profile(tx, profile, now)
            for key, value in (("name", changes.get("name")), ("city", changes.get("city"))):
                if value:
                    self._upsert_fact(tx, key, value, "profile", now)
        return profile

    def _store_profile(self, tx: Transaction, profile: Profile, now: float) -> None:
        tx.execute(
            "INSERT INTO profiles (user_id, name, city, timezone, lat, lon, notes, persona, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (user_id) DO UPDATE SET name = excluded.name, "
            "city = excluded.city, timezone = excluded.timezone, lat = excluded.lat, lon = excluded.lon, "
            "notes = excluded.notes, persona = excluded.persona, updated_at = excluded.updated_at",
            (
                self.user_id,
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

    def get_profile(self) -> Profile | None:
        """This user's stored profile, or None."""
        self._pin()
        rows = self._conn.read("SELECT * FROM profiles WHERE user_id = ?", (self.user_id,))
        if not rows:
            return None
        return _profile(rows[0])

    def _upsert_fact(self, tx: Transaction, key: str, value: str, source: str, t: float) -> None:
        tx.execute(
            "INSERT INTO facts (user_id, key, value, source, t) VALUES (?, ?, ?, ?, ?) ON CONFLICT (user_id, key) "
            "DO UPDATE SET value = excluded.value, source = excluded.source, t = excluded.t",
            (self.user_id, key, value, source, t),
        )

    def set_fact(self, key: str, value: str, *, source: str = "user") -> None:
        """Remember ``key = value`` (replacing an older value of the same key).

        Raises:
            ValueError: ``key`` or ``value`` is not a string, is empty (or only spaces), or is longer than
                :data:`~cspan.backends.context_db.models.MAX_FACT_KEY_CHARS` /
                :data:`~cspan.backends.context_db.models.MAX_FACT_VALUE_CHARS` (the ``remember_fact`` tool's limits);
                nothing was written.
        """
        check_text("key", key, min_chars=1, max_chars=MAX_FACT_KEY_CHARS)
        check_text("value", value, min_chars=1, max_chars=MAX_FACT_VALUE_CHARS)
        check_text("source", source, min_chars=1, max_chars=MAX_FACT_KEY_CHARS)
        with self._write() as tx:
            self._upsert_fact(tx, key, value, source, time.time())

    def forget_fact(self, key: str) -> bool:
        """Forget one fact; True when there was one."""
        with self._write() as tx:
            return tx.execute("DELETE FROM facts WHERE user_id = ? AND key = ?", (self.user_id, key)).rowcount > 0

    def facts(self) -> list[Fact]:
        """All of this user's facts, oldest first."""
        self._pin()
        rows = self._conn.read(
            "SELECT key, value, source, t FROM facts WHERE user_id = ? ORDER BY t, id", (self.user_id,)
        )
        return [Fact(key=r["key"], value=r["value"], source=r["source"], t=r["t"]) for r in rows]

    # ------------------------------------------------------------------ conversations and turns

    def start_conversation(
        self,
        conversation_id: str | None = None,
        *,
        checkpoint: str = "",
        settings: dict[str, Any] | None = None,
        started_at: float | None = None,
    ) -> str:
        """Create a conversation of this user and return its id (a new uuid4 hex unless ``conversation_id`` is given).
        ``started_at``: when it started, epoch seconds (default now; a caller whose write may wait passes the time
        it queued the write).

        Starting an id this user already has returns the id, so a reconnecting client can resume; it changes only
        what the first start left empty (its checkpoint, its settings: a row made by a retrieval that reached the
        database before the session's own start gets them) and keeps the earlier of the two start times.

        Raises:
            ValueError: ``conversation_id`` is empty, too long or not printable.
        """
        cid = check_id(conversation_id, "conversation id") if conversation_id is not None else uuid.uuid4().hex
        with self._write() as tx:
            tx.execute(
                "INSERT INTO conversations (user_id, id, started_at, checkpoint, settings) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (user_id, id) DO UPDATE SET "
                "started_at = CASE WHEN excluded.started_at < conversations.started_at THEN excluded.started_at "
                "ELSE conversations.started_at END, "
                "checkpoint = CASE WHEN conversations.checkpoint = '' THEN excluded.checkpoint "
                "ELSE conversations.checkpoint END, "
                "settings = CASE WHEN conversations.settings = '{}' THEN excluded.settings "
                "ELSE conversations.settings END",
                (
                    self.user_id,
                    cid,
                    time.time() if started_at is None else started_at,
                    checkpoint,
                    json.dumps(settings or {}),
                ),
            )
        return cid

    def end_conversation(self, conversation_id: str, *, ended_at: float | None = None) -> bool:
        """Record when the conversation ended (``ended_at``: epoch seconds, default now; a caller whose write may wait
        passes the time it queued the write); False when this user has no such one.

        Raises:
            UserForgotten: the user was forgotten since this memory's first use; nothing was written.
        """
        with self._write() as tx:
            cur = tx.execute(
                "UPDATE conversations SET ended_at = ? WHERE user_id = ? AND id = ?",
                (time.time() if ended_at is None else ended_at, self.user_id, conversation_id),
            )
        return cur.rowcount > 0

    def get_conversation(self, conversation_id: str) -> Conversation | None:
        """This user's conversation ``conversation_id``, or None."""
        self._pin()
        rows = self._conn.read(
            "SELECT * FROM conversations WHERE user_id = ? AND id = ?", (self.user_id, conversation_id)
        )
        return _conversation(rows[0]) if rows else None

    def conversations(self) -> list[Conversation]:
        """This user's conversations, oldest first."""
        self._pin()
        rows = self._conn.read("SELECT * FROM conversations WHERE user_id = ? ORDER BY started_at, id", (self.user_id,))
        return [_conversation(r) for r in rows]

    def _require_conversation(self, tx: Transaction, conversation_id: str, *, lock: bool = False) -> None:
        """Refuse a write to a conversation this user does not have. With ``lock`` (PostgreSQL), the conversation's
        row stays locked until ``tx`` ends, so the writes that read its latest turn before they add one (a turn
        with ``dedupe``: the session's transcript and the retrieval's copy of the same utterance, on two threads of
        the pool) take turns instead of both missing the other's uncommitted row. ``FOR NO KEY UPDATE`` does not
        block the key-share lock a span's or another turn's foreign key takes."""
        suffix = " FOR NO KEY UPDATE" if lock and tx.dialect == "postgresql" else ""
        found = tx.execute(
            f"SELECT 1 AS found FROM conversations WHERE user_id = ? AND id = ?{suffix}",
            (self.user_id, conversation_id),
        ).rows
        if not found:
            raise ContextDBError(
                f"conversation {conversation_id!r} is not in the Context DB {self._conn.where!r} for this user. "
                "Fix: call start_conversation() first."
            )

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
        """Append a turn and return its id. ``t``: when it was said, epoch seconds (default now; a caller whose write
        may wait passes the time it queued the write); ``frame``: the 12.5 Hz frame of the conversation it ended at.

        User turns also update this user's facts (:func:`extract_facts`). With ``dedupe``, a turn that is another
        copy of the latest turn of the same role is not added again: its text equals that turn's (case and
        punctuation aside) and one of the two has no ``frame`` (a retrieval writes its question without one, the
        transcript's own turn with its frame: one utterance). Two turns with different frames are two utterances
        and both kept (a user who says "yes" twice). A copy returns the latest turn's id; if that turn had no frame
        it takes this one's ``frame`` (and ``t``, when given): the retrieval's copy written before the transcript's.

        Raises:
            ContextDBError: this user has no such conversation (start it with :meth:`start_conversation`).
            ValueError: ``role`` is not user / agent / tool, or ``text`` is not a string or is longer than
                :data:`~cspan.backends.context_db.models.MAX_TURN_CHARS` (nothing was written).
        """
        if role not in ("user", "agent", "tool"):
            raise ValueError(f"turn role must be 'user', 'agent' or 'tool', got {role!r}")
        check_text("text", text, max_chars=MAX_TURN_CHARS)
        now = time.time() if t is None else t
        with self._write() as tx:
            self._require_conversation(tx, conversation_id, lock=dedupe)
            if dedupe:
                last = tx.execute(
                    "SELECT id, text, frame, t FROM turns WHERE user_id = ? AND conversation_id = ? AND role = ? "
                    "ORDER BY id DESC LIMIT 1",
                    (self.user_id, conversation_id, role),
                ).rows
                if (
                    last
                    and normalised(last[0]["text"]) == normalised(text)
                    and (frame is None or last[0]["frame"] is None or frame == last[0]["frame"])
                ):
                    if frame is not None and last[0]["frame"] is None:
                        tx.execute(
                            "UPDATE turns SET frame = ?, t = ? WHERE user_id = ? AND id = ?",
                            (frame, now if t is not None else last[0]["t"], self.user_id, last[0]["id"]),
                        )
                    return int(last[0]["id"])
            rows = tx.execute(
                "INSERT INTO turns (user_id, conversation_id, role, text, t, frame, meta) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
                (self.user_id, conversation_id, role, text, now, frame, json.dumps(meta or {})),
            ).rows
            if role == "user":
                for key, value in extract_facts(text).items():
                    self._upsert_fact(tx, key, value, "user", now)
            return int(rows[0]["id"])

    def turns(self, conversation_id: str, *, last: int | None = None) -> list[Turn]:
        """The conversation's turns in order (only the ``last`` n when given); [] for a conversation not this user's."""
        self._pin()
        where = "WHERE user_id = ? AND conversation_id = ?"
        if last is None:
            rows = self._conn.read(f"SELECT * FROM turns {where} ORDER BY id", (self.user_id, conversation_id))
        else:
            rows = self._conn.read(
                f"SELECT * FROM (SELECT * FROM turns {where} ORDER BY id DESC LIMIT ?) AS recent ORDER BY id",
                (self.user_id, conversation_id, max(0, int(last))),
            )
        return [_turn(r) for r in rows]

    def last_user_text(self, conversation_id: str) -> str:
        """Text of the latest user turn of the conversation, or ""."""
        self._pin()
        rows = self._conn.read(
            "SELECT text FROM turns WHERE user_id = ? AND conversation_id = ? AND role = 'user' "
            "ORDER BY id DESC LIMIT 1",
            (self.user_id, conversation_id),
        )
        return rows[0]["text"] if rows else ""

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
        provisional_id: int | None = None,
    ) -> int:
        """Record one retrieval and return its id. ``text`` is the reference (None when there was none);
        ``dropped`` may be set at once (e.g. "no_span"), or later with :meth:`mark_span_dropped`.

        ``provisional_id``: the id of :meth:`provisional_span_id` this row was promised under (a row written late,
        after the database stalled): an outcome already marked under it is written to the row now, and later marks
        under it reach the row.

        Raises:
            ContextDBError: this user has no such conversation.
        """
        row = self._insert_span(
            conversation_id, question, text, tool, arguments, source, asked_at, latency_s, error, dropped
        )
        while provisional_id is not None:
            # the outcome marked before the row was written, then any marked while that one is written, in order;
            # the row's id is handed to later marks only once none is left to write, so that an older outcome never
            # overwrites a newer one (the lock is never held over the database: a mark must not wait for it)
            with self._provisional_lock:
                promised = self._provisional.get(provisional_id)
                if promised is None:
                    break
                outcome, promised.outcome = promised.outcome, None
                if outcome is None:
                    promised.row = row
                    break
            try:
                self._update_span(row, *outcome)
            except BaseException:  # later marks still reach the row (this one's failure is the caller's to see)
                with self._provisional_lock:
                    promised.row = row
                raise
        return row

    def provisional_span_id(self) -> int:
        """An id for a span row not written yet (negative, unique in this process): :meth:`add_span` with
        ``provisional_id`` writes the row, and :meth:`mark_span_injected` / :meth:`mark_span_dropped` take the id
        before and after that (an outcome marked first is kept and written with the row). A retriever hands it out
        for a row the database has not answered, so that the span's outcome is not lost. At most
        :data:`MAX_PROVISIONAL_SPANS` are kept (the oldest forgotten first)."""
        with self._provisional_lock:
            provisional = -next(_PROVISIONAL_IDS)
            self._provisional[provisional] = _ProvisionalSpan()
            while len(self._provisional) > MAX_PROVISIONAL_SPANS:
                self._provisional.popitem(last=False)
            return provisional

    def _insert_span(
        self,
        conversation_id: str,
        question: str,
        text: str | None,
        tool: str | None,
        arguments: dict[str, Any] | None,
        source: str,
        asked_at: float | None,
        latency_s: float | None,
        error: str | None,
        dropped: DropReason | None,
    ) -> int:
        with self._write() as tx:
            self._require_conversation(tx, conversation_id)
            rows = tx.execute(
                "INSERT INTO spans (user_id, conversation_id, question, text, tool, arguments, source, asked_at, "
                "latency_s, error, dropped) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
                (
                    self.user_id,
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
            ).rows
            return int(rows[0]["id"])

    def mark_span_injected(self, span_id: int, *, injected_at: float | None = None, frame: int | None = None) -> None:
        """Record that span ``span_id`` was injected: ``injected_at`` epoch seconds (default now; a caller whose write
        may wait passes the time it queued the write), ``frame`` at 12.5 Hz. A provisional id
        (:meth:`provisional_span_id`) of a row not written yet keeps the mark for the row.

        Raises:
            ContextDBError: this user has no such span.
        """
        self._update_span(
            span_id,
            "injected_at = ?, frame = ?, dropped = NULL",
            (time.time() if injected_at is None else injected_at, frame),
        )

    def mark_span_dropped(self, span_id: int, reason: DropReason, *, error: str | None = None) -> None:
        """Record that span ``span_id`` was not injected: "late" (past the deadline), "no_span" (nothing to
        say), "error" (a backend failed; ``error`` says how) or "cancelled" (its conversation ended before it was
        read; ``error`` says why). No time is recorded for a drop (the span's ``injected_at`` is cleared).

        Raises:
            ContextDBError: this user has no such span.
            ValueError: unknown reason.
        """
        if reason not in get_args(DropReason):
            raise ValueError(f"drop reason must be one of {', '.join(get_args(DropReason))}, got {reason!r}")
        if error is None:
            self._update_span(span_id, "dropped = ?, injected_at = NULL", (reason,))
        else:
            self._update_span(span_id, "dropped = ?, injected_at = NULL, error = ?", (reason, error))

    def _update_span(self, span_id: int, assignments: str, params: tuple[Any, ...]) -> None:
        if span_id < 0:  # a provisional id: the row's, or kept until the row is written
            with self._provisional_lock:
                promised = self._provisional.get(span_id)
                if promised is None:
                    raise ContextDBError(f"span {span_id} is not a provisional span id of this memory (or forgotten)")
                if promised.row is None:
                    promised.outcome = (assignments, params)
                    return
                span_id = promised.row
        with self._write() as tx:
            cur = tx.execute(
                f"UPDATE spans SET {assignments} WHERE user_id = ? AND id = ?", (*params, self.user_id, span_id)
            )
        if cur.rowcount == 0:
            raise ContextDBError(f"span {span_id} is not in the Context DB {self._conn.where!r} for this user")

    def spans(self, conversation_id: str, *, last: int | None = None) -> list[SpanRecord]:
        """The conversation's spans in order (only the ``last`` n when given)."""
        self._pin()
        where = "WHERE user_id = ? AND conversation_id = ?"
        if last is None:
            rows = self._conn.read(f"SELECT * FROM spans {where} ORDER BY id", (self.user_id, conversation_id))
        else:
            rows = self._conn.read(
                f"SELECT * FROM (SELECT * FROM spans {where} ORDER BY id DESC LIMIT ?) AS recent ORDER BY id",
                (self.user_id, conversation_id, max(0, int(last))),
            )
        return [_span(r) for r in rows]

    # ------------------------------------------------------------------ router view

    def profile_line(self, profile: Profile | None = None) -> str:
        """``profile: user=Ada, place=Leeds, timezone=Europe/London, the user's ...`` from the profile and facts."""
        profile = profile or self.get_profile() or Profile(user_id=self.user_id)
        parts: list[str] = []
        if profile.name:
            parts.append(f"user={profile.name}")
        if profile.place_label():
            parts.append(f"place={profile.place_label()}")
        if profile.timezone:
            parts.append(f"timezone={profile.timezone}")
        shown = {profile.name.lower(), profile.city.lower()}
        for fact in self.facts():
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
        head = self.profile_line(profile)[:max_chars]
        lines = [f"{t.role}: {' '.join(t.text.split())}" for t in self.turns(conversation_id, last=recent)]
        budget = max_chars - (len(head) + 1 if head else 0)
        kept: list[str] = []
        for line in reversed(lines):
            if len(line) + 1 > budget:
                break
            kept.append(line)
            budget -= len(line) + 1
        return "\n".join(([head] if head else []) + list(reversed(kept)))

    # ------------------------------------------------------------------ export and forget

    def export(self) -> dict[str, Any]:
        """Everything stored about this user as one JSON-serialisable object (``cspan db export USER``).

        Keys: ``user_id``, ``exported_at`` (epoch s), ``schema_version``, ``profile`` (or None), ``facts``,
        ``conversations`` (each with its ``turns`` and ``spans``) and ``tokens`` (issued tokens' ids, scopes,
        labels and times; never a token or its hash).
        """
        profile = self.get_profile()
        conversations = []
        for conv in self.conversations():
            item = conv.model_dump()
            item["turns"] = [t.model_dump() for t in self.turns(conv.id)]
            item["spans"] = [s.model_dump() for s in self.spans(conv.id)]
            conversations.append(item)
        tokens = self._conn.read("SELECT * FROM tokens WHERE user_id = ? ORDER BY created_at, id", (self.user_id,))
        return {
            "user_id": self.user_id,
            "exported_at": time.time(),
            "schema_version": SCHEMA_VERSION,
            "profile": profile.model_dump() if profile else None,
            "facts": [f.model_dump() for f in self.facts()],
            "conversations": conversations,
            "tokens": [token_record(r).model_dump() for r in tokens],
        }

    def forget(self) -> dict[str, int]:
        """Delete everything remembered about this user: profile, facts, conversations with their turns and spans.

        In the same transaction the user's erase generation goes up (``erasures``: the SHA-256 of the user id, the
        generation and when), so every other memory of this user opened before (a running session, on any replica)
        has its writes refused from now on; this memory goes on at the new generation (unless it was stale
        already). Issued tokens are kept (they are access, not memory; revoke them with ``cspan users revoke``).
        Returns the number of rows deleted per table.
        """
        counts: dict[str, int] = {}
        with self._conn.write() as tx:
            self._lock_user(tx, exclusive=True)
            before = self._read_generation(tx)
            tx.execute(
                "INSERT INTO erasures (user_hash, generation, erased_at) VALUES (?, ?, ?) ON CONFLICT (user_hash) "
                "DO UPDATE SET generation = excluded.generation, erased_at = excluded.erased_at",
                (self._erase_key, before + 1, time.time()),
            )
            for table in ("spans", "turns", "conversations", "facts", "profiles"):
                counts[table] = tx.execute(f"DELETE FROM {table} WHERE user_id = ?", (self.user_id,)).rowcount
        with self._pin_lock:
            if self._generation in (None, before):  # a memory already stale stays refused: it may hold old rows
                self._generation = before + 1
        self._conn.scrub()  # SQLite: no copy of the deleted rows left in the WAL
        return counts

    # ------------------------------------------------------------------ async wrappers (run on self.executor)

    async def aput_profile(self, profile: Profile) -> Profile:
        """:meth:`put_profile` in a worker thread."""
        return await run_in(self.executor, self.put_profile, profile)

    async def amerge_profile(self, changes: Mapping[str, Any]) -> Profile:
        """:meth:`merge_profile` in a worker thread."""
        return await run_in(self.executor, self.merge_profile, changes)

    async def aget_profile(self) -> Profile | None:
        """:meth:`get_profile` in a worker thread."""
        return await run_in(self.executor, self.get_profile)

    async def aset_fact(self, key: str, value: str, *, source: str = "user") -> None:
        """:meth:`set_fact` in a worker thread."""
        await run_in(self.executor, self.set_fact, key, value, source=source)

    async def afacts(self) -> list[Fact]:
        """:meth:`facts` in a worker thread."""
        return await run_in(self.executor, self.facts)

    async def astart_conversation(self, conversation_id: str | None = None, **kwargs: Any) -> str:
        """:meth:`start_conversation` in a worker thread."""
        return await run_in(self.executor, self.start_conversation, conversation_id, **kwargs)

    async def aend_conversation(self, conversation_id: str, **kwargs: Any) -> bool:
        """:meth:`end_conversation` in a worker thread."""
        return await run_in(self.executor, self.end_conversation, conversation_id, **kwargs)

    async def aget_conversation(self, conversation_id: str) -> Conversation | None:
        """:meth:`get_conversation` in a worker thread."""
        return await run_in(self.executor, self.get_conversation, conversation_id)

    async def aadd_turn(self, conversation_id: str, role: TurnRole, text: str, **kwargs: Any) -> int:
        """:meth:`add_turn` in a worker thread."""
        return await run_in(self.executor, self.add_turn, conversation_id, role, text, **kwargs)

    async def aturns(self, conversation_id: str, *, last: int | None = None) -> list[Turn]:
        """:meth:`turns` in a worker thread."""
        return await run_in(self.executor, self.turns, conversation_id, last=last)

    async def aadd_span(self, conversation_id: str, **kwargs: Any) -> int:
        """:meth:`add_span` in a worker thread."""
        return await run_in(self.executor, self.add_span, conversation_id, **kwargs)

    async def amark_span_injected(self, span_id: int, **kwargs: Any) -> None:
        """:meth:`mark_span_injected` in a worker thread."""
        await run_in(self.executor, self.mark_span_injected, span_id, **kwargs)

    async def amark_span_dropped(self, span_id: int, reason: DropReason, **kwargs: Any) -> None:
        """:meth:`mark_span_dropped` in a worker thread."""
        await run_in(self.executor, self.mark_span_dropped, span_id, reason, **kwargs)

    async def aspans(self, conversation_id: str, *, last: int | None = None) -> list[SpanRecord]:
        """:meth:`spans` in a worker thread."""
        return await run_in(self.executor, self.spans, conversation_id, last=last)

    async def aworking_text(self, conversation_id: str, **kwargs: Any) -> str:
        """:meth:`working_text` in a worker thread."""
        return await run_in(self.executor, self.working_text, conversation_id, **kwargs)

    async def awas_forgotten(self) -> bool:
        """:meth:`was_forgotten` in a worker thread."""
        return await run_in(self.executor, self.was_forgotten)
