"""``/v1/realtime`` event handling against a real server (tiny checkpoint, raw WebSocket client): a
``session.update`` applies its valid fields and names each invalid one, OpenAI's voice names and inert client tools
get warnings rather than errors, item operations are checked as OpenAI checks them, and a command's error comes in
order with the responses around it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import numpy as np
import pytest
from realtime_schema import RealtimeClient as Client
from realtime_schema import connect_realtime

TOOL = {
    "type": "function",
    "name": "lookup_order",
    "description": "Look up an order.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
}


def errors(events: list[dict[str, Any]]) -> list[tuple[str, str | None, str | None]]:
    return [
        (e["error"]["code"], e["error"].get("param"), e["error"].get("event_id"))
        for e in events
        if e["type"] == "error"
    ]


async def update(client: Client, event_id: str | None, session: dict[str, Any]) -> tuple[dict[str, Any], list[dict]]:
    """Send a session.update (without an ``event_id`` for ``None``, as the openai SDK sends it); its
    session.updated and what followed it before the next marker."""
    start = len(client.events)
    id_field = {} if event_id is None else {"event_id": event_id}
    await client.send({"type": "session.update", **id_field, "session": session})
    await client.send({"type": "input_audio_buffer.clear", "event_id": "marker"})
    await client.until(lambda e: e["type"] == "input_audio_buffer.cleared")
    got = client.events[start:-1]
    (updated,) = [e for e in got if e["type"] == "session.updated"]
    assert got[0] is updated  # first the effective session, then the errors and warnings
    return updated["session"], got[1:]


def metric(server: Any, name: str) -> float:
    line = next((x for x in httpx.get(server.url + "/metrics").text.splitlines() if x.startswith(name + " ")), None)
    return float(line.split()[-1]) if line else 0.0


@pytest.mark.timeout(300)
async def test_session_update_applies_every_valid_field_and_names_each_invalid_one(serve) -> None:
    server = serve()
    ws, client = await connect_realtime(server)
    try:
        cases: list[tuple[dict[str, Any], dict[str, Any], list[str]]] = [
            (  # a bad profile timezone (was: a traceback and "internal", the other fields applied silently)
                {"instructions": "Profile test", "cspan": {"profile": {"name": "Ada", "timezone": "Mars/Base"}}},
                {"instructions": "Profile test"},
                ["session.cspan.profile.timezone"],
            ),
            (  # one schema-invalid field no longer refuses the event
                {"instructions": "MIXED", "input_audio_format": "mp3"},
                {"instructions": "MIXED"},
                ["session.input_audio_format"],
            ),
            (
                {
                    "instructions": "Three",
                    "modalities": ["video"],
                    "tool_choice": 42,
                    "output_audio_format": "g711_alaw",
                },
                {"instructions": "Three", "audio.output.format.type": "audio/pcma"},
                ["session.modalities", "session.tool_choice"],
            ),
            (  # a bad leaf leaves its siblings
                {"audio": {"input": {"format": {"type": "audio/mp3"}}, "output": {"voice": "tiny1"}}},
                {"audio.output.voice": "tiny1", "audio.input.format.type": "audio/pcm"},
                ["session.audio.input.format.type"],
            ),
        ]
        for k, (session, applied, params) in enumerate(cases):
            effective, after = await update(client, f"u{k}", session)
            for path, value in applied.items():
                node: Any = effective
                for key in path.split("."):
                    node = node[key]
                assert node == value, (k, path, effective)
            assert errors(after) == [("invalid_event", p, f"u{k}") for p in params], after
            assert all(e["error"]["type"] == "invalid_request_error" for e in after)
        effective, _ = await update(client, "u9", {})
        assert effective["instructions"] == "Three" and effective["audio"]["output"]["voice"] == "tiny1"

        # items: content parts of the wrong type are refused, with the event and the field named
        for k, part in enumerate([{"type": "input_text", "text": 5}, {"type": "input_audio", "transcript": ["x"]}]):
            item = {"type": "message", "role": "user", "content": [part]}
            await client.send({"type": "conversation.item.create", "event_id": f"i{k}", "item": item})
            error = (await client.until(lambda e: e["type"] == "error"))["error"]
            field = "text" if k == 0 else "transcript"
            assert (error["code"], error["param"], error["event_id"]) == (
                "invalid_event",
                f"item.content.0.{field}",
                f"i{k}",
            )
    finally:
        await ws.close()
    assert metric(server, 'cspan_protocol_errors_total{code="internal",protocol="realtime"}') == 0


@pytest.mark.timeout(300)
async def test_openai_voice_names_are_kept_out_with_a_warning(serve) -> None:
    """LiveKit's and pipecat's plugins send an OpenAI voice with their updates: the server's voice stays, with a
    ``cspan.warning`` (for clients that asked for events) instead of an ``error`` (fatal to pipecat); another unknown
    name is still ``bad_voice``; one of the server's voices is applied."""
    server = serve()
    ws, client = await connect_realtime(server)
    try:
        for voice in ("alloy", "marin", {"id": "verse"}):
            effective, after = await update(client, "v1", {"voice": voice})
            assert effective["audio"]["output"]["voice"] == "tiny0" and after == []  # no error; no warning unasked
        effective, after = await update(
            client, "v2", {"cspan": {"events": True}, "audio": {"output": {"voice": "ash"}}}
        )
        assert effective["audio"]["output"]["voice"] == "tiny0"
        (warning,) = after
        assert warning["event_id"].startswith("event_")  # its own, as every server event's
        assert (warning["type"], warning["code"], warning["param"], warning["client_event_id"]) == (
            "cspan.warning",
            "voice_not_applied",
            "session.audio.output.voice",  # the field the client sent (GA), not the beta name
            "v2",
        )
        effective, after = await update(client, "v3", {"voice": "nova-prime"})
        assert effective["audio"]["output"]["voice"] == "tiny0" and errors(after) == [
            ("bad_voice", "session.voice", "v3")
        ]
        effective, after = await update(client, "v4", {"voice": "tiny1"})
        assert effective["audio"]["output"]["voice"] == "tiny1" and after == []
    finally:
        await ws.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("router", ["none", "local", "llm"])
