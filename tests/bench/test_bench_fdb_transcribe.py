"""Word-timed output.json writing: the reference format and the user-interruption crop-and-offset rule."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cspan.backends.asr import PocketSphinxTranscriber, Transcript, Word
from cspan.bench import transcribe
from cspan.bench.errors import BenchError
from cspan.bench.fdb_v1 import OutputTranscript, TaskKind, read_output_json


class RecordingTranscriber:
    """A transcriber that reports two words at fixed clip times and remembers the clips it was given."""

    def __init__(self, words: list[Word] | None) -> None:
        self.words = words
        self.calls: list[tuple[int, int]] = []

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> Transcript:
        self.calls.append((int(pcm.shape[0]), sample_rate))
        text = " ".join(w.text for w in self.words or [])
        return Transcript(text=text or "something", words=self.words)


def _sample(tmp_path: Path, *, seconds: float, sr: int, interrupt_end: float | None = None, channels: int = 1) -> Path:
    sample = tmp_path / "task" / "1"
    sample.mkdir(parents=True)
    rng = np.random.default_rng(0)
    data = (0.01 * rng.standard_normal((int(seconds * sr), channels))).astype(np.float32)
    sf.write(str(sample / "output.wav"), data, sr, subtype="PCM_16")
    if interrupt_end is not None:
        payload = [{"context": "c", "interrupt": "i", "timestamp": [1.0, interrupt_end]}]
        (sample / "interrupt.json").write_text(json.dumps(payload))
    return sample


async def test_interruption_crop_and_offset(tmp_path: Path) -> None:
    sr = 24000
    sample = _sample(tmp_path, seconds=3.0, sr=sr, interrupt_end=1.2345)
    asr = RecordingTranscriber(
        [Word(text="hello", start_s=0.25, end_s=0.5), Word(text="there", start_s=0.5, end_s=0.9)]
    )
    written = await transcribe.ensure_output_jsons([sample], asr, TaskKind.USER_INTERRUPTION)
    assert written == [sample / "output.json"]
    # Cropped from sample int(1.2345 * 24000) = 29628 on, at the file's own rate.
    assert asr.calls == [(3 * sr - int(1.2345 * sr), sr)]
    out = read_output_json(sample / "output.json")
    assert out.text == "hello there"
    assert [c.timestamp for c in out.chunks] == [(0.25 + 1.2345, 0.5 + 1.2345), (0.5 + 1.2345, 0.9 + 1.2345)]
    # 4-space indented, exactly the two keys of the reference format.
    raw = (sample / "output.json").read_text()
    assert raw.startswith('{\n    "text": "hello there",\n    "chunks": [')
    assert set(json.loads(raw)) == {"text", "chunks"}


async def test_default_task_is_whole_file_and_stereo_is_averaged(tmp_path: Path) -> None:
    sample = _sample(tmp_path, seconds=2.0, sr=16000, channels=2)
    asr = RecordingTranscriber([Word(text="yes", start_s=1.0, end_s=1.25)])
    await transcribe.ensure_output_jsons([sample], asr, TaskKind.TURN_TAKING)
    assert asr.calls == [(32000, 16000)]
    assert read_output_json(sample / "output.json").chunks[0].timestamp == (1.0, 1.25)
    # An existing output.json is kept unless overwrite is asked for.
    assert await transcribe.ensure_output_jsons([sample], asr, TaskKind.TURN_TAKING) == []
    assert len(asr.calls) == 1


async def test_transcriber_without_word_times_is_refused(tmp_path: Path) -> None:
    sample = _sample(tmp_path, seconds=1.0, sr=16000)
    with pytest.raises(BenchError, match="without word timestamps"):
        await transcribe.ensure_output_jsons([sample], RecordingTranscriber(None), TaskKind.PAUSE_HANDLING)


async def test_interruption_past_the_end_gives_no_words(tmp_path: Path) -> None:
    sample = _sample(tmp_path, seconds=1.0, sr=16000, interrupt_end=5.0)
    asr = RecordingTranscriber([Word(text="x", start_s=0.0, end_s=0.1)])
    out = await transcribe.transcribe_sample(asr, sample, TaskKind.USER_INTERRUPTION)
    assert out == OutputTranscript(text="", chunks=[])
    assert asr.calls == []


async def test_pocketsphinx_interruption_words_are_absolute(tmp_path: Path, fixtures_dir: Path) -> None:
    src = fixtures_dir / "fdb-v1" / "smooth_turn_taking_example" / "1" / "output.wav"
    if not src.is_file():
        pytest.skip(f"fixture not found: {src}")
    pcm, sr = sf.read(str(src), dtype="float32")
    sample = tmp_path / "synthetic_user_interruption" / "1"
    sample.mkdir(parents=True)
    # 3 s cut: speech from about 3.4 s of the original, i.e. 0.9 s into the cut; the "interruption" ends at 0.6 s.
    sf.write(str(sample / "output.wav"), pcm[int(2.5 * sr) : int(5.5 * sr)], sr, subtype="PCM_16")
    shutil.copy(
        fixtures_dir / "fdb-v1" / "user_interruption_example" / "1" / "interrupt.json", sample / "interrupt.json"
    )
    payload = json.loads((sample / "interrupt.json").read_text())
    payload[0]["timestamp"] = [0.1, 0.6]
    (sample / "interrupt.json").write_text(json.dumps(payload))
    out = await transcribe.transcribe_sample(PocketSphinxTranscriber(), sample, TaskKind.USER_INTERRUPTION)
    assert out.chunks, "pocketsphinx recognised nothing"
    assert all(c.start >= 0.6 and c.end <= 3.0 + 1e-6 for c in out.chunks)
    # Speech starts near 0.9 s on the absolute timeline, not near 0.3 s (the time within the crop).
    assert out.chunks[0].start >= 0.8


def test_make_transcriber_choices() -> None:
    from cspan.backends.asr import HTTPTranscriber, OpenAITranscriber

    assert isinstance(transcribe.make_transcriber("sphinx"), PocketSphinxTranscriber)
    openai = transcribe.make_transcriber("http://127.0.0.1:9/v1", model="whisper-1")
    assert isinstance(openai, OpenAITranscriber) and openai.word_timestamps and openai.model == "whisper-1"
    assert isinstance(transcribe.make_transcriber("http://127.0.0.1:9"), HTTPTranscriber)
    with pytest.raises(BenchError, match="--asr"):
        transcribe.make_transcriber("nonsense")
