"""Audio formats of the OpenAI Realtime API: ``pcm16`` at 24 kHz and G.711 u-law / A-law at 8 kHz, both ways.

The model runs on float32 mono at 24 kHz (:data:`cspan.core.constants.SAMPLE_RATE`). A Realtime client sends and
receives base64 audio in the session's format:

==============  ===========================  ===============  ===========================================
GA name         beta name                    sample rate      bytes
==============  ===========================  ===============  ===========================================
``audio/pcm``   ``pcm16``                    24 000 Hz        signed 16-bit little-endian, 2 per sample
``audio/pcmu``  ``g711_ulaw``                8 000 Hz         ITU-T G.711 u-law, 1 per sample
``audio/pcma``  ``g711_alaw``                8 000 Hz         ITU-T G.711 A-law, 1 per sample
==============  ===========================  ===============  ===========================================

:class:`InputAudio` turns the client's chunks (any length, even split inside a sample) into float32 at 24 kHz;
:class:`OutputAudio` turns each of the agent's 80 ms frames into exactly 80 ms of the client's bytes (3840 bytes of
pcm16, 640 of G.711). G.711 input is resampled to 24 kHz with soxr's streaming resampler (one stream per session,
so chunk boundaries leave no clicks; :data:`RESAMPLE_QUALITY`). G.711 output is 24 kHz decimated by 3
(:class:`Decimator`, a linear-phase FIR low-pass and every third sample): soxr's stream delivers in blocks of about
66 ms, so its output for one frame is 66 or 131 ms, not 80.

The G.711 tables follow ITU-T Recommendation G.711 as implemented in Sun Microsystems' public-domain ``g711.c``
(the code behind Python's former ``audioop.lin2ulaw`` / ``lin2alaw``): 65 536-entry encode tables and 256-entry
decode tables, built once at import.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from cspan.core.constants import SAMPLE_RATE

AudioFormat = Literal["pcm16", "g711_ulaw", "g711_alaw"]
"""A Realtime audio format, by its beta name (the GA names map onto these: :data:`GA_FORMATS`)."""

GA_FORMATS: dict[str, AudioFormat] = {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}
"""GA ``audio.*.format.type`` -> the beta name."""
GA_NAMES: dict[AudioFormat, str] = {v: k for k, v in GA_FORMATS.items()}
"""Beta name -> GA ``format.type``."""
FORMAT_RATES: dict[AudioFormat, int] = {"pcm16": SAMPLE_RATE, "g711_ulaw": 8000, "g711_alaw": 8000}
"""Sample rate (Hz) of each format on the wire."""
RESAMPLE_QUALITY = "MQ"
"""soxr's medium quality for G.711 input (8 -> 24 kHz): about 24 ms of stream delay (HQ adds 71 ms), ample for 8 kHz
telephone audio."""
FORMAT_BYTES_PER_SAMPLE: dict[AudioFormat, int] = {"pcm16": 2, "g711_ulaw": 1, "g711_alaw": 1}


# ---------------------------------------------------------------------------------------------------- G.711


def _ulaw_encode(pcm: np.ndarray) -> np.ndarray:
    """int16-range ints -> u-law bytes (g711.c ``linear2ulaw``: 14-bit magnitude, bias 0x84, clip 8159)."""
    v = pcm.astype(np.int32) >> 2
    mask = np.where(v < 0, 0x7F, 0xFF)
    v = np.minimum(np.abs(v), 8159) + (0x84 >> 2)
    seg = np.searchsorted(np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF]), v)
    code = (seg << 4) | ((v >> (seg + 1)) & 0x0F)
    return ((np.where(seg >= 8, 0x7F, code) ^ mask) & 0xFF).astype(np.uint8)


def _ulaw_decode(code: np.ndarray) -> np.ndarray:
    """u-law bytes -> int16-range ints (g711.c ``ulaw2linear``)."""
    u = ~code.astype(np.int32) & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84)


def _alaw_encode(pcm: np.ndarray) -> np.ndarray:
    """int16-range ints -> A-law bytes (g711.c ``linear2alaw``: 13-bit magnitude, even bits inverted)."""
    v = pcm.astype(np.int32) >> 3
    mask = np.where(v >= 0, 0xD5, 0x55)
    v = np.where(v >= 0, v, -v - 1)
    seg = np.searchsorted(np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF]), v)
    low = np.where(seg < 2, v >> 1, v >> np.maximum(seg, 1)) & 0x0F
    code = np.where(seg >= 8, 0x7F, (seg << 4) | low)
    return ((code ^ mask) & 0xFF).astype(np.uint8)


def _alaw_decode(code: np.ndarray) -> np.ndarray:
    """A-law bytes -> int16-range ints (g711.c ``alaw2linear``)."""
    a = code.astype(np.int32) ^ 0x55
    seg = (a & 0x70) >> 4
    t = (a & 0x0F) << 4
    t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))
    return np.where(a & 0x80, t, -t)


_ALL_INT16 = np.arange(-32768, 32768, dtype=np.int32)
_ALL_BYTES = np.arange(256, dtype=np.int32)
_ENCODE: dict[str, np.ndarray] = {"g711_ulaw": _ulaw_encode(_ALL_INT16), "g711_alaw": _alaw_encode(_ALL_INT16)}
"""Encode tables indexed by ``int16 + 32768``."""
_DECODE: dict[str, np.ndarray] = {
    "g711_ulaw": (_ulaw_decode(_ALL_BYTES) / 32768.0).astype(np.float32),
    "g711_alaw": (_alaw_decode(_ALL_BYTES) / 32768.0).astype(np.float32),
}
"""Decode tables: byte -> float32 in [-1, 1]."""


def _to_int16(pcm: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] -> int16 (rounded, clipped; NaN -> 0)."""
    x = np.nan_to_num(np.asarray(pcm, dtype=np.float32), nan=0.0, posinf=1.0, neginf=-1.0)
    return np.clip(np.rint(x * 32768.0), -32768, 32767).astype(np.int16)


