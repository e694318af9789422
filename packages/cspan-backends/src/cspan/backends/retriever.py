"""``Retriever``: what the conversation runtime calls when the model emits ``<ret>``.

It composes a transcriber, a router and (optionally) the Context DB into one call,
``retrieve(audio or question, ...) -> SpanResult``:

1. the question is the given text, or the transcript of ``audio`` (any sample rate, float32 mono);
2. it is added to the Context DB as a user turn (unless it repeats the last one), and the router is given the
   working text, the profile, what the agent already said and the conversation's earlier tool calls with their
   results;
3. the router's reference, tool and arguments come back as a :class:`SpanResult`; tool calls are logged as tool
   turns (``get_time({"timezone": "Asia/Tokyo"}) => It is ...``) and the retrieval as a span row, dropped at once
   as ``no_span`` / ``error`` / ``late`` when there is nothing to inject. The runtime marks injected spans with
   :meth:`ContextDB.mark_span_injected` using ``SpanResult.span_id``.

A deadline bounds the whole call; cancelling the task cancels the transcriber and router requests in flight, and
records the retrieval as a span row dropped ``cancelled``, with the step it was in and the reason (the cancel
message, e.g. the runtime's ``conversation ended``) as its ``error``: a retrieval cut short is never lost.
Backend failures never escape: they become ``reference=None`` with ``error`` set, and ``stage`` names the step
that failed or was running when the deadline passed (``asr``, ``context``, ``router``, ``tool``), with the seconds
each step took (``asr_s``, ``context_s``, ``llm_s``, ``tool_s``), so that a late span says why it was late.

A database that does not answer (a frozen host) costs at most ``db_timeout_s`` when one is given (``cspan serve``
gives ``--db-wait-s``), for the context read and the router's own reads together (the local router's facts:
:mod:`cspan.backends.context_db.waits`), and again for the span row write: the context step then routes without
the conversation's context, as when the database fails, and a span row not written within the bound is left to be
written when the database answers (the result's ``span_id`` is then a provisional one, under which the span's
outcome is marked and written with the row). A conversation's Context DB work runs one job at a time, in order
(the question's turn before its span row); at most :data:`MAX_PENDING_DB_JOBS` wait, beyond which a retrieval
neither reads nor records (logged).

Whose memory: a :class:`~cspan.backends.context_db.UserMemory` (``db.user(principal)``) fixes the user for every
call; a server makes one Retriever per session with :meth:`Retriever.scoped`. A whole
:class:`~cspan.backends.context_db.ContextDB` is still accepted (deprecated): the user is then the profile's
``user_id``, which in a server is whatever the client sent.

Source: ``retrieve_for_ret`` of the original system (mindlogic-ai/Context-Spanning, ``frame_stream.py``,
summarised in ``docs/reference/context-spanning-original.md`` section 4.3), with the Context DB persisted and
earlier tool results (not just their sources) given to the router. It satisfies the ``Retriever`` protocol of
``cspan.core`` structurally, without importing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time
import warnings
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol, TypeVar

import numpy as np
from pydantic import BaseModel, Field

from cspan.backends.asr.base import MAX_TRANSCRIPT_CHARS
from cspan.backends.context_db import ContextDB, ContextDBError, Profile, UserMemory, db_waits_due_by
from cspan.backends.router.base import TOOL_RESULT_PREFIX, Router, RouteRequest, RouteResult, ToolCall
from cspan.backends.tools.bank import calls_due_by
from cspan.backends.untrusted import is_seconds, require_str, sanitize_text

Stage = Literal["asr", "context", "router", "tool"]

log = logging.getLogger(__name__)

MAX_REFERENCE_CHARS = 4000
"""Longest span text taken from a router, in characters (a tool clause is at most a few hundred; chained calls
join several)."""

MAX_PENDING_DB_JOBS = 4
"""Most Context DB jobs of one conversation (a context read with its question turn; a span row write: two per
retrieval) waiting for the database at once; a retrieval that would add one more neither reads nor records (logged),
so a database that does not answer piles up no work."""

T = TypeVar("T")

_LEFT_RUNNING: set[asyncio.Task[Any]] = set()
"""Every Context DB job not finished yet: held here so that one left to finish in the background is not collected."""

__all__ = ["MAX_PENDING_DB_JOBS", "Retriever", "SpanResult"]


class _Transcriber(Protocol):
    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> Any: ...


class SpanResult(BaseModel):
    """The outcome of one retrieval.

    Attributes:
        question: the question routed (the transcript when audio was given; "" when there was none).
        reference: the span text to inject, or None.
        tool: the tool that produced it, or None.
        arguments: the tool's validated arguments.
        source: the router's source (``"tool:<name>"``, ``"llm"``, ``"local:<kind>"``, ``"none"``).
        asr_s: seconds spent transcribing (0 when the question was given).
        route_s: seconds spent routing (LLM and tool).
        error: what failed when ``reference`` is None because of a failure or the deadline; None otherwise.
        late: the deadline passed before a reference was ready.
        span_id: the Context DB span row of this retrieval (None without a DB or conversation). A row not written
            within the retriever's ``db_timeout_s`` is written when the database answers; its id is then a
            provisional one (negative), under which ``mark_span_injected`` / ``mark_span_dropped`` of the
            retriever's memory record the span's outcome, before or after the row is written.
        stage: the step that failed, or was running when the deadline passed: ``"asr"``, ``"context"`` (reading
            the Context DB), ``"router"`` (the router LLM), ``"tool"``; None when nothing went wrong.
        context_s: seconds spent reading the Context DB (at most the retriever's ``db_timeout_s``).
        llm_s, tool_s: of ``route_s``, seconds waiting for the router LLM and running tools.
    """

    question: str = ""
    reference: str | None = None
    tool: str | None = None
    arguments: dict[str, Any] = Field(default_factory=dict)
    source: str = "none"
    asr_s: float = 0.0
    route_s: float = 0.0
    error: str | None = None
    late: bool = False
    span_id: int | None = None
    stage: Stage | None = None
    context_s: float = 0.0
    llm_s: float = 0.0
    tool_s: float = 0.0


def _result_clause(reference: str) -> str:
    text = reference.strip()
    if text.lower().startswith(TOOL_RESULT_PREFIX):
        text = text[len(TOOL_RESULT_PREFIX) :].strip()
    return text


class Retriever:
    """Transcriber + router + Context DB behind one ``retrieve`` call.

    Args:
        transcriber: anything with ``async transcribe(pcm, sample_rate) -> Transcript`` (or a ``str``); may be
            None when every call passes ``question``.
        router: an ``LLMRouter``, a ``LocalRouter`` or anything with ``async route(RouteRequest)``.
        memory: the user's :class:`~cspan.backends.context_db.UserMemory`; or, deprecated, a whole
            :class:`~cspan.backends.context_db.ContextDB` (the user is then the profile's ``user_id``); or None
            (earlier tool calls are then remembered in this object per conversation).
        deadline_s: default time budget of one :meth:`retrieve` in seconds (None: no limit). The original's live
            default was 2.5 s from ``<ret>`` to injection.
        history: how many earlier tool calls the router sees.
        context_chars: budget of the Context DB working text.
        user_id: with a whole ContextDB (deprecated), the user when the profile names none.
        db_timeout_s: longest wait of one :meth:`retrieve` for the Context DB, in seconds, for the context read and
            the router's reads together, and again for the span row write (None: no limit, the database is waited
            for). Past it the context step
            routes without the context, and the span row is left to be written when the database answers; a
            write behind one still waiting is not waited for at all.

    Raises:
        ValueError: ``deadline_s`` or ``db_timeout_s`` is not a positive number of seconds.
    """

    def __init__(
        self,
        transcriber: _Transcriber | None,
        router: Router,
        memory: UserMemory | ContextDB | None = None,
        *,
        deadline_s: float | None = None,
        history: int = 5,
        context_chars: int = 1400,
        user_id: str = "default",
        db_timeout_s: float | None = None,
    ) -> None:
        if db_timeout_s is not None and not 0 < db_timeout_s < float("inf"):
            raise ValueError(f"db_timeout_s must be a positive number of seconds or None, not {db_timeout_s!r}")
        if deadline_s is not None and not (is_seconds(deadline_s, infinite=True) and deadline_s > 0):
            raise ValueError(
                f"deadline_s must be a positive number of seconds (inf allowed) or None, not {deadline_s!r}"
            )
        self.transcriber = transcriber
        self.router = router
        if isinstance(memory, ContextDB):
            warnings.warn(
                "Retriever(..., ContextDB) trusts the profile's user_id; pass db.user(principal) (a UserMemory)",
                DeprecationWarning,
                stacklevel=2,
            )
        self.db = memory
        self.deadline_s = deadline_s
        self.history = history
        self.context_chars = context_chars
        self.user_id = user_id
        self.db_timeout_s = db_timeout_s
        self._calls: dict[str | None, list[ToolCall]] = {}
        self._jobs: dict[str, list[asyncio.Task[Any]]] = {}  # per conversation: its Context DB jobs not done, in order

    def scoped(self, memory: UserMemory | None, *, router: Router | None = None) -> Retriever:
        """A Retriever like this one for one session: ``memory`` is that session principal's, ``router`` its own
        (e.g. ``llm_router.with_bank(session_bank(...))``). Cheap; a server makes one per session."""
        return Retriever(
            self.transcriber,
            router if router is not None else self.router,
            memory,
            deadline_s=self.deadline_s,
            history=self.history,
            context_chars=self.context_chars,
            user_id=self.user_id,
            db_timeout_s=self.db_timeout_s,
        )

    def _memory(self, profile: Profile | None, conversation_id: str | None) -> UserMemory | None:
        if isinstance(self.db, ContextDB):  # deprecated: the caller names the user
            if profile is None and conversation_id is not None:
                with contextlib.suppress(ContextDBError):
                    owner = self.db._memory_of_conversation(conversation_id)
                    if owner.get_conversation(conversation_id) is not None:
                        return owner
            return self.db.user(profile.user_id if profile else self.user_id)
        return self.db

    async def retrieve(
        self,
        audio: np.ndarray | None = None,
        sample_rate: int | None = None,
        question: str | None = None,
        profile: Profile | None = None,
        agent_said: str = "",
        conversation_id: str | None = None,
        deadline_s: float | None = None,
        after_span: bool | None = None,
    ) -> SpanResult:
        """Transcribe (unless ``question`` is given), route, record, and return the span to inject.

        Args:
            audio: user speech, float32 mono in [-1, 1], shape ``[S]``, at ``sample_rate`` Hz.
            sample_rate: Hz of ``audio``.
            question: the question as text; skips transcription.
            profile: the user's profile; defaults to the stored profile of the conversation's user.
            agent_said: what the agent already said (decoded text tokens of its current answer).
            conversation_id: the Context DB conversation (started if it does not exist yet).
            deadline_s: time budget of this call in seconds; overrides the constructor's.
            after_span: whether all of the speech the question comes from was heard after the conversation's last
                Context Span was read (False when none was), None when unknown (the router then finds the new words
                in the text): an action held back for confirmation is confirmed only by such speech
                (:class:`~cspan.backends.router.RouteRequest`).

        Returns:
            A :class:`SpanResult`; never raises for a transcriber, router, tool or database failure.

        Raises:
            TypeError: ``question`` (when given) or ``agent_said`` is not a ``str`` (bytes included: decode them
                first).
            ValueError: ``deadline_s`` is not a number of seconds >= 0 (a string, NaN, negative).
            asyncio.CancelledError: the caller cancelled the task (in-flight requests are cancelled too; the span
                row, dropped ``cancelled``, is written first).
        """
        if question is not None:
            require_str("question", question)
        require_str("agent_said", agent_said)
        if deadline_s is not None and not (is_seconds(deadline_s, infinite=True) and deadline_s >= 0):
            raise ValueError(f"deadline_s must be a number of seconds >= 0 (inf allowed) or None, not {deadline_s!r}")
        budget = self.deadline_s if deadline_s is None else deadline_s
        res = SpanResult()
        route: RouteResult | None = None
        asked_at = time.time()
        start = time.perf_counter()
        # a tool that would wait (an MCP server's Retry-After) waits only where the wait ends before this deadline
        due = contextlib.nullcontext()
        if budget is not None and math.isfinite(budget):
            due = calls_due_by(asyncio.get_running_loop().time() + budget)
        try:
            async with asyncio.timeout(budget):
                with due:
                    route = await self._run(
                        res, audio, sample_rate, question, profile, agent_said, conversation_id, after_span
                    )
        except TimeoutError:
            res.late = True
            res.reference = None
            spent = ", ".join(
                f"{name} {value:.2f} s"
                for name, value in (("asr", res.asr_s), ("context", res.context_s), ("router", res.route_s))
                if value > 0
            )
            res.error = (
                f"retrieval missed its {budget:g} s deadline in the {res.stage or 'asr'} step "
                f"(question {'known' if res.question else 'not yet known'}; {spent or 'nothing finished'})"
            )
            log.warning("%s", res.error)
        except asyncio.CancelledError as exc:
            why = str(exc.args[0]) if exc.args else "cancelled by its caller"
            res.error = f"cancelled in the {res.stage or 'asr'} step: {why}"
            # shielded: a second cancel while the row is written does not lose it
            await asyncio.shield(
                self._record(res, None, profile, conversation_id, asked_at, time.perf_counter() - start, cut=True)
            )
            raise
        if route is not None and not res.late:
            # one line without control or format characters, whatever router made it (tool output already is);
            # nothing left of it (blank, or only such characters) is no reference: the row is dropped "no_span"
            res.reference = (sanitize_text(route.reference, MAX_REFERENCE_CHARS) or None) if route.reference else None
            res.tool = route.tool
            res.arguments = dict(route.arguments)
            res.source = route.source
            res.llm_s, res.tool_s = route.llm_s, route.tool_s
            if res.reference is None and route.error:
                res.error = route.error
                res.stage = "tool" if route.tool else "router"
                log.warning("%s failed for %r: %s", res.stage, res.question, res.error)
        if not res.late and res.error is None:
            res.stage = None
        res.span_id = await self._record(res, route, profile, conversation_id, asked_at, time.perf_counter() - start)
        return res

    async def record_cut(
        self,
        *,
        why: str,
        asked_at: float,
        waited_s: float,
        profile: Profile | None = None,
        conversation_id: str | None = None,
    ) -> int | None:
        """Record a ``<ret>`` that its caller ended before asking :meth:`retrieve` (it was waiting for the user's
        utterance to end, or for its final transcript, when the conversation ended): its span row, the question not
        known, dropped ``cancelled`` with ``error`` "cancelled in the asr step: WHY", as a retrieval cut while it
        runs is recorded.

        Args:
            why: the reason, e.g. ``"conversation ended"``.
            asked_at: when the ``<ret>`` came, in seconds since the epoch (the row's ``asked_at``).
            waited_s: seconds from the ``<ret>`` to the cut (the row's ``latency_s``).
            profile, conversation_id: as for :meth:`retrieve`.

        Returns:
            The span row's id, as :attr:`SpanResult.span_id` is; None without a Context DB or conversation. Never
            raises for a database failure (logged).
        """
        res = SpanResult(stage="asr", error=f"cancelled in the asr step: {why}")
        # shielded: a cancel while the row is written does not lose it (as a running retrieval's cut)
        return await asyncio.shield(
            self._record(res, None, profile, conversation_id, asked_at, max(0.0, waited_s), cut=True)
        )

    async def _run(
        self,
        res: SpanResult,
        audio: np.ndarray | None,
        sample_rate: int | None,
        question: str | None,
        profile: Profile | None,
        agent_said: str,
        conversation_id: str | None,
        after_span: bool | None,
    ) -> RouteResult | None:
        if question is None:
            res.stage = "asr"
            question = await self._transcribe(res, audio, sample_rate)
            if question is None:
                return None
        res.question = sanitize_text(question, MAX_TRANSCRIPT_CHARS)
        if not res.question:
            return None
        # the context read and the router's own reads (the local router's facts) wait for the database at most
        # db_timeout_s together: one that does not answer costs the retrieval its context once, not its deadline
        db_due = contextlib.nullcontext()
        if self.db_timeout_s is not None:
            db_due = db_waits_due_by(asyncio.get_running_loop().time() + self.db_timeout_s)
        with db_due:
            res.stage = "context"
            t0 = time.perf_counter()
            try:
                conversation, history, profile = await self._context(res.question, profile, conversation_id)
            finally:
                res.context_s = time.perf_counter() - t0
            req = RouteRequest(
                question=res.question,
                profile=profile,
                agent_said=agent_said,
                history=history,
                conversation=conversation,
                after_span=after_span,
            )
            res.stage = "router"
            t0 = time.perf_counter()
            try:
                route = await self.router.route(req)
            except Exception as exc:
                res.error = f"router failed: {exc}"
                log.warning("router failed for %r: %s", res.question, exc)
                return None
            finally:
                res.route_s = time.perf_counter() - t0
        if route is not None and not isinstance(route, RouteResult):
            # a router of the caller's that answers something else is a failed route, not a crash of retrieve()
            res.error = f"router failed: {type(self.router).__name__}.route() returned {type(route).__name__}, not a RouteResult"
            log.warning("%s", res.error)
            return None
        return route

    async def _transcribe(self, res: SpanResult, audio: np.ndarray | None, sample_rate: int | None) -> str | None:
        if audio is None:
            res.error = "retrieve() needs audio or a question"
            return None
        if self.transcriber is None:
            res.error = "no transcriber configured (--asr none): the question cannot be heard; pass --asr"
            return None
        if not sample_rate or sample_rate <= 0:
            res.error = f"retrieve() got audio without a valid sample_rate ({sample_rate!r})"
            return None
        t0 = time.perf_counter()
        try:
            transcript = await self.transcriber.transcribe(audio, int(sample_rate))
        except Exception as exc:
            res.error = f"transcriber failed: {exc}"
            log.warning("transcriber failed: %s", exc)
            return None
        finally:
            res.asr_s = time.perf_counter() - t0
        text = transcript if isinstance(transcript, str) else getattr(transcript, "text", "")
        return str(text or "")

    async def _context(
        self, question: str, profile: Profile | None, conversation_id: str | None
    ) -> tuple[str, list[ToolCall], Profile | None]:
        """Working text, earlier tool calls and the profile; a failing DB only costs the context, and so does one
        that has not answered within ``db_timeout_s`` (its work, the question's turn included, goes on)."""
        memory = self._memory(profile, conversation_id)
        if memory is None or conversation_id is None:
            return "", list(self._calls.get(conversation_id, []))[-self.history :], profile
        job = self._enqueue(
            conversation_id,
            f"read the context of {question!r}",
            functools.partial(self._read_context, memory, question, profile, conversation_id),
        )
        if job is None:
            return "", [], profile
        try:
            async with asyncio.timeout(self.db_timeout_s):
                return await asyncio.shield(job)
        except TimeoutError:
            log.warning(
                "Context DB has not answered in %g s for conversation %s: routing %r without its context "
                "(its turn is written when the database answers)",
                self.db_timeout_s,
                conversation_id,
                question,
            )
            return "", [], profile

    async def _read_context(
        self, memory: UserMemory, question: str, profile: Profile | None, conversation_id: str
    ) -> tuple[str, list[ToolCall], Profile | None]:
        try:
            conv = await memory.aget_conversation(conversation_id)
            if conv is None:
                await memory.astart_conversation(conversation_id)
            if profile is None:
                profile = await memory.aget_profile()
            await memory.aadd_turn(conversation_id, "user", question, dedupe=True)
            spans = await memory.aspans(conversation_id, last=max(self.history, 1) * 4)
            history = [
                ToolCall(
                    question=s.question,
                    name=s.tool,
                    arguments=s.arguments,
                    result=_result_clause(s.text),
                    status="awaiting_confirmation" if s.source.startswith("confirm:") else "done",
                )
                for s in spans
                # a confirmation dropped before it was read (late, cancelled) was never asked: nothing awaits it
                if s.tool and s.text and not (s.source.startswith("confirm:") and s.dropped is not None)
            ][-self.history :]
            text = await memory.aworking_text(conversation_id, max_chars=self.context_chars, profile=profile)
            return text, history, profile
        except Exception as exc:
            log.warning("Context DB unavailable for conversation %s: %s", conversation_id, exc)
            return "", [], profile

    def _waiting(self, conversation_id: str) -> bool:
        """Whether a Context DB job of the conversation is still running (the database has not answered it)."""
        return any(not job.done() for job in self._jobs.get(conversation_id, ()))

    def _enqueue(self, conversation_id: str, what: str, work: Callable[[], Awaitable[T]]) -> asyncio.Task[T] | None:
        """Run ``work`` as the conversation's next Context DB job, once the jobs before it are done; None (logged)
        when :data:`MAX_PENDING_DB_JOBS` already wait. The job is never cancelled by the retrieval that awaits it
        (shielded): one given up on finishes in the background, and one that ends otherwise than by returning
        (cancelled at shutdown, a failure ``work`` did not catch) is logged."""
        jobs = [job for job in self._jobs.get(conversation_id, ()) if not job.done()]
        if len(jobs) >= MAX_PENDING_DB_JOBS:
            log.warning(
                "Context DB: %d jobs of conversation %s still wait for the database: did not %s (not recorded)",
                len(jobs),
                conversation_id,
                what,
            )
            return None
        before = jobs[-1] if jobs else None

        async def run() -> T:
            if before is not None:
                await asyncio.wait([before])
            return await work()

        job = asyncio.ensure_future(run())
        jobs.append(job)
        self._jobs[conversation_id] = jobs
        _LEFT_RUNNING.add(job)
        job.add_done_callback(functools.partial(self._job_done, conversation_id, what))
        return job

    def _job_done(self, conversation_id: str, what: str, job: asyncio.Task[Any]) -> None:
        _LEFT_RUNNING.discard(job)
        jobs = self._jobs.get(conversation_id)
        if jobs is not None:
            with contextlib.suppress(ValueError):
                jobs.remove(job)
            if not jobs:
                del self._jobs[conversation_id]
        if job.cancelled():
            log.warning("Context DB: could not %s: cancelled before the database answered", what)
        elif (exc := job.exception()) is not None:
            log.warning("Context DB: could not %s: %s", what, exc)

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for this retriever's Context DB jobs still running (span rows left to the background), at most
        ``timeout_s`` seconds (None: no limit). Returns whether none is left; never raises for their failures."""
        jobs = [job for jobs in self._jobs.values() for job in jobs if not job.done()]
        if jobs:
            await asyncio.wait(jobs, timeout=timeout_s)
        return not any(not job.done() for jobs in self._jobs.values() for job in jobs)

    async def _record(
        self,
        res: SpanResult,
        route: RouteResult | None,
        profile: Profile | None,
        conversation_id: str | None,
        asked_at: float,
        latency_s: float,
        *,
        cut: bool = False,
    ) -> int | None:
        """Write the retrieval's tool turns and span row (``cut``: cancelled before it finished, dropped
        ``cancelled``), waiting for it at most ``db_timeout_s`` (not at all behind a job the database has not
        answered): the span row's id; for a row left to be written in the background, its provisional id (negative:
        :meth:`~cspan.backends.context_db.UserMemory.provisional_span_id`; the outcome marked under it is written
        with the row), or None where no mark could reach it (a row that already has its outcome, a deprecated whole
        ContextDB); None when there is no row. A failing database is logged, never raised."""
        calls = route.calls if route is not None and not res.late else []
        memory = self._memory(profile, conversation_id)
        if memory is None or conversation_id is None:
            if calls:
                self._calls.setdefault(conversation_id, []).extend(calls)
                del self._calls[conversation_id][: -max(self.history, 1)]
            return None
        if not res.question and res.error is None:
            return None  # nothing was asked (empty transcript): not a retrieval worth a row
        dropped = None
        if cut:
            dropped = "cancelled"
        elif res.reference is None:
            dropped = "late" if res.late else "error" if res.error else "no_span"
        row = {
            "question": res.question,
            "text": res.reference,
            "tool": res.tool,
            "arguments": dict(res.arguments),
            "source": res.source,
            "asked_at": asked_at,
            "latency_s": latency_s,
            "error": res.error,
            "dropped": dropped,
        }
        behind = self.db_timeout_s is not None and self._waiting(conversation_id)
        what = f"record the span of {res.question!r}"
        job = self._enqueue(conversation_id, what, functools.partial(self._write, memory, conversation_id, calls, row))
        if job is None:
            return None
        # a row that may be left to the background gets a provisional id, so that its outcome (injected, late,
        # cancelled: marked by the caller under the id it is given) reaches it when it is written; only where the
        # marks use this same memory (not a deprecated whole ContextDB, which makes a memory per call). Taken once
        # the row is queued: a retrieval not recorded takes none, since a memory keeps only the newest
        # MAX_PROVISIONAL_SPANS ids and those of a long stall's unrecorded retrievals pushed out the waiting rows'.
        # The job reads ``row`` when it runs, after this (nothing is awaited in between).
        provisional = None
        if self.db_timeout_s is not None and memory is self.db and row["dropped"] is None:
            provisional = memory.provisional_span_id()
            row["provisional_id"] = provisional
        if not behind:
            try:
                async with asyncio.timeout(self.db_timeout_s):
                    return await asyncio.shield(job)
            except TimeoutError:
                pass
        log.warning(
            "Context DB has not answered %s for conversation %s: the span of %r is recorded when it answers%s",
            "an earlier call" if behind else f"in {self.db_timeout_s:g} s",
            conversation_id,
            res.question,
            " (its outcome with it)" if provisional is not None else " (without its outcome)",
        )
        return provisional

    async def _write(
        self, memory: UserMemory, conversation_id: str, calls: list[ToolCall], row: dict[str, Any]
    ) -> int | None:
        try:
            if await memory.aget_conversation(conversation_id) is None:
                await memory.astart_conversation(conversation_id)
            for call in calls:
                args = json.dumps(call.arguments, ensure_ascii=False, default=str, separators=(", ", ": "))
                await memory.aadd_turn(
                    conversation_id, "tool", f"{call.name}({args}) => {call.result[:240]}", meta={"tool": call.name}
                )
            return await memory.aadd_span(conversation_id, **row)
        except Exception as exc:
            log.warning("could not record the span in the Context DB: %s", exc)
            return None
