"""pocketsphinx's utterance streams (``PocketSphinxTranscriber.open_stream``): decoded as heard in the worker
process, the final transcript of a short utterance identical to the whole-clip decode, a long one's final costing
a fraction of the whole clip's; cancellation, a full process and a crashed process."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

pytest.importorskip("pocketsphinx")

SAMPLE_RATE = 24_000  # the fixtures' rate, the runtime's
FRAME_SIZE = 1920  # the runtime's 80 ms frame


def _read(fixture_file, name: str) -> np.ndarray:
    import soundfile as sf

    pcm, sr = sf.read(fixture_file("audio", name), dtype="float32")
    assert sr == SAMPLE_RATE
    return pcm


async def _stream(transcriber, pcm: np.ndarray, *, realtime: bool = False) -> tuple[object, list[str], float]:
    """Feed ``pcm`` in 80 ms frames with a partial every 1.6 s (as the runtime does); returns the final transcript,
    the partials' texts and the seconds ``finish`` took."""
    stream = transcriber.open_stream(SAMPLE_RATE)
    partials = []
    t0 = time.perf_counter()
    for k, i in enumerate(range(0, len(pcm), FRAME_SIZE)):
        stream.feed(pcm[i : i + FRAME_SIZE])
        if k and k % 20 == 0:
            partials.append((await stream.partial()).text)
        if realtime:
            await asyncio.sleep(max(0.0, t0 + (k + 1) * 0.08 - time.perf_counter()))
    t0 = time.perf_counter()
    final = await stream.finish()
    return final, partials, time.perf_counter() - t0


async def test_a_short_utterance_streams_to_the_whole_clip_transcript(fixture_file) -> None:
    """A question (2.9 s, under WHOLE_S) fed as 80 ms frames: its partial is the live pass's best path so far; its
    final transcript is the whole-clip decode's, word timings included."""
    from cspan.backends.asr.sphinx import WHOLE_S, PocketSphinxTranscriber

    pcm = _read(fixture_file, "question_weather_24k.wav")
    assert len(pcm) / SAMPLE_RATE < WHOLE_S
    transcriber = PocketSphinxTranscriber()
    try:
        whole = await transcriber.transcribe(pcm, SAMPLE_RATE)
        final, partials, _ = await _stream(transcriber, pcm)
        assert final == whole
        assert "weather" in final.text and "london" in final.text, final.text
        assert len(partials) == 1 and partials[0].startswith("what is the"), partials
    finally:
        await transcriber.aclose()


async def test_a_long_utterance_costs_its_tail_not_its_length(fixture_file) -> None:
    """12 s of human speech fed at real-time pace: the process decodes it as it comes, so the final transcript
    (the tail and the decoder's closing passes) takes a fraction of the whole clip's decode (a fifth here, 0.3 s
    against 1.6 s on an idle core of the 2-core development machine), and gets the words the whole clip gets."""
    from cspan.backends.asr.sphinx import PocketSphinxTranscriber

    pcm = _read(fixture_file, "assistant_dialogue_24k.wav")[int(3.2 * SAMPLE_RATE) : int(15.2 * SAMPLE_RATE)]
    transcriber = PocketSphinxTranscriber()
    try:
        await asyncio.to_thread(transcriber.warm)
        final, partials, finish_s = await _stream(transcriber, pcm, realtime=True)
        t0 = time.perf_counter()
        whole = await transcriber.transcribe(pcm, SAMPLE_RATE)
        whole_s = time.perf_counter() - t0
        assert finish_s < 0.6 * whole_s, (finish_s, whole_s)
        assert {"sticky", "cooking", "stove"} <= set(final.text.split()) & set(whole.text.split()), (final, whole)
        assert len(partials) == 7 and "sticky" in partials[-1], partials
        times = [(w.start_s, w.end_s) for w in final.words]
        assert times == sorted(times) and times[0][0] >= 0 and times[-1][1] <= 12.0, times
    finally:
        await transcriber.aclose()


