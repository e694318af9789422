"""pocketsphinx's decoding processes, shared by the transcribers of one model in a process, and the utterance streams
decoded in them.

pocketsphinx holds Python's GIL while it decodes, so :class:`~cspan.backends.asr.sphinx.PocketSphinxTranscriber`
decodes in worker processes (:class:`SphinxWorker`: ``python -m cspan.backends.asr.sphinx_worker``); the calling
thread waits on a pipe, GIL released. Wire protocol (stdin / stdout of the process): one JSON line of settings, answered
by ``{"ready": true}``; then per request an 8-byte header ``<json bytes, sample bytes>`` (uint32 little endian), a
JSON object and float32 little-endian samples; answered by one JSON line. Requests:

- ``{"op": "decode", "rate": Hz}`` + samples: a whole clip -> ``{"text", "words": [[word, start_s, end_s], ...]}``;
- ``{"op": "feed", "id": n, "rate": Hz}`` + samples: more audio of utterance stream ``n`` (opened by its first feed)
  -> ``{"ok": true}``;
- ``{"op": "partial", "id": n}`` -> the transcript of what stream ``n`` heard so far;
- ``{"op": "finish", "id": n}`` -> its final transcript (the stream is closed);
- ``{"op": "close", "id": n}`` -> ``{"ok": true}`` (the stream is dropped, no transcript).

Any request may be answered ``{"error": "..."}``. A process keeps at most ``max_streams`` streams open (one
pocketsphinx decoder each, about 90 MB): opening one more closes the one least recently used, whose next request
then gets an error (its client falls back to whole clips).

:class:`SphinxProcessStream` is the client side of one stream: audio is sent in chunks of ``chunk_s`` as it is fed
and decoded in the background, so a partial costs only the audio since the last chunk and the final transcript only
the tail and the decoder's closing passes.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import itertools
import json
import queue
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from cspan.backends.asr.audio import as_mono_float32
from cspan.backends.asr.base import Transcript, Word
from cspan.backends.errors import TranscriberError

ENDPOINT = "pocketsphinx"
MAX_STREAMS = 4
"""Utterance streams a decoding process keeps open at once (one decoder, about 90 MB, each): ``cspan serve``'s
default of 4 sessions, each with one utterance running."""
CHUNK_S = 0.4
"""Audio a stream sends to its process at a time (seconds): the most a partial or the final waits to be decoded,
besides the decoder's closing passes."""


def _transcript(reply: dict[str, Any]) -> Transcript:
    return Transcript(text=reply["text"], words=[Word(text=w, start_s=a, end_s=b) for w, a, b in reply["words"]])


class SphinxWorker:
    """One decoding process (see the module docstring for its protocol). Thread-safe: requests are sent one at a
    time. A plain subprocess: nothing of the caller's ``__main__`` is imported, nothing is unpickled.

    Args:
        key: ``(model_dir, options as sorted pairs, max_streams)``.

    Raises:
        TranscriberError: the process could not start or died (its last stderr lines are in the message).
    """

    def __init__(self, key: tuple[Any, ...]) -> None:
        self.key = key
        model_dir, options, max_streams = key
        self._lock = threading.Lock()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cspan.backends.asr.sphinx_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        settings = {"model_dir": model_dir, "options": dict(options), "max_streams": max_streams}
        with self._lock:
            self._send(json.dumps(settings).encode() + b"\n")
            self._reply()  # the decoder is loaded

    def _send(self, data: bytes) -> None:
        try:
            self.process.stdin.write(data)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self._died()

    def _reply(self) -> dict[str, Any]:
        try:
            line = self.process.stdout.readline()
        except (OSError, ValueError):
            line = b""
        if not line:
            self._died()
        return json.loads(line)

    def _died(self) -> None:
        self.process.kill()
        try:
            tail = self.process.stderr.read().decode(errors="replace").strip().splitlines()[-3:]
        except (OSError, ValueError):
            tail = []
        raise TranscriberError(f"pocketsphinx: the decoding process ended ({' / '.join(tail) or 'no message'})",
                               endpoint=ENDPOINT)  # fmt: skip

    def request(self, op: dict[str, Any], pcm: np.ndarray | None = None) -> dict[str, Any]:
        """Send one request (``pcm`` float32 ``[S]`` as its samples) and return its answer (blocking).

        Raises:
            TranscriberError: the answer is an error, or the process died.
        """
        head = json.dumps(op).encode()
        payload = b"" if pcm is None else np.ascontiguousarray(pcm, dtype="<f4").tobytes()
        with self._lock:
            self._send(struct.pack("<II", len(head), len(payload)) + head + payload)
            reply = self._reply()
        if "error" in reply:
            raise TranscriberError(f"pocketsphinx: {reply['error']}", endpoint=ENDPOINT)
        return reply

    def decode(self, pcm: np.ndarray, sample_rate: int) -> Transcript:
        """Transcribe float32 ``pcm`` [S] at ``sample_rate`` Hz in the process (blocking)."""
        return _transcript(self.request({"op": "decode", "rate": int(sample_rate)}, pcm))

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        if self.alive:
            try:
                self.process.stdin.close()  # the worker leaves at the end of its input
            except OSError:
                pass
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.process.kill()


