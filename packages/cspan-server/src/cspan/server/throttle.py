"""How fast one client's messages are read, how long it may stay over that budget, and how many errors it is sent.

Every message a client sends costs the event loop that also runs every session's 80 ms frame clock (parsing,
base64, resampling), so one client that sends tens of thousands of small messages a second would take the clock
from everyone. A connection over its budget is not cut off at once: its next message is read later, so the socket's
buffers fill and TCP slows the client down to the budget, while the other sessions' frames keep their clock.
Real-time clients stay far below it: audio arrives in 10-100 ms pieces (10 to 100 messages and about 64 KB of
base64 pcm16 a second).

**The budget** is two token buckets (as a rate limiter such as nginx's ``limit_req`` keeps one) that may run into
one message's debt: messages, ``--max-messages-per-s`` a second with a burst of one second's worth, and bytes, 16
largest messages (``--max-message-kib``) a second with a burst of 32 of them, and at least a whole voice recording
(8 MiB, sent at once before a conversation: docs/PROTOCOL.md). A message read while a bucket is in debt waits until
both are out of it.

**Over the budget for 10 s** (:data:`OVER_BUDGET_END_S`): the connection's time is cut into windows of at least
:data:`WINDOW_S` (1 s, each closed by the first message read after it). A window is *saturated* when the budget held
back at least one of its messages and the connection waited for the client's next message for less than
:data:`BREAK_FRACTION` (a quarter) of it: the client's messages were queued all along. A client whose saturated
windows run for 10 s, from the first message held back, without an unsaturated one is ended (reason ``over_budget``,
close 1008; checked as each window closes, so 10 to 11 s after) with a message that says why: held back that long,
its own messages fill the connection's buffers ahead of its keepalive pongs, and the WebSocket layer would otherwise
close it as a server failure (1011, "keepalive ping timeout") 20-40 s later.

Counting the client's pauses, not the bucket's level, keeps the clock from being reset by the server's own delays: a
throttled sleep that overshoots, or the handling of a message, refills the bucket past zero (the clock of the
bucket's level restarted at almost every message on a busy 2-core machine, and never reached 10 s), and a busy event
loop refills it further, but the client's messages wait meanwhile, so the window stays saturated. Nor does a pause of
the client's of under a quarter of a second in a second reset it. A client within its budget on average (bursts,
then pauses of a quarter of a second or more in a second, or a slower pace) is never ended. One that went over and
then sends at the budget's pace keeps its backlog, and is over for as long as it does (over 10 s it sent more than
the budget's 10 s). A server too busy to read even the budget (every message held back by its own work, none by the
budget) ends no one this way; the keepalive (1011) does, 20-40 s later.

**Errors** (:class:`ErrorBudget`): at most :data:`ERROR_BURST` (50) ``error`` messages at once and
:data:`ERROR_RATE` (10) a second after that are sent to one session's client; the others are counted (in
``stats.errors`` and ``cspan_protocol_errors_total``) but not sent, and the next error sent says how many were left
out before it. A flood of bad messages is therefore not amplified into the server's own send buffer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cspan.backends.rate import TokenBucket

BYTE_RATE_MESSAGES = 16
"""The byte budget per second, in largest messages (``--max-message-kib``): 4 MiB/s at the default 256 KiB."""
BYTE_BURST_MESSAGES = 32
"""The byte burst, in largest messages (8 MiB at the default)."""
OVER_BUDGET_END_S = 10.0
"""Seconds of saturated windows without a break before a client's session is ended (reason ``over_budget``):
under the WebSocket keepalive's 20 s ping interval, so the client hears why."""
WINDOW_S = 1.0
"""The least length of a window of the over-budget clock (seconds)."""
BREAK_FRACTION = 0.25
"""A window in which the connection waited for the client's next message for at least this fraction of it is a
break: the client's messages were not queued."""
ERROR_BURST = 50
"""``error`` messages sent to one client at once (then :data:`ERROR_RATE` a second)."""
ERROR_RATE = 10.0
"""``error`` messages sent to one client a second after :data:`ERROR_BURST`."""


class ClientBudget:
    """The message and byte budget of one connection, and how long it has stayed over it (module docstring).

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
        byte_burst = max(BYTE_BURST_MESSAGES * max_message_bytes, min_burst_bytes)
        self._buckets = (
            TokenBucket(messages_per_s, messages_per_s, clock),
            TokenBucket(BYTE_RATE_MESSAGES * max_message_bytes, byte_burst, clock),
        )
        self._clock = clock
        self._window_start = clock()
        self._window_held: float | None = None  # when the budget first held back a message of this window
        self._window_waited = 0.0  # seconds of this window the connection waited for the client's next message
        self._over_since: float | None = None  # the first message held back in the saturated windows running now
        self._over_until = 0.0  # the end of the last of them

    def charge(self, size: int, waited_s: float = 0.0) -> float:
        """Charge one message of ``size`` bytes, read after the connection waited ``waited_s`` seconds for it;
        returns the seconds to wait before handling it (0.0: handle it now), the time until both budgets are out
        of debt again."""
        wait = max(bucket.charge(cost) for bucket, cost in zip(self._buckets, (1.0, float(size)), strict=True))
        now = self._clock()
        if wait > 0.0 and self._window_held is None:
            self._window_held = now
        self._window_waited += max(0.0, waited_s)
        length = now - self._window_start
        if length >= WINDOW_S:
            if self._window_held is not None and self._window_waited < BREAK_FRACTION * length:
                if self._over_since is None:
                    self._over_since = self._window_held
                self._over_until = now
            else:
                self._over_since = None
            self._window_start, self._window_held, self._window_waited = now, None, 0.0
        return wait

    def over_s(self) -> float:
        """Seconds of saturated windows without a break, as of the last window closed (0.0: none running)."""
        return 0.0 if self._over_since is None else self._over_until - self._over_since


class ErrorBudget:
    """How many ``error`` messages one session's client is sent (module docstring): :data:`ERROR_BURST` at once,
    :data:`ERROR_RATE` a second after that.

    Args:
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._bucket = TokenBucket(ERROR_RATE, ERROR_BURST, clock)
        self._unsent = 0

    def admit(self) -> int | None:
        """One more error: None when it is not to be sent (counted), else how many were not sent before it."""
        if not self._bucket.take():
            self._unsent += 1
            return None
        unsent, self._unsent = self._unsent, 0
        return unsent


__all__ = [
    "BREAK_FRACTION",
    "BYTE_BURST_MESSAGES",
    "BYTE_RATE_MESSAGES",
    "ERROR_BURST",
    "ERROR_RATE",
    "OVER_BUDGET_END_S",
    "WINDOW_S",
    "ClientBudget",
    "ErrorBudget",
]
