"""Audio input validation, streaming resampling and atomic writing."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from cspan.core.audio import AtomicWavWriter, inspect_audio, iter_frames, read_audio
from cspan.core.errors import AudioInputError


def _tone(sr: int, seconds: float, channels: int = 1) -> np.ndarray:
    t = np.arange(int(sr * seconds)) / sr
    x = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    return np.stack([x, 0.5 * x], axis=1) if channels == 2 else x


def test_streaming_frames_equal_whole_file_resampling(tmp_path, fixture_file):
    src = fixture_file("audio", "question_weather_24k.wav")
    frames = list(iter_frames(src))
    whole = read_audio(src)
    assert all(f.shape == (1920,) and f.dtype == np.float32 for f in frames)
    assert len(frames) == -(-len(whole) // 1920)
    joined = np.concatenate(frames)[: len(whole)]
    np.testing.assert_array_equal(joined, whole)


def test_48k_stereo_flac_resampled_and_channel_selected(tmp_path):
    path = tmp_path / "in.flac"
    sf.write(path, _tone(48_000, 2.0, channels=2), 48_000, format="FLAC")
    info = inspect_audio(path, channel=1)
    assert (info.sample_rate, info.channels) == (48_000, 2)
    assert info.duration_s == pytest.approx(2.0)
    frames = list(iter_frames(path, channel=1))
    assert len(frames) == 25  # 2 s at 12.5 frames/s
    left = np.concatenate(list(iter_frames(path, channel=0)))
    right = np.concatenate(frames)
    np.testing.assert_allclose(right, 0.5 * left, atol=2e-4)


@pytest.mark.parametrize("case", ["missing", "empty", "garbage", "silent", "too_long", "bad_channel", "directory"])
def test_bad_inputs_raise_audio_input_error(tmp_path, case):
    path = tmp_path / "x.wav"
    kwargs = {}
    if case == "empty":
        path.write_bytes(b"")
    elif case == "garbage":
        path.write_bytes(b"RIFF\x00\x00garbage" * 10)
    elif case == "silent":
        sf.write(path, np.zeros(24_000, dtype=np.float32), 24_000)
    elif case == "too_long":
        sf.write(path, _tone(8_000, 3.0), 8_000)
        kwargs["max_seconds"] = 2.0
    elif case == "bad_channel":
        sf.write(path, _tone(24_000, 0.5), 24_000)
        kwargs["channel"] = 1
    elif case == "directory":
        path = tmp_path
    with pytest.raises(AudioInputError) as err:
        inspect_audio(path, **kwargs)
    assert str(path) in str(err.value)


def test_atomic_writer_publishes_only_complete_files(tmp_path):
    dest = tmp_path / "out.wav"
    with AtomicWavWriter(dest, channels=2) as w:
        w.write(np.zeros((1920, 2), dtype=np.float32))
        assert not dest.exists()
    data, sr = sf.read(dest)
    assert sr == 24_000 and data.shape == (1920, 2)

    dest2 = tmp_path / "failed.wav"
    with pytest.raises(RuntimeError), AtomicWavWriter(dest2, channels=2) as w:
        w.write(np.zeros((1920, 2), dtype=np.float32))
        raise RuntimeError("boom")
    assert not dest2.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []
