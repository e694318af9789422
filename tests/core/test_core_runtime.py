"""The conversation runtime's frame clock and ``<ret>`` policy, with a scripted engine and backends.

The engine here is a stand-in that records what the runtime asks of it (the real engine is tested in
test_core_engine*.py and end to end by ``cspan infer``); the policy under test is the runtime's own.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from cspan.core.constants import FRAME_SIZE, RET
from cspan.core.events import (
    CONVERSATION_ENDED,
    ErrorEvent,
    LateEvent,
    NoSpanEvent,
    QuestionEvent,
    RetEvent,
    SpanEvent,
    TextEvent,
    UserTextEvent,
)
from cspan.core.runtime import TRAILING_FRAMES, Conversation, ConversationConfig


@dataclass
class _Report:
    n: int
    prefill_ms: float = 1.0
    truncated: bool = False
    prefix_in_window: bool = True
    deferred: bool = True


@dataclass
class RecordingEngine:
    injected: list[tuple[int, str]] = field(default_factory=list)
    frame: int = 0

    def inject_span(self, session: int, text: str) -> _Report:
        self.injected.append((self.frame, text))
        return _Report(n=len(text.split()) + 2)


@dataclass
class ScriptedVAD:
    voiced_frames: set[int]
    i: int = 0

    def is_voiced(self, frame: np.ndarray) -> bool:
        v = self.i in self.voiced_frames
        self.i += 1
        return v

    def reset(self) -> None:
        self.i = 0


@dataclass
class _Transcript:
    text: str
    words: None = None


class FakeTranscriber:
    def __init__(self, text: str) -> None:
        self.text = text
        self.calls: list[int] = []

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> _Transcript:
        self.calls.append(len(pcm))
        return _Transcript(self.text)


@dataclass
class _Result:
    question: str | None
    reference: str | None
    tool: str | None = None
    arguments: dict | None = None
    source: str | None = "test"
    error: str | None = None
    late: bool = False


class FakeRetriever:
    def __init__(
        self,
        reference: str | None = "The answer is 42.",
        delay_s: float = 0.0,
        fail: bool = False,
        reports_late: bool = False,
    ):
        self.reference = reference
        self.delay_s = delay_s
        self.fail = fail
        self.reports_late = reports_late
        self.requests: list[dict] = []

    async def retrieve(self, **kw) -> _Result:
        self.requests.append(kw)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail:
            raise ConnectionError("router down")
        q = kw.get("question") or "transcribed window"
        if self.reports_late:  # as cspan.backends' Retriever does when its deadline_s runs out
            return _Result(question=q, reference=None, error="missed its deadline", late=True)
        return _Result(question=q, reference=self.reference)


class FakeTokenizer:
    def id_to_piece(self, i: int) -> str:
        return f"\u2581w{i}"

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


def _run(conv: Conversation, engine: RecordingEngine, n_frames: int, ret_frames=(), tokens=None) -> None:
    async def go() -> None:
        for i in range(n_frames):
            engine.frame = i
            await conv.before_step(np.zeros(1920, dtype=np.float32))
            tok = (tokens or {}).get(i, 3)
            await conv.after_step(RET if i in ret_frames else tok, i in ret_frames)
            await asyncio.sleep(0)
        await conv.finish()

    asyncio.run(go())


def _conv(engine, *, voiced=(), transcriber=None, retriever=None, **cfg) -> Conversation:
    cfg.setdefault("span_delay_s", 0.8)
    return Conversation(
        engine,
        0,
        tokenizer=FakeTokenizer(),
        transcriber=transcriber,
        retriever=retriever,
        config=ConversationConfig(**cfg),
        vad=ScriptedVAD(set(voiced)),
    )


def test_fresh_final_transcript_is_the_question_and_span_lands_after_the_delay():
    engine, asr, ret = RecordingEngine(), FakeTranscriber("when does the library open"), FakeRetriever()
    conv = _conv(engine, voiced=range(5, 30), transcriber=asr, retriever=ret)
    # utterance 5..29 ends after 9 silent frames -> ended at frame 38; <ret> at 40
    _run(conv, engine, 80, ret_frames={40})
    finals = [e for e in conv.events if isinstance(e, UserTextEvent) and e.final]
    assert [(e.start_s, e.end_s, e.text) for e in finals] == [(0.4, 2.4, "when does the library open")]
    # the recognizer hears the utterance and TRAILING_FRAMES after its last voiced frame (the end of the last word)
    assert asr.calls[-1] == (30 + TRAILING_FRAMES - 5) * FRAME_SIZE
    rets = [e for e in conv.events if isinstance(e, RetEvent)]
    assert [(r.frame, r.plan) for r in rets] == [(40, "cache")]
    q = [e for e in conv.events if isinstance(e, QuestionEvent)]
    assert q[0].text == "when does the library open" and ret.requests[0]["question"] == q[0].text
    spans = [e for e in conv.events if isinstance(e, SpanEvent)]
    assert len(spans) == 1 and spans[0].frame == 40 + 10  # asked at 40, 0.8 s = 10 frames later
    assert spans[0].deferred and spans[0].prefill_ms == 1.0  # the engine's report, as it said
    assert engine.injected == [(50, "The answer is 42.")]


def test_ret_while_speaking_waits_for_the_cut_utterance():
    engine, asr, ret = RecordingEngine(), FakeTranscriber("what time is it"), FakeRetriever()
    conv = _conv(engine, voiced=range(5, 20), transcriber=asr, retriever=ret)
    _run(conv, engine, 60, ret_frames={17})
    rets = [e for e in conv.events if isinstance(e, RetEvent)]
    assert rets[0].plan == "wait"
    final = next(e for e in conv.events if isinstance(e, UserTextEvent) and e.final)
    # last voiced frame 19 -> cut after 5 silent frames (0.4 s) at frame 24 instead of 9 (0.72 s)
    assert final.frame == 24
    q = next(e for e in conv.events if isinstance(e, QuestionEvent))
    assert q.frame == 24 and q.text == "what time is it"


def test_a_ret_waiting_for_the_utterance_when_the_conversation_ends_is_recorded_by_the_retriever():
    """A ``<ret>`` still waiting for the user's utterance at the end (the retriever never asked) gets its ``no_span``
    and, where the retriever keeps records (``record_cut``), its record: why, when the ``<ret>`` came and how long it
    waited; a retriever without ``record_cut`` is left as it is."""

    class RecordingRetriever(FakeRetriever):
        def __init__(self) -> None:
            super().__init__()
            self.cuts: list[dict] = []

        async def record_cut(self, **kw) -> int:
            self.cuts.append(kw)
            return 7

    for retriever in (RecordingRetriever(), FakeRetriever()):
        engine = RecordingEngine()
        conv = _conv(engine, voiced=range(5, 60), transcriber=FakeTranscriber("what time"), retriever=retriever)
        before = time.time()
        _run(conv, engine, 20, ret_frames={17})  # finish() at frame 20: the user still speaks, the <ret> waits
        assert [e.plan for e in conv.events if isinstance(e, RetEvent)] == ["wait"]
        assert retriever.requests == []
        ended = [e for e in conv.events if isinstance(e, NoSpanEvent)]
        assert [(e.question, e.error, e.retrieval_id) for e in ended] == [(None, CONVERSATION_ENDED, None)]
        if isinstance(retriever, RecordingRetriever):
            (cut,) = retriever.cuts
            assert cut["why"] == CONVERSATION_ENDED and cut["conversation_id"] == conv.conversation_id
            assert before <= cut["asked_at"] <= time.time() and 0 <= cut["waited_s"] < 10


def test_no_utterance_transcribes_the_listen_window_through_the_retriever():
    engine, ret = RecordingEngine(), FakeRetriever()
    conv = _conv(engine, retriever=ret, listen_s=2.0)
    _run(conv, engine, 50, ret_frames={30})
    req = ret.requests[0]
    assert req["question"] is None and req["sample_rate"] == 24_000
    assert len(req["audio"]) == 25 * 1920  # 2 s window ending at the <ret> frame
    assert [e.plan for e in conv.events if isinstance(e, RetEvent)] == ["window"]
    assert any(isinstance(e, QuestionEvent) and e.text == "transcribed window" for e in conv.events)


def test_the_question_transcribed_by_the_retriever_carries_its_transcription_time():
    """A ``question`` event says the transcription latency where one ran (``asr_s``): the listen window's question
    is transcribed by the retriever, whose result says how long that took."""

    class TimedRetriever(FakeRetriever):
        async def retrieve(self, **kw):
            result = await super().retrieve(**kw)
            result.asr_s = 0.25 if kw.get("question") is None else 0.0  # as cspan.backends' SpanResult.asr_s
            return result

    engine = RecordingEngine()
    conv = _conv(engine, retriever=TimedRetriever(), listen_s=2.0)
    _run(conv, engine, 50, ret_frames={30})
    question = next(e for e in conv.events if isinstance(e, QuestionEvent))
    assert (question.text, question.asr_s) == ("transcribed window", 0.25)


def test_second_ret_while_pending_is_ignored_and_reported():
    engine, ret = RecordingEngine(), FakeRetriever()
    conv = _conv(engine, retriever=ret)
    _run(conv, engine, 40, ret_frames={10, 12})
    rets = [e for e in conv.events if isinstance(e, RetEvent)]
    assert [(r.frame, r.ignored is None) for r in rets] == [(10, True), (12, False)]
    assert len(ret.requests) == 1


def test_failing_backend_gives_no_span_and_the_conversation_goes_on():
    engine, ret = RecordingEngine(), FakeRetriever(fail=True)
    conv = _conv(engine, retriever=ret)
    _run(conv, engine, 40, ret_frames={5, 30})
    no = [e for e in conv.events if isinstance(e, NoSpanEvent)]
    assert len(no) == 2 and "router down" in (no[0].error or "")
    assert engine.injected == []
    assert conv.frame == 40


def test_live_clock_cancels_a_retrieval_that_outlives_its_deadline():
    engine, ret = RecordingEngine(), FakeRetriever(delay_s=10.0)
    conv = _conv(engine, retriever=ret, span_delay_s=None, span_deadline_s=0.4)
    _run(conv, engine, 20, ret_frames={2})
    assert ret.requests[0]["deadline_s"] == pytest.approx(0.4)  # the retriever gets the wall-clock budget
    late = [e for e in conv.events if isinstance(e, LateEvent)]
    # the first frame past the deadline plus the grace (0.4 + 0.16 s = 7 frames) after the <ret>
    assert len(late) == 1 and late[0].frame == 2 + 8
    assert engine.injected == []


@pytest.mark.parametrize("answered", [False, True])
def test_a_retrieval_not_read_when_the_conversation_ends_is_reported_with_its_record(answered):
    """``finish``: a retrieval still running is cancelled with :data:`CONVERSATION_ENDED` and waited for (its backend
    records the cut, e.g. the Context DB row dropped ``cancelled``); one whose reference was ready but not read yet
    gives its ``retrieval_id``, so that its record can be marked too (was: neither, the record left as if pending)."""
    engine = RecordingEngine()
    cut: list[tuple] = []

    class Retriever:
        async def retrieve(self, **kw) -> SimpleNamespace:
            if answered:
                return SimpleNamespace(question="q", reference="The answer is 42.", span_id=7, late=False, error=None)
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError as exc:
                await asyncio.sleep(0.01)  # its record, written after the cut
                cut.append(exc.args)
                raise
            raise AssertionError("unreachable")

    conv = _conv(engine, retriever=Retriever(), span_delay_s=None)

    async def go() -> None:
        await conv.before_step(np.zeros(1920, dtype=np.float32))
        await conv.after_step(RET, True)
        await asyncio.sleep(0)  # the retrieval runs: answers, or waits
        await conv.finish()

    asyncio.run(go())
    ended = [(e.error, e.retrieval_id) for e in conv.events if isinstance(e, NoSpanEvent)]
    assert ended == [(CONVERSATION_ENDED, 7 if answered else None)]
    assert cut == ([] if answered else [(CONVERSATION_ENDED,)])  # cancelled with the reason, and waited for
    assert engine.injected == [] and not conv.busy


@pytest.mark.parametrize("ret_frame", [2, 40])
def test_live_late_report_of_the_retriever_keeps_the_question(ret_frame):
    """Window plan (<ret> at 2: the question is the retriever's transcript) and cache plan (<ret> at 40: the
    question is the fresh utterance transcript): either way the late event says what was asked."""
    engine, asr = RecordingEngine(), FakeTranscriber("when does the library open")
    ret = FakeRetriever(reports_late=True)
    conv = _conv(engine, voiced=range(5, 30), transcriber=asr, retriever=ret, span_delay_s=None)
    _run(conv, engine, 60, ret_frames={ret_frame})
    late = [e for e in conv.events if isinstance(e, LateEvent)]
    expected = "transcribed window" if ret_frame == 2 else "when does the library open"
    assert [e.question for e in late] == [expected]
    assert not any(isinstance(e, NoSpanEvent) for e in conv.events) and engine.injected == []


def test_given_span_is_injected_without_backend_and_forced_ret_counts_as_ret():
    engine = RecordingEngine()
    conv = _conv(engine)
    conv.schedule_span(7, "The weather in Sydney is 24 degrees.")
    conv.schedule_ret(9)
    _run(conv, engine, 12)
    assert engine.injected == [(7, "The weather in Sydney is 24 degrees.")]
    span = next(e for e in conv.events if isinstance(e, SpanEvent))
    assert span.source == "given" and span.n_frames == 9
    ret = next(e for e in conv.events if isinstance(e, RetEvent))
    assert ret.forced and ret.ignored == "no retriever configured"


@pytest.mark.parametrize("delay", [0.08, 0.8, 2.0])
def test_offline_clock_is_deterministic(delay):
    frames = []
    for _ in range(2):
        engine, ret = RecordingEngine(), FakeRetriever(delay_s=0.01)
        conv = _conv(engine, retriever=ret, span_delay_s=delay)
        _run(conv, engine, 60, ret_frames={5})
        frames.append(engine.injected)
    assert frames[0] == frames[1] == [(5 + max(1, round(delay * 12.5)), "The answer is 42.")]


def _timeless(events) -> list[dict]:
    """The events without their wall-clock measurements."""
    return [e.model_dump(exclude={"backend_s", "prefill_ms", "asr_s"}) for e in events]


def test_offline_backend_latency_acts_on_the_frame_clock_only():
    """The cause of non-reproducible offline runs: a backend slower (in wall-clock time) than the deadline, or
    transcripts that take a while, must change nothing; the retriever gets no wall-clock deadline at all."""
    runs = []
    for delay in (0.0, 0.05, 0.3):
        engine, asr = RecordingEngine(), FakeTranscriber("when does the library open")
        ret = FakeRetriever(delay_s=delay)
        conv = _conv(
            engine, voiced=range(5, 30), transcriber=asr, retriever=ret, span_delay_s=0.16, span_deadline_s=0.2
        )
        _run(conv, engine, 70, ret_frames={2, 40})
        assert [r["deadline_s"] for r in ret.requests] == [math.inf, math.inf]  # no wall-clock limit
        runs.append((engine.injected, _timeless(conv.events)))
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][0] == [(4, "The answer is 42."), (42, "The answer is 42.")]


@pytest.mark.parametrize(("ret_frame", "question"), [(2, "transcribed window"), (40, "when does the library open")])
def test_offline_late_is_judged_on_frames_and_keeps_the_question(ret_frame, question):
    """A reference due after the deadline on the frame clock (0.8 s delay > 0.5 s deadline) is late whatever the
    backend's speed, and the late event carries the question: the retriever's transcript (window plan) or the
    utterance transcript (cache plan)."""
    for delay in (0.0, 0.2):
        engine, asr = RecordingEngine(), FakeTranscriber("when does the library open")
        ret = FakeRetriever(delay_s=delay)
        conv = _conv(engine, voiced=range(5, 30), transcriber=asr, retriever=ret, span_delay_s=0.8, span_deadline_s=0.5)
        _run(conv, engine, 60, ret_frames={ret_frame})
        late = [e for e in conv.events if isinstance(e, LateEvent)]
        assert [(e.frame, e.question, e.text, e.seconds) for e in late] == [
            (ret_frame + 10, question, "The answer is 42.", pytest.approx(0.8))
        ]
        assert engine.injected == []


class BytePieceTokenizer(FakeTokenizer):
    """Pieces as SentencePiece renders them, with byte fallback for characters outside the vocabulary."""

    def id_to_piece(self, i: int) -> str:
        pieces = {20: "\u2581caf", 21: "<0xC3>", 22: "<0xA9>", 23: "\u2581ok", 24: "<0xE2>", 25: "<0x82>", 26: "<0xAC>"}
        return pieces.get(i, "!")


def test_text_events_join_byte_fallback_pieces_into_characters():
    """'café' is ▁caf + <0xC3> + <0xA9>: the text events render ' caf', then 'é' once its second byte came; '€'
    (three bytes) likewise; a character cut short by an ordinary piece is replaced, not dropped or left raw."""
    engine = RecordingEngine()
    conv = Conversation(engine, 0, tokenizer=BytePieceTokenizer(), vad=ScriptedVAD(set()))
    tokens = {0: 20, 1: 21, 2: 22, 3: 23, 4: 24, 5: 25, 6: 26, 7: 24, 8: 27}
    _run(conv, engine, 9, tokens=tokens)
    texts = [(e.frame, e.text) for e in conv.events if isinstance(e, TextEvent)]
    assert texts == [(0, " caf"), (2, "é"), (3, " ok"), (6, "€"), (8, "\ufffd!")]


class WindowEngine(RecordingEngine):
    """A recording engine whose persona policy acts at given frames (``DuplexEngine.take_window_events``)."""

    def __init__(self, at: dict[int, list]) -> None:
        super().__init__()
        self.at = at

    def take_window_events(self, i: int) -> list:
        return self.at.pop(self.frame, [])


def test_persona_events_and_bounded_history():
    """What the persona policy did becomes ``persona`` events at the step's frame; ``keep_history=False`` (serve)
    keeps no event list and only the last ``agent_said_tokens`` text tokens, over any number of frames."""
    from cspan.core.events import PersonaEvent
    from cspan.core.window import WindowEvent

    events = {
        7: [WindowEvent("pin", 1, 40)],
        30: [WindowEvent("reprefix", 3000, 39), WindowEvent("reprefix", 3039, 39)],
    }
    engine = WindowEngine(events)
    seen: list = []
    conv = _conv(engine, keep_history=False, agent_said_tokens=8)
    conv.on_event = seen.append
    _run(conv, engine, 400, tokens={i: 10 + i % 50 for i in range(400)})
    persona = [e for e in seen if isinstance(e, PersonaEvent)]
    assert [(e.frame, e.kind, e.position, e.positions) for e in persona] == [
        (7, "pin", 1, 40),
        (30, "reprefix", 3000, 39),
        (30, "reprefix", 3039, 39),
    ]
    assert conv.events == [] and len(seen) > 380  # every event went to on_event, none was kept
    assert conv.agent_text() == " ".join(f"w{10 + i % 50}" for i in range(392, 400))
    kept = _conv(RecordingEngine())
    _run(kept, RecordingEngine(), 20, tokens={i: 20 for i in range(20)})
    assert len(kept.events) == 20  # the default keeps everything (cspan infer's JSON)


def test_a_span_scheduled_for_a_frame_under_way_is_read_at_the_next_head():
    """``schedule_span`` for a frame whose head already ran (a memory span that arrives during the step) is read at
    the next frame's head, with its source."""
    engine = RecordingEngine()
    conv = _conv(engine)

    async def go() -> None:
        for i in range(6):
            engine.frame = i
            await conv.before_step(np.zeros(1920, dtype=np.float32))
            if i == 2:
                conv.schedule_span(conv.frame, "memory: user=Ada", source="memory")  # frame 2 is under way
            await conv.after_step(20)

    asyncio.run(go())
    assert engine.injected == [(3, "memory: user=Ada")]
    spans = [e for e in conv.events if isinstance(e, SpanEvent)]
    assert [(e.frame, e.source) for e in spans] == [(3, "memory")]


