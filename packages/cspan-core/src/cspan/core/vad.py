"""Voice activity on the user channel, and utterance segmentation at the 12.5 Hz frame clock.

:class:`SileroVAD` wraps the maintained Silero VAD model (``silero-vad`` package, its bundled TorchScript model):
each 80 ms frame at 24 kHz is resampled to 16 kHz with a streaming soxr resampler and cut into the 512-sample
windows the model takes; a frame is voiced when any window in it scores at least ``threshold``.

:class:`UtteranceTracker` turns voiced/unvoiced frames into utterances. The timing constants follow the original
Context Spanning runtime (``runtime/frame_stream.py``): an utterance starts at the first voiced frame, ends after
0.72 s (9 frames) without voice, needs at least 3 frames, is re-transcribed as a partial every 1.6 s (20 frames)
while it runs, and after a ``<ret>`` it is cut after 0.4 s (5 frames) of silence instead.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import soxr
import torch

from cspan.core.constants import SAMPLE_RATE

VAD_RATE = 16_000
VAD_WINDOW = 512

_model_lock = threading.Lock()


def _load_silero() -> torch.jit.ScriptModule:
    # Importing silero_vad calls torch.set_num_threads(1) as a side effect; keep the caller's setting.
    threads = torch.get_num_threads()
    try:
        from silero_vad import load_silero_vad
    finally:
        torch.set_num_threads(threads)
    with _model_lock:
        return load_silero_vad(onnx=False)


class SileroVAD:
    """Streaming per-frame voice activity for one session.

    Args:
        threshold: speech probability at or above which a 32 ms window counts as speech.
        sample_rate: rate of the frames given to :meth:`__call__` (Hz).

    Call with one frame ``[S]`` float32 (normally 1920 samples at 24 kHz); returns the frame's speech
    probability (the max over the windows completed in it; 0.0 while the resampler is still filling).
    """

    def __init__(self, threshold: float = 0.5, sample_rate: int = SAMPLE_RATE) -> None:
        self.threshold = threshold
        self.sample_rate = sample_rate
        self._model = _load_silero()
        self.reset()

    def reset(self) -> None:
        """Forget all state (new conversation)."""
        self._model.reset_states()
        self._resampler = soxr.ResampleStream(self.sample_rate, VAD_RATE, 1, dtype="float32")
        self._buffer = np.zeros(0, dtype=np.float32)
        self.last_probability = 0.0

    @torch.inference_mode()
    def __call__(self, frame: np.ndarray) -> float:
        pcm16k = self._resampler.resample_chunk(np.asarray(frame, dtype=np.float32))
        self._buffer = np.concatenate([self._buffer, pcm16k])
        prob = 0.0
        while len(self._buffer) >= VAD_WINDOW:
            window = torch.from_numpy(self._buffer[:VAD_WINDOW].copy())
            self._buffer = self._buffer[VAD_WINDOW:]
            prob = max(prob, float(self._model(window, VAD_RATE)))
        self.last_probability = prob
        return prob

    def is_voiced(self, frame: np.ndarray) -> bool:
        """``True`` when the frame contains speech."""
        return self(frame) >= self.threshold


@dataclass
class Utterance:
    """A stretch of user speech in frame indices (``end`` exclusive; ``None`` while running)."""

    index: int
    start: int
    end: int | None = None
    last_voiced: int = 0
    partial_requested_at: int = 0
    cut_requested: bool = False

    @property
    def running(self) -> bool:
        return self.end is None


@dataclass
class UtteranceEvent:
    """What :meth:`UtteranceTracker.update` reports for a frame: ``kind`` is ``started``, ``partial`` or ``ended``."""

    kind: str
    utterance: Utterance


@dataclass
class UtteranceTracker:
    """Frame-clock utterance segmentation (constants in frames of 80 ms; see the module docstring)."""

    end_silence_frames: int = 9
    cut_silence_frames: int = 5
    min_frames: int = 3
    partial_every_frames: int = 20
    current: Utterance | None = None
    finished: list[Utterance] = field(default_factory=list)
    _count: int = 0

    def update(self, frame_index: int, voiced: bool) -> list[UtteranceEvent]:
        """Advance by one frame; returns the events that happen at ``frame_index``."""
        events: list[UtteranceEvent] = []
        utt = self.current
        if utt is None:
            if voiced:
                utt = Utterance(index=self._count, start=frame_index, last_voiced=frame_index)
                utt.partial_requested_at = frame_index
                self._count += 1
                self.current = utt
                events.append(UtteranceEvent("started", utt))
            return events
        if voiced:
            utt.last_voiced = frame_index
        silence = frame_index - utt.last_voiced
        limit = self.cut_silence_frames if utt.cut_requested else self.end_silence_frames
        if silence >= limit:
            utt.end = utt.last_voiced + 1
            self.current = None
            if utt.end - utt.start >= self.min_frames:
                self.finished.append(utt)
                events.append(UtteranceEvent("ended", utt))
            return events
        if frame_index - utt.partial_requested_at >= self.partial_every_frames:
            utt.partial_requested_at = frame_index
            events.append(UtteranceEvent("partial", utt))
        return events

    def request_cut(self) -> None:
        """After a ``<ret>``: end the running utterance after the shorter silence (0.4 s by default)."""
        if self.current is not None:
            self.current.cut_requested = True

    def reset(self) -> None:
        self.current = None
        self.finished.clear()
        self._count = 0


__all__ = ["SileroVAD", "Utterance", "UtteranceEvent", "UtteranceTracker"]
