"""``/v1/realtime`` end to end with the official ``openai`` SDK's realtime client: a real uvicorn server on 127.0.0.1
with the tiny checkpoint, the embedded transcriber, an LLM router (a scripted OpenAI-compatible chat server) that
picks the client's function, and forced ``<ret>``\\ s (the tiny random model does not emit one when wanted)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import websockets
from realtime_schema import check_event, pcm16_chunks

openai = pytest.importorskip("openai")

TOKEN = "realtime-test-token"
FORCED_RETS = [2.0 * k for k in range(1, 17)]
ORDER_TOOL = {
    "type": "function",
    "name": "lookup_order",
    "description": "Look up the status of one of the user's orders.",
    "parameters": {
        "type": "object",
        "properties": {"order_id": {"type": "string", "description": "the order number"}},
        "required": ["order_id"],
    },
}


class Events:
    """What an SDK connection received: every event as the SDK parsed it and as raw JSON, in order."""

    def __init__(self, conn: Any, *, beta: bool = False) -> None:
        self.conn = conn
        self.beta = beta
        self.raw: list[dict[str, Any]] = []

    async def recv(self, timeout: float) -> dict[str, Any]:
        data = await asyncio.wait_for(self.conn.recv_bytes(), timeout)
        event = self.conn.parse_event(data)  # the SDK's own parsing accepts every event
        raw = json.loads(data)
        assert event.type == raw["type"]
        check_event(raw, beta=self.beta)  # ... without validating it: the SDK's models do
        self.raw.append(raw)
        return raw

    async def until(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"not received; last types {[e['type'] for e in self.raw[-15:]]}")
            event = await self.recv(left)
            if predicate(event):
                return event

    async def seen(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 120.0) -> dict[str, Any]:
        """An event received already, else the next one that matches."""
        return next((e for e in self.raw if predicate(e)), None) or await self.until(predicate, timeout)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.raw if e["type"] == kind]


def _metric(text: str, name: str) -> float:
    """The value of one sample in a Prometheus text exposition (0 when absent)."""
    line = next((line for line in text.splitlines() if line.startswith(name + " ")), None)
    return float(line.split()[-1]) if line else 0.0


def _is(kind: str, **fields: Any) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["type"] == kind and all(e.get(k) == v for k, v in fields.items())


@pytest.mark.timeout(300)
async def test_openai_sdk_streams_a_recording_and_completes_function_calls(serve, fixture_file, stub_llm) -> None:
    """The GA client: session.update with instructions and a function tool, a recording streamed as pcm16, agent
    audio and transcript deltas grouped in a response, the user's transcript, and two forced ``<ret>``\\ s whose
    router picks the client's function: its output is read as a span, as is; an error output as the abstain span."""
    stub_llm.reset(
        {"tool": "lookup_order", "arguments": {"order_id": "A1"}},
        {"tool": "lookup_order", "arguments": {"order_id": "B2"}},
    )
    server = serve(
        asr="sphinx", router=stub_llm.url, span_deadline_s=600.0, client_tool_timeout_s=120.0, idle_timeout_s=600.0
    )
    client = openai.AsyncOpenAI(api_key="unused-without-a-server-token", base_url=server.url + "/v1")
    async with client.realtime.connect(model="cspan-tiny") as conn:
        events = Events(conn)
        created = await events.recv(30)
        assert created["type"] == "session.created"
        assert created["session"]["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
        await conn.session.update(
            session={
                "type": "realtime",
                "instructions": "You answer questions about orders.",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}},
                "tools": [ORDER_TOOL],
                # a <ret> every 2 s (one while a retrieval is pending is ignored): two of them reach the router
                "cspan": {"events": True, "test": {"force_ret_at": FORCED_RETS, "seed": 7}},  # type: ignore[typeddict-unknown-key]
            }
        )
        updated = await events.until(_is("session.updated"))
        assert updated["session"]["instructions"] == "You answer questions about orders."
        assert [t["name"] for t in updated["session"]["tools"]] == ["lookup_order"]
        for chunk in pcm16_chunks(fixture_file("audio", "question_weather_24k.wav")):
            await conn.input_audio_buffer.append(audio=chunk)

        ready = await events.until(_is("cspan.ready"))
        assert ready["seed"] == 7
        outputs = {"A1": "Order A1 shipped on Monday and arrives on Thursday.", "B2": '{"error": "no such order"}'}
        spans: list[dict[str, Any]] = []
        for _ in outputs:
            call = await events.until(_is("response.function_call_arguments.done"))
            assert call["name"] == "lookup_order"
            order = json.loads(call["arguments"])["order_id"]
            done = await events.until(_is("response.done"))
            assert done["response"]["id"] == call["response_id"]
            assert done["response"]["output"][-1] == {
                "id": call["item_id"],
                "object": "realtime.item",
                "type": "function_call",
                "status": "completed",
                "call_id": call["call_id"],
                "name": "lookup_order",
                "arguments": call["arguments"],
            }
            await conn.conversation.item.create(
                item={"type": "function_call_output", "call_id": call["call_id"], "output": outputs[order]}
            )
            added = await events.until(lambda e: e["type"] == "conversation.item.added" and e["item"].get("output"))
            assert added["item"]["type"] == "function_call_output" and added["item"]["call_id"] == call["call_id"]
            spans.append(await events.until(_is("cspan.span", call_id=call["call_id"])))
        heard = await events.seen(_is("conversation.item.input_audio_transcription.completed"))
        await conn.conversation.item.retrieve(item_id=heard["item_id"])
        retrieved = await events.until(_is("conversation.item.retrieved"))
        # the user's item holds its transcript once it is known (was: input_audio without a transcript)
        assert retrieved["item"]["role"] == "user"
        assert retrieved["item"]["content"] == [{"type": "input_audio", "transcript": heard["transcript"]}]

    first, second = spans
    assert first["text"] == "(tool result) Order A1 shipped on Monday and arrives on Thursday."
    assert (first["tool"], first["arguments"]) == ("lookup_order", {"order_id": "A1"})
    assert first["n_frames"] > 0 and first["source"] == "tool:lookup_order"
    assert second["text"] == "(tool result) (no information found)"  # an error output is the abstain clause

    # the client's function joined the router's bank for this session (next to the server's own tools)
    offered = [t["function"]["name"] for t in stub_llm.requests[0]["tools"]]
    assert "lookup_order" in offered and "get_time" in offered
    # the agent's speech: audio deltas (80 ms of pcm16 each) with transcript deltas, grouped into responses
    audio = events.of("response.output_audio.delta")
    assert audio and {len(base64.b64decode(e["delta"])) for e in audio} == {3840}
    transcript = events.of("response.output_audio_transcript.delta")
    assert transcript and {e["response_id"] for e in transcript} <= {
        e["response"]["id"] for e in events.of("response.created")
    }
    # the user's speech: one item from speech_started to its transcript
    started = events.of("input_audio_buffer.speech_started")[0]
    (completed,) = [
        e
        for e in events.of("conversation.item.input_audio_transcription.completed")
        if e["item_id"] == started["item_id"]
    ]
    assert completed["transcript"].strip()
    assert "error" not in {e["type"] for e in events.raw}, [e for e in events.raw if e["type"] == "error"]

    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text  # admin scope
    assert 'cspan_sessions_started_total{protocol="realtime"} 1.0' in metrics
    assert 'cspan_protocol_errors_total{code="invalid_event",protocol="realtime"}' not in metrics


