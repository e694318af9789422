"""Full-Duplex-Bench v1 scorers: pause handling, backchannel, smooth turn-taking, user interruption.

The rules reproduce the benchmark's reference scorers (``DanielLin94144/Full-Duplex-Bench``, ``v1_v1.5/evaluation/``
``eval_pause_handling.py``, ``eval_backchannel.py``, ``eval_smooth_turn_taking.py``, ``eval_user_interruption.py``;
paper: Lin et al., "Full-Duplex-Bench", arXiv 2503.04721, section 3), as written out in
``docs/reference/benchmarks.md`` section 1. Every quirk that changes a number is kept, for example: a take-over needs
four words or a one-second span; the backchannel TOR is decided by the *last* short VAD segment and a segment over
3 s stops the scan; the Jensen-Shannon value is the *distance* (square root of the divergence); latencies are
averaged over TOR = 1 samples only, negatives clipped to 0.

The module has two layers:

- pure functions over parsed inputs (:func:`take_turn`, :func:`score_turn_taking`, :func:`score_backchannel`,
  :func:`backchannel_jsd`, ...) that tests can feed by hand;
- folder readers and :func:`score_task`, which walk one task folder of the benchmark's dataset layout
  (``{task}/{ID}/output.wav``, ``output.json``, ``turn_taking.json`` / ``interrupt.json``) and return per-sample
  scores plus a :class:`TaskSummary` (what ``summary.json`` holds).

Deliberate differences from the reference, none of which changes a number it produces: a missing ``output.json``
is an error (the reference keeps a stale backchannel TOR); the judge is retried a bounded number of times instead of
forever; a word without an end time falls back to its start in every task (the reference does so in pause handling
and crashes elsewhere); sample folders are the immediate sub-folders of a task folder (the interruption reference
walks all sub-folders recursively, which only matters for nested layouts it would reject anyway).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cspan.bench.errors import BenchDataError, BenchSettingsError, JudgeError

# --- constants of the reference scorers ----------------------------------------------------------------------------

TURN_DURATION_THRESHOLD_S = 1.0
"""A response spanning at least this long (last word end - first word start, seconds) is a take-over."""
TURN_NUM_WORDS_THRESHOLD = 3
"""A response with more than this many words is a take-over."""
BC_WINDOW_S = 0.2
"""Backchannel histogram bin width, seconds."""
BC_EPSILON = 1e-10
"""Added to every histogram bin before normalising."""
BC_LONG_SEGMENT_S = 3.0
"""A VAD segment longer than this (seconds) is a take-over and stops the backchannel scan."""

OUTPUT_JSON = "output.json"
OUTPUT_WAV = "output.wav"
INPUT_WAV = "input.wav"
TURN_TAKING_JSON = "turn_taking.json"
INTERRUPT_JSON = "interrupt.json"
RATING_JSON = "rating.json"
ICC_GT_JSON = "icc_gt_distribution.json"


class TaskKind(StrEnum):
    """The four v1 scorers. Dataset folders map onto them by name (see :func:`infer_task_kind`)."""

    PAUSE_HANDLING = "pause_handling"
    BACKCHANNEL = "backchannel"
    TURN_TAKING = "turn_taking"
    USER_INTERRUPTION = "user_interruption"


def infer_task_kind(folder_name: str) -> TaskKind | None:
    """Map a dataset folder name to its scorer, or ``None`` when the name says nothing.

    ``candor_pause_handling`` / ``synthetic_pause_handling`` -> pause handling, ``icc_backchannel`` -> backchannel,
    ``candor_turn_taking`` -> turn-taking, ``synthetic_user_interruption`` -> user interruption (the fixture names
    ``*_example`` map the same way).
    """
    name = folder_name.lower()
    if "backchannel" in name:
        return TaskKind.BACKCHANNEL
    if "turn_taking" in name or "turn-taking" in name:
        return TaskKind.TURN_TAKING
    if "interruption" in name:
        return TaskKind.USER_INTERRUPTION
    if "pause" in name:
        return TaskKind.PAUSE_HANDLING
    return None


def parse_task_spec(spec: str) -> tuple[str, TaskKind]:
    """``(name, kind)`` of a ``--tasks`` entry, ``NAME`` (the scorer told by :func:`infer_task_kind`) or
    ``NAME=KIND`` (KIND one of pause_handling, backchannel, turn_taking, user_interruption).

    Raises:
        BenchSettingsError: an unknown KIND, or a NAME that tells no task without one (exit status 2).
    """
    name, _, kind_name = spec.partition("=")
    try:
        kind = TaskKind(kind_name) if kind_name else infer_task_kind(name)
    except ValueError as exc:
        choices = ", ".join(k.value for k in TaskKind)
        raise BenchSettingsError(f"--tasks {spec!r}: unknown scorer {kind_name!r}; use one of {choices}") from exc
    if kind is None:
        raise BenchSettingsError(f"--tasks {name!r}: cannot tell the task from the name; write {name}=KIND")
    return name, kind


# --- the output.json transcript ------------------------------------------------------------------------------------


class Chunk(BaseModel):
    """One word of ``output.json``: ``{"text": word, "timestamp": [start_s, end_s]}``; either time may be null."""

    model_config = ConfigDict(extra="allow")

    text: str
    timestamp: tuple[float | None, float | None]

    @property
    def start(self) -> float | None:
        """Start of the word, seconds on the output's timeline (``None`` when the ASR gave none)."""
        return self.timestamp[0]

    @property
    def end(self) -> float | None:
        """End of the word, seconds (``None`` when the ASR gave none)."""
        return self.timestamp[1]