class GatedTranscriber:
    """Answers its k-th request ``t{k}``; a request in ``held`` waits until :meth:`release` (a recognizer shared
    with other sessions answers late)."""

    def __init__(self, held: set[int]) -> None:
        self.held = held
        self.gates: dict[int, asyncio.Event] = {}
        self.calls = 0

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> _Transcript:
        k, self.calls = self.calls, self.calls + 1
        if k in self.held:
            await self.gates.setdefault(k, asyncio.Event()).wait()
        return _Transcript(f"t{k}")

    def release(self) -> None:
        for k in self.held:
            self.gates.setdefault(k, asyncio.Event()).set()


@pytest.mark.parametrize(
    ("held", "release_at", "calls", "shown"),
    [
        ({1}, 75, 3, [(False, "t0"), (True, "t2")]),  # the second partial is still running when the final is asked
        ({0}, 52, 2, [(False, "t0"), (True, "t1")]),  # the first partial is still running at the second's frame
    ],
)
def test_a_transcript_never_goes_back_and_partials_do_not_pile_up(held, release_at, calls, shown):
    """An utterance voiced 5..49 asks partials at frames 25 and 45 and its final at frame 58. A partial still running
    when the next one is due stands for it (no second pass over the same audio); one still running when the final is
    asked is cancelled: the text of an utterance never goes back (was: ``final`` then a stale ``final: false``)."""
    engine, asr = RecordingEngine(), GatedTranscriber(held)
    conv = _conv(engine, voiced=range(5, 50), transcriber=asr, span_delay_s=None)

    async def go() -> None:
        for i in range(90):
            engine.frame = i
            if i == release_at:
                asr.release()
            await conv.before_step(np.zeros(1920, dtype=np.float32))
            await conv.after_step(3)
            await asyncio.sleep(0)
        await conv.finish()

    asyncio.run(go())
    got = [(e.final, e.text) for e in conv.events if isinstance(e, UserTextEvent)]
    assert asr.calls == calls and got == shown
    assert conv._asr_tasks == [] and conv._asr_shown == {}  # nothing kept once the utterance is done


