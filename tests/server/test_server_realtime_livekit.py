"""``/v1/realtime`` as LiveKit Agents' OpenAI plugin drives it, replayed with a raw WebSocket client (the project's
test environment has no LiveKit): the events below are the ones ``livekit-plugins-openai`` 1.8.9 (with
``livekit-agents`` 1.8.9, whose ``livekit/agents/llm/_realtime/openai.py`` holds the protocol engine) sends, as
captured from its ``openai_client_event_queued`` event against this server:

- ``RealtimeSession.__init__``: the default ``session.update`` (``_create_session_update_event``);
- ``update_instructions`` and ``update_tools``: a ``session.update`` each;
- ``push_audio``: ``input_audio_buffer.append`` of 100 ms of pcm16 (``AudioByteStream`` of ``SAMPLE_RATE // 10``);
- ``interrupt``: ``response.cancel`` without a ``response_id``;
- ``update_chat_ctx`` of an item whose content changed: ``conversation.item.delete`` then
  ``conversation.item.create`` under the same id, placed by ``previous_item_id`` (``_create_update_chat_ctx_events``,
  "update the items with the same id but different content").
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
import websockets
from realtime_schema import RealtimeClient as Client
from serve_client import load_frames

# livekit-plugins-openai 1.8.9: RealtimeSession's first event, as sent (RealtimeModel(model="cspan") with defaults)
LIVEKIT_SESSION_UPDATE = {
    "session": {
        "type": "realtime",
        "audio": {
            "input": {
                "format": {"rate": 24000, "type": "audio/pcm"},
                "noise_reduction": None,
                "transcription": {"model": "gpt-4o-mini-transcribe"},
                "turn_detection": {
                    "type": "semantic_vad",
                    "create_response": True,
                    "eagerness": "medium",
                    "interrupt_response": True,
                },
            },
            "output": {"format": {"rate": 24000, "type": "audio/pcm"}, "speed": 1.0, "voice": "marin"},
        },
        "max_output_tokens": "inf",
        "model": "cspan",
        "output_modalities": ["audio"],
        "tool_choice": "auto",
        "tracing": None,
    },
    "type": "session.update",
    "event_id": "session_update_c27e8b8c158c",
}
LIVEKIT_INSTRUCTIONS_UPDATE = {
    "session": {"type": "realtime", "instructions": "You are a helpful test agent."},
    "type": "session.update",
    "event_id": "instructions_update_b9ab1d666d35",
}
LIVEKIT_TOOLS_UPDATE = {
    "session": {
        "type": "realtime",
        "model": "cspan",
        "tools": [
            {
                "description": "Look up the status of one of the user's orders.\n",
                "name": "lookup_order",
                "parameters": {
                    "properties": {
                        "order_id": {"description": "the order number", "title": "Order Id", "type": "string"}
                    },
                    "required": ["order_id"],
                    "title": "LookupOrderArgs",
                    "type": "object",
                },
                "type": "function",
            }
        ],
    },
    "type": "session.update",
    "event_id": "tools_update_388f5ed40411",
}

TEXT_PART = {"type": "input_text", "text": "what's the weather like"}


def livekit_appends(path: Any) -> list[dict[str, Any]]:
    """A recording as LiveKit's ``push_audio`` sends it: pcm16 in 100 ms ``input_audio_buffer.append`` events."""
    pcm = np.concatenate(load_frames(path))
    data = (np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2").tobytes()
    step = 2400 * 2
    return [
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(data[i : i + step]).decode("ascii")}
        for i in range(0, len(data), step)
    ]


async def start(server: Any) -> tuple[Any, Client]:
    ws = await websockets.connect(
        server.url.replace("http://", "ws://") + "/v1/realtime?model=cspan",
        additional_headers={"Authorization": "Bearer unused", "User-Agent": "LiveKit Agents"},
        max_size=None,
    )
    client = Client(ws)
    await client.until(lambda e: e["type"] == "conversation.created")
    for event in (LIVEKIT_SESSION_UPDATE, LIVEKIT_INSTRUCTIONS_UPDATE, LIVEKIT_TOOLS_UPDATE):
        await client.send(event)
        await client.until(lambda e: e["type"] == "session.updated")
    assert not [e for e in client.events if e["type"] == "error"]  # every field LiveKit sends is accepted
    return ws, client


