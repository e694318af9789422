"""Word-timed transcription of model outputs into the benchmark's ``output.json``.

Full-Duplex-Bench scores a response from ``output.json`` = ``{"text": ..., "chunks": [{"text": word,
"timestamp": [start_s, end_s]}, ...]}``, written next to ``output.wav`` (reference: ``v1_v1.5/get_transcript/asr.py``,
which runs NVIDIA Parakeet-TDT; ``docs/reference/benchmarks.md`` section 1.3). Here any transcriber of
:mod:`cspan.backends.asr` that returns word timings does the recognition: the embedded pocketsphinx by default, or
an OpenAI-compatible ``/v1/audio/transcriptions`` endpoint asked for word timestamps. The rules kept from the
reference:

- multichannel audio is averaged to mono and transcribed at its own sample rate;
- ``text`` is the words joined by single spaces (the reference appends word + space, then strips);
- user interruption: the waveform is cropped from sample ``int(end * sr)`` on, where ``end`` is the interruption
  end (``interrupt.json`` ``[0]["timestamp"][1]``), only that part is transcribed, and ``end`` is added to every
  word time, so the file holds only post-interruption words on the absolute timeline;
- the file is written as 4-space indented JSON.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cspan.backends.urls import redact_url
from cspan.bench.errors import BenchDataError, BenchError
from cspan.bench.fdb_v1 import (
    INTERRUPT_JSON,
    OUTPUT_JSON,
    OUTPUT_WAV,
    Chunk,
    OutputTranscript,
    TaskKind,
    read_interrupt,
)

log = logging.getLogger(__name__)

DEFAULT_ASR = "sphinx"


def words_to_output(words: Sequence[Any], offset_s: float = 0.0) -> OutputTranscript:
    """Build ``output.json`` content from transcriber words.

    Args:
        words: objects with ``text``, ``start_s``, ``end_s`` (seconds from the start of the transcribed clip), as
            :class:`cspan.backends.asr.Word`.
        offset_s: added to every time (the interruption end for the user-interruption crop).
    """
    chunks = [Chunk(text=w.text, timestamp=(w.start_s + offset_s, w.end_s + offset_s)) for w in words]
    text = "".join(f"{w.text} " for w in words).strip()
    return OutputTranscript(text=text, chunks=chunks)


def read_audio_mono(path: Path) -> tuple[np.ndarray, int]:
    """Read an audio file as float32 mono ``[S]`` (channels averaged) and its rate in Hz.

    Raises:
        BenchDataError: the file is missing or not readable audio.
    """
    import soundfile as sf

    if not path.is_file():
        raise BenchDataError(f"{path} is missing")
    try:
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.SoundFileError, RuntimeError) as exc:
        raise BenchDataError(f"{path} is not a readable audio file ({exc})") from exc
    pcm = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]
    return np.ascontiguousarray(pcm), int(sr)


def crop_after(pcm: np.ndarray, sample_rate: int, start_s: float) -> np.ndarray:
    """``pcm[int(start_s * sample_rate):]`` -- the reference's crop (float product, truncated). ``pcm`` ``[S]``."""
    return pcm[int(start_s * sample_rate) :]


async def transcribe_pcm(
    transcriber: Any, pcm: np.ndarray, sample_rate: int, *, offset_s: float = 0.0
) -> OutputTranscript:
    """Transcribe ``pcm`` ``[S]`` (float32 mono, ``sample_rate`` Hz) and shift its word times by ``offset_s``.

    Raises:
        BenchError: the transcriber failed, or returned text without word timings (use pocketsphinx or an
            OpenAI-compatible endpoint that supports ``timestamp_granularities[]=word``).
    """
    from cspan.backends.errors import BackendError

    if pcm.size == 0:
        return OutputTranscript(text="", chunks=[])
    try:
        transcript = await transcriber.transcribe(pcm, sample_rate)
    except BackendError as exc:
        raise BenchError(f"transcription failed: {exc}") from exc
    if transcript.words is None:
        if not transcript.text.strip():
            return OutputTranscript(text="", chunks=[])
        name = getattr(transcriber, "endpoint", type(transcriber).__name__)
        raise BenchError(
            f"transcriber {name} returned text without word timestamps; the benchmark needs word times: use "
            "--asr sphinx, or an OpenAI-compatible endpoint (http://host:port/v1) that supports "
            "timestamp_granularities[]=word"
        )
    return words_to_output(transcript.words, offset_s)


