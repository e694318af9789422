"""Audio input and output: reading any file soundfile decodes, resampling, channel choice, atomic WAV writing.

Everything here works on float32 samples in [-1, 1]. Reading is streaming (blocks of a few seconds, resampled with
``soxr.ResampleStream``), so an hour-long recording is processed with bounded memory. Writing goes to a temporary
file next to the destination that is renamed into place only when complete, so a crash never leaves a partial
file that looks finished.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np
import soundfile as sf
import soxr

from cspan.core.constants import FRAME_SIZE, SAMPLE_RATE
from cspan.core.errors import AudioInputError

SILENCE_PEAK = 10 ** (-80 / 20)
"""A file whose peak stays below -80 dBFS is treated as silent-only."""

_BLOCK_SECONDS = 4.0


@dataclass(frozen=True)
class AudioInfo:
    """What a recording is, as read from its header and one streaming pass.

    Attributes:
        path: the file.
        sample_rate: its native rate in Hz.
        channels: number of channels.
        frames: samples per channel at the native rate.
        duration_s: length in seconds.
        peak: absolute peak of the selected channel (float32 scale).
    """

    path: Path
    sample_rate: int
    channels: int
    frames: int
    duration_s: float
    peak: float


def _open(path: Path) -> sf.SoundFile:
    if not path.exists():
        raise AudioInputError(f"{path}: no such file; pass an existing recording (WAV, FLAC or OGG)")
    if path.is_dir():
        raise AudioInputError(f"{path}: is a directory, not an audio file")
    if path.stat().st_size == 0:
        raise AudioInputError(f"{path}: the file is empty (0 bytes)")
    try:
        return sf.SoundFile(str(path))
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise AudioInputError(
            f"{path}: cannot decode audio ({exc}); supported are the formats libsndfile reads (WAV, FLAC, OGG)"
        ) from exc


def inspect_audio(path: str | os.PathLike[str], *, channel: int = 0, max_seconds: float = 3600.0) -> AudioInfo:
    """Validate a recording and measure it in one streaming pass.

    Args:
        path: the recording.
        channel: which channel is used (0 = left / mono).
        max_seconds: longest accepted duration.

    Returns:
        An :class:`AudioInfo`.

    Raises:
        AudioInputError: missing, empty, undecodable, no samples, channel out of range, longer than
            ``max_seconds``, or silent-only (peak below -80 dBFS).
    """
    path = Path(path)
    with _open(path) as f:
        sr, channels, frames = int(f.samplerate), int(f.channels), int(f.frames)
        if not 0 <= channel < channels:
            raise AudioInputError(f"{path}: has {channels} channel(s); --channel {channel} does not exist")
        if frames <= 0:
            raise AudioInputError(f"{path}: contains no audio samples")
        duration = frames / sr
        if duration > max_seconds:
            raise AudioInputError(
                f"{path}: is {duration:.1f} s long, over the limit of {max_seconds:.0f} s (raise --max-seconds)"
            )
        peak = 0.0
        try:
            for block in f.blocks(blocksize=int(sr * _BLOCK_SECONDS), dtype="float32", always_2d=True):
                peak = max(peak, float(np.max(np.abs(block[:, channel]))) if len(block) else 0.0)
        except (sf.LibsndfileError, RuntimeError) as exc:
            raise AudioInputError(f"{path}: decoding failed part-way ({exc}); the file is damaged") from exc
    if not math.isfinite(peak):
        raise AudioInputError(f"{path}: contains NaN or infinite samples")
    if peak < SILENCE_PEAK:
        raise AudioInputError(f"{path}: is silent (peak {peak:.2e}, below -80 dBFS); nothing to listen to")
    return AudioInfo(path=path, sample_rate=sr, channels=channels, frames=frames, duration_s=duration, peak=peak)


def iter_frames(
    path: str | os.PathLike[str],
    *,
    channel: int = 0,
    sample_rate: int = SAMPLE_RATE,
    frame_size: int = FRAME_SIZE,
) -> Iterator[np.ndarray]:
    """Stream a recording as fixed-size frames at ``sample_rate``.

    The file is read in blocks of a few seconds, the chosen channel is resampled with ``soxr.ResampleStream``
    (quality "HQ"), and frames of exactly ``frame_size`` samples are yielded; the last one is zero-padded. Memory
    stays bounded whatever the length. Call :func:`inspect_audio` first to validate the file.

    Yields:
        float32 arrays of shape ``[frame_size]``.

    Raises:
        AudioInputError: the file cannot be opened or decoded.
    """
    path = Path(path)
    with _open(path) as f:
        sr = int(f.samplerate)
        resampler = None if sr == sample_rate else soxr.ResampleStream(sr, sample_rate, 1, dtype="float32")
        pending = np.zeros(0, dtype=np.float32)
        blocks = f.blocks(blocksize=int(sr * _BLOCK_SECONDS), dtype="float32", always_2d=True)
        while True:
            try:
                block = next(blocks)
                last = False
            except StopIteration:
                block = np.zeros((0, f.channels), dtype=np.float32)
                last = True
            except (sf.LibsndfileError, RuntimeError) as exc:
                raise AudioInputError(f"{path}: decoding failed part-way ({exc}); the file is damaged") from exc
            mono = np.ascontiguousarray(block[:, channel], dtype=np.float32)
            if resampler is not None:
                mono = resampler.resample_chunk(mono, last=last)
            pending = np.concatenate([pending, mono]) if len(pending) else mono
            n_full = len(pending) // frame_size
            for i in range(n_full):
                yield pending[i * frame_size : (i + 1) * frame_size].copy()
            pending = pending[n_full * frame_size :]
            if last:
                break
        if len(pending):
            frame = np.zeros(frame_size, dtype=np.float32)
            frame[: len(pending)] = pending
            yield frame


def read_audio(
    path: str | os.PathLike[str],
    *,
    channel: int = 0,
    sample_rate: int = SAMPLE_RATE,
    max_seconds: float = 3600.0,
) -> np.ndarray:
    """Read one channel of a recording, resampled to ``sample_rate``, as float32 ``[S]``.

    Convenience for short files (the whole signal is held in memory). Validates like :func:`inspect_audio`.

    Raises:
        AudioInputError: see :func:`inspect_audio`.
    """
    inspect_audio(path, channel=channel, max_seconds=max_seconds)
    with _open(Path(path)) as f:
        data = f.read(dtype="float32", always_2d=True)[:, channel]
        sr = int(f.samplerate)
    if sr != sample_rate:
        data = soxr.resample(data, sr, sample_rate, quality="HQ").astype(np.float32)
    return np.ascontiguousarray(data, dtype=np.float32)


def resample(pcm: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Resample float32 mono ``[S]`` with soxr (quality "HQ")."""
    if from_rate == to_rate:
        return np.asarray(pcm, dtype=np.float32)
    return soxr.resample(np.asarray(pcm, dtype=np.float32), from_rate, to_rate, quality="HQ").astype(np.float32)


