"""ContextDB: a real SQLite file (WAL) and a real PostgreSQL server, keyed by principal, migrated forward."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import itertools
import sqlite3
import stat
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from postgres_server import PostgresServer, running_postgres

from cspan.backends.context_db import (
    SCHEMA_VERSION,
    ContextDB,
    ContextDBError,
    Profile,
    UserForgotten,
    UserMemory,
    default_db_path,
    extract_facts,
)
from cspan.backends.context_db.schema import V1, statements
from cspan.backends.identity import Authenticator, Principal

# --------------------------------------------------------------------------------------------- PostgreSQL


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    yield from running_postgres()


_databases = itertools.count()


@contextlib.contextmanager
def _database_at_schema(target: str, version: int) -> Iterator[Any]:
    """A Context DB at ``target`` as a release at schema ``version`` created it (the migration list is append-only:
    its first ``version`` steps are the SQL that release ran); yields a write transaction for that release's rows."""
    from cspan.backends.context_db.connection import connect
    from cspan.backends.context_db.schema import MIGRATIONS

    conn = connect(target)
    try:
        with conn.write() as tx:
            tx.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
            for step in MIGRATIONS[:version]:
                step.apply(tx)
            tx.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
            yield tx
    finally:
        conn.close()


def _fresh_postgres(server: PostgresServer) -> str:
    """A new empty database on the test server; returns its URL."""
    import psycopg

    name = f"t{next(_databases)}"
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server.url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A Context DB target of each engine (a SQLite file, a fresh PostgreSQL database)."""
    if request.param == "sqlite":
        return str(tmp_path / "context.sqlite")
    return _fresh_postgres(request.getfixturevalue("postgres"))


# --------------------------------------------------------------------------------------------- persistence


def test_survives_a_process_restart(tmp_path: Path) -> None:
    path = tmp_path / "ctx" / "context.sqlite"
    writer = textwrap.dedent(
        f"""
        from cspan.backends.context_db import ContextDB, Profile
        db = ContextDB({str(path)!r})
        me = db.user("u1")
        me.put_profile(Profile(name="Ada", city="Leeds", timezone="Europe/London", lat=53.8, lon=-1.55,
                               notes="Allergic to peanuts.", persona="a helpful travel agent"))
        cid = me.start_conversation("c1", checkpoint="tiny", settings={{"temperature": 0.7}})
        me.add_turn(cid, "user", "hi, I live in York now", frame=12)
        me.add_turn(cid, "agent", "Hello Ada!", frame=30)
        sid = me.add_span(cid, question="what time is it", text="(tool result) It is noon.", tool="get_time",
                          arguments={{"timezone": "Europe/London"}}, source="tool:get_time", latency_s=0.4)
        me.mark_span_injected(sid, injected_at=1000.5, frame=44)
        me.add_span(cid, question="hmm", text=None, dropped="no_span")
        print(sid)
        """
    )
    out = subprocess.run([sys.executable, "-c", writer], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    span_id = int(out.stdout.strip())

    with ContextDB(path) as db:
        assert db.schema_version() == SCHEMA_VERSION and db.journal_mode == "wal"
        me = db.user("u1")
        assert me.get_profile() == Profile(
            user_id="u1",
            name="Ada",
            city="Leeds",
            timezone="Europe/London",
            lat=53.8,
            lon=-1.55,
            notes="Allergic to peanuts.",
            persona="a helpful travel agent",
        )
        conv = me.get_conversation("c1")
        assert conv is not None and conv.user_id == "u1" and conv.checkpoint == "tiny"
        assert conv.settings == {"temperature": 0.7}
        assert [(t.role, t.text, t.frame) for t in me.turns("c1")] == [
            ("user", "hi, I live in York now", 12),
            ("agent", "Hello Ada!", 30),
        ]
        spans = me.spans("c1")
        assert len(spans) == 2 and spans[0].id == span_id
        assert spans[0].tool == "get_time" and spans[0].arguments == {"timezone": "Europe/London"}
        assert spans[0].injected_at == 1000.5 and spans[0].frame == 44 and spans[0].dropped is None
        assert spans[1].text is None and spans[1].dropped == "no_span"
        assert {f.key: (f.value, f.source) for f in me.facts()} == {
            "name": ("Ada", "profile"),
            "city": ("York", "user"),
        }
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_default_is_a_file_in_the_platform_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv("CSPAN_DB", raising=False)
    assert default_db_path() == tmp_path / "data" / "cspan" / "context.sqlite"
    with ContextDB() as db:
        db.user("ada").set_fact("colour", "green")
        assert db.path == str(default_db_path()) and db.journal_mode == "wal"
        # private to its owner: what users said and their tokens' hashes (the WAL and its index alike)
        assert stat.S_IMODE(default_db_path().parent.stat().st_mode) == 0o700
        for suffix in ("", "-wal", "-shm"):
            assert stat.S_IMODE(Path(f"{default_db_path()}{suffix}").stat().st_mode) == 0o600, suffix
    with ContextDB() as again:  # persistent: a second open sees it
        assert [f.value for f in again.user("ada").facts()] == ["green"]
    monkeypatch.setenv("CSPAN_DB", ":memory:")
    with ContextDB() as mem:
        assert mem.path == ":memory:" and mem.user("ada").facts() == []


def test_migrates_the_first_schema_forward(tmp_path: Path) -> None:
    """A file written by the first release (schema 1, rows keyed by conversation only) opens with everything kept."""
    path = tmp_path / "v1.sqlite"
    with sqlite3.connect(path) as raw:
        for statement in statements(V1, "sqlite"):
            raw.execute(statement)
        raw.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        raw.execute("INSERT INTO schema_version VALUES (1)")
        raw.execute("INSERT INTO profiles (user_id, name, city, updated_at) VALUES ('ada', 'Ada', 'Leeds', 10)")
        raw.execute("INSERT INTO conversations (id, user_id, started_at) VALUES ('a1', 'ada', 11), ('b1', 'bob', 12)")
        raw.execute("INSERT INTO turns (conversation_id, role, text, t) VALUES ('a1', 'user', 'hi from ada', 13)")
        raw.execute("INSERT INTO turns (conversation_id, role, text, t) VALUES ('b1', 'user', 'hi from bob', 14)")
        raw.execute(
            "INSERT INTO spans (conversation_id, question, text, tool, asked_at) VALUES ('a1', 'q', 'r', 'calc', 15)"
        )
        raw.execute("INSERT INTO facts (user_id, key, value, t) VALUES ('ada', 'name', 'Ada', 10)")
    with ContextDB(path) as db:
        assert db.schema_version() == SCHEMA_VERSION == 5
        ada, bob = db.user("ada"), db.user("bob")
        assert [t.text for t in ada.turns("a1")] == ["hi from ada"] and ada.turns("b1") == []
        assert [t.text for t in bob.turns("b1")] == ["hi from bob"]
        assert [(s.id, s.tool) for s in ada.spans("a1")] == [(1, "calc")]
        assert ada.get_profile() is not None and [f.value for f in ada.facts()] == ["Ada"]
        # new rows get fresh ids after the copied ones
        assert ada.add_turn("a1", "user", "after the migration") > 2
        assert ada.add_span("a1", question="q2", text=None) == 2
    with sqlite3.connect(path) as raw:
        columns = {row[1] for row in raw.execute("PRAGMA table_info(turns)")}
        assert "user_id" in columns


def test_migrates_schema_3_forward_keeping_every_span(target: str) -> None:
    """Schema 4 lets ``spans.dropped`` be ``cancelled`` (the CHECK rebuilt with the table, in one migration for both
    engines): a database at schema 3 opens with its spans, their ids, the next id and the constraint kept."""
    with _database_at_schema(target, 3) as tx:
        tx.execute("INSERT INTO conversations (user_id, id, started_at) VALUES ('ada', 'a1', 1)")
        tx.execute(
            "INSERT INTO spans (user_id, conversation_id, question, asked_at, dropped) VALUES ('ada', 'a1', 'q1', 2, "
            "'late')"
        )
        tx.execute(
            "INSERT INTO spans (user_id, conversation_id, question, text, asked_at, injected_at, frame) "
            "VALUES ('ada', 'a1', 'q2', 'r2', 3, 4, 50)"
        )
    with ContextDB(target) as db:
        assert db.schema_version() == SCHEMA_VERSION == 5
        ada = db.user("ada")
        kept = ada.spans("a1")
        assert [(s.id, s.question, s.dropped, s.frame) for s in kept] == [(1, "q1", "late", None), (2, "q2", None, 50)]
        sid = ada.add_span("a1", question="q3", text=None, dropped="cancelled", error="conversation ended")
        assert sid == 3  # after the copied ids, on either engine
        ada.mark_span_dropped(2, "cancelled", error="conversation ended")
        assert [s.dropped for s in ada.spans("a1")] == ["late", "cancelled", "cancelled"]
        with pytest.raises(Exception, match=r"(?i)check constraint"), db._conn.write() as tx:  # it still holds
            tx.execute("UPDATE spans SET dropped = 'bored' WHERE id = 1")
        with db._conn.write() as tx:  # still tied to its conversation: deleting that deletes them
            tx.execute("DELETE FROM conversations WHERE user_id = 'ada' AND id = 'a1'")
        assert ada.spans("a1") == []


# The tables of a SQLite Context DB at schema 2 as an older release left it: `sqlite_master` of a file written by
# `cspan users add` and `cspan serve` at commit e3b68c5 (main of 2026-12-03), the release before user ids were
# refused with white space at either end (13ac1ea) and composed to Unicode NFC (6e76078).
SCHEMA_2_SQLITE_E3B68C5 = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE profiles (
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
CREATE TABLE "conversations" (
    user_id    TEXT NOT NULL,
    id         TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at   REAL,
    checkpoint TEXT NOT NULL DEFAULT '',
    settings   TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (user_id, id)
);
CREATE TABLE "turns" (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    user_id         TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    role            TEXT NOT NULL CHECK (role IN ('user', 'agent', 'tool')),
    text            TEXT NOT NULL,
    t               REAL NOT NULL,
    frame           INTEGER,
    meta            TEXT NOT NULL DEFAULT '{}',
    FOREIGN KEY (user_id, conversation_id) REFERENCES "conversations" (user_id, id) ON DELETE CASCADE
);
CREATE TABLE "spans" (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    user_id         TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
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
    error           TEXT,
    FOREIGN KEY (user_id, conversation_id) REFERENCES "conversations" (user_id, id) ON DELETE CASCADE
);
CREATE INDEX conversations_user ON conversations(user_id, started_at);
CREATE INDEX turns_conversation ON turns(user_id, conversation_id, id);
CREATE INDEX turns_t ON turns(t);
CREATE INDEX spans_conversation ON spans(user_id, conversation_id, id);
CREATE INDEX spans_asked ON spans(asked_at);
CREATE TABLE "facts" (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    user_id TEXT NOT NULL,
    key     TEXT NOT NULL,
    value   TEXT NOT NULL,
    source  TEXT NOT NULL DEFAULT 'user',
    t       REAL NOT NULL,
    UNIQUE (user_id, key)
);
CREATE TABLE tokens (
    id           TEXT PRIMARY KEY,
    user_id      TEXT NOT NULL,
    hash         TEXT NOT NULL,
    scopes       TEXT NOT NULL DEFAULT '',
    label        TEXT NOT NULL DEFAULT '',
    created_at   REAL NOT NULL,
    last_used_at REAL,
    revoked_at   REAL
);
CREATE INDEX tokens_user ON tokens(user_id);
INSERT INTO schema_version (version) VALUES (2);
"""

