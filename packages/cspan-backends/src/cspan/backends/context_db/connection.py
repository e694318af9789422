"""The database connections of the Context DB: SQLite (a file or ``:memory:``) or PostgreSQL (psycopg 3).

Both expose the same small surface: :meth:`Connection.read` (one statement, rows as dicts) and
:meth:`Connection.write` (a transaction whose :meth:`Transaction.execute` returns rows and the row count). SQL is
written once with ``?`` parameters (see :mod:`.schema`); the PostgreSQL side turns them into ``%s``.

Concurrency: one instance may be used from many threads (the ``a``-methods of the Context DB run in worker threads).
SQLite has one connection, which runs one statement at a time under a lock; its WAL lets other processes read
during a write, and ``busy_timeout`` makes writers wait their turn (``BEGIN IMMEDIATE`` takes the write lock up
front). PostgreSQL has a small pool (:data:`POOL_SIZE` connections, opened as needed, kept while they work): each
statement or transaction takes a connection of its own, so threads run theirs at once and a slow one (a big export
or erase, a lock wait, a slow disk) holds up only its own thread. A thread inside :meth:`Connection.write` reads
and writes on that transaction's connection (a read there sees the transaction's uncommitted rows; a write there is
a savepoint), so a thread never holds two connections. A connection that broke (server restart, network) is
closed when its statement ends and another is opened at the next statement; one the server ended while it was idle
is replaced before a statement, so a restart costs no statement. Several instances or processes may share one
database: SQLite serialises their writers, PostgreSQL is built for it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import selectors
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cspan.backends.context_db.models import ContextDBError
from cspan.backends.context_db.schema import Dialect
from cspan.backends.urls import redact_url

log = logging.getLogger(__name__)


@dataclass
class Result:
    """What one statement gave: its rows (dicts, for statements that return rows) and the affected row count."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    rowcount: int = 0


class Transaction:
    """A write transaction handed out by :meth:`Connection.write`."""

    def __init__(self, run: Any, dialect: Dialect) -> None:
        self._run = run
        self.dialect: Dialect = dialect

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> Result:
        """Run one statement inside the transaction."""
        return self._run(sql, params)