def test_a_finish_given_up_on_cancels_the_transcripts_still_running():
    """A server waits a bounded time for an ending conversation's transcripts (``wait_for(finish(), ...)``): when it
    stops waiting, the transcripts still running are cancelled, not left to run on past the transcriber's shutdown
    and end in an error nobody reads (asyncio's "Task exception was never retrieved" at a server's shutdown)."""
    engine, asr = RecordingEngine(), GatedTranscriber({0})  # its first request never answers
    conv = _conv(engine, voiced=range(5, 50), transcriber=asr, span_delay_s=None)

    async def go() -> list[asyncio.Task]:
        for i in range(30):
            engine.frame = i
            await conv.before_step(np.zeros(1920, dtype=np.float32))
            await conv.after_step(3)
            await asyncio.sleep(0)
        running = [t.task for t in conv._asr_tasks]
        assert asr.calls == 1 and len(running) == 1 and not running[0].done()  # the partial of frame 25, held
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(conv.finish(), timeout=0.05)
        await asyncio.sleep(0)
        return running

    (task,) = asyncio.run(go())
    assert task.cancelled() and conv._asr_tasks == []


def test_a_slow_recognizer_gets_one_partial_at_a_time():
    """Continuous speech (frames 5..199) with a recognizer that answers its first request only at frame 150: the
    partials due at frames 45..145 are not asked (each would have decoded longer audio than the last, piling up
    behind it: minutes of backlog on a long utterance); once it answers, the partials resume at their pace, then
    the final."""
    engine, asr = RecordingEngine(), GatedTranscriber({0})
    conv = _conv(engine, voiced=range(5, 200), transcriber=asr, span_delay_s=None)
    asked: list[int] = []

    async def go() -> None:
        for i in range(240):
            engine.frame = i
            if i == 150:
                asr.release()
            calls = asr.calls
            await conv.before_step(np.zeros(1920, dtype=np.float32))
            await conv.after_step(3)
            await asyncio.sleep(0)  # a request starts running here
            if asr.calls > calls:
                asked.append(i)
        await conv.finish()

    asyncio.run(go())
    got = [(e.final, e.text) for e in conv.events if isinstance(e, UserTextEvent)]
    assert asked == [25, 165, 185, 205, 208]  # partials every 20 frames while heard, then the final
    assert got == [(False, "t0"), (False, "t1"), (False, "t2"), (False, "t3"), (True, "t4")]


