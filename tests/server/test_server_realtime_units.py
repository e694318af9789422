"""The pieces of ``/v1/realtime`` that need no server: audio formats, event models, and the turn state machines."""

from __future__ import annotations

import asyncio
import base64
import json
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from cspan.core.vad import UtteranceTracker
from cspan.server.adapters import Connection
from cspan.server.realtime_audio import Decimator, InputAudio, OutputAudio, decode_samples, encode_samples
from cspan.server.realtime_events import (
    MAX_TOOL_SCHEMA_NODES,
    FunctionCallItem,
    FunctionCallOutputItemIn,
    MessageItem,
    RealtimeEventError,
    SessionUpdate,
    dump_event,
    error_event,
    event_dict,
    function_tools,
    parse_client_event,
)
from cspan.server.realtime_turns import (
    ITEM_LOG_SIZE,
    QUIET_FRAMES,
    UTTERANCES_KEPT,
    ItemLog,
    ResponseStream,
    UserSpeech,
)

SR = 24000

# ---------------------------------------------------------------------------------------------------- audio


def test_g711_known_codes_and_round_trip() -> None:
    # silence and full scale (ITU-T G.711: u-law 0 -> 0xFF, A-law 0 -> 0xD5; u-law +-max -> 0x80 / 0x00)
    assert encode_samples(np.array([0.0], np.float32), "g711_ulaw") == b"\xff"
    assert encode_samples(np.array([0.0], np.float32), "g711_alaw") == b"\xd5"
    assert encode_samples(np.array([1.0, -1.0], np.float32), "g711_ulaw") == b"\x80\x00"
    x = np.linspace(-0.9, 0.9, 2001, dtype=np.float32)
    for fmt in ("g711_ulaw", "g711_alaw"):
        y = decode_samples(encode_samples(x, fmt), fmt)
        # logarithmic quantisation: the error grows with the amplitude, about 1/32 of it at most
        assert np.all(np.abs(y - x) <= np.abs(x) / 28 + 2e-3), fmt
    pcm = decode_samples(encode_samples(x, "pcm16"), "pcm16")
    assert np.max(np.abs(pcm - x)) <= 1 / 32768


def test_g711_tables_equal_the_reference_implementation() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")  # Python <= 3.12: Sun's g711.c
    ints = np.arange(-32768, 32768, dtype="<i2")
    floats = ints.astype(np.float32) / 32768.0
    for fmt, enc, dec in (
        ("g711_ulaw", audioop.lin2ulaw, audioop.ulaw2lin),
        ("g711_alaw", audioop.lin2alaw, audioop.alaw2lin),
    ):
        assert encode_samples(floats, fmt) == enc(ints.tobytes(), 2), fmt
        ref = np.frombuffer(dec(bytes(range(256)), 2), dtype="<i2")
        assert np.array_equal(np.rint(decode_samples(bytes(range(256)), fmt) * 32768).astype(np.int16), ref), fmt


def _peak_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum) * rate / len(x))


def test_input_audio_pcm16_keeps_a_split_sample() -> None:
    x = (np.arange(100, dtype=np.int16) * 100).astype("<i2").tobytes()
    stream = InputAudio("pcm16")
    a = stream.decode(x[:51])  # 25 samples and one byte of the 26th
    b = stream.decode(x[51:])
    assert len(a) == 25 and len(b) == 75
    assert np.array_equal(np.rint(np.concatenate([a, b]) * 32768).astype(np.int16), np.arange(100) * 100)


@pytest.mark.parametrize("fmt", ["g711_ulaw", "g711_alaw"])
def test_g711_streams_resample_8k_both_ways(fmt: str) -> None:
    tone = (0.5 * np.sin(2 * np.pi * 440 * np.arange(SR) / SR)).astype(np.float32)  # 1 s at 24 kHz
    out = OutputAudio(fmt)
    wire = b"".join(out.encode(tone[i : i + 1920]) for i in range(0, SR, 1920))
    assert len(wire) == 8000  # 8 kHz, one byte per sample
    assert _peak_hz(decode_samples(wire, fmt), 8000) == pytest.approx(440, abs=4)
    back = InputAudio(fmt)
    pcm = np.concatenate([back.decode(wire[i : i + 333]) for i in range(0, len(wire), 333)])
    assert 3 * len(wire) - 2400 <= len(pcm) <= 3 * len(wire)  # the stream holds back at most 100 ms
    assert _peak_hz(pcm, SR) == pytest.approx(440, abs=4)


# ---------------------------------------------------------------------------------------------------- events


