"""Voice activity: the batched Silero detector against the silero-vad package's own streaming wrapper, and the
runtime's use of it (one pass for many conversations; no detector where nothing reads it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import soxr
import torch

from cspan.core.audio import read_audio
from cspan.core.constants import FRAME_SIZE
from cspan.core.runtime import Conversation, voice_activity
from cspan.core.vad import VAD_RATE, VAD_WINDOW, SileroVAD, voice_probabilities

RECORDING = Path(__file__).resolve().parents[2] / "assets" / "question_library_24k.wav"


@pytest.fixture(scope="module")
def sessions() -> np.ndarray:
    """[3, frames, 1920]: the repository's recording (speech, then silence) at three offsets."""
    pcm = read_audio(RECORDING)
    pcm = np.concatenate([pcm, np.zeros(FRAME_SIZE * 12, dtype=np.float32)])
    frames = len(pcm) // FRAME_SIZE - 3
    return np.stack([pcm[k * 1000 : k * 1000 + frames * FRAME_SIZE].reshape(frames, FRAME_SIZE) for k in range(3)])


def _package_probabilities(frames: np.ndarray) -> list[float]:
    """One session through the package's own wrapper, one 512-sample window per call (what SileroVAD did before
    it batched): per frame, the max over the windows completed in it."""
    from silero_vad import load_silero_vad

    threads = torch.get_num_threads()
    model = load_silero_vad(onnx=False)
    torch.set_num_threads(threads)
    resampler = soxr.ResampleStream(24_000, VAD_RATE, 1, dtype="float32")
    buffer = np.zeros(0, dtype=np.float32)
    out = []
    with torch.inference_mode():
        for frame in frames:
            buffer = np.concatenate([buffer, resampler.resample_chunk(frame)])
            prob = 0.0
            while len(buffer) >= VAD_WINDOW:
                prob = max(prob, float(model(torch.from_numpy(buffer[:VAD_WINDOW].copy()), VAD_RATE)))
                buffer = buffer[VAD_WINDOW:]
            out.append(prob)
    return out


def test_batched_sessions_equal_the_package_wrapper(sessions: np.ndarray) -> None:
    detectors = [SileroVAD() for _ in sessions]
    got = np.array([voice_probabilities(detectors, list(sessions[:, t])) for t in range(sessions.shape[1])]).T
    for k, frames in enumerate(sessions):
        expected = np.array(_package_probabilities(frames))
        assert np.abs(got[k] - expected).max() < 1e-5
        assert ((got[k] >= 0.5) == (expected >= 0.5)).all()
        assert (expected >= 0.5).sum() >= 10 and (expected < 0.5).sum() >= 10  # both kinds of frame are covered
    assert [d.last_probability for d in detectors] == got[:, -1].tolist()


def test_one_detector_alone_equals_its_batched_run(sessions: np.ndarray) -> None:
    alone, batched = SileroVAD(), [SileroVAD() for _ in sessions]
    for t in range(12):
        a = alone(sessions[1, t])
        b = voice_probabilities(batched, list(sessions[:, t]))[1]
        assert abs(a - b) < 1e-6
    alone.reset()
    fresh = SileroVAD()
    assert [alone(f) for f in sessions[0, :6]] == [fresh(f) for f in sessions[0, :6]]


def test_voice_probabilities_rejects_mismatched_input(sessions: np.ndarray) -> None:
    vad = SileroVAD()
    with pytest.raises(ValueError, match="2 detectors for 1 frames"):
        voice_probabilities([vad, SileroVAD()], [sessions[0, 0]])
    with pytest.raises(ValueError, match="appears twice"):
        voice_probabilities([vad, vad], [sessions[0, 0], sessions[0, 1]])
    assert voice_probabilities([], []) == []


class _Engine:
    def inject_span(self, session: int, text: str) -> None:  # pragma: no cover - no spans in these tests
        raise AssertionError("no span expected")


class _CountingVAD:
    def __init__(self) -> None:
        self.calls = 0

    def is_voiced(self, frame: np.ndarray) -> bool:
        self.calls += 1
        return False

    def reset(self) -> None:
        self.calls = 0


class _Transcriber:
    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> object:  # pragma: no cover
        raise AssertionError("no utterance expected")


def test_runtime_runs_the_detector_only_where_something_listens(sessions: np.ndarray) -> None:
    deaf, listening = _CountingVAD(), _CountingVAD()
    quiet = Conversation(_Engine(), 0, vad=deaf)
    heard = Conversation(_Engine(), 1, vad=listening, transcriber=_Transcriber())
    assert not quiet.listens and heard.listens

    async def go() -> None:
        for conv in (quiet, heard):
            for _ in range(3):
                await conv.before_step(np.zeros(FRAME_SIZE, dtype=np.float32))
                await conv.after_step(None)

    asyncio.run(go())
    assert deaf.calls == 0 and listening.calls == 3


def test_voice_activity_runs_the_silero_detectors_in_one_pass(sessions: np.ndarray) -> None:
    silero = [Conversation(_Engine(), k, transcriber=_Transcriber()) for k in range(2)]
    other = Conversation(_Engine(), 2, vad=_CountingVAD(), transcriber=_Transcriber())
    deaf = Conversation(_Engine(), 3)
    reference = [SileroVAD(), SileroVAD()]
    for t in range(sessions.shape[1]):
        frames = [sessions[0, t], sessions[1, t], sessions[2, t], sessions[2, t]]
        voiced = voice_activity([*silero, other, deaf], frames)
        assert voiced[2:] == [None, None]
        assert voiced[:2] == [reference[k].is_voiced(frames[k]) for k in range(2)]


def test_the_tracker_reports_an_utterance_too_short_to_keep_as_dropped() -> None:
    """Two voiced frames then silence: no ``ended`` (under ``min_frames``) but a ``dropped`` event at the frame the
    silence ends it, so whatever the runtime opened for it (a transcript stream) is released."""
    from cspan.core.vad import UtteranceTracker

    tracker = UtteranceTracker()
    kinds = [(i, ev.kind) for i in range(12) for ev in tracker.update(i, i < 2)]
    assert kinds == [(0, "started"), (10, "dropped")]
    assert tracker.current is None and not tracker.finished
