"""``PocketSphinxTranscriber``: the embedded, offline default transcriber.

It needs no server and no network: the ``pocketsphinx`` package (CMU Sphinx, https://github.com/cmusphinx/pocketsphinx)
ships a US-English acoustic model, language model and dictionary. It is a **low-accuracy fallback**: on clean
synthetic questions it gets the content words mostly right ("what is the weather like in London today" comes back
as "well the weather like in london today") and on conversational speech it gets much less. Use Qwen3-ASR behind
``OpenAITranscriber`` (vLLM) or ``cspan asr-serve --engine transformers`` for real deployments.

Word timings come from the decoder's segmentation (``Decoder.seg()``), whose frame indices count at the feature
frame rate (``-frate``, 100 frames per second by default): ``start_s = start_frame / frate`` and
``end_s = (end_frame + 1) / frate``.

pocketsphinx holds Python's GIL while it decodes (0.1 to 0.2 s of CPU per second of speech on an idle core, more
under load): in a thread it stops every other thread of the process, the duplex engine's frame clock and the event
loop included (a served session fell seconds behind real time on its partial transcripts). So
:meth:`PocketSphinxTranscriber.transcribe` decodes in worker processes (:mod:`cspan.backends.asr.sphinx_process`:
``python -m cspan.backends.asr.sphinx_worker``, shared by the transcribers of one model in a process; the calling
thread waits on a pipe, GIL released); :meth:`~PocketSphinxTranscriber.transcribe_sync` still decodes in the calling
thread.

Streaming (:meth:`PocketSphinxTranscriber.open_stream`, the runtime's ``TranscriptStream``): an utterance is decoded
as it is heard, pocketsphinx's live mode (``start_utt``, ``process_raw(..., full_utt=False)`` per chunk, ``seg`` for
a partial, ``end_utt`` for the final) on a decoder the utterance holds in the decoding process
(:class:`SphinxUtterance`), so a partial costs the audio since the last one, not the whole utterance again.

Live mode normalises the cepstra with a running mean (from the configured ``cmninit``, updated as the utterance
goes), where a whole clip uses the clip's own mean: the two transcripts differ. So an utterance of at most
:data:`WHOLE_S` seconds (most questions) gets as its final transcript the whole-clip decode, identical to
:meth:`PocketSphinxTranscriber.transcribe`'s and costing at most that much audio; a longer one gets the live pass's,
costing the last chunk and the decoder's closing passes. Partials are always the live pass's. How far the two
differ on the fixtures' speech is in ``docs/PERFORMANCE.md`` ("pocketsphinx: utterances decoded as they are heard").
"""

from __future__ import annotations

import asyncio
import queue
import re
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import soxr

from cspan.backends.asr.audio import AudioFormatError, as_mono_float32, check_sample_rate, resample, to_int16
from cspan.backends.asr.base import Transcript, Word
from cspan.backends.asr.sphinx_process import (
    ENDPOINT,
    MAX_STREAMS,
    SphinxProcessStream,
    SphinxWorker,  # noqa: F401 (re-exported)
    borrow_worker,
)
from cspan.backends.errors import TranscriberError

WHOLE_S = 4.0
"""The longest streamed utterance whose final transcript is decoded again as a whole clip (see the module
docstring): at most this much audio to decode when the transcript is wanted."""
_SILENT = 1 / 32768
"""Peak below which a clip is digital silence: every sample rounds to 0 in the decoder's 16-bit input."""
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

    def acquire(self) -> Any:
        """Take a decoder for an utterance that spans several calls (:class:`SphinxUtterance`); blocks while all
        ``size`` are taken. Give it back with :meth:`release`."""
        return self._acquire()

    def release(self, decoder: Any, *, ok: bool = True) -> None:
        """Give back a decoder from :meth:`acquire`; ``ok=False`` drops it (a decode that failed half-way may leave
        its utterance open), which frees its place for a new one."""
        if ok:
            self._idle.put(decoder)
        else:
            with self._lock:
                self._created -= 1

    @contextmanager
    def decoder(self) -> Iterator[Any]:
        """Borrow a decoder for one utterance; blocks while all ``size`` decoders are busy."""
        decoder = self._acquire()
        ok = False
        try:
            yield decoder
            ok = True
        finally:
            self.release(decoder, ok=ok)

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
        if pcm.size == 0 or float(np.max(np.abs(pcm))) < _SILENT:
            # nothing, or digital silence, on which the decoder would still guess a word ("i'm" on 2 s of zeros)
            return Transcript(text="", words=[])
        with self.decoder() as decoder:
            raw = to_int16(resample(pcm, sample_rate, self.sample_rate)).tobytes()
            try:
                decoder.start_utt()
                decoder.process_raw(raw, no_search=False, full_utt=True)
                decoder.end_utt()
            except RuntimeError as exc:
                raise TranscriberError(f"pocketsphinx failed to decode the clip: {exc}", endpoint=ENDPOINT) from exc
            return self.transcript(decoder)

    def transcript(self, decoder: Any) -> Transcript:
        """The decoder's current hypothesis as a :class:`Transcript` (fillers removed, times in seconds)."""
        # A clip too short to decode (under ~0.1 s) leaves no hypothesis: seg() then returns None.
        segments = [(seg.word, seg.start_frame, seg.end_frame) for seg in (decoder.seg() or [])]
        frate = float(self.frame_rate)
        words = [
            Word(text=_ALT_PRONUNCIATION.sub("", word), start_s=start / frate, end_s=(end + 1) / frate)
            for word, start, end in segments
            if not _is_filler(word)
        ]
        return Transcript(text=" ".join(w.text for w in words), words=words)


