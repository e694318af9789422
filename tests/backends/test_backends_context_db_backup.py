"""docs/OPERATORS.md's "Upgrading": the backup and restore commands it gives, run as written (only the paths and the
database's address changed), on SQLite with Debian's ``sqlite3`` and on PostgreSQL with ``pg_dump``/``pg_restore``.

A backup must hold what the Context DB held, a mistyped path must fail (status 1) rather than back up a new empty
database with status 0, and a restore after an upgrade must give back the database as it was, the upgrade's own
tables and rows gone.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from postgres_server import PostgresServer, running_postgres

from cspan.backends.context_db import ContextDB
from cspan.backends.context_db.store import SCHEMA_VERSION

OPERATORS = Path(__file__).resolve().parents[2] / "docs" / "OPERATORS.md"


def upgrading_commands() -> list[str]:
    """The inline commands of the paragraph that opens "Upgrading" (before its list), lines rejoined."""
    section = OPERATORS.read_text().split("\n## Upgrading: ", 1)[1].split("\n## ", 1)[0]
    paragraph = section.split("\n\n")[1].replace("\n", " ")
    return re.findall(r"`((?:sqlite3|pg_dump|pg_restore|dropdb) [^`]*)`", paragraph)


def documented(program: str, verb: str) -> list[str]:
    """The documented command line of ``program`` containing ``verb``, split as a shell would."""
    (command,) = [c for c in upgrading_commands() if c.startswith(program + " ") and verb in c]
    return shlex.split(command)


def with_tokens(target: str, *users: str) -> None:
    db = ContextDB(target)
    try:
        for user in users:
            db.add_token(f"id-{user}", user, "0" * 64, scopes=["session"])
    finally:
        db.close()


def token_users(target: str) -> list[str]:
    db = ContextDB(target, read_only=True)
    try:
        assert db.schema_version() == SCHEMA_VERSION
        return sorted(t.user_id for t in db.tokens())
    finally:
        db.close()


def sqlite3_or_skip() -> str:
    found = shutil.which("sqlite3")
    if found is None:
        pytest.skip("the sqlite3 command-line shell is not installed")
    return found


def test_the_documented_sqlite_backup_holds_the_db_and_refuses_a_mistyped_path(tmp_path: Path) -> None:
    sqlite3_or_skip()
    backup = documented("sqlite3", ".backup")
    assert backup[-1] == ".backup context-before-upgrade.sqlite", backup
    db = tmp_path / "data" / "context.sqlite"
    db.parent.mkdir()
    with_tokens(str(db), "ada")

    # a path that is not the database (run from another folder, a typo): an error, and nothing created
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    wrong = [elsewhere / "context.sqlite" if a == "/path/to/context.sqlite" else a for a in backup]
    done = subprocess.run(wrong, cwd=elsewhere, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "unable to open database" in done.stderr, done
    assert not (elsewhere / "context.sqlite").exists(), "an empty database was made at the mistyped path"

    # the database's own path, while a connection holds it open (a running server): the backup holds its rows
    live = ContextDB(str(db))
    try:
        right = [str(db) if a == "/path/to/context.sqlite" else a for a in backup]
        subprocess.run(right, cwd=tmp_path, check=True, capture_output=True, timeout=60)
    finally:
        live.close()
    assert token_users(str(tmp_path / "context-before-upgrade.sqlite")) == ["ada"]

    # what the upgraded release wrote (a row, a table) is gone after the documented restore
    with_tokens(str(db), "bob")
    subprocess.run(["sqlite3", str(db), "CREATE TABLE newer (x INTEGER)"], check=True, timeout=60)
    restore = [str(db) if a == "/path/to/context.sqlite" else a for a in documented("sqlite3", ".restore")]
    subprocess.run(restore, cwd=tmp_path, check=True, capture_output=True, timeout=60)
    assert token_users(str(db)) == ["ada"]
    tables = subprocess.run(["sqlite3", str(db), ".tables"], check=True, capture_output=True, text=True).stdout
    assert "newer" not in tables.split(), tables


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    yield from running_postgres()


def test_the_documented_postgresql_backup_and_restore_give_back_the_db(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    import psycopg

    url = postgres.url
    with_tokens(url, "ada")
    dump = documented("pg_dump", "-Fc")
    assert dump[-1] == "postgresql://...", dump
    run_as = {"cwd": tmp_path}
    subprocess.run([*dump[:-1], url], check=True, capture_output=True, timeout=120, **run_as)  # type: ignore[call-overload]
    assert (tmp_path / "cspan-before-upgrade.dump").stat().st_size > 0

    # the upgrade: a row and a table the older release does not know
    with_tokens(url, "bob")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE newer (x INTEGER)")

    connection = ["-h", "127.0.0.1", "-p", str(postgres.port), "-U", postgres.user]
    (recreate,) = [c for c in upgrading_commands() if c.startswith("dropdb ")]
    for step in recreate.split(" && "):
        program, name = shlex.split(step)
        assert name == "NAME", recreate
        subprocess.run([program, *connection, postgres.database], check=True, capture_output=True, timeout=120)
    restore = documented("pg_restore", "-d")
    assert restore[-2:] == ["postgresql://.../NAME", "cspan-before-upgrade.dump"], restore
    subprocess.run([*restore[:-2], url, restore[-1]], check=True, capture_output=True, timeout=120, **run_as)  # type: ignore[call-overload]
    assert token_users(url) == ["ada"]
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT to_regclass('newer')").fetchone() == (None,)
