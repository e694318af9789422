"""Silero VAD wrapper: real model on the fixture's speech, 16 kHz resampling, torch thread count untouched."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
import torch

from cspan.bench import vad


@pytest.fixture(scope="module")
def speech(fixtures_dir: Path) -> tuple[np.ndarray, int]:
    path = fixtures_dir / "fdb-v1" / "smooth_turn_taking_example" / "1" / "output.wav"
    if not path.is_file():
        pytest.skip(f"fixture not found: {path}")
    pcm, sr = sf.read(str(path), dtype="float32")
    return pcm, sr


def test_segments_follow_the_speech(speech) -> None:
    pcm, sr = speech
    threads = torch.get_num_threads()
    segments = vad.speech_segments(pcm, sr)
    assert torch.get_num_threads() == threads
    assert segments, "no speech found in a clip with 7 s of speech"
    # Rounded to 0.1 s by silero's return_seconds; ordered; within the clip; silence before 3.4 s.
    for start, end in segments:
        assert round(start, 1) == start and round(end, 1) == end
        assert 0 <= start < end <= len(pcm) / sr + 1e-9
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(segments))
    assert 3.2 <= segments[0][0] <= 3.6
    # The 0.5 s pause around 4.0-4.4 s of the response separates "Yes," from the next phrase.
    assert segments[0][1] <= 4.5


def test_other_rates_are_resampled_to_16k(speech) -> None:
    pcm, sr = speech
    at_16k = vad.speech_segments(pcm, sr)
    at_24k = vad.speech_segments(soxr.resample(pcm, sr, 24000).astype(np.float32), 24000)
    assert len(at_24k) == len(at_16k)
    for (a0, a1), (b0, b1) in zip(at_16k, at_24k, strict=True):
        assert abs(a0 - b0) <= 0.1 + 1e-9 and abs(a1 - b1) <= 0.1 + 1e-9


def test_silence_has_no_segments() -> None:
    assert vad.speech_segments(np.zeros(16000, dtype=np.float32), 16000) == []
    assert vad.speech_segments(np.zeros(0, dtype=np.float32), 16000) == []


def test_rejects_multichannel() -> None:
    with pytest.raises(ValueError, match="mono"):
        vad.to_vad_rate(np.zeros((2, 100), dtype=np.float32), 16000)