@pytest.mark.parametrize(
    ("text", "code", "event_id", "param"),
    [
        ("{", "bad_json", None, None),
        ("[1, 2]", "bad_json", None, None),
        ('{"type": "response.explode", "event_id": "e1"}', "unknown_event", "e1", "type"),
        ('{"event_id": "e2"}', "unknown_event", "e2", "type"),
        ('{"type": "input_audio_buffer.append", "event_id": "e3"}', "invalid_event", "e3", "audio"),
        (
            '{"type": "conversation.item.create", "event_id": "e4", "item": {"type": "function_call_output", '
            '"call_id": "c", "output": 7}}',
            "invalid_event",
            "e4",
            "item.output",
        ),
        ('{"type": "session.update", "event_id": "e5", "session": [1]}', "invalid_event", "e5", "session"),
        (
            '{"type": "session.update", "event_id": "e6", "session": {}, "event_id": 7}',
            "invalid_event",
            None,
            "event_id",
        ),
        ('{"type": "session.update", "session": {"cspan": {"profile": {"lat": NaN}}}}', "bad_json", None, None),
        ('{"type": "response.cancel", "event_id": "e7", "response_id": Infinity}', "bad_json", None, None),
        ('{"type": "session.update", "session": {"cspan": {"seed": 1' + "0" * 5000 + "}}}", "bad_json", None, None),
        ('{"type": "session.update", "session": ' + "[" * 100_000 + "]" * 100_000 + "}", "bad_json", None, None),
        ('{"type": "response.cancel", "event_id": "e\\ud800"}', "bad_json", None, None),  # half a surrogate pair
        ('{"type": "session.update", "session": {"instructions": "\\udc00 hi"}}', "bad_json", None, None),
        (
            '{"type": "conversation.item.create", "event_id": "e8", "item": {"type": "message", "role": "user", '
            '"content": [{"type": "input_text", "text": 5}]}}',
            "invalid_event",
            "e8",
            "item.content.0.text",
        ),
        (
            '{"type": "conversation.item.create", "event_id": "e9", "item": {"type": "message", "role": "user", '
            '"content": [{"type": "input_audio", "transcript": ["x"]}]}}',
            "invalid_event",
            "e9",
            "item.content.0.transcript",
        ),
        (
            '{"type": "conversation.item.create", "event_id": "e10", "item": {"type": "message", "id": "", '
            '"role": "user"}}',
            "invalid_event",
            "e10",
            "item.id",
        ),
    ],
)
def test_malformed_client_events(text: str, code: str, event_id: str | None, param: str | None) -> None:
    with pytest.raises(RealtimeEventError) as info:
        parse_client_event(text)
    assert (info.value.code, info.value.event_id, info.value.param) == (code, event_id, param)
    sent = json.loads(dump_event(error_event(info.value)) or "")
    assert sent["type"] == "error" and sent["event_id"].startswith("event_")
    assert sent["error"]["code"] == code and sent["error"].get("event_id") == event_id
    assert sent["error"]["type"] == "invalid_request_error" and sent["error"]["message"]