_WORKERS: dict[tuple[Any, ...], queue.Queue[SphinxWorker]] = {}
"""Idle decoding processes of this process, per key: shared by every transcriber of the same model (a process and its
decoder take seconds to start), ended at interpreter exit."""
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


def _discard(worker: SphinxWorker) -> None:
    """End ``worker`` and free its place (a new one starts on the next request)."""
    worker.close()
    with _WORKERS_LOCK:
        if worker in _ALL_WORKERS:
            _ALL_WORKERS.remove(worker)


@contextmanager
def borrow_worker(key: tuple[Any, ...], size: int) -> Iterator[SphinxWorker]:
    """Borrow a decoding process of ``key``; at most ``size`` of them run at once. A process found dead is
    replaced."""
    while True:
        with _WORKERS_LOCK:
            idle = _WORKERS.setdefault(key, queue.Queue())
            try:
                worker = idle.get_nowait()
            except queue.Empty:
                worker = None
                start = sum(1 for w in _ALL_WORKERS if w.key == key) < size
                if start:
                    _ALL_WORKERS.append(placeholder := _Starting(key))
        if worker is None and start:
            try:
                worker = SphinxWorker(key)
            finally:
                with _WORKERS_LOCK:
                    _ALL_WORKERS.remove(placeholder)
            with _WORKERS_LOCK:
                _ALL_WORKERS.append(worker)
            break
        if worker is None:
            try:  # wake up now and then: a worker that died frees a place to start a new one
                worker = idle.get(timeout=0.5)
            except queue.Empty:
                continue
        if worker.alive:
            break
        _discard(worker)  # it died since (a crash while a stream used it): its place is free again
    ok = False
    try:
        yield worker
        ok = True
    finally:
        if ok and worker.alive:
            idle.put(worker)
        else:
            _discard(worker)


_STREAM_IDS = itertools.count(1)


