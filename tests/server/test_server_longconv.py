"""Conversations longer than the attention window in ``cspan infer`` and ``cspan serve`` (issue 18): the persona
policy flag, the memory span (Context DB summary read back when spans leave the window), bounded memory."""

from __future__ import annotations

import asyncio
import json
import typing
from pathlib import Path

import pytest

from cspan.core.cli import build_parser
from cspan.core.events import SpanEvent
from cspan.core.settings import SettingsError, settings_from_args
from cspan.core.window import DEFAULT_PERSONA_POLICY, PERSONA_POLICIES
from cspan.server.infer import run_infer
from cspan.server.memory_span import MEMORY_SPAN_CHARS, MemorySpan, memory_summary
from cspan.server.output import InferOutput
from cspan.server.settings_common import ModelSettings

LONG_TEXT = " ".join(f"Item {i} of the inventory weighs {7 * i} grams and sits on shelf {i % 9}." for i in range(90))
"""A reference longer than a span may be (cut to 600 columns)."""


def test_the_persona_policy_is_declared_once_with_the_engines_choices() -> None:
    field = ModelSettings.model_fields["persona_policy"]
    assert typing.get_args(field.annotation) == PERSONA_POLICIES and field.default == DEFAULT_PERSONA_POLICY
    parser = build_parser()
    for verb in (["infer", "--input-wav", "in.wav", "--output-wav", "out.wav"], ["serve"]):
        s = settings_from_args(parser.parse_args([*verb, "--persona-policy", "reprefix", "--memory-span"]))
        assert (s.persona_policy, s.memory_span) == ("reprefix", True)
        s = settings_from_args(parser.parse_args(verb))
        assert (s.persona_policy, s.memory_span) == ("pinned", False)
    with pytest.raises(SettingsError, match=r"--persona-policy / CSPAN_PERSONA_POLICY: .*'pinned', 'reprefix' or"):
        settings_from_args(parser.parse_args(["serve", "--persona-policy", "sometimes"]))


def test_memory_summary_reads_profile_facts_and_the_last_references() -> None:
    from cspan.backends.context_db import ContextDB, Profile
    from cspan.backends.identity import Principal

    db = ContextDB(":memory:")
    memory = db.user(Principal.local())
    memory.put_profile(Profile(user_id=memory.user_id, name="Ada", city="Leeds"))
    memory.set_fact("favourite_colour", "green")
    cid = memory.start_conversation(checkpoint="tiny")
    for q, text in [("weather?", "Rain in Leeds, 12 degrees."), ("time?", "It is 10:40."), ("news?", None)]:
        span = memory.add_span(cid, question=q, text=text, source="local:knowledge")
        if text is not None:
            memory.mark_span_injected(span, frame=5)
    assert memory.add_span(cid, question="dropped?", text="never read") > 0  # not injected: not repeated
    text = memory_summary(memory, cid, left=["The shelf list.", "It is 10:40."])
    assert text.startswith("memory: user=Ada, place=Leeds") and "green" in text
    assert "earlier: weather? -> Rain in Leeds, 12 degrees." in text and "earlier: time? -> It is 10:40." in text
    assert text.endswith("earlier: The shelf list.") and "never read" not in text
    assert len(memory_summary(memory, cid, left=[LONG_TEXT] * 3)) <= MEMORY_SPAN_CHARS
    other = memory.start_conversation(checkpoint="tiny")
    assert memory_summary(memory, other).startswith("memory: user=Ada")  # the profile, no references
    db.close()


def _span(frame: int, text: str, source: str = "given") -> SpanEvent:
    return SpanEvent(frame=frame, t=frame * 0.08, text=text, source=source, injected_at=0.0, n_frames=10, prefill_ms=0)


def test_memory_span_is_due_when_a_span_leaves_the_window() -> None:
    tracker = MemorySpan(window=100)
    tracker.on_event(_span(3, "first"))
    assert tracker.after_step(20) is None  # read by the step: last position <= 18
    assert tracker.after_step(117) is None  # 117 - 18 < 100
    due = tracker.after_step(118)
    assert due is not None and (due.spans_left, due.left) == (1, ["first"])
    assert tracker.after_step(500) is None  # nothing else left
    tracker.on_event(_span(40, "summary", source="memory"))
    assert tracker.after_step(520) is None
    tracker.on_event(_span(41, "second"))
    tracker.on_event(_span(41, "third"))
    assert tracker.after_step(530) is None
    tracker.reading = True
    assert tracker.after_step(700) is None  # the memory span and two spans left, but one is being read
    tracker.reading = False
    due = tracker.after_step(701)
    assert due is not None and due.spans_left == 2 and due.left == ["first", "second", "third"]
    tracker = MemorySpan(window=100)
    tracker.on_event(_span(1, "A"))
    assert tracker.after_step(20) is None
    tracker.on_event(_span(2, "B"))
    assert tracker.after_step(30) is None
    assert tracker.after_step(118).left == ["A"]
    assert tracker.after_step(128) is None and tracker.after_step(142) is None  # B left, < window / 4 after 118
    assert tracker.after_step(143).left == ["A", "B"]
    tracker.on_event(_span(3, "summary 1", source="memory"))
    assert tracker.after_step(150) is None
    tracker.on_event(_span(4, "summary 2", source="memory"))
    assert tracker.after_step(200) is None
    assert tracker.after_step(248) is None  # summary 1 left, summary 2 is still in the window
    assert tracker.after_step(298).spans_left == 0  # summary 2 left: read again
    assert MemorySpan(window=None).after_step(10**6) is None