@pytest.mark.timeout(300)
async def test_tool_choice_none_keeps_the_clients_functions_from_the_router(serve, fixture_file, stub_llm) -> None:
    """``tool_choice: "none"`` (OpenAI's: no function is called) keeps the client's functions out of the router's
    bank (was: echoed and ignored, so the router could still call them); ``"auto"`` brings them back; a value outside
    the schema is an ``invalid_event`` for that field and is not applied."""
    stub_llm.reset()  # every request is answered with nothing: no span
    server = serve(asr="sphinx", router=stub_llm.url, span_deadline_s=600.0, idle_timeout_s=600.0)
    client = openai.AsyncOpenAI(api_key="unused", base_url=server.url + "/v1")
    async with client.realtime.connect(model="cspan-tiny") as conn:
        events = Events(conn)
        await conn.session.update(
            session={
                "type": "realtime",
                "tools": [ORDER_TOOL],
                "tool_choice": "none",
                "cspan": {"events": True, "test": {"force_ret_at": FORCED_RETS}},  # type: ignore[typeddict-unknown-key]
            }
        )
        updated = await events.until(_is("session.updated"))
        assert updated["session"]["tool_choice"] == "none"
        assert [t["name"] for t in updated["session"]["tools"]] == ["lookup_order"]  # declared, not offered
        for chunk in pcm16_chunks(fixture_file("audio", "question_weather_24k.wav")):
            await conn.input_audio_buffer.append(audio=chunk)
        await events.until(_is("cspan.no_span"))
        asked_without = len(stub_llm.requests)
        await conn.session.update(session={"type": "realtime", "tool_choice": "auto"})
        assert (await events.until(_is("session.updated")))["session"]["tool_choice"] == "auto"
        for _ in range(2):  # the second retrieval after the update started after it
            await events.until(_is("cspan.no_span"))
        await conn.session.update(session={"type": "realtime", "tool_choice": "sometimes"}, event_id="tc")  # type: ignore[typeddict-item]
        assert (await events.until(_is("session.updated")))["session"]["tool_choice"] == "auto"
        error = (await events.until(_is("error")))["error"]
        assert (error["code"], error["param"], error["event_id"]) == ("invalid_event", "session.tool_choice", "tc")

    offered = [[t["function"]["name"] for t in r.get("tools", [])] for r in stub_llm.requests]
    assert asked_without >= 1 and all("lookup_order" not in names for names in offered[:asked_without])
    assert "get_time" in offered[0]  # the server's own tools stay
    assert "lookup_order" in offered[-1]


