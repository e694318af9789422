"""What every HTTP server of the project (``cspan serve``, ``cspan asr-serve``, ``cspan tools serve --transport
http``) adds to uvicorn: a header timeout (uvicorn has none of its own, so a client that trickles its request
headers, "slowloris", would hold a connection for ever).

And the listening socket of all three (:func:`bind_socket`): a bad ``--host`` or a busy ``--port`` is one line
(:class:`~cspan.backends.errors.ListenError`, exit status 2) before a model or engine loads, not uvicorn's log line
and exit status 3.

``cspan.server`` imports them from here (``cspan.backends`` cannot import the server package).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from typing import Any

from cspan.backends.errors import ListenError

__all__ = ["bind_socket", "header_timeout_protocol", "uvicorn_http"]

log = logging.getLogger(__name__)


def header_timeout_protocol(timeout_s: float) -> type[Any]:
    """uvicorn's httptools HTTP protocol with a header timeout: a connection whose request line and headers are not
    complete ``timeout_s`` after it opened (or after its previous response) is closed, so that slowly trickling
    clients cannot hold connections forever. A request answered before its body was all received (a route that reads
    no body, such as a 405) has ``timeout_s`` more for the rest of it, which uvicorn reads and drops, and is closed
    then: uvicorn would keep the connection for as long as the client trickles it (every byte resets its keep-alive
    timer). The rest is not cut at once, so a client that sends its whole body before reading the answer reads it,
    rather than a connection reset.

    Raises:
        ImportError: httptools is not installed.
    """
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _timer: Any = None  # closes the connection unless disarmed within timeout_s

        def _arm(self, waiting_for: str) -> None:
            if self._timer is None:
                self._timer = self.loop.call_later(timeout_s, self._timeout, waiting_for)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _timeout(self, waiting_for: str) -> None:
            self._timer = None
            if not self.transport.is_closing():
                self.logger.info("closing a connection whose %s took over %g s", waiting_for, timeout_s)
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm("request headers")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm("request headers")

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if cycle is not None and cycle.more_body and not self.transport.is_closing():
                self._arm("answered request's remaining body")  # uvicorn reads and drops the rest

        def on_message_complete(self) -> None:
            super().on_message_complete()
            if self.cycle is not None and self.cycle.response_complete:
                self._disarm()  # the dropped body has ended: the connection goes on

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


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port``, not listening yet (uvicorn listens once the model or engine is
    loaded, so a client meanwhile gets "connection refused" rather than a hang): pass it as
    ``uvicorn.Server(config).run(sockets=[sock])``. Call it before loading anything, so that a bad ``--host`` or
    a busy ``--port`` is found in a second, not after minutes of loading.

    Raises:
        ListenError: naming the flag, the value and the cause.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        cause = exc.strerror if isinstance(exc, socket.gaierror) and exc.strerror else "not a valid host name"
        raise ListenError(
            f"--host {host!r}: not an address or a host name that resolves here ({cause}); use an address such "
            "as 127.0.0.1, 0.0.0.0 or ::1"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        cause = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(
                f"--port {port}: address already in use on {where} (another server?); stop it or pick another --port"
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ListenError(f"--host {host!r}: not an address of this machine ({cause})") from None
        if exc.errno == errno.EACCES:
            raise ListenError(
                f"--port {port}: permission denied on {where} (ports below 1024 need privileges)"
            ) from None
        raise ListenError(f"cannot listen on {where}: {cause}") from None
    return sock
