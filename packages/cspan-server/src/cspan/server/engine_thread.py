"""Every call into the ``DuplexEngine`` of ``cspan serve``, on one dedicated thread.

The event loop of the server never touches the engine: persona prefixes, Context Spans, the batched step and the
Mimi encoding of voices all run on the single worker thread of :class:`EngineThread`, in the order they are asked
for. Nothing else calls the engine or its models.

Context Spans reach the engine through :class:`SpanHandoff`, the object a
:class:`~cspan.core.runtime.Conversation` is given as its ``engine``: its ``inject_span`` (on the event loop) hands
the reference to the engine thread at once and returns a :class:`QueuedSpan` standing in for the engine's
``SpanReport``. On the engine thread, in order with every other call, the span is injected into its session and the
next step prepared (``DuplexEngine.prepare``: its tables and decode plan built while the device idles between two
frames, so the frame that reads the span starts its device work at once); the ``QueuedSpan`` gets the report, or
the error. The frame loop hands spans over between frames (``Conversation.read_spans`` after each frame); after the
step that reads a span (the engine's ``take_span_reads``, read through :class:`SpanHandoff`), the ``Conversation``
sends its ``span`` event, completed from the report, or an ``error`` where the engine refused it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


@dataclass
class QueuedSpan:
    """A Context Span handed to the engine thread for session ``slot`` (:meth:`EngineThread.read_span`).

    Until the engine thread has injected it, ``n``, ``prefill_ms``, ``truncated``, ``deferred`` and
    ``prefix_in_window`` are placeholders (what a ``Conversation`` reads from a report right away); afterwards
    ``report`` is the engine's :class:`~cspan.core.span.SpanReport`, or ``error`` says why the engine refused the
    span. Either is set before any frame asked for after the handoff runs.
    """

    slot: int
    text: str
    report: Any = None
    error: BaseException | None = None
    n: int = 0
    prefill_ms: float = 0.0
    truncated: bool = False
    deferred: bool = False
    prefix_in_window: bool = True

    @property
    def seq(self) -> int | None:
        """The engine's number of the span (``SpanReport.seq``), once injected."""
        return None if self.report is None else int(self.report.seq)


class SpanHandoff:
    """What a session's ``Conversation`` sees as its engine: ``inject_span`` hands the span to :class:`EngineThread`."""

    def __init__(self, engine_thread: EngineThread) -> None:
        self._engine_thread = engine_thread

    def inject_span(self, i: int, text: str) -> QueuedSpan:
        """Hand ``text`` for session ``i`` to the engine thread, which injects it before any later call (so the next
        step reads it) and prepares that step (see the module docstring)."""
        span = QueuedSpan(slot=i, text=text)
        self._engine_thread.read_span(span)
        return span

    def take_window_events(self, i: int) -> list[Any]:
        """What session ``i``'s persona policy did since the last call (``DuplexEngine.take_window_events``: host
        only, guarded by the sessions record's lock, so any thread may call it)."""
        return self._engine_thread.engine.take_window_events(i)

    def take_span_reads(self, i: int) -> list[Any]:
        """The Context Spans session ``i``'s steps read since the last call (``DuplexEngine.take_span_reads``: host
        only, under the same lock)."""
        return self._engine_thread.engine.take_span_reads(i)


@dataclass
class FrameResult:
    """One batched step, as host arrays.

    Attributes:
        agent_pcm: [B, 1920] float32, the agent frame of every row.
        text_token: [B] int64 (-1 where ``valid`` is False).
        is_ret: [B] bool.
        valid: [B] bool, whether the row returned a frame (False on a row's first call after its reset).
        step_ms: wall-clock milliseconds of the engine step (spans read before it not included).
    """

    agent_pcm: np.ndarray
    text_token: np.ndarray
    is_ret: np.ndarray
    valid: np.ndarray
    step_ms: float


