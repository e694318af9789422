"""Voice activity on the user channel, and utterance segmentation at the 12.5 Hz frame clock.

:class:`SileroVAD` wraps the maintained Silero VAD model (``silero-vad`` package, its bundled TorchScript model):
each 80 ms frame at 24 kHz is resampled to 16 kHz with a streaming soxr resampler and cut into the 512-sample
windows the model takes (each with the 64 samples before it as context, as the package's own wrapper does); a frame
is voiced when any window in it scores at least ``threshold``. :func:`voice_probabilities` runs the frames of
several sessions in one pass: the model's convolutional front end (STFT and encoder) over all their windows in one
call, then its recurrent decoder once per window position, over the sessions that have one.

:class:`UtteranceTracker` turns voiced/unvoiced frames into utterances. The timing constants follow the original
Context Spanning runtime (``runtime/frame_stream.py``): an utterance starts at the first voiced frame, ends after
0.72 s (9 frames) without voice, needs at least 3 frames, is re-transcribed as a partial every 1.6 s (20 frames)
while it runs, and after a ``<ret>`` it is cut after 0.4 s (5 frames) of silence instead.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import soxr
import torch

from cspan.core.constants import SAMPLE_RATE

FINISHED_KEPT = 64
"""Finished utterances an :class:`UtteranceTracker` keeps (the latest; memory stays bounded over any duration)."""

VAD_RATE = 16_000
VAD_WINDOW = 512
VAD_CONTEXT = 64
"""Samples before each window that the 16 kHz model also sees (its wrapper's ``context_size_samples``)."""
_HIDDEN = 128
"""Size of the model's recurrent state (``[2, rows, 128]``: LSTM h and c)."""

_model_lock = threading.Lock()
_shared: torch.jit.ScriptModule | None = None


def _silero() -> torch.jit.ScriptModule:
    """The 16 kHz network of the bundled TorchScript model, loaded once per process and shared by every session:
    :func:`voice_probabilities` keeps each session's recurrent state and context itself and calls the network's
    ``stft``, ``encoder`` and ``decoder`` (the structure of silero-vad 5.1 to 6.x), which change nothing in it."""
    global _shared
    with _model_lock:
        if _shared is None:
            # Importing silero_vad calls torch.set_num_threads(1) as a side effect; keep the caller's setting.
            threads = torch.get_num_threads()
            try:
                from silero_vad import load_silero_vad
            finally:
                torch.set_num_threads(threads)
            network = load_silero_vad(onnx=False)._model
            missing = [name for name in ("stft", "encoder", "decoder") if not hasattr(network, name)]
            if missing:
                raise RuntimeError(
                    f"the installed silero-vad model has no {', '.join(missing)}: cspan.core.vad needs silero-vad "
                    "5.1 to 6.x (pip install 'silero-vad>=5.1,<7')"
                )
            _shared = network
        return _shared


class SileroVAD:
    """Streaming per-frame voice activity for one session.

    Args:
        threshold: speech probability at or above which a 32 ms window counts as speech.
        sample_rate: rate of the frames given to :meth:`__call__` (Hz).

    Call with one frame ``[S]`` float32 (normally 1920 samples at 24 kHz); returns the frame's speech
    probability (the max over the windows completed in it; 0.0 while the resampler is still filling). The model
    is shared by all sessions of the process; each detector holds its own state (resampler, context, recurrent
    state), so :func:`voice_probabilities` can run many sessions' frames in one pass.
    """

    def __init__(self, threshold: float = 0.5, sample_rate: int = SAMPLE_RATE) -> None:
        self.threshold = threshold
        self.sample_rate = sample_rate
        _silero()  # load (or fail) now, not at the first frame
        self.reset()

    def reset(self) -> None:
        """Forget all state (new conversation)."""
        self._resampler = soxr.ResampleStream(self.sample_rate, VAD_RATE, 1, dtype="float32")
        self._buffer = np.zeros(VAD_CONTEXT, dtype=np.float32)  # the context, then samples not in a window yet
        self._state = torch.zeros(2, 1, _HIDDEN)
        self.last_probability = 0.0

    def __call__(self, frame: np.ndarray) -> float:
        return voice_probabilities([self], [frame])[0]

    def is_voiced(self, frame: np.ndarray) -> bool:
        """``True`` when the frame contains speech."""
        return self(frame) >= self.threshold

    def _windows(self, frame: np.ndarray) -> list[np.ndarray]:
        """Resample ``frame`` and cut the completed windows, each ``[VAD_CONTEXT + VAD_WINDOW]`` with its context."""
        pcm16k = self._resampler.resample_chunk(np.asarray(frame, dtype=np.float32))
        buffer = np.concatenate([self._buffer, pcm16k])
        count = (len(buffer) - VAD_CONTEXT) // VAD_WINDOW
        windows = [buffer[k * VAD_WINDOW : (k + 1) * VAD_WINDOW + VAD_CONTEXT] for k in range(count)]
        self._buffer = buffer[count * VAD_WINDOW :]
        return windows


@torch.inference_mode()
def voice_probabilities(detectors: Sequence[SileroVAD], frames: Sequence[np.ndarray]) -> list[float]:
    """The next frame of several sessions in one pass: ``frames[i]`` continues ``detectors[i]``'s stream.

    Each detector's probability is what its own ``detector(frames[i])`` returns (and is kept in its
    ``last_probability``): the max over its completed windows, 0.0 when none completed. Batching only regroups the
    same network calls (the front end over all windows at once, the recurrent decoder over the sessions at each
    window position), so a probability moves from the one-window-at-a-time result by float rounding at most.

    Raises:
        ValueError: ``detectors`` and ``frames`` differ in length, or a detector appears twice.
    """
    if len(detectors) != len(frames):
        raise ValueError(f"voice_probabilities: {len(detectors)} detectors for {len(frames)} frames")
    if len({id(d) for d in detectors}) != len(detectors):
        raise ValueError("voice_probabilities: a detector appears twice; give each session's frames in turn")
    windows = [d._windows(f) for d, f in zip(detectors, frames, strict=True)]
    probabilities = [0.0] * len(detectors)
    rounds = max((len(w) for w in windows), default=0)
    if rounds:
        network = _silero()
        rows = [w for ws in windows for w in ws]
        features = network.encoder(network.stft(torch.from_numpy(np.stack(rows))))  # [windows, 128, 1]
        first = np.cumsum([0] + [len(w) for w in windows])  # row of each session's first window
        owners: list[int] = []
        scores: list[torch.Tensor] = []
        for r in range(rounds):
            sessions = [i for i, w in enumerate(windows) if len(w) > r]
            if len(sessions) == 1:  # one session (the usual case for one conversation): no gathering
                row = int(first[sessions[0]]) + r
                out, state = network.decoder(features[row : row + 1], detectors[sessions[0]]._state)
            else:
                state = torch.cat([detectors[i]._state for i in sessions], dim=1)
                out, state = network.decoder(features[[int(first[i]) + r for i in sessions]], state)
            for j, i in enumerate(sessions):
                detectors[i]._state = state[:, j : j + 1]
            owners += sessions
            scores.append(out.squeeze(1).mean(1))
        for i, score in zip(owners, torch.cat(scores).tolist(), strict=True):
            probabilities[i] = max(probabilities[i], score)
    for detector, probability in zip(detectors, probabilities, strict=True):
        detector.last_probability = probability
    return probabilities


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
    """What :meth:`UtteranceTracker.update` reports for a frame: ``kind`` is ``started``, ``partial``, ``ended``, or
    ``dropped`` (it ended shorter than ``min_frames``: not an utterance)."""

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
    finished: collections.deque[Utterance] = field(default_factory=lambda: collections.deque(maxlen=FINISHED_KEPT))
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
            else:
                events.append(UtteranceEvent("dropped", utt))  # too short to be speech
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


__all__ = ["FINISHED_KEPT", "SileroVAD", "Utterance", "UtteranceEvent", "UtteranceTracker", "voice_probabilities"]
