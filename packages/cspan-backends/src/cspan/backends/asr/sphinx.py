"""``PocketSphinxTranscriber``: the embedded, offline default transcriber.

It needs no server and no network: the ``pocketsphinx`` package (CMU Sphinx, https://github.com/cmusphinx/pocketsphinx)
ships a US-English acoustic model, language model and dictionary. It is a **low-accuracy fallback**: on clean
synthetic questions it gets the content words mostly right ("what is the weather like in London today" comes back
as "well the weather like in london today") and on conversational speech it gets much less. Use Qwen3-ASR behind
``OpenAITranscriber`` (vLLM) or ``cspan asr-serve --engine transformers`` for real deployments.

Word timings come from the decoder's segmentation (``Decoder.seg()``), whose frame indices count at the feature
frame rate (``-frate``, 100 frames per second by default): ``start_s = start_frame / frate`` and
``end_s = (end_frame + 1) / frate``.

pocketsphinx holds Python's GIL while it decodes (about 0.4 s of CPU per second of speech here): in a thread it
stops every other thread of the process, the duplex engine's frame clock and the event loop included (a served
session fell seconds behind real time on its partial transcripts). So :meth:`PocketSphinxTranscriber.transcribe`
decodes in worker processes (:class:`SphinxWorker`: ``python -m cspan.backends.asr.sphinx_worker``, one decoder
each, shared by the transcribers of one model in a process; the calling thread waits on a pipe, GIL released); :meth:`~PocketSphinxTranscriber.transcribe_sync` still decodes in the calling thread.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import queue
import re
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cspan.backends.asr.audio import AudioFormatError, as_mono_float32, check_sample_rate, resample, to_int16
from cspan.backends.asr.base import Transcript, Word
from cspan.backends.errors import TranscriberError

ENDPOINT = "pocketsphinx"
_ALT_PRONUNCIATION = re.compile(r"\(\d+\)$")
_INSTALL_HINT = "pip install 'cspan-backends[sphinx]' (or pip install pocketsphinx)"


def _is_filler(word: str) -> bool:
    """Silence, sentence markers and noise words of the Sphinx dictionaries: ``<s>``, ``<sil>``, ``[NOISE]``, ``++UH++``."""
    return word.startswith(("<", "[", "++")) or not word


def sphinx_model_files(model_dir: str | Path) -> dict[str, str]:
    """Find a Sphinx model in ``model_dir``: the acoustic model folder (the one holding ``mdef``), a language model
    (``*.lm.bin``, ``*.lm`` or ``*.DMP``, phone LMs skipped) and a dictionary (``*.dict``).

    The layout is the one of pocketsphinx's bundled ``model/en-us`` and of the CMU Sphinx model downloads.
    Returns decoder options ``{"hmm", "lm", "dict"}``. Raises ``FileNotFoundError`` naming what is missing.
    """
    root = Path(model_dir).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"Sphinx model directory {root} does not exist")
    hmms = sorted(p.parent for p in root.rglob("mdef"))
    lms = sorted(p for pat in ("*.lm.bin", "*.lm", "*.DMP") for p in root.rglob(pat) if "phone" not in p.name)
    dicts = sorted(root.rglob("*.dict"))
    missing = [
        what
        for what, found in (
            ("an acoustic model folder with mdef", hmms),
            ("a *.lm.bin language model", lms),
            ("a *.dict", dicts),
        )
        if not found
    ]
    if missing:
        raise FileNotFoundError(f"{root} is not a Sphinx model directory: no {', no '.join(missing)}")
    return {"hmm": str(hmms[0]), "lm": str(lms[0]), "dict": str(dicts[0])}


class SphinxDecoderPool:
    """A thread-safe pool of pocketsphinx decoders: at most ``size`` of them, each used by one thread at a time.

    A pocketsphinx ``Decoder`` keeps per-utterance state, so it must never run two decodes at once; the pool hands
    each caller its own decoder and makes further callers wait. Decoders are created on demand (about half a
    second and some tens of MB each) and reused.

    Args:
        size: the most decoders (and so concurrent decodes) the pool holds.
        model_dir: a Sphinx model directory (see :func:`sphinx_model_files`); ``None`` uses the bundled US-English
            model.
        options: more decoder options (pocketsphinx ``Config`` names without the dash, e.g. ``{"beam": 1e-60}``).

    Raises:
        TranscriberError: pocketsphinx is not installed, or the model directory is unusable.
    """

    def __init__(self, size: int = 1, *, model_dir: str | Path | None = None, options: Mapping[str, Any] | None = None):
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        try:
            import pocketsphinx
        except ImportError as exc:
            raise TranscriberError(
                f"the embedded transcriber needs the pocketsphinx package: {_INSTALL_HINT}", endpoint=ENDPOINT
            ) from exc
        self._pocketsphinx = pocketsphinx
        self.size = int(size)
        self.model_dir = None if model_dir is None else Path(model_dir)
        opts: dict[str, Any] = {"loglevel": "FATAL"}
        if self.model_dir is not None:
            try:
                opts.update(sphinx_model_files(self.model_dir))
            except FileNotFoundError as exc:
                raise TranscriberError(str(exc), endpoint=ENDPOINT) from exc
        opts.update(options or {})
        self._options = opts
        self._idle: queue.LifoQueue[Any] = queue.LifoQueue()
        self._created = 0
        self._lock = threading.Lock()
        self.sample_rate = 16000
        self.frame_rate = 100

    @property
    def language(self) -> str | None:
        """``"en"`` for the bundled model, ``None`` (unknown) for a model directory given by the user."""
        return "en" if self.model_dir is None else None

    def _new_decoder(self) -> Any:
        try:
            decoder = self._pocketsphinx.Decoder(**self._options)
        except (RuntimeError, ValueError, KeyError) as exc:
            where = self.model_dir or "the bundled model"
            raise TranscriberError(
                f"pocketsphinx could not load {where} with options {self._options}: {exc}", endpoint=ENDPOINT
            ) from exc
        self.sample_rate = int(decoder.config["samprate"])
        self.frame_rate = int(decoder.config["frate"])
        return decoder

    def warm(self) -> None:
        """Create one decoder now (so a bad model fails at startup, not at the first request)."""
        with self.decoder():
            pass

    def _acquire(self) -> Any:
        while True:
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                create = self._created < self.size
                if create:
                    self._created += 1
            if create:
                try:
                    return self._new_decoder()
                except BaseException:
                    with self._lock:
                        self._created -= 1
                    raise
            try:
                # Wake up now and then: a decoder dropped after a failure frees a slot to create a new one.
                return self._idle.get(timeout=0.5)
            except queue.Empty:
                continue

    @contextmanager
    def decoder(self) -> Iterator[Any]:
        """Borrow a decoder for one utterance; blocks while all ``size`` decoders are busy."""
        decoder = self._acquire()
        ok = False
        try:
            yield decoder
            ok = True
        finally:
            if ok:
                self._idle.put(decoder)
            else:
                # A decode that failed half-way may leave the utterance open: drop that decoder.
                with self._lock:
                    self._created -= 1

    def decode(self, pcm: np.ndarray, sample_rate: int) -> Transcript:
        """Transcribe ``pcm`` ``[S]`` float32 mono at ``sample_rate`` Hz (resampled with soxr to the model's rate).

        Returns the words the decoder recognised (fillers and silences removed, alternate-pronunciation markers
        such as ``the(2)`` stripped) with times in seconds, and their space-joined text. Blocking; thread-safe.

        Raises:
            AudioFormatError: the array or sample rate is unusable.
            TranscriberError: the decoder failed.
        """
        pcm = as_mono_float32(pcm)
        sample_rate = check_sample_rate(sample_rate)
        if pcm.size == 0 or float(np.max(np.abs(pcm))) < 1 / 32768:
            # nothing, or digital silence (every sample rounds to 0 in the decoder's 16-bit input), on which the
            # decoder would still guess a word ("i'm" on 2 s of zeros)
            return Transcript(text="", words=[])
        with self.decoder() as decoder:
            raw = to_int16(resample(pcm, sample_rate, self.sample_rate)).tobytes()
            try:
                decoder.start_utt()
                decoder.process_raw(raw, no_search=False, full_utt=True)
                decoder.end_utt()
            except RuntimeError as exc:
                raise TranscriberError(f"pocketsphinx failed to decode the clip: {exc}", endpoint=ENDPOINT) from exc
            # A clip too short to decode (under ~0.1 s) leaves no hypothesis: seg() then returns None.
            segments = [(seg.word, seg.start_frame, seg.end_frame) for seg in (decoder.seg() or [])]
            frate = float(self.frame_rate)
        words = [
            Word(text=_ALT_PRONUNCIATION.sub("", word), start_s=start / frate, end_s=(end + 1) / frate)
            for word, start, end in segments
            if not _is_filler(word)
        ]
        return Transcript(text=" ".join(w.text for w in words), words=words)


class SphinxWorker:
    """One decoding process: ``python -m cspan.backends.asr.sphinx_worker`` with one decoder, spoken to over its
    standard input and output (a JSON line of settings once; then per clip 8 bytes ``<samples, rate>`` (uint32 little
    endian) and the float32 samples; back one JSON line ``{"text", "words": [[word, start_s, end_s], ...]}`` or
    ``{"error": ...}``). A plain subprocess: nothing of the caller's ``__main__`` is imported, nothing is unpickled.

    Raises:
        TranscriberError: the process could not start or died (its last stderr lines are in the message).
    """

    def __init__(self, key: tuple[Any, ...]) -> None:
        self.key = key  # (model_dir, options as sorted pairs)
        model_dir, options = key
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cspan.backends.asr.sphinx_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._send(json.dumps({"model_dir": model_dir, "options": dict(options)}).encode() + b"\n")
        self._reply()  # the decoder is loaded

    def _send(self, data: bytes) -> None:
        try:
            self.process.stdin.write(data)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            self._died()

    def _reply(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            self._died()
        return json.loads(line)

    def _died(self) -> None:
        self.process.kill()
        tail = self.process.stderr.read().decode(errors="replace").strip().splitlines()[-3:]
        raise TranscriberError(f"pocketsphinx: the decoding process ended ({' / '.join(tail) or 'no message'})",
                               endpoint=ENDPOINT)  # fmt: skip

    def decode(self, pcm: np.ndarray, sample_rate: int) -> Transcript:
        """Transcribe float32 ``pcm`` [S] at ``sample_rate`` Hz in the process (blocking; one clip at a time)."""
        pcm = np.ascontiguousarray(pcm, dtype="<f4")
        self._send(struct.pack("<II", pcm.size, sample_rate) + pcm.tobytes())
        reply = self._reply()
        if "error" in reply:
            raise TranscriberError(f"pocketsphinx: {reply['error']}", endpoint=ENDPOINT)
        words = [Word(text=w, start_s=a, end_s=b) for w, a, b in reply["words"]]
        return Transcript(text=reply["text"], words=words)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        if self.alive:
            self.process.stdin.close()  # the worker leaves at the end of its input
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.process.kill()


_WORKERS: dict[tuple[Any, ...], queue.Queue[SphinxWorker]] = {}
"""Idle decoding processes of this process, per (model folder, options): shared by every transcriber of the same
model (a process and its decoder take seconds to start), ended at interpreter exit."""
_ALL_WORKERS: list[SphinxWorker] = []
_WORKERS_LOCK = threading.Lock()


@atexit.register
def _stop_workers() -> None:
    with _WORKERS_LOCK:
        workers = list(_ALL_WORKERS)
        _ALL_WORKERS.clear()
        _WORKERS.clear()
    try:
        for worker in workers:
            worker.close()
    except KeyboardInterrupt:  # a second Ctrl-C while leaving: end the rest at once, without a traceback
        for worker in workers:
            if isinstance(worker, SphinxWorker) and worker.alive:
                worker.process.kill()


@dataclass(eq=False)
class _Starting:
    """A place taken by a worker being started."""

    key: tuple[Any, ...]

    def close(self) -> None:
        pass


@contextmanager
def _worker(key: tuple[Any, ...], size: int) -> Iterator[SphinxWorker]:
    """Borrow a decoding process of ``key`` = (model_dir, options); at most ``size`` of them run at once."""
    while True:
        with _WORKERS_LOCK:
            idle = _WORKERS.setdefault(key, queue.Queue())
            try:
                worker = idle.get_nowait()
                break
            except queue.Empty:
                pass
            start = sum(1 for w in _ALL_WORKERS if w.key == key) < size
            if start:
                _ALL_WORKERS.append(placeholder := _Starting(key))
        if start:
            try:
                worker = SphinxWorker(key)
            finally:
                with _WORKERS_LOCK:
                    _ALL_WORKERS.remove(placeholder)
            with _WORKERS_LOCK:
                _ALL_WORKERS.append(worker)
            break
        try:  # wake up now and then: a worker that died frees a place to start a new one
            worker = idle.get(timeout=0.5)
            break
        except queue.Empty:
            continue
    ok = False
    try:
        yield worker
        ok = True
    finally:
        if ok and worker.alive:
            idle.put(worker)
        else:
            worker.close()
            with _WORKERS_LOCK:
                if worker in _ALL_WORKERS:
                    _ALL_WORKERS.remove(worker)


class PocketSphinxTranscriber:
    """The embedded offline transcriber: pocketsphinx with its bundled US-English model, word timings included.

    A **low-accuracy fallback** for machines with no ASR server (see the module docstring); English only unless
    ``model_dir`` points at another Sphinx model.

    Args:
        model_dir: a Sphinx model directory (see :func:`sphinx_model_files`); ``None`` = the bundled en-us model.
        pool_size: how many clips may decode at the same time (one decoder each).
        options: extra pocketsphinx decoder options.

    ``await transcribe(pcm [S] float32, sample_rate Hz)`` runs the decode in one of ``pool_size`` worker processes
    (pocketsphinx holds the GIL: see the module docstring) and returns a :class:`Transcript` with ``words``; the
    processes start at the first clip or at :meth:`warm` (``cspan serve`` and ``cspan infer`` warm it when they
    build their backends). Raises :class:`~cspan.backends.errors.TranscriberError`
    (``endpoint="pocketsphinx"``).
    """

    endpoint = ENDPOINT

    def __init__(
        self,
        *,
        model_dir: str | Path | None = None,
        pool_size: int = 1,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.pool = SphinxDecoderPool(pool_size, model_dir=model_dir, options=options)
        self._worker_key = (None if model_dir is None else str(model_dir), tuple(sorted((options or {}).items())))
        self._pool_size = int(pool_size)
        # Its own threads, one per decoding process: a clip waiting for a process waits in this executor's queue
        # (where a cancelled transcription is dropped), never on a thread of the event loop's default executor,
        # which the server needs for every handshake, Context DB call and large message.
        self._executor = ThreadPoolExecutor(max_workers=self._pool_size, thread_name_prefix="cspan-sphinx")

    def warm(self) -> None:
        """Start a decoding process and load its decoder now instead of at the first clip."""
        with _worker(self._worker_key, self._pool_size):
            pass

    def transcribe_sync(self, pcm: np.ndarray, sample_rate: int) -> Transcript:
        """Blocking form of :meth:`transcribe`."""
        try:
            return self.pool.decode(pcm, sample_rate)
        except AudioFormatError as exc:
            raise TranscriberError(f"pocketsphinx: cannot use this clip: {exc}", endpoint=ENDPOINT) from exc

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> Transcript:
        """Transcribe ``pcm`` ``[S]`` float32 mono at ``sample_rate`` Hz in a worker process."""
        try:
            pcm = as_mono_float32(pcm)
            sample_rate = check_sample_rate(sample_rate)
        except AudioFormatError as exc:
            raise TranscriberError(f"pocketsphinx: cannot use this clip: {exc}", endpoint=ENDPOINT) from exc
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._decode_in_process, pcm, sample_rate)

    def _decode_in_process(self, pcm: np.ndarray, sample_rate: int) -> Transcript:
        with _worker(self._worker_key, self._pool_size) as worker:
            return worker.decode(pcm, sample_rate)

    async def aclose(self) -> None:
        """Drop the clips still waiting for a decoding process (a clip being decoded finishes; a later
        :meth:`transcribe` raises RuntimeError). Decoders are freed with the object, and the decoding processes are
        shared by every transcriber of the same model in this process (they end with it)."""
        self._executor.shutdown(wait=False, cancel_futures=True)  # an exit would otherwise decode the backlog first