@pytest.mark.timeout(600)
def test_infer_past_the_window_pins_the_persona_and_reads_the_memory_span(
    tiny_checkpoint_dir: Path, fixtures_dir: Path, tmp_path: Path
) -> None:
    """The tiny checkpoint (window 3000) past its window in ``cspan infer``: nine 600-column spans in 3.6 s of audio.
    The persona is pinned (one ``persona`` event, the JSON's ``window`` summary), every span reports it in the window,
    and once the first spans left the window a memory span (the profile and the references that left) is read."""
    spans = [arg for k in range(9) for arg in ("--span", f"{0.4 * k:.1f}:{k} {LONG_TEXT}")]
    argv = [
        "infer",
        "--input-wav", str(fixtures_dir / "audio" / "greeting_24k.wav"),
        "--output-wav", str(tmp_path / "out.wav"),
        "--output-text", str(tmp_path / "out.json"),
        "--checkpoint", str(tiny_checkpoint_dir),
        "--lead-silence", "0.5", "--tail-silence", "4",
        "--device", "cpu", "--seed", "5", "--quiet", "--asr", "none", "--router", "none",
        "--db", str(tmp_path / "context.sqlite"), "--user-name", "Ada",
        "--persona-policy", "pinned", "--memory-span", *spans,
    ]  # fmt: skip
    result = asyncio.run(run_infer(settings_from_args(build_parser().parse_args(argv))))
    doc = InferOutput.model_validate(json.loads((tmp_path / "out.json").read_text()))
    window = doc.window
    assert window is not None and window.persona_policy == "pinned" and window.context == 3000
    assert window.positions > 2 * 3000 and window.positions == result.engine.positions[0]
    persona = [e for e in doc.events if e.type == "persona"]
    assert [e.kind for e in persona] == ["pin"] and window.pinned_at_frame == persona[0].frame
    assert persona[0].positions == doc.persona.frames + 1 and persona[0].position > 0
    spans = [e for e in doc.events if e.type == "span"]
    assert all(e.prefix_in_window for e in spans) and all(e.truncated for e in spans if e.source == "given")
    memory = [e for e in spans if e.source == "memory"]
    assert window.memory_spans == len(memory) >= 1
    first = memory[0]
    assert first.text.startswith("memory: user=Ada") and "earlier: 0 Item 0 of the inventory" in first.text
    assert len(first.text) <= MEMORY_SPAN_CHARS
    assert result.engine.prefix_in_window(0)


SERVE_AUDIO_S = 600.0
"""Ten minutes of audio per session: two and a half windows of the tiny checkpoint."""


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_two_served_sessions_over_ten_minutes_keep_the_persona_with_bounded_memory(
    serve, fixture_file, monkeypatch
) -> None:
    """Two sessions of ``cspan serve`` (``--unpaced``: the clients' audio is the clock, so ten minutes play in the
    time the engine takes), each with ten minutes of audio and Context Spans: the persona is pinned once per session
    past the window and in the window at every span; a memory span is read once spans left; what a session keeps
    (events, agent text, utterances, span reports, its audio queue) stays bounded."""
    import websockets
    from serve_client import Client, load_frames

    from cspan.core.runtime import SPAN_REPORTS_KEPT
    from cspan.core.vad import FINISHED_KEPT

    server = serve(max_sessions=2, unpaced=True, memory_span=True)
    hub = server.hub
    clip = load_frames(fixture_file("audio", "assistant_dialogue_24k.wav"))
    n = round(SERVE_AUDIO_S * 12.5)
    audio = [clip[k % len(clip)] for k in range(n)]
    spans = [{"at": t, "text": f"{t:.0f} {LONG_TEXT}"[:1900]} for t in (20.0, 60.0, 100.0, 140.0)]
    seen: list[tuple[int, int, int]] = []

    async def talk(client: Client, volume: float) -> dict:
        ready = await client.start(profile={"name": "Ada"}, test={"spans": spans})
        assert ready["type"] == "ready"
        for k in range(0, n, 500):
            await client.stream([volume * f for f in audio[k : k + 500]], window=8)
            for s in list(hub.sessions):
                if s.conversation is not None:
                    c = s.conversation
                    seen.append((len(c.events), len(c._agent_tokens), len(c.span_reports)))
                    assert len(c.utterances.finished) <= FINISHED_KEPT and len(s.inbox) <= 250
        return await client.stop()

    async with (
        websockets.connect(server.ws_url, max_size=None) as ws1,
        websockets.connect(server.ws_url, max_size=None) as ws2,
    ):
        c1, c2 = Client(ws1), Client(ws2)
        bye1, bye2 = await asyncio.gather(talk(c1, 1.0), talk(c2, 0.5))

    assert all(events == 0 and tokens <= 64 and reports <= SPAN_REPORTS_KEPT for events, tokens, reports in seen)
    for client, bye in ((c1, bye1), (c2, bye2)):
        assert bye["stats"]["frames"] >= n and bye["stats"]["dropped_frames"] == 0
        persona = client.received.json("persona")
        assert [e["kind"] for e in persona] == ["pin"], persona
        assert 1 <= persona[0]["position"] <= 601  # the first window past the end: its first position
        given = [e for e in client.received.json("span") if e["source"] == "given"]
        memory = [e for e in client.received.json("span") if e["source"] == "memory"]
        assert len(given) == 4 and all(e["prefix_in_window"] for e in given + memory)
        assert memory and memory[0]["text"].startswith("memory: user=Ada") and "earlier: 20 Item 0" in memory[0]["text"]