class SphinxUtterance:
    """One utterance decoded as its audio comes: pocketsphinx's live mode on a decoder of ``pool`` that it holds from
    its first audio to :meth:`close` (see the module docstring). Not thread-safe: one caller (a decoding process
    serves its streams one request at a time).

    The live pass starts from fresh feature state (``reinit_feat``: the configured initial cepstral mean, whatever
    the decoder decoded before, so the result depends on this utterance only) and updates the running mean after
    every chunk. Its transcript is what :meth:`partial` gives. :meth:`finish` gives it too for an utterance longer
    than ``whole_s``; a shorter one is decoded again as a whole clip on ``clip_pool`` (exactly what
    :meth:`SphinxDecoderPool.decode` gives for it), whose cost is bounded by ``whole_s``. Word times count from the
    first sample fed.

    Args:
        pool: decoders for live passes (a decoder decodes in live mode ever after its first live pass, so whole
            clips need decoders of their own).
        sample_rate: the rate of the audio fed (Hz); resampled to the model's rate with a streaming soxr resampler.
        clip_pool: decoders for whole clips; ``None``: the final transcript is always the live pass's.
        whole_s: the longest utterance whose final transcript is a whole-clip decode.

    Raises (every method): TranscriberError: the decoder failed (the utterance is then closed), or it is closed;
    AudioFormatError: unusable audio or rate.
    """

    def __init__(
        self,
        pool: SphinxDecoderPool,
        sample_rate: int,
        *,
        clip_pool: SphinxDecoderPool | None = None,
        whole_s: float = WHOLE_S,
    ) -> None:
        self.pool = pool
        self.clip_pool = clip_pool
        self.sample_rate = check_sample_rate(sample_rate)
        if pool._created == 0:
            pool.warm()  # the model's rate is known once a decoder is loaded
        rate = pool.sample_rate
        self._resampler = (
            soxr.ResampleStream(self.sample_rate, rate, 1, dtype="float32") if self.sample_rate != rate else None
        )
        # the audio as fed, while the utterance may still be decoded whole at the end
        self._kept: list[np.ndarray] | None = [] if clip_pool is not None else None
        self._kept_n = 0
        self._whole = round(whole_s * self.sample_rate)
        self._decoder: Any = None
        self._peak = 0.0
        self.finished = False
        self.closed = False

    def feed(self, pcm: np.ndarray) -> None:
        """Decode ``pcm`` ``[S]`` float32 (at the utterance's rate) after what was fed before."""
        self._check_open()
        pcm = as_mono_float32(pcm)
        if not pcm.size:
            return
        self._peak = max(self._peak, float(np.max(np.abs(pcm))))
        if self._kept is not None:
            self._kept_n += pcm.size
            if self._kept_n <= self._whole:
                self._kept.append(pcm)
            else:
                self._kept = None  # too long to decode whole at the end: the live pass's transcript is final
        self._process(pcm if self._resampler is None else self._resampler.resample_chunk(pcm))

    def partial(self) -> Transcript:
        """The transcript of what was fed so far (the live pass's best path; the utterance goes on)."""
        self._check_open()
        if self._peak < _SILENT or self._decoder is None:
            return Transcript(text="", words=[])
        return self.pool.transcript(self._decoder)

    def finish(self) -> Transcript:
        """The final transcript of the utterance. Call :meth:`close` after it (a decoding process answers first):
        it ends the live pass and gives its decoder back."""
        self._check_open()
        self.finished = True
        if self._peak < _SILENT:
            return Transcript(text="", words=[])  # digital silence: no guess
        if self._kept is not None and self.clip_pool is not None:
            return self.clip_pool.decode(np.concatenate(self._kept), self.sample_rate)
        if self._resampler is not None:
            self._process(self._resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True))
        try:
            self._decoder.end_utt()
        except RuntimeError as exc:
            self._fail(exc)
        transcript = self.pool.transcript(self._decoder)
        self.pool.release(self._decoder)
        self._decoder = None
        return transcript

    def close(self) -> None:
        """End the utterance (after :meth:`finish`, or to drop it: no transcript); the decoder goes back."""
        if self.closed:
            return
        self.closed = self.finished = True
        decoder, self._decoder = self._decoder, None
        if decoder is not None:
            try:
                decoder.end_utt()
            except RuntimeError:
                self.pool.release(decoder, ok=False)
            else:
                self.pool.release(decoder)

    def _check_open(self) -> None:
        if self.finished:
            raise TranscriberError("pocketsphinx: this utterance is finished or closed", endpoint=ENDPOINT)

    def _process(self, pcm: np.ndarray) -> None:
        if not pcm.size:
            return
        try:
            if self._decoder is None:
                self._decoder = self.pool.acquire()
                self._decoder.reinit_feat()  # fresh cepstral mean and live/batch mode: this utterance only
                self._decoder.start_utt()
            self._decoder.process_raw(to_int16(pcm).tobytes(), no_search=False, full_utt=False)
            self._decoder.get_cmn(True)  # the running mean follows the utterance
        except RuntimeError as exc:
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self.closed = self.finished = True
        decoder, self._decoder = self._decoder, None
        if decoder is not None:
            self.pool.release(decoder, ok=False)
        raise TranscriberError(f"pocketsphinx failed to decode the utterance: {exc}", endpoint=ENDPOINT) from exc


