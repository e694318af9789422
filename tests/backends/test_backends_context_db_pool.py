"""The Context DB's PostgreSQL connection pool (``context_db.connection.PostgresConnection``), on a real server.

Each statement or transaction takes a connection of its own, so threads run theirs at once (a slow one holds up only
its own thread); a thread inside a write reads and writes on that transaction's connection; a restart or a broken
connection costs at most the statement that was running; ``close()`` leaves no connection behind. Also the writes
that read before they write (a turn with ``dedupe``, ``merge_profile``), which one connection used to serialise.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from postgres_server import PostgresServer, running_postgres

from cspan.backends.context_db import ContextDB, ContextDBError, Profile
from cspan.backends.context_db.connection import POOL_SIZE, PostgresConnection

APP = "cspan-context-db"


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    yield from running_postgres()


_databases = itertools.count()


@pytest.fixture
def url(postgres: PostgresServer) -> str:
    """A new empty database on the test server (its URL carries a password: trust authentication ignores it, and
    no message may show it)."""
    import psycopg

    name = f"pool{next(_databases)}"
    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres.url.replace("cspan@", "cspan:s3cret-pw@").rsplit("/", 1)[0] + "/" + name


def _admin(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """``sql`` on a connection of the test's own (not the pool's)."""
    import psycopg

    with psycopg.connect(url, autocommit=True, application_name="test-admin") as conn:
        return conn.execute(sql, params).fetchall()


def _pool_connections(url: str) -> int:
    """The Context DB's connections to the test's database, from the server's point of view."""
    name = url.rsplit("/", 1)[1]
    rows = _admin(
        url, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND datname = %s", (APP, name)
    )
    return int(rows[0][0])


def _eventually(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def _at_once(*calls: Callable[[], Any], timeout: float = 60.0) -> list[Any]:
    """Run ``calls`` on threads of their own, started together; their results (or exceptions), in order."""
    results: list[Any] = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i: int, call: Callable[[], Any]) -> None:
        barrier.wait()
        try:
            results[i] = call()
        except Exception as exc:  # handed back to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a call did not return"
    return results


def _sleeping(url: str) -> int:
    """How many of the Context DB's connections run a ``pg_sleep`` now."""
    rows = _admin(
        url,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND state = 'active' AND query LIKE %s",
        (APP, "SELECT pg_sleep%"),
    )
    return int(rows[0][0])


def _cancel_sleeps(url: str) -> None:
    """Cancel the Context DB's running ``pg_sleep`` statements (their callers get a ContextDBError)."""
    _admin(
        url,
        "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE application_name = %s AND query LIKE %s",
        (APP, "SELECT pg_sleep%"),
    )


def test_a_slow_statement_holds_up_only_its_own_thread(url: str) -> None:
    """While one thread's statement runs (a minute-long sleep, cancelled at the end), and while another thread
    holds a write transaction open, a third thread's read and write complete (was: every statement waited behind
    the one connection's lock, so they could not finish before the sleep)."""
    with ContextDB(url) as db:
        db.user("ada").put_profile(Profile(name="Ada", city="Leeds"))
        slow_done = threading.Event()

        def slow() -> None:
            with pytest.raises(ContextDBError, match="canceling statement"):
                db._conn.read("SELECT pg_sleep(60)")
            slow_done.set()

        holding, release = threading.Event(), threading.Event()

        def hold() -> None:
            with db._conn.write() as tx:
                tx.execute("INSERT INTO facts (user_id, key, value, source, t) VALUES ('eve', 'k', 'v', 'user', 0)")
                holding.set()
                assert release.wait(30)

        slow_thread = threading.Thread(target=slow)
        hold_thread = threading.Thread(target=hold)
        slow_thread.start()
        hold_thread.start()
        try:
            assert _eventually(lambda: _sleeping(url) == 1) and holding.wait(10)
            assert db.user("ada").get_profile().city == "Leeds"
            db.user("bob").set_fact("city", "Paris")
            assert not slow_done.is_set() and _sleeping(url) == 1  # done while the sleep still runs
            assert _pool_connections(url) == 3  # the sleep's, the open transaction's, the reader's
            assert db.user("eve").facts() == []  # the open transaction's row is not seen by another thread
        finally:
            release.set()
            _cancel_sleeps(url)
            slow_thread.join(30)
            hold_thread.join(30)
        assert [f.value for f in db.user("eve").facts()] == ["v"] and slow_done.is_set()