def test_error_messages_do_not_grow_with_the_input() -> None:
    """A huge type, event id, key or list gets an error of bounded size: client values cut short, the first few
    problems named and the rest counted."""

    def parts(n: int) -> str:
        content = [{"type": "input_text", "text": k} for k in range(n)]
        return json.dumps(
            {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": content}}
        )

    cases = [
        json.dumps({"type": "x" * 100_000, "event_id": "e" * 100_000}),
        json.dumps({"type": {"k" * 50_000: 1}}),
        json.dumps({"type": "conversation.item.truncate", "item_id": "i" * 100_000, "content_index": -1}),
        parts(60),
        parts(5000),
    ]
    for text in cases:
        with pytest.raises(RealtimeEventError) as info:
            parse_client_event(text)
        sent = dump_event(error_event(info.value)) or ""
        assert len(sent) < 1500, (text[:60], len(sent))
        assert info.value.event_id is None or len(info.value.event_id) <= 512
    with pytest.raises(RealtimeEventError) as info:
        parse_client_event(parts(60))
    assert info.value.message.endswith("(and 56 more)") and info.value.param == "item.content.0.text"


@pytest.mark.parametrize(
    ("session", "applied", "problems"),
    [
        ({"instructions": "MIXED", "input_audio_format": "mp3"}, {"instructions": "MIXED"}, ["input_audio_format"]),
        (
            {"instructions": "x", "modalities": ["video"], "tool_choice": 42, "voice": 5},
            {"instructions": "x"},
            ["modalities", "tool_choice", "voice"],
        ),
        (  # a bad leaf leaves its siblings: the voice of the same audio object is applied
            {"audio": {"input": {"format": {"type": "audio/mp3"}}, "output": {"voice": "marin"}}},
            {"audio": {"input": {}, "output": {"voice": "marin"}}},
            ["audio.input.format.type"],
        ),
        (
            {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
            {"audio": {"input": {"format": {"type": "audio/pcm"}}}},
            ["audio.input.format.rate"],
        ),
        (  # the profile is checked as /ws's: an unknown IANA timezone is that field alone
            {"cspan": {"events": True, "profile": {"name": "Ada", "timezone": "Mars/Base"}}},
            {"cspan": {"events": True, "profile": {"name": "Ada"}}},
            ["cspan.profile.timezone"],
        ),
        ({"cspan": {"profile": {"name": "Ada", "user_id": "u1"}}}, {"cspan": {}}, ["cspan.profile"]),
        ({"tools": [{"name": "a"}, 7], "instructions": "y"}, {"instructions": "y"}, ["tools"]),
    ],
)
def test_session_update_is_read_field_by_field(session: dict, applied: dict, problems: list[str]) -> None:
    event = parse_client_event(json.dumps({"type": "session.update", "event_id": "u1", "session": session}))
    assert isinstance(event, SessionUpdate)
    assert event.session.model_dump(exclude_none=True, exclude_unset=True) == applied
    assert sorted(p for p, _ in event.problems) == sorted(f"session.{p}" for p in problems)
    for param, message in event.problems:
        assert message.startswith(f"session.update: {param}: ") and message.endswith("not applied")


def test_session_update_with_many_bad_fields_names_a_few() -> None:
    profile = {f"k{i}": i for i in range(500)}
    event = parse_client_event(json.dumps({"type": "session.update", "session": {"cspan": {"profile": profile}}}))
    assert len(event.problems) == 4 and event.problems[-1] == (
        "session",
        "session.update: 497 more invalid fields not applied",
    )


def test_tool_schemas_are_bounded() -> None:
    def update(properties: int, tools: int = 1) -> SessionUpdate:
        params = {"type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(properties)}}
        specs = [{"type": "function", "name": f"t{i}", "parameters": params} for i in range(tools)]
        return parse_client_event(json.dumps({"type": "session.update", "session": {"tools": specs}}))

    assert len(function_tools(update(100, 20).session) or []) == 20  # 20 * 102 objects
    for properties, tools in [(MAX_TOOL_SCHEMA_NODES, 1), (300, 8)]:
        with pytest.raises(RealtimeEventError) as info:
            function_tools(update(properties, tools).session, "u")
        assert (info.value.code, info.value.param) == ("invalid_event", "session.tools")


def test_session_update_ga_and_beta_fields_and_tools() -> None:
    ga = parse_client_event(
        json.dumps(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "instructions": "Be brief.",
                    "audio": {"input": {"format": {"type": "audio/pcmu"}}, "output": {"voice": "marin"}},
                    "tools": [{"type": "function", "name": "lookup_order", "parameters": {"type": "object"}}],
                    "tracing": "auto",  # a field this server does not use: ignored
                },
            }
        )
    )
    assert isinstance(ga, SessionUpdate)
    assert ga.session.audio.input.format.type == "audio/pcmu"  # type: ignore[union-attr]
    (tool,) = function_tools(ga.session) or []
    assert tool.name == "lookup_order" and tool.parameters == {"type": "object"}
    beta = parse_client_event(
        '{"type": "session.update", "session": {"input_audio_format": "g711_alaw", "voice": "alloy", "tools": []}}'
    )
    assert beta.session.input_audio_format == "g711_alaw" and function_tools(beta.session) == []
    for tools, code, param in [
        ([{"type": "mcp", "server_label": "x"}], "unsupported", "session.tools[0].type"),
        ([{"type": "function", "name": "has space"}], "invalid_event", "session.tools[0].name"),
        ([{"name": "a"}, {"name": "a"}], "invalid_event", "session.tools[1].name"),
    ]:
        update = parse_client_event(
            json.dumps({"type": "session.update", "event_id": "u", "session": {"tools": tools}})
        )
        with pytest.raises(RealtimeEventError) as info:
            function_tools(update.session, "u")
        assert (info.value.code, info.value.param, info.value.event_id) == (code, param, "u")


def test_function_call_output_item() -> None:
    event = parse_client_event(
        '{"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": "call_1", '
        '"output": "{\\"status\\": \\"shipped\\"}"}}'
    )
    assert isinstance(event.item, FunctionCallOutputItemIn)
    assert event.item.call_id == "call_1" and event.item.output == '{"status": "shipped"}'


# ---------------------------------------------------------------------------------------------------- turns


def _types(events: list) -> list[str]:
    return [e.type for e in events]


def _frame(stream: ResponseStream, text: str | None = None, data: bytes = b"\x01\x02") -> list:
    events = stream.audio(data)
    if text is not None:
        events += stream.text(text)
    return events


def test_a_turn_is_one_response_with_audio_and_transcript() -> None:
    log = ItemLog()
    stream = ResponseStream(log, conversation_id="conv_1", audio_config={"voice": "v"})
    assert _frame(stream) == [] and _frame(stream) == []  # silence before the turn: nothing is sent
    opening = _frame(stream, " Hello", data=b"\x00\x01")
    assert _types(opening) == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
        "response.output_audio.delta",  # the frame just before the first word
        "response.output_audio_transcript.delta",
    ]
    response_id = opening[0].response.id
    item_id = opening[1].item.id
    assert opening[4].delta == base64.b64encode(b"\x00\x01").decode()
    assert opening[5].delta == "Hello"  # the turn's leading space is dropped
    middle = _frame(stream, " there") + _frame(stream, "!")
    assert _types(middle) == ["response.output_audio.delta", "response.output_audio_transcript.delta"] * 2
    assert {e.response_id for e in middle} == {response_id} and {e.item_id for e in middle} == {item_id}
    tail = []
    for _ in range(QUIET_FRAMES):
        tail += _frame(stream)
    assert _types(tail) == ["response.output_audio.delta"] * QUIET_FRAMES  # the voice's tail is in the response
    closing = _frame(stream)
    assert _types(closing) == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert closing[1].transcript == "Hello there!"
    done = closing[-1].response
    assert done.id == response_id and done.status == "completed" and done.conversation_id == "conv_1"
    (item,) = done.output
    assert item.id == item_id and item.content[0].transcript == "Hello there!" and item.status == "completed"
    assert done.usage.output_token_details == {"text_tokens": 3, "audio_tokens": 1 + 2 + QUIET_FRAMES}
    assert log.last_id == item_id
    # the next words open the next response
    again = _frame(stream, " Bye")
    assert again[0].type == "response.created" and again[0].response.id != response_id


