"""A deadline a caller hands down to the work it starts, through the asyncio task context (``contextvars``): the
work inside, in this task and the tasks it starts, sees the nearest of its callers' deadlines."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar


class Deadline:
    """One kind of deadline, as the event loop's clock (``loop.time()``); ``name`` names its context variable."""

    def __init__(self, name: str) -> None:
        self._at: ContextVar[float | None] = ContextVar(name, default=None)

    def get(self) -> float | None:
        """The nearest deadline set around the caller, or None."""
        return self._at.get()

    @contextlib.contextmanager
    def by(self, at: float) -> Iterator[None]:
        """The work inside ends by ``at`` at the latest; an outer deadline that comes first stays."""
        outer = self._at.get()
        token = self._at.set(at if outer is None else min(outer, at))
        try:
            yield
        finally:
            self._at.reset(token)
