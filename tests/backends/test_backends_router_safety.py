"""What keeps the router safe: actions wait for the user's confirmation, hostile replies cost little, late spans
say why, and a session's router shares the server's HTTP client. Real HTTP server (StubLLM), real tool banks."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator, Iterator

import pytest
from router_stub import StubLLM

from cspan.backends.context_db import ContextDB
from cspan.backends.errors import RouterError
from cspan.backends.retriever import Retriever
from cspan.backends.router import LLMRouter, RouteRequest
from cspan.backends.router.llm import parse_reply, strip_fences
from cspan.backends.tools import ToolBank
from cspan.backends.tools.catalog import ToolsSpec, build_bank, callback_tool, fdb_v3_bank


@pytest.fixture(scope="module")
def stub() -> Iterator[StubLLM]:
    server = StubLLM().start()
    yield server
    server.stop()


@pytest.fixture
def llm(stub: StubLLM) -> StubLLM:
    stub.reset()
    return stub


@pytest.fixture
async def world() -> AsyncIterator[ToolBank]:
    bank = await build_bank(ToolsSpec.from_flags("fdb-v3"))  # a live bank naming the mock world: actions confirmed
    yield bank
    await bank.aclose()


SOON = (datetime.date.today() + datetime.timedelta(days=30)).isoformat()
SEARCH = {"tool": "search_flights", "arguments": {"destination": "Denver", "date": SOON}}
BOOK = {"tool": "book_flight", "arguments": {"passenger_name": "Ada Lovelace"}}


async def test_an_action_runs_only_after_the_user_confirms(llm: StubLLM, world: ToolBank, tmp_path) -> None:
    db = ContextDB(tmp_path / "ctx.sqlite")
    memory = db.user("ada")
    llm.reset(SEARCH, BOOK, BOOK)
    async with LLMRouter(llm.url, "m", world) as router:
        retriever = Retriever(None, router, memory)
        await retriever.retrieve(question="find me a flight to Denver next month", conversation_id="c")
        held = await retriever.retrieve(question="book it for Ada Lovelace", conversation_id="c")
        assert held.source == "confirm:book_flight" and held.reference is not None
        assert held.reference.startswith("(tool result) confirmation needed: book a flight")
        assert "passenger name Ada Lovelace" in held.reference
        done = await retriever.retrieve(question="yes please go ahead", conversation_id="c")
    assert '"status": "awaiting_confirmation"' in llm.user_messages()[2]  # the LLM saw the pending action
    assert done.source == "tool:book_flight" and done.error is None, done.error
    assert "confirmation needed" not in (done.reference or "") and "confirmation code" in (done.reference or "")
    sources = [s.source for s in memory.spans("c")]
    assert sources == ["tool:search_flights", "confirm:book_flight", "tool:book_flight"]
    db.close()


async def test_a_refusal_or_other_arguments_do_not_run_the_action(llm: StubLLM, world: ToolBank) -> None:
    async with LLMRouter(llm.url, "m", world) as router:
        llm.reset(BOOK, BOOK)
        held = await router.route(RouteRequest(question="book a flight for Ada Lovelace"))
        no = await router.route(RouteRequest(question="no wait, don't", history=held.calls))
        assert no.source == "confirm:book_flight"  # asked again, not run
        other = {"tool": "book_flight", "arguments": {"passenger_name": "Grace Hopper"}}
        llm.reset(other)
        changed = await router.route(RouteRequest(question="yes", history=held.calls))
        assert changed.source == "confirm:book_flight" and "Grace Hopper" in (changed.reference or "")
        llm.reset(BOOK)
        stale = await router.route(RouteRequest(question="yes"))  # nothing pending
        assert stale.source == "confirm:book_flight"


async def test_the_yes_must_come_after_the_question(llm: StubLLM, world: ToolBank, tmp_path) -> None:
    """A request that already says "okay" is not its own confirmation: a second ``<ret>`` reading the same words
    (the last utterance again, or an ASR window that still holds it, transcribed a little differently) asks again;
    only words said after it count."""
    request = "book it for Ada Lovelace okay"
    llm.reset(SEARCH, BOOK, BOOK, BOOK, BOOK)
    with ContextDB(tmp_path / "ctx.sqlite") as db:
        async with LLMRouter(llm.url, "m", world) as router:
            retriever = Retriever(None, router, db.user("ada"))
            await retriever.retrieve(question="find me a flight to Denver next month", conversation_id="c")
            held = await retriever.retrieve(question=request, conversation_id="c")
            assert held.source == "confirm:book_flight"
            again = await retriever.retrieve(question=request, conversation_id="c")
            assert again.source == "confirm:book_flight", again.error  # the same words: asked again, not run
            window = await retriever.retrieve(question="um book it for ada love lace ok so", conversation_id="c")
            assert window.source == "confirm:book_flight", window.error  # nothing new agrees
            done = await retriever.retrieve(question="book it for Ada Lovelace, ok. Yes go ahead", conversation_id="c")
    assert done.source == "tool:book_flight" and done.error is None, done.error


async def test_only_speech_heard_after_the_confirmation_confirms(llm: StubLLM, world: ToolBank, tmp_path) -> None:
    """The runtime says whether the question's speech was all heard after the last span was read (``after_span``):
    a window that still holds the request, however differently transcribed ("yes" heard as "yeah", the request
    itself unrecognisable: the words-after-the-request match, which the text alone needs, finds nothing and took
    all of it as new), confirms nothing; an utterance begun after the question does; and a "no" in it does not."""
    llm.reset(SEARCH, BOOK, BOOK, BOOK, BOOK)
    with ContextDB(tmp_path / "ctx.sqlite") as db:
        async with LLMRouter(llm.url, "m", world) as router:
            retriever = Retriever(None, router, db.user("ada"))
            await retriever.retrieve(question="find me a flight to Denver next month", conversation_id="c")
            held = await retriever.retrieve(
                question="yes please book a flight for Ada Lovelace", conversation_id="c", after_span=False
            )
            assert held.source == "confirm:book_flight"
            window = await retriever.retrieve(
                question="yeah the the three city are you doing", conversation_id="c", after_span=False
            )
            assert window.source == "confirm:book_flight", window.error  # asked again, not run
            refused = await retriever.retrieve(question="no don't", conversation_id="c", after_span=True)
            assert refused.source == "confirm:book_flight", refused.error
            done = await retriever.retrieve(question="yeah go ahead", conversation_id="c", after_span=True)
    assert done.source == "tool:book_flight" and done.error is None, done.error


async def test_a_confirmation_never_read_confirms_nothing(llm: StubLLM, world: ToolBank, tmp_path) -> None:
    """A confirmation dropped before the model read it (late: the user never heard the question) leaves nothing
    awaiting: the request read again, even as speech heard after some other span, is asked about again, not run
    (was: the "yes" inside the request ran the action)."""
    llm.reset(SEARCH, BOOK, BOOK)
    with ContextDB(tmp_path / "ctx.sqlite") as db:
        memory = db.user("ada")
        async with LLMRouter(llm.url, "m", world) as router:
            retriever = Retriever(None, router, memory)
            await retriever.retrieve(question="find me a flight to Denver next month", conversation_id="c")
            held = await retriever.retrieve(question="book it for Ada Lovelace yes do it", conversation_id="c")
            assert held.source == "confirm:book_flight" and held.span_id is not None
            memory.mark_span_dropped(held.span_id, "late")  # the runtime's late event, as cspan serve records it
            again = await retriever.retrieve(
                question="book it for Ada Lovelace yes do it", conversation_id="c", after_span=True
            )
    assert again.source == "confirm:book_flight", again.error  # asked (for the first time), not run


async def test_benchmark_bank_runs_actions_at_once(llm: StubLLM) -> None:
    bank = fdb_v3_bank(confirm_actions=False)  # the benchmark's mock world: no confirmation step
    try:
        llm.reset(SEARCH, BOOK)
        async with LLMRouter(llm.url, "m", bank) as router:
            await router.route(RouteRequest(question="flights to Denver next month"))
            booked = await router.route(RouteRequest(question="book it for Ada Lovelace"))
        assert booked.source == "tool:book_flight" and booked.error is None
    finally:
        await bank.aclose()


@pytest.mark.timeout(30)
def test_hostile_replies_parse_in_linear_time() -> None:
    """A megabyte of unbalanced braces took minutes with the old regex; now it is one scan (bounded by the timeout)."""
    for text in ("{" * 1_000_000, "{" + "a" * 1_000_000, "```" + " " * 1_000_000 + "x", "[" * 1_000_000):
        decision = parse_reply(text)
        assert decision.name is None
    assert parse_reply('Sure! {"name": "get_time", "arguments": {}} hope that helps').name == "get_time"
    assert parse_reply('```json\n{"answer": "It is sunny."}\n```').answer == "It is sunny."
    assert strip_fences("```python\nprint(1)\n```") == "print(1)"


async def test_oversized_replies_are_refused(llm: StubLLM) -> None:
    bank = ToolBank()
    llm.reset({"raw": "x" * (10 * 1024 * 1024)})
    async with LLMRouter(llm.url, "m", bank, json_mode="always") as router:
        with pytest.raises(RouterError, match=r"over the limit of 1048576 bytes"):
            await router.route(RouteRequest(question="hello"))
        # a big but allowed reply is decoded in a worker thread, and still understood
        llm.reset({"content": '{"answer": "' + "very " * 8000 + 'long."}'})
        seen: list[str] = []
        real = asyncio.to_thread

        async def spy(fn, *args, **kwargs):
            seen.append(getattr(fn, "__name__", ""))
            return await real(fn, *args, **kwargs)

        asyncio.to_thread = spy  # type: ignore[assignment]
        try:
            result = await router.route(RouteRequest(question="hello"))
        finally:
            asyncio.to_thread = real  # type: ignore[assignment]
        assert "_json_decision" in seen and result.source == "llm"


async def test_late_span_says_which_step_was_slow(llm: StubLLM, tmp_path) -> None:
    bank = await build_bank(ToolsSpec.from_flags("clock"))
    llm.reset({"sleep": 3.0, "then": {"tool": "get_time", "arguments": {}}})
    async with LLMRouter(llm.url, "m", bank, timeout_s=10) as router:
        res = await Retriever(None, router, None).retrieve(question="what time is it", deadline_s=0.5)
    await bank.aclose()
    assert res.late and res.stage == "router" and res.reference is None
    assert "deadline in the router step" in (res.error or "")


async def test_session_router_shares_the_client_and_adds_tools(llm: StubLLM) -> None:
    shared = await build_bank(ToolsSpec.from_flags("clock"))

    async def lights(arguments: dict) -> str:
        return f"lights {arguments['state']}"

    schema = {"type": "object", "properties": {"state": {"type": "string"}}, "required": ["state"]}
    session = shared.derive([callback_tool("set_lights", "Switch the lights.", schema, lights)])
    llm.reset({"tool": "set_lights", "arguments": {"state": "on"}})
    base = LLMRouter(llm.url, "m", shared)
    mine = base.with_bank(session)
    try:
        result = await mine.route(RouteRequest(question="lights on please"))
        assert result.reference == "(tool result) lights on"
        assert mine._http() is base._http()  # one connection pool
        names = [t["function"]["name"] for t in llm.requests[0]["tools"]]
        assert names == ["get_time", "set_lights"] and "set_lights" not in shared
        await mine.aclose()  # closes nothing
        assert not base._http().is_closed
    finally:
        await base.aclose()
        await shared.aclose()
