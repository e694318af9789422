"""Every Context DB call of ``cspan serve``, off the event loop: one small pool of threads, and per session an
ordered queue of writes that holds the session's messages until the write before them is committed.

Why: the event loop runs the 80 ms frame loop of every conversation, the handshakes and ``/health``. A statement
run there, or awaited by the frame loop, stalls all of them for as long as the database takes: forever, for a
PostgreSQL that stops answering without closing its connections (a frozen process or host; TCP never gives up
while its kernel acknowledges). And asyncio's default executor is shared with other work (voice activity
detectors, voice recordings, tools): threads stuck on the database must not be the ones that work waits for.

- :class:`DBCalls` (one per :class:`~cspan.server.session.SessionHub`) owns :class:`DBExecutor`:
  :data:`DB_THREADS` threads named ``cspan-db-N``, where every Context DB and identity call of ``cspan serve``
  runs. It is the database's :attr:`~cspan.backends.context_db.ContextDB.executor`, so the retriever's and the
  memory tools' ``a``-methods and the token lookups run there too; :meth:`DBCalls.within` bounds a call the
  server waits for by ``--db-wait-s``.
- :class:`SessionWrites` (one per session): the session's writes run in the order they were queued, one at a time,
  on that pool; the frame loop only queues them. A message the session puts for its client while one of its
  writes is pending is held, in order, behind that write, and sent once the write is done (committed, or failed
  and logged): what a client has seen is committed, and the order the client sees is the session's. With no write
  pending a message goes straight to the outbox. When a write has not completed within ``--db-wait-s`` the session
  stops holding (one warning) and sends what it held; its writes stay queued in order (at most
  :data:`WRITES_PER_SESSION`; a write beyond is dropped, logged once a wait and counted) and go through when the
  database answers again, after which holding resumes. A write that fails is logged once per streak of failures
  (the first one, with its error; the others at debug level), and the first success after them says how many
  failed: a PostgreSQL restart logs two lines a session, not one per write.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, TypeVar

from cspan.backends.context_db.workers import run_in

logger = logging.getLogger(__name__)

T = TypeVar("T")

DB_THREADS = 4
"""Threads of the pool. On PostgreSQL the Context DB has a pool of connections, more than these threads
(:data:`cspan.backends.context_db.connection.POOL_SIZE`), so each thread runs its statements at once with the others
and a slow one holds up only its own; on SQLite it has one connection, which runs one statement at a time. A few
threads let a session's write, a token lookup and a retrieval's read go on without one waiting for a thread behind
the others. A session has at most one write in the pool at a time."""
WRITES_PER_SESSION = 256
"""Writes a session may have queued while the database does not answer (about a minute of a busy conversation);
a write beyond is dropped (logged, counted in ``cspan_db_write_failures_total{reason="dropped"}``)."""


class DBExecutor(Executor):
    """A fixed pool of ``threads`` daemon threads named ``{name}-N`` (a :class:`concurrent.futures.Executor`).

    Not a :class:`~concurrent.futures.ThreadPoolExecutor`: Python joins that one's threads at exit, so a process
    whose thread waits on a database that never answers would never exit (not even on SIGTERM). A daemon thread
    stuck so is left behind when the process ends; the database rolls its transaction back.
    """

    def __init__(self, threads: int = DB_THREADS, name: str = "cspan-db") -> None:
        self._work: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on the next free thread, in the order submitted.

        Raises:
            RuntimeError: after :meth:`shutdown`.
        """
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the Context DB's threads were shut down")
            self._work.put((future, functools.partial(fn, *args, **kwargs)))
        return future

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while it waited for a thread
            try:
                result = call()
            except BaseException as exc:  # handed to whoever awaits it, as ThreadPoolExecutor does
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more work; with ``cancel_futures`` drop what waits for a thread; with ``wait`` join the threads
        (each after its running call: do not wait on a database that does not answer)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if cancel_futures:
                with contextlib.suppress(queue.Empty):
                    while True:
                        item = self._work.get_nowait()
                        if item is not None:
                            item[0].cancel()
            for _ in self._threads:
                self._work.put(None)
        if wait:
            for thread in self._threads:
                thread.join()