class Connection(ABC):
    """Base of the two engines; :func:`connect` picks one from the target."""

    dialect: Dialect
    where: str
    """The database in words, for messages (a PostgreSQL URL without its password)."""
    journal_mode: str = ""

    @abstractmethod
    def read(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        """The rows of one read-only statement, as dicts."""

    @abstractmethod
    def write(self) -> Any:
        """A context manager around one write transaction (:class:`Transaction`)."""

    @abstractmethod
    def close(self) -> None:
        """Close the connection(s)."""

    def scrub(self) -> bool:
        """After deleting rows that must not outlive their deletion (``forget``, retention): make sure no copy of
        them stays in a file beside the database. Nothing to do here (PostgreSQL keeps dead rows until ``VACUUM``,
        an operator's job); :class:`SQLiteConnection` empties its WAL. Returns whether that was done."""
        return True


class SQLiteConnection(Connection):
    """SQLite in WAL mode, ``synchronous=NORMAL`` (a power cut may lose the last commits, never corrupt the file),
    foreign keys on. A new file is private to its owner (mode 0600; SQLite gives its ``-wal`` and ``-shm`` files the
    same), in a folder made 0700 when it is created here: it holds what users said and their tokens' hashes."""

    dialect: Dialect = "sqlite"

    def __init__(self, path: str, *, busy_timeout_s: float) -> None:
        self.where = path
        if path != ":memory:":
            try:
                folder = Path(path).parent
                if not folder.exists():
                    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except OSError as exc:
                raise ContextDBError(
                    f"cannot create Context DB {path!r}: {exc.strerror or exc}. Fix: point --db at a writable path."
                ) from exc
        self._lock = threading.RLock()
        try:
            self._conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
            self._conn.row_factory = _dict_row
            self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            self.journal_mode = str(next(iter(self._conn.execute("PRAGMA journal_mode = WAL").fetchone().values())))
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._conn.execute("PRAGMA foreign_keys = ON")
            # deleted rows are overwritten with zeros, not left in free pages (many builds default to off)
            self._conn.execute("PRAGMA secure_delete = ON")
        except sqlite3.DatabaseError as exc:
            raise ContextDBError(
                f"cannot open Context DB {path!r}: {exc}. Fix: point --db at a Context DB file or a new path."
            ) from exc
        self.journal_mode = self.journal_mode.lower()

    def _failed(self, exc: sqlite3.Error) -> ContextDBError:
        """The error a failed statement becomes, with the fix where the cause has one (a file this process may not
        write, a write lock held past the busy timeout, a damaged file, a full disk)."""
        name = getattr(exc, "sqlite_errorname", "")
        fix = next((text for prefix, text in _SQLITE_FIXES.items() if name.startswith(prefix)), "")
        return ContextDBError(f"the Context DB at {self.where} failed: {exc}" + (f". Fix: {fix}" if fix else ""))

    def _run(self, sql: str, params: tuple[Any, ...]) -> Result:
        cur = self._conn.execute(sql, params)
        rows = cur.fetchall() if cur.description else []
        return Result(rows, cur.rowcount)

    def read(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with self._lock:
            try:
                return self._run(sql, params).rows
            except sqlite3.Error as exc:
                raise self._failed(exc) from exc

    @contextmanager
    def write(self) -> Iterator[Transaction]:
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield Transaction(self._run, self.dialect)
                    self._conn.execute("COMMIT")
                except BaseException:
                    if self._conn.in_transaction:  # SQLite itself rolls back after some errors (a full disk)
                        self._conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise self._failed(exc) from exc

    def scrub(self) -> bool:
        """Copy the WAL into the database and truncate it to zero bytes (``wal_checkpoint(TRUNCATE)``): a deleted
        row's text otherwise stays in the WAL's older frames (a file of the same owner, kept while any process has
        the database open) until they happen to be overwritten. False (with a warning) when another process was
        reading past the busy timeout, so the WAL could not be emptied now; SQLite empties it at its next
        checkpoint that finds no reader."""
        if self.journal_mode != "wal":
            return True
        with self._lock:
            try:
                row = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            except sqlite3.Error as exc:
                log.warning("the Context DB at %s: cannot empty its WAL after a deletion: %s", self.where, exc)
                return False
        busy = next(iter(row.values())) if row else 0
        if busy:
            log.warning(
                "the Context DB at %s: another process was reading, so the WAL still holds deleted rows until the "
                "next checkpoint",
                self.where,
            )
        return not busy

    def close(self) -> None:
        with self._lock:
            self._conn.close()


_SQLITE_FIXES = {
    "SQLITE_READONLY": "--db needs a file, and a folder for its -wal and -shm journals, that this user may write",
    "SQLITE_BUSY": "another process held the database's write lock past the busy timeout; try again",
    "SQLITE_CORRUPT": "the file is damaged: restore it from a backup, or point --db at a new path",
    "SQLITE_NOTADB": "the file is damaged: restore it from a backup, or point --db at a new path",
    "SQLITE_FULL": "free space on the file system that holds --db",
}
"""What to do about a failed SQLite statement, by the prefix of its (extended) result code's name."""


def _dict_row(cursor: sqlite3.Cursor, row: tuple[Any, ...]) -> dict[str, Any]:
    return {col[0]: value for col, value in zip(cursor.description, row, strict=True)}


_PARAM = re.compile(r"\?")


POOL_SIZE = 6
"""Most PostgreSQL connections one Context DB opens: the 4 database threads of ``cspan serve``
(:data:`cspan.server.db_calls.DB_THREADS`) each with one, and 2 for what runs beside them (the opening thread, a
caller's own threads). A statement that finds all of them busy waits for one (at most ``pool_wait_s``)."""
POOL_WAIT_S = 30.0
"""How long a statement waits for a free PostgreSQL connection when all :data:`POOL_SIZE` are busy, in seconds."""


class PostgresConnection(Connection):
    """PostgreSQL through psycopg 3: a pool of at most ``pool_size`` connections (autocommit for reads, one
    transaction per write; see the module docstring).

    Args:
        url: the ``postgresql://`` URL.
        connect_timeout_s: how long opening one connection may take, in seconds.
        pool_size: the most connections open at once (one per statement or transaction running).
        pool_wait_s: how long a statement waits for a connection when all are busy; then a ContextDBError.

    Raises:
        ContextDBError: psycopg is missing, the URL cannot be read, or the first connection cannot be opened.
    """

    dialect: Dialect = "postgresql"

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float,
        pool_size: int = POOL_SIZE,
        pool_wait_s: float = POOL_WAIT_S,
    ) -> None:
        if pool_size < 1:
            raise ValueError(f"pool_size must be at least 1, got {pool_size!r}")
        try:
            import psycopg  # noqa: F401
        except ImportError as exc:
            raise ContextDBError(
                f"the Context DB at {redact_url(url)} needs psycopg 3: pip install 'psycopg[binary]' ({exc})"
            ) from exc
        self.url = url
        self.where = redact_url(url)
        self._secrets = _url_secrets(url, self.where)
        self.connect_timeout_s = connect_timeout_s
        self.pool_size = pool_size
        self.pool_wait_s = pool_wait_s
        self.journal_mode = "postgresql"
        self._lock = threading.Lock()  # guards _idle and _closed (never held over I/O)
        self._slots = threading.BoundedSemaphore(pool_size)  # one per connection in use or being opened
        self._idle: list[Any] = []  # open connections not in use, the most recently used last
        self._closed = False
        self._local = threading.local()  # .conn: the connection of this thread's open write transaction
        self._idle.append(self._open())  # the first one now: an unreachable server fails here, with its reason

    def _open(self) -> Any:
        """A new connection, configured for the Context DB."""
        import psycopg
        from psycopg.rows import dict_row

        try:
            conn = psycopg.connect(
                self.url,
                autocommit=True,
                row_factory=dict_row,
                connect_timeout=max(1, round(self.connect_timeout_s)),
                application_name="cspan-context-db",
            )
            # read committed whatever the database's default: a write's erase check must see an erase that
            # committed while it waited (a snapshot taken at its first statement would not)
            conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        except psycopg.Error as exc:
            raise ContextDBError(
                f"cannot connect to the Context DB at {self.where}: {self._describe(exc)}. Fix: check that the "
                "server is running and the URL (host, port, database, user, password) in --db."
            ) from exc
        return conn

    def _take(self) -> Any:
        """An idle connection that still works, else a new one (the caller holds a slot)."""
        while True:
            with self._lock:
                if self._closed:
                    raise ContextDBError(f"the Context DB at {self.where} was closed")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._open()
            if not conn.closed and not conn.broken and not _ended_while_idle(conn):
                return conn
            conn.close()  # the server ended it between statements (a restart): open another, not fail once

    def _give(self, conn: Any) -> None:
        """Back to the idle ones after a statement or transaction; closed instead when it broke (the next statement
        opens another), is not idle (a transaction left open), or the pool was closed."""
        import psycopg

        with self._lock:
            if (
                not self._closed
                and not conn.closed
                and not conn.broken
                and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            ):
                self._idle.append(conn)
                return
        conn.close()

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        """A connection of the pool for one statement or transaction (waiting at most ``pool_wait_s`` for one)."""
        if not self._slots.acquire(timeout=self.pool_wait_s):
            raise ContextDBError(
                f"the Context DB at {self.where} failed: all {self.pool_size} connections stayed busy for "
                f"{self.pool_wait_s:g} s. Fix: check the server (statements that do not end: a frozen host, a lock "
                "held elsewhere; see pg_stat_activity)"
            )
        try:
            conn = self._take()
            try:
                yield conn
            finally:
                self._give(conn)
        finally:
            self._slots.release()

    def _describe(self, exc: Exception) -> str:
        """``exc`` in one line, without the password (libpq may quote the values of the URL it read)."""
        diag = getattr(exc, "diag", None)
        text = (getattr(diag, "message_primary", None) or str(exc)).strip()
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return " ".join(text.split())

    def _failed(self, exc: Exception) -> ContextDBError:
        """The error a failed statement becomes: a lost server, or what the server refused (a role without the
        privilege, a read-only database) with the fix."""
        import psycopg

        message = f"the Context DB at {self.where} failed: {self._describe(exc)}"
        if isinstance(exc, psycopg.errors.InsufficientPrivilege | psycopg.errors.ReadOnlySqlTransaction):
            message += (
                ". Fix: --db needs a role that may create, read and write the Context DB's tables (the database's "
                "owner, or one granted CREATE on its schema and SELECT, INSERT, UPDATE, DELETE on its tables)"
            )
        return ContextDBError(message)

    @staticmethod
    def _run(conn: Any, sql: str, params: tuple[Any, ...]) -> Result:
        cur = conn.execute(_PARAM.sub("%s", sql), params, prepare=False)
        rows = cur.fetchall() if cur.description else []
        return Result(rows, cur.rowcount)

    def read(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        import psycopg

        held = getattr(self._local, "conn", None)
        try:
            if held is not None:  # inside this thread's write: its transaction's connection, its uncommitted rows
                return self._run(held, sql, params).rows
            with self._connection() as conn:
                return self._run(conn, sql, params).rows
        except psycopg.Error as exc:
            raise self._failed(exc) from exc

    @contextmanager
    def write(self) -> Iterator[Transaction]:
        import psycopg

        held = getattr(self._local, "conn", None)
        if held is not None:  # a write inside this thread's write: a savepoint on the same connection
            try:
                with held.transaction():
                    yield Transaction(functools.partial(self._run, held), self.dialect)
            except psycopg.Error as exc:
                raise self._failed(exc) from exc
            return
        with self._connection() as conn:
            self._local.conn = conn
            try:
                with conn.transaction():
                    yield Transaction(functools.partial(self._run, conn), self.dialect)
            except psycopg.Error as exc:
                raise self._failed(exc) from exc
            finally:
                self._local.conn = None

    def close(self) -> None:
        """Close the idle connections now, and each one in use when its statement ends; statements after this
        raise ContextDBError."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _ended_while_idle(conn: Any) -> bool:
    """Whether the server ended ``conn`` while it was idle: an idle connection has nothing to read (no ``LISTEN``
    here), so a readable socket holds the server's goodbye (``terminating connection``) or its end of file. psycopg
    finds out only when the next statement fails; a restarted PostgreSQL would fail one statement per replica."""
    try:
        with selectors.DefaultSelector() as selector:  # not select.select: a server's descriptors pass 1024
            selector.register(conn.fileno(), selectors.EVENT_READ)
            return bool(selector.select(0))
    except (OSError, ValueError):
        return True


def _url_secrets(url: str, where: str) -> list[str]:
    """The passwords ``url`` holds, as libpq reads them, for :meth:`PostgresConnection._describe` to hide.

    Raises:
        ContextDBError: libpq cannot read ``url``, or reads it otherwise than it looks (a password with an unencoded
            ``@`` or ``/`` moves the host); the message quotes none of it but ``where`` (:func:`redact_url`).
    """
    from psycopg.conninfo import conninfo_to_dict

    fix = (
        "Fix: percent-encode the characters @ / : ? # % and space in the user and password (@ is %40, / is %2F, "
        "% is %25: python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=\"\"))' "
        "PASSWORD prints it), or leave the password out of the URL and set PGPASSWORD or a ~/.pgpass file."
    )
    try:
        params = conninfo_to_dict(url)
    except Exception as exc:  # psycopg.ProgrammingError quoting the part it could not read
        raise ContextDBError(f"cannot read the Context DB URL {where}. {fix}") from exc
    if any("@" in str(params.get(key, "")) for key in ("host", "hostaddr", "port", "dbname")):
        raise ContextDBError(f"the Context DB URL {where} has an '@' left in its host or database name. {fix}")
    secrets = {str(params[key]) for key in ("password", "sslpassword") if params.get(key)}
    return sorted(secrets, key=len, reverse=True)


def is_postgres_url(target: str) -> bool:
    """Whether ``target`` names a PostgreSQL database (``postgresql://`` or ``postgres://`` URL)."""
    return target.startswith(("postgresql://", "postgres://", "postgresql+psycopg://"))


def sqlite_file(target: str) -> str | None:
    """The SQLite file ``target`` opens (a file path, or SQLAlchemy's ``sqlite:///relative.db`` /
    ``sqlite:////absolute.db``), ``~`` expanded; None for a PostgreSQL URL or ``:memory:``."""
    if is_postgres_url(target):
        return None
    if target.startswith("sqlite://"):
        target = target.removeprefix("sqlite://").removeprefix("/") or ":memory:"
    return None if target == ":memory:" else str(Path(target).expanduser())


def connect(target: str, *, busy_timeout_s: float = 10.0, pool_size: int = POOL_SIZE) -> Connection:
    """Open ``target``: a PostgreSQL URL (a pool of at most ``pool_size`` connections), ``sqlite:///PATH``,
    ``:memory:`` or a file path (one connection).

    Raises:
        ContextDBError: the database cannot be opened or reached (the message names it, without a password).
    """
    if is_postgres_url(target):
        return PostgresConnection(
            target.replace("postgresql+psycopg://", "postgresql://", 1), connect_timeout_s=10.0, pool_size=pool_size
        )
    return SQLiteConnection(sqlite_file(target) or ":memory:", busy_timeout_s=busy_timeout_s)
