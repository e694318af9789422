"""Where the Context DB's coroutines (the ``a``-methods) run their statements: a worker thread, never the event loop.

By default that is asyncio's default executor (:func:`asyncio.to_thread`). A server passes its own
(:attr:`ContextDB.executor <cspan.backends.context_db.ContextDB.executor>`): a database that stops answering
without closing its connections (a frozen host) holds every thread that waits on it, and on the shared default
executor those threads are the ones unrelated work needs too.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")


async def run_in(executor: Executor | None, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a worker thread of ``executor`` (None: asyncio's default executor, as
    :func:`asyncio.to_thread`), awaited without blocking the event loop; the context variables go along, as with
    ``to_thread``. Cancelling the await leaves a call that already started running to its end (a thread cannot be
    stopped) and drops one still waiting for a thread.

    Raises:
        What ``fn`` raises; RuntimeError: ``executor`` was shut down.
    """
    if executor is None:
        return await asyncio.to_thread(fn, *args, **kwargs)
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(executor, call)


__all__ = ["run_in"]