class OutputTranscript(BaseModel):
    """The benchmark's ``output.json``: ``text`` (space-joined words) and ``chunks`` (words in time order)."""

    model_config = ConfigDict(extra="allow")

    text: str = ""
    chunks: list[Chunk] = Field(default_factory=list)


# --- the shared take-over decision ---------------------------------------------------------------------------------


def _first_start(chunks: Sequence[Chunk]) -> float:
    start = chunks[0].start
    if start is None:
        raise BenchDataError(
            f"the first word {chunks[0].text!r} of the response has no start time; re-run the transcription with "
            "word timestamps"
        )
    return float(start)


def response_span_s(chunks: Sequence[Chunk]) -> float:
    """``last.end - first.start`` in seconds (``last.start`` when the last word has no end). ``chunks`` non-empty.

    Raises:
        BenchDataError: the first word has no start time (or the last word has neither time).
    """
    first = _first_start(chunks)
    last = chunks[-1].end if chunks[-1].end is not None else chunks[-1].start
    if last is None:
        raise BenchDataError(f"the last word {chunks[-1].text!r} of the response has no time at all")
    return float(last) - first


def take_turn(chunks: Sequence[Chunk]) -> int:
    """The take-over (TOR) decision shared by pause handling, turn-taking and user interruption.

    No words -> 0. Otherwise 0 only when the span (:func:`response_span_s`) is under
    :data:`TURN_DURATION_THRESHOLD_S` **and** there are at most :data:`TURN_NUM_WORDS_THRESHOLD` words; 1 in every
    other case (equivalently: 1 iff span >= 1 s or >= 4 words). Source: the reference scorers' shared block
    (``turn_duration_threshold = 1``, ``turn_num_words_threshold = 3``).
    """
    if not chunks:
        return 0
    if response_span_s(chunks) < TURN_DURATION_THRESHOLD_S and len(chunks) <= TURN_NUM_WORDS_THRESHOLD:
        return 0
    return 1


def response_latency_s(chunks: Sequence[Chunk], reference_time_s: float) -> float:
    """``first_word.start - reference_time_s`` clipped below at 0 (seconds). ``chunks`` must be non-empty."""
    latency = _first_start(chunks) - reference_time_s
    return latency if latency >= 0 else 0.0


# --- per-sample scores ---------------------------------------------------------------------------------------------


class PauseSample(BaseModel):
    """Pause handling, one sample: TOR on the whole response (lower is better)."""

    id: str
    tor: int
    n_words: int


class TurnTakingSample(BaseModel):
    """Smooth turn-taking, one sample: TOR (higher is better) and, when TOR = 1, the latency in seconds."""

    id: str
    tor: int
    latency_s: float | None
    turn_end_s: float


class InterruptionSample(BaseModel):
    """User interruption, one sample: TOR and latency on the post-interruption words, and the judge's 0-5 rating."""

    id: str
    tor: int
    latency_s: float | None
    interrupt_end_s: float
    rating: int | None = None
    analysis: str | None = None
    judge_failed: bool = False
    """The judge was asked for the rating and failed (a request error, or no readable reply): no rating, and it is
    asked again on the next run with a judge."""


