"""uvicorn's WebSocket protocol with a bound on what a connection is read after the server's close frame.

uvicorn (``websockets-sansio``, its default with ``websockets`` installed) keeps reading a connection after the
application closes it, to receive the peer's close frame (RFC 6455 §7.1.1), for up to 10 s, and parses every message
that arrives meanwhile only to drop it. A client that floods its connection (ended ``over_budget``:
docs/PROTOCOL.md) has its socket's whole backlog behind that close frame, often megabytes of tiny messages, and
parsing them is Python work on the event loop: on the 2-core development machine 1-byte messages held every other
session's frames and ``/health`` for about 2.5 s each time one flooder was ended.

:class:`WebSocketProtocol` reads at most :data:`AFTER_CLOSE_BYTES` after the server's close frame. A peer that sends
more is not read any further: its connection closes :data:`AFTER_CLOSE_GRACE_S` later (its close frame and what the
server sent before it go out first), unparsed. A peer that answers the close promptly, as every client does, is
not affected.

It also tells the app when the WebSocket keepalive closed a connection: uvicorn closes a connection whose peer did
not answer a ping within ``ws_ping_timeout`` (close 1011) and reports only its loss (1005 or 1006, once the transport
has flushed) to the app. :class:`WebSocketProtocol` first queues a ``websocket.disconnect`` whose reason is
:data:`KEEPALIVE_TIMEOUT`: a client that stops reading its socket never reads the ping, and the app ends its session
as ``slow_client`` (docs/PROTOCOL.md).

Every close of its transport is bounded: asyncio's ``close()`` waits until the buffered data is sent, which never
happens for a peer that stopped reading (its window stays shut, and the socket and its buffer were kept for as long as
the peer's kernel acknowledged). What is still unsent :data:`CLOSE_FLUSH_S` after a close is dropped (``abort()``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

AFTER_CLOSE_BYTES = 64 * 1024
"""Bytes a connection is read after the server's close frame before it is no longer read (about 0.7 s of a client's
pcm16 audio still in flight, or one socket read)."""
AFTER_CLOSE_GRACE_S = 2.0
"""Seconds between no longer reading a connection and closing it: for the server's close frame to reach the peer."""
CLOSE_FLUSH_S = 10.0
"""Seconds a closed connection has to send what it still buffers (the server's last messages and its close frame)
before it is aborted: a reading peer needs milliseconds; one that stopped reading would hold the socket forever."""
KEEPALIVE_TIMEOUT = "keepalive ping timeout"
"""The reason of the ``websocket.disconnect`` queued when the keepalive closes a connection (uvicorn's close reason)."""


class BoundedCloseTransport:
    """``transport`` whose ``close()`` also aborts it :data:`CLOSE_FLUSH_S` later (a no-op once the buffer was sent
    and the connection is gone); every other attribute is the transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self.abort_timer: asyncio.TimerHandle | None = None

    def close(self) -> None:
        self._transport.close()
        if self.abort_timer is None:
            self.abort_timer = self._loop.call_later(CLOSE_FLUSH_S, self._transport.abort)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class WebSocketProtocol(WebSocketsSansIOProtocol):
    """``websockets-sansio`` whose reading after the server's close frame is bounded and whose keepalive closes are
    reported to the app (module docstring); pass as uvicorn's ``ws`` (:func:`cspan.server.serve.uvicorn_config`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._after_close = 0  # bytes received since the server's close frame

    def connection_made(self, transport: Any) -> None:
        super().connection_made(BoundedCloseTransport(transport, self.loop))

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)  # (closes the transport again: a no-op)
        timer = getattr(self.transport, "abort_timer", None)
        if timer is not None:  # nothing is left to abort
            timer.cancel()

    def data_received(self, data: bytes) -> None:
        if self.close_sent:
            self._after_close += len(data)
            if self._after_close > AFTER_CLOSE_BYTES:
                if not self.transport.is_closing():
                    self.transport.pause_reading()
                    self.loop.call_later(AFTER_CLOSE_GRACE_S, self.transport.close)
                return
        super().data_received(data)

    def keepalive_timeout(self) -> None:
        if not (self.close_sent or self.transport.is_closing()):  # uvicorn closes the connection below
            self.queue.put_nowait({"type": "websocket.disconnect", "code": 1011, "reason": KEEPALIVE_TIMEOUT})
        super().keepalive_timeout()


__all__ = [
    "AFTER_CLOSE_BYTES",
    "AFTER_CLOSE_GRACE_S",
    "CLOSE_FLUSH_S",
    "KEEPALIVE_TIMEOUT",
    "BoundedCloseTransport",
    "WebSocketProtocol",
]
