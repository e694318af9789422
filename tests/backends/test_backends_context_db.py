"""ContextDB: a real SQLite file (WAL), surviving a process restart, concurrent async writers, working text."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cspan.backends.context_db import SCHEMA_VERSION, ContextDB, ContextDBError, Profile, extract_facts


def test_survives_a_process_restart(tmp_path: Path) -> None:
    path = tmp_path / "ctx" / "context.sqlite"
    writer = textwrap.dedent(
        f"""
        from cspan.backends.context_db import ContextDB, Profile
        db = ContextDB({str(path)!r})
        db.put_profile(Profile(user_id="u1", name="Ada", city="Leeds", timezone="Europe/London", lat=53.8, lon=-1.55,
                               notes="Allergic to peanuts.", persona="a helpful travel agent"))
        cid = db.start_conversation("u1", conversation_id="c1", checkpoint="tiny", settings={{"temperature": 0.7}})
        db.add_turn(cid, "user", "hi, I live in York now", frame=12)
        db.add_turn(cid, "agent", "Hello Ada!", frame=30)
        sid = db.add_span(cid, question="what time is it", text="(tool result) It is noon.", tool="get_time",
                          arguments={{"timezone": "Europe/London"}}, source="tool:get_time", latency_s=0.4)
        db.mark_span_injected(sid, injected_at=1000.5, frame=44)
        db.add_span(cid, question="hmm", text=None, dropped="no_span")
        print(sid)
        """
    )
    out = subprocess.run([sys.executable, "-c", writer], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    span_id = int(out.stdout.strip())

    db = ContextDB(path)
    try:
        assert db.schema_version() == SCHEMA_VERSION
        assert db.journal_mode == "wal"
        profile = db.get_profile("u1")
        assert profile == Profile(
            user_id="u1",
            name="Ada",
            city="Leeds",
            timezone="Europe/London",
            lat=53.8,
            lon=-1.55,
            notes="Allergic to peanuts.",
            persona="a helpful travel agent",
        )
        conv = db.get_conversation("c1")
        assert conv is not None and conv.user_id == "u1" and conv.checkpoint == "tiny"
        assert conv.settings == {"temperature": 0.7}
        turns = db.turns("c1")
        assert [(t.role, t.text, t.frame) for t in turns] == [
            ("user", "hi, I live in York now", 12),
            ("agent", "Hello Ada!", 30),
        ]
        spans = db.spans("c1")
        assert len(spans) == 2 and spans[0].id == span_id
        assert spans[0].tool == "get_time" and spans[0].arguments == {"timezone": "Europe/London"}
        assert spans[0].injected_at == 1000.5 and spans[0].frame == 44 and spans[0].dropped is None
        assert spans[1].text is None and spans[1].dropped == "no_span"
        facts = {f.key: (f.value, f.source) for f in db.facts("u1")}
        assert facts == {"name": ("Ada", "profile"), "city": ("York", "user")}
    finally:
        db.close()
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_concurrent_writes_from_20_tasks_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "context.sqlite"
    first, second = ContextDB(path), ContextDB(path)  # two connections to one file, like two processes
    try:
        cid = await first.astart_conversation("u1", conversation_id="busy")
        per_task = 25

        async def writer(task: int) -> list[int]:
            db = first if task % 2 == 0 else second
            ids = []
            for i in range(per_task):
                ids.append(await db.aadd_turn(cid, "user", f"task {task} turn {i}", frame=i))
                if i % 5 == 0:
                    ids.append(-(await db.aadd_span(cid, question=f"q{task}.{i}", text=f"r{task}.{i}")))
            return ids

        results = await asyncio.gather(*(writer(t) for t in range(20)))
        turn_ids = [i for ids in results for i in ids if i > 0]
        span_ids = [-i for ids in results for i in ids if i < 0]
        assert len(set(turn_ids)) == 20 * per_task
        assert len(set(span_ids)) == 20 * 5
        texts = {t.text for t in await second.aturns(cid)}
        assert texts == {f"task {t} turn {i}" for t in range(20) for i in range(per_task)}
        assert len(await first.aspans(cid)) == 100
    finally:
        first.close()
        second.close()


def test_working_text_keeps_profile_and_drops_oldest_turns() -> None:
    db = ContextDB(":memory:")
    db.put_profile(Profile(user_id="u", name="Ada", timezone="Europe/London"))
    cid = db.start_conversation("u")
    for i in range(12):
        db.add_turn(cid, "user" if i % 2 == 0 else "agent", f"turn number {i:02d} " + "x" * 40)
    db.add_turn(cid, "tool", 'get_time({"timezone": "Europe/London"}) => It is noon.')
    full = db.working_text(cid, max_chars=5000, recent=10)
    lines = full.splitlines()
    assert lines[0] == "profile: user=Ada, place=London, timezone=Europe/London"
    assert len(lines) == 11  # profile + the last 10 turns
    assert lines[1].startswith("agent: turn number 03") and lines[-1].startswith("tool: get_time(")

    short = db.working_text(cid, max_chars=200, recent=10)
    assert len(short) <= 200
    kept = short.splitlines()
    assert kept[0].startswith("profile: user=Ada") and kept[-1] == lines[-1]
    assert 1 < len(kept) < len(lines)
    assert kept[1:] == lines[-(len(kept) - 1) :]  # the newest turns survive, in order

    assert db.working_text(cid, max_chars=20).startswith("profile: user=Ada")
    assert len(db.working_text(cid, max_chars=20)) == 20


def test_user_turns_become_facts_and_dedupe() -> None:
    db = ContextDB()
    cid = db.start_conversation("priya")
    first = db.add_turn(cid, "user", "Hello, my name is Priya and I live in Sydney.")
    again = db.add_turn(cid, "user", "hello my name is priya and i live in sydney", dedupe=True)
    assert again == first and len(db.turns(cid)) == 1
    assert {f.key: f.value for f in db.facts("priya")} == {"name": "Priya", "city": "Sydney"}
    assert db.profile_line("priya") == "profile: the user's name is Priya, the user lives in Sydney"
    db.add_turn(cid, "agent", "agents' words are not facts: my name is Bob")
    assert {f.key: f.value for f in db.facts("priya")}["name"] == "Priya"


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


def test_span_marks_and_errors(tmp_path: Path) -> None:
    with ContextDB(tmp_path / "c.sqlite") as db:
        cid = db.start_conversation()
        sid = db.add_span(cid, question="q", text="(tool result) 5", tool="calculate", source="tool:calculate")
        db.mark_span_dropped(sid, "late")
        assert db.spans(cid)[0].dropped == "late" and db.spans(cid)[0].injected_at is None
        db.mark_span_injected(sid, frame=7)
        rec = db.spans(cid)[0]
        assert rec.dropped is None and rec.frame == 7 and rec.injected_at is not None
        with pytest.raises(ContextDBError, match="span 999"):
            db.mark_span_injected(999)
        with pytest.raises(ValueError, match="drop reason"):
            db.mark_span_dropped(sid, "bored")  # type: ignore[arg-type]
        with pytest.raises(ContextDBError, match="start_conversation"):
            db.add_turn("nope", "user", "hello")
        with pytest.raises(ValueError, match="role"):
            db.add_turn(cid, "system", "hello")  # type: ignore[arg-type]
        assert db.start_conversation(conversation_id=cid) == cid  # resuming is a no-op


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    ContextDB(path).close()
    with sqlite3.connect(path) as raw:
        raw.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(ContextDBError, match="newer"):
        ContextDB(path)


def test_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("this is not sqlite " * 200)
    with pytest.raises(ContextDBError, match="cannot open"):
        ContextDB(path)