class FakeStream:
    """A transcript stream that records what it is fed; ``fail`` makes ``partial`` and ``finish`` raise (the
    recognizer's process died)."""

    def __init__(self, owner: StreamingTranscriber) -> None:
        self.owner = owner
        self.fed: list[int] = []  # samples per feed
        self.state = "open"

    def feed(self, pcm: np.ndarray) -> None:
        assert self.state == "open"
        self.fed.append(len(pcm))

    async def partial(self) -> _Transcript:
        if self.owner.fail:
            raise ConnectionError("the decoding process ended")
        return _Transcript(f"heard {sum(self.fed)}")

    async def finish(self) -> _Transcript:
        self.state = "finished"
        if self.owner.fail:
            raise ConnectionError("the decoding process ended")
        return _Transcript(f"final {sum(self.fed)}")

    def cancel(self) -> None:
        if self.state == "open":
            self.state = "cancelled"


class StreamingTranscriber(FakeTranscriber):
    def __init__(self, text: str = "whole clip", *, fail: bool = False) -> None:
        super().__init__(text)
        self.fail = fail
        self.streams: list[FakeStream] = []

    def open_stream(self, sample_rate: int) -> FakeStream:
        assert sample_rate == 24_000
        self.streams.append(FakeStream(self))
        return self.streams[-1]