class DBCalls:
    """The Context DB calls of one hub: the pool, the bound, and every session's write queue.

    Args:
        wait_s: ``--db-wait-s``: how long a session holds its messages behind a write, and a call the server
            waits for (:meth:`within`) may take, in seconds.
        metrics: the :class:`~cspan.server.metrics.ServerMetrics` (``cspan_db_*``).
        threads: the pool's size.
    """

    def __init__(self, wait_s: float, metrics: Any, *, threads: int = DB_THREADS) -> None:
        self.wait_s = wait_s
        self.metrics = metrics
        self.executor = DBExecutor(threads)
        self._busy: set[SessionWrites] = set()  # the queues with a write pending (sessions ended included)

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` (a Context DB read) on the pool; unbounded (see :meth:`within`).

        Raises:
            What ``fn`` raises.
        """
        return await run_in(self.executor, fn, *args, **kwargs)

    async def within(self, call: Awaitable[T]) -> T:
        """``await call`` for at most ``wait_s`` seconds (the thread a database call took stays with it: the pool
        runs it to its end, or drops it if it never got a thread).

        Raises:
            TimeoutError: the database did not answer in time (the message says so, for logs and clients' errors);
            what ``call`` raises.
        """
        try:
            return await asyncio.wait_for(call, self.wait_s)
        except TimeoutError:
            raise TimeoutError(f"the Context DB did not answer within {self.wait_s:g} s (--db-wait-s)") from None

    def session(self, name: str, *, send: Callable[[Any], None], on_forgotten: Callable[[], None]) -> SessionWrites:
        """A session's write queue (see :class:`SessionWrites`)."""
        return SessionWrites(self, name, send=send, on_forgotten=on_forgotten)

    async def close(self, timeout_s: float) -> None:
        """Give the writes still queued, of every session, up to ``timeout_s`` seconds; then log what is left (given
        up: counted as dropped; one running goes on on its daemon thread while the process lives) and stop the
        pool."""
        busy = list(self._busy)
        if busy:
            await asyncio.gather(*(writes.settle(timeout_s) for writes in busy))
        left = {writes: writes.pending for writes in self._busy if writes.pending}
        if left:
            logger.warning(
                "Context DB: gave up %d write(s) of %d session(s): the database did not answer within %g s of the "
                "shutdown",
                sum(left.values()),
                len(left),
                timeout_s,
            )
            self.metrics.db_write_failures.labels("dropped").inc(sum(left.values()))
        self.executor.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Write:
    seq: int
    what: str
    call: Callable[[], Any]
    queued: float  # loop time


class SessionWrites:
    """One session's Context DB writes, in order, and the messages held behind them (see the module docstring).

    Args:
        calls: the hub's :class:`DBCalls`.
        name: the session, for logs.
        send: delivers one message to the session's outbox (a held one, when its write is done).
        on_forgotten: called once when a write is refused because the user was forgotten
            (:class:`~cspan.backends.context_db.UserForgotten`); the writes queued behind it are dropped, and any
            queued later too (each would be refused).
    """

    def __init__(
        self, calls: DBCalls, name: str, *, send: Callable[[Any], None], on_forgotten: Callable[[], None]
    ) -> None:
        self._calls = calls
        self._name = name
        self._send = send
        self._on_forgotten = on_forgotten
        self._queue: collections.deque[_Write] = collections.deque()  # the first one is running
        self._held: collections.deque[tuple[int, Any]] = collections.deque()  # (the write it waits for, message)
        self._seq = 0
        self._stalled = False  # the first write outlived the bound: messages are not held until the queue empties
        self._dropped = 0  # writes dropped in this wait (queue full)
        self._refused = False
        self._failed = 0  # writes failed in a row (the first logged as a warning, the others at debug level)
        self._timer: asyncio.TimerHandle | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def pending(self) -> int:
        """Writes queued and not done (the running one included)."""
        return len(self._queue)

    def write(self, what: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        """Queue ``fn(*args, **kwargs)`` (a Context DB write) after the session's earlier writes; returns at once.
        ``what`` completes the log line of a failure: ``session {name}: Context DB: could not {what}: {error}``."""
        if self._refused:
            return
        metrics = self._calls.metrics
        if len(self._queue) >= WRITES_PER_SESSION:
            metrics.db_write_failures.labels("dropped").inc()
            if not self._dropped:
                logger.warning(
                    "session %s: %d Context DB writes wait for the database already; this one (%s) and those after "
                    "it, until it answers, are dropped: not recorded",
                    self._name,
                    WRITES_PER_SESSION,
                    what,
                )
            self._dropped += 1
            return
        self._seq += 1
        loop = asyncio.get_running_loop()
        self._queue.append(_Write(self._seq, what, functools.partial(fn, *args, **kwargs), loop.time()))
        metrics.db_writes_pending.inc()
        if len(self._queue) == 1:
            self._idle.clear()
            self._calls._busy.add(self)
            self._start(loop)

    def hold(self, message: Any) -> bool:
        """Hold ``message`` behind the writes queued so far, if one is pending and the bound has not passed
        (True); False: send it now."""
        if not self._queue or self._stalled:
            return False
        self._held.append((self._seq, message))
        return True

    async def settle(self, timeout: float) -> bool:
        """Wait until no write is pending, at most ``timeout`` seconds; whether none is."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self._idle.is_set()

    # -- on the event loop --------------------------------------------------------------------------------------

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the first queued write on the pool; until the bound passes, the messages stay held behind it."""
        head = self._queue[0]
        try:
            done = asyncio.wrap_future(self._calls.executor.submit(head.call), loop=loop)
        except RuntimeError:  # the pool was shut down (DBCalls.close, which counted these as given up)
            self._calls.metrics.db_writes_pending.dec(len(self._queue))
            self._queue.clear()
            self._stalled = False  # not "answers again": given up
            self._finish()
            return
        done.add_done_callback(functools.partial(self._done, head))
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None if self._stalled else loop.call_at(head.queued + self._calls.wait_s, self._expire)

    def _done(self, head: _Write, done: asyncio.Future[Any]) -> None:
        from cspan.backends.context_db import UserForgotten

        metrics = self._calls.metrics
        self._queue.popleft()
        metrics.db_writes_pending.dec()
        metrics.db_write_seconds.observe(asyncio.get_running_loop().time() - head.queued)
        error = None if done.cancelled() else done.exception()  # cancelled: by DBCalls.close, which counted it
        if isinstance(error, UserForgotten):
            self._refused = True
            metrics.db_writes_pending.dec(len(self._queue))
            self._queue.clear()
            self._on_forgotten()
        elif error is not None:
            metrics.db_write_failures.labels("failed").inc()
            self._failed += 1
            if self._failed == 1:  # the first of a streak; the others only at debug level (a restart fails them all)
                logger.warning("session %s: Context DB: could not %s: %s", self._name, head.what, error)
            else:
                logger.debug(
                    "session %s: Context DB: could not %s either (%d in a row): %s",
                    self._name,
                    head.what,
                    self._failed,
                    error,
                )
        elif self._failed:
            logger.warning(
                "session %s: the Context DB writes again; %d write(s) in a row had failed before (not recorded)",
                self._name,
                self._failed,
            )
            self._failed = 0
        while self._held and self._held[0][0] <= head.seq:
            self._send(self._held.popleft()[1])
        if self._queue:
            self._start(asyncio.get_running_loop())
        else:
            self._finish()

    def _finish(self) -> None:
        """No write is pending any more: send what is still held (behind writes dropped), hold again from now."""
        while self._held:
            self._send(self._held.popleft()[1])
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._stalled:
            logger.warning(
                "session %s: the Context DB answers again; the writes of the wait are written%s",
                self._name,
                f" ({self._dropped} were dropped)" if self._dropped else "",
            )
        self._stalled = False
        self._dropped = 0
        self._calls._busy.discard(self)
        self._idle.set()

    def _expire(self) -> None:
        """The first write outlived the bound: send what is held and hold nothing until the queue empties."""
        self._timer = None
        if not self._queue or self._stalled:
            return
        self._stalled = True
        logger.warning(
            "session %s: the Context DB has not answered in %g s; what the client sees meanwhile may not be recorded "
            "(its writes wait, in order, for the database)",
            self._name,
            self._calls.wait_s,
        )
        while self._held:
            self._send(self._held.popleft()[1])


__all__ = ["DB_THREADS", "WRITES_PER_SESSION", "DBCalls", "DBExecutor", "SessionWrites"]
