"""What every HTTP server of the project (``cspan serve``, ``cspan asr-serve``, ``cspan tools serve --transport
http``) adds to uvicorn: a header timeout (uvicorn has none of its own, so a client that trickles its request
headers, "slowloris", would hold a connection for ever).

``cspan.server`` imports it from here (``cspan.backends`` cannot import the server package).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["header_timeout_protocol", "uvicorn_http"]

log = logging.getLogger(__name__)


def header_timeout_protocol(timeout_s: float) -> type[Any]:
    """uvicorn's httptools HTTP protocol with a header timeout: a connection whose request line and headers are not
    complete ``timeout_s`` after it opened (or after its previous response) is closed, so that slowly trickling
    clients cannot hold connections forever.

    Raises:
        ImportError: httptools is not installed.
    """
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: Any = None

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.logger.info("closing a connection whose request headers took over %g s", timeout_s)
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def uvicorn_http(header_timeout_s: float) -> Any:
    """The ``http`` argument of ``uvicorn.Config``: :func:`header_timeout_protocol`, or ``"auto"`` with a warning
    when httptools is missing (``pip install 'uvicorn[standard]'``)."""
    try:
        return header_timeout_protocol(header_timeout_s)
    except ImportError:
        log.warning("httptools is not installed: no HTTP header timeout (install uvicorn[standard])")
        return "auto"
