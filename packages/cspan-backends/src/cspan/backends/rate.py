"""A token bucket: ``rate`` tokens a second up to ``burst`` (the rate limits of ``cspan serve``'s clients,
:mod:`cspan.server.throttle`, and of an MCP server's stderr, :class:`cspan.backends.tools.mcp_stdio.StderrLog`)."""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """``rate`` tokens a second up to ``burst``; :meth:`charge` may run into debt, :meth:`take` may not.

    Args:
        rate: tokens a second (> 0).
        burst: the most tokens held (and the tokens at first).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"TokenBucket: rate and burst must be > 0, got {rate}, {burst}")
        self.rate, self.burst = float(rate), float(burst)
        self._left = self.burst
        self._clock = clock
        self._then = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._left = min(self.burst, self._left + max(0.0, now - self._then) * self.rate)
        self._then = now

    def charge(self, cost: float) -> float:
        """Take ``cost`` tokens, into debt if need be; returns the seconds until the bucket is out of debt (0.0:
        it is not in debt)."""
        self._refill()
        self._left -= cost
        return max(0.0, -self._left / self.rate)

    def take(self, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens if the bucket holds them (True), else take nothing (False)."""
        self._refill()
        if self._left < cost:
            return False
        self._left -= cost
        return True


__all__ = ["TokenBucket"]