async def test_client_tools_on_a_router_that_never_calls_them_get_a_warning(serve, stub_llm, router) -> None:
    server = serve(router=stub_llm.url if router == "llm" else router)
    ws, client = await connect_realtime(server)
    try:
        effective, after = await update(client, "t1", {"tools": [TOOL], "cspan": {"events": True}})
        assert [t["name"] for t in effective["tools"]] == ["lookup_order"]  # accepted either way
        warnings = [(e["code"], e["param"], e["client_event_id"]) for e in after if e["type"] == "cspan.warning"]
        assert errors(after) == []
        assert warnings == ([] if router == "llm" else [("tools_inert", "session.tools", "t1")])
        _, after = await update(client, "t2", {"tools": []})  # no tools: nothing to warn about
        assert after == []
    finally:
        await ws.close()


@pytest.mark.timeout(300)
async def test_warnings_for_an_update_without_an_event_id(serve) -> None:
    """The openai SDK sends ``session.update`` without an ``event_id``: its warnings still come (each with an id of
    its own, as every server event, and no ``client_event_id``), not an ``internal`` error (was: a validation
    error of the warning event)."""
    server = serve(router="local")
    ws, client = await connect_realtime(server)
    try:
        session = {"type": "realtime", "cspan": {"events": True}, "voice": "alloy", "tools": [TOOL]}
        effective, after = await update(client, None, session)
        assert effective["audio"]["output"]["voice"] == "tiny0" and errors(after) == []
        assert [(e["type"], e["code"], e["param"]) for e in after] == [
            ("cspan.warning", "voice_not_applied", "session.voice"),
            ("cspan.warning", "tools_inert", "session.tools"),
        ]
        assert all(e["event_id"].startswith("event_") and "client_event_id" not in e for e in after)
        assert len({e["event_id"] for e in after}) == 2
        # the errors that echo a client event's id: none without one
        await client.send({"type": "conversation.item.delete", "item_id": "nope"})
        await client.send({"type": "response.cancel"})
        for code in ("unknown_item", "response_cancel_not_active"):
            error = (await client.until(lambda e: e["type"] == "error"))["error"]
            assert (error["code"], error.get("event_id")) == (code, None)
    finally:
        await ws.close()
    assert metric(server, 'cspan_protocol_errors_total{code="internal",protocol="realtime"}') == 0