_JOSE_NFD, _JOSE = "jose\u0301", "jos\u00e9"  # e + combining acute (a decomposing keyboard, a file name) / composed
_ZOE_NFD, _ZOE = "zoe\u0308", "zo\u00eb"


def _database_of_an_older_release(target: str, version: int) -> dict[str, str]:
    """A Context DB at schema ``version`` (2: e3b68c5's SQLite file above, or its migrations on PostgreSQL; 3: the
    release of 85141d5) holding rows under user ids as those releases stored them. Returns the issued tokens."""
    from cspan.backends.context_db.connection import connect
    from cspan.backends.identity import hash_token

    if version == 2 and "://" not in target:
        with sqlite3.connect(target) as raw:
            raw.executescript(SCHEMA_2_SQLITE_E3B68C5)
    else:
        with _database_at_schema(target, version):
            pass
    tokens = {_JOSE_NFD: "cspan.0123456789ab." + "j" * 43, " bob": "cspan.ba0123456789." + "b" * 43}
    conn = connect(target)
    with conn.write() as tx:
        for user, name, city, tz, notes, t in [
            (_JOSE_NFD, "José", "Sevilla", "", "prefers Spanish", 100.0),
            (" bob", "Bob", "Oslo", "", "", 100.0),
            (_ZOE_NFD, "Zoë", "Paris", "", "likes tea", 100.0),  # two spellings of one user, the NFC one newer
            (_ZOE, "Zoë", "", "Europe/Paris", "", 200.0),
        ]:
            tx.execute(
                "INSERT INTO profiles (user_id, name, city, timezone, notes, updated_at) VALUES (?, ?, ?, ?, ?, ?)",
                (user, name, city, tz, notes, t),
            )
        for user, key, value, source, t in [
            (_JOSE_NFD, "name", "José", "profile", 100.0),
            (_JOSE_NFD, "city", "Sevilla", "profile", 100.0),
            (_ZOE_NFD, "city", "Paris", "profile", 100.0),
            (_ZOE_NFD, "colour", "green", "user", 150.0),
            (_ZOE, "city", "Lyon", "user", 200.0),
        ]:
            tx.execute(
                "INSERT INTO facts (user_id, key, value, source, t) VALUES (?, ?, ?, ?, ?)",
                (user, key, value, source, t),
            )
        for user, cid, text, t in [
            (_JOSE_NFD, "c1", "hola", 101.0),
            (" bob", "b1", "hi", 101.0),
            (_ZOE_NFD, "c1", "bonjour", 101.0),
            (_ZOE, "c1", "salut", 201.0),
        ]:
            tx.execute(
                "INSERT INTO conversations (user_id, id, started_at, ended_at, checkpoint) VALUES (?, ?, ?, ?, 'tiny')",
                (user, cid, t, t + 5),
            )
            tx.execute(
                "INSERT INTO turns (user_id, conversation_id, role, text, t, frame) VALUES (?, ?, 'user', ?, ?, 3)",
                (user, cid, text, t + 1),
            )
        tx.execute(
            "INSERT INTO spans (user_id, conversation_id, question, text, source, asked_at, injected_at) "
            "VALUES (?, 'c1', 'when does it open', 'At nine.', 'local:knowledge', 102, 103)",
            (_JOSE_NFD,),
        )
        for user, token in tokens.items():
            tx.execute(
                "INSERT INTO tokens (id, user_id, hash, scopes, created_at) VALUES (?, ?, ?, 'session', 100)",
                (token.split(".")[1], user, hash_token(token)),
            )
        if version >= 3:  # " bob" was forgotten once before his rows above
            tx.execute(
                "INSERT INTO erasures (user_hash, generation, erased_at) VALUES (?, 1, 50)",
                (hashlib.sha256(b" bob").hexdigest(),),
            )
    conn.close()
    return tokens


