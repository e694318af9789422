"""A real stdio MCP server subprocess (``cspan tools serve``) mounted as a ToolBank and called through LLMRouter."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator

import pytest
from router_stub import StubLLM

from cspan.backends.context_db import ContextDB
from cspan.backends.retriever import Retriever
from cspan.backends.router import LLMRouter, RouteRequest
from cspan.backends.tools import ToolBank
from cspan.backends.tools.catalog import fdb_v3_bank, mount_mcp

pytest.importorskip("mcp", reason="the mcp extra of cspan-backends is not installed")


@pytest.fixture(scope="module")
def stub() -> Iterator[StubLLM]:
    server = StubLLM().start()
    yield server
    server.stop()


@pytest.fixture
async def mcp_bank() -> AsyncIterator[ToolBank]:
    command = [sys.executable, "-m", "cspan.core.cli", "tools", "serve", "--fdb-v3-only"]
    bank = await mount_mcp(command=command, prefix="world_", connect_timeout_s=60)
    yield bank
    await bank.aclose()


async def test_mcp_tool_called_through_the_router(stub: StubLLM, mcp_bank: ToolBank, tmp_path) -> None:
    assert "world_get_exchange_rate" in mcp_bank.names() and len(mcp_bank) == 12
    stub.reset(
        {
            "tool": "world_get_exchange_rate",
            "arguments": {"amount": "250", "from_currency": "EUR", "to_currency": "USD"},
        },
        {"tool": "world_book_flight", "arguments": {"passenger_name": "Ada Lovelace"}},
        {"tool": "world_book_flight", "arguments": {"passenger_name": "Ada Lovelace"}},
    )
    in_process = fdb_v3_bank(confirm_actions=False)
    expected = await in_process.call("get_exchange_rate", {"amount": 250, "from_currency": "EUR", "to_currency": "USD"})
    await in_process.aclose()

    db = ContextDB(tmp_path / "ctx.sqlite")
    memory = db.user("ada")
    async with LLMRouter(stub.url, "m", mcp_bank) as router:
        retriever = Retriever(None, router, memory)
        span = await retriever.retrieve(question="what's two hundred fifty euros in dollars", conversation_id="c")
        held = await router.route(RouteRequest(question="book me on the flight to paris"))
        confirmed = await router.route(RouteRequest(question="yes, go ahead", history=held.calls))

    assert (
        span.error is None and span.tool == "world_get_exchange_rate" and span.source == "tool:world_get_exchange_rate"
    )
    assert span.arguments["amount"] == 250 and span.arguments["from_currency"] == "EUR"
    assert span.reference == f"(tool result) {expected.text}"
    names = [t["function"]["name"] for t in stub.requests[0]["tools"]]
    assert "world_get_exchange_rate" in names
    tool_turn = memory.turns("c")[-1]
    assert tool_turn.role == "tool" and tool_turn.text.startswith("world_get_exchange_rate(")
    # the server's "action" kind survives the MCP bridge, so the action waits for the user's confirmation
    assert held.source == "confirm:world_book_flight" and held.calls[0].status == "awaiting_confirmation"
    assert held.reference is not None and "confirmation needed" in held.reference
    assert "passenger name Ada Lovelace" in held.reference
    # confirmed: the booking tool itself ran this time (and answered that no flight was searched for yet)
    assert confirmed.tool == "world_book_flight" and "search" in (confirmed.error or "")
    assert "confirmation" not in (confirmed.reference or "")
    db.close()