def sanitize_pcm(pcm: np.ndarray) -> tuple[np.ndarray, int]:
    """Audio that arrives live (a wire protocol, a decoded stream) made safe for the model.

    Non-finite samples (NaN, +-Inf) become 0 (silence) and every sample is clipped to [-1, 1], so that one bad
    sample can neither reach the model nor be played back as a full-scale click.

    Args:
        pcm: float samples, any shape.

    Returns:
        ``(clean, nonfinite)``: float32 samples of the same shape, and how many were not finite (callers report
        that once, naming the source).
    """
    x = np.asarray(pcm, dtype=np.float32)
    finite = np.isfinite(x)
    nonfinite = int(x.size - np.count_nonzero(finite))
    if nonfinite:
        x = np.where(finite, x, np.float32(0.0))
    return np.clip(x, -1.0, 1.0), nonfinite


def _default_mode() -> int:
    """The permissions a plain ``open(..., "w")`` would give a new file (0o666 minus the umask)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


class AtomicWavWriter:
    """Streaming 16-bit PCM WAV writer that only publishes a complete file.

    Frames are written to a temporary file in the destination's folder; :meth:`commit` (or leaving the ``with``
    block without an exception) renames it into place. On an exception, or :meth:`abort`, the temporary file is
    removed and the destination is left untouched.

    Args:
        path: destination.
        sample_rate: Hz.
        channels: 1 or 2 (stereo is ``[S, 2]``, left then right).
    """

    def __init__(self, path: str | os.PathLike[str], *, sample_rate: int = SAMPLE_RATE, channels: int = 2) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".part", dir=self.path.parent)
        os.close(fd)
        self._tmp = Path(tmp)
        self._file = sf.SoundFile(
            str(self._tmp), mode="w", samplerate=sample_rate, channels=channels, subtype="PCM_16", format="WAV"
        )
        self.channels = channels
        self.frames_written = 0

    def write(self, samples: np.ndarray) -> None:
        """Append ``[S, channels]`` (or ``[S]`` for mono) float32 samples; values are clipped to [-1, 1]."""
        data = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
        if data.ndim == 1:
            data = data[:, None]
        if data.shape[1] != self.channels:
            raise ValueError(f"expected {self.channels} channel(s), got array of shape {data.shape}")
        self._file.write(data)
        self.frames_written += len(data)

    def commit(self) -> Path:
        """Close and rename the temporary file onto the destination; returns the destination."""
        self._file.close()
        os.chmod(self._tmp, _default_mode())  # mkstemp made it private; the result is an ordinary file
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Close and delete the temporary file; the destination is not touched."""
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> AtomicWavWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write a text file through a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, _default_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
