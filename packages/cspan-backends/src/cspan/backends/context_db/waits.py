"""One bound on how long a piece of work waits for the Context DB in all, across the callers it goes through.

A retrieval waits for the database in its context step and again in the router (the local router reads the user's
facts): against a database that does not answer (a frozen host) each wait bounded on its own would cost the
retrieval twice the bound, enough to miss its span deadline. :func:`db_waits_due_by` sets the time every wait inside
ends by; :func:`db_wait_s` is what a caller's own bound leaves of it.
"""

from __future__ import annotations

import asyncio
import contextlib

from cspan.backends.deadline import Deadline

_DUE = Deadline("cspan_context_db_due")


def db_waits_due_by(at: float) -> contextlib.AbstractContextManager[None]:
    """Waits for the Context DB made inside (by this task and the tasks it starts) end by ``at`` (``loop.time()``) at
    the latest; an outer bound that comes first stays."""
    return _DUE.by(at)


def db_wait_s(own: float | None) -> float | None:
    """Seconds a wait for the Context DB may last now: the caller's own bound ``own`` (None: none), or what is left
    until :func:`db_waits_due_by`'s time where that comes first (0 once it has passed). Call it in a running loop."""
    due = _DUE.get()
    if due is None:
        return own
    left = max(0.0, due - asyncio.get_running_loop().time())
    return left if own is None else min(own, left)