def test_threads_run_at_once_up_to_the_pool_size(url: str) -> None:
    """Six threads each sleeping in PostgreSQL: with the default pool (6) all six sleep at once; with a pool of 3,
    three sleep and three wait for a connection until the first three end (cancelled here), never more connections
    than the pool's size."""
    assert POOL_SIZE == 6
    for size in (POOL_SIZE, 3):
        with ContextDB(url, pool_size=size) as db:
            ended: list[int] = []

            def sleep(db: ContextDB = db, ended: list[int] = ended) -> str:
                with pytest.raises(ContextDBError, match="canceling statement"):
                    db._conn.read("SELECT pg_sleep(60)")
                ended.append(1)
                return "cancelled"

            done: list[Any] = []
            runner = threading.Thread(target=lambda done=done: done.append(_at_once(*[sleep] * 6)))
            runner.start()
            try:
                for batch in range(6 // size):  # `size` sleep at once, the others wait; then the next `size`
                    assert _eventually(
                        lambda size=size, batch=batch, ended=ended: (
                            _sleeping(url) == size and len(ended) == batch * size
                        )
                    ), (size, batch, _sleeping(url), len(ended))
                    assert _pool_connections(url) <= size
                    _cancel_sleeps(url)
            finally:
                deadline = time.monotonic() + 30
                while runner.is_alive() and time.monotonic() < deadline:
                    _cancel_sleeps(url)
                    runner.join(0.2)
            assert done == [["cancelled"] * 6]
            assert _pool_connections(url) <= size
        assert _eventually(lambda: _pool_connections(url) == 0)


def test_a_read_inside_a_write_sees_the_write_and_takes_no_other_connection(url: str) -> None:
    """A thread inside a write reads on the write's own connection: it sees the transaction's uncommitted row, and
    with a pool of one it neither waits nor deadlocks; a write inside the write is a savepoint of it."""
    with ContextDB(url, pool_size=1) as db:
        memory = db.user("ada")
        with db._conn.write() as tx:
            tx.execute(
                "INSERT INTO profiles (user_id, name, city, updated_at) VALUES ('ada', 'Ada', 'Leeds', ?)", (1.0,)
            )
            # the uncommitted row, on the same connection (with a pool of one, another would wait 30 s and fail)
            assert memory.get_profile().city == "Leeds"
            assert db._conn.read("SELECT count(*) AS n FROM profiles")[0]["n"] == 1
            memory.set_fact("city", "Leeds")  # a nested write: a savepoint, committed with the transaction
            with pytest.raises(ContextDBError, match="duplicate key"), db._conn.write() as inner:
                inner.execute("INSERT INTO profiles (user_id, updated_at) VALUES ('ada', 0)")
            assert memory.get_profile().name == "Ada"  # only the inner savepoint was rolled back
        assert [f.value for f in db.user("ada").facts()] == ["Leeds"] and db.user("ada").get_profile().name == "Ada"
        assert _pool_connections(url) == 1


def test_close_leaves_no_connection(url: str) -> None:
    """``close()`` closes the pool's idle connections at once and one in use when its statement ends; a statement
    after it is a ContextDBError, and reopens nothing."""
    db = ContextDB(url)
    _at_once(*[lambda: db._conn.read("SELECT pg_sleep(0.3)")] * 4)
    assert _pool_connections(url) == 4
    running = threading.Thread(target=lambda: db._conn.read("SELECT pg_sleep(1)"))
    running.start()
    assert _eventually(
        lambda: bool(_admin(url, "SELECT 1 FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(1%%'"))
    )
    db.close()
    assert _eventually(lambda: _pool_connections(url) == 1)  # the running one only
    running.join(10)
    assert _eventually(lambda: _pool_connections(url) == 0)
    with pytest.raises(ContextDBError, match=r"was closed"):
        db.users()
    time.sleep(0.2)
    assert _pool_connections(url) == 0


def test_a_restart_between_statements_costs_none_with_several_connections_idle(
    url: str, postgres: PostgresServer
) -> None:
    """After PostgreSQL restarts, every idle connection of the pool is dead; the next statements of six threads at
    once all succeed (each dead one is replaced before use), twice over."""
    with ContextDB(url) as db:
        db.user("ada").put_profile(Profile(name="Ada", city="Leeds"))
        _at_once(*[lambda: db._conn.read("SELECT pg_sleep(0.2)")] * POOL_SIZE)
        assert _pool_connections(url) == POOL_SIZE
        for city in ("York", "Bath"):
            postgres.restart()
            calls = [lambda: db.user("ada").get_profile().name] * 4
            calls += [lambda city=city: db.user("ada").merge_profile({"city": city}).city] * 2
            assert _at_once(*calls) == ["Ada"] * 4 + [city] * 2
            assert db.user("ada").get_profile().city == city
        assert _pool_connections(url) <= POOL_SIZE


def test_a_broken_connection_fails_its_statement_only(url: str, postgres: PostgresServer) -> None:
    """A connection ended under a running statement fails that statement (a ContextDBError without the password);
    the next statement opens another. A stopped server is an immediate error naming the fix, not a wait, and
    once it is back the next statement connects (no back-off)."""
    with ContextDB(url) as db:
        failed: list[BaseException] = []

        def victim() -> None:
            try:
                db._conn.read("SELECT pg_sleep(10)")
            except ContextDBError as exc:
                failed.append(exc)

        thread = threading.Thread(target=victim)
        thread.start()
        assert _eventually(
            lambda: bool(_admin(url, "SELECT 1 FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(10%%'"))
        )
        _admin(
            url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s AND query LIKE %s",
            (APP, "SELECT pg_sleep(10%"),
        )
        thread.join(10)
        (error,) = failed
        assert "the Context DB at postgresql://cspan:***@127.0.0.1" in str(error) and "terminat" in str(error)
        assert "s3cret" not in str(error)
        assert db.users() == []  # the next statement: another connection

        postgres.stop_server()
        try:
            t0 = time.monotonic()
            with pytest.raises(ContextDBError, match=r"cannot connect to the Context DB at .*Fix: check") as info:
                db.users()
            # refused at once: not a wait for the pool (30 s)
            assert time.monotonic() - t0 < 15 and "s3cret" not in str(info.value)
        finally:
            postgres.start_server()
        db.user("ada").set_fact("city", "Leeds")
        assert [f.value for f in db.user("ada").facts()] == ["Leeds"]


@pytest.mark.timeout(120)
def test_a_frozen_server_makes_a_new_connection_fail_and_a_busy_pool_give_up(
    url: str, postgres: PostgresServer
) -> None:
    """With PostgreSQL frozen (SIGSTOP): a statement that needs a new connection fails after the connect timeout (as
    the one connection's reconnect did), and one that finds every connection busy on the frozen server gives up
    after ``pool_wait_s`` (was: waited on the one connection's lock for as long as the freeze); after SIGCONT the
    statements that were running complete and the pool works."""
    fresh = PostgresConnection(url, connect_timeout_s=1, pool_size=2, pool_wait_s=2)  # one connection open
    busy = PostgresConnection(url, connect_timeout_s=1, pool_size=2, pool_wait_s=2)
    _at_once(*[lambda: busy.read("SELECT pg_sleep(0.2)")] * 2)  # two connections open
    results: list[Any] = []
    running = [
        threading.Thread(target=lambda c=c, n=n: results.append(c.read(f"SELECT {n} AS n")))
        for c, n in ((fresh, 1), (busy, 2), (busy, 3))
    ]
    try:
        postgres.freeze()
        try:
            for thread in running:
                thread.start()  # each takes an open connection; its statement waits on the frozen server
            time.sleep(0.5)
            t0 = time.monotonic()
            with pytest.raises(ContextDBError, match=r"cannot connect to the Context DB .*: connection timeout"):
                fresh.read("SELECT 4 AS n")  # a new connection: the server never answers its hello
            assert time.monotonic() - t0 < 8
            t0 = time.monotonic()
            with pytest.raises(ContextDBError, match=r"all 2 connections stayed busy for 2 s\. Fix: check"):
                busy.read("SELECT 5 AS n")
            assert 1.9 < time.monotonic() - t0 < 10  # pool_wait_s, not the freeze
        finally:
            postgres.thaw()
        for thread in running:
            thread.join(30)
        assert sorted(r[0]["n"] for r in results) == [1, 2, 3]
        assert fresh.read("SELECT 6 AS n") == [{"n": 6}] and busy.read("SELECT 7 AS n") == [{"n": 7}]
    finally:
        fresh.close()
        busy.close()
    assert _eventually(lambda: _pool_connections(url) == 0)


def test_a_transcript_and_its_retrievals_copy_at_once_are_one_turn(url: str) -> None:
    """The session's final transcript and the retrieval's copy of the same utterance (``dedupe``), written on two
    threads at once, are one turn, as when one connection took them in turn: the second waits for the first's
    commit (the conversation's row lock) and finds its turn."""
    with ContextDB(url) as db:
        memory = db.user("ada")
        cid = memory.start_conversation()
        for i in range(30):
            text = f"what is the weather in place {i}"
            ids = _at_once(
                lambda text=text: memory.add_turn(cid, "user", text, dedupe=True),
                lambda text=text, i=i: memory.add_turn(cid, "user", text, frame=100 + i, dedupe=True),
            )
            assert ids[0] == ids[1], (i, ids)
        turns = memory.turns(cid)
        assert len(turns) == 30 and [t.frame for t in turns] == [100 + i for i in range(30)]


def test_two_merges_of_a_new_users_profile_at_once_keep_both(url: str) -> None:
    """Two sessions of a user without a stored profile merge a field each at once: both fields are kept (the
    second merge waits for the first's row and overlays it, instead of writing its own over an empty one)."""
    with ContextDB(url) as db:
        for i in range(20):
            memory = db.user(f"u{i}")
            _at_once(
                lambda m=memory: m.merge_profile({"name": "Ada"}), lambda m=memory: m.merge_profile({"city": "Leeds"})
            )
            profile = memory.get_profile()
            assert (profile.name, profile.city) == ("Ada", "Leeds"), i