async def _assistant_item(client: Client) -> str:
    """Open a response (``response.create`` starts the conversation) and wait for its assistant message and some of
    its audio; the item's id."""
    await client.send({"type": "response.create", "event_id": "r0"})
    added = await client.until(lambda e: e["type"] == "response.output_item.added" and e["item"]["type"] == "message")
    for _ in range(3):
        await client.until(lambda e: e["type"] == "response.output_audio.delta")
    return added["item"]["id"]


@pytest.mark.timeout(300)
async def test_item_operations_are_checked_as_openai_checks_them(serve) -> None:
    server = serve(idle_timeout_s=600.0)
    ws, client = await connect_realtime(server)
    try:
        item_id = await _assistant_item(client)
        sent_ms = 80 * sum(
            1 for e in client.events if e["type"] == "response.output_audio.delta" and e["item_id"] == item_id
        )
        for event_id, fields, expect in [
            ("t1", {"content_index": 7, "audio_end_ms": 0}, ("invalid_event", "content_index")),
            ("t2", {"content_index": 0, "audio_end_ms": 10**9}, ("invalid_event", "audio_end_ms")),
            ("t3", {"content_index": 0, "audio_end_ms": sent_ms}, None),
            ("t4", {"content_index": 0, "audio_end_ms": 0}, None),
        ]:
            await client.send(
                {"type": "conversation.item.truncate", "event_id": event_id, "item_id": item_id, **fields}
            )
            got = await client.until(lambda e: e["type"] in ("error", "conversation.item.truncated"))
            if expect is None:
                assert got["type"] == "conversation.item.truncated" and got["audio_end_ms"] == fields["audio_end_ms"]
            else:
                assert (got["error"]["code"], got["error"]["param"], got["error"]["event_id"]) == (*expect, event_id)

        async def create(event_id: str, item: dict[str, Any]) -> dict[str, Any]:
            await client.send({"type": "conversation.item.create", "event_id": event_id, "item": item})
            return await client.until(lambda e: e["type"] in ("error", "conversation.item.done"))

        message = {"type": "message", "id": "item_mine", "role": "user", "content": []}
        first = await create("c1", message)
        assert first["type"] == "conversation.item.done" and first["item"]["id"] == "item_mine"
        again = await create("c2", message)  # (was: accepted, its previous_item_id itself)
        assert (again["error"]["code"], again["error"]["param"], again["error"]["event_id"]) == (
            "invalid_event",
            "item.id",
            "c2",
        )
        empty = await create("c3", {**message, "id": ""})
        assert (empty["error"]["code"], empty["error"]["param"]) == ("invalid_event", "item.id")
        # the client's own function call (a history being restored) and its output: both kept
        call = {"type": "function_call", "call_id": "call_mine", "name": "f", "arguments": "{}"}
        assert (await create("c4", call))["item"]["call_id"] == "call_mine"
        output = await create("c5", {"type": "function_call_output", "call_id": "call_mine", "output": "ok"})
        assert output["type"] == "conversation.item.done" and output["item"]["output"] == "ok"
        same_call = await create("c6", call)
        assert (same_call["error"]["code"], same_call["error"]["param"]) == ("invalid_event", "item.call_id")
        unknown = await create("c7", {"type": "function_call_output", "call_id": "call_other", "output": "x"})
        assert unknown["error"]["code"] == "unknown_call_id"
        second = await create("c8", {"type": "function_call_output", "call_id": "call_mine", "output": "again"})
        assert (second["error"]["code"], second["error"]["param"]) == ("late_call_output", "item.call_id")

        async def place(event_id: str, item_id: str, previous: str) -> dict[str, Any]:
            item = {"type": "message", "id": item_id, "role": "user", "content": []}
            await client.send(
                {"type": "conversation.item.create", "event_id": event_id, "previous_item_id": previous, "item": item}
            )
            return await client.until(lambda e: e["type"] in ("error", "conversation.item.done"))

        # previous_item_id places the item: first ("root"), or right after the item it names
        first_item = await place("c9", "item_first", "root")
        assert first_item["type"] == "conversation.item.done" and first_item.get("previous_item_id") is None
        mid = await place("c10", "item_mid", "item_mine")
        assert mid["type"] == "conversation.item.done" and mid["previous_item_id"] == "item_mine"
        last = await create("c11", {"type": "message", "id": "item_last", "role": "user", "content": []})
        assert last["previous_item_id"] != "item_mid"  # appended after the end, not after the last one placed
    finally:
        await ws.close()