async def transcribe_sample(transcriber: Any, sample_dir: Path, kind: TaskKind) -> OutputTranscript:
    """Transcribe ``{sample_dir}/output.wav`` for a task; for user interruption apply the crop-and-offset rule."""
    pcm, sr = read_audio_mono(sample_dir / OUTPUT_WAV)
    offset = 0.0
    if kind is TaskKind.USER_INTERRUPTION:
        offset = read_interrupt(sample_dir / INTERRUPT_JSON).end_s
        pcm = crop_after(pcm, sr, offset)
    return await transcribe_pcm(transcriber, pcm, sr, offset_s=offset)


def write_output_json(path: Path, output: OutputTranscript) -> None:
    """Write ``output.json`` as the reference does: ``{text, chunks}``, 4-space indent."""
    payload = {"text": output.text, "chunks": [{"text": c.text, "timestamp": list(c.timestamp)} for c in output.chunks]}
    path.write_text(json.dumps(payload, indent=4) + "\n", encoding="utf-8")


async def ensure_output_jsons(
    sample_dirs: Sequence[Path], transcriber: Any, kind: TaskKind, *, overwrite: bool = False
) -> list[Path]:
    """Write ``output.json`` into every sample folder that lacks one (or into all, with ``overwrite``).

    Returns the files written. Raises :class:`BenchDataError` when a folder lacks ``output.wav`` too, and
    :class:`BenchError` when transcription fails.
    """
    written = []
    for sample_dir in sample_dirs:
        target = sample_dir / OUTPUT_JSON
        if target.is_file() and not overwrite:
            continue
        if not (sample_dir / OUTPUT_WAV).is_file():
            raise BenchDataError(f"{sample_dir} has neither {OUTPUT_JSON} nor {OUTPUT_WAV} to transcribe")
        output = await transcribe_sample(transcriber, sample_dir, kind)
        write_output_json(target, output)
        log.info("transcribed %s: %d words", sample_dir / OUTPUT_WAV, len(output.chunks))
        written.append(target)
    return written


def make_transcriber(spec: str = DEFAULT_ASR, *, model: str | None = None, language: str | None = "en") -> Any:
    """A word-timed transcriber from a ``--asr`` setting.

    ``"sphinx"`` -> the embedded :class:`~cspan.backends.asr.PocketSphinxTranscriber`; an OpenAI-style URL
    (``http://host:port/v1``, ``openai+http://host:port``) -> :class:`~cspan.backends.asr.OpenAITranscriber` asked
    for word timestamps (``model`` default ``qwen3-asr``; key from ``OPENAI_API_KEY``); another ``http(s)`` URL ->
    :class:`~cspan.backends.asr.HTTPTranscriber` (its server must send ``words``).

    Raises:
        BenchError: the setting is none of these, or the engine cannot be loaded.
    """
    from cspan.backends.asr import OpenAITranscriber, transcriber_from_url
    from cspan.backends.errors import BackendError

    try:
        transcriber = transcriber_from_url(spec, model=model, language=language)
        if isinstance(transcriber, OpenAITranscriber):
            transcriber = OpenAITranscriber(
                transcriber.endpoint, model=transcriber.model, language=language, word_timestamps=True
            )
    except (ValueError, BackendError) as exc:
        raise BenchError(f"--asr {redact_url(spec)!r}: {exc}") from exc
    return transcriber