def test_function_call_ends_the_response_and_cancel_mutes_the_turn() -> None:
    log = ItemLog()
    stream = ResponseStream(log)
    _frame(stream, "Let")
    _frame(stream, " me")
    events, call_id, item_id = stream.function_call("lookup_order", {"order_id": "A1"})
    assert _types(events) == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.output_item.added",
        "conversation.item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    args_done = events[8]
    assert (args_done.call_id, args_done.item_id, args_done.name) == (call_id, item_id, "lookup_order")
    assert json.loads(args_done.arguments) == {"order_id": "A1"} and args_done.output_index == 1
    message, call = events[-1].response.output
    assert message.content[0].transcript == "Let me" and call.call_id == call_id and call.arguments
    assert not stream.active
    # a call with no response open opens and closes one of its own
    alone, _, _ = stream.function_call("f", "{}")
    assert _types(alone)[0] == "response.created" and _types(alone)[-1] == "response.done"
    # cancel: the response ends cancelled, and the rest of the turn is dropped
    _frame(stream, "One")
    cancelled = stream.cancel()
    assert cancelled[-1].response.status == "cancelled"
    assert cancelled[-1].response.status_details.reason == "client_cancelled"
    assert _frame(stream, " two") == [] and _frame(stream) == []
    for _ in range(QUIET_FRAMES):
        assert _frame(stream) == []
    assert _frame(stream, "Three")[0].type == "response.created"
    with pytest.raises(RealtimeEventError) as info:
        stream.create(event_id="c1")
    assert info.value.code == "conversation_already_has_active_response" and info.value.event_id == "c1"
    assert info.value.message.startswith("Conversation already has an active response in progress: resp_")


def test_client_created_response_closes_empty_when_the_agent_is_silent() -> None:
    stream = ResponseStream(ItemLog())
    with pytest.raises(RealtimeEventError) as info:
        stream.cancel(event_id="x")
    assert (info.value.code, info.value.message) == (
        "response_cancel_not_active",
        "Cancellation failed: no active response found",  # OpenAI's words, which LiveKit's plugin ignores
    )
    created = stream.create({"client_event_id": "abc"})
    assert created[0].response.metadata == {"client_event_id": "abc"}
    events = []
    for _ in range(QUIET_FRAMES + 1):
        events += stream.audio(b"\x00\x00")
    assert events[0].type == "response.output_item.added"  # the agent's frames fill the response it was asked for
    assert events[-1].type == "response.done" and events[-1].response.status == "completed"


