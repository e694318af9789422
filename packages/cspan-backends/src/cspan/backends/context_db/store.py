"""``ContextDB``: the store (one database, its migrations, retention, issued tokens) and the door to each user's rows.

Reading and writing memory goes through :meth:`ContextDB.user`, which returns the :class:`UserMemory` of one
principal; nothing on the store itself returns another user's profile, facts, conversations, turns or spans.
What the store does itself is what an operator does: export or forget one user (``cspan db export|forget``),
apply the retention setting (:meth:`ContextDB.prune`), and keep the hashed per-user tokens (``cspan users``).
"""

from __future__ import annotations

import logging
import os
import re
import time
import unicodedata
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Protocol

from cspan.backends.context_db.connection import POOL_SIZE, Connection, connect, is_postgres_url, sqlite_file
from cspan.backends.context_db.legacy import LegacyMethods
from cspan.backends.context_db.models import ContextDBError, TokenRecord
from cspan.backends.context_db.schema import MIGRATIONS, SCHEMA_VERSION
from cspan.backends.context_db.user import MAX_ID_CHARS, UserMemory, check_id, token_record
from cspan.backends.context_db.workers import run_in

log = logging.getLogger(__name__)

DB_ENV = "CSPAN_DB"
"""Environment variable naming the Context DB when no target is given (a path, ``:memory:`` or a URL)."""

_MIGRATION_LOCK = 0x63737061  # PostgreSQL advisory lock key of the migration ("cspa")


class Owner(Protocol):
    """Whom rows belong to, as :meth:`ContextDB.user` takes it: anything with a ``user_id``, such as a
    :class:`~cspan.backends.identity.Principal` (identity builds on the Context DB, not the other way round)."""

    @property
    def user_id(self) -> str: ...


def default_db_path() -> Path:
    """Where the Context DB lives by default: ``context.sqlite`` in the platform's user data directory
    (``~/.local/share/cspan`` on Linux, ``~/Library/Application Support/cspan`` on macOS, ``%LOCALAPPDATA%\\cspan``
    on Windows; :func:`platformdirs.user_data_dir`)."""
    import platformdirs

    return Path(platformdirs.user_data_dir("cspan", appauthor=False)) / "context.sqlite"


def resolve_target(target: str | os.PathLike[str] | None) -> str:
    """The database a target names: ``None`` -> ``$CSPAN_DB``, else :func:`default_db_path`; paths expanded.

    Raises:
        ContextDBError: a URL of another database (``mysql://...``): it would otherwise become a folder named
            ``mysql:``; a path (or ``sqlite:///`` URL) that is a folder or ends with a slash.
    """
    if target is None:
        target = os.environ.get(DB_ENV) or default_db_path()
    text = str(target)
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", text)
    if scheme and not (is_postgres_url(text) or text.startswith("sqlite://")):
        # a URL of a database we do not speak, not a folder named "mysql:"
        raise ContextDBError(
            f"{re.sub(r'//[^@/]*@', '//', text)}: {scheme.group(1)!r} databases are not supported; the "
            "Context DB is SQLite (a file path, sqlite:///PATH or :memory:) or PostgreSQL (postgresql://...)"
        )
    file = sqlite_file(text)
    if file is not None and (Path(file).is_dir() or text.endswith(("/", os.sep))):
        # SQLite's own word for a folder is "unable to open database file"; "new/" would make a file named "new"
        what = "is a folder" if Path(file).is_dir() else "ends with a slash, naming a folder"
        raise ContextDBError(
            f"{file}: {what}; give the Context DB's file (e.g. {Path(file) / 'context.sqlite'}), ':memory:' or a URL"
        )
    return text if scheme or text == ":memory:" else str(Path(text).expanduser())


