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
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

AFTER_CLOSE_BYTES = 64 * 1024
"""Bytes a connection is read after the server's close frame before it is no longer read (about 0.7 s of a client's
pcm16 audio still in flight, or one socket read)."""
AFTER_CLOSE_GRACE_S = 2.0
"""Seconds between no longer reading a connection and closing it: for the server's close frame to reach the peer."""


class WebSocketProtocol(WebSocketsSansIOProtocol):
    """``websockets-sansio`` whose reading after the server's close frame is bounded (module docstring); pass as
    uvicorn's ``ws`` (:func:`cspan.server.serve.uvicorn_config`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._after_close = 0  # bytes received since the server's close frame

    def data_received(self, data: bytes) -> None:
        if self.close_sent:
            self._after_close += len(data)
            if self._after_close > AFTER_CLOSE_BYTES:
                if not self.transport.is_closing():
                    self.transport.pause_reading()
                    self.loop.call_later(AFTER_CLOSE_GRACE_S, self.transport.close)
                return
        super().data_received(data)


__all__ = ["AFTER_CLOSE_BYTES", "AFTER_CLOSE_GRACE_S", "WebSocketProtocol"]