def test_text_modality_sends_text_deltas_only() -> None:
    stream = ResponseStream(ItemLog(), modality="text")
    events = _frame(stream, "Hi") + _frame(stream, " you")
    for _ in range(QUIET_FRAMES + 1):
        events += _frame(stream)
    kinds = _types(events)
    assert "response.output_audio.delta" not in kinds
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == ["Hi", " you"]
    done = events[-1].response
    assert done.output_modalities == ["text"] and done.output[0].content[0].text == "Hi you"


def test_beta_dialect_names() -> None:
    stream = ResponseStream(ItemLog(), audio_config={"voice": "v"})
    events = _frame(stream, "Hi")
    for _ in range(QUIET_FRAMES + 1):
        events += _frame(stream)
    beta = [event_dict(e, "beta") for e in events]
    kinds = [d["type"] for d in beta if d is not None]
    assert "response.audio.delta" in kinds and "response.audio_transcript.delta" in kinds
    assert "conversation.item.created" in kinds and "conversation.item.done" not in kinds
    assert "response.output_audio.delta" not in kinds
    done = beta[-1]
    assert done["response"]["modalities"] == ["audio"] and "audio" not in done["response"]
    assert done["response"]["output"][0]["content"][0]["type"] == "audio"
    ga = event_dict(events[-1], "ga")
    assert ga["response"]["output"][0]["content"][0]["type"] == "output_audio"


def test_user_speech_items_follow_the_voice_activity_tracker() -> None:
    log = ItemLog()
    user = UserSpeech(log)
    tracker = UtteranceTracker()
    events: list = []
    voiced = [False] * 5 + [True] * 10 + [False] * 12
    for i, v in enumerate(voiced):
        tracker.update(i, v)
        events += user.poll(tracker)
    assert _types(events) == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
    ]
    started, stopped, committed, added, _ = events
    assert started.audio_start_ms == 400 and stopped.audio_end_ms == 1200
    assert started.item_id == stopped.item_id == committed.item_id == added.item.id
    assert added.item.role == "user" and added.item.content[0].type == "input_audio"
    partial = user.transcript(0, "what is", final=False, start_s=0.4, end_s=None)
    more = user.transcript(0, "what is the", final=False, start_s=0.4, end_s=None)
    assert [e.delta for e in partial + more] == ["what is", " the"]
    (completed,) = user.transcript(0, "what is the time", final=True, start_s=0.4, end_s=1.2)
    assert completed.type == "conversation.item.input_audio_transcription.completed"
    assert completed.item_id == started.item_id and completed.transcript == "what is the time"
    assert completed.usage == {"type": "duration", "seconds": 0.8}
    # a blip too short to be an utterance starts and stops, and is not committed
    blip: list = []
    for i, v in enumerate([True] + [False] * 12, start=len(voiced)):
        tracker.update(i, v)
        blip += user.poll(tracker)
    assert _types(blip) == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"]
    assert log.last_id == started.item_id


def _utterance(tracker: UtteranceTracker, user: UserSpeech, start: int) -> tuple[list, int]:
    """One utterance of 10 voiced frames then 12 silent ones from frame ``start``: its events, the next frame."""
    events: list = []
    for i, v in enumerate([True] * 10 + [False] * 12, start=start):
        tracker.update(i, v)
        events += user.poll(tracker)
    return events, start + 22


