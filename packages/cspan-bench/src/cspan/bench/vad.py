"""Silero VAD speech segments, taken the way Full-Duplex-Bench's backchannel scorer takes them.

The reference (``eval_backchannel.py``) calls the ``silero-vad`` pip package with every default:
``get_speech_timestamps(wav, load_silero_vad(), return_seconds=True)`` -- threshold 0.5, 250 ms minimum speech,
100 ms minimum silence, 30 ms padding, 512-sample windows, start/end rounded to 0.1 s -- and never passes the sample
rate, so the audio must be 16 kHz for the times to be right. Here the audio is resampled to 16 kHz with soxr first
(``docs/reference/benchmarks.md`` section 1.7). Silero VAD: Silero Team, https://github.com/snakers4/silero-vad.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np
import soxr

VAD_SAMPLE_RATE = 16000
"""The only rate the reference's call is correct for, Hz."""

_default_model: Any = None
_model_lock = threading.Lock()


def silero_vad_version() -> str:
    """The installed ``silero-vad`` package version (the model changed across versions: v4, v5, v6)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("silero-vad")
    except PackageNotFoundError:
        return "not installed"


def load_silero_vad() -> Any:
    """Load the Silero VAD model bundled in the ``silero-vad`` package (TorchScript, CPU).

    Importing ``silero_vad`` sets ``torch.set_num_threads(1)`` for the whole process; the previous thread count is
    restored here so scoring does not slow down the rest of the program.

    Raises:
        ImportError: ``silero-vad`` is not installed (``pip install silero-vad``).
    """
    import torch

    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            # silero's loader uses importlib.resources.path and torch.jit.load, both deprecated upstream.
            warnings.simplefilter("ignore", DeprecationWarning)
            return _silero().load_silero_vad()
    finally:
        torch.set_num_threads(threads)


def _silero() -> Any:
    """Import ``silero_vad`` without letting its import-time ``torch.set_num_threads(1)`` stick."""
    import torch

    threads = torch.get_num_threads()
    try:
        import silero_vad
    finally:
        torch.set_num_threads(threads)
    return silero_vad


def _model() -> Any:
    global _default_model
    if _default_model is None:
        _default_model = load_silero_vad()
    return _default_model


def to_vad_rate(pcm: np.ndarray, sample_rate: int) -> np.ndarray:
    """Mono float32 ``pcm`` ``[S]`` at ``sample_rate`` Hz -> float32 ``[S']`` at 16 kHz (soxr, high quality)."""
    pcm = np.asarray(pcm, dtype=np.float32)
    if pcm.ndim != 1:
        raise ValueError(f"expected mono PCM of shape [S], got shape {pcm.shape}")
    if sample_rate == VAD_SAMPLE_RATE or pcm.size == 0:
        return np.ascontiguousarray(pcm)
    return np.ascontiguousarray(soxr.resample(pcm, sample_rate, VAD_SAMPLE_RATE), dtype=np.float32)


def speech_segments(pcm: np.ndarray, sample_rate: int, *, model: Any = None) -> list[tuple[float, float]]:
    """Speech segments of a clip with Silero VAD at its default settings, as the FDB backchannel scorer sees them.

    Args:
        pcm: float32 mono audio ``[S]`` in [-1, 1] (what ``soundfile``/``torchaudio`` read from a 16-bit WAV).
        sample_rate: its rate in Hz; resampled to 16 kHz with soxr before the VAD.
        model: a model from :func:`load_silero_vad`; ``None`` uses one shared model (loaded on first use).

    Returns:
        ``[(start_s, end_s), ...]`` in time order, each rounded to 0.1 s by silero's ``return_seconds=True``.
    """
    import torch

    get_speech_timestamps = _silero().get_speech_timestamps
    audio = torch.from_numpy(to_vad_rate(pcm, sample_rate))
    if audio.numel() == 0:
        return []
    with _model_lock:  # the model keeps recurrent state between windows: one clip at a time
        vad = model if model is not None else _model()
        # One 512-sample window per call: intra-op threads only add overhead (tens of times slower on a busy
        # machine), which is why silero itself sets one thread. Restore the caller's setting afterwards.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            stamps = get_speech_timestamps(audio, vad, return_seconds=True)
        finally:
            torch.set_num_threads(threads)
    return [(float(s["start"]), float(s["end"])) for s in stamps]
