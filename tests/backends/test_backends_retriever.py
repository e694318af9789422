"""Retriever: real transcribers (pocketsphinx, HTTP), real routers and a real Context DB file, deadlines, cancels."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from banks import make_mixed_bank
from router_stub import StubLLM

from cspan.backends.asr import HTTPTranscriber
from cspan.backends.context_db import ContextDB, Profile
from cspan.backends.retriever import Retriever, SpanResult
from cspan.backends.router import LLMRouter, LocalRouter
from cspan.backends.router.base import RouteResult
from cspan.backends.tools.catalog import fdb_v3_bank

LONDON_NOTE = "# London\n\nLondon weather today: mild and cloudy, around 14 degrees, light rain in the evening.\n"


@pytest.fixture(scope="module")
def stub() -> Iterator[StubLLM]:
    server = StubLLM().start()
    yield server
    server.stop()


@pytest.fixture
def knowledge(tmp_path: Path) -> Path:
    folder = tmp_path / "knowledge"
    folder.mkdir()
    (folder / "london.md").write_text(LONDON_NOTE)
    (folder / "misc.txt").write_text("The office closes at six on Fridays.\n")
    return folder


def _clip(fixture_file, name: str) -> tuple[np.ndarray, int]:
    pcm, sr = sf.read(fixture_file("audio", name), dtype="float32")
    return pcm, sr


async def test_audio_to_reference_with_pocketsphinx_and_local_notes(fixture_file, knowledge: Path, tmp_path) -> None:
    pytest.importorskip("pocketsphinx")
    from cspan.backends.asr import PocketSphinxTranscriber

    pcm, sr = _clip(fixture_file, "question_weather_24k.wav")
    db = ContextDB(tmp_path / "ctx.sqlite")
    bank = make_mixed_bank()
    transcriber = PocketSphinxTranscriber()
    try:
        retriever = Retriever(transcriber, LocalRouter(bank, db, knowledge), db)
        res = await retriever.retrieve(audio=pcm, sample_rate=sr, conversation_id="live", agent_said="Let me see.")
    finally:
        await transcriber.aclose()
        await bank.aclose()
    assert "weather" in res.question and "london" in res.question
    assert res.error is None and res.source == "local:knowledge"
    assert res.reference is not None and res.reference.startswith("London weather today: mild and cloudy")
    assert res.asr_s > 0 and res.route_s > 0
    (turn,) = db.turns("live")
    assert turn.role == "user" and turn.text == res.question
    (span,) = db.spans("live")
    assert span.id == res.span_id and span.text == res.reference and span.dropped is None
    assert span.question == res.question and span.latency_s is not None and span.latency_s > 0
    db.close()


async def test_transcriber_failure_is_an_error_result(fixture_file, tmp_path) -> None:
    pcm, sr = _clip(fixture_file, "question_exchange_24k.wav")
    db = ContextDB(tmp_path / "ctx.sqlite")
    async with HTTPTranscriber("http://127.0.0.1:9/transcribe", timeout_s=2, connect_timeout_s=1) as asr:
        retriever = Retriever(asr, LocalRouter(None, db), db)
        res = await retriever.retrieve(audio=pcm, sample_rate=sr, conversation_id="c")
    assert res.reference is None and res.error and res.error.startswith("transcriber failed")
    assert db.spans("c")[0].dropped == "error"
    no_rate = await retriever.retrieve(audio=pcm, sample_rate=None, conversation_id="c")
    assert no_rate.reference is None and "sample_rate" in (no_rate.error or "")
    db.close()


async def test_deadline_and_cancellation(stub: StubLLM, tmp_path) -> None:
    bank = fdb_v3_bank(confirm_actions=False)
    db = ContextDB(tmp_path / "ctx.sqlite")
    stub.reset({"sleep": 3.0, "then": {"content": "Too late."}}, {"sleep": 3.0, "then": {"content": "Never."}})
    async with LLMRouter(stub.url, "m", bank, timeout_s=30) as router:
        retriever = Retriever(None, router, db, deadline_s=1.0)
        late = await retriever.retrieve(question="what is the exchange rate", conversation_id="c")
        seen = len(stub.requests)
        task = asyncio.create_task(retriever.retrieve(question="hello again", conversation_id="c", deadline_s=60))
        while len(stub.requests) == seen:  # cancel once the request is in flight at the server
            await asyncio.sleep(0.01)
        task.cancel("conversation ended")
        with pytest.raises(asyncio.CancelledError):
            await task
    await bank.aclose()
    assert late.late and late.reference is None and "deadline" in (late.error or "")
    assert late.question == "what is the exchange rate"
    spans = db.spans("c")
    # the cancelled retrieval is recorded as cut, with the step it was in and the cancel message (was: no row)
    assert [s.dropped for s in spans] == ["late", "cancelled"]
    assert spans[1].question == "hello again" and spans[1].text is None
    assert spans[1].error == "cancelled in the router step: conversation ended" and spans[1].latency_s > 0
    assert db.turns("c")[-1].text == "hello again"
    db.close()


async def test_a_ret_cut_before_the_retriever_was_asked_is_recorded_as_cancelled(tmp_path) -> None:
    """``record_cut``: a ``<ret>`` that waited for the user's utterance when its conversation ended (the runtime never
    called ``retrieve``) leaves a span row as a retrieval cut while it runs does: dropped ``cancelled``, the step
    (asr) and the reason in ``error``, the question not known, asked when the ``<ret>`` came; none without a
    conversation."""
    db = ContextDB(tmp_path / "ctx.sqlite")
    retriever = Retriever(None, LocalRouter(None, db), db, db_timeout_s=2.0)
    row = await retriever.record_cut(
        why="conversation ended", asked_at=1_700_000_000.5, waited_s=1.25, conversation_id="c"
    )
    (span,) = db.spans("c")
    assert span.id == row
    assert (span.question, span.text, span.dropped, span.error) == (
        "",
        None,
        "cancelled",
        "cancelled in the asr step: conversation ended",
    )
    assert (span.asked_at, span.latency_s, span.injected_at) == (1_700_000_000.5, 1.25, None)
    assert await retriever.record_cut(why="conversation ended", asked_at=0.0, waited_s=0.0) is None
    db.close()


async def test_history_and_profile_reach_the_router(stub: StubLLM, tmp_path) -> None:
    bank = make_mixed_bank()
    db = ContextDB(tmp_path / "ctx.sqlite")
    db.put_profile(Profile(user_id="ada", name="Ada", timezone="Europe/London"))
    cid = db.start_conversation("ada")
    stub.reset({"tool": "calculate", "arguments": {"expression": "6 * 7"}}, {"tool": "get_time", "arguments": {}})
    async with LLMRouter(stub.url, "m", bank) as router:
        retriever = Retriever(None, router, db)
        first = await retriever.retrieve(question="what is six times seven", conversation_id=cid)
        second = await retriever.retrieve(question="and what time is it", conversation_id=cid, agent_said="It's 42.")
    await bank.aclose()
    assert first.reference == "(tool result) 6 * 7 = 42"
    assert second.tool == "get_time" and second.arguments == {"timezone": "Europe/London"}  # stored profile
    user = stub.user_messages()[1]
    assert "EARLIER_TOOL_CALLS" in user and '"result": "6 * 7 = 42"' in user
    assert '"question": "what is six times seven"' in user
    assert "profile: user=Ada" in user and 'ASSISTANT_ALREADY_SAID: "It\'s 42."' in user
    roles = [t.role for t in db.turns(cid)]
    assert roles == ["user", "tool", "user", "tool"]
    db.close()


async def test_without_a_db_history_is_kept_in_memory(stub: StubLLM) -> None:
    bank = make_mixed_bank()
    stub.reset({"tool": "calculate", "arguments": {"expression": "2 + 2"}}, {"content": "Four is even."})
    async with LLMRouter(stub.url, "m", bank) as router:
        retriever = Retriever(None, router)
        first = await retriever.retrieve(question="two plus two", conversation_id="x")
        second = await retriever.retrieve(question="is that even", conversation_id="x")
    await bank.aclose()
    assert first.span_id is None and first.reference == "(tool result) 2 + 2 = 4"
    assert second.reference == "Four is even." and second.source == "llm"
    assert '"result": "2 + 2 = 4"' in stub.user_messages()[1]


async def test_empty_question_is_nothing(tmp_path) -> None:
    db = ContextDB(tmp_path / "ctx.sqlite")
    res = await Retriever(None, LocalRouter(None, db), db).retrieve(question="   ", conversation_id="c")
    assert res == SpanResult()
    assert db.spans("c") == [] and db.turns("c") == []
    db.close()


async def test_deadlines_that_are_not_seconds_are_refused(tmp_path) -> None:
    """A deadline that is no number of seconds is a ValueError naming it, at construction (``"x"`` used to be
    accepted and every retrieve() then raised TypeError "unsupported operand type(s) for +") and per call (NaN or a
    negative number read as a deadline already missed); 0 (the runtime's "no time left") and inf stay valid."""
    for wrong in ("x", 0, -1, float("nan"), True):
        with pytest.raises(ValueError, match="deadline_s must be a positive number of seconds"):
            Retriever(None, LocalRouter(), deadline_s=wrong)  # type: ignore[arg-type]
    db = ContextDB(tmp_path / "ctx.sqlite")
    retriever = Retriever(None, LocalRouter(), db.user("ada"), deadline_s=float("inf"))
    for wrong in ("1", -1, float("nan")):
        with pytest.raises(ValueError, match="deadline_s must be a number of seconds >= 0"):
            await retriever.retrieve(question="is it open", conversation_id="c", deadline_s=wrong)  # type: ignore[arg-type]
    late = await retriever.retrieve(question="what is two plus two", conversation_id="c", deadline_s=0)
    assert late.late and late.reference is None
    assert db.user("ada").spans("c")[-1].dropped == "late"
    db.close()


async def test_a_question_that_is_not_text_is_a_type_error_naming_it(tmp_path, knowledge: Path) -> None:
    """``retrieve(question=b"...")`` routed the bytes' repr (``"b'what time is it'"``) and wrote it to the Context
    DB as the user's turn; a non-str question or ``agent_said`` is now a TypeError naming the argument, before
    anything is routed or written (the notes search, another entry point for a question, checks the same)."""
    from cspan.backends.knowledge import KnowledgeBase

    db = ContextDB(tmp_path / "ctx.sqlite")
    memory = db.user("ada")
    retriever = Retriever(None, LocalRouter(None, memory), memory)
    for wrong in (b"what time is it", bytearray(b"what time is it"), 42, ["what time is it"]):
        with pytest.raises(TypeError, match=f"question must be a str, not {type(wrong).__name__}") as info:
            await retriever.retrieve(question=wrong, conversation_id="c")  # type: ignore[arg-type]
        assert ("decode them first" in str(info.value)) == isinstance(wrong, bytes | bytearray)
    with pytest.raises(TypeError, match="agent_said must be a str, not bytes"):
        await retriever.retrieve(question="what time is it", agent_said=b"It is", conversation_id="c")  # type: ignore[arg-type]
    assert memory.get_conversation("c") is None or memory.turns("c") == []  # nothing was written
    notes = KnowledgeBase(knowledge)
    with pytest.raises(TypeError, match="question must be a str, not bytes"):
        await notes.search(b"london weather")  # type: ignore[arg-type]
    hit = await notes.search("london weather")
    assert hit is not None and "London weather" in hit.text
    db.close()


def test_matches_the_retriever_contract() -> None:
    params = list(inspect.signature(Retriever.retrieve).parameters)
    assert params == [
        "self",
        "audio",
        "sample_rate",
        "question",
        "profile",
        "agent_said",
        "conversation_id",
        "deadline_s",
        "after_span",
    ]
    assert inspect.iscoroutinefunction(Retriever.retrieve)
    assert set(SpanResult.model_fields) >= {
        "question",
        "reference",
        "tool",
        "arguments",
        "source",
        "asr_s",
        "route_s",
        "error",
    }


def test_public_names_import_without_torch() -> None:
    code = (
        "import json, sys\n"
        "import cspan.backends as b\n"
        "names = [b.Retriever, b.SpanResult, b.LLMRouter, b.LocalRouter, b.ContextDB, b.Profile, b.RouteRequest]\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'core': 'cspan.core' in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"torch": False, "core": False}


async def test_a_reference_with_nothing_to_read_is_no_span(tmp_path) -> None:
    """A router (any object with ``route``) whose answer is blank or only control / format characters: nothing is
    left to inject, so the result has no reference and the span row is dropped ``no_span`` (was: reference "" and a
    row neither injected nor dropped, which nothing would ever mark)."""

    class Blank:
        def __init__(self, answer: str) -> None:
            self.answer = answer

        async def route(self, req):
            return RouteResult(reference=self.answer, source="llm")

    db = ContextDB(tmp_path / "ctx.sqlite")
    memory = db.user("ada")
    for answer in ("   ", "\x00\x1b\u200b\u202e", "\u2028"):
        res = await Retriever(None, Blank(answer), memory).retrieve(question="is it open", conversation_id="c")
        assert res.reference is None and res.error is None and res.source == "llm"
    kept = await Retriever(None, Blank("Open\x00 at\u200b nine."), memory).retrieve(
        question="when", conversation_id="c"
    )
    assert kept.reference == "Open at nine."
    assert [(s.text, s.dropped) for s in memory.spans("c")] == [(None, "no_span")] * 3 + [("Open at nine.", None)]
    db.close()


async def test_a_router_that_answers_no_route_result_is_a_failed_route(tmp_path) -> None:
    """A caller's router whose ``route`` returns something other than a RouteResult (a str, a dict): retrieve()
    still never raises for a router failure; the result and the span row name what came back (it used to escape as
    AttributeError "'str' object has no attribute 'reference'")."""

    class Garbage:
        def __init__(self, answer: object) -> None:
            self.answer = answer

        async def route(self, req):
            return self.answer

    db = ContextDB(tmp_path / "ctx.sqlite")
    memory = db.user("ada")
    for answer, kind in (("It opens at nine.", "str"), ({"reference": "It opens at nine."}, "dict")):
        res = await Retriever(None, Garbage(answer), memory).retrieve(question="is it open", conversation_id="c")
        assert (res.reference, res.stage) == (None, "router")
        assert res.error == f"router failed: Garbage.route() returned {kind}, not a RouteResult"
    assert [(s.text, s.dropped, s.error) for s in memory.spans("c")] == [
        (None, "error", "router failed: Garbage.route() returned str, not a RouteResult"),
        (None, "error", "router failed: Garbage.route() returned dict, not a RouteResult"),
    ]
    db.close()


class GatedExecutor(ThreadPoolExecutor):
    """The Context DB's worker threads, each call of which waits while the gate is closed (a database that does not
    answer, as a frozen PostgreSQL host)."""

    def __init__(self) -> None:
        super().__init__(max_workers=4, thread_name_prefix="gated-db")
        self.is_open = threading.Event()
        self.is_open.set()

    def submit(self, fn, /, *args, **kwargs):
        def gated():
            assert self.is_open.wait(30), "the gate was never opened"
            return fn(*args, **kwargs)

        return super().submit(gated)


async def test_a_context_db_that_does_not_answer_costs_the_context_not_the_deadline(
    knowledge: Path, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every Context DB call waits (a frozen database). With ``db_timeout_s`` the retrieval gives the context up
    after the bound and answers from the local notes on time (not late, no error, a provisional ``span_id``); the
    span row is not waited for, and is written when the database answers, in order after the question's turn, with
    the outcome marked under its provisional id meanwhile (it had none: the span carried no id to mark). At most
    ``MAX_PENDING_DB_JOBS`` jobs of a conversation wait: a retrieval beyond them still answers, its row is not
    recorded (logged). Without the bound (the library default) the retrieval waits for the database, as before."""
    from cspan.backends.retriever import MAX_PENDING_DB_JOBS

    assert MAX_PENDING_DB_JOBS == 4  # two retrievals' jobs (a context read, a span row write) wait, a third's don't
    gate = GatedExecutor()
    db = ContextDB(tmp_path / "ctx.sqlite", executor=gate)
    memory = db.user("ada")
    cid = memory.start_conversation()  # the sync calls are not gated: the test reads the database with them
    bound = 0.4
    retriever = Retriever(None, LocalRouter(None, None, knowledge), memory, deadline_s=2.5, db_timeout_s=bound)
    questions = ["what is the weather in london", "when does the office close", "is london weather rainy"]
    gate.is_open.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="cspan.backends.retriever"):
            results, took = [], []
            for question in questions:
                t0 = time.perf_counter()
                results.append(await retriever.retrieve(question=question, conversation_id=cid))
                took.append(time.perf_counter() - t0)
            first, second, third = results
            assert first.reference is not None and first.reference.startswith("London weather today: mild")
            assert second.reference == "The office closes at six on Fridays."
            assert third.reference is not None and third.reference.startswith("London weather today")
            for res in results:
                assert res.source == "local:knowledge" and not res.late and res.error is None and res.stage is None
            # not written yet: the first two rows are promised under provisional ids, the third is not recorded
            assert first.span_id is not None and second.span_id is not None and third.span_id is None
            assert first.span_id < 0 and second.span_id < 0 and first.span_id != second.span_id
            # the context step gave up after the bound; the span row write (behind it) was not waited for
            assert bound - 0.05 <= first.context_s < bound + 0.3 and bound - 0.05 <= took[0] < bound + 0.6, took
            assert took[1] < bound + 0.6 and took[2] < 0.3, took  # the third did not even wait: nothing queued
            messages = [r.getMessage() for r in caplog.records]
            assert sum("has not answered in 0.4 s" in m and "routing" in m for m in messages) == 2, messages
            assert sum("recorded when it answers" in m for m in messages) == 2, messages
            assert sum("jobs of conversation" in m and "not recorded" in m for m in messages) == 2, messages
            assert memory.spans(cid) == [] and memory.turns(cid) == []
            # the runtime read the first span meanwhile (cspan serve marks it under the id its span event carries)
            memory.mark_span_injected(first.span_id, injected_at=1234.5, frame=77)
            gate.is_open.set()
            assert await retriever.drain(10)
    finally:
        gate.is_open.set()
    rows = memory.spans(cid)
    assert [(s.question, s.text, s.dropped, s.injected_at, s.frame) for s in rows] == [
        (questions[0], first.reference, None, 1234.5, 77),  # the outcome marked before the row was written
        (questions[1], second.reference, None, None, None),
    ]
    memory.mark_span_dropped(second.span_id, "late")  # after the row is written: the same id reaches it
    assert memory.spans(cid)[1].dropped == "late"
    assert all(s.latency_s is not None and s.latency_s < 1.5 for s in rows)  # the retrieval's, not the write's
    assert [(t.role, t.text) for t in memory.turns(cid)] == [("user", questions[0]), ("user", questions[1])]

    # the database answers again: the retrieval reads its context and waits for its row, as usual
    again = await retriever.retrieve(question="when does the office close", conversation_id=cid)
    assert again.span_id == memory.spans(cid)[-1].id and again.span_id is not None

    # no bound (the library default): the retrieval waits for the database, and its row is there when it returns
    waiting = Retriever(None, LocalRouter(None, None, knowledge), memory, deadline_s=10)
    gate.is_open.clear()
    asyncio.get_running_loop().call_later(0.6, gate.is_open.set)
    t0 = time.perf_counter()
    res = await waiting.retrieve(question="what is the weather in london", conversation_id=cid)
    assert time.perf_counter() - t0 >= 0.55 and not res.late
    assert res.span_id is not None and memory.spans(cid)[-1].id == res.span_id
    gate.shutdown()
    db.close()
    with pytest.raises(ValueError, match="db_timeout_s"):
        Retriever(None, LocalRouter(None, None, knowledge), db_timeout_s=0)


async def test_the_context_read_and_the_routers_facts_wait_for_a_frozen_database_once_in_all(
    knowledge: Path, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """The local router of a server reads the user's facts itself, bounded by the same ``db_timeout_s``: against a
    database that does not answer, the context read and that read each waited the whole bound, so a retrieval spent
    twice it (2 s of ``cspan serve``'s 2.5 s span deadline at ``--db-wait-s 1``) and missed its deadline where the
    transcription took more than half a second. Now they share the retrieval's bound: the router does not wait again
    and searches the notes without the facts; with the database answering, the facts are read."""
    gate = GatedExecutor()
    db = ContextDB(tmp_path / "ctx.sqlite", executor=gate)
    memory = db.user("ada")
    memory.set_fact("office", "the office closes at five on Mondays")  # sync calls are not gated
    cid = memory.start_conversation()
    bound = 0.5
    router = LocalRouter(None, None, knowledge, db_timeout_s=bound).with_bank(memory=memory)
    retriever = Retriever(None, router, memory, deadline_s=2.5, db_timeout_s=bound)
    gate.is_open.clear()
    try:
        with caplog.at_level(logging.WARNING):
            t0 = time.perf_counter()
            res = await retriever.retrieve(question="what is the weather in london", conversation_id=cid)
            took = time.perf_counter() - t0
        assert res.reference is not None and res.reference.startswith("London weather today: mild")
        assert not res.late and res.error is None
        assert bound - 0.05 <= res.context_s < bound + 0.3 and res.route_s < 0.3 and took < bound + 0.5, (res, took)
        messages = [r.getMessage() for r in caplog.records]
        assert any("has not answered this retrieval in time" in m and "without the user's facts" in m for m in messages)
        gate.is_open.set()
        assert await retriever.drain(10)
    finally:
        gate.is_open.set()
    res = await retriever.retrieve(question="when does the office close on mondays", conversation_id=cid)
    assert res.reference is not None and "five on Mondays" in res.reference, res  # the facts are read again
    gate.shutdown()
    db.close()


async def test_retrievals_not_recorded_during_a_stall_do_not_push_out_a_waiting_rows_outcome(
    knowledge: Path, tmp_path
) -> None:
    """A long stall: a retrieval's span row waits for the database under a provisional id, its span is read (marked
    injected under that id), and the user asks on. Each later retrieval beyond the queue's bound is not recorded, but
    took a provisional id all the same, and the memory keeps only the newest MAX_PROVISIONAL_SPANS: after that many
    the waiting row's id, and the outcome kept under it, were forgotten, so the row was written without its outcome
    (the case provisional ids exist for). A retrieval that records nothing takes no id now."""
    from cspan.backends.context_db.user import MAX_PROVISIONAL_SPANS

    gate = GatedExecutor()
    db = ContextDB(tmp_path / "ctx.sqlite", executor=gate)
    memory = db.user("ada")
    cid = memory.start_conversation()
    retriever = Retriever(None, LocalRouter(None, None, knowledge), memory, deadline_s=2.5, db_timeout_s=0.1)
    gate.is_open.clear()
    try:
        first = await retriever.retrieve(question="what is the weather in london", conversation_id=cid)
        assert first.span_id is not None and first.span_id < 0
        memory.mark_span_injected(first.span_id, injected_at=1234.5, frame=77)  # read while the row waits
        for _ in range(MAX_PROVISIONAL_SPANS + 2):  # the user asks on; beyond the queue's bound none is recorded
            await retriever.retrieve(question="when does the office close", conversation_id=cid)
        gate.is_open.set()
        assert await retriever.drain(10)
    finally:
        gate.is_open.set()
        gate.shutdown()
    row = memory.spans(cid)[0]
    assert (row.question, row.injected_at, row.frame) == ("what is the weather in london", 1234.5, 77)
    memory.mark_span_dropped(first.span_id, "late")  # the id still reaches its row
    assert memory.spans(cid)[0].dropped == "late"
    db.close()