def encode_samples(pcm: np.ndarray, fmt: AudioFormat) -> bytes:
    """float32 samples (already at the format's rate) -> wire bytes of ``fmt``."""
    ints = _to_int16(pcm)
    if fmt == "pcm16":
        return ints.astype("<i2").tobytes()
    return _ENCODE[fmt][ints.astype(np.int32) + 32768].tobytes()


def decode_samples(data: bytes, fmt: AudioFormat) -> np.ndarray:
    """Wire bytes of ``fmt`` (whole samples) -> float32 samples in [-1, 1] at the format's rate."""
    if fmt == "pcm16":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    return _DECODE[fmt][np.frombuffer(data, dtype=np.uint8)]


# ---------------------------------------------------------------------------------------------------- decimation


def lowpass_taps(rate: int, passband_hz: float, stopband_hz: float, attenuation_db: float) -> np.ndarray:
    """A linear-phase low-pass FIR filter: a windowed sinc cut off half-way between the band edges, with a Kaiser
    window whose ``beta`` and length follow Kaiser's design formulas (Oppenheim and Schafer, *Discrete-Time Signal
    Processing*, 3rd ed., section 7.6). Returns float32 taps (an odd number; unit gain at 0 Hz)."""
    a = attenuation_db
    beta = 0.1102 * (a - 8.7) if a > 50 else 0.5842 * (a - 21) ** 0.4 + 0.07886 * (a - 21) if a >= 21 else 0.0
    width = 2 * np.pi * (stopband_hz - passband_hz) / rate
    order = int(np.ceil((a - 8) / (2.285 * width)))
    order += order % 2  # even order: an odd length, a whole-sample delay of order / 2
    cutoff = (passband_hz + stopband_hz) / 2 / rate  # cycles per sample
    n = np.arange(order + 1) - order / 2
    taps = 2 * cutoff * np.sinc(2 * cutoff * n) * np.kaiser(order + 1, beta)
    return (taps / taps.sum()).astype(np.float32)