class ContextDB(LegacyMethods):
    """The Context DB: SQLite (default, a file in the platform's data directory) or PostgreSQL (for replicas).

    Args:
        target: a file path, ``":memory:"`` (throw-away), ``sqlite:///PATH``, or a PostgreSQL URL
            (``postgresql://user:password@host:5432/dbname``). ``None``: ``$CSPAN_DB``, else
            :func:`default_db_path`.
        busy_timeout_s: how long a SQLite writer waits for another connection's write lock, in seconds.
        retention_days: when set, rows older than this many days are removed at open and by :meth:`prune`
            (``None``: kept until forgotten).
        read_only: the caller only reads: a database at this release's schema is opened without a write (no
            migration transaction), so a PostgreSQL role with only ``SELECT`` can open it. Writes are not blocked;
            the database refuses them as its privileges say. An older schema is still migrated.
        executor: where the ``a``-methods run their statements, and those of the memories :meth:`user` makes from
            then on (:attr:`executor`; None: asyncio's default executor, :func:`asyncio.to_thread`).
        pool_size: PostgreSQL: the most connections open at once, one per statement or transaction running (the
            threads of ``executor`` run theirs at once; see :mod:`.connection`). SQLite has one connection.

    Raises:
        ContextDBError: the database was written by a newer schema, is not a Context DB / not SQLite, or the
            PostgreSQL server cannot be reached.
        ValueError: ``retention_days`` is not a positive finite number.

    Per-user data: ``db.user(principal)`` (:class:`UserMemory`). The methods that take a user or conversation id
    directly (``put_profile``, ``add_turn``, ...) are deprecated shims kept for older callers (see
    :class:`~cspan.backends.context_db.legacy.LegacyMethods`).
    """

    def __init__(
        self,
        target: str | os.PathLike[str] | None = None,
        *,
        busy_timeout_s: float = 10.0,
        retention_days: float | None = None,
        read_only: bool = False,
        executor: Executor | None = None,
        pool_size: int = POOL_SIZE,
    ) -> None:
        if retention_days is not None and not (0 < float(retention_days) < float("inf")):
            raise ValueError(f"retention_days must be a positive number of days, got {retention_days!r}")
        self.path = resolve_target(target)
        self.retention_days = None if retention_days is None else float(retention_days)
        self.read_only = read_only
        self.executor = executor  # a server owning a pool for its database calls may set it before any user()
        self._conn: Connection = connect(self.path, busy_timeout_s=busy_timeout_s, pool_size=pool_size)
        self.dialect = self._conn.dialect
        self.where = self._conn.where
        self.journal_mode = self._conn.journal_mode
        try:
            self._migrate()
        except ContextDBError:
            self._conn.close()
            raise
        except Exception as exc:
            self._conn.close()
            raise ContextDBError(
                f"cannot open Context DB {self.where!r}: {exc}. Fix: point --db at a Context DB or a new path."
            ) from exc
        if self.retention_days is not None:
            self.prune()

    # ------------------------------------------------------------------ plumbing

    def _migrate(self) -> None:
        # opened to read, a database at this schema already is not written: a role that may only read (`cspan db
        # export`, `cspan users list` with a read-only PostgreSQL role) opens it
        if self.read_only and self._stored_version() == SCHEMA_VERSION:
            return
        with self._conn.write() as tx:
            if self.dialect == "postgresql":
                tx.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
            tx.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            rows = tx.execute("SELECT version FROM schema_version").rows
            current = int(rows[0]["version"]) if rows else 0
            self._refuse_newer(current)
            for step in MIGRATIONS:
                if step.version > current:
                    step.apply(tx)
            if not rows:
                tx.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            elif current != SCHEMA_VERSION:
                tx.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
        if 0 < current < SCHEMA_VERSION:  # once: the next open finds this release's version
            log.warning(
                "Context DB %s: schema %d (an older release's) migrated to %d; a release older than this one no "
                "longer opens it (to go back, restore the backup taken before the upgrade)",
                self.where,
                current,
                SCHEMA_VERSION,
            )

    def _stored_version(self) -> int:
        """The schema version the database holds (0: none yet), read without writing.

        Raises:
            ContextDBError: it is newer than this release's.
        """
        if self.dialect == "postgresql":
            sql = "SELECT to_regclass('schema_version') IS NOT NULL AS found"
        else:
            sql = "SELECT COUNT(*) > 0 AS found FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
        if not self._conn.read(sql)[0]["found"]:
            return 0
        rows = self._conn.read("SELECT version FROM schema_version")
        current = int(rows[0]["version"]) if rows else 0
        self._refuse_newer(current)
        return current

    def _refuse_newer(self, current: int) -> None:
        if current > SCHEMA_VERSION:
            raise ContextDBError(
                f"Context DB {self.where!r} has schema version {current}, newer than this cspan-backends "
                f"({SCHEMA_VERSION}). Fix: upgrade cspan-backends, restore the backup taken before the database was "
                "upgraded, or use another --db."
            )

    def schema_version(self) -> int:
        """The schema version stored in the database (equals :data:`SCHEMA_VERSION` once opened)."""
        return int(self._conn.read("SELECT version FROM schema_version")[0]["version"])

    def close(self) -> None:
        """Close the connection (SQLite checkpoints the WAL into the main file; PostgreSQL's pool closes its idle
        connections now and each one in use when its statement ends)."""
        self._conn.close()

    def __enter__(self) -> ContextDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ContextDB({self.where!r})"

    # ------------------------------------------------------------------ per-user access

    def user(self, principal: Owner | str) -> UserMemory:
        """The memory of one principal (a :class:`~cspan.backends.identity.Principal` or its user id).

        Raises:
            ValueError: the user id is empty, too long or not printable, or ``principal`` is neither a string nor
                has a ``user_id`` (None, a number).
        """
        user_id = principal if isinstance(principal, str) else getattr(principal, "user_id", principal)
        return UserMemory(self._conn, user_id, executor=self.executor)

    def users(self) -> list[str]:
        """Ids of the users with anything stored (profile, facts, conversations or tokens), sorted."""
        rows = self._conn.read(
            "SELECT user_id FROM profiles UNION SELECT user_id FROM facts UNION SELECT user_id FROM conversations "
            "UNION SELECT user_id FROM tokens ORDER BY user_id"
        )
        return [r["user_id"] for r in rows]

    def export_user(self, user_id: str) -> dict[str, Any]:
        """Everything stored about ``user_id`` (see :meth:`UserMemory.export`)."""
        return self.user(user_id).export()

    def forget_user(self, user_id: str, *, tokens: bool = False) -> dict[str, int]:
        """Delete what is remembered about ``user_id`` (and its issued tokens with ``tokens``); rows per table."""
        user_id = check_id(user_id, "user id")
        counts = self.user(user_id).forget()
        if tokens:
            with self._conn.write() as tx:
                counts["tokens"] = tx.execute("DELETE FROM tokens WHERE user_id = ?", (user_id,)).rowcount
            self._conn.scrub()
        return counts

    def prune(self, older_than_days: float | None = None, *, now: float | None = None) -> dict[str, int]:
        """Apply retention: remove rows older than ``older_than_days`` (default: the ``retention_days`` setting).

        Removed: turns and spans older than the cutoff, conversations that ended (or, never ended, started) before
        it and have no turn left, facts and profiles last written before it. Issued tokens are not affected.
        Returns the number of rows deleted per table ({} when no retention applies).
        """
        days = self.retention_days if older_than_days is None else older_than_days
        if days is None:
            return {}
        if not (0 < float(days) < float("inf")):
            raise ValueError(f"retention must be a positive number of days, got {days!r}")
        cutoff = (time.time() if now is None else now) - float(days) * 86400.0
        counts: dict[str, int] = {}
        with self._conn.write() as tx:
            counts["spans"] = tx.execute("DELETE FROM spans WHERE asked_at < ?", (cutoff,)).rowcount
            counts["turns"] = tx.execute("DELETE FROM turns WHERE t < ?", (cutoff,)).rowcount
            counts["conversations"] = tx.execute(
                "DELETE FROM conversations WHERE COALESCE(ended_at, started_at) < ? AND NOT EXISTS "
                "(SELECT 1 FROM turns WHERE turns.user_id = conversations.user_id "
                "AND turns.conversation_id = conversations.id) AND NOT EXISTS "
                "(SELECT 1 FROM spans WHERE spans.user_id = conversations.user_id "
                "AND spans.conversation_id = conversations.id)",
                (cutoff,),
            ).rowcount
            counts["facts"] = tx.execute("DELETE FROM facts WHERE t < ?", (cutoff,)).rowcount
            counts["profiles"] = tx.execute("DELETE FROM profiles WHERE updated_at < ?", (cutoff,)).rowcount
        if any(counts.values()):
            self._conn.scrub()  # SQLite: no copy of the deleted rows left in the WAL
        return counts

    async def aprune(self, older_than_days: float | None = None) -> dict[str, int]:
        """:meth:`prune` in a worker thread of :attr:`executor` (a server calls it periodically)."""
        return await run_in(self.executor, self.prune, older_than_days)

    # ------------------------------------------------------------------ issued tokens (stored hashed)

    def add_token(
        self, token_id: str, user_id: str, token_hash: str, *, scopes: list[str], label: str = ""
    ) -> TokenRecord:
        """Store an issued token's id and hash (use :func:`cspan.backends.identity.issue_token`, which makes both).

        Raises:
            ContextDBError: ``token_id`` exists already.
            ValueError: an unusable user id, or a label that is not printable (a newline or a terminal escape would
                reach the operator's terminal through ``cspan users list``) or longer than :data:`MAX_ID_CHARS`.
        """
        user_id = check_id(user_id, "user id")
        if len(label) > MAX_ID_CHARS or not label.isprintable():
            shown = repr(label)
            if len(shown) > 60:  # cut as check_id cuts an id
                shown = f"{shown[:57]}... ({len(label)} characters)"
            raise ValueError(
                f"label must be at most {MAX_ID_CHARS} printable characters (no control characters), got {shown}"
            )
        now = time.time()
        with self._conn.write() as tx:
            if tx.execute("SELECT 1 AS found FROM tokens WHERE id = ?", (token_id,)).rows:
                raise ContextDBError(f"token id {token_id!r} exists already")
            tx.execute(
                "INSERT INTO tokens (id, user_id, hash, scopes, label, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                (token_id, user_id, token_hash, ",".join(scopes), label, now),
            )
        return TokenRecord(id=token_id, user_id=user_id, scopes=list(scopes), label=label, created_at=now)

    def token_hash(self, token_id: str) -> tuple[TokenRecord, str] | None:
        """The valid (not revoked) token ``token_id`` and its stored hash, or None."""
        rows = self._conn.read("SELECT * FROM tokens WHERE id = ? AND revoked_at IS NULL", (token_id,))
        return (token_record(rows[0]), rows[0]["hash"]) if rows else None

    def touch_token(self, token_id: str) -> None:
        """Record that ``token_id`` was just used (``last_used_at``)."""
        with self._conn.write() as tx:
            tx.execute("UPDATE tokens SET last_used_at = ? WHERE id = ?", (time.time(), token_id))

    def tokens(self, user_id: str | None = None, *, revoked: bool = False) -> list[TokenRecord]:
        """Issued tokens (of one user, or all), oldest first; revoked ones too with ``revoked``."""
        sql = "SELECT * FROM tokens WHERE 1 = 1"
        params: tuple[Any, ...] = ()
        if user_id is not None:
            sql += " AND user_id = ?"
            params = (user_id,)
        if not revoked:
            sql += " AND revoked_at IS NULL"
        return [token_record(r) for r in self._conn.read(sql + " ORDER BY created_at, id", params)]

    def revoke_tokens(self, *, token_id: str | None = None, user_id: str | None = None) -> int:
        """Revoke one token (by id) or every token of a user; returns how many were revoked."""
        if (token_id is None) == (user_id is None):
            raise ValueError("revoke_tokens needs exactly one of token_id= or user_id=")
        column, value = ("id", token_id) if token_id is not None else ("user_id", unicodedata.normalize("NFC", user_id))
        with self._conn.write() as tx:
            return tx.execute(
                f"UPDATE tokens SET revoked_at = ? WHERE {column} = ? AND revoked_at IS NULL", (time.time(), value)
            ).rowcount
