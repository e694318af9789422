"""Audio helpers of the transcribers and the ASR server: validate PCM, decode uploads, resample, encode WAV.

Decoding uses libsndfile (``soundfile``: WAV, FLAC, OGG/Vorbis, OGG/Opus, MP3 where the library has it) and
resampling uses libsoxr (``soxr``, its default high-quality setting). No torch.

Non-finite samples follow the project's one rule (``cspan.core.audio.sanitize_pcm``, which this package cannot
import): each NaN or infinite sample becomes 0.0 (silence) and finite samples beyond full scale are clipped to
+-1.0, before mixing or resampling; how many were replaced is logged as a warning naming the input
(:func:`sanitize_samples`). Sample rates outside 1 kHz..768 kHz are refused here as in ``cspan.core.audio``.
"""

from __future__ import annotations

import io
import logging

import numpy as np
import soundfile as sf
import soxr

from cspan.backends.errors import BackendError

log = logging.getLogger(__name__)


class AudioFormatError(BackendError, ValueError):
    """Audio that cannot be used: undecodable bytes, a wrong array shape or dtype, a bad sample rate."""


class AudioTooLongError(AudioFormatError):
    """An upload longer than the configured limit. ``duration_s`` and ``limit_s`` are in seconds."""

    def __init__(self, message: str, *, duration_s: float, limit_s: float) -> None:
        super().__init__(message)
        self.duration_s = duration_s
        self.limit_s = limit_s


MIN_SAMPLE_RATE = 1_000
"""Lowest sample rate accepted anywhere audio enters the backends, in Hz."""
MAX_SAMPLE_RATE = 768_000
"""Highest sample rate accepted, in Hz (the highest that audio hardware records; a header claiming more is bogus)."""


def check_sample_rate(sample_rate: int) -> int:
    """Return ``sample_rate`` as an int, raising :class:`AudioFormatError` unless it is an integer number of Hz
    between :data:`MIN_SAMPLE_RATE` and :data:`MAX_SAMPLE_RATE`."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int | np.integer):
        raise AudioFormatError(f"sample_rate must be an integer in Hz, got {sample_rate!r}")
    if not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
        raise AudioFormatError(
            f"sample rate {int(sample_rate)} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz; resample the audio"
        )
    return int(sample_rate)


def sanitize_samples(samples: np.ndarray, name: str = "audio") -> np.ndarray:
    """Float samples (any shape) as float32 with the project's rule for non-finite samples (the module docstring):
    NaN / infinite -> 0.0, counted in one warning naming ``name``; finite samples clipped to [-1, 1]."""
    with np.errstate(over="ignore"):
        x = np.asarray(samples).astype(np.float32, copy=False)
    finite = np.isfinite(x)
    nonfinite = int(x.size - np.count_nonzero(finite))
    if nonfinite:
        log.warning("%s: %d NaN or infinite samples read as silence", name, nonfinite)
        x = np.where(finite, x, np.float32(0.0))
    if x.size and (float(x.max()) > 1.0 or float(x.min()) < -1.0):
        x = np.clip(x, -1.0, 1.0)
    return x


def as_mono_float32(pcm: np.ndarray, name: str = "audio") -> np.ndarray:
    """Return ``pcm`` as a contiguous float32 array of shape ``[S]``.

    Accepts shape ``[S]`` or ``[1, S]`` / ``[1, 1, S]`` (leading singleton axes are dropped), floating dtypes
    (cast to float32) and int16 (scaled by 1/32768). Non-finite samples become silence, counted in a warning
    naming ``name`` (:func:`sanitize_samples`). Raises :class:`AudioFormatError` for several channels (mix them
    first) or other dtypes.
    """
    arr = np.asarray(pcm)
    while arr.ndim > 1 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        raise AudioFormatError(
            f"expected mono PCM of shape [S] (or [1, S]), got shape {tuple(np.shape(pcm))}; mix channels to mono first"
        )
    if arr.dtype == np.int16:
        arr = arr.astype(np.float32) / 32768.0
    elif np.issubdtype(arr.dtype, np.floating):
        arr = sanitize_samples(arr, name)
    else:
        raise AudioFormatError(f"expected float32 PCM in [-1, 1] (or int16), got dtype {arr.dtype}")
    return np.ascontiguousarray(arr)


def resample(pcm: np.ndarray, sample_rate: int, target_rate: int) -> np.ndarray:
    """Resample float32 mono ``pcm`` ``[S]`` from ``sample_rate`` to ``target_rate`` Hz with soxr; returns ``[S']``."""
    sample_rate = check_sample_rate(sample_rate)
    target_rate = check_sample_rate(target_rate)
    if sample_rate == target_rate or pcm.size == 0:
        return pcm.astype(np.float32, copy=False)
    return np.asarray(soxr.resample(pcm, sample_rate, target_rate), dtype=np.float32)


def to_int16(pcm: np.ndarray) -> np.ndarray:
    """Float PCM in [-1, 1] ``[S]`` -> int16 ``[S]`` (clipped, rounded to nearest)."""
    return np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)