@pytest.mark.timeout(300)
async def test_malformed_events_keep_the_session(serve, fixture_file, stub_llm) -> None:
    """Every malformed or refused event gets an ``error`` with its ``event_id`` and the session goes on; a function
    call the client never answers is read as the abstain clause, and its late output is refused. The client asks
    for the beta event names with the ``OpenAI-Beta: realtime=v1`` header."""
    stub_llm.reset({"tool": "lookup_order", "arguments": {"order_id": "C3"}})
    server = serve(
        asr="sphinx", router=stub_llm.url, span_deadline_s=600.0, client_tool_timeout_s=1.0, idle_timeout_s=600.0
    )
    client = openai.AsyncOpenAI(api_key="unused", base_url=server.url + "/v1")
    async with client.realtime.connect(model="cspan-tiny", extra_headers={"OpenAI-Beta": "realtime=v1"}) as conn:
        events = Events(conn, beta=True)
        created = await events.recv(30)
        assert created["type"] == "session.created" and created["session"]["input_audio_format"] == "pcm16"

        async def refused(send: Any, code: str, event_id: str | None, param: str | None = None) -> dict[str, Any]:
            await send
            error = (await events.until(_is("error")))["error"]
            assert (error["code"], error.get("event_id"), error.get("param")) == (code, event_id, param), error
            return error

        await refused(conn.send_raw("{not json"), "bad_json", None)
        await refused(conn.send_raw(b"\x00\x01"), "binary_message", None)
        await refused(conn.send_raw('{"type": "response.explode", "event_id": "e1"}'), "unknown_event", "e1", "type")
        await refused(
            conn.send_raw('{"type": "input_audio_buffer.append", "event_id": "e2"}'), "invalid_event", "e2", "audio"
        )
        await refused(conn.input_audio_buffer.append(audio="not base64!", event_id="e3"), "bad_audio", "e3", "audio")
        await refused(
            conn.conversation.item.create(
                item={"type": "function_call_output", "call_id": "call_nope", "output": "x"}, event_id="e4"
            ),
            "unknown_call_id",
            "e4",
            "item.call_id",
        )
        await refused(conn.response.cancel(event_id="e5"), "response_cancel_not_active", "e5", None)
        await refused(
            conn.session.update(session={"voice": "nova-prime", "tools": [ORDER_TOOL]}, event_id="e6"),
            "bad_voice",
            "e6",
            "session.voice",
        )
        updated = events.of("session.updated")[-1]
        assert [t["name"] for t in updated["session"]["tools"]] == ["lookup_order"]  # the rest was applied
        for tool, param in [
            ({"type": "function", "name": "get_time"}, "name"),  # one of the server's own tools
            ({"type": "function", "name": "f", "parameters": {"type": "array"}}, "parameters"),
        ]:
            await refused(
                conn.session.update(session={"tools": [tool]}, event_id="e9"),
                "invalid_event",
                "e9",
                f"session.tools[0].{param}",
            )
            assert [t["name"] for t in events.of("session.updated")[-1]["session"]["tools"]] == ["lookup_order"]
        await conn.session.update(
            session={"cspan": {"events": True, "test": {"force_ret_at": FORCED_RETS}}}  # type: ignore[typeddict-unknown-key]
        )
        await events.until(_is("session.updated"))
        for chunk in pcm16_chunks(fixture_file("audio", "question_weather_24k.wav")):
            await conn.input_audio_buffer.append(audio=chunk)

        call = await events.until(_is("response.function_call_arguments.done"))  # not answered
        span = await events.until(_is("cspan.span", call_id=call["call_id"]))
        assert span["text"] == "(tool result) (no information found)"
        await refused(
            conn.conversation.item.create(
                item={"type": "function_call_output", "call_id": call["call_id"], "output": "too late"},
                event_id="e7",
            ),
            "late_call_output",
            "e7",
            "item.call_id",
        )
        await refused(
            conn.session.update(session={"instructions": "Now be someone else."}, event_id="e8"),
            "session_live",
            "e8",
            "session.instructions",
        )
        # the conversation goes on; the output format may change mid-session (G.711 u-law at 8 kHz from now on)
        await conn.session.update(session={"output_audio_format": "g711_ulaw"})
        await events.until(_is("session.updated"))
        g711 = [base64.b64decode((await events.until(_is("response.audio.delta")))["delta"]) for _ in range(12)]
        assert [len(d) for d in g711] == [640] * 12  # every frame 80 ms at 8 kHz

    kinds = {e["type"] for e in events.raw}
    assert "response.audio.delta" in kinds and "conversation.item.created" in kinds  # the beta names
    assert "response.output_audio.delta" not in kinds and "conversation.item.added" not in kinds
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text  # admin scope
    assert 'cspan_protocol_errors_total{code="bad_json",protocol="realtime"} 1.0' in metrics


