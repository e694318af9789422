"""A Context DB that does not answer stalls no conversation (``cspan.server.db_calls``).

A session's writes run on the Context DB's own threads, in order; what the session sends while one is pending is
held behind it, so a client sees a final transcript or a span only once its row is committed, in the order it
would have seen it. Past ``--db-wait-s`` the session stops holding and its writes wait for the database. The frame
loop never waits: the other sessions, and the session itself, keep their 80 ms clock.

Two tests with the real parts: a server in this process on a SQLite file whose writes of one user wait on a gate
(the tiny checkpoint, uvicorn, the local router over the user's memory), and a real ``cspan serve`` process on a
real PostgreSQL frozen with SIGSTOP mid-conversation (then SIGCONT)."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import websockets
from serve_client import Client, ServerThread, load_frames
from serve_process import ServeProcess, serve_args

from cspan.backends.asr import Transcript
from cspan.backends.context_db import ContextDB, ContextDBError, Profile, UserMemory
from cspan.backends.identity import issue_token

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "backends"))
from postgres_server import PostgresServer, running_postgres  # noqa: E402

SILENCE = np.zeros(1920, dtype=np.float32)
FRAMES_PER_S = 12.5


class FixedTranscriber:
    """Hears ``text`` in any audio (the test changes it as it goes)."""

    def __init__(self, text: str) -> None:
        self.text = text

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> Transcript:
        return Transcript(text=self.text)


EVENT_WRITES = frozenset({"add_turn", "mark_span_injected"})
ALL_CALLS = EVENT_WRITES | {"get_profile", "merge_profile", "start_conversation", "end_conversation"}


class Gate:
    """Holds the Context DB calls named in ``calls`` of one user while closed (by default the writes a session's
    events make: a user turn with its frame, a span marked injected); ``entered`` is set when one waits."""

    def __init__(self, user: str, calls: frozenset[str] = EVENT_WRITES) -> None:
        self.user = user
        self.calls = calls
        self.is_open = threading.Event()
        self.is_open.set()
        self.entered = threading.Event()
        self.away = False  # the calls fail at once (PostgreSQL stopped: connection refused), rather than wait

    def close(self) -> None:
        self.entered.clear()
        self.is_open.clear()

    def open(self) -> None:
        self.is_open.set()

    def wait(self, memory: UserMemory, call: str) -> None:
        if memory.user_id == self.user and call in self.calls and self.away:
            raise ContextDBError(f"{call}: the database is away (connection refused)")
        if memory.user_id == self.user and call in self.calls and not self.is_open.is_set():
            self.entered.set()
            assert self.is_open.wait(120), "the gate was never opened"


class GatedMemory(UserMemory):
    gate: Gate

    def add_turn(self, conversation_id: str, role: Any, text: str, **kwargs: Any) -> int:
        if kwargs.get("frame") is not None:  # the session's record of a final transcript (the retriever's has none)
            self.gate.wait(self, "add_turn")
        return super().add_turn(conversation_id, role, text, **kwargs)

    def mark_span_injected(self, span_id: int, **kwargs: Any) -> None:
        self.gate.wait(self, "mark_span_injected")
        super().mark_span_injected(span_id, **kwargs)

    def get_profile(self) -> Any:
        self.gate.wait(self, "get_profile")
        return super().get_profile()

    def merge_profile(self, changes: Any) -> Any:
        self.gate.wait(self, "merge_profile")
        return super().merge_profile(changes)

    def start_conversation(self, conversation_id: str | None = None, **kwargs: Any) -> str:
        self.gate.wait(self, "start_conversation")
        return super().start_conversation(conversation_id, **kwargs)

    def end_conversation(self, conversation_id: str, **kwargs: Any) -> bool:
        self.gate.wait(self, "end_conversation")
        return super().end_conversation(conversation_id, **kwargs)


class GatedDB(ContextDB):
    """A real SQLite Context DB whose memories are :class:`GatedMemory`."""

    def __init__(self, path: Path, gate: Gate) -> None:
        super().__init__(path)
        self.gate = gate

    def user(self, principal: Any) -> UserMemory:
        user_id = principal if isinstance(principal, str) else principal.user_id
        memory = GatedMemory(self._conn, user_id, executor=self.executor)
        memory.gate = self.gate
        return memory


def gated_server(tiny_checkpoint: Any, path: Path, gate: Gate, **settings: Any) -> ServerThread:
    """A started server on the SQLite file ``path`` whose Context DB calls go through ``gate`` (one session, no
    ASR: every utterance is heard as "yes"); ``settings``: more :class:`ServeSettings` fields."""
    from cspan.server.serve import ServeSettings, create_app

    config = ServeSettings(
        asr="none", test_hooks=True, max_sessions=1, db=str(path), text_prompt="You are a helpful assistant.",
        max_queued_frames=250, **settings,
    )  # fmt: skip
    app = create_app(config, checkpoint=tiny_checkpoint, db=GatedDB(path, gate), transcriber=FixedTranscriber("yes"))
    return ServerThread(app, config).start()


class Live:
    """A started client whose messages a task reads (each stamped with its arrival time), while another sends audio
    at the real-time pace: the frames given to :meth:`say`, else silence."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._base = len(client.received.items)  # what was received before (ready)
        self.stamps: list[float] = []
        self._script: list[np.ndarray] = []
        self._tasks: list[asyncio.Task[None]] = []

    def go(self) -> Live:
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._send())]
        return self

    def say(self, frames: list[np.ndarray]) -> None:
        self._script.extend(frames)

    async def _read(self) -> None:
        while True:
            await self.client.recv(timeout=600)
            self.stamps.append(time.monotonic())

    async def _send(self) -> None:
        due = time.monotonic()
        while True:
            frame = self._script.pop(0) if self._script else SILENCE
            await self.client.ws.send(np.ascontiguousarray(frame, dtype="<f4").tobytes())
            due += 1 / FRAMES_PER_S
            await asyncio.sleep(max(0.0, due - time.monotonic()))

    def items(self) -> list[tuple[float, str, Any]]:
        items = self.client.received.items[self._base :]
        return [(t, kind, msg) for t, (kind, msg) in zip(self.stamps, items, strict=False)]

    def audio_between(self, t0: float, t1: float) -> int:
        return sum(1 for t, kind, _ in self.items() if kind == "audio" and t0 <= t < t1)

    def first(self, predicate: Callable[[dict[str, Any]], bool]) -> tuple[float, dict[str, Any]] | None:
        return next(((t, m) for t, kind, m in self.items() if kind == "json" and predicate(m)), None)

    async def until(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> tuple[float, dict]:
        """The first JSON message ``predicate`` accepts and when it arrived, waiting at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while (found := self.first(predicate)) is None:
            assert time.monotonic() < deadline, f"not received; got {self.client.received.types()[-30:]}"
            await asyncio.sleep(0.02)
        return found

    async def stop(self) -> dict[str, Any]:
        """Stop reading and sending, then ``stop`` the session; its ``bye``."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        return await self.client.stop()


async def event_set(event: threading.Event, timeout: float) -> float:
    """Wait (without blocking the loop) for ``event``; when it was seen set."""
    deadline = time.monotonic() + timeout
    while not event.is_set():
        assert time.monotonic() < deadline, "not reached in time"
        await asyncio.sleep(0.01)
    return time.monotonic()


def is_final(m: dict[str, Any]) -> bool:
    return m["type"] == "user_text" and m["final"]


async def test_session_writes_go_in_order_and_what_follows_them_waits(caplog: pytest.LogCaptureFixture) -> None:
    """:class:`~cspan.server.db_calls.SessionWrites` alone: writes run one at a time in order on the ``cspan-db``
    threads; a message put while one is pending is sent once the write before it is done, in order; none pending,
    it goes straight out. Past the bound what is held goes out and nothing is held until the queue empties; a
    failed write is logged and the next ones go on; a queue over its bound drops and counts; a refusal (the user
    forgotten) calls ``on_forgotten`` once and drops what follows; the shutdown gives up on a write that hangs."""
    from cspan.backends.context_db import UserForgotten
    from cspan.server.db_calls import WRITES_PER_SESSION, DBCalls
    from cspan.server.metrics import ServerMetrics

    metrics = ServerMetrics(1)
    calls = DBCalls(0.3, metrics)
    assert all(t.daemon and t.name.startswith("cspan-db-") for t in calls.executor._threads)
    sent: list[str] = []
    done: list[str] = []
    refusals: list[bool] = []
    writes = calls.session("s1", send=sent.append, on_forgotten=lambda: refusals.append(True))
    go = threading.Event()

    def slow(name: str) -> None:
        assert go.wait(10)
        done.append(name)

    def failing() -> None:
        raise RuntimeError("disk full")

    def count(name: str) -> float:
        return metrics.registry.get_sample_value("cspan_db_write_failures_total", {"reason": name}) or 0.0

    with caplog.at_level(logging.WARNING, logger="cspan.server.db_calls"):
        assert not writes.hold("a")  # no write pending: straight out
        writes.write("write one", slow, "w1")
        writes.write("write two", done.append, "w2")
        assert writes.hold("b")
        writes.write("write three", failing)
        writes.write("write four", done.append, "w4")
        assert writes.hold("c") and writes.pending == 4
        await asyncio.sleep(0.1)
        assert sent == [] and done == []
        go.set()
        assert await writes.settle(5)
        assert done == ["w1", "w2", "w4"] and sent == ["b", "c"] and count("failed") == 1
        assert [r.getMessage() for r in caplog.records] == [
            "session s1: Context DB: could not write three: disk full",
            "session s1: the Context DB writes again; 1 write(s) in a row had failed before (not recorded)",
        ]
        caplog.clear()  # a streak of failures (a PostgreSQL restart): its first one logged, then one line at its end
        for n in range(5):
            writes.write(f"write failing {n}", failing)
        writes.write("write after", done.append, "after")
        assert await writes.settle(5)
        assert count("failed") == 6 and done[-1] == "after"
        assert [r.getMessage() for r in caplog.records] == [
            "session s1: Context DB: could not write failing 0: disk full",
            "session s1: the Context DB writes again; 5 write(s) in a row had failed before (not recorded)",
        ]
        done.remove("after")

        go.clear()  # past the bound: what is held goes out, nothing more is held, the writes wait in order
        writes.write("write five", slow, "w5")
        assert writes.hold("d")
        await asyncio.sleep(0.5)
        assert sent[-1] == "d" and not writes.hold("e")
        assert "has not answered in 0.3 s" in caplog.records[-1].getMessage()
        for _ in range(WRITES_PER_SESSION + 2):
            writes.write("write more", done.append, "more")
        assert writes.pending == WRITES_PER_SESSION and count("dropped") == 3
        go.set()
        assert await writes.settle(5)
        assert done[3:5] == ["w5", "more"] and len(done) == 3 + WRITES_PER_SESSION
        last = caplog.records[-1].getMessage()
        assert "answers again" in last and "3 were dropped" in last
        assert writes.hold("f") is False  # nothing pending

        def refused() -> None:
            raise UserForgotten("ada was forgotten")

        go.clear()
        writes.write("write six", slow, "w6")
        writes.write("store the profile", refused)
        assert writes.hold("g")
        writes.write("write seven", done.append, "w7")
        assert writes.hold("h")
        go.set()
        assert await writes.settle(5)
        assert refusals == [True] and sent[-2:] == ["g", "h"] and "w7" not in done
        writes.write("write eight", done.append, "w8")  # refused before: not even queued
        assert writes.pending == 0 and "w8" not in done

        hung = calls.session("s2", send=sent.append, on_forgotten=lambda: None)
        go.clear()
        hung.write("write nine", slow, "w9")
        hung.write("write ten", done.append, "w10")
        await calls.close(0.2)
        assert "gave up 2 write(s) of 1 session(s)" in caplog.records[-1].getMessage()
        assert count("dropped") == 3 + 2
        go.set()  # the running one ends; the one behind it finds the pool shut: not run, not logged again
        assert await hung.settle(5)
        assert "w10" not in done and count("failed") == 6 and "gave up" in caplog.records[-1].getMessage()
    assert metrics.registry.get_sample_value("cspan_db_writes_pending") == 0.0


@pytest.mark.timeout(300)
async def test_a_pending_write_holds_its_sessions_messages_and_no_frame(
    tiny_checkpoint: Any, fixture_file, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ada's and bob's sessions run; ada's writes wait on a gate. (1) Her span's write waits: the span and what
    follows it reach her only once the gate opens and the row is committed, in the order of the frames (the span
    before the frame whose head read it), while the frame loop keeps stepping her session and bob's frames keep
    arriving at the real-time pace. (2) Her final transcript's write waits past ``--db-wait-s``: the session then
    sends what it held (the transcript, not recorded yet) and its frames flow at the real-time pace, the write
    still waiting; when the gate opens it is written, and the session holds again."""
    wait_s = 2.5
    path = tmp_path / "context.sqlite"
    with ContextDB(path) as db:
        tokens = {user: issue_token(db, user)[1] for user in ("ada", "bob")}
        db.user("ada").set_fact("locker_code", "ada-4711")
    from cspan.server.serve import ServeSettings, create_app

    settings = ServeSettings(
        asr="none", router="local", tools="clock,memory", test_hooks=True, max_sessions=2, db=str(path),
        text_prompt="You are a helpful assistant.", max_queued_frames=250, db_wait_s=wait_s,
    )  # fmt: skip
    gate = Gate("ada")
    transcriber = FixedTranscriber("what is my locker code")
    app = create_app(settings, checkpoint=tiny_checkpoint, db=GatedDB(path, gate), transcriber=transcriber)
    server = ServerThread(app, settings).start()
    speech = load_frames(fixture_file("audio", "question_weather_24k.wav"))
    try:
        with caplog.at_level(logging.WARNING, logger="cspan.server.db_calls"):
            async with (
                websockets.connect(f"{server.ws_url}?token={tokens['ada']}", max_size=None) as ws_ada,
                websockets.connect(f"{server.ws_url}?token={tokens['bob']}", max_size=None) as ws_bob,
            ):
                bob = Client(ws_bob)
                assert (await bob.start())["type"] == "ready"
                bob_live = Live(bob).go()
                gate.close()
                ada = Client(ws_ada)
                ready = await ada.start(test={"force_ret_at": [0.8]})
                assert ready["type"] == "ready"  # the start's writes are not gated
                ada_live = Live(ada).go()
                (session,) = [s for s in server.hub.sessions if s.principal.user_id == "ada"]

                # (1) the span's write waits: ada gets nothing more, her session and bob's step on
                entered = await event_set(gate.entered, 60)
                stepped = session.stats.frames
                await asyncio.sleep(1.5)
                opened = time.monotonic()
                assert session.stats.frames - stepped >= 10  # the frame loop stepped her session meanwhile
                assert ada_live.audio_between(entered + 0.3, opened) == 0  # held behind the write
                assert bob_live.audio_between(entered + 0.3, opened) >= 0.6 * 1.2 * FRAMES_PER_S
                assert ada_live.first(lambda m: m["type"] == "span") is None
                gate.open()
                arrived, span = await ada_live.until(lambda m: m["type"] == "span", 10)
                assert arrived >= opened and "ada-4711" in span["text"]
                with ContextDB(path) as check:  # committed before it was sent
                    (row,) = [s for s in check.user("ada").spans(ready["conversation_id"]) if s.text]
                    assert row.injected_at is not None and row.frame == span["frame"]
                kinds = [kind for _, kind, m in ada_live.items() if kind == "audio" or m["type"] == "span"]
                assert kinds.index("json") == span["frame"]  # frames 0 .. k-1, the span, frame k: as sent unheld
                assert not [r for r in caplog.records if "has not answered" in r.getMessage()]

                # (2) the final transcript's write waits past the bound: what was held goes out, frames flow
                await asyncio.sleep(1.0)  # what was held went out
                transcriber.text = "I live in Leeds"  # not the question's turn again (a turn is not stored twice)
                gate.close()
                ada_live.say(speech)
                entered = await event_set(gate.entered, 60)
                arrived, final = await ada_live.until(is_final, wait_s + 3.0)
                assert entered + wait_s - 0.5 <= arrived, "sent before the bound while its write waited"
                assert [r for r in caplog.records if "has not answered in 2.5 s" in r.getMessage()]
                with ContextDB(path) as check:  # sent, not recorded yet: the write still waits
                    assert final["text"] not in [t.text for t in check.user("ada").turns(ready["conversation_id"])]
                await asyncio.sleep(1.5)
                assert ada_live.audio_between(arrived + 0.2, arrived + 1.2) >= 0.6 * FRAMES_PER_S
                assert bob_live.audio_between(entered, arrived + 1.2) >= 0.6 * (arrived + 1.2 - entered) * FRAMES_PER_S
                gate.open()
                deadline = time.monotonic() + 10
                while not [r for r in caplog.records if "answers again" in r.getMessage()]:
                    assert time.monotonic() < deadline, "the write never went through"
                    await asyncio.sleep(0.05)
                assert session.writes.pending == 0  # nothing pending: a message goes straight out again

                ada_bye = await ada_live.stop()
                assert ada_bye["reason"] == "stop"
                assert (await bob_live.stop())["reason"] == "stop"
        with ContextDB(path) as check:
            memory = check.user("ada")
            (conversation,) = memory.conversations()
            assert conversation.id == ready["conversation_id"] and conversation.ended_at is not None
            assert final["text"] in [t.text for t in memory.turns(conversation.id) if t.role == "user"]
        body = server.hub.metrics.render()[0].decode()
        assert 'cspan_db_write_failures_total{reason="failed"} 0.0' in body
        assert "cspan_db_writes_pending 0.0" in body
    finally:
        server.stop()


SHARED_TOKEN = "shared-token-0123456789"
KIOSK_TOKEN = "kiosk-token-0123456789"


@pytest.mark.timeout(120)
async def test_static_credentials_need_no_database_thread(
    tiny_checkpoint: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every ``cspan-db`` thread is stuck (each waits on an event, as on a frozen PostgreSQL): the shared ``--token``
    and a token-file credential still start conversations (``ready``) and read ``/metrics`` (200, with the
    ``cspan_db_*`` metrics), checked on the event loop; a client with no token gets 4401 at once, one with an issued
    token 1013 (it needs the database). A session's recheck waits for its one check on the database instead of
    starting another each round. A session ended by the shutdown while its client still sends audio gets ``bye``
    ``shutdown`` (close 1001) and no ``stopping`` error (it never sent ``stop``)."""
    from cspan.server import app as app_module
    from cspan.server.db_calls import DB_THREADS
    from cspan.server.serve import ServeSettings, create_app

    monkeypatch.setattr(app_module, "CREDENTIAL_RECHECK_S", 0.2)
    asked: list[str] = []  # the user of each memory check a recheck asked the database for
    was_forgotten = UserMemory.awas_forgotten

    async def counted(memory: UserMemory) -> bool:
        asked.append(memory.user_id)
        return await was_forgotten(memory)

    monkeypatch.setattr(UserMemory, "awas_forgotten", counted)
    path = tmp_path / "context.sqlite"
    with ContextDB(path) as db:
        issued = issue_token(db, "ada")[1]
    token_file = tmp_path / "tokens.toml"
    token_file.write_text(f'[[token]]\nuser = "kiosk"\ntoken = "{KIOSK_TOKEN}"\n')
    settings = ServeSettings(
        asr="none", router="none", max_sessions=2, db=str(path), token=SHARED_TOKEN, token_file=token_file,
        db_wait_s=0.5, idle_timeout_s=600,
    )  # fmt: skip
    app = create_app(settings, checkpoint=tiny_checkpoint, transcriber=None, retriever=None)
    server = ServerThread(app, settings).start()
    hub = server.hub
    stuck = threading.Event()
    try:
        for _ in range(DB_THREADS):
            hub.db_calls.executor.submit(stuck.wait, 60)
        deadline = time.monotonic() + 5
        while hub.db_calls.executor._work.qsize():  # every thread took one
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)

        async with httpx.AsyncClient(base_url=server.url, timeout=5.0) as http:
            t0 = time.monotonic()
            answer = await http.get("/metrics", headers={"Authorization": f"Bearer {SHARED_TOKEN}"})
            assert answer.status_code == 200 and "cspan_db_writes_pending" in answer.text
            assert time.monotonic() - t0 < 0.4  # not after --db-wait-s: no database asked
            assert (await http.get("/metrics")).status_code == 401
            assert (await http.get("/info")).json()["token_required"] is True

        t0 = time.monotonic()
        async with websockets.connect(server.ws_url, max_size=None) as ws:  # no token: never valid here
            closed = await Client(ws).until_closed(timeout=5)
        assert closed.rcvd is not None and closed.rcvd.code == 4401 and "missing token" in closed.rcvd.reason
        assert time.monotonic() - t0 < 0.4
        async with websockets.connect(f"{server.ws_url}?token={issued}", max_size=None) as ws:  # needs the database
            closed = await Client(ws).until_closed(timeout=5)
        assert closed.rcvd is not None and closed.rcvd.code == 1013, closed

        async with (
            websockets.connect(f"{server.ws_url}?token={SHARED_TOKEN}", max_size=None) as ws_shared,
            websockets.connect(f"{server.ws_url}?token={KIOSK_TOKEN}", max_size=None) as ws_kiosk,
        ):
            shared, kiosk = Client(ws_shared), Client(ws_kiosk)
            assert (await shared.start())["type"] == "ready"
            assert (await kiosk.start())["type"] == "ready"
            (session,) = [s for s in hub.sessions if s.principal.user_id == "kiosk"]
            live = Live(kiosk).go()
            await asyncio.sleep(2.0)  # ten rounds of the recheck: one check waits on the database, no other started
            assert sorted(asked) == ["kiosk", "local"], asked
            assert session.state == "live"  # the static credential was checked again: not revoked

            loop = hub._task.get_loop()  # the shutdown ends every session while the kiosk's audio keeps coming
            ending = asyncio.run_coroutine_threadsafe(hub.end_all("shutdown"), loop)
            _, bye = await live.until(lambda m: m["type"] == "bye", 15)
            assert bye["reason"] == "shutdown"
            await asyncio.to_thread(ending.result, 15)
            for task in live._tasks:
                task.cancel()
            closed = await kiosk.until_closed(timeout=5)
            assert closed.rcvd is not None and closed.rcvd.code == 1001
            assert session.state == "closed" and session._stopping_reported is False
            errors = [m for m in kiosk.received.json("error") if m["code"] == "stopping"]
            assert errors == []
            _, bye = await shared.recv_until(lambda k, m: k == "json" and m["type"] == "bye", 10)
            assert bye["reason"] == "shutdown"
    finally:
        stuck.set()


@pytest.mark.timeout(300)
async def test_what_a_stall_delays_is_stored_as_it_happened(tiny_checkpoint: Any, fixture_file, tmp_path: Path) -> None:
    """Eve's Context DB answers nothing (every call of hers waits on a gate) from before her start to after her
    end. Her start cannot read the stored profile (the session goes on with her client's fields alone), she says
    "yes" twice, she stops; then the database answers. Stored: her profile's fields the client did not give are
    still there (the start wrote only the fields given), both "yes" turns (two utterances), and the times of the
    start, the turns and the end as they happened, not as the writes ran (after the thaw)."""
    wait_s = 1.0
    path = tmp_path / "context.sqlite"
    with ContextDB(path) as db:
        token = issue_token(db, "eve")[1]
        db.user("eve").put_profile(Profile(name="Eve Old", city="Leeds", notes="allergic to nuts", persona="old"))
    gate = Gate("eve", ALL_CALLS)
    server = gated_server(tiny_checkpoint, path, gate, router="local", tools="clock", db_wait_s=wait_s)
    speech = load_frames(fixture_file("audio", "question_weather_24k.wav"))
    try:
        async with websockets.connect(f"{server.ws_url}?token={token}", max_size=None) as ws:
            client = Client(ws)
            gate.close()
            asked = time.time()
            ready = await client.start(profile={"name": "Eve"})
            readied = time.time()
            assert ready["type"] == "ready" and gate.entered.is_set()
            (session,) = server.hub.sessions
            assert (session.profile.name, session.profile.city, session.profile.notes) == ("Eve", "", "")
            live = Live(client).go()
            live.say(speech + [SILENCE] * 25 + speech)
            finals: list[int] = []
            heard: list[float] = []  # when each final arrived (wall clock)
            while len(finals) < 2:  # sent at once: the session stopped holding (its start's writes wait)
                arrived, final = await live.until(lambda m: is_final(m) and m["frame"] not in finals, 60)
                finals.append(final["frame"])
                heard.append(time.time() - (time.monotonic() - arrived))
            stopped = time.time()
            assert (await live.stop())["reason"] == "stop"
            ended = time.time()
        await asyncio.sleep(1.0)
        opened = time.time()
        gate.open()
        await _writes_done(server)
        with ContextDB(path) as check:
            memory = check.user("eve")
            stored = memory.get_profile()
            assert (stored.name, stored.city, stored.notes) == ("Eve", "Leeds", "allergic to nuts")
            assert stored.persona == "You are a helpful assistant."
            conversation = memory.get_conversation(ready["conversation_id"])
            assert asked <= conversation.started_at <= readied < opened
            assert stopped <= conversation.ended_at <= ended < opened
            turns = [t for t in memory.turns(conversation.id) if t.role == "user"]
            assert [(t.text, t.frame) for t in turns] == [("yes", finals[0]), ("yes", finals[1])]
            for turn, seen in zip(turns, heard, strict=True):  # the time the final was published
                assert readied < turn.t <= seen + 0.01 and seen - 0.5 < turn.t
    finally:
        server.stop()


async def _writes_done(server: Any, timeout: float = 20.0) -> None:
    """Wait until no session of ``server`` has a Context DB write pending."""
    deadline = time.monotonic() + timeout
    while server.hub.db_calls._busy:
        assert time.monotonic() < deadline, "the writes never went through"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(180)
async def test_a_conversation_started_while_the_database_is_away_is_recorded_once_it_is_back(
    tiny_checkpoint: Any, fixture_file, tmp_path: Path
) -> None:
    """Eve's Context DB refuses every call at once (PostgreSQL stopped) when she starts: her profile and
    conversation row are not written, and her first final transcript is lost with the outage. Once the database is
    back, the session's next write writes the start first: her conversation row (with its start time and settings),
    her profile's fields, her second turn and her end are stored (was: none of it, every turn refused for want of
    its conversation row)."""
    path = tmp_path / "context.sqlite"
    with ContextDB(path) as db:
        token = issue_token(db, "eve")[1]
    gate = Gate("eve", ALL_CALLS)
    server = gated_server(tiny_checkpoint, path, gate, router="none", db_wait_s=1.0)
    speech = load_frames(fixture_file("audio", "question_weather_24k.wav"))
    try:
        async with websockets.connect(f"{server.ws_url}?token={token}", max_size=None) as ws:
            client = Client(ws)
            gate.away = True
            asked = time.time()
            ready = await client.start(profile={"name": "Eve", "location": "Paris"})
            readied = time.time()
            assert ready["type"] == "ready"
            live = Live(client).go()
            live.say(speech + [SILENCE] * 25)
            _, first = await live.until(is_final, 60)
            gate.away = False  # the database is back
            live.say(speech + [SILENCE] * 25)
            _, second = await live.until(lambda m: is_final(m) and m["frame"] != first["frame"], 60)
            stopped = time.time()
            assert (await live.stop())["reason"] == "stop"
        await _writes_done(server)
        with ContextDB(path) as check:
            memory = check.user("eve")
            stored = memory.get_profile()
            assert (stored.name, stored.city) == ("Eve", "Paris")
            conversation = memory.get_conversation(ready["conversation_id"])
            assert conversation is not None, "the conversation was never recorded"
            assert asked <= conversation.started_at <= readied and conversation.ended_at >= stopped
            assert conversation.settings["session_id"] == ready["session_id"]
            turns = [(t.text, t.frame) for t in memory.turns(conversation.id) if t.role == "user"]
            assert turns == [("yes", second["frame"])]  # the first was said while the database was away
    finally:
        server.stop()


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    if not Path("/proc/self/stat").exists():
        pytest.skip("freezing PostgreSQL finds its processes in /proc (Linux)")
    yield from running_postgres()


@pytest.mark.timeout(420)
async def test_a_frozen_postgresql_stalls_no_conversation(
    tiny_checkpoint_dir: Path, fixture_file, tmp_path: Path, postgres: PostgresServer
) -> None:
    """A real ``cspan serve`` on a real PostgreSQL; mid-conversation PostgreSQL is frozen (SIGSTOP) for 8 s while the
    user asks a question. The session keeps receiving agent audio at about the real-time pace, its final transcript
    comes (after ``--db-wait-s``, not recorded yet), ``/health`` answers, a new connection is refused with 1013
    (its credential cannot be checked) instead of hanging. The retrieval asked during the freeze, answered from
    ``--knowledge`` notes, is read during the freeze within the default span deadline (2.5 s): its context step gives
    up after ``--db-wait-s`` and its span row is not waited for (was: late, or read only at the thaw). After SIGCONT
    the turns and the span row of the freeze are in the database, in order, at the times they were said (not the
    thaw's; the row with its outcome, marked under the provisional id its span event carried: it had none). A second
    conversation of the same user
    started during the freeze (its connection made before) cannot read the stored profile; after the thaw the stored
    notes are still there and its start time is the freeze's."""
    import psycopg

    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute("CREATE DATABASE frozen")
    url = postgres.url.rsplit("/", 1)[0] + "/frozen"
    with ContextDB(url) as db:
        db.user("local").put_profile(Profile(name="Ada", city="Leeds", notes="allergic to nuts"))
    knowledge = tmp_path / "notes"
    knowledge.mkdir()
    (knowledge / "weather.md").write_text("The weather in London today is sunny and warm.\n")
    args = serve_args(
        tiny_checkpoint_dir, "--port", "0", "--db", url, "--asr", "sphinx", "--router", "local",
        "--knowledge", str(knowledge), "--span-deadline-s", "2.5", "--test-hooks", "--db-wait-s", "1",
        "--idle-timeout-s", "600", "--max-sessions", "2",
    )  # fmt: skip
    speech = load_frames(fixture_file("audio", "question_weather_24k.wav"))
    freeze_s = 8.0
    server = ServeProcess(*args, name="serve").start()
    try:
        async with asyncio.timeout(300):  # a hang fails here, the server's stacks in its log (kill)
            await asyncio.to_thread(server.wait_healthy)
            async with (
                websockets.connect(server.ws(), max_size=None) as ws,
                websockets.connect(server.ws(), max_size=None) as ws_second,
            ):
                client = Client(ws)
                ready = await client.start(profile={"name": "Ada"}, test={"force_ret_at": [5.5]})
                assert ready["type"] == "ready"
                live = Live(client).go()
                await asyncio.sleep(1.0)
                postgres.freeze()
                frozen = time.monotonic()
                try:
                    live.say(speech)  # 2.9 s: the forced <ret> at 5.5 s asks about it, while PostgreSQL is frozen
                    async with httpx.AsyncClient(base_url=server.url, timeout=3.0) as http:
                        t0 = time.monotonic()
                        async with websockets.connect(server.ws(), max_size=None) as refused:
                            closed = await Client(refused).until_closed(timeout=15)
                        assert closed.rcvd is not None and closed.rcvd.code == 1013, closed
                        assert "credentials cannot be checked now" in closed.rcvd.reason
                        assert time.monotonic() - t0 < 5.0
                        second = Client(ws_second)
                        second_asked = time.time()
                        second_ready = await second.start(profile={"name": "Eve"})
                        assert second_ready["type"] == "ready"
                        assert (await second.stop())["reason"] == "stop"
                        while time.monotonic() - frozen < freeze_s:
                            assert (await http.get("/health")).status_code == 200
                            await asyncio.sleep(0.5)
                    thawed = time.monotonic()
                    thawed_at = time.time()
                    spans_in_freeze = [
                        m for t, kind, m in live.items() if kind == "json" and m["type"] == "span" and t < thawed
                    ]
                    finals_in_freeze = [
                        m for t, kind, m in live.items() if kind == "json" and is_final(m) and t < thawed
                    ]
                    received = live.audio_between(frozen + 2.0, thawed)
                finally:
                    postgres.thaw()
                assert received >= 0.8 * (thawed - frozen - 2.0) * FRAMES_PER_S, received  # about real time
                assert finals_in_freeze and any("london" in m["text"] for m in finals_in_freeze)
                # read during the freeze, within the span deadline of its <ret>
                (span,) = spans_in_freeze
                assert "sunny" in span["text"] and span["source"] == "local:knowledge"
                assert (span["frame"] - span["ret_frame"]) / FRAMES_PER_S <= 2.5 + 0.2, span
                assert not client.received.json("late"), client.received.json("late")
                await asyncio.sleep(1.0)
                assert (await live.stop())["reason"] == "stop"
            assert "has not answered in 1 s" in server.log and "answers again" in server.log, server.log
            with ContextDB(url) as db:
                memory = db.user("local")
                conversation = memory.get_conversation(ready["conversation_id"])
                assert conversation is not None and conversation.ended_at is not None
                assert conversation.settings["session_id"] == ready["session_id"]
                stored = iter(t.text for t in memory.turns(conversation.id) if t.role == "user")
                finals = [m["text"] for m in client.received.json("user_text") if m["final"]]
                assert all(text in stored for text in finals), finals  # every final transcript, in order
                said = {t.text: t.t for t in memory.turns(conversation.id) if t.role == "user"}
                assert all(said[m["text"]] < thawed_at - 1.0 for m in finals_in_freeze), (said, thawed_at)
                profile = memory.get_profile()
                assert (profile.name, profile.city, profile.notes) == ("Eve", "Leeds", "allergic to nuts")
                started = memory.get_conversation(second_ready["conversation_id"])
                assert second_asked <= started.started_at < thawed_at - 1.0 and started.ended_at < thawed_at
                # written at the thaw, marked injected under the provisional id of its span event (was: no outcome)
                (row,) = [s for s in memory.spans(conversation.id) if s.text]
                assert span["retrieval_id"] is not None and span["retrieval_id"] < 0, span
                assert row.text == span["text"] and row.dropped is None and row.frame == span["frame"]
                assert row.injected_at is not None and row.injected_at < thawed_at  # when it was read, not the thaw
    finally:
        postgres.thaw()
        server.signal()
        try:
            server.wait(timeout=60)
        finally:
            server.kill()
        print(server.log)  # shown when the test fails