def test_user_speech_records_stay_bounded_over_many_utterances() -> None:
    """Issue 18: the per-utterance records are the latest UTTERANCES_KEPT; every utterance still gets the same
    events (a new unique id, committed after the previous one, its transcripts), and the ids kept stay reserved."""
    log = ItemLog()
    user = UserSpeech(log)
    tracker = UtteranceTracker()
    frame, previous, ids = 0, None, []
    for k in range(UTTERANCES_KEPT + 200):
        events, frame = _utterance(tracker, user, frame)
        events += user.transcript(k, "hello", final=False, start_s=0.0, end_s=None)
        events += user.transcript(k, "hello there", final=False, start_s=0.0, end_s=None)
        events += user.transcript(k, "hello there", final=True, start_s=0.0, end_s=0.8)
        assert _types(events) == [
            "input_audio_buffer.speech_started",
            "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed",
            "conversation.item.added",
            "conversation.item.done",
            "conversation.item.input_audio_transcription.delta",
            "conversation.item.input_audio_transcription.delta",
            "conversation.item.input_audio_transcription.completed",
        ]
        item_id = events[0].item_id
        assert all(getattr(e, "item_id", item_id) == item_id for e in events) and events[3].item.id == item_id
        assert events[2].previous_item_id == previous and [e.delta for e in events[5:7]] == ["hello", " there"]
        previous = item_id
        ids.append(item_id)
        assert len(user._utterances) <= UTTERANCES_KEPT and len(user._ids) <= UTTERANCES_KEPT
    assert len(set(ids)) == len(ids)
    assert all(user.reserved(i) for i in ids[-UTTERANCES_KEPT:]) and not any(user.reserved(i) for i in ids[:200])
    # a transcript of an utterance forgotten long ago (none comes so late) is dropped, never given a new id
    assert user.transcript(3, "late", final=True, start_s=0.0, end_s=0.8) == []
    assert len(user._utterances) == UTTERANCES_KEPT and len(log.items) == ITEM_LOG_SIZE


def test_a_response_without_pause_ends_at_its_token_bound_and_the_next_words_open_another() -> None:
    """An agent that never pauses: each response ends ``incomplete`` (max_output_tokens) at the bound, with its
    transcript, and the next one opens at once, so every agent frame is still sent (one transcript never grows for
    the whole session)."""
    log = ItemLog()
    stream = ResponseStream(log, max_text_tokens=5)
    events = []
    for i in range(12):
        events += stream.audio(b"\x00" * 4)
        events += stream.text(f" w{i}")
    done = [e.response for e in events if e.type == "response.done"]
    assert [(r.status, r.status_details.reason) for r in done] == [("incomplete", "max_output_tokens")] * 2
    assert [r.usage.output_token_details["text_tokens"] for r in done] == [5, 5]
    transcripts = [e.transcript for e in events if e.type == "response.output_audio_transcript.done"]
    assert transcripts == ["w0 w1 w2 w3 w4", "w5 w6 w7 w8 w9"]
    assert stream.active and len([e for e in events if e.type == "response.created"]) == 3
    assert len([e for e in events if e.type == "response.output_audio.delta"]) == 12  # every agent frame


def test_cancel_of_an_empty_response_does_not_mute_the_agents_next_turn() -> None:
    """A response the client opened and cancelled before the agent said a word had no turn to cut short: the
    agent's next words open a response at once (they were dropped until a pause of QUIET_FRAMES, so a client that
    cancelled before the conversation started never heard an agent that never paused)."""
    stream = ResponseStream(ItemLog())
    stream.create()
    _frame(stream)
    cancelled = stream.cancel()
    assert (
        cancelled[-1].response.status == "cancelled"
        and cancelled[-1].response.usage.output_token_details["text_tokens"] == 0
    )
    again = _frame(stream, "Hello")
    assert _types(again)[0] == "response.created"
    assert "response.output_audio_transcript.delta" in _types(again)


def test_cancel_of_another_response_cancels_nothing() -> None:
    stream = ResponseStream(ItemLog())
    created = stream.create()[0].response.id
    for wrong in ("resp_nope", "r" * 10_000):
        with pytest.raises(RealtimeEventError) as info:
            stream.cancel(wrong, event_id="c1")
        assert (info.value.code, info.value.param, info.value.event_id) == (
            "response_cancel_not_active",
            "response_id",
            "c1",
        )
        assert info.value.message.startswith("Cancellation failed:") and created in info.value.message
        assert len(info.value.message) < 250 and stream.active  # still in progress
    done = stream.cancel(created)
    assert done[-1].response.id == created and done[-1].response.status == "cancelled"


def test_item_log_ids_are_unique_and_audio_is_counted_per_message() -> None:
    log = ItemLog()
    stream = ResponseStream(log)
    stream.create()
    for _ in range(3):
        stream.audio(b"\x00" * 4)
    (message,) = [i for i in log.items.values() if isinstance(i, MessageItem)]
    assert log.audio_ms(message.id) == 240 and log.audio_ms("item_other") == 0
    with pytest.raises(ValueError):
        log.add(message)
    call = FunctionCallItem(id="item_c", call_id="call_mine", name="f", arguments="{}")
    log.add(call)
    assert log.function_call("call_mine") is call and log.function_call("call_other") is None
    log.delete(message.id)
    assert log.audio_ms(message.id) == 0


