"""How fast one client's messages are read: a budget of messages and bytes per second for each connection.

Every message a client sends costs the event loop that also runs every session's 80 ms frame clock (parsing,
base64, resampling), so one client that sends tens of thousands of small messages a second would take the clock
from everyone. A connection over its budget is not cut off: its next message is read later, so the socket's buffers
fill and TCP slows the client down to the budget, while the other sessions' frames keep their clock. Real-time
clients stay far below it: audio arrives in 10-100 ms pieces (10 to 100 messages and about 64 KB of base64 pcm16
a second). A client that stays over its budget for :data:`OVER_BUDGET_END_S` is ended (reason ``over_budget``,
close 1008) with a message that says why: held back that long, its own messages fill the connection's buffers ahead
of its keepalive pongs, and the WebSocket layer would otherwise close it as a server failure (1011, "keepalive
ping timeout") 20-40 s later.

The budget is two token buckets (as a rate limiter such as nginx's ``limit_req`` keeps one): messages,
``--max-messages-per-s`` a second with a burst of one second's worth, and bytes, 16 largest messages
(``--max-message-kib``) a second with a burst of 32 of them, and at least a whole voice recording (8 MiB, sent at
once before a conversation: docs/PROTOCOL.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable

BYTE_RATE_MESSAGES = 16
"""The byte budget per second, in largest messages (``--max-message-kib``): 4 MiB/s at the default 256 KiB."""
BYTE_BURST_MESSAGES = 32
"""The byte burst, in largest messages (8 MiB at the default)."""
OVER_BUDGET_END_S = 10.0
"""Seconds a client may stay over its budget without a break before its session is ended (reason ``over_budget``):
under the WebSocket keepalive's 20 s ping interval, so the client hears why."""


class ClientBudget:
    """The message and byte budget of one connection (token buckets that may run into debt).

    Args:
        messages_per_s: messages a second, also the burst (one second's worth).
        max_message_bytes: the largest message a client may send; the byte rate and burst are
            :data:`BYTE_RATE_MESSAGES` and :data:`BYTE_BURST_MESSAGES` of them.
        min_burst_bytes: the least byte burst (a whole voice recording).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(
        self,
        messages_per_s: float,
        max_message_bytes: int,
        min_burst_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if messages_per_s <= 0 or max_message_bytes <= 0:
            raise ValueError(f"ClientBudget: rates must be > 0, got {messages_per_s}, {max_message_bytes}")
        self._rates = (float(messages_per_s), float(BYTE_RATE_MESSAGES * max_message_bytes))
        self._bursts = (float(messages_per_s), float(max(BYTE_BURST_MESSAGES * max_message_bytes, min_burst_bytes)))
        self._left = list(self._bursts)
        self._clock = clock
        self._then = clock()
        self._over_since: float | None = None  # when the client went over its budget, None while within it

    def charge(self, size: int) -> float:
        """Charge one message of ``size`` bytes; returns the seconds to wait before reading it (0.0: read it now),
        the time until both budgets are out of debt again."""
        now = self._clock()
        elapsed, self._then = max(0.0, now - self._then), now
        wait = 0.0
        for k, cost in enumerate((1.0, float(size))):
            self._left[k] = min(self._bursts[k], self._left[k] + elapsed * self._rates[k]) - cost
            wait = max(wait, -self._left[k] / self._rates[k])
        if wait <= 0.0:
            self._over_since = None
        elif self._over_since is None:
            self._over_since = now
        return wait

    def over_s(self) -> float:
        """Seconds the client has stayed over its budget without a break, as of the last :meth:`charge` (0.0
        within it)."""
        return 0.0 if self._over_since is None else self._then - self._over_since


__all__ = ["BYTE_BURST_MESSAGES", "BYTE_RATE_MESSAGES", "OVER_BUDGET_END_S", "ClientBudget"]