@pytest.mark.timeout(300)
async def test_livekit_updates_a_user_item_by_deleting_and_creating_it_again(serve, fixture_file) -> None:
    """LiveKit updates an item of the chat context by deleting it and creating it again under the same id. For a
    committed user utterance the create was refused (``invalid_event``: "an item with id ... is in this conversation
    already"), the id of a deleted item still reserved; it is now placed as ``previous_item_id`` says, and a later
    ``retrieve`` gives the client's item."""
    server = serve(asr="sphinx", idle_timeout_s=600.0)  # the voice activity tracker runs with a transcriber
    ws, client = await start(server)
    try:
        for event in livekit_appends(fixture_file("audio", "question_weather_24k.wav")):
            await client.send(event)
        silence = {"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(4800)).decode("ascii")}
        for _ in range(30):  # 3 s of silence: the utterance ends and is committed
            await client.send(silence)
        committed = await client.until(lambda e: e["type"] == "input_audio_buffer.committed")
        item_id = committed["item_id"]
        await client.send({"type": "conversation.item.delete", "item_id": item_id, "event_id": "chat_ctx_delete_1"})
        await client.send(
            {
                "item": {
                    "content": [{"text": TEXT_PART["text"], "type": "input_text"}],
                    "role": "user",
                    "type": "message",
                    "id": item_id,
                },
                "type": "conversation.item.create",
                "event_id": "chat_ctx_create_1",
                "previous_item_id": "root",
            }
        )
        added = await client.until(
            lambda e: (
                (e["type"] == "error" and e["error"].get("event_id") == "chat_ctx_create_1")
                or (e["type"] == "conversation.item.added" and e["item"]["content"] == [TEXT_PART])
            )
        )
        assert added["type"] == "conversation.item.added", added
        assert added["item"]["id"] == item_id
        assert added.get("previous_item_id") is None  # "root": first in the conversation
        deleted = [e for e in client.events if e["type"] == "conversation.item.deleted"]
        assert [e["item_id"] for e in deleted] == [item_id]
        await client.send({"type": "conversation.item.retrieve", "item_id": item_id, "event_id": "r1"})
        got = await client.until(lambda e: e["type"] in ("conversation.item.retrieved", "error"))
        assert got["type"] == "conversation.item.retrieved"
        assert got["item"]["content"] == [TEXT_PART]
        # an id of an utterance still to come, or of one in the conversation, stays refused
        await client.send(
            {
                "type": "conversation.item.create",
                "event_id": "chat_ctx_create_2",
                "item": {"type": "message", "role": "user", "id": item_id, "content": []},
            }
        )
        again = await client.until(lambda e: e["type"] == "error")
        assert (again["error"]["code"], again["error"]["param"], again["error"]["event_id"]) == (
            "invalid_event",
            "item.id",
            "chat_ctx_create_2",
        )
    finally:
        await ws.close()


@pytest.mark.timeout(300)
async def test_livekit_interrupt_leaves_the_message_incomplete(serve, fixture_file) -> None:
    """LiveKit's ``interrupt()`` (``response.cancel`` without an id): the response ends ``cancelled`` and its
    message ``incomplete``, in ``response.output_item.done``, ``conversation.item.done`` and the response's output,
    as OpenAI reports an interrupted message (was: ``completed``); LiveKit then truncates it to what it played."""
    server = serve(idle_timeout_s=600.0)
    ws, client = await start(server)
    try:
        for event in livekit_appends(fixture_file("audio", "question_weather_24k.wav")):
            await client.send(event)
            if any(e["type"] == "response.output_audio.delta" for e in client.events):
                break
            await client.send({"type": "input_audio_buffer.clear"})
            await client.until(lambda e: e["type"] == "input_audio_buffer.cleared")
        delta = await client.until(lambda e: e["type"] == "response.output_audio.delta")
        item_id = delta["item_id"]
        await client.send({"type": "response.cancel"})
        done = await client.until(lambda e: e["type"] == "response.done")
        assert done["response"]["status"] == "cancelled"
        assert done["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
        assert [(i["id"], i["status"]) for i in done["response"]["output"]] == [(item_id, "incomplete")]
        for kind in ("response.output_item.done", "conversation.item.done"):
            (event,) = [e for e in client.events if e["type"] == kind and e["item"]["id"] == item_id]
            assert event["item"]["status"] == "incomplete"
        await client.send(
            {"audio_end_ms": 80, "content_index": 0, "item_id": item_id, "type": "conversation.item.truncate"}
        )
        truncated = await client.until(lambda e: e["type"] in ("conversation.item.truncated", "error"))
        assert truncated == {**truncated, "type": "conversation.item.truncated", "item_id": item_id, "audio_end_ms": 80}
    finally:
        await ws.close()