def _user_texts(conv: Conversation) -> list[tuple[bool, str]]:
    return [(e.final, e.text) for e in conv.events if isinstance(e, UserTextEvent)]


def test_a_streaming_transcriber_hears_each_frame_once_and_transcribes_nothing_whole():
    """An utterance voiced 5..49 with a transcriber that streams: its stream is fed every frame once, as heard, up to
    the final's clip end (the last voiced frame and TRAILING_FRAMES more, 54 frames here); the partials (frames 25,
    45) and the final (frame 58) come from it and nothing is transcribed whole. A blip too short to be an utterance
    (frames 70..71) has its stream cancelled; so has the utterance still running when the input ends."""
    engine, asr = RecordingEngine(), StreamingTranscriber()
    conv = _conv(engine, voiced=[*range(5, 50), 70, 71, *range(90, 100)], transcriber=asr, span_delay_s=None)
    _run(conv, engine, 100)
    first, blip, running = asr.streams
    assert sum(first.fed) == (50 + TRAILING_FRAMES - 5) * FRAME_SIZE and first.state == "finished"
    assert set(first.fed) == {FRAME_SIZE}  # one frame at a time, none twice
    assert _user_texts(conv) == [(False, f"heard {21 * FRAME_SIZE}"), (False, f"heard {41 * FRAME_SIZE}"),
                                 (True, f"final {49 * FRAME_SIZE}")]  # fmt: skip
    assert blip.state == "cancelled" and running.state == "cancelled"
    assert asr.calls == [] and conv._streams == {}