DECIMATE_TAPS = lowpass_taps(SAMPLE_RATE, 3400.0, 4600.0, 70.0)
"""24 -> 8 kHz anti-aliasing filter: passband to 3400 Hz (G.711's telephone band), 70 dB down from 4600 Hz (what
would fold below 3400 Hz at 8 kHz); 89 taps, a delay of 44 samples (1.8 ms)."""


class Decimator:
    """A stream at 24 kHz -> every third sample of it low-pass filtered (:data:`DECIMATE_TAPS`): 8 kHz, exactly one
    output sample per three input samples whatever the chunking (1920 in -> 640 out)."""

    def __init__(self, factor: int = 3, taps: np.ndarray = DECIMATE_TAPS) -> None:
        self.factor = factor
        self._taps = taps
        self._history = np.zeros(len(taps) - 1, dtype=np.float32)
        self._phase = 0
        """Index, in the next chunk, of the next sample kept."""

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        """float32 ``[n]`` at the input rate -> float32 ``[ceil((n - phase) / factor)]``."""
        buf = np.concatenate([self._history, np.asarray(pcm, dtype=np.float32).reshape(-1)])
        filtered = np.convolve(buf, self._taps, mode="valid")  # one value per input sample of this chunk
        out = filtered[self._phase :: self.factor]
        self._phase = (self._phase - (len(buf) - len(self._history))) % self.factor
        self._history = buf[len(buf) - len(self._history) :]
        return out.astype(np.float32, copy=False)


# ---------------------------------------------------------------------------------------------------- streams


class InputAudio:
    """The client's audio stream in one format -> float32 mono at 24 kHz.

    Args:
        fmt: the session's input format.

    Chunks may have any length: a byte left over from an odd-length ``pcm16`` chunk is kept for the next one.
    """

    def __init__(self, fmt: AudioFormat) -> None:
        import soxr

        self.format = fmt
        self._width = FORMAT_BYTES_PER_SAMPLE[fmt]
        self._carry = b""
        rate = FORMAT_RATES[fmt]
        self._resampler = (
            None
            if rate == SAMPLE_RATE
            else soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32", quality=RESAMPLE_QUALITY)
        )
        self.samples_in = 0
        """Samples received at the wire rate (for ``audio_start_ms`` style accounting)."""

    def decode(self, data: bytes) -> np.ndarray:
        """One chunk of wire bytes -> float32 ``[n]`` at 24 kHz (``n`` may be 0)."""
        data = self._carry + data
        whole = len(data) - len(data) % self._width
        self._carry = data[whole:]
        pcm = decode_samples(data[:whole], self.format)
        self.samples_in += len(pcm)
        if self._resampler is not None:
            pcm = self._resampler.resample_chunk(pcm)
        return np.asarray(pcm, dtype=np.float32)

    def clear(self) -> None:
        """Forget a partial sample (``input_audio_buffer.clear``)."""
        self._carry = b""


class OutputAudio:
    """The agent's float32 frames at 24 kHz -> wire bytes of one format (decimated to 8 kHz for G.711)."""

    def __init__(self, fmt: AudioFormat) -> None:
        self.format = fmt
        rate = FORMAT_RATES[fmt]
        self._decimate = None if rate == SAMPLE_RATE else Decimator(SAMPLE_RATE // rate)

    def encode(self, pcm: np.ndarray) -> bytes:
        """One agent frame float32 ``[1920]`` -> its 80 ms of bytes (3840 for pcm16, 640 for G.711)."""
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if self._decimate is not None:
            pcm = self._decimate(pcm)
        return encode_samples(pcm, self.format)


__all__ = [
    "DECIMATE_TAPS",
    "FORMAT_RATES",
    "GA_FORMATS",
    "GA_NAMES",
    "AudioFormat",
    "Decimator",
    "InputAudio",
    "OutputAudio",
    "decode_samples",
    "encode_samples",
    "lowpass_taps",
]