async def test_streams_cancelled_or_pushed_out_free_their_decoders(fixture_file) -> None:
    """A process keeps ``max_streams`` streams open: one more closes the least recently used, whose partial then
    fails with a clear error (the runtime falls back to whole clips); a cancelled stream is dropped; digital
    silence gives no words; and the process serves on."""
    from cspan.backends.asr.sphinx import PocketSphinxTranscriber
    from cspan.backends.errors import TranscriberError

    pcm = _read(fixture_file, "question_weather_24k.wav")
    transcriber = PocketSphinxTranscriber(max_streams=1, options={"beam": 1e-48})  # a process of its own
    try:
        first = transcriber.open_stream(SAMPLE_RATE)
        first.feed(pcm[:SAMPLE_RATE])
        assert (await first.partial()).text
        second = transcriber.open_stream(SAMPLE_RATE)
        second.feed(pcm)
        assert "weather" in (await second.finish()).text
        with pytest.raises(TranscriberError, match="not open"):
            await first.partial()
        first.cancel()
        dropped = transcriber.open_stream(SAMPLE_RATE)
        dropped.feed(pcm)
        dropped.cancel()
        with pytest.raises(RuntimeError):
            dropped.feed(pcm)
        silent = transcriber.open_stream(SAMPLE_RATE)
        silent.feed(np.zeros(2 * SAMPLE_RATE, dtype=np.float32))
        assert (await silent.finish()).text == ""
        assert "weather" in (await transcriber.transcribe(pcm, SAMPLE_RATE)).text
    finally:
        await transcriber.aclose()


async def test_a_crashed_process_fails_its_streams_and_the_next_ones_start_a_new_one(fixture_file) -> None:
    """The decoding process dies mid-utterance: that stream's partial and finish raise TranscriberError naming the
    process; the next clip and the next stream start a new process and are transcribed."""
    from cspan.backends.asr.sphinx import PocketSphinxTranscriber
    from cspan.backends.errors import TranscriberError

    pcm = _read(fixture_file, "question_weather_24k.wav")
    transcriber = PocketSphinxTranscriber(options={"beam": 1e-47})  # a process of its own
    try:
        stream = transcriber.open_stream(SAMPLE_RATE)
        stream.feed(pcm[:SAMPLE_RATE])
        await stream.partial()
        stream._worker.process.kill()
        stream._worker.process.wait()
        stream.feed(pcm[SAMPLE_RATE:])
        with pytest.raises(TranscriberError, match="decoding process ended"):
            await stream.partial()
        with pytest.raises(TranscriberError, match="decoding process ended"):
            await stream.finish()
        assert "weather" in (await transcriber.transcribe(pcm, SAMPLE_RATE)).text
        final, _, _ = await _stream(transcriber, pcm)
        assert "weather" in final.text
    finally:
        await transcriber.aclose()


async def test_the_runtime_streams_an_utterance_to_the_transcript_of_its_clip(fixture_file) -> None:
    """A conversation with the embedded transcriber: the question is heard as it is spoken (partials from the
    stream, no clip transcribed whole) and its final ``user_text`` is the whole-clip transcript of the utterance's
    frames and their 0.32 s tail."""
    from cspan.backends.asr.sphinx import PocketSphinxTranscriber
    from cspan.core.events import UserTextEvent
    from cspan.core.runtime import TRAILING_FRAMES, Conversation, ConversationConfig

    class _NoVAD:
        def is_voiced(self, frame: np.ndarray) -> bool:
            return False

        def reset(self) -> None:
            pass

    class _Counting(PocketSphinxTranscriber):
        clips = 0

        async def transcribe(self, pcm, sample_rate):
            self.clips += 1
            return await super().transcribe(pcm, sample_rate)

    pcm = _read(fixture_file, "question_weather_24k.wav")
    frames = len(pcm) // FRAME_SIZE
    audio = np.concatenate([pcm[: frames * FRAME_SIZE], np.zeros(20 * FRAME_SIZE, dtype=np.float32)])
    transcriber = _Counting()
    try:
        conv = Conversation(object(), transcriber=transcriber, config=ConversationConfig(), vad=_NoVAD())
        for i in range(frames + 20):
            await conv.before_step(audio[i * FRAME_SIZE : (i + 1) * FRAME_SIZE], voiced=i < frames)
            await conv.after_step(None)
            await asyncio.sleep(0.01)
        await conv.finish()
        texts = [(e.final, e.text) for e in conv.events if isinstance(e, UserTextEvent)]
        clip = audio[: (frames + TRAILING_FRAMES) * FRAME_SIZE]
        assert transcriber.clips == 0
        whole = await transcriber.transcribe(clip, SAMPLE_RATE)
        assert texts[-1] == (True, whole.text) and "weather" in whole.text, texts
        # its partial (at 1.6 s), unless the machine was too busy to decode it before the utterance ended
        assert [final for final, _ in texts] in ([False, True], [True]), texts
        assert all(text.startswith("what is") for final, text in texts if not final), texts
    finally:
        await transcriber.aclose()