def test_a_failing_stream_falls_back_to_whole_clips():
    """The stream fails (its recognizer died): the partial asked of it becomes a whole-clip transcription of the same
    audio, the rest of the utterance goes without the stream, and the conversation goes on."""
    engine, asr = RecordingEngine(), StreamingTranscriber("whole clip", fail=True)
    conv = _conv(engine, voiced=range(5, 50), transcriber=asr, span_delay_s=None)
    _run(conv, engine, 70)
    assert _user_texts(conv) == [(False, "whole clip"), (False, "whole clip"), (True, "whole clip")]
    assert asr.calls == [21 * FRAME_SIZE, 41 * FRAME_SIZE, (45 + TRAILING_FRAMES) * FRAME_SIZE]
    assert asr.streams[0].state == "cancelled" and not any(isinstance(e, ErrorEvent) for e in conv.events)


@pytest.mark.parametrize(("answer_at", "in_time"), [(33, True), (45, False)])
def test_a_final_on_its_way_when_the_wait_runs_out_is_waited_for_once_more(answer_at: int, in_time: bool):
    """Live clock. ``<ret>`` at 17 while the user speaks (voiced 5..19): the wait runs to 17 + 12 = 29; the utterance
    was cut at 24 and its final is still decoding then. It is waited for up to ret_wait_s more (to 41): answered at
    33 it is the question (was: the window at 29, queued on the same transcriber behind that final); answered at 45
    the window is transcribed at 41."""
    engine, asr, ret = RecordingEngine(), GatedTranscriber({0}), FakeRetriever()  # the final is its first request
    conv = _conv(engine, voiced=range(5, 20), transcriber=asr, retriever=ret, span_delay_s=None)

    async def go() -> None:
        for i in range(60):
            engine.frame = i
            if i == answer_at:
                asr.release()
            await conv.before_step(np.zeros(1920, dtype=np.float32))
            await conv.after_step(RET if i == 17 else 3, i == 17)
            for _ in range(3):  # let a task that was just released finish before the next frame
                await asyncio.sleep(0)
        await conv.finish()

    asyncio.run(go())
    question = next(e for e in conv.events if isinstance(e, QuestionEvent))
    if in_time:
        assert question.text == "t0" and ret.requests[0]["question"] == "t0"
        assert question.frame in (answer_at, answer_at + 1)  # collected at the head of the next frame at the latest
    else:
        assert ret.requests[0]["question"] is None and len(ret.requests[0]["audio"]) > 0  # the window
        assert question.text == "transcribed window" and question.frame >= 41  # asked when the wait ran out
    assert [e.plan for e in conv.events if isinstance(e, RetEvent)] == ["wait"]


