"""`cspan infer`'s JSON written by :class:`InferJsonStream`: the lists spooled next to the destination as the
conversation runs, the file byte for byte what ``InferOutput(...).model_dump_json(indent=2)`` writes of the same
values, the spool removed whatever happens (issue 18: memory bounded over any duration)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from fs_faults import tmpfs

from cspan.core.errors import OutputError
from cspan.core.events import (
    ErrorEvent,
    LateEvent,
    NoSpanEvent,
    PersonaEvent,
    QuestionEvent,
    RetEvent,
    SpanEvent,
    TextEvent,
    UserTextEvent,
)
from cspan.server.output import (
    AgentWord,
    CheckpointIdentity,
    InferJsonStream,
    InferOutput,
    PersonaInfo,
    Timing,
    UserTranscript,
    WindowSummary,
)

ENGINE = SimpleNamespace(context=3000, positions=[4321])


def _events() -> list:
    """Events of every type, with text that JSON escapes (quotes, backslash, control) and that is not ASCII."""
    pieces = ["Hé", "llo", " wörld", " ", "☃", " 日本", "語", ' "q"\\', "\t\x01", " "]
    events: list = [TextEvent(frame=k + 1, t=(k + 1) * 0.08, token=100 + k, text=p) for k, p in enumerate(pieces)]
    events += [
        UserTextEvent(frame=20, t=1.6, utterance=0, final=False, start_s=0.5, end_s=None, text="qué"),
        UserTextEvent(frame=30, t=2.4, utterance=0, final=True, start_s=0.5, end_s=2.32, text="qué tiempo — “hace”"),
        RetEvent(frame=31, t=2.48, forced=True, plan="cache"),
        QuestionEvent(frame=32, t=2.56, text="weather in Zürich?", ret_frame=31, asr_s=0.012),
        SpanEvent(
            frame=40,
            t=3.2,
            text="Zürich: 14 °C\nrain",
            tool="get_weather",
            arguments={"city": "Zürich", "n": [1.5]},
            source="tool:get_weather",
            question="weather in Zürich?",
            ret_frame=31,
            asked_at=2.56,
            injected_at=3.2,
            backend_s=0.25,
            n_frames=12,
            prefill_ms=1.25e-05,
            retrieval_id=7,
        ),
        SpanEvent(frame=50, t=4.0, text="Ada, Leeds", source="memory", injected_at=4.0, n_frames=5, prefill_ms=3.0),
        LateEvent(frame=60, t=4.8, question="q", text="t", source="llm", seconds=2.75, error="slow"),
        NoSpanEvent(frame=61, t=4.88, question="nothing?", error="no match"),
        PersonaEvent(frame=70, t=5.6, kind="pin", position=1, positions=210),
        PersonaEvent(frame=80, t=6.4, kind="reprefix", position=3030, positions=209),
        PersonaEvent(frame=90, t=7.2, kind="reprefix", position=6000, positions=209),
        ErrorEvent(frame=91, t=7.28, stage="asr", message="boom: ✗"),
        UserTextEvent(frame=95, t=7.6, utterance=1, final=True, start_s=7.0, end_s=None, text=""),
        TextEvent(frame=96, t=7.68, token=5, text="end"),
    ]
    return events


def _document(**lists) -> InferOutput:
    return InferOutput(
        input="in é.wav",
        output_wav=None,
        sample_rate=24000,
        duration_s=8.0,
        input_offset_s=1.04,
        persona=PersonaInfo(frames=209, voice_frames=20, text_tokens=187, window=3000),
        window=lists.pop("window", None),
        agent_text="Héllo wörld ☃",
        timing=Timing(frames=100, step=None, prefill=None, realtime_factor=2.5),
        settings={"span": ["1.0:é"], "x": None},
        checkpoint=CheckpointIdentity(source="tiny", files={}, dep_q=16, num_parameters=1, dtype="f", device="cpu"),
        **lists,
    )


def _reference_lists(events: list) -> dict:
    """The lists as ``cspan infer`` built them from a whole event list before the stream (the rule it keeps)."""
    words: list[AgentWord] = []
    for ev in events:
        if isinstance(ev, TextEvent):
            if ev.text.startswith(" ") or not words:
                words.append(AgentWord(text=ev.text.strip(), start_s=ev.t, frame=ev.frame))
            else:
                words[-1].text += ev.text
    transcripts = [
        UserTranscript(utterance=e.utterance, start_s=e.start_s, end_s=e.end_s, text=e.text)
        for e in events
        if isinstance(e, UserTextEvent) and e.final
    ]
    return {"agent_words": [w for w in words if w.text], "user_transcripts": transcripts, "events": events}


@pytest.mark.parametrize("count", [0, 1, 2, None], ids=["no-events", "one-event", "two-events", "every-type"])
def test_streamed_json_is_byte_identical_to_the_whole_document(count, tmp_path: Path) -> None:
    events = _events()[:count]
    stream = InferJsonStream(tmp_path / "out.json")
    spool = [p for p in tmp_path.iterdir() if p.name.startswith(".out.json.") and p.name.endswith(".part")]
    assert len(spool) == 1 and spool[0].is_dir()  # next to the destination, on its file system
    for ev in events:
        stream.on_event(ev)
    window = stream.window(ENGINE, "pinned")
    stream.write(_document(agent_words=[], user_transcripts=[], events=[], window=window))

    expected = _document(**_reference_lists(events), window=window).model_dump_json(indent=2) + "\n"
    assert (tmp_path / "out.json").read_text(encoding="utf-8") == expected
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # the spool is gone
    assert InferOutput.model_validate_json((tmp_path / "out.json").read_bytes()).events == events


def test_counters_and_window_summary_come_from_the_events(tmp_path: Path) -> None:
    stream = InferJsonStream(tmp_path / "out.json")
    for ev in _events():
        stream.on_event(ev)
    assert stream.spans == 2 and list(stream.prefill_ms) == [1.25e-05, 3.0]
    assert stream.counts == {"agent_words": 5, "user_transcripts": 2, "events": len(_events())}  # "end": on write
    assert stream.window(ENGINE, "reprefix") == WindowSummary(
        persona_policy="reprefix", context=3000, positions=4321, pinned_at_frame=70, reprefix_frames=[80, 90],
        memory_spans=1,
    )  # fmt: skip
    stream.drop()
    assert list(tmp_path.iterdir()) == []


def test_without_a_path_nothing_is_spooled(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    stream = InferJsonStream(None)
    for ev in _events():
        stream.on_event(ev)
    assert not stream.spooling and stream.spans == 2 and stream.error is None
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_spooling_is_an_error_naming_the_json_and_leaves_nothing(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", size_kb=8) as small:
        stream = InferJsonStream(small / "o.json")
        for _ in range(100):  # about 200 bytes each: the buffers reach the disk and fill it
            for ev in _events():
                stream.on_event(ev)
        assert stream.error is not None and not stream.spooling
        assert str(stream.error).startswith(f"{small / 'o.json'}: cannot write: no space left on device")
        assert list(small.iterdir()) == []  # the spool went at once, freeing the space
        with pytest.raises(OutputError, match="no space left on device"):
            stream.write(_document(agent_words=[], user_transcripts=[], events=[]))
        assert list(small.iterdir()) == []


def test_infer_result_reads_its_json_on_first_use_and_says_when_there_is_none(tmp_path: Path) -> None:
    from cspan.core.errors import CspanError
    from cspan.server.infer import InferResult

    path = tmp_path / "out.json"
    path.write_text(_document(agent_words=[], user_transcripts=[], events=_events()).model_dump_json(indent=2))
    result = InferResult(output_text=path, engine=None, conversation=None)
    assert result.output.events == _events() and result.output is result.output  # read once
    with pytest.raises(CspanError, match="no --output-text"):
        _ = InferResult(output_text=None, engine=None, conversation=None).output