@pytest.mark.parametrize("fmt", ["g711_ulaw", "g711_alaw", "pcm16"])
def test_every_agent_frame_is_80_ms_on_the_wire(fmt: str) -> None:
    out = OutputAudio(fmt)
    rng = np.random.default_rng(0)
    sizes = {len(out.encode((rng.standard_normal(1920) * 0.1).astype(np.float32))) for _ in range(40)}
    assert sizes == ({3840} if fmt == "pcm16" else {640})


def test_decimator_filters_before_it_drops_samples() -> None:
    """24 -> 8 kHz: the telephone band passes, what would fold into it is 70 dB down, any chunking."""

    def level_db(hz: float, chunk: int) -> float:
        x = np.sin(2 * np.pi * hz * np.arange(2 * SR) / SR).astype(np.float32)
        d = Decimator()
        y = np.concatenate([d(x[i : i + chunk]) for i in range(0, len(x), chunk)])
        assert len(y) == len(x) // 3
        return float(20 * np.log10(np.sqrt(np.mean(y[400:] ** 2)) / np.sqrt(0.5)))

    for chunk in (1920, 7, 1000):
        for hz in (300.0, 1000.0, 3400.0):
            assert abs(level_db(hz, chunk)) < 0.1, (hz, chunk)
        for hz in (4600.0, 6000.0, 9000.0, 11000.0):
            assert level_db(hz, chunk) < -70.0, (hz, chunk)


class _Session:
    """What :class:`RealtimeAdapter` reads of its session when it renders calls and takes client items."""

    id = "s1"
    recorded_voice = None
    hub = SimpleNamespace(settings=SimpleNamespace(client_tool_timeout_s=5.0), default_voice="tiny0")

    def __init__(self) -> None:
        self.queued: list = []
        self.put = self.queued.append


def test_client_function_calls_are_forgotten_past_the_bound_never_while_waiting() -> None:
    """Issue 18: the adapter remembers the latest CALLS_KEPT calls that are over, and every call still waiting;
    a second output of a remembered call is still ``late_call_output``."""
    from cspan.server.adapters.realtime import CALLS_KEPT, RealtimeAdapter, _Call, _FunctionCall

    adapter = RealtimeAdapter(_Session(), Connection(path="/v1/realtime"))
    loop = asyncio.new_event_loop()
    try:

        def call(k: int) -> _Call:
            made = _Call("lookup", {"k": k}, loop.create_future())
            events = adapter._events(_FunctionCall(made))
            (item,) = [e.item for e in events if e.type == "response.output_item.done"]
            assert item.type == "function_call" and item.call_id == made.call_id
            return made

        def output(call_id: str, event_id: str) -> None:
            adapter._item_create(
                parse_client_event(
                    json.dumps(
                        {
                            "type": "conversation.item.create",
                            "event_id": event_id,
                            "item": {"type": "function_call_output", "call_id": call_id, "output": "ok"},
                        }
                    )
                )
            )

        waiting = call(-1)  # never answered: the router still waits for it
        calls = []
        for k in range(CALLS_KEPT + 50):
            calls.append(call(k))
            output(calls[-1].call_id, f"e{k}")
            assert calls[-1].future.result() == "ok"
            assert len(adapter._calls) <= CALLS_KEPT + 1
        assert waiting.call_id in adapter._calls and not waiting.future.done()
        assert calls[0].call_id not in adapter._calls and calls[-1].call_id in adapter._calls
        with pytest.raises(RealtimeEventError) as late:
            output(calls[-1].call_id, "again")
        assert late.value.code == "late_call_output" and "has an output already" in late.value.message
        output(waiting.call_id, "finally")  # its item left the log long ago; the call is still answered
        assert waiting.future.result() == "ok" and waiting.call_id in adapter._calls
    finally:
        loop.close()


def test_item_log_places_items_as_previous_item_id_says() -> None:
    """OpenAI's ``previous_item_id``: unset appends, ``"root"`` puts the item first, an id puts it right after that
    item; the id returned is the item now before it, and the server's next item still goes at the end."""
    from cspan.server.realtime_events import MessageItem
    from cspan.server.realtime_turns import ItemLog

    def message(item_id: str) -> MessageItem:
        return MessageItem(id=item_id, role="user", content=[])

    log = ItemLog()
    assert log.add(message("a")) is None and log.add(message("b")) == "a" and log.add(message("c")) == "b"
    assert log.add(message("r"), after="root") is None
    assert log.add(message("m"), after="a") == "a"
    assert list(log.items) == ["r", "a", "m", "b", "c"] and log.last_id == "c"
    assert log.add(message("d")) == "c"
    log.delete("d")
    assert log.last_id == "c"
    with pytest.raises(ValueError, match="no item 'x'"):
        log.add(message("e"), after="x")
    with pytest.raises(ValueError, match="already"):
        log.add(message("a"), after="root")
    assert list(log.items) == ["r", "a", "m", "b", "c"]