@pytest.mark.timeout(300)
async def test_a_cancel_error_comes_in_order_with_the_responses(serve) -> None:
    """``response.cancel`` naming another response cancels nothing, says which is in progress, and arrives before
    the events of the next command (errors of commands are no longer queued behind them)."""
    server = serve(idle_timeout_s=600.0)
    ws, client = await connect_realtime(server)
    try:
        await client.send({"type": "response.create", "event_id": "r1"})
        created = await client.until(lambda e: e["type"] == "response.created")
        response_id = created["response"]["id"]
        for event in (
            {"type": "response.create", "event_id": "r2"},
            {"type": "response.cancel", "event_id": "c1", "response_id": "resp_nope"},
            {"type": "response.cancel", "event_id": "c2"},
            {"type": "response.cancel", "event_id": "c3"},
        ):
            await client.send(event)
        await client.until(lambda e: e["type"] == "error" and e["error"]["event_id"] == "c3")
        seen = [
            (e["error"]["code"], e["error"]["event_id"])
            if e["type"] == "error"
            else (e["type"], e["response"]["status"])
            for e in client.events
            if e["type"] == "error" or (e["type"] == "response.done")
        ]
        assert seen == [
            ("conversation_already_has_active_response", "r2"),
            ("response_cancel_not_active", "c1"),
            ("response.done", "cancelled"),
            ("response_cancel_not_active", "c3"),
        ]
        by_id = {e["error"]["event_id"]: e["error"] for e in client.events if e["type"] == "error"}
        assert response_id in by_id["c1"]["message"] and by_id["c1"]["param"] == "response_id"
        assert by_id["c3"]["message"] == "Cancellation failed: no active response found"
        assert by_id["r2"]["message"].startswith(
            f"Conversation already has an active response in progress: {response_id}"
        )
    finally:
        await ws.close()


@pytest.mark.timeout(300)
async def test_output_audio_buffer_cleared_names_the_response_it_cleared(serve) -> None:
    """``output_audio_buffer.cleared`` carries ``response_id`` (required by the openai SDK's model of it): the
    response it cancelled, else the last one, else "" before any."""
    server = serve(idle_timeout_s=600.0)
    ws, client = await connect_realtime(server)
    try:  # (Client.until checks each event with the SDK's model of it)
        await client.send({"type": "output_audio_buffer.clear", "event_id": "x0"})
        before = await client.until(lambda e: e["type"] == "output_audio_buffer.cleared")
        await client.send({"type": "response.create", "event_id": "r1"})
        created = await client.until(lambda e: e["type"] == "response.created")
        await client.send({"type": "output_audio_buffer.clear", "event_id": "x1"})
        cleared = await client.until(lambda e: e["type"] == "output_audio_buffer.cleared")
        await client.send({"type": "output_audio_buffer.clear", "event_id": "x2"})
        again = await client.until(lambda e: e["type"] == "output_audio_buffer.cleared")
        response_id = created["response"]["id"]
        assert [before["response_id"], cleared["response_id"], again["response_id"]] == ["", response_id, response_id]
        (done,) = [e for e in client.events if e["type"] == "response.done"]
        assert done["response"]["status"] == "cancelled"
        assert client.events.index(done) < client.events.index(cleared)
        assert errors(client.events) == []
    finally:
        await ws.close()