class EngineThread:
    """The engine and the one thread that calls it.

    Args:
        engine: a :class:`~cspan.core.engine.DuplexEngine`.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.batch_size: int = engine.batch_size
        self._live = [True] * self.batch_size  # the engine's own flags, as last set (every session starts live)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cspan-engine")

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def read_span(self, span: QueuedSpan) -> None:
        """Inject ``span`` on the engine thread, after the calls asked for before it and before any asked for after
        it, then prepare the next step; its report (or error) is filled in there. Called on the event loop."""
        self._executor.submit(self._read_span, span)

    async def prepare(
        self,
        slot: int,
        *,
        seed: int,
        sampling: Any = None,
        text_prompt: str | None,
        voice: Any,
        user_name: str | None,
        user_city: str | None,
    ) -> Any:
        """Reset row ``slot`` with ``seed`` and ``sampling`` (a :class:`cspan.core.sampling.SessionSampling`, None:
        the engine's defaults) and read its persona prefix (``voice``: a :class:`~cspan.core.voice.VoicePrompt`, [8, N]
        codes or None); the engine's ``PrefixReport``."""
        return await self._call(self._prepare, slot, seed, sampling, text_prompt, voice, user_name, user_city)

    async def set_sampling(self, slot: int, sampling: Any) -> None:
        """Sample row ``slot`` with ``sampling`` (a :class:`cspan.core.sampling.SessionSampling`) from the engine's
        next step on (after any prepare queued before)."""
        await self._call(self.engine.set_sampling, slot, sampling.text, sampling.audio)

    async def load_voice(self, path: Any, checkpoint: Any) -> Any:
        """:func:`cspan.core.voice.load_voice_prompt` of a voice file (a recording is Mimi-encoded: on this thread,
        between two steps)."""
        from cspan.core.voice import load_voice_prompt

        return await self._call(load_voice_prompt, path, checkpoint)

    async def encode_voice(self, audio: Any) -> Any:
        """The Mimi codes [8, N] (CPU) of a prepared recording (:func:`cspan.core.voice.encode_voice_pcm`), between
        two steps."""
        from cspan.core.voice import encode_voice_pcm

        return await self._call(encode_voice_pcm, audio, self.engine.mimi)

    async def frame(self, pcm: np.ndarray, live: list[bool] | None = None) -> FrameResult:
        """One batched step of ``pcm`` [B, 1920] float32 over the ``live`` rows (default: all), reading every span
        handed over before it; the other rows are idle: not stepped, no compute (``DuplexEngine.set_live``)."""
        return await self._call(self._frame, pcm, live)

    async def shutdown(self) -> None:
        """Let the running call finish and stop the thread."""
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)

    # -- on the engine thread ---------------------------------------------------------------------------------------

    def _prepare(
        self,
        slot: int,
        seed: int,
        sampling: Any,
        text_prompt: str | None,
        voice: Any,
        name: str | None,
        city: str | None,
    ) -> Any:
        engine = self.engine
        engine.reset(slot, seed=seed)
        return engine.set_persona(slot, text_prompt or None, voice, user_name=name, user_city=city, sampling=sampling)

    def _read_span(self, span: QueuedSpan) -> None:
        engine = self.engine
        try:
            report = engine.inject_span(span.slot, span.text)
        except Exception as exc:  # reported as the span's error event; the session goes on
            span.error = exc
            return
        span.n = int(report.n)
        span.prefill_ms = float(getattr(report, "prefill_ms", 0.0))
        span.truncated = bool(getattr(report, "truncated", False))
        span.deferred = bool(getattr(report, "deferred", False))
        span.prefix_in_window = bool(getattr(report, "prefix_in_window", True))
        span.report = report
        try:
            engine.prepare()  # the step that reads it, built now (a later change makes the step build its own)
        except Exception:
            logger.exception("engine thread: preparing the step after a span failed (the step builds its own)")

    def _frame(self, pcm: np.ndarray, live: list[bool] | None) -> FrameResult:
        import torch

        engine = self.engine
        for row, flag in enumerate(live if live is not None else [True] * self.batch_size):
            if flag != self._live[row]:
                engine.set_live(row, flag)
                self._live[row] = flag
        t0 = time.perf_counter()
        out = engine.step(torch.from_numpy(pcm))
        return FrameResult(
            agent_pcm=out.agent_pcm.detach().float().cpu().numpy(),
            text_token=out.text_token.cpu().numpy(),
            is_ret=out.is_ret.cpu().numpy(),
            valid=out.valid.cpu().numpy(),
            step_ms=(time.perf_counter() - t0) * 1000.0,
        )


__all__ = ["EngineThread", "FrameResult", "QueuedSpan", "SpanHandoff"]