@pytest.mark.parametrize("version", [2, 3])
def test_user_ids_an_older_release_stored_join_their_user(
    target: str, version: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Releases up to schema 3 stored a user id as given; this one composes it (NFC) and refuses white space at
    either end, so rows stored as "jose\u0301" or " bob" were never found again: the upgrade lost the user's profile,
    facts and conversations, `cspan db export|forget` missed them or refused the id, and the token of " bob" broke
    every connection (ValueError in the session). The migration moves them to the id this release uses."""
    tokens = _database_of_an_older_release(target, version)
    with caplog.at_level("WARNING"), ContextDB(target) as db:
        assert db.schema_version() == SCHEMA_VERSION
        assert db.users() == sorted(["bob", _JOSE, _ZOE])
        auth = Authenticator(db=db)
        jose = auth.authenticate(tokens[_JOSE_NFD])
        assert jose is not None and jose.user_id == _JOSE
        memory = db.user(jose)
        profile = memory.get_profile()
        assert profile is not None and (profile.name, profile.city, profile.notes) == (
            "José",
            "Sevilla",
            "prefers Spanish",
        )
        assert {f.key: f.value for f in memory.facts()} == {"name": "José", "city": "Sevilla"}
        assert [c.id for c in memory.conversations()] == ["c1"]
        assert [t.text for t in memory.turns("c1")] == ["hola"]
        assert [(s.question, s.text) for s in memory.spans("c1")] == [("when does it open", "At nine.")]
        assert db.user(_JOSE_NFD).get_profile() == profile  # either spelling given now
        bob = auth.authenticate(tokens[" bob"])
        assert bob is not None and bob.user_id == "bob"
        assert db.user(bob).get_profile().city == "Oslo" and [t.text for t in db.user(bob).turns("b1")] == ["hi"]
        # one user stored under both spellings: the newer value of each field and fact, every conversation
        zoe = db.user(_ZOE)
        merged = zoe.get_profile()
        assert (merged.name, merged.city, merged.timezone, merged.notes) == (
            "Zoë",
            "Paris",
            "Europe/Paris",
            "likes tea",
        )
        assert {f.key: f.value for f in zoe.facts()} == {"city": "Lyon", "colour": "green"}
        assert sorted((c.id, [t.text for t in zoe.turns(c.id)]) for c in zoe.conversations()) == [
            ("c1", ["salut"]),
            ("c1-2", ["bonjour"]),
        ]
        exported = db.export_user(_JOSE)
        assert len(exported["conversations"]) == 1 and [t["id"] for t in exported["tokens"]] == ["0123456789ab"]
        db.forget_user(_JOSE, tokens=True)
        db.forget_user("bob")
        for table in ("profiles", "facts", "conversations", "turns", "spans", "tokens"):
            left = db._conn.read(
                f"SELECT user_id FROM {table} WHERE user_id IN (?, ?, ?, ?)", (_JOSE_NFD, _JOSE, " bob", "bob")
            )
            assert [r["user_id"] for r in left] == (["bob"] if table == "tokens" else []), table
        if version >= 3:  # bob's erase generation went with him: forgotten once before, once now
            assert db._conn.read(
                "SELECT generation FROM erasures WHERE user_hash = ?", (hashlib.sha256(b"bob").hexdigest(),)
            ) == [{"generation": 2}]
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"schema {version} (an older release's) migrated to {SCHEMA_VERSION}" in m for m in said), said
    assert any("3 user id(s)" in m and "'jose\\u0301' -> 'jos\u00e9'" in m for m in said), said
    # Zoë's rows were under both spellings: the merge is named apart from the plain moves (josé's and bob's)
    merges = [m for m in said if "held rows each and are one user now" in m]
    assert len(merges) == 1 and f"one user now, {_ZOE!r}" in merges[0], said
    caplog.clear()
    with caplog.at_level("WARNING"), ContextDB(target) as again:  # once: the next open changes nothing
        assert again.users() == sorted(["bob", _ZOE])
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"])
def test_newer_schema_is_refused(engine: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    target = str(tmp_path / "c.sqlite") if engine == "sqlite" else _fresh_postgres(request.getfixturevalue("postgres"))
    ContextDB(target).close()
    if engine == "sqlite":
        with sqlite3.connect(target) as raw:
            raw.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    else:
        import psycopg

        with psycopg.connect(target, autocommit=True) as conn:
            conn.execute("UPDATE schema_version SET version = %s", (SCHEMA_VERSION + 1,))
    with pytest.raises(ContextDBError, match="newer"):
        ContextDB(target)


def test_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("this is not sqlite " * 200)
    with pytest.raises(ContextDBError, match="cannot open"):
        ContextDB(path)


def test_an_unwritable_place_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ContextDBError, match=r"cannot create Context DB .*Fix: point --db"):
        ContextDB(blocker / "context.sqlite")


def test_a_failed_sqlite_statement_is_a_clear_error(tmp_path: Path) -> None:
    """A statement that fails after the file opened (a write lock held past the busy timeout, a damaged page) is a
    ContextDBError naming the file and the fix, as on PostgreSQL, not sqlite3's exception (``cspan db forget`` printed
    a traceback); the failed write leaves no transaction open."""
    target = tmp_path / "c.sqlite"
    with ContextDB(target) as db:
        db.user("ada").put_profile(Profile(name="Ada", city="Leeds"))
    holder = sqlite3.connect(target, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    db = ContextDB(target, busy_timeout_s=0.1, read_only=True)
    try:
        with pytest.raises(ContextDBError, match=rf"^the Context DB at {target} failed: database is locked\. Fix: "):
            db.forget_user("ada")
        holder.execute("ROLLBACK")
        assert db.forget_user("ada")["profiles"] == 1  # the refused write left nothing behind to block this one
    finally:
        holder.close()
        db.close()
    with open(target, "r+b") as raw:  # the tables' pages overwritten, the header kept: the file still opens
        raw.seek(4096)
        raw.write(b"\xff" * 8192)
    with pytest.raises(ContextDBError, match=r"malformed\. Fix: the file is damaged: restore it from a backup"):
        ContextDB(target, read_only=True)


def test_unreachable_postgres_is_a_clear_error() -> None:
    with pytest.raises(ContextDBError, match=r"cannot connect .*postgresql://u:\*\*\*@127\.0\.0\.1:1/x"):
        ContextDB("postgresql://u:secret@127.0.0.1:1/x")
    with pytest.raises(ContextDBError) as info:  # libpq also reads the password from the query
        ContextDB("postgresql://u@127.0.0.1:1/x?sslmode=disable&password=secret&sslpassword=secret2")
    assert "secret" not in str(info.value) and "?sslmode=disable&password=***&sslpassword=***" in str(info.value)


def _role(server: PostgresServer, database_url: str, name: str, password: str, *grants: str) -> str:
    """A new login role with ``password`` and ``grants`` on ``database_url``'s database; returns the URL of that
    database as this role, the password percent-encoded."""
    from urllib.parse import quote

    import psycopg

    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {name} LOGIN PASSWORD '{password}'")
    with psycopg.connect(database_url, autocommit=True) as conn:
        for grant in grants:
            conn.execute(grant.format(role=name))
    host_and_db = database_url.split("@", 1)[1]
    return f"postgresql://{name}:{quote(password, safe='')}@{host_and_db}"


def test_a_password_that_is_not_percent_encoded_is_refused_without_showing_it(postgres: PostgresServer) -> None:
    """libpq reads a raw ``@`` or ``/`` in the password as the end of it (the rest becomes the host), and a raw ``%``
    as a broken escape: each is refused with the fix, and no message shows any part of the password."""
    url = _fresh_postgres(postgres)
    password = "p@ss:w/rd#?%x9"
    encoded = _role(postgres, url, "special", password, "GRANT ALL ON SCHEMA public TO {role}")
    host = url.split("@", 1)[1]
    assert encoded == f"postgresql://special:p%40ss%3Aw%2Frd%23%3F%25x9@{host}"
    with ContextDB(encoded) as db:  # percent-encoded, as the docs say, it opens
        assert db.schema_version() == SCHEMA_VERSION and db.where == f"postgresql://special:***@{host}"
    raw = f"postgresql://special:{password}@{host}"
    for given in (raw, f"postgresql://special:pa/ss9@{host}", f"postgresql://special:pa@ss9@{host}"):
        with pytest.raises(ContextDBError, match=r"Fix: percent-encode the characters @ / :") as info:
            ContextDB(given)
        message = str(info.value)
        assert f"postgresql://special:***@{host}" in message
        for piece in ("ss:w", "rd#", "%x9", "pa/", "ss9"):
            assert piece not in message, (piece, message)
    for given in (f"postgresql://special:pa#ss9@{host}", f"postgresql://special:pa?ss9@{host}"):
        with pytest.raises(ContextDBError) as info:  # libpq reads these: the server refuses the password (trust
            ContextDB(given + "x")  # authentication accepts any, so name a database that does not exist)
        assert "ss9" not in str(info.value) and f"postgresql://special:***@{host}x" in str(info.value)


def test_a_postgresql_restart_between_statements_costs_none(postgres: PostgresServer) -> None:
    """After PostgreSQL restarts, the next read and the next write of an open Context DB (a replica's) succeed: the
    connection the server ended while idle is replaced first (was: one ContextDBError per connection, "terminating
    connection due to administrator command", which `cspan serve` turned into a refused conversation)."""
    url = _fresh_postgres(postgres)
    with ContextDB(url) as reader, ContextDB(url) as writer:
        writer.user("ada").put_profile(Profile(name="Ada", city="Leeds"))
        assert reader.user("ada").get_profile().city == "Leeds"
        postgres.restart()
        assert reader.user("ada").get_profile().city == "Leeds"
        writer.user("ada").put_profile(Profile(name="Ada", city="York"))
        postgres.restart()
        assert reader.export_user("ada")["profile"]["city"] == "York"


def test_a_read_only_role_reads_and_is_told_why_it_cannot_write(postgres: PostgresServer) -> None:
    """An operator's read-only role (``SELECT`` only) opens a current Context DB to read (``cspan db export``,
    ``users list``, ``db info``); a write, or opening it to write (``cspan serve``), is a ContextDBError naming the
    privilege and the fix, not psycopg's exception."""
    url = _fresh_postgres(postgres)
    with ContextDB(url) as owner:
        owner.user("ada").put_profile(Profile(name="Ada", city="Leeds"))
    reader = _role(postgres, url, "reader", "r3ad-only", "GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    with ContextDB(reader, read_only=True) as db:
        assert db.export_user("ada")["profile"]["city"] == "Leeds" and db.users() == ["ada"]
        with pytest.raises(ContextDBError, match=r"permission denied for table .*Fix: --db needs a role that may"):
            db.user("bob").put_profile(Profile(name="Bob"))
    with pytest.raises(ContextDBError, match=r"permission denied for schema public\. Fix: --db needs a role") as info:
        ContextDB(reader)
    assert "r3ad" not in str(info.value) and "LINE 1" not in str(info.value)


# --------------------------------------------------------------------------------------------- one user's memory


async def test_concurrent_writes_from_20_tasks_lose_nothing(target: str) -> None:
    first, second = ContextDB(target), ContextDB(target)  # two connections, like two processes or replicas
    try:
        a, b = first.user("u1"), second.user("u1")
        cid = await a.astart_conversation("busy")
        per_task = 10

        async def writer(task: int) -> list[int]:
            me = a if task % 2 == 0 else b
            ids = []
            for i in range(per_task):
                ids.append(await me.aadd_turn(cid, "user", f"task {task} turn {i}", frame=i))
                if i % 5 == 0:
                    ids.append(-(await me.aadd_span(cid, question=f"q{task}.{i}", text=f"r{task}.{i}")))
            return ids

        results = await asyncio.gather(*(writer(t) for t in range(20)))
        turn_ids = [i for ids in results for i in ids if i > 0]
        span_ids = [-i for ids in results for i in ids if i < 0]
        assert len(set(turn_ids)) == 20 * per_task and len(set(span_ids)) == 20 * 2
        texts = {t.text for t in await b.aturns(cid)}
        assert texts == {f"task {t} turn {i}" for t in range(20) for i in range(per_task)}
        assert len(await a.aspans(cid)) == 40
    finally:
        first.close()
        second.close()


async def test_the_async_methods_run_on_the_executor_given(tmp_path: Path) -> None:
    """``ContextDB(executor=...)``: the ``a``-methods of the store, of the memories it makes, of the deprecated shims
    and the token lookup run their statements on that executor (a server's own pool: a database that stops answering
    holds those threads, not asyncio's default executor's); without one, on asyncio's default executor."""
    from concurrent.futures import ThreadPoolExecutor

    from cspan.backends.identity import Authenticator, issue_token

    class Counting(ThreadPoolExecutor):
        calls = 0

        def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.calls += 1
            return super().submit(fn, *args, **kwargs)

    with Counting(1) as pool, ContextDB(tmp_path / "c.sqlite") as db:
        assert db.executor is None and db.user("u").executor is None
        cid = await db.user("u").astart_conversation()  # asyncio.to_thread's
        db.executor = pool  # as a server sets it, before it makes any memory
        memory = db.user("u")
        assert memory.executor is pool
        await memory.aadd_turn(cid, "user", "hello")
        assert [t.text for t in await memory.aturns(cid)] == ["hello"] and pool.calls == 2
        _, token = issue_token(db, "ada")
        assert (await Authenticator(db=db).aauthenticate(token)).user_id == "ada" and pool.calls == 3
        assert await db.aprune(30) == {"spans": 0, "turns": 0, "conversations": 0, "facts": 0, "profiles": 0}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            assert [t.text for t in await db.aturns(cid)] == ["hello"]
        assert pool.calls == 5


def test_working_text_keeps_profile_and_drops_oldest_turns() -> None:
    me = ContextDB(":memory:").user("u")
    me.put_profile(Profile(name="Ada", timezone="Europe/London"))
    cid = me.start_conversation()
    for i in range(12):
        me.add_turn(cid, "user" if i % 2 == 0 else "agent", f"turn number {i:02d} " + "x" * 40)
    me.add_turn(cid, "tool", 'get_time({"timezone": "Europe/London"}) => It is noon.')
    lines = me.working_text(cid, max_chars=5000, recent=10).splitlines()
    assert lines[0] == "profile: user=Ada, place=London, timezone=Europe/London"
    assert len(lines) == 11  # profile + the last 10 turns
    assert lines[1].startswith("agent: turn number 03") and lines[-1].startswith("tool: get_time(")
    short = me.working_text(cid, max_chars=200, recent=10)
    kept = short.splitlines()
    assert len(short) <= 200 and kept[0].startswith("profile: user=Ada") and kept[-1] == lines[-1]
    assert 1 < len(kept) < len(lines) and kept[1:] == lines[-(len(kept) - 1) :]
    assert len(me.working_text(cid, max_chars=20)) == 20


def test_user_turns_become_facts_and_dedupe() -> None:
    me = ContextDB(":memory:").user("priya")
    cid = me.start_conversation()
    first = me.add_turn(cid, "user", "Hello, my name is Priya and I live in Sydney.")
    again = me.add_turn(cid, "user", "hello my name is priya and i live in sydney", dedupe=True)
    assert again == first and len(me.turns(cid)) == 1
    assert {f.key: f.value for f in me.facts()} == {"name": "Priya", "city": "Sydney"}
    assert me.profile_line() == "profile: the user's name is Priya, the user lives in Sydney"
    me.add_turn(cid, "agent", "agents' words are not facts: my name is Bob")
    assert {f.key: f.value for f in me.facts()}["name"] == "Priya"


@pytest.mark.parametrize(
    ("text", "facts"),
    [
        ("my name is ada and i live in leeds", {"name": "Ada", "city": "Leeds"}),
        ("My name is Ada Lovelace.", {"name": "Ada Lovelace"}),
        ("call me bob, I'm from new york city now", {"name": "Bob", "city": "New York City"}),
        ("I'm in a meeting, what time is it", {}),
        ("what is my name", {}),
    ],
)
def test_extract_facts(text: str, facts: dict[str, str]) -> None:
    assert extract_facts(text) == facts


def test_a_principal_that_is_not_a_user_is_refused_clearly(tmp_path: Path) -> None:
    """``db.user(x)`` takes a user id or anything with ``user_id``; None or a number is a ValueError naming the user
    id (it used to be AttributeError "'NoneType' object has no attribute 'user_id'")."""
    with ContextDB(tmp_path / "c.sqlite") as db:
        for wrong, shown in ((None, "None"), (5, "5"), ("", "''")):
            with pytest.raises(ValueError, match=f"user id must be 1 to 200 printable characters, got {shown}$"):
                db.user(wrong)  # type: ignore[arg-type]
        assert db.user(Principal.local("ada")).user_id == "ada" and db.users() == []


def test_span_marks_and_errors(tmp_path: Path) -> None:
    with ContextDB(tmp_path / "c.sqlite") as db:
        me = db.user("u")
        cid = me.start_conversation()
        sid = me.add_span(cid, question="q", text="(tool result) 5", tool="calculate", source="tool:calculate")
        me.mark_span_dropped(sid, "late")
        assert me.spans(cid)[0].dropped == "late" and me.spans(cid)[0].injected_at is None
        me.mark_span_injected(sid, frame=7)
        rec = me.spans(cid)[0]
        assert rec.dropped is None and rec.frame == 7 and rec.injected_at is not None
        with pytest.raises(ContextDBError, match="span 999"):
            me.mark_span_injected(999)
        with pytest.raises(ValueError, match="drop reason"):
            me.mark_span_dropped(sid, "bored")  # type: ignore[arg-type]
        with pytest.raises(ContextDBError, match="start_conversation"):
            me.add_turn("nope", "user", "hello")
        with pytest.raises(ValueError, match="role"):
            me.add_turn(cid, "system", "hello")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="conversation id"):
            me.start_conversation("x" * 500)
        assert me.start_conversation(cid) == cid  # resuming is a no-op


# --------------------------------------------------------------------------------------------- isolation


def test_no_method_reaches_another_users_rows(target: str) -> None:
    """Bob's memory, given Ada's conversation and span ids, neither reads nor changes any of her rows."""
    db = ContextDB(target)
    ada, bob = db.user("ada"), db.user("bob")
    ada.put_profile(Profile(name="Ada", city="Leeds", notes="Ada's secret note"))
    ada.start_conversation("c1")
    ada.add_turn("c1", "user", "my name is Ada and I live in Leeds")
    ada_span = ada.add_span("c1", question="secret question", text="secret answer", tool="t")
    ada_promised = ada.provisional_span_id()  # a row Ada's retriever will write late
    bob.start_conversation("c1")  # the same conversation id: Bob's own, a different row

    tried: set[str] = set()

    def attempt(name: str, *args, **kwargs):
        tried.add(name)
        return getattr(bob, name)(*args, **kwargs)

    assert attempt("get_profile") is None
    assert attempt("facts") == []
    assert attempt("turns", "c1") == [] and attempt("spans", "c1") == []
    assert attempt("last_user_text", "c1") == ""
    assert "Ada" not in attempt("working_text", "c1") and attempt("profile_line") == ""
    assert [c.user_id for c in attempt("conversations")] == ["bob"]
    assert attempt("get_conversation", "c1").user_id == "bob"
    with pytest.raises(ContextDBError):
        attempt("mark_span_injected", ada_span)
    with pytest.raises(ContextDBError):
        attempt("mark_span_dropped", ada_span, "late")
    assert attempt("provisional_span_id") < 0  # Bob's own, no mark of his reaches Ada's promised row
    with pytest.raises(ContextDBError):
        attempt("mark_span_injected", ada_promised)
    assert attempt("add_turn", "c1", "user", "bob speaking") > 0  # into Bob's c1
    assert attempt("add_span", "c1", question="bob's", text=None) > 0
    assert attempt("end_conversation", "c1") is True
    stored = attempt("put_profile", Profile(user_id="ada", name="Mallory"))  # the profile's user_id is ignored
    assert stored.user_id == "bob"
    assert attempt("merge_profile", {"timezone": "Europe/Madrid"}).notes == ""  # over Bob's profile, not Ada's
    attempt("set_fact", "name", "Mallory")
    assert attempt("forget_fact", "city") is False  # Ada's city is not Bob's to forget
    exported = attempt("export")
    assert "secret" not in str(exported) and "Leeds" not in str(exported)
    assert attempt("forget")["facts"] == 1
    assert attempt("was_forgotten") is False and not ada.was_forgotten()  # Bob's erase is his own, his memory goes on
    attempt("start_conversation", "c2")

    # every public method of UserMemory was tried (async twins run the same code in a thread)
    public = {n for n, _ in inspect.getmembers(UserMemory, inspect.isfunction) if not n.startswith("_")}
    assert {n for n in public if not n.startswith("a") or n == "add_turn" or n == "add_span"} <= tried

    # and Ada's rows are exactly as she left them
    assert ada.get_profile().name == "Ada" and ada.get_conversation("c1").ended_at is None
    assert [t.text for t in ada.turns("c1")] == ["my name is Ada and I live in Leeds"]
    assert [s.injected_at for s in ada.spans("c1")] == [None]
    assert {f.key: f.value for f in ada.facts()} == {"name": "Ada", "city": "Leeds"}
    db.close()


def test_two_replicas_see_each_others_facts(postgres: PostgresServer) -> None:
    url = _fresh_postgres(postgres)
    replica_a, replica_b = ContextDB(url), ContextDB(url)  # both migrate at once without harm
    try:
        a = replica_a.user("ada")
        a.start_conversation("c")
        a.add_turn("c", "user", "my name is Ada, I live in Leeds")
        b = replica_b.user("ada")
        assert {f.key: f.value for f in b.facts()} == {"name": "Ada", "city": "Leeds"}
        assert b.working_text("c").startswith("profile: the user's name is Ada")
        assert replica_b.user("bob").facts() == []
    finally:
        replica_a.close()
        replica_b.close()


# --------------------------------------------------------------------------------------------- operators


def test_export_forget_and_retention(target: str) -> None:
    db = ContextDB(target)
    ada = db.user("ada")
    ada.put_profile(Profile(name="Ada"))
    ada.start_conversation("old", started_at=1000.0)
    ada.add_turn("old", "user", "an old turn", t=1000.0)
    ada.add_span("old", question="old q", text=None, asked_at=1000.0)
    ada.start_conversation("new")
    ada.add_turn("new", "user", "a new turn")
    db.user("bob").set_fact("city", "Paris")

    exported = db.export_user("ada")
    assert exported["user_id"] == "ada" and exported["profile"]["name"] == "Ada"
    assert {c["id"]: [t["text"] for t in c["turns"]] for c in exported["conversations"]} == {
        "old": ["an old turn"],
        "new": ["a new turn"],
    }
    assert db.users() == ["ada", "bob"]

    removed = db.prune(30)  # everything older than 30 days: the 1970 rows
    assert removed["turns"] == 1 and removed["spans"] == 1 and removed["conversations"] == 1
    assert [c.id for c in ada.conversations()] == ["new"] and ada.get_profile() is not None

    counts = db.forget_user("ada")
    assert counts["turns"] == 1 and counts["conversations"] == 1 and counts["profiles"] == 1
    assert db.export_user("ada")["conversations"] == [] and db.users() == ["bob"]
    with pytest.raises(ValueError, match="positive"):
        db.prune(float("inf"))
    db.close()
    with ContextDB(target, retention_days=30) as again:  # retention applies at open
        assert again.retention_days == 30


def test_forget_leaves_no_copy_in_the_sqlite_files(tmp_path: Path) -> None:
    """What a user said is gone from every file of a SQLite Context DB once ``cspan db forget`` returns, while a
    server still holds the database open (its WAL kept the deleted rows' text before), and so are pruned rows."""
    path = tmp_path / "c.sqlite"
    server = ContextDB(str(path))  # a running server: its connection keeps the WAL from being removed at close
    try:
        ada = server.user("ada")
        ada.set_fact("pin", "ZEBRA-PIN-5678")
        ada.start_conversation("c1")
        ada.add_turn("c1", "user", "my password is ZEBRA-PASSWORD-1234")
        ada.add_turn("c1", "user", "an OLD-TURN-4242", t=1000.0)
        server.user("bob").set_fact("city", "Paris")

        def files() -> dict[str, bytes]:
            return {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("c.sqlite")}

        assert any(b"ZEBRA-PASSWORD-1234" in data for data in files().values())
        with ContextDB(str(path)) as cli:
            assert cli.prune(30)["turns"] == 1
            assert not [name for name, data in files().items() if b"OLD-TURN-4242" in data]
            assert cli.forget_user("ada")["facts"] == 1
        assert not [name for name, data in files().items() if b"ZEBRA-" in data]
        assert server._conn.read("PRAGMA secure_delete")[0]["secure_delete"] == 1
        assert server.user("bob").facts()[0].value == "Paris" and server.users() == ["bob"]
    finally:
        server.close()


def test_a_memory_opened_before_forget_writes_nothing(target: str) -> None:
    """A session's memory (one process) and ``cspan db forget`` (another): once ada is forgotten, every write through
    the memory opened before is refused and nothing it held comes back; a memory opened after starts afresh."""
    server, cli = ContextDB(target), ContextDB(target)
    try:
        session = server.user("ada")
        session.put_profile(Profile(name="Ada", notes="forget me"))
        session.start_conversation("c1")
        session.add_turn("c1", "user", "I live in Leeds")
        span = session.add_span("c1", question="q", text="r")
        server.user("bob").set_fact("city", "Paris")
        assert not session.was_forgotten()

        assert cli.forget_user("ada")["profiles"] == 1
        assert session.was_forgotten() and not server.user("bob").was_forgotten()
        writes = [
            lambda: session.put_profile(Profile(name="Ada again", notes="forget me")),
            lambda: session.set_fact("name", "Ada"),
            lambda: session.forget_fact("city"),
            lambda: session.start_conversation("c2"),
            lambda: session.end_conversation("c1"),
            lambda: session.add_turn("c1", "user", "my name is Ada"),
            lambda: session.add_span("c1", question="q2", text=None),
            lambda: session.mark_span_injected(span),
            lambda: session.mark_span_dropped(span, "late"),
        ]
        for write in writes:
            with pytest.raises(UserForgotten, match=r"'ada' was forgotten .*nothing was written.*new session"):
                write()
        exported = cli.export_user("ada")
        assert (exported["profile"], exported["facts"], exported["conversations"]) == (None, [], [])
        assert cli.users() == ["bob"]

        fresh = server.user("ada")  # a new session: a fresh start at the new generation
        assert fresh.get_profile() is None
        fresh.put_profile(Profile(name="Ada anew"))
        assert fresh.start_conversation("c1") == "c1" and not fresh.was_forgotten()
        assert cli.user("ada").get_profile().notes == "" and session.was_forgotten()
        with pytest.raises(UserForgotten):
            session.put_profile(Profile(name="Ada again"))

        cli.forget_user("ada")  # forgotten twice: the second session is refused too
        with pytest.raises(UserForgotten):
            fresh.add_turn("c1", "user", "hello")
        assert server.user("ada").get_profile() is None and server.user("bob").facts()[0].value == "Paris"
        session.forget()  # an erase through a stale memory erases, and leaves it stale (it may hold old rows)
        with pytest.raises(UserForgotten):
            session.put_profile(Profile(name="Ada again", notes="forget me"))
        erasures = cli._conn.read("SELECT * FROM erasures")  # the erased user's id is not kept, only its hash
        assert len(erasures) == 1 and "ada" not in repr(erasures) and erasures[0]["generation"] == 3
    finally:
        server.close()
        cli.close()


@pytest.mark.timeout(120)
def test_a_memory_first_used_by_a_read_and_a_write_at_once_does_not_deadlock(target: str) -> None:
    """The first use pins the erase generation: a write pins it holding the connection's lock, a read takes that
    lock to read it; neither may wait on the other (was: a lock-order deadlock that froze the event loop)."""

    async def both(memory: UserMemory) -> None:
        await asyncio.wait_for(asyncio.gather(memory.aset_fact("k", "v"), memory.aget_profile()), timeout=20)

    with ContextDB(target) as db:
        for i in range(20):
            asyncio.run(both(db.user(f"u{i}")))
        assert [f.value for f in db.user("u19").facts()] == ["v"]


def test_a_write_during_an_erase_is_refused_without_waiting(postgres: PostgresServer) -> None:
    """PostgreSQL: a write of a user whose erase holds the lock is refused at once (it would be refused after the
    erase anyway), instead of holding up its replica until the erase commits."""
    import time

    import psycopg

    from cspan.backends.context_db.user import _ERASE_LOCK

    url = _fresh_postgres(postgres)
    with ContextDB(url) as db, psycopg.connect(url) as eraser:
        session = db.user("ada")
        session.put_profile(Profile(name="Ada"))
        eraser.execute("SELECT pg_advisory_xact_lock(%s::integer, hashtext(%s))", (_ERASE_LOCK, "ada"))
        t0 = time.monotonic()
        with pytest.raises(UserForgotten, match="'ada' is being forgotten"):
            session.set_fact("name", "Ada")
        assert time.monotonic() - t0 < 5
        db.user("bob").set_fact("city", "Paris")  # another user's writes go on
        eraser.rollback()
        session.set_fact("name", "Ada")  # no erase happened: the write goes through


def test_no_write_that_raced_an_erase_survives_it(target: str) -> None:
    """Writers of a session keep writing while another connection forgets the user: after ``forget`` returns nothing
    is left (a write either committed before the erase and was deleted by it, or was refused). On PostgreSQL the
    database's default isolation is repeatable read here: the Context DB's connections read committed whatever
    the default (a snapshot taken before a write waited for the erase would miss it)."""
    import threading

    if target.startswith("postgresql"):
        import psycopg

        with psycopg.connect(target, autocommit=True) as conn:
            name = target.rsplit("/", 1)[1]
            conn.execute(f"ALTER DATABASE {name} SET default_transaction_isolation = 'repeatable read'")

    for _ in range(5):
        server, cli = ContextDB(target), ContextDB(target)
        try:
            session = server.user("ada")
            cid = session.start_conversation()
            started = threading.Event()

            def write(memory: UserMemory = session, cid: str = cid, started: threading.Event = started) -> None:
                try:
                    for i in range(10_000):
                        memory.put_profile(Profile(name=f"Ada {i}", notes="forget me"))
                        memory.add_turn(cid, "user", f"my name is Ada{i}")
                        started.set()
                except UserForgotten:
                    return

            writer = threading.Thread(target=write)
            writer.start()
            assert started.wait(30)
            cli.forget_user("ada")
            writer.join(60)
            assert not writer.is_alive()
            exported = cli.export_user("ada")
            assert (exported["profile"], exported["facts"], exported["conversations"]) == (None, [], [])
        finally:
            server.close()
            cli.close()


def test_deprecated_methods_still_work_and_warn() -> None:
    db = ContextDB(":memory:")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        db.put_profile(Profile(user_id="ada", name="Ada"))
        cid = db.start_conversation("ada")
        db.add_turn(cid, "user", "hello")
        sid = db.add_span(cid, question="q", text="r")
        db.mark_span_injected(sid, frame=3)
        assert [t.text for t in db.turns(cid)] == ["hello"] and db.spans(cid)[0].frame == 3
        assert db.get_profile("ada").name == "Ada" and db.turns("unknown") == []
    assert caught and all(issubclass(w.category, DeprecationWarning) for w in caught)
    assert db.user("ada").turns(cid)[0].text == "hello"


def test_a_retrievals_early_rows_get_what_the_sessions_own_writes_carry(target: str) -> None:
    """Under a slow database a retrieval can write before the session's own start and turn (``cspan serve`` queues
    those behind the database): the conversation row it made gets the session's checkpoint and settings, and the
    question's turn the transcript's frame; what the first start or turn gave is never overwritten."""
    with ContextDB(target) as db:
        me = db.user("ada")
        assert me.start_conversation("c1") == "c1"  # the retrieval's: no checkpoint, no settings
        question = me.add_turn("c1", "user", "What is the weather in Leeds?", dedupe=True)
        assert me.start_conversation("c1", checkpoint="tiny", settings={"session_id": "s1"}) == "c1"
        assert me.add_turn("c1", "user", "what is the weather in leeds", frame=42, dedupe=True) == question
        conversation = me.get_conversation("c1")
        assert (conversation.checkpoint, conversation.settings) == ("tiny", {"session_id": "s1"})
        assert [(t.text, t.frame) for t in me.turns("c1")] == [("What is the weather in Leeds?", 42)]
        # a second start, or the same turn again, changes nothing the first one gave
        me.start_conversation("c1", checkpoint="other", settings={"session_id": "s2"})
        me.add_turn("c1", "user", "What is the weather in Leeds", frame=42, dedupe=True)
        conversation = me.get_conversation("c1")
        assert (conversation.checkpoint, conversation.settings) == ("tiny", {"session_id": "s1"})
        assert [t.frame for t in me.turns("c1")] == [42]


def test_repeated_utterances_are_kept_and_a_retrievals_copy_is_not(target: str) -> None:
    """``dedupe``: two final transcripts of the same words at different frames are two utterances, two rows (a user
    who says "yes" twice); a retrieval's frameless copy of the question and the transcript's own turn are one row,
    whichever reaches the database first, and that row has the transcript's frame and time."""
    with ContextDB(target) as db:
        me = db.user("ada")
        me.start_conversation("c1")
        yes = me.add_turn("c1", "user", "Yes.", t=100.0, frame=10, dedupe=True)
        assert me.add_turn("c1", "user", "yes", t=105.0, frame=70, dedupe=True) != yes  # said twice: kept
        assert me.add_turn("c1", "user", "yes", dedupe=True) != yes  # the retrieval's copy: the latest one
        assert [(t.text, t.frame, t.t) for t in me.turns("c1")] == [("Yes.", 10, 100.0), ("yes", 70, 105.0)]

        # the transcript's turn first, then the retrieval's copy (as retriever._context writes it)
        me.add_turn("c1", "user", "What time is it?", t=110.0, frame=120, dedupe=True)
        asyncio.run(me.aadd_turn("c1", "user", "what time is it", dedupe=True))
        # the retrieval's copy first (its time is its write's), then the transcript's turn: its frame and time win
        asyncio.run(me.aadd_turn("c1", "user", "What time is it now?", dedupe=True))
        me.add_turn("c1", "user", "what time is it now", t=120.0, frame=200, dedupe=True)
        # the same words again, asked by the user: the retrieval's copy joins the latest turn, the transcript's is new
        me.add_turn("c1", "user", "what time is it now", dedupe=True)
        me.add_turn("c1", "user", "What time is it now?", t=130.0, frame=260, dedupe=True)
        assert [(t.text, t.frame, t.t) for t in me.turns("c1")][2:] == [
            ("What time is it?", 120, 110.0),
            ("What time is it now?", 200, 120.0),
            ("What time is it now?", 260, 130.0),
        ]


def test_merge_profile_changes_only_the_fields_given(target: str) -> None:
    """``merge_profile`` reads, overlays and writes in one transaction: the fields not given keep what is stored
    (a session that could not read the profile erases nothing); ``put_profile`` still replaces all of it."""
    with ContextDB(target) as db:
        me = db.user("eve")
        assert me.merge_profile({"name": "Eve"}) == Profile(user_id="eve", name="Eve")  # none stored yet
        me.put_profile(Profile(name="Eve", city="Leeds", lat=53.8, notes="allergic to nuts", persona="old"))
        merged = me.merge_profile({"name": "Evelyn", "timezone": "Europe/London", "persona": "a travel agent"})
        expected = Profile(
            user_id="eve", name="Evelyn", city="Leeds", timezone="Europe/London", lat=53.8,
            notes="allergic to nuts", persona="a travel agent",
        )  # fmt: skip
        assert merged == expected and me.get_profile() == expected
        assert {f.key: f.value for f in me.facts()} == {"name": "Evelyn", "city": "Leeds"}
        me.merge_profile({"notes": "", "lat": None})  # given empty: emptied
        assert (me.get_profile().notes, me.get_profile().lat, me.get_profile().city) == ("", None, "Leeds")
        with pytest.raises(ValueError, match="not profile fields: user_id"):
            me.merge_profile({"user_id": "mallory", "name": "x"})
        assert me.get_profile().name == "Evelyn"
        me.put_profile(Profile(name="Eve"))
        assert (me.get_profile().name, me.get_profile().city) == ("Eve", "")


def test_profile_writes_validate_what_they_store(target: str) -> None:
    """A value that is not valid for its field is refused before anything is written (a ``lat`` of ``"x"`` stored
    as text used to make the user's profile unreadable: ``get_profile``, ``working_text``, ``export`` and every
    retrieval's context failed from then on); valid strings are coerced as ``Profile`` does; ``put_profile`` of a
    dict says what it takes."""
    with ContextDB(target) as db:
        me = db.user("eve")
        me.put_profile(Profile(name="Eve", city="Leeds", lat=53.8))
        for changes, field in (
            ({"lat": "north"}, "lat"),
            ({"name": "Evelyn", "lon": [1]}, "lon"),
            ({"name": 5}, "name"),
        ):
            with pytest.raises(ValueError, match=f"profile field '{field}': .*nothing was written"):
                me.merge_profile(changes)
        assert me.get_profile() == Profile(user_id="eve", name="Eve", city="Leeds", lat=53.8)
        assert me.merge_profile({"lat": "51.5", "lon": " -0.12 "}) == Profile(
            user_id="eve", name="Eve", city="Leeds", lat=51.5, lon=-0.12
        )
        conversation = me.start_conversation()
        assert me.working_text(conversation).startswith("profile: user=Eve")
        assert me.export()["profile"]["lat"] == 51.5
        with pytest.raises(TypeError, match=r"put_profile\(\) takes a Profile, got dict; .*merge_profile"):
            me.put_profile({"name": "Mallory"})  # type: ignore[arg-type]
        assert me.get_profile().name == "Eve"


def test_profile_writes_refuse_out_of_range_coordinates_and_unknown_timezones(target: str) -> None:
    """``lat``/``lon`` out of range or not finite and an unknown IANA ``timezone`` are refused on write, with a
    ValueError naming the field (the rule ``/ws``'s ``profile`` follows); a row stored before the rule still loads,
    and a merge of other fields keeps its values as they are."""
    with ContextDB(target) as db:
        me = db.user("eve")
        me.put_profile(Profile(name="Eve", timezone="Europe/London", lat=53.8, lon=-1.55))
        for changes, field in (
            ({"lat": 1000}, "lat"),
            ({"lat": -90.5}, "lat"),
            ({"lon": 180.01}, "lon"),
            ({"lat": float("nan")}, "lat"),
            ({"lon": "inf"}, "lon"),
            ({"lon": float("-inf")}, "lon"),
            ({"name": "Evelyn", "timezone": "Mars/Olympus"}, "timezone"),
            ({"timezone": "Europe"}, "timezone"),
        ):
            with pytest.raises(ValueError, match=f"profile field '{field}': "):
                me.merge_profile(changes)
            with pytest.raises(ValueError, match=f"profile field '{field}': "):
                me.put_profile(Profile(name="Mallory", **{k: v for k, v in changes.items() if k != "name"}))
        stored = Profile(user_id="eve", name="Eve", timezone="Europe/London", lat=53.8, lon=-1.55)
        assert me.get_profile() == stored  # nothing was written
        assert me.merge_profile({"lat": -90, "lon": 180, "timezone": ""}) == stored.model_copy(
            update={"lat": -90.0, "lon": 180.0, "timezone": ""}
        )
        legacy = Profile(user_id="eve", name="Eve", timezone="Mars/Olympus", lat=1000.0, lon=-500.0)
        with me._write() as tx:  # a row an earlier version stored
            me._store_profile(tx, legacy, 1.0)
        loaded = me.get_profile()
        assert (loaded.timezone, loaded.lat, loaded.lon) == ("Mars/Olympus", 1000.0, -500.0)
        merged = me.merge_profile({"notes": "likes tea"})
        assert (merged.notes, merged.timezone, merged.lat, merged.lon) == ("likes tea", "Mars/Olympus", 1000.0, -500.0)
        assert me.get_profile().notes == "likes tea"


def test_facts_and_turns_have_the_memory_tools_limits(target: str) -> None:
    """``set_fact`` and ``add_turn`` refuse what the ``remember_fact`` tool refuses (an empty key or value, one over
    its limits; one definition of each) and ``None`` or a 10 MB text, with a ValueError naming the argument, before
    anything is written (``None`` used to surface as "NOT NULL constraint failed")."""
    from cspan.backends.context_db.models import MAX_FACT_KEY_CHARS, MAX_FACT_VALUE_CHARS, MAX_TURN_CHARS
    from cspan.backends.tools.catalog import memory_tools

    remember = next(tool for tool in memory_tools(None) if tool.name == "remember_fact")  # type: ignore[arg-type]
    schema = remember.parameters.model_json_schema()["properties"]
    assert (schema["key"]["maxLength"], schema["value"]["maxLength"]) == (MAX_FACT_KEY_CHARS, MAX_FACT_VALUE_CHARS)
    assert (schema["key"]["minLength"], schema["value"]["minLength"]) == (1, 1)
    with ContextDB(target) as db:
        me = db.user("eve")
        for key, value, argument in (
            ("", "tea", "key"),
            ("   ", "tea", "key"),
            (None, "tea", "key"),
            ("k" * (MAX_FACT_KEY_CHARS + 1), "tea", "key"),
            ("drink", "", "value"),
            ("drink", None, "value"),
            ("drink", 5, "value"),
            ("drink", "v" * (MAX_FACT_VALUE_CHARS + 1), "value"),
            ("drink", "x" * 10_000_000, "value"),
        ):
            with pytest.raises(ValueError, match=f"^{argument} (must|has)"):
                me.set_fact(key, value)  # type: ignore[arg-type]
        assert me.facts() == []
        me.set_fact("k" * MAX_FACT_KEY_CHARS, "v" * MAX_FACT_VALUE_CHARS)
        assert [(f.key, f.value) for f in me.facts()] == [("k" * MAX_FACT_KEY_CHARS, "v" * MAX_FACT_VALUE_CHARS)]
        conversation = me.start_conversation("c1")
        for text in (None, 42, "x" * 10_000_000, "x" * (MAX_TURN_CHARS + 1)):
            with pytest.raises(ValueError, match=r"^text (must|has)"):
                me.add_turn(conversation, "user", text)  # type: ignore[arg-type]
        assert me.turns(conversation) == []
        me.add_turn(conversation, "agent", "x" * MAX_TURN_CHARS)
        assert [len(turn.text) for turn in me.turns(conversation)] == [MAX_TURN_CHARS]


def test_the_times_given_are_the_times_stored(target: str) -> None:
    """A caller whose writes wait for the database passes the events' times: they are stored as given (not the
    write's time); a second start of a conversation keeps the earlier start time (a retrieval's early row gets the
    session's)."""
    with ContextDB(target) as db:
        me = db.user("ada")
        me.start_conversation("c1", started_at=1000.0)
        me.start_conversation("c1", started_at=1200.0)  # a resume: the first start stays
        assert me.get_conversation("c1").started_at == 1000.0
        me.start_conversation("c2")  # a retrieval's early row (now), then the session's own start
        me.start_conversation("c2", started_at=900.0)
        assert me.get_conversation("c2").started_at == 900.0
        me.add_turn("c1", "user", "hello", t=1001.5, frame=12)
        sid = me.add_span("c1", question="hello", text="ref", asked_at=1002.0)
        me.mark_span_injected(sid, injected_at=1003.25, frame=40)
        assert me.end_conversation("c1", ended_at=1010.0)
        assert me.get_conversation("c1").ended_at == 1010.0
        assert [t.t for t in me.turns("c1")] == [1001.5]
        assert (me.spans("c1")[0].asked_at, me.spans("c1")[0].injected_at) == (1002.0, 1003.25)


def test_a_span_row_promised_under_a_provisional_id_gets_the_outcome_marked_before_or_after_it_is_written(
    tmp_path: Path,
) -> None:
    """A retriever that cannot wait for a stalled database hands out a provisional span id for the row it writes
    later; the span's outcome is marked under that id (injected, dropped late or cancelled). Such rows were written
    with no outcome at all: the span had no id to mark."""
    from cspan.backends.context_db import ContextDBError
    from cspan.backends.context_db.user import MAX_PROVISIONAL_SPANS

    with ContextDB(tmp_path / "ctx.sqlite") as db:
        memory = db.user("ada")
        cid = memory.start_conversation()
        early, later, unmarked = (memory.provisional_span_id() for _ in range(3))
        assert early < 0 and len({early, later, unmarked}) == 3
        memory.mark_span_injected(early, injected_at=100.0, frame=12)  # before the row: kept for it
        memory.mark_span_dropped(later, "cancelled", error="conversation ended")
        memory.mark_span_dropped(later, "late")  # the last mark wins, as on a row
        rows = {
            pid: memory.add_span(cid, question=f"q{pid}", text="ref", provisional_id=pid)
            for pid in (early, later, unmarked)
        }
        got = {s.id: s for s in memory.spans(cid)}
        assert (got[rows[early]].injected_at, got[rows[early]].frame, got[rows[early]].dropped) == (100.0, 12, None)
        assert (got[rows[later]].dropped, got[rows[later]].injected_at) == ("late", None)
        assert (got[rows[unmarked]].dropped, got[rows[unmarked]].injected_at) == (None, None)
        memory.mark_span_dropped(unmarked, "cancelled", error="conversation ended")  # after the row: reaches it
        assert memory.spans(cid)[-1].dropped == "cancelled" and memory.spans(cid)[-1].error == "conversation ended"
        with pytest.raises(ContextDBError, match="not a provisional span id"):
            memory.mark_span_injected(-10_000)
        for _ in range(MAX_PROVISIONAL_SPANS):  # bounded: the oldest are forgotten
            memory.provisional_span_id()
        with pytest.raises(ContextDBError, match="not a provisional span id"):
            memory.mark_span_injected(early)
        assert db.user("bob").provisional_span_id() < 0  # each memory its own


def test_a_mark_made_while_the_row_takes_an_earlier_mark_is_not_overwritten_by_it(tmp_path: Path) -> None:
    """Marks under a provisional id are kept in order: the last one wins, as on a row. When the row was written,
    ``add_span`` set the row id first and then wrote the outcome marked before; a mark made in between (another
    thread: the session's queued writes) went straight to the row and was then overwritten by that older outcome."""
    with ContextDB(tmp_path / "ctx.sqlite") as db:
        memory = db.user("ada")
        cid = memory.start_conversation()
        promised = memory.provisional_span_id()
        memory.mark_span_injected(promised, injected_at=100.0, frame=12)  # before the row is written
        update = memory._update_span
        between: list[int] = []

        def racing_update(span_id: int, assignments: str, params: tuple) -> None:
            if span_id > 0 and not between:  # add_span writes the earlier outcome: a later mark comes in meanwhile
                between.append(span_id)
                memory.mark_span_dropped(promised, "late")
            update(span_id, assignments, params)

        memory._update_span = racing_update  # type: ignore[method-assign]
        row = memory.add_span(cid, question="q", text="ref", provisional_id=promised)
        memory._update_span = update  # type: ignore[method-assign]
        assert between == [row]
        (span,) = memory.spans(cid)
        assert (span.dropped, span.injected_at) == ("late", None)  # the later mark, not the earlier one


def test_an_erase_of_a_user_is_not_undone_by_the_rows_of_an_older_spelling(
    target: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``cspan db forget bob`` could not reach the rows an older release stored under ``" bob"`` (the reason for
    schema 5). Schema 5 moved those rows to ``bob`` whatever the erase: what the operator had forgotten (as far as the
    operator could tell) was remembered again, and spoken about in bob's next conversation. Rows of another
    spelling written before the user's erase are deleted instead of moved (logged); later ones join the user."""
    with _database_at_schema(target, 4) as tx:
        tx.execute(  # bob forgotten at 500 (his " bob" rows out of reach)
            "INSERT INTO erasures (user_hash, generation, erased_at) VALUES (?, 1, 500)",
            (hashlib.sha256(b"bob").hexdigest(),),
        )
        tx.execute("INSERT INTO profiles (user_id, name, notes, updated_at) VALUES (' bob', 'Bob', 'HIV+', 100)")
        tx.execute("INSERT INTO facts (user_id, key, value, t) VALUES (' bob', 'diagnosis', 'HIV+', 100)")
        tx.execute("INSERT INTO facts (user_id, key, value, t) VALUES (' bob', 'colour', 'green', 600)")  # after
        for cid, t in (("old", 100.0), ("new", 600.0)):
            tx.execute("INSERT INTO conversations (user_id, id, started_at) VALUES (' bob', ?, ?)", (cid, t))
            tx.execute(
                "INSERT INTO turns (user_id, conversation_id, role, text, t) VALUES (' bob', ?, 'user', ?, ?)",
                (cid, f"said at {t:g}", t + 1),
            )
            tx.execute(
                "INSERT INTO spans (user_id, conversation_id, question, asked_at) VALUES (' bob', ?, 'q', ?)",
                (cid, t + 2),
            )
    with caplog.at_level("WARNING"), ContextDB(target) as db:
        bob = db.user("bob")
        assert bob.get_profile() is None
        assert {f.key: f.value for f in bob.facts()} == {"colour": "green"}
        assert [c.id for c in bob.conversations()] == ["new"]
        assert [t.text for t in bob.turns("new")] == ["said at 600"] and len(bob.spans("new")) == 1
        for table in ("profiles", "facts", "conversations", "turns", "spans"):
            assert db._conn.read(f"SELECT user_id FROM {table} WHERE user_id = ' bob'") == [], table
        assert db._conn.read("SELECT COUNT(*) AS n FROM turns")[0]["n"] == 1
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("before 'bob' was forgotten" in m and "deleted" in m for m in said), said