@pytest.mark.timeout(120)
async def test_token_subprotocols_and_idle_timeout(serve) -> None:
    """``Authorization: Bearer`` and the browser's ``openai-insecure-api-key.`` subprotocol carry the token (a wrong
    one is closed with 4401); a session without audio ends after the idle timeout with an ``error`` and a close."""
    server = serve(token=TOKEN, idle_timeout_s=1.0)
    wrong = openai.AsyncOpenAI(api_key="wrong-token-123", base_url=server.url + "/v1")
    async with wrong.realtime.connect(model="cspan-tiny") as conn:
        with pytest.raises(websockets.ConnectionClosed) as info:
            await asyncio.wait_for(conn.recv(), 30)
    assert info.value.rcvd is not None and info.value.rcvd.code == 4401

    ws_base = server.url.replace("http://", "ws://") + "/v1"
    right = openai.AsyncOpenAI(api_key=TOKEN, base_url=server.url + "/v1", websocket_base_url=ws_base)
    async with right.realtime.connect(model="cspan-tiny") as conn:
        created = await asyncio.wait_for(conn.recv(), 30)
        assert created.type == "session.created" and created.session.type == "realtime"
    async with right.beta.realtime.connect(model="cspan-tiny") as conn:  # the beta client: the beta session shape
        created = await asyncio.wait_for(conn.recv(), 30)
        assert created.type == "session.created" and created.session.input_audio_format == "pcm16"

    url = server.url.replace("http://", "ws://") + "/v1/realtime?model=cspan-tiny"
    offered = ["realtime", f"openai-insecure-api-key.{TOKEN}", "openai-beta.realtime-v1"]
    async with websockets.connect(url, subprotocols=offered) as ws:  # type: ignore[arg-type]
        assert ws.subprotocol == "realtime"
        created = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert created["type"] == "session.created" and "voice" in created["session"]  # the beta shape
        received = [created]
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                received.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000
    error = received[-1]["error"]
    assert (error["code"], error["param"], error["type"]) == ("session_ended", "idle", "server_error")

    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text  # admin scope
    assert 'cspan_auth_failures_total{protocol="realtime",reason="token"} 1.0' in metrics
    # (the two sessions above may have idled out too on a slow machine); none reached ready (no audio: not started)
    assert _metric(metrics, 'cspan_sessions_unstarted_total{protocol="realtime",reason="idle"}') >= 1
    assert "cspan_sessions_ended_total{" not in metrics