class BackchannelSample(BaseModel):
    """Backchannel, one sample.

    ``predictions`` are the VAD segments ``(start_s, end_s)`` counted as backchannels, ``frequency`` is their
    number per second of output, ``jsd`` the Jensen-Shannon distance of their timing histogram to the ground truth.
    """

    id: str
    tor: int
    frequency: float
    jsd: float
    predictions: list[tuple[float, float]]
    n_segments: int
    duration_s: float


def score_pause(sample_id: str, output: OutputTranscript) -> PauseSample:
    """Pause handling on one sample: TOR over the **whole** ``output.json`` (the pause window is not used)."""
    return PauseSample(id=sample_id, tor=take_turn(output.chunks), n_words=len(output.chunks))


def score_turn_taking(sample_id: str, output: OutputTranscript, turn_end_s: float) -> TurnTakingSample:
    """Smooth turn-taking on one sample.

    Args:
        output: the whole response transcript.
        turn_end_s: end of the user's last word (``turn_taking.json`` ``[0]["timestamp"][0]``), seconds.

    Returns TOR and, when TOR = 1, ``latency = max(0, first_word.start - turn_end_s)``.
    """
    tor = take_turn(output.chunks)
    latency = response_latency_s(output.chunks, turn_end_s) if tor == 1 else None
    return TurnTakingSample(id=sample_id, tor=tor, latency_s=latency, turn_end_s=turn_end_s)


def score_interruption(sample_id: str, output: OutputTranscript, interrupt_end_s: float) -> InterruptionSample:
    """User interruption on one sample (TOR and latency; the rating is added by :func:`score_task`).

    Args:
        output: the transcript of the output **after** the interruption (``output.json`` written with the crop-and-
            offset rule of :mod:`cspan.bench.transcribe`: words only from ``interrupt_end_s`` on, absolute times).
        interrupt_end_s: end of the user's interrupting utterance (``interrupt.json`` ``[0]["timestamp"][1]``).
    """
    tor = take_turn(output.chunks)
    latency = response_latency_s(output.chunks, interrupt_end_s) if tor == 1 else None
    return InterruptionSample(id=sample_id, tor=tor, latency_s=latency, interrupt_end_s=interrupt_end_s)


# --- backchannel ---------------------------------------------------------------------------------------------------


def words_in_segment(chunks: Sequence[Chunk], seg_start_s: float, seg_end_s: float) -> list[str]:
    """The words of ``chunks`` that overlap the VAD segment ``[seg_start_s, seg_end_s]`` (reference rule).

    A word ``[ts, te]`` is taken when it lies inside the segment (``ts >= start and te <= end``), straddles its end
    (``ts <= end and te > end``) or straddles its start (``ts <= start and te > start``). Words without a start are
    skipped; a word without an end is skipped when ``ts < end`` and otherwise treated as ``te = ts`` (as
    ``eval_backchannel.py`` does).
    """
    taken: list[str] = []
    for chunk in chunks:
        ts, te = chunk.start, chunk.end
        if ts is None or (te is None and ts < seg_end_s):
            continue
        if te is None:
            te = ts
        if (
            (ts >= seg_start_s and te <= seg_end_s)
            or (ts <= seg_end_s and te > seg_end_s)
            or (ts <= seg_start_s and te > seg_start_s)
        ):
            taken.append(chunk.text)
    return taken


def segment_take_turn(n_words: int, duration_s: float) -> int:
    """Backchannel TOR of one short (<= 3 s) VAD segment: more than 3 words -> 1; under 1 s -> 1 iff more than 2
    words; 1-3 s -> 1."""
    if n_words > 3:
        return 1
    if duration_s < 1:
        return 0 if n_words <= 2 else 1
    return 1


def backchannel_histogram(predictions: Iterable[tuple[float, float]], duration_s: float) -> np.ndarray:
    """The normalised timing histogram of predicted backchannels, float64 ``[int(duration_s / 0.2) + 1]``.

    Each interval adds 1 to every bin from ``int(start / 0.2)`` to ``int(end / 0.2)`` inclusive (bins past the
    end are ignored); indices use IEEE double division then truncation, so ``0.6 / 0.2`` lands in bin 2. Then
    :data:`BC_EPSILON` is added to every bin and the histogram is normalised to sum 1.
    """
    n_bins = int(duration_s / BC_WINDOW_S) + 1
    hist = np.zeros(n_bins, dtype=np.float64)
    for start, end in predictions:
        first, last = int(start / BC_WINDOW_S), int(end / BC_WINDOW_S)
        for i in range(first, last + 1):
            if 0 <= i < n_bins:
                hist[i] += 1
    hist = hist + BC_EPSILON
    return hist / np.sum(hist)