def test_an_assistant_message_deleted_mid_response_leaves_no_state_for_the_item_that_takes_its_id() -> None:
    """``conversation.item.delete`` of the assistant message still streaming: its frames went on being counted under
    its id (a counter that outlived the item), so an item the client then created under that id (LiveKit's delete +
    create) could be truncated at audio the server never sent for it, and the message's end overwrote that item."""
    from cspan.server.adapters.realtime import RealtimeAdapter

    adapter = RealtimeAdapter(_Session(), Connection(path="/v1/realtime"))
    stream = adapter.responses
    opening = _frame(stream, "Hello")
    item_id = next(e.item.id for e in opening if e.type == "conversation.item.added")
    for _ in range(3):
        _frame(stream, " there")
    assert adapter.items.audio_ms(item_id) == 4 * 80

    def handle(event: dict) -> None:
        asyncio.run(adapter._handle(parse_client_event(json.dumps(event))))

    handle({"type": "conversation.item.delete", "event_id": "d", "item_id": item_id})
    assert adapter.items.audio_ms(item_id) == 0
    for _ in range(5):  # the response goes on streaming the deleted message
        events = _frame(stream, " more")
        assert {e.item_id for e in events} == {item_id}
    assert adapter.items.audio_ms(item_id) == 0 and item_id not in adapter.items.items
    mine = {"type": "message", "id": item_id, "role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]}
    handle({"type": "conversation.item.create", "event_id": "c", "item": mine})
    _frame(stream, " still")
    assert adapter.items.audio_ms(item_id) == 0  # the client's item: no audio was sent for it
    with pytest.raises(RealtimeEventError) as refused:
        handle(
            {
                "type": "conversation.item.truncate",
                "event_id": "t",
                "item_id": item_id,
                "content_index": 0,
                "audio_end_ms": 80,
            }
        )
    assert refused.value.param == "audio_end_ms" and "0 ms of audio sent" in refused.value.message
    closing = []
    for _ in range(QUIET_FRAMES + 1):
        closing += _frame(stream)
    assert closing[-1].type == "response.done"
    assert closing[-1].response.output[0].content[0].transcript.startswith("Hello there")
    kept = adapter.items.get(item_id)  # the client's item, untouched by the message's end
    assert kept.content[0].text == "Hi" and kept.content[0].transcript is None
    assert adapter.items.chars == 2


def _chars_held(log: ItemLog) -> int:
    from cspan.server.realtime_turns import _text_chars

    return sum(_text_chars(i) for i in log.items.values())


def test_transcripts_count_in_the_item_logs_character_bound() -> None:
    """The bound of :data:`ITEM_LOG_CHARS` counted an item's text once, when it was added: an assistant message is
    added empty and its transcript grows by deltas, a user item gets its transcript later, a function call its
    arguments; none of that was counted, so a log could hold any number of characters."""
    log = ItemLog(max_chars=100)
    stream = ResponseStream(log)
    old = MessageItem(id="item_old", role="user", content=[])
    log.add(old)
    _frame(stream, "x" * 60)
    assert log.chars == 60 and "item_old" in log.items  # deltas are counted as they come
    _frame(stream, "y" * 30)
    assert log.chars == 90
    for _ in range(QUIET_FRAMES + 1):
        _frame(stream)
    assert not stream.active and log.chars == 90 == _chars_held(log)  # the finished item: counted once
    _frame(stream, "z" * 40)  # a second message: past the bound, the oldest items (the first message) are forgotten
    assert len(log.items) == 1 and log.chars == 40
    # a function call's arguments
    _events, _call_id, call_item = stream.function_call("f", {"a": "b" * 50})
    assert call_item in log.items and log.chars == _chars_held(log) <= 100
    # a user item's transcript
    speech = UserSpeech(log)
    speech.transcript(0, "w" * 80, final=True, start_s=0.0, end_s=1.0)
    user_item = speech.item_id(0)
    assert log.items[user_item].content[0].transcript == "w" * 80
    assert log.chars == _chars_held(log) <= 100 and list(log.items) == [user_item]
