"""The embedded pocketsphinx transcriber decodes in worker processes: the GIL it holds while decoding never stops
the server's other threads."""

from __future__ import annotations

import asyncio

import numpy as np


async def test_a_decode_leaves_the_other_threads_running(fixture_file) -> None:
    """pocketsphinx holds the GIL while it decodes; transcribe() decodes in a worker process, so a thread of this
    process (the duplex engine's frame clock, the event loop) keeps running meanwhile: a 1 ms sleeper ticks through
    the decodes instead of stopping for them."""
    import threading
    import time

    import soundfile as sf

    from cspan.backends.asr.sphinx import PocketSphinxTranscriber

    pcm, sr = sf.read(fixture_file("audio", "question_weather_24k.wav"), dtype="float32")
    clip = np.concatenate([pcm] * 4)
    transcriber = PocketSphinxTranscriber()
    try:
        await asyncio.to_thread(transcriber.warm)
        ticks, stop = [0], threading.Event()

        def sleeper() -> None:
            while not stop.is_set():
                time.sleep(0.001)
                ticks[0] += 1

        thread = threading.Thread(target=sleeper)
        thread.start()
        t0 = time.perf_counter()
        results = [await transcriber.transcribe(clip, sr) for _ in range(3)]
        elapsed = time.perf_counter() - t0
        stop.set()
        thread.join()
        assert all("weather" in r.text for r in results), [r.text for r in results]
        # in-process decoding gave about 11 ticks in 2.7 s; a free thread gets hundreds (1 ms sleeps + scheduling)
        assert ticks[0] > 0.1 * elapsed * 1000, (ticks[0], elapsed)
    finally:
        await transcriber.aclose()


async def test_a_backlog_of_clips_leaves_the_default_executor_free(fixture_file) -> None:
    """Clips waiting for a decoding process wait in the transcriber's own executor: the event loop's default executor
    (which the server uses for every handshake's credential check, the Context DB and large messages) stays free
    however many clips are queued (it has only cpu_count + 4 threads; with each waiting clip on one of them, a
    backlog of transcriptions left the server answering no WebSocket handshake), and a cancelled transcription that
    has not started is dropped."""
    import time

    import soundfile as sf

    from cspan.backends.asr.sphinx import PocketSphinxTranscriber

    pcm, sr = sf.read(fixture_file("audio", "question_weather_24k.wav"), dtype="float32")
    clip = np.concatenate([pcm] * 3)
    transcriber = PocketSphinxTranscriber()
    try:
        await asyncio.to_thread(transcriber.warm)
        backlog = [asyncio.create_task(transcriber.transcribe(clip, sr)) for _ in range(40)]
        await asyncio.sleep(0.2)
        t0 = time.perf_counter()
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 5.0) == "free"
        assert time.perf_counter() - t0 < 1.0
        first = await backlog[0]
        assert "weather" in first.text
        for task in backlog[2:]:
            task.cancel()
        t0 = time.perf_counter()
        await asyncio.gather(*backlog[1:], return_exceptions=True)
        assert time.perf_counter() - t0 < 20.0  # at most the one clip already decoding, not 38 more
        assert all(t.cancelled() for t in backlog[2:])
        assert "weather" in (await transcriber.transcribe(pcm, sr)).text
    finally:
        await transcriber.aclose()


def test_digital_silence_is_no_words_and_speech_still_is() -> None:
    """Two seconds of zeros (or of samples that round to 0 in 16-bit PCM) give no text; the decoder guessed a
    word there before. A quiet tone above the 16-bit floor is still decoded (whatever it hears)."""
    from cspan.backends.asr.sphinx import SphinxDecoderPool

    pool = SphinxDecoderPool(1)
    for pcm in (np.zeros(32_000, dtype=np.float32), np.full(32_000, 1e-6, dtype=np.float32)):
        transcript = pool.decode(pcm, 16_000)
        assert transcript.text == "" and transcript.words == []
    tone = (0.01 * np.sin(np.arange(32_000) * 0.2)).astype(np.float32)
    assert isinstance(pool.decode(tone, 16_000).text, str)