def resize_distribution(values: Sequence[float], n: int) -> np.ndarray:
    """Linearly re-sample ``values`` (placed on ``linspace(0, 1, len(values))``) onto ``linspace(0, 1, n)``.

    The result is **not** renormalised (the reference feeds it as is to the distance, which normalises internally).
    Both grids span exactly [0, 1], so the reference's extrapolating ``scipy.interpolate.interp1d`` never
    extrapolates and equals :func:`numpy.interp`. Returns float64 ``[n]``.
    """
    src = np.asarray(values, dtype=np.float64)
    if src.ndim != 1 or src.size == 0:
        raise ValueError(f"expected a non-empty 1-D distribution, got shape {src.shape}")
    if src.size == 1:
        return np.full(n, src[0], dtype=np.float64)
    return np.interp(np.linspace(0.0, 1.0, n), np.linspace(0.0, 1.0, src.size), src)


def jensen_shannon_distance(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon **distance** (natural log): ``sqrt((KL(p||m) + KL(q||m)) / 2)``, ``m = (p + q) / 2``.

    ``p`` and ``q`` (float ``[N]``, non-negative) are normalised to sum 1 first; ``0 * log 0`` counts as 0.
    Same definition as ``scipy.spatial.distance.jensenshannon`` (base e), which the reference calls.
    """
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if p.shape != q.shape:
        raise ValueError(f"distributions differ in shape: {p.shape} vs {q.shape}")
    p = p / np.sum(p)
    q = q / np.sum(q)
    m = (p + q) / 2.0

    def _kl(a: np.ndarray) -> float:
        mask = a > 0
        return float(np.sum(a[mask] * np.log(a[mask] / m[mask])))

    js = (_kl(p) + _kl(q)) / 2.0
    return math.sqrt(max(js, 0.0))


def backchannel_jsd(
    predictions: Sequence[tuple[float, float]], duration_s: float, gt_distribution: Sequence[float]
) -> float:
    """JS distance between the predicted backchannel timing and the annotated one; 1.0 when nothing was predicted.

    Args:
        predictions: counted backchannel segments ``(start_s, end_s)``.
        duration_s: true length of ``output.wav`` in seconds (sets the number of 0.2 s bins).
        gt_distribution: this sample's list from ``icc_gt_distribution.json`` (any length; resized, not renormalised).
    """
    if not predictions:
        return 1.0
    hist = backchannel_histogram(predictions, duration_s)
    return jensen_shannon_distance(hist, resize_distribution(gt_distribution, hist.size))


def score_backchannel(
    sample_id: str,
    segments: Sequence[tuple[float, float]],
    output: OutputTranscript,
    duration_s: float,
    gt_distribution: Sequence[float],
) -> BackchannelSample:
    """Backchannel on one sample, from its VAD speech segments and its word transcript.

    Args:
        segments: Silero VAD speech segments ``(start_s, end_s)`` of ``output.wav`` in time order (rounded to
            0.1 s, as :func:`cspan.bench.vad.speech_segments` returns them).
        output: the whole response transcript (``output.json``).
        duration_s: true length of ``output.wav`` in seconds.
        gt_distribution: this sample's ground-truth list from ``icc_gt_distribution.json``.

    Rules (``eval_backchannel.py``): scan the segments in order with TOR = 0; a segment longer than 3 s sets TOR = 1
    and **stops** the scan (it is not counted); any other segment sets TOR from its own words and length
    (:func:`segment_take_turn`) -- **the last scanned segment wins** -- and is **always** counted as a predicted
    backchannel. Frequency = predictions / ``duration_s``; JSD per :func:`backchannel_jsd`.
    """
    tor = 0
    predictions: list[tuple[float, float]] = []
    for start, end in segments:
        seg_duration = end - start
        if seg_duration > BC_LONG_SEGMENT_S:
            tor = 1
            break
        words = words_in_segment(output.chunks, start, end)
        tor = segment_take_turn(len(words), seg_duration)
        predictions.append((float(start), float(end)))
    if duration_s <= 0:
        raise BenchDataError(f"sample {sample_id}: output audio has no samples")
    return BackchannelSample(
        id=sample_id,
        tor=tor,
        frequency=len(predictions) / duration_s,
        jsd=backchannel_jsd(predictions, duration_s, gt_distribution),
        predictions=predictions,
        n_segments=len(segments),
        duration_s=duration_s,
    )


# --- task summaries ------------------------------------------------------------------------------------------------


class TaskSummary(BaseModel):
    """What ``summary.json`` holds for one scored task folder.

    ``metrics`` keys by kind (``None`` = not computable, see ``notes``):

    - pause handling: ``tor`` (lower is better);
    - turn-taking: ``tor``, ``latency_s`` (mean over TOR = 1 samples);
    - backchannel: ``jsd``, ``tor``, ``frequency`` (means) and ``jsd_std``, ``tor_std``, ``frequency_std``
      (population standard deviations);
    - user interruption: ``tor``, ``latency_s``, ``rating`` (mean 0-5 judge rating over rated TOR = 1 samples).
    """

    benchmark: str = "fdb-v1"
    task: str
    kind: TaskKind
    n: int
    metrics: dict[str, float | None]
    counts: dict[str, int] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)
    config: dict[str, Any] = Field(default_factory=dict)


METRIC_DIRECTIONS: dict[TaskKind, dict[str, str]] = {
    TaskKind.PAUSE_HANDLING: {"tor": "down"},
    TaskKind.BACKCHANNEL: {"tor": "down", "frequency": "up", "jsd": "down"},
    TaskKind.TURN_TAKING: {"tor": "up", "latency_s": "down"},
    TaskKind.USER_INTERRUPTION: {"tor": "up", "rating": "up", "latency_s": "down"},
}
"""Which way is better for each headline metric (``"up"`` or ``"down"``), as the benchmark's tables mark them."""


def _mean(values: Sequence[float]) -> float | None:
    # Plain left-to-right summation divided by the count, as the reference prints it (not numpy's pairwise sum).
    return sum(values) / len(values) if values else None


def summarize_pause(task: str, samples: Sequence[PauseSample]) -> TaskSummary:
    """Mean TOR over the samples."""
    notes = [] if samples else ["no samples"]
    return TaskSummary(
        task=task,
        kind=TaskKind.PAUSE_HANDLING,
        n=len(samples),
        metrics={"tor": _mean([s.tor for s in samples])},
        notes=notes,
    )


def summarize_turn_taking(task: str, samples: Sequence[TurnTakingSample]) -> TaskSummary:
    """Mean TOR over all samples; mean latency over TOR = 1 samples (``None`` when no sample took the turn)."""
    latencies = [s.latency_s for s in samples if s.tor == 1 and s.latency_s is not None]
    notes = [] if latencies else ["no sample took the turn: latency undefined"]
    return TaskSummary(
        task=task,
        kind=TaskKind.TURN_TAKING,
        n=len(samples),
        metrics={"tor": _mean([s.tor for s in samples]), "latency_s": _mean(latencies)},
        counts={"took_turn": len(latencies)},
        notes=notes,
    )


def summarize_interruption(task: str, samples: Sequence[InterruptionSample], notes: Sequence[str] = ()) -> TaskSummary:
    """Mean TOR over all samples; mean latency and mean rating over TOR = 1 samples (rating over rated ones)."""
    took = [s for s in samples if s.tor == 1]
    latencies = [s.latency_s for s in took if s.latency_s is not None]
    ratings = [s.rating for s in took if s.rating is not None]
    return TaskSummary(
        task=task,
        kind=TaskKind.USER_INTERRUPTION,
        n=len(samples),
        metrics={
            "tor": _mean([s.tor for s in samples]),
            "latency_s": _mean(latencies),
            "rating": _mean([float(r) for r in ratings]),
        },
        counts={"took_turn": len(took), "rated": len(ratings)},
        notes=list(notes),
    )


def summarize_backchannel(task: str, samples: Sequence[BackchannelSample]) -> TaskSummary:
    """Mean and population standard deviation (numpy defaults) of JSD, TOR and frequency."""
    metrics: dict[str, float | None] = {}
    for key in ("jsd", "tor", "frequency"):
        values = np.asarray([getattr(s, key) for s in samples], dtype=np.float64)
        metrics[key] = float(np.mean(values)) if values.size else None
        metrics[f"{key}_std"] = float(np.std(values)) if values.size else None
    return TaskSummary(
        task=task,
        kind=TaskKind.BACKCHANNEL,
        n=len(samples),
        metrics=metrics,
        counts={"predictions": sum(len(s.predictions) for s in samples)},
    )


# --- readers -------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise BenchDataError(f"{path} is missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BenchDataError(f"{path} is not readable JSON ({exc})") from exc


def read_output_json(path: Path) -> OutputTranscript:
    """Read an ``output.json`` (``{text, chunks}``). Raises :class:`BenchDataError` naming the file and the fix."""
    data = _read_json(path)
    try:
        return OutputTranscript.model_validate(data)
    except ValidationError as exc:
        raise BenchDataError(
            f"{path} is not in the benchmark's output.json format {{text, chunks: [{{text, timestamp}}]}}: {exc}; "
            "delete it and score again to re-transcribe output.wav"
        ) from exc


def _first_timestamp(path: Path) -> tuple[dict[str, Any], list[Any]]:
    data = _read_json(path)
    try:
        entry = data[0]
        stamp = list(entry["timestamp"])
        if len(stamp) != 2:
            raise ValueError("timestamp must be [start, end]")
        return entry, stamp
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise BenchDataError(
            f"{path}: expected a JSON list whose first object has 'timestamp': [start, end] ({exc})"
        ) from exc


def read_turn_end(path: Path) -> float:
    """``turn_taking.json`` -> the user's turn end in seconds (``[0]["timestamp"][0]``, the only value used)."""
    _, stamp = _first_timestamp(path)
    return float(stamp[0])


class InterruptInfo(BaseModel):
    """``interrupt.json``: the user's first turn (``context``), the interrupting utterance and its times (s)."""

    context: str
    interrupt: str
    start_s: float
    end_s: float


def read_interrupt(path: Path) -> InterruptInfo:
    """Read ``interrupt.json`` (``[{context, interrupt, timestamp: [start, end]}]``)."""
    entry, stamp = _first_timestamp(path)
    try:
        return InterruptInfo(
            context=str(entry["context"]),
            interrupt=str(entry["interrupt"]),
            start_s=float(stamp[0]),
            end_s=float(stamp[1]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BenchDataError(f"{path}: needs 'context', 'interrupt' and a numeric 'timestamp' ({exc})") from exc


def load_icc_gt(path: Path) -> dict[str, list[float]]:
    """Read ``icc_gt_distribution.json``: ``{"0": [floats...], ..., "54": [...]}`` (one distribution per sample ID)."""
    data = _read_json(path)
    if isinstance(data, dict) and all(isinstance(v, list) for v in data.values()):
        try:
            gt = {str(k): [float(x) for x in v] for k, v in data.items()}
            if all(math.isfinite(x) for v in gt.values() for x in v):
                return gt
        except (TypeError, ValueError):  # an item that is not a number
            pass
    raise BenchDataError(f"{path}: expected an object mapping sample IDs to lists of finite numbers")


def _sort_key(name: str) -> tuple[int, int, str]:
    return (0, int(name), name) if name.isdigit() else (1, 0, name)


def sample_dirs(task_dir: Path, kind: TaskKind) -> list[Path]:
    """The sample folders of a task folder, in ID order.

    Hidden folders are skipped; for backchannel only all-digit names count (they key the ground-truth file), as in
    the reference. Other folders count when they hold an ``output.wav`` or an ``output.json``.
    """
    if not task_dir.is_dir():
        raise BenchDataError(f"task folder {task_dir} does not exist")
    found = []
    for entry in task_dir.iterdir():
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        if kind is TaskKind.BACKCHANNEL:
            if entry.name.isdigit():
                found.append(entry)
        elif (entry / OUTPUT_WAV).is_file() or (entry / OUTPUT_JSON).is_file():
            found.append(entry)
    return sorted(found, key=lambda p: _sort_key(p.name))


# --- scoring a task folder -----------------------------------------------------------------------------------------


class InterruptionJudge(Protocol):
    """What :func:`score_task` needs from a judge: a 0-5 rating with its analysis (see :mod:`cspan.bench.judge`)."""

    def rate_interruption(self, context: str, interrupt: str, response: str) -> Any:
        """Return an object with ``rating: int`` and ``analysis: str``."""
        ...


SegmentFn = Callable[[np.ndarray, int], list[tuple[float, float]]]
"""``(pcm float32 [S], sample_rate Hz) -> [(start_s, end_s), ...]`` speech segments (default: Silero VAD)."""


@dataclass
class TaskScore:
    """One scored task folder: its summary and the per-sample scores (one model per sample folder, in ID order)."""

    summary: TaskSummary
    samples: list[PauseSample] | list[TurnTakingSample] | list[BackchannelSample] | list[InterruptionSample]


def _read_wav_mono(path: Path) -> tuple[np.ndarray, int]:
    import soundfile as sf

    if not path.is_file():
        raise BenchDataError(f"{path} is missing; every backchannel sample needs the model's output.wav")
    try:
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.SoundFileError, RuntimeError) as exc:
        raise BenchDataError(f"{path} is not a readable audio file ({exc})") from exc
    pcm = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]
    return np.ascontiguousarray(pcm), int(sr)


def score_task(
    task_dir: Path,
    kind: TaskKind,
    *,
    task: str | None = None,
    icc_gt: Mapping[str, Sequence[float]] | None = None,
    segment_fn: SegmentFn | None = None,
    judge: InterruptionJudge | None = None,
    reuse_ratings: bool = False,
    write_ratings: bool = True,
    samples: Sequence[Path] | None = None,
) -> TaskScore:
    """Score every sample folder of one task folder whose ``output.json`` files already exist.

    Args:
        task_dir: ``{root}/{task}`` holding ``{ID}/`` sample folders.
        kind: which scorer to run.
        task: the name recorded in the summary (default: the folder name).
        icc_gt: backchannel only: the ground-truth distributions (:func:`load_icc_gt`); required for backchannel.
        segment_fn: backchannel only: speech segmenter; default :func:`cspan.bench.vad.speech_segments` (Silero).
        judge: user interruption only: rates TOR = 1 samples; ``None`` skips the rating with a note.
        reuse_ratings: user interruption only: take an existing ``rating.json`` instead of asking the judge (the
            only way to get ratings without a judge).
        write_ratings: write each new rating to ``{ID}/rating.json`` (``{analysis, rating}``), as the reference does.
        samples: score only these sample folders (in this order), e.g. those a run just rendered; default
            :func:`sample_dirs`, with a note naming the folders that hold an ``input.wav`` but no output (a run cut
            short; not for backchannel, whose samples need their ``output.wav``): they are not scored.

    Raises:
        BenchDataError: a folder or file is missing or malformed (named in the message).

    A rating the judge failed to give (:class:`~cspan.bench.errors.JudgeError`) is recorded as ``judge_failed`` on
    the sample and in the summary's notes; the other samples are still scored.
    """
    name = task or task_dir.name
    dirs = sample_dirs(task_dir, kind) if samples is None else list(samples)
    score = _score_dirs(name, kind, dirs, task_dir, icc_gt, segment_fn, judge, reuse_ratings, write_ratings)
    if samples is None and kind is not TaskKind.BACKCHANNEL:  # backchannel: a sample without output.wav is an error
        unrendered = unrendered_dirs(task_dir, dirs)
        if unrendered:
            ids = ", ".join(d.name for d in unrendered[:10]) + (" ..." if len(unrendered) > 10 else "")
            score.summary.notes.append(
                f"{len(unrendered)} sample folder(s) with an {INPUT_WAV} but no {OUTPUT_WAV} or {OUTPUT_JSON} not "
                f"scored (a run cut short? run it again): {ids}"
            )
    return score


def unrendered_dirs(task_dir: Path, scored: Sequence[Path]) -> list[Path]:
    """Sample folders of ``task_dir`` holding an ``input.wav`` that are not among ``scored`` (in ID order)."""
    names = {d.name for d in scored}
    found = [
        e
        for e in task_dir.iterdir()
        if e.is_dir() and not e.name.startswith(".") and e.name not in names and (e / INPUT_WAV).is_file()
    ]
    return sorted(found, key=lambda p: _sort_key(p.name))


def _score_dirs(
    name: str,
    kind: TaskKind,
    dirs: Sequence[Path],
    task_dir: Path,
    icc_gt: Mapping[str, Sequence[float]] | None,
    segment_fn: SegmentFn | None,
    judge: InterruptionJudge | None,
    reuse_ratings: bool,
    write_ratings: bool,
) -> TaskScore:
    if kind is TaskKind.PAUSE_HANDLING:
        pause = [score_pause(d.name, read_output_json(d / OUTPUT_JSON)) for d in dirs]
        return TaskScore(summary=summarize_pause(name, pause), samples=pause)
    if kind is TaskKind.TURN_TAKING:
        turns = [
            score_turn_taking(d.name, read_output_json(d / OUTPUT_JSON), read_turn_end(d / TURN_TAKING_JSON))
            for d in dirs
        ]
        return TaskScore(summary=summarize_turn_taking(name, turns), samples=turns)
    if kind is TaskKind.BACKCHANNEL:
        return _score_backchannel_task(name, dirs, task_dir, icc_gt, segment_fn)
    return _score_interruption_task(name, dirs, judge, reuse_ratings, write_ratings)


def _score_backchannel_task(
    name: str,
    dirs: Sequence[Path],
    task_dir: Path,
    icc_gt: Mapping[str, Sequence[float]] | None,
    segment_fn: SegmentFn | None,
) -> TaskScore:
    if icc_gt is None:
        raise BenchDataError(
            f"backchannel task {task_dir} needs the ground truth {ICC_GT_JSON} (from the benchmark's "
            "v1_v1.5/evaluation folder); pass --icc-gt PATH"
        )
    if segment_fn is None:
        from cspan.bench.vad import speech_segments

        segment_fn = speech_segments
    samples = []
    for d in dirs:
        if d.name not in icc_gt:
            raise BenchDataError(f"{d}: sample ID {d.name!r} has no entry in the ground-truth file {ICC_GT_JSON}")
        pcm, sr = _read_wav_mono(d / OUTPUT_WAV)
        segments = segment_fn(pcm, sr)
        output = read_output_json(d / OUTPUT_JSON)
        samples.append(score_backchannel(d.name, segments, output, pcm.shape[0] / sr, icc_gt[d.name]))
    return TaskScore(summary=summarize_backchannel(name, samples), samples=samples)


def _score_interruption_task(
    name: str, dirs: Sequence[Path], judge: InterruptionJudge | None, reuse_ratings: bool, write_ratings: bool
) -> TaskScore:
    from cspan.bench.judge import MAX_RATING, MIN_RATING

    samples: list[InterruptionSample] = []
    notes: list[str] = []
    unrated = 0
    last_failure = ""
    for d in dirs:
        info = read_interrupt(d / INTERRUPT_JSON)
        output = read_output_json(d / OUTPUT_JSON)
        sample = score_interruption(d.name, output, info.end_s)
        if sample.tor == 1:
            rating_path = d / RATING_JSON
            if reuse_ratings and rating_path.is_file():
                stored = _read_json(rating_path)
                try:
                    sample.rating, sample.analysis = int(stored["rating"]), str(stored.get("analysis", ""))
                except (KeyError, TypeError, ValueError) as exc:
                    raise BenchDataError(f"{rating_path}: expected {{analysis, rating}} ({exc})") from exc
                if not MIN_RATING <= sample.rating <= MAX_RATING:
                    raise BenchDataError(
                        f"{rating_path}: rating {sample.rating} is outside the judge's {MIN_RATING}-{MAX_RATING}; "
                        "remove the file to have the sample rated again"
                    )
            elif judge is not None:
                try:
                    verdict = judge.rate_interruption(info.context, info.interrupt, output.text)
                except JudgeError as exc:  # recorded as failed; the run goes on (the judge may be taken as down)
                    sample.judge_failed = True
                    last_failure = str(exc)
                else:
                    rating = int(verdict.rating)
                    if not MIN_RATING <= rating <= MAX_RATING:  # a judge of its own that does not check its range
                        sample.judge_failed = True
                        last_failure = f"the judge rated {rating}, outside {MIN_RATING}-{MAX_RATING}"
                    else:
                        sample.rating, sample.analysis = rating, str(verdict.analysis)
                    if write_ratings and not sample.judge_failed:
                        rating_path.write_text(
                            json.dumps({"analysis": sample.analysis, "rating": sample.rating}), encoding="utf-8"
                        )
            else:
                unrated += 1
        samples.append(sample)
    failed = sum(s.judge_failed for s in samples)
    if failed:
        notes.append(
            f"relevance rating failed for {failed} sample(s) (judge_failed in samples.json; not in the mean, asked "
            f"again on the next run): {last_failure}"
        )
    if unrated:
        notes.append(
            f"relevance rating skipped for {unrated} sample(s): no judge configured "
            "(pass --judge-url and --judge-model, or --reuse-ratings to use stored rating.json files)"
        )
    return TaskScore(summary=summarize_interruption(name, samples, notes), samples=samples)


_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]+")


def write_task_score(score: TaskScore, out_dir: Path) -> Path:
    """Write ``{out_dir}/{task}/summary.json`` and ``samples.json``; returns the summary path."""
    folder = out_dir / _SAFE_NAME.sub("_", score.summary.task)
    folder.mkdir(parents=True, exist_ok=True)
    summary_path = folder / "summary.json"
    summary_path.write_text(score.summary.model_dump_json(indent=2) + "\n", encoding="utf-8")
    samples = [s.model_dump(mode="json") for s in score.samples]
    (folder / "samples.json").write_text(json.dumps(samples, indent=2) + "\n", encoding="utf-8")
    return summary_path