@pytest.mark.timeout(300)
async def test_temperature_is_the_sessions_audio_temperature(serve) -> None:
    """``session.temperature`` (the beta field) samples this session's speech at that temperature: given before
    the conversation starts it is read with the persona, after it applies from the next frame; out of range it is
    named in an error and not applied. The text keeps the server's temperature."""
    import base64

    server = serve()
    engine = server.hub.engine
    ws, client = await connect_realtime(server)
    try:
        _, after = await update(client, "t1", {"temperature": 0.6})
        assert errors(after) == []
        _, after = await update(client, "t2", {"temperature": 20})
        assert errors(after) == [("invalid_event", "session.temperature", "t2")]
        audio = base64.b64encode(np.zeros(4800, dtype="<i2").tobytes()).decode()
        await client.send({"type": "input_audio_buffer.append", "audio": audio})
        (session,) = server.hub.sessions
        for _ in range(1200):  # the persona is read on the engine thread
            if session.state == "live":
                break
            await asyncio.sleep(0.05)
        assert session.state == "live"
        assert engine.sampling[session.slot].audio.temperature == 0.6
        assert engine.sampling[session.slot].text == engine.text_params
        _, after = await update(client, "t3", {"temperature": 1.1})
        assert errors(after) == []
        assert engine.sampling[session.slot].audio.temperature == 1.1
    finally:
        await ws.close()


@pytest.mark.timeout(120)
async def test_half_a_surrogate_pair_is_refused_and_the_session_goes_on(serve) -> None:
    """A ``\\ud800`` escape without its pair parses to a Python string that cannot be sent back as UTF-8: an item,
    instructions or ``event_id`` holding one is refused with ``bad_json`` (not echoed, which ended the connection
    without a close frame); a whole pair (an emoji) is text like any other."""
    server = serve()
    ws, client = await connect_realtime(server)
    async with ws:
        lone = '{"type": "input_text", "text": "\\ud800"}'
        await ws.send(
            '{"type": "conversation.item.create", "event_id": "e1", "item": {"type": "message", "role": "user", '
            f'"content": [{lone}]}}}}'
        )
        await ws.send('{"type": "session.update", "event_id": "e\\udc00", "session": {"instructions": "\\udc00"}}')
        pair = '{"type": "input_text", "text": "\\ud83d\\ude00"}'
        await ws.send(
            '{"type": "conversation.item.create", "event_id": "e2", "item": {"type": "message", "role": "user", '
            f'"content": [{pair}]}}}}'
        )
        added = await client.until(lambda e: e["type"] == "conversation.item.added")
        assert added["item"]["content"][0]["text"] == "\U0001f600"
        await client.send({"type": "input_audio_buffer.clear", "event_id": "marker"})
        await client.until(lambda e: e["type"] == "input_audio_buffer.cleared")
        assert errors(client.events) == [("bad_json", None, None), ("bad_json", None, None)]