def test_the_retriever_is_told_whether_the_question_was_heard_after_the_last_span():
    """``after_span``, what a confirmation needs (docs/OPERATORS.md, "Actions need a confirmation"). The first
    question (utterance 5..29, no span read yet): False. Its span is read at 44 (asked at the cut, 34, + 0.8 s); the
    utterance 60..69 began after it: True (its span is read at 86). The <ret> at 120 finds no fresh final: its
    window of 2 s starts at 96, after the last span: True; a window of 12 s reaches back to the start: False."""
    for listen_s, window_after in ((2.0, True), (12.0, False)):
        engine, asr, ret = RecordingEngine(), FakeTranscriber("yes go ahead"), FakeRetriever()
        conv = _conv(
            engine, voiced=set(range(5, 30)) | set(range(60, 70)), transcriber=asr, retriever=ret, listen_s=listen_s
        )
        _run(conv, engine, 140, ret_frames={25, 75, 120})
        assert [r.get("question") for r in ret.requests] == ["yes go ahead", "yes go ahead", None]
        spans = [e.frame for e in conv.events if isinstance(e, SpanEvent)]
        assert spans == [44, 86, 130]
        assert [r["after_span"] for r in ret.requests] == [False, True, window_after], (listen_s, spans)


def test_a_span_s_event_names_the_frame_whose_step_read_it(tiny_checkpoint):
    """With the real engine: two long spans at the head of frame 3 and a column budget that fits one a step. The
    second is read by frame 4's step, and its ``span`` event says frame 4 (was: both said frame 3, the second
    read a frame later than reported); a span still queued when the conversation ends is a ``no_span`` with
    "conversation ended", not a span that was never read."""
    import torch

    from cspan.core.engine import DuplexEngine

    engine = DuplexEngine(tiny_checkpoint, batch_size=1, seed=0, max_block_columns=40)
    engine.set_persona(0, "You are a test.")
    conv = Conversation(engine, 0, tokenizer=tiny_checkpoint.tokenizer, config=ConversationConfig(span_delay_s=0.8))
    long = " ".join(f"word{k}" for k in range(12))
    conv.schedule_span(3, long)
    conv.schedule_span(3, long)
    conv.schedule_span(7, long)

    async def go() -> None:
        for _ in range(7):
            await conv.before_step(np.zeros(FRAME_SIZE, dtype=np.float32))
            out = engine.step(torch.zeros(1, FRAME_SIZE))
            await conv.after_step(int(out.text_token[0]) if bool(out.valid[0]) else None)
        await conv.read_spans()  # frame 7's span, queued between frames (as cspan serve does): no step follows
        await conv.finish()

    asyncio.run(go())
    spans = [e for e in conv.events if isinstance(e, SpanEvent)]
    assert [(e.frame, e.injected_at) for e in spans] == [(3, 3 * 0.08), (4, 4 * 0.08)]
    assert spans[0].n_frames > 20 and spans[0].n_frames + spans[1].n_frames > 40  # one a step
    ended = [(e.frame, e.error) for e in conv.events if isinstance(e, NoSpanEvent)]
    assert ended == [(7, "conversation ended")]  # the span of frame 7 was queued, its step never ran


