"""Audio input and output: reading any file soundfile decodes, resampling, channel choice, atomic writing.

Everything here works on float32 samples in [-1, 1]. Reading is streaming (blocks of a few seconds, resampled with
``soxr.ResampleStream``), so an hour-long recording is processed with bounded memory.

Non-finite samples, one rule on every surface: wherever audio enters (files read here, voice prompts, ``cspan
prepare``'s dialogues, ``cspan serve``'s wire frames), it goes through :func:`sanitize_pcm`: a NaN or infinite
sample becomes 0.0 (silence) and finite samples beyond full scale are clipped to +-1.0, before any resampling (a NaN
would otherwise spread through the filter); how many were replaced is said once (a warning, ``cspan infer``'s
``input_nonfinite_samples``, ``cspan serve``'s ``bad_audio`` event). ``cspan asr-serve`` uploads and the
transcribers apply the same rule with ``cspan.backends.asr.audio.sanitize_samples`` (the backends cannot import
this package). Sample rates: a recording must declare 1 kHz..768 kHz (:func:`check_sample_rate`, the same bounds
as the backends'); anything else is a bogus header, refused with the same message everywhere. Readers count what
they replaced or clipped (:attr:`AudioInfo.nonfinite`, :attr:`AudioInfo.clipped`) so that callers can say so.

Writing (:class:`AtomicAudioWriter`) goes through :mod:`cspan.core.files`: a temporary ``.NAME.*.part`` file next
to the destination that is renamed into place only when complete, so a crash never leaves a partial file that looks
finished; the temporary files of a process that exits are removed. Write failures raise
:class:`~cspan.core.errors.OutputError` naming the path and the cause (permission denied, no space left on device,
read-only file system).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import soundfile as sf
import soxr

from cspan.core.constants import FRAME_SIZE, SAMPLE_RATE
from cspan.core.errors import AudioInputError, OutputError, SettingsError
from cspan.core.files import drop_part, new_part, publish_part, write_error

MIN_SAMPLE_RATE = 1_000
"""Lowest sample rate a recording may declare, in Hz (the same bounds as ``cspan.backends.asr.audio``)."""
MAX_SAMPLE_RATE = 768_000
"""Highest sample rate a recording may declare, in Hz (the highest audio hardware records; more is a bogus header)."""

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
        peak: absolute peak of the selected channel (float32 scale) after :func:`sanitize_pcm`.
        nonfinite: NaN or infinite samples of the selected channel, read as silence (0.0).
        clipped: finite samples of the selected channel beyond full scale (a float file), read as +-1.0.
    """

    path: Path
    sample_rate: int
    channels: int
    frames: int
    duration_s: float
    peak: float
    nonfinite: int = 0
    clipped: int = 0

    def stream_frames(self, sample_rate: int = SAMPLE_RATE, frame_size: int = FRAME_SIZE) -> int:
        """How many frames :func:`iter_frames` yields for this recording: its samples at ``sample_rate`` (soxr's
        stream gives ``frames * sample_rate / self.sample_rate`` rounded half up; exact integers, not the float
        duration) in frames of ``frame_size``, the last one padded."""
        samples = (2 * self.frames * sample_rate + self.sample_rate) // (2 * self.sample_rate)
        return -(-samples // frame_size)


def sanitize_pcm(pcm: np.ndarray) -> tuple[np.ndarray, int]:
    """Samples as the model takes them: float32 in [-1, 1], with non-finite samples made silent.

    The one handling of NaN and infinity wherever audio enters (see the module docstring): each NaN or infinite
    sample becomes 0.0 (a NaN has no value, and an infinite sample would be a full-scale click), and finite samples
    beyond full scale are clipped to +-1.0, as any conversion to integer PCM does. Values are converted to float32
    first, so a float64 beyond float32's range counts as infinite.

    Args:
        pcm: float samples of any shape, full scale 1.0 (convert int16 PCM with ``/ 32768`` first).

    Returns:
        ``(samples, nonfinite)``: float32 of the same shape (the input itself when it was float32 and already
        clean, else a new array) and how many samples were NaN or infinite.

    Raises:
        TypeError: integer or non-numeric samples (their scale is ambiguous).
    """
    arr = np.asarray(pcm)
    if not np.issubdtype(arr.dtype, np.floating):
        raise TypeError(f"sanitize_pcm expects float samples (full scale 1.0), got dtype {arr.dtype}")
    with np.errstate(over="ignore"):
        x = arr.astype(np.float32, copy=False)
    finite = np.isfinite(x)
    nonfinite = int(x.size - np.count_nonzero(finite))
    if nonfinite:
        x = np.where(finite, x, np.float32(0.0))
    if x.size and (float(x.max()) > 1.0 or float(x.min()) < -1.0):
        x = np.clip(x, -1.0, 1.0)
    return x, nonfinite


READABLE_FORMATS = "WAV, FLAC, OGG Vorbis/Opus, MP3"
"""What the error messages offer: the formats the bundled libsndfile (>= 1.1) decodes."""


def decode_error_cause(exc: BaseException) -> str:
    """Why libsndfile could not open a file, without the name it was opened under (for a file object that is its
    repr, ``<_io.BytesIO object at 0x...>``, which must not reach a client): ``"Format not recognised."``."""
    cause = getattr(exc, "error_string", None)
    return str(cause) if cause else str(exc)


def _open(path: Path) -> sf.SoundFile:
    if not path.exists():
        raise AudioInputError(f"{path}: no such file; pass an existing recording ({READABLE_FORMATS})")
    if path.is_dir():
        raise AudioInputError(f"{path}: is a directory, not an audio file")
    if not path.is_file():  # a FIFO, /dev/zero, a socket: no length to check, a second pass reads something else
        raise AudioInputError(
            f"{path}: is not a regular file (a pipe, a device or a socket); save the recording to a file first"
        )
    if path.stat().st_size == 0:
        raise AudioInputError(f"{path}: the file is empty (0 bytes)")
    # bytes: a name that is not UTF-8 opens too
    return open_decoder(os.fsencode(path), path, "supported are the formats libsndfile reads")


def open_decoder(source: Any, label: str | os.PathLike[str], hint: str) -> sf.SoundFile:
    """libsndfile's reader of ``source`` (a file name or a binary file object) whose sample rate is plausible.

    Raises:
        AudioInputError: not decodable ("<label>: cannot decode audio (<libsndfile's reason>); <hint> (formats)"),
            or a sample rate outside :data:`MIN_SAMPLE_RATE`..:data:`MAX_SAMPLE_RATE`.
    """
    try:
        f = sf.SoundFile(source)
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise AudioInputError(
            f"{label}: cannot decode audio ({decode_error_cause(exc)}); {hint} ({READABLE_FORMATS})"
        ) from None
    try:
        check_sample_rate(int(f.samplerate), label)
    except AudioInputError:
        f.close()
        raise
    return f


def check_sample_rate(sample_rate: int, where: str | os.PathLike[str]) -> int:
    """``sample_rate`` when it lies in :data:`MIN_SAMPLE_RATE`..:data:`MAX_SAMPLE_RATE` Hz, the bounds every
    surface that takes audio applies (files here, ``cspan prepare``, ``cspan asr-serve`` uploads).

    Raises:
        AudioInputError: outside the bounds, naming ``where``.
    """
    if not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
        raise AudioInputError(
            f"{where}: declares a sample rate of {sample_rate} Hz, outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz; "
            "use audio recorded at a usual rate (8000 to 48000 Hz)"
        )
    return sample_rate


def _check_layout(path: Path, f: sf.SoundFile, channel: int) -> None:
    """The header's checks shared by :func:`inspect_audio` and :func:`iter_frames`: the channel exists (else a
    :class:`SettingsError`, a bad ``--channel``) and the file holds samples (else :class:`AudioInputError`)."""
    if not 0 <= channel < f.channels:
        raise SettingsError(f"--channel {channel}: {path} has {f.channels} channel(s), numbered 0 to {f.channels - 1}")
    if f.frames <= 0:
        raise AudioInputError(f"{path}: contains no audio samples")


def inspect_audio(path: str | os.PathLike[str], *, channel: int = 0, max_seconds: float = 3600.0) -> AudioInfo:
    """Validate a recording and measure it in one streaming pass.

    Args:
        path: the recording.
        channel: which channel is used (0 = left / mono).
        max_seconds: longest accepted duration.

    Returns:
        An :class:`AudioInfo`.

    Raises:
        AudioInputError: missing, empty, undecodable, no samples, longer than ``max_seconds``, or silent-only on
            the chosen channel (peak below -80 dBFS once non-finite samples are read as silence; the message names a
            channel that has sound, if any).
        SettingsError: ``channel`` is not one of the recording's (a bad ``--channel``: exit status 2).
    """
    path = Path(path)
    with _open(path) as f:
        _check_layout(path, f, channel)
        sr, channels, frames = int(f.samplerate), int(f.channels), int(f.frames)
        duration = frames / sr
        if duration > max_seconds:
            raise AudioInputError(
                f"{path}: is {duration:.1f} s long, over the limit of {max_seconds:.0f} s (raise --max-seconds)"
            )
        peaks = np.zeros(channels)  # every channel's, to point at another one when the chosen one is silent
        nonfinite = clipped = 0
        try:
            for block in f.blocks(blocksize=int(sr * _BLOCK_SECONDS), dtype="float32", always_2d=True):
                column = block[:, channel]
                finite = np.isfinite(column)
                with np.errstate(invalid="ignore"):
                    clipped += int(np.count_nonzero(finite & (np.abs(column) > 1.0)))
                nonfinite += column.size - int(np.count_nonzero(finite))
                if len(block):  # every channel as the model would take it
                    peaks = np.maximum(peaks, np.abs(sanitize_pcm(block)[0]).max(axis=0))
        except (sf.LibsndfileError, RuntimeError) as exc:
            raise AudioInputError(
                f"{path}: decoding failed part-way ({decode_error_cause(exc)}); the file is damaged"
            ) from exc
    peak = float(peaks[channel])
    if peak < SILENCE_PEAK:
        why = f"; its {nonfinite} NaN or infinite samples count as silence" if nonfinite else ""
        if channels == 1:
            raise AudioInputError(f"{path}: is silent (peak {peak:.2e}, below -80 dBFS{why}); nothing to listen to")
        loud = [c for c in range(channels) if peaks[c] >= SILENCE_PEAK]
        hint = f"; channel {loud[0]} has sound: pass --channel {loud[0]}" if loud else "; so are its other channels"
        raise AudioInputError(
            f"{path}: channel {channel} of {channels} is silent (peak {peak:.2e}, below -80 dBFS{why}){hint}"
        )
    return AudioInfo(
        path=path,
        sample_rate=sr,
        channels=channels,
        frames=frames,
        duration_s=duration,
        peak=peak,
        nonfinite=nonfinite,
        clipped=clipped,
    )


def iter_frames(
    path: str | os.PathLike[str],
    *,
    channel: int = 0,
    sample_rate: int = SAMPLE_RATE,
    frame_size: int = FRAME_SIZE,
) -> Iterator[np.ndarray]:
    """Stream a recording as fixed-size frames at ``sample_rate``.

    The file is read in blocks of a few seconds, the chosen channel goes through :func:`sanitize_pcm` and is
    resampled with ``soxr.ResampleStream`` (quality "HQ"; clipped to [-1, 1] again after it), and frames of exactly
    ``frame_size`` samples are yielded; the last one is zero-padded. Memory stays bounded whatever the length. Call
    :func:`inspect_audio` first to validate the file (and count its non-finite samples).

    Yields:
        float32 arrays of shape ``[frame_size]``.

    Raises:
        AudioInputError: the file cannot be opened or decoded, or holds no samples.
        SettingsError: ``channel`` is not one of the file's.
    """
    path = Path(path)
    with _open(path) as f:
        _check_layout(path, f, channel)
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
                raise AudioInputError(
                    f"{path}: decoding failed part-way ({decode_error_cause(exc)}); the file is damaged"
                ) from exc
            mono = np.ascontiguousarray(sanitize_pcm(block[:, channel])[0])
            if resampler is not None:
                mono = np.clip(resampler.resample_chunk(mono, last=last), -1.0, 1.0)
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
        data = sanitize_pcm(f.read(dtype="float32", always_2d=True)[:, channel])[0]
        sr = int(f.samplerate)
    if sr != sample_rate:
        data = np.clip(soxr.resample(data, sr, sample_rate, quality="HQ").astype(np.float32), -1.0, 1.0)
    return np.ascontiguousarray(data, dtype=np.float32)


def resample(pcm: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Resample float mono ``[S]`` with soxr (quality "HQ"), after :func:`sanitize_pcm`; float32, in [-1, 1]."""
    clean = sanitize_pcm(pcm)[0]
    if from_rate == to_rate:
        return clean
    return np.clip(soxr.resample(clean, from_rate, to_rate, quality="HQ").astype(np.float32), -1.0, 1.0)


OUTPUT_FORMATS: dict[str, tuple[str, str]] = {
    ".wav": ("WAV", "PCM_16"),
    ".flac": ("FLAC", "PCM_16"),
    ".ogg": ("OGG", "VORBIS"),
    ".mp3": ("MP3", "MPEG_LAYER_III"),
}
"""Audio files the writers produce, by the destination's extension: ``(soundfile format, subtype)``."""


def output_format(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``(format, subtype)`` that :class:`AtomicAudioWriter` writes for ``path``, from its extension.

    Raises:
        OutputError: an extension that is not in :data:`OUTPUT_FORMATS` (or that this libsndfile cannot write).
    """
    suffix = Path(path).suffix.lower()
    fmt = OUTPUT_FORMATS.get(suffix)
    if fmt is None or not sf.check_format(*fmt):
        known = ", ".join(k for k, v in OUTPUT_FORMATS.items() if sf.check_format(*v))
        what = f"{suffix!r} is not an audio format the writer knows" if suffix else "it has no file extension"
        raise OutputError(f"{path}: cannot write audio there: {what}; name the file with one of {known}")
    return fmt


class AtomicAudioWriter:
    """Streaming audio writer that only publishes a complete file.

    The format follows the destination's extension (:data:`OUTPUT_FORMATS`: 16-bit PCM WAV, 16-bit FLAC, Ogg
    Vorbis, MP3). Frames are written to a temporary file in the destination's folder; :meth:`commit` (or leaving
    the ``with`` block without an exception) renames it into place. On an exception, :meth:`abort` or the process
    exiting first, the temporary file is removed and the destination is left untouched.

    Args:
        path: destination.
        sample_rate: Hz.
        channels: 1 or 2 (stereo is ``[S, 2]``, left then right).

    Raises:
        OutputError: an unknown extension; the temporary file cannot be created or written (path and cause).
    """

    def __init__(self, path: str | os.PathLike[str], *, sample_rate: int = SAMPLE_RATE, channels: int = 2) -> None:
        self.path = Path(path)
        self.format, self.subtype = output_format(self.path)
        try:
            self._tmp = new_part(self.path)
        except OSError as exc:
            raise OutputError.from_os_error(self.path, exc) from None
        try:
            self._file = sf.SoundFile(
                os.fsencode(self._tmp),
                mode="w",
                samplerate=sample_rate,
                channels=channels,
                subtype=self.subtype,
                format=self.format,
            )
        except (sf.LibsndfileError, RuntimeError, OSError) as exc:
            error = write_error(self.path, exc)
            drop_part(self._tmp)
            raise error from None
        self.channels = channels
        self.frames_written = 0

    def write(self, samples: np.ndarray) -> None:
        """Append ``[S, channels]`` (or ``[S]`` for mono) float32 samples; values are clipped to [-1, 1].

        Raises:
            ValueError: wrong number of channels. OutputError: the write failed (path and cause).
        """
        data = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
        if data.ndim == 1:
            data = data[:, None]
        if data.shape[1] != self.channels:
            raise ValueError(f"expected {self.channels} channel(s), got array of shape {data.shape}")
        try:
            self._file.write(data)
        except (sf.LibsndfileError, RuntimeError, OSError) as exc:
            raise write_error(self.path, exc) from None
        self.frames_written += len(data)

    def commit(self) -> Path:
        """Close and rename the temporary file onto the destination (:meth:`finish`, then :meth:`publish`);
        returns the destination.

        Raises:
            OutputError: closing (the last buffered bytes) or the rename failed; the temporary file is removed.
        """
        self.finish()
        return self.publish()

    def finish(self) -> None:
        """Close the temporary file (its last buffered bytes and header written): complete, not yet in place.

        Raises:
            OutputError: closing failed; the temporary file is removed.
        """
        if self._file.closed:
            return
        try:
            self._file.close()
        except (sf.LibsndfileError, RuntimeError, OSError) as exc:
            error = write_error(self.path, exc)
            self.abort()
            raise error from None

    def publish(self) -> Path:
        """Rename the :meth:`finish`-ed temporary file onto the destination; returns the destination.

        Raises:
            OutputError: the rename failed; the temporary file is removed.
        """
        assert self._file.closed, "finish() first"
        try:
            publish_part(self._tmp, self.path)
        except OSError as exc:
            error = write_error(self.path, exc)
            self.abort()
            raise error from None
        return self.path

    def abort(self) -> None:
        """Close and delete the temporary file; the destination is not touched."""
        if not self._file.closed:
            try:
                self._file.close()
            except (sf.LibsndfileError, RuntimeError, OSError):
                pass  # the file is being thrown away; a failed flush of its last bytes does not matter
        drop_part(self._tmp)

    def __enter__(self) -> AtomicAudioWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


AtomicWavWriter = AtomicAudioWriter
"""The former name (it wrote WAV only); kept while ``cspan.bench`` uses it."""