def encode_wav(pcm: np.ndarray, sample_rate: int) -> bytes:
    """Encode float32 mono ``pcm`` ``[S]`` as a 16-bit PCM WAV file at ``sample_rate`` Hz; returns the file bytes."""
    sample_rate = check_sample_rate(sample_rate)
    buf = io.BytesIO()
    sf.write(buf, to_int16(as_mono_float32(pcm)), sample_rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def decode_audio(data: bytes, *, max_seconds: float | None = None, name: str = "upload") -> tuple[np.ndarray, int]:
    """Decode an audio file held in memory to float32 mono PCM.

    Args:
        data: the file's bytes (WAV, FLAC, OGG, ... anything libsndfile reads), any sample rate, any channel count.
        max_seconds: reject files longer than this (checked from the header before decoding the samples).
        name: how error messages name the input.

    Returns:
        ``(pcm, sample_rate)``: ``pcm`` float32 ``[S]`` in [-1, 1], channels averaged to mono; ``sample_rate`` in Hz.

    Raises:
        AudioTooLongError: the audio lasts longer than ``max_seconds``.
        AudioFormatError: the bytes are empty or not a readable audio file, the header's sample rate is outside
            1 kHz..768 kHz. NaN or infinite samples are read as silence and counted in a warning
            (:func:`sanitize_samples`).
    """
    if not data:
        raise AudioFormatError(f"{name} is empty; send a WAV, FLAC or OGG file")
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            sample_rate = int(f.samplerate)
            frames = int(f.frames)
            if not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
                raise AudioFormatError(
                    f"{name} declares a sample rate of {sample_rate} Hz, outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} "
                    "Hz; send audio recorded at a usual rate (8000 to 48000 Hz)"
                )
            _check_duration(frames / sample_rate, max_seconds, name)
            samples = f.read(dtype="float32", always_2d=True)
    except AudioFormatError:
        raise
    except (sf.SoundFileError, RuntimeError, TypeError, ValueError, EOFError) as exc:
        reason = getattr(exc, "error_string", None) or str(exc)  # libsndfile's own words, without the BytesIO repr
        if reason.strip(" .").lower() in ("system error", "internal psf_fseek() failed"):
            reason = "the data ends early or is damaged"  # what libsndfile's generic I/O failures mean for bytes
        raise AudioFormatError(
            f"{name} ({len(data)} bytes) is not a readable audio file ({reason}); send WAV, FLAC or OGG"
        ) from exc
    # Some containers report no frame count up front; check again on what was actually read.
    _check_duration(samples.shape[0] / sample_rate, max_seconds, name)
    if samples.shape[0] == 0:
        raise AudioFormatError(f"{name} ({len(data)} bytes) holds no audio samples; send a clip with sound in it")
    samples = sanitize_samples(samples, name)
    pcm = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    return np.ascontiguousarray(pcm), sample_rate


def _check_duration(duration_s: float, max_seconds: float | None, name: str) -> None:
    if max_seconds is not None and duration_s > max_seconds:
        raise AudioTooLongError(
            f"{name} lasts {duration_s:.1f} s, longer than this server's limit of {max_seconds:g} s; "
            "send a shorter clip (or raise the server's --max-seconds)",
            duration_s=duration_s,
            limit_s=max_seconds,
        )