@pytest.mark.timeout(120)
async def test_a_deeply_nested_event_is_refused_and_session_updates_go_on(serve) -> None:
    """A ``session.update`` whose tool schema (or ``tool_choice``) nests past :data:`MAX_EVENT_DEPTH` is refused with
    ``invalid_event``. It was accepted and kept, and every ``session.updated`` after it failed to serialise (pydantic's
    depth limit): the client never heard of a ``session.update`` again."""
    from cspan.server.realtime_events import MAX_EVENT_DEPTH

    levels = 200  # each level is two objects: "properties" and the property
    schema = json.loads('{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels)
    deep_tool = {**TOOL, "parameters": schema}
    deep_choice = json.loads('{"a": ' * (MAX_EVENT_DEPTH + 1) + "1" + "}" * (MAX_EVENT_DEPTH + 1))
    nested = 25  # within the limit: the event, session, tools, the tool and parameters, then two levels each
    within = json.loads('{"type": "object", "properties": {"a": ' * nested + '{"type": "string"}' + "}}" * nested)
    server = serve()
    ws, client = await connect_realtime(server)
    async with ws:
        await client.send({"type": "session.update", "event_id": "deep", "session": {"tools": [deep_tool]}})
        await client.send({"type": "session.update", "event_id": "choice", "session": {"tool_choice": deep_choice}})
        await client.until(lambda e: e["type"] == "error" and e["error"].get("event_id") == "choice")
        session, problems = await update(
            client, "after", {"instructions": "Still here", "tools": [{**TOOL, "parameters": within}]}
        )
        assert session["instructions"] == "Still here" and problems == []
        assert [t["parameters"] for t in session["tools"]] == [within]
        assert errors(client.events) == [("invalid_event", None, "deep"), ("invalid_event", None, "choice")]
        message = next(e for e in client.events if e["type"] == "error")["error"]["message"]
        assert f"nested more than {MAX_EVENT_DEPTH} levels deep" in message


@pytest.mark.timeout(120)
async def test_client_items_are_bounded_in_characters(serve) -> None:
    """A client's ``conversation.item.create`` may carry up to ``--max-message-kib`` of text; the items a session
    remembers hold at most :data:`ITEM_LOG_CHARS` characters in all, the oldest forgotten first (as past
    :data:`ITEM_LOG_SIZE` items). They were bounded by count only: 1000 items of 250 KB kept a quarter of a gigabyte
    per connection, for any number of connections of one token."""
    from cspan.server.realtime_turns import ITEM_LOG_CHARS

    size = 200_000
    count = ITEM_LOG_CHARS // size + 3
    server = serve()
    ws, client = await connect_realtime(server)
    async with ws:
        for i in range(count):
            text = str(i) * size
            item = {
                "type": "message",
                "id": f"big{i}",
                "role": "user",
                "content": [{"type": "input_text", "text": text}],
            }
            await client.send({"type": "conversation.item.create", "event_id": f"c{i}", "item": item})
            await client.until(lambda e: e["type"] == "conversation.item.done")
        kept = []
        for i in range(count):
            await client.send({"type": "conversation.item.retrieve", "event_id": f"r{i}", "item_id": f"big{i}"})
            got = await client.until(lambda e: e["type"] in ("conversation.item.retrieved", "error"))
            if got["type"] == "conversation.item.retrieved":
                assert got["item"]["content"][0]["text"] == str(i) * size
                kept.append(i)
            else:
                assert (got["error"]["code"], got["error"]["event_id"]) == ("unknown_item", f"r{i}")
        assert kept == list(range(count - ITEM_LOG_CHARS // size, count))


@pytest.mark.timeout(120)
async def test_an_unexpected_error_reaches_the_realtime_client_without_its_text(serve, monkeypatch) -> None:
    """As on ``/ws`` (``test_server_guards``): an unexpected exception while an event is handled answers ``internal``
    with its type, the event's id and the session; its text, which may name paths or other internals, stays in the
    server's log (``/v1/realtime`` sent it to the client), and the session goes on."""
    from cspan.server.adapters.realtime import RealtimeAdapter

    def failing(self: Any, event: Any) -> None:
        raise RuntimeError("cannot open /srv/cspan/secret/voices/x.pt")

    monkeypatch.setattr(RealtimeAdapter, "_truncate", failing)
    server = serve()
    ws, client = await connect_realtime(server)
    async with ws:
        truncate = {"item_id": "item_x", "content_index": 0, "audio_end_ms": 0}
        await client.send({"type": "conversation.item.truncate", "event_id": "t1", **truncate})
        error = (await client.until(lambda e: e["type"] == "error"))["error"]
        session_id = next(e for e in client.events if e["type"] == "session.created")["session"]["id"]
        assert (error["type"], error["code"], error["event_id"]) == ("server_error", "internal", "t1")
        assert error["message"] == (
            f"an unexpected server error (RuntimeError); the server log has it (session {session_id[len('sess_') :]})"
        )
        session, problems = await update(client, "after", {"instructions": "Goes on"})
        assert session["instructions"] == "Goes on" and problems == []
