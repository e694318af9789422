"""What the embedded pocketsphinx transcriber costs the conversation runtime over one long user utterance.

One :class:`cspan.core.runtime.Conversation` (no engine: a stand-in that accepts spans) is driven on the real-time
80 ms clock through a user utterance of ``L`` seconds of real speech (the fixtures' human recordings, joined; voice
activity is given as voiced for the ``L`` seconds, silent after, so the utterance is exactly ``L`` long). The
transcriber is a real :class:`~cspan.backends.asr.sphinx.PocketSphinxTranscriber` (its worker process), asked for
partials every 1.6 s as ``cspan serve`` does. ``<ret>`` is forced at the utterance's last voiced frame (the user
still speaking: the ``wait`` plan, which cuts the utterance after 0.4 s of silence and asks with its final
transcript; after ``ret_wait_s`` = 1 s without one it transcribes the last 12 s instead). The retriever answers at
once, transcribing the audio it is given with the same transcriber, as the real one does.

Printed per ``L``: the partials shown, their latency (request to transcript) median and max, the final
transcript's latency, the decoding process's CPU seconds over the run, the plan that gave the question, what came of
the ``<ret>`` (``span``, or ``late`` past the 2.5 s span deadline of ``cspan serve``) and when, and the **question
latency**: wall seconds from ``<ret>`` to the question.

``--agreement`` instead compares the two on every utterance of the fixtures' speech (the synthesised questions
whole; the human recordings and Full-Duplex-Bench's example turns cut where the runtime's voice activity ends
utterances, each with its 0.32 s tail), each way in one pass over all of them from a fresh decoding process: the
whole-clip decode, and the final transcript of a stream fed 80 ms frames with a partial every 1.6 s. Printed: the
words the two share (matching blocks of the two word sequences) over the words of each; the same for a third pass,
whole clips in the reverse order (pocketsphinx carries its noise estimate from one utterance to the next, so the
whole-clip transcript itself depends on what was decoded before: the floor); and, where the text is known, the
words of the reference each gets.

``--mode batch`` hides the transcriber's streaming capability (``open_stream``): every partial and the final
re-decode the utterance from its start (what the runtime did before streaming). ``--mode stream`` (default) lets
the runtime decode incrementally. ``--burn N`` keeps N other processes spinning (the duplex engine's core on a
served 2-core machine).

Usage::

    python scripts/sphinx_partials_bench.py --mode batch --lengths 4 8 12 16 --json before.json
    python scripts/sphinx_partials_bench.py --mode stream --lengths 4 8 12 16 --json after.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT.parent / "shared" / "fixtures" / "audio"
SPEECH = ("assistant_dialogue_24k.wav", "service_call_24k.wav")


def _speech() -> np.ndarray:
    """The human recordings joined, from the first word (3.2 s into the first)."""
    import soundfile as sf

    parts = []
    for name in SPEECH:
        path = FIXTURES / name
        if not path.exists():
            path = Path("/work/shared/fixtures/audio") / name
        pcm, sr = sf.read(path, dtype="float32")
        assert sr == 24_000, (path, sr)
        parts.append(pcm)
    return np.concatenate(parts)[int(3.2 * 24_000) :]


class _Engine:
    def inject_span(self, session: int, text: str) -> Any:
        return SimpleNamespace(n=1, truncated=False, prefill_ms=0.0, deferred=False, prefix_in_window=True)


class _NoVAD:
    def is_voiced(self, frame: np.ndarray) -> bool:  # never called: voice activity is given
        return False

    def reset(self) -> None:
        pass


class _TimedStream:
    def __init__(self, inner: Any, owner: _Timed) -> None:
        self.inner, self.owner = inner, owner

    def feed(self, pcm: np.ndarray) -> None:
        self.inner.feed(pcm)

    def cancel(self) -> None:
        self.inner.cancel()

    async def partial(self) -> Any:
        t0 = time.monotonic()
        try:
            return await self.inner.partial()
        finally:
            self.owner.partials.append(time.monotonic() - t0)

    async def finish(self) -> Any:
        t0 = time.monotonic()
        try:
            return await self.inner.finish()
        finally:
            self.owner.finals.append(time.monotonic() - t0)


class _Timed:
    """The transcriber, each ``transcribe`` and each stream's ``partial`` and ``finish`` timed; ``open_stream``
    offered unless ``batch``."""

    def __init__(self, inner: Any, *, batch: bool) -> None:
        self.inner = inner
        self.calls: list[tuple[float, float, float]] = []  # (asked, answered, audio seconds)
        self.partials: list[float] = []
        self.finals: list[float] = []
        if not batch and hasattr(inner, "open_stream"):
            self.open_stream = lambda sample_rate: _TimedStream(inner.open_stream(sample_rate), self)

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> Any:
        t0 = time.monotonic()
        try:
            return await self.inner.transcribe(pcm, sample_rate)
        finally:
            self.calls.append((t0, time.monotonic(), len(pcm) / sample_rate))


class _Retriever:
    def __init__(self, transcriber: Any) -> None:
        self.transcriber = transcriber
        self.heard = False  # whether it was given audio to transcribe (the window plan)

    async def retrieve(self, *, audio=None, sample_rate=None, question=None, **_: Any) -> Any:
        if question is None and audio is not None:
            self.heard = True
            question = (await self.transcriber.transcribe(audio, sample_rate)).text
        return SimpleNamespace(
            question=question, reference="ok", tool=None, arguments=None, source="stub", error=None, late=False
        )


REFERENCES = {
    "question_weather_24k.wav": "what is the weather like in london today",
    "question_exchange_24k.wav": "how much is one hundred dollars in euros",
    "greeting_24k.wav": "hello my name is priya and i live in sydney",
    "question_library_24k.wav": "when does the library open on sunday",
}


def _utterances() -> list[tuple[str, np.ndarray, str | None]]:
    """(name, float32 24 kHz clip, reference text or None) for every utterance of the fixtures' speech."""
    import soundfile as sf

    from cspan.core.runtime import TRAILING_FRAMES
    from cspan.core.vad import SileroVAD, UtteranceTracker

    clips = []
    for name, text in REFERENCES.items():
        path = FIXTURES / name if (FIXTURES / name).exists() else ROOT / "assets" / name
        clips.append((name, sf.read(path, dtype="float32")[0], text))
    recordings = [FIXTURES / name for name in SPEECH]
    recordings += sorted((FIXTURES.parent / "fdb-v1").glob("*/*/*.wav"))  # users' and agents' turns
    for path in recordings:
        pcm, sr = sf.read(path, dtype="float32")
        if pcm.ndim > 1:
            pcm = pcm.mean(axis=1)
        if sr != 24_000:
            import soxr

            pcm = soxr.resample(pcm, sr, 24_000).astype(np.float32)
        vad, tracker = SileroVAD(), UtteranceTracker()
        for i in range(len(pcm) // 1920):
            for ev in tracker.update(i, vad.is_voiced(pcm[i * 1920 : (i + 1) * 1920])):
                if ev.kind == "ended":
                    u = ev.utterance
                    clip = pcm[u.start * 1920 : (u.end + TRAILING_FRAMES) * 1920]
                    clips.append((f"{path.parent.parent.name}/{path.name}@{u.start * 0.08:.1f}s", clip, None))
    speech = _speech()
    for seconds in (6, 8, 12, 16):  # long utterances: windows of the joined human speech
        for offset in range(0, 31, 10):
            if (offset + seconds) * 24_000 <= len(speech):
                clip = speech[offset * 24_000 : (offset + seconds) * 24_000]
                clips.append((f"speech[{offset}:{offset + seconds}]", clip, None))
    return clips


def _shared(a: list[str], b: list[str]) -> int:
    import difflib

    return sum(block.size for block in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_matching_blocks())


async def _agreement() -> dict[str, Any]:
    from cspan.backends.asr import sphinx_process
    from cspan.backends.asr.sphinx import PocketSphinxTranscriber

    clips = _utterances()

    async def one_pass(kind: str, order: list[int]) -> dict[int, list[str]]:
        sphinx_process._stop_workers()  # a fresh decoding process: each pass starts from the same state
        transcriber = PocketSphinxTranscriber()
        await asyncio.to_thread(transcriber.warm)
        out = {}
        try:
            for k in order:
                clip = clips[k][1]
                if kind == "batch":
                    out[k] = (await transcriber.transcribe(clip, 24_000)).text.split()
                    continue
                stream = transcriber.open_stream(24_000)
                for i in range(0, len(clip), 1920):
                    stream.feed(clip[i : i + 1920])
                    if i and i % (20 * 1920) == 0:
                        await stream.partial()
                out[k] = (await stream.finish()).text.split()
        finally:
            await transcriber.aclose()
        return out

    order = list(range(len(clips)))
    batch = await one_pass("batch", order)
    stream = await one_pass("stream", order)
    again = await one_pass("batch", order[::-1])
    from cspan.backends.asr.sphinx import WHOLE_S

    rows = []
    groups: dict[str, dict[str, int]] = {}
    ref = {"words": 0, "batch": 0, "stream": 0}
    for k, (name, clip, text) in enumerate(clips):
        seconds = len(clip) / 24_000
        shared = _shared(batch[k], stream[k])
        group = groups.setdefault(
            f"up to {WHOLE_S:g} s" if seconds <= WHOLE_S else f"over {WHOLE_S:g} s",
            {"utterances": 0, "words_batch": 0, "words_stream": 0, "shared": 0, "reversed_shared": 0},
        )
        group["utterances"] += 1
        group["words_batch"] += len(batch[k])
        group["words_stream"] += len(stream[k])
        group["shared"] += shared
        group["reversed_shared"] += _shared(batch[k], again[k])
        row = {"clip": name, "seconds": round(seconds, 2), "batch": " ".join(batch[k]),
               "stream": " ".join(stream[k]), "shared": shared}  # fmt: skip
        if text:
            words = text.split()
            ref["words"] += len(words)
            ref["batch"] += _shared(words, batch[k])
            ref["stream"] += _shared(words, stream[k])
        rows.append(row)
        print(json.dumps(row), flush=True)
    for group in groups.values():
        group["shared_of_batch"] = round(group["shared"] / max(1, group["words_batch"]), 3)
        group["shared_of_stream"] = round(group["shared"] / max(1, group["words_stream"]), 3)
        group["batch_reversed_shared_of_batch"] = round(group.pop("reversed_shared") / max(1, group["words_batch"]), 3)
    summary = {"groups": groups, "reference_words": ref["words"], "reference_words_batch": ref["batch"],
               "reference_words_stream": ref["stream"]}  # fmt: skip
    print(json.dumps(summary), flush=True)
    return {"summary": summary, "rows": rows}


def _worker_cpu() -> float:
    """CPU seconds (user + system) of this process's pocketsphinx decoding processes."""
    try:
        from cspan.backends.asr import sphinx_process as where
    except ImportError:  # before the decoding processes had a module of their own
        from cspan.backends.asr import sphinx as where

    total = 0.0
    for worker in list(where._ALL_WORKERS):
        process = getattr(worker, "process", None)
        if process is None:
            continue
        try:
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def _one(transcriber: Any, speech: np.ndarray, seconds: float, *, mode: str) -> dict[str, Any]:
    from cspan.core.constants import FRAME_S, FRAME_SIZE
    from cspan.core.events import LateEvent, QuestionEvent, RetEvent, SpanEvent, UserTextEvent
    from cspan.core.runtime import Conversation, ConversationConfig

    timed = _Timed(transcriber, batch=mode == "batch")
    voiced_frames = round(seconds / FRAME_S)
    total = voiced_frames + 40  # 3.2 s of silence after
    audio = np.zeros(total * FRAME_SIZE, dtype=np.float32)
    n = min(len(speech), voiced_frames * FRAME_SIZE)
    audio[:n] = speech[:n]
    seen: list[tuple[float, Any]] = []
    retriever = _Retriever(timed)
    conversation = Conversation(
        _Engine(),
        transcriber=timed,
        retriever=retriever,
        config=ConversationConfig(span_deadline_s=2.5),
        vad=_NoVAD(),
        on_event=lambda ev: seen.append((time.monotonic(), ev)),
    )
    ret_frame = voiced_frames - 1
    cpu0 = _worker_cpu()
    t0 = time.monotonic()
    for k in range(total):
        await conversation.before_step(audio[k * FRAME_SIZE : (k + 1) * FRAME_SIZE], voiced=k < voiced_frames)
        await conversation.after_step(None, is_ret=k == ret_frame)
        delay = t0 + (k + 1) * FRAME_S - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
    await conversation.finish()
    cpu = _worker_cpu() - cpu0
    ret_at = next(t for t, ev in seen if isinstance(ev, RetEvent))
    plan = next(ev.plan for _, ev in seen if isinstance(ev, RetEvent))
    asked = [(t, ev) for t, ev in seen if isinstance(ev, QuestionEvent)]
    outcome = [(t, ev) for t, ev in seen if isinstance(ev, (SpanEvent, LateEvent))]
    shown = [ev for _, ev in seen if isinstance(ev, UserTextEvent) and not ev.final]
    final_text = [ev.text for _, ev in seen if isinstance(ev, UserTextEvent) and ev.final]
    # whole clips: the partials are the calls before the final's (the last call of the utterance, unless the
    # retriever transcribed a window after it); streams: timed per call
    clips = [(b - a, seconds_) for a, b, seconds_ in timed.calls]
    if mode == "batch":
        utterance_calls = [c for c in clips[: len(clips) - int(retriever.heard)]]
        partials = [c[0] for c in utterance_calls[:-1]]
        finals = [c[0] for c in utterance_calls[-1:]]
    else:
        partials, finals = timed.partials, timed.finals
    return {
        "seconds": seconds,
        "mode": mode,
        "partials_shown": len(shown),
        "partial_latency_median_s": round(statistics.median(partials), 3) if partials else None,
        "partial_latency_max_s": round(max(partials), 3) if partials else None,
        "final_latency_s": round(finals[0], 3) if finals else None,
        "worker_cpu_s": round(cpu, 2),
        "plan": "window" if retriever.heard else plan,
        "outcome": outcome[0][1].type if outcome else None,
        "ret_to_outcome_s": round(outcome[0][0] - ret_at, 3) if outcome else None,
        "question_latency_s": round(asked[0][0] - ret_at, 3) if asked else None,
        "question": asked[0][1].text if asked else None,
        "final": final_text[0] if final_text else None,
    }


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    from cspan.backends.asr.sphinx import PocketSphinxTranscriber

    transcriber = PocketSphinxTranscriber()
    await asyncio.to_thread(transcriber.warm)
    speech = _speech()
    rows = []
    try:
        for seconds in args.lengths:
            row = await _one(transcriber, speech, seconds, mode=args.mode)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        await transcriber.aclose()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("batch", "stream"), default="stream")
    parser.add_argument("--lengths", type=float, nargs="+", default=[4.0, 8.0, 12.0, 16.0])
    parser.add_argument("--burn", type=int, default=0, help="other processes kept spinning meanwhile")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--agreement", action="store_true", help="compare stream and whole-clip transcripts")
    args = parser.parse_args()
    if args.agreement:
        result = asyncio.run(_agreement())
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(0, args.burn))]
    try:
        rows = asyncio.run(_main(args))
    finally:
        for p in burners:
            p.kill()
    if args.json:
        args.json.write_text(json.dumps({"machine": f"{os.cpu_count()} CPU cores", "burn": args.burn, "rows": rows},
                                        indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