def test_a_window_that_cuts_into_an_utterance_was_heard_from_its_start():
    """The <ret> at 60 finds no fresh final (the utterance 20..69 still runs): its 2 s window starts at 36, after the
    span read at 30, but cuts into speech begun at 20, before it: ``after_span`` False (the tail of a request
    is the request; was True: the window's start was taken)."""
    engine, asr, ret = RecordingEngine(), FakeTranscriber("yes do it"), FakeRetriever()
    conv = _conv(engine, voiced=range(20, 70), transcriber=asr, retriever=ret, listen_s=2.0, ret_wait_s=0.0)
    conv.schedule_span(30, "The question was read here.")
    _run(conv, engine, 90, ret_frames={60})
    assert [e.frame for e in conv.events if isinstance(e, SpanEvent)][:1] == [30]  # then the answer's
    window = [r for r in ret.requests if r.get("audio") is not None]
    assert len(window) == 1 and len(window[0]["audio"]) == 25 * FRAME_SIZE
    assert window[0]["after_span"] is False


def test_run_conversation_drives_its_own_row_of_a_batched_engine(tiny_checkpoint):
    """``run_conversation`` on session 1 of a two-session engine: the other row is given silence, and session 1
    hears the frames and says (and plays, to rounding) what the same session does alone in a one-session engine
    (was: every step was given [1, 1920] PCM, which an engine of two sessions refuses)."""
    from cspan.core.engine import DuplexEngine
    from cspan.core.runtime import run_conversation

    frames = [0.1 * np.random.default_rng(k).standard_normal(FRAME_SIZE).astype(np.float32) for k in range(8)]
    runs = []
    for batch, row in ((2, 1), (1, 0)):
        engine = DuplexEngine(tiny_checkpoint, batch_size=batch, seed=7 - row)  # session `row` has seed 7
        engine.set_persona(row, "You are a test.")
        conv = Conversation(
            engine, row, tokenizer=tiny_checkpoint.tokenizer, config=ConversationConfig(span_delay_s=0.8)
        )
        conv.schedule_span(3, "The answer is four.")
        agent = np.zeros((len(frames), FRAME_SIZE), dtype=np.float32)
        asyncio.run(run_conversation(engine, conv, frames, on_frame=lambda k, _u, a, out=agent: out.__setitem__(k, a)))
        spans = [(e.frame, e.n_frames) for e in conv.events if isinstance(e, SpanEvent)]
        runs.append((conv.agent_text(), agent, spans, engine.positions[row]))
    (text, pcm, spans, position), alone = runs
    assert spans == alone[2] == [(3, spans[0][1])] and spans[0][1] > 3
    assert text and text == alone[0] and position == alone[3] > len(frames)
    np.testing.assert_allclose(pcm, alone[1], atol=1e-5)  # the codec's batched convolutions round apart