class PocketSphinxTranscriber:
    """The embedded offline transcriber: pocketsphinx with its bundled US-English model, word timings included.

    A **low-accuracy fallback** for machines with no ASR server (see the module docstring); English only unless
    ``model_dir`` points at another Sphinx model.

    Args:
        model_dir: a Sphinx model directory (see :func:`sphinx_model_files`); ``None`` = the bundled en-us model.
        pool_size: how many clips may decode at the same time (one decoding process each).
        options: extra pocketsphinx decoder options.
        max_streams: utterance streams a decoding process keeps open at once (one decoder, about 90 MB, each; one
            more closes the least recently used, whose utterance then goes on with whole clips).

    ``await transcribe(pcm [S] float32, sample_rate Hz)`` runs the decode in one of ``pool_size`` worker processes
    (pocketsphinx holds the GIL: see the module docstring) and returns a :class:`Transcript` with ``words``; the
    processes start at the first clip or at :meth:`warm` (``cspan serve`` and ``cspan infer`` warm it when they
    build their backends). :meth:`open_stream` transcribes an utterance as it is heard (the runtime's
    ``TranscriptStream``: ``feed``, ``partial``, ``finish``, ``cancel``). Raises
    :class:`~cspan.backends.errors.TranscriberError` (``endpoint="pocketsphinx"``).
    """

    endpoint = ENDPOINT

    def __init__(
        self,
        *,
        model_dir: str | Path | None = None,
        pool_size: int = 1,
        options: Mapping[str, Any] | None = None,
        max_streams: int = MAX_STREAMS,
    ) -> None:
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        self.pool = SphinxDecoderPool(pool_size, model_dir=model_dir, options=options)
        self._worker_key = (
            None if model_dir is None else str(model_dir),
            tuple(sorted((options or {}).items())),
            int(max_streams),
        )
        self._pool_size = int(pool_size)
        # Its own threads, one per decoding process: a clip waiting for a process waits in this executor's queue
        # (where a cancelled transcription is dropped), never on a thread of the event loop's default executor,
        # which the server needs for every handshake, Context DB call and large message.
        self._executor = ThreadPoolExecutor(max_workers=self._pool_size, thread_name_prefix="cspan-sphinx")

    def warm(self) -> None:
        """Start a decoding process and load its decoder now instead of at the first clip."""
        with borrow_worker(self._worker_key, self._pool_size):
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
        with borrow_worker(self._worker_key, self._pool_size) as worker:
            return worker.decode(pcm, sample_rate)

    def open_stream(self, sample_rate: int) -> SphinxProcessStream:
        """Start transcribing an utterance as it is heard: ``feed(pcm)`` (float32 ``[S]`` at ``sample_rate`` Hz;
        never blocks), ``await partial()``, ``await finish()`` (its final transcript), ``cancel()``. Decoded in a
        decoding process in chunks of 0.4 s as the audio comes (see the module docstring); its requests take turns
        with whole clips on this transcriber's threads."""
        sample_rate = check_sample_rate(sample_rate)
        return SphinxProcessStream(self._worker_key, self._pool_size, self._executor, sample_rate)

    async def aclose(self) -> None:
        """Drop the clips still waiting for a decoding process (a clip being decoded finishes; a later
        :meth:`transcribe` raises RuntimeError). Decoders are freed with the object, and the decoding processes are
        shared by every transcriber of the same model in this process (they end with it)."""
        self._executor.shutdown(wait=False, cancel_futures=True)  # an exit would otherwise decode the backlog first
