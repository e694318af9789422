"""Audio input validation, streaming resampling and atomic writing."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from fs_faults import fill, read_only_folder, tmpfs

from cspan.core.audio import AtomicAudioWriter, inspect_audio, iter_frames, read_audio, sanitize_pcm
from cspan.core.errors import AudioInputError, OutputError
from cspan.core.files import check_writable, write_text_atomic


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


@pytest.mark.parametrize(
    ("rate", "n"),
    [
        (48_000, 42_241),
        (48_000, 42_240),
        (96_000, 7_682),
        (32_000, 2_562),
        (44_100, 70_001),
        (8_000, 1),
        (24_000, 1921),
    ],
)
def test_stream_frames_counts_what_iter_frames_yields(tmp_path, rate, n):
    """``AudioInfo.stream_frames`` is the resampler's count (half up at x.5 samples: 42241 at 48 kHz are 21120.5 at
    24 kHz, 21121 samples, 12 frames), not the float duration rounded half to even (11 frames)."""
    path = tmp_path / "in.wav"
    sf.write(path, np.full(n, 0.25, dtype=np.float32), rate, subtype="FLOAT")
    assert inspect_audio(path).stream_frames() == len(list(iter_frames(path)))


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


@pytest.mark.parametrize("case", ["missing", "empty", "garbage", "silent", "too_long", "directory"])
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
    elif case == "directory":
        path = tmp_path
    with pytest.raises(AudioInputError) as err:
        inspect_audio(path, **kwargs)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/null", "socket"])
def test_an_input_that_is_not_a_regular_file_is_called_so(tmp_path, kind):
    """Issue 22 (F18): a pipe or a device is not "empty (0 bytes)", and opening a FIFO must not block."""
    import os
    import socket

    if kind == "fifo":
        path = tmp_path / "q.wav"
        os.mkfifo(path)
    elif kind == "socket":
        path = tmp_path / "q.sock"
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(path))
    else:
        path = Path(kind)
    try:
        with pytest.raises(AudioInputError, match="is not a regular file") as err:
            inspect_audio(path)
        assert str(path) in str(err.value) and "empty" not in str(err.value)
    finally:
        if kind == "socket":
            listener.close()


def test_atomic_writer_publishes_only_complete_files(tmp_path):
    dest = tmp_path / "out.wav"
    with AtomicAudioWriter(dest, channels=2) as w:
        w.write(np.zeros((1920, 2), dtype=np.float32))
        assert not dest.exists()
    data, sr = sf.read(dest)
    assert sr == 24_000 and data.shape == (1920, 2)

    dest2 = tmp_path / "failed.wav"
    with pytest.raises(RuntimeError), AtomicAudioWriter(dest2, channels=2) as w:
        w.write(np.zeros((1920, 2), dtype=np.float32))
        raise RuntimeError("boom")
    assert not dest2.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []


# ---------------------------------------------------------------------------------------- non-finite samples


@pytest.mark.parametrize(
    ("given", "expected", "nonfinite"),
    [
        ([0.5, np.nan, -0.25], [0.5, 0.0, -0.25], 1),
        ([np.inf, 0.1, -np.inf], [0.0, 0.1, 0.0], 2),  # silence, not a full-scale click
        ([1.5, -3.0, 0.999], [1.0, -1.0, 0.999], 0),  # beyond full scale: clipped
        (np.array([1e300, -1e-300, 0.2], dtype=np.float64), [0.0, -0.0, 0.2], 1),  # beyond float32: infinite
        ([np.nan] * 4, [0.0] * 4, 4),
    ],
)
def test_sanitize_pcm_makes_non_finite_samples_silent(given, expected, nonfinite):
    clean, bad = sanitize_pcm(given if isinstance(given, np.ndarray) else np.asarray(given, dtype=np.float32))
    assert clean.dtype == np.float32 and bad == nonfinite
    np.testing.assert_allclose(clean, np.asarray(expected, dtype=np.float32), atol=1e-7)


def test_sanitize_pcm_keeps_clean_float32_as_is_and_refuses_integers():
    x = np.linspace(-1, 1, 1920, dtype=np.float32)
    clean, bad = sanitize_pcm(x)
    assert clean is x and bad == 0
    with pytest.raises(TypeError, match="float samples"):
        sanitize_pcm(np.zeros(8, dtype=np.int16))


def _speech_like(n: int) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 220 * np.arange(n) / 24_000)).astype(np.float32)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("rate", [24_000, 48_000])
def test_non_finite_samples_in_a_file_are_read_as_silence(tmp_path, bad, rate):
    """NaN in the FIRST block (the case that passed as "silent" through max(0.0, nan)) and later ones: the file is
    not silent, the samples are counted, and no NaN or click reaches the frames, resampled or not."""
    x = _speech_like(rate * 6)
    x[:100] = bad  # first block
    x[rate * 5 : rate * 5 + 10] = bad  # a later block
    path = tmp_path / "in.wav"
    sf.write(path, x, rate, subtype="FLOAT")
    info = inspect_audio(path)
    assert info.nonfinite == 110 and info.peak == pytest.approx(0.3, abs=1e-3)
    frames = np.concatenate(list(iter_frames(path)))
    assert np.isfinite(frames).all() and np.abs(frames).max() <= 0.31
    whole = read_audio(path)
    assert np.isfinite(whole).all()
    if rate == 24_000:
        assert (frames[:100] == 0).all() and (frames[24_000 * 5 : 24_000 * 5 + 10] == 0).all()


def test_a_channel_the_recording_lacks_is_a_bad_setting(tmp_path):
    from cspan.core.errors import SettingsError

    path = tmp_path / "mono.wav"
    sf.write(path, _tone(24_000, 0.5), 24_000)
    with pytest.raises(SettingsError, match=rf"^--channel 1: {path} has 1 channel\(s\), numbered 0 to 0$") as err:
        inspect_audio(path, channel=1)
    assert err.value.exit_code == 2


def test_framing_a_file_without_samples_or_without_the_channel_says_so(tmp_path):
    """``iter_frames`` (the README's quickstart calls it directly, without :func:`inspect_audio`): a WAV with a
    header and no samples, or a channel it lacks, is an error before the first frame, not zero frames."""
    from cspan.core.errors import SettingsError

    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, dtype=np.float32), 24_000)
    with pytest.raises(AudioInputError, match="contains no audio samples"):
        next(iter_frames(empty))
    mono = tmp_path / "mono.wav"
    sf.write(mono, _tone(24_000, 0.5), 24_000)
    with pytest.raises(SettingsError, match=r"--channel 1: .* has 1 channel"):
        next(iter_frames(mono, channel=1))


def test_a_silent_channel_points_at_the_channel_that_has_sound(tmp_path):
    """A stereo recording whose speech is on the right: reading the left (the default) says to pass --channel 1;
    when every channel is silent it says so."""
    path = tmp_path / "right.wav"
    tone = _tone(24_000, 0.5)
    sf.write(path, np.stack([np.zeros_like(tone), tone], axis=1), 24_000)
    with pytest.raises(AudioInputError, match=r"channel 0 of 2 is silent .*; channel 1 has sound: pass --channel 1$"):
        inspect_audio(path)
    assert inspect_audio(path, channel=1).peak > 0.1
    sf.write(path, np.zeros((24_000, 2), dtype=np.float32), 24_000)
    with pytest.raises(AudioInputError, match=r"channel 1 of 2 is silent .*; so are its other channels$"):
        inspect_audio(path, channel=1)


def test_a_file_of_only_non_finite_samples_is_silent_and_says_why(tmp_path):
    path = tmp_path / "nan.wav"
    sf.write(path, np.full(24_000, np.nan, dtype=np.float32), 24_000, subtype="FLOAT")
    with pytest.raises(AudioInputError, match="24000 NaN or infinite samples count as silence"):
        inspect_audio(path)


def _wav_claiming(rate: int, channels: int = 1, samples: int = 48_000) -> bytes:
    """A 16-bit WAV of a tone whose header claims ``rate`` Hz (libsndfile cannot write such rates itself)."""
    tone = (8000 * np.sin(np.arange(samples) / 3.0)).astype("<i2")
    data = np.repeat(tone, channels).tobytes()
    fmt = struct.pack("<IHHIIHH", 16, 1, channels, rate, (rate * 2 * channels) % 2**32, 2 * channels, 16)
    return (
        b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + fmt + b"data" + struct.pack("<I", len(data)) + data
    )


@pytest.mark.parametrize("rate", [2_000_000_000, 1_000_000, 999, 1])
def test_an_absurd_header_sample_rate_is_the_same_clear_error_for_every_reader(tmp_path, rate):
    from cspan.backends.asr.audio import AudioFormatError, decode_audio
    from cspan.core.voice import prepare_voice_audio

    path = tmp_path / "x.wav"
    path.write_bytes(_wav_claiming(rate))
    said = f"declares a sample rate of {rate} Hz, outside 1000..768000 Hz"
    for read in (inspect_audio, read_audio, lambda p: list(iter_frames(p)), prepare_voice_audio):
        with pytest.raises(AudioInputError, match=said) as err:
            read(path)
        assert str(err.value).startswith(f"{path}: ")
    with pytest.raises(AudioFormatError, match=said):  # asr-serve uploads and the transcribers
        decode_audio(path.read_bytes())


def test_a_voice_recording_with_non_finite_samples_is_read_with_them_silent(tmp_path, caplog):
    from cspan.core.voice import prepare_voice_audio

    x = _speech_like(24_000 * 3)
    x[1000:1010] = np.nan
    x[5000] = np.inf
    path = tmp_path / "voice.wav"
    sf.write(path, x, 24_000, subtype="FLOAT")
    with caplog.at_level("WARNING", logger="cspan.core.voice"):
        voice = prepare_voice_audio(path)
    assert np.isfinite(voice.pcm).all() and voice.samples == 24_000 * 3
    assert f"{path}: 11 NaN or infinite samples read as silence" in [r.getMessage() for r in caplog.records]


# ------------------------------------------------------------------------------------------------- writing


@pytest.mark.parametrize(
    ("name", "fmt"), [("o.wav", "WAV"), ("o.flac", "FLAC"), ("o.ogg", "OGG"), ("o.mp3", "MP3"), ("O.WAV", "WAV")]
)
def test_writer_writes_the_format_its_extension_names(tmp_path, name, fmt):
    x = np.stack([_speech_like(24_000), 0.5 * _speech_like(24_000)], axis=1)
    with AtomicAudioWriter(tmp_path / name, channels=2) as w:
        w.write(x)
    info = sf.info(tmp_path / name)
    assert (info.format, info.samplerate, info.channels) == (fmt, 24_000, 2)
    assert [p.name for p in tmp_path.iterdir()] == [name]


@pytest.mark.parametrize("name", ["o.m4a", "o.aac", "o", "o.txt"])
def test_writer_refuses_an_extension_it_cannot_honour(tmp_path, name):
    with pytest.raises(OutputError, match=r"cannot write audio there: .*\.wav, \.flac, \.ogg, \.mp3"):
        AtomicAudioWriter(tmp_path / name, channels=2)
    assert list(tmp_path.iterdir()) == []


def test_check_writable_names_the_path_and_the_cause(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputError, match=r"afile/out\.wav: cannot write: not a directory"):
        check_writable(tmp_path / "afile" / "out.wav")
    with pytest.raises(OutputError, match="no space left on device: the output needs about"):
        check_writable(tmp_path / "out.wav", need_bytes=2**62)
    with read_only_folder(tmp_path / "ro") as ro, pytest.raises(OutputError) as err:
        check_writable(ro / "out.wav")
    assert str(ro / "out.wav") in str(err.value)
    assert "permission denied" in str(err.value) or "operation not permitted" in str(err.value)
    check_writable(tmp_path / "new" / "deeper" / "out.wav")  # missing folders are created
    assert [p.name for p in (tmp_path / "new" / "deeper").iterdir()] == []


def test_full_disk_mid_write_is_named_and_leaves_no_part_file(tmp_path):
    with tmpfs(tmp_path / "small", size_kb=256) as small:
        w = AtomicAudioWriter(small / "out.wav", channels=2)
        with pytest.raises(OutputError, match=r"out\.wav: cannot write: no space left on device; free some space"):
            for _ in range(100):  # 100 x 0.08 s of stereo 16-bit = 768 kB
                w.write(np.zeros((1920, 2), dtype=np.float32))
        w.abort()
        assert list(small.iterdir()) == []
        with pytest.raises(OutputError, match=r"out\.json: cannot write: no space left on device"):
            fill(small)
            write_text_atomic(small / "out.json", "x" * 100_000)
        assert [p.name for p in small.iterdir()] == ["filler.bin"]
    with tmpfs(tmp_path / "ro", read_only=True) as ro, pytest.raises(OutputError, match="read-only file system"):
        AtomicAudioWriter(ro / "out.flac", channels=2)


def test_unfinished_outputs_are_removed_when_the_process_exits(tmp_path):
    """A process that exits (sys.exit, an uncaught exception, SIGTERM through cspan's handler) mid-write leaves no
    .part file behind."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from cspan.core.audio import AtomicAudioWriter\n"
        f"w = AtomicAudioWriter({str(tmp_path / 'o.wav')!r}, channels=2)\n"
        "w.write(np.zeros((1920, 2), dtype=np.float32))\n"
        "sys.exit(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert list(tmp_path.iterdir()) == []