class SphinxProcessStream:
    """One utterance transcribed as it is heard, in a decoding process (the client of the module docstring's
    stream requests; :class:`cspan.core.protocols.TranscriptStream`).

    :meth:`feed` only buffers; each ``chunk_s`` of audio is sent as one request, run in order on ``executor`` (the
    transcriber's threads, one request per job, so streams and whole clips take turns), so the process decodes the
    utterance while it is spoken. :meth:`partial` and :meth:`finish` send what is buffered and wait for the
    transcript. A failure (the process died, the stream was closed to make room) is raised by the next
    :meth:`partial` or :meth:`finish`; the stream is then of no further use. :meth:`cancel` drops the utterance:
    queued audio is not decoded and the process frees its decoder.

    Word times count from the first sample fed.
    """

    def __init__(
        self,
        key: tuple[Any, ...],
        size: int,
        executor: ThreadPoolExecutor,
        sample_rate: int,
        *,
        chunk_s: float = CHUNK_S,
    ) -> None:
        self._key = key
        self._size = size
        self._executor = executor
        self.sample_rate = int(sample_rate)
        self._chunk = max(1, round(chunk_s * self.sample_rate))
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._ops: collections.deque[tuple[str, np.ndarray | None, Future[Transcript] | None]] = collections.deque()
        self._lock = threading.Lock()  # guards _ops
        self._run_lock = threading.Lock()  # held while a request runs
        self._worker: SphinxWorker | None = None
        self._id = next(_STREAM_IDS)
        self._error: BaseException | None = None
        self.closed = False

    # ------------------------------------------------------------------------------------------------ caller side
    def feed(self, pcm: np.ndarray) -> None:
        """Add ``pcm`` (float32 ``[S]`` at the stream's rate) to the utterance. Never blocks.

        Raises:
            RuntimeError: the stream was finished or cancelled.
        """
        if self.closed:
            raise RuntimeError("this utterance stream is finished or cancelled")
        pcm = as_mono_float32(pcm)
        if pcm.size:
            self._buffer.append(pcm)
            self._buffered += pcm.size
            if self._buffered >= self._chunk:
                self._flush()

    async def partial(self) -> Transcript:
        """The transcript of everything fed so far (the utterance goes on)."""
        if self.closed:
            raise RuntimeError("this utterance stream is finished or cancelled")
        self._flush()
        return await asyncio.wrap_future(self._submit("partial"))

    async def finish(self) -> Transcript:
        """The final transcript of everything fed; the stream is closed."""
        if self.closed:
            raise RuntimeError("this utterance stream is finished or cancelled")
        self._flush()
        self.closed = True
        return await asyncio.wrap_future(self._submit("finish"))

    def cancel(self) -> None:
        """Drop the utterance: nothing more is decoded, no transcript comes; a partial still waiting is cancelled."""
        if self.closed:
            return
        self.closed = True
        self._buffer, self._buffered = [], 0
        with self._lock:
            dropped = list(self._ops)
            self._ops.clear()
        for _, _, future in dropped:
            if future is not None:
                future.cancel()
        self._submit("close")

    # ------------------------------------------------------------------------------------------------ the requests
    def _flush(self) -> None:
        if self._buffered:
            pcm = np.concatenate(self._buffer) if len(self._buffer) > 1 else self._buffer[0]
            self._buffer, self._buffered = [], 0
            self._submit("feed", pcm)

    def _submit(self, op: str, pcm: np.ndarray | None = None) -> Future[Transcript]:
        future: Future[Transcript] = Future()
        with self._lock:
            self._ops.append((op, pcm, future if op in ("partial", "finish") else None))
        try:
            job = self._executor.submit(self._next)
        except RuntimeError:  # the transcriber was closed: nothing will run
            self._abort()
        else:
            job.add_done_callback(lambda j: self._abort() if j.cancelled() else None)
        return future

    def _abort(self) -> None:
        """The executor dropped this stream's requests (the transcriber was closed): fail what waits."""
        with self._lock:
            dropped = list(self._ops)
            self._ops.clear()
        for _, _, future in dropped:
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(TranscriberError("pocketsphinx: the transcriber was closed", endpoint=ENDPOINT))

    def _next(self) -> None:
        """Run the stream's oldest request. One job per request; the jobs may run on several threads at once, so
        each holds the stream's run lock from taking its request to the answer: the requests run in order."""
        with self._run_lock:
            with self._lock:
                if not self._ops:
                    return  # taken by an earlier job, or dropped by cancel()
                op, pcm, future = self._ops.popleft()
            if future is not None and not future.set_running_or_notify_cancel():
                return  # a partial nobody waits for any more
            try:
                reply = self._request(op, pcm)
            except BaseException as exc:
                if future is not None:
                    future.set_exception(exc)
                return
            if future is not None:
                future.set_result(_transcript(reply))

    def _request(self, op: str, pcm: np.ndarray | None) -> dict[str, Any]:
        if self._error is not None:
            if op == "close":
                return {}
            raise self._error
        if self._worker is None:
            if op == "close":
                return {}  # never opened in a process
            with borrow_worker(self._key, self._size) as worker:
                self._worker = worker
        message: dict[str, Any] = {"op": op, "id": self._id}
        if op == "feed":
            message["rate"] = self.sample_rate
        try:
            return self._worker.request(message, pcm)
        except TranscriberError as exc:
            self._error = exc
            if not self._worker.alive:
                _discard(self._worker)
            raise
