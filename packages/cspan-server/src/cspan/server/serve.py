"""``cspan serve``: live conversations over WebSocket, several at once on one batched engine.

This module is the command and its uvicorn wiring. The parts, one concern each:

- :mod:`cspan.server.serve_settings`: the settings, declared once (flags, ``CSPAN_*``, ``--config``);
- :mod:`cspan.server.session`: the session core (slots, the 80 ms frame loop, personas, spans, records) and the
  contract protocol adapters follow; :mod:`cspan.server.engine_thread`: every engine call, on one thread;
- :mod:`cspan.server.adapters`: one module per wire protocol (``/ws``: :mod:`cspan.server.adapters.ws`;
  ``/api/chat``: :mod:`cspan.server.adapters.moshi`), :mod:`cspan.server.opus` (Ogg/Opus through sphn);
- :mod:`cspan.server.app`: the app, the page and HTTP routes, the Host guard, the connection runner;
- :mod:`cspan.server.auth`, :mod:`cspan.server.metrics`, :mod:`cspan.server.records`: access control, Prometheus
  metrics, Context DB records.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import threading
from typing import Any

from cspan.server.app import create_app
from cspan.server.protocol import MAX_WEBSOCKET_MESSAGE_BYTES
from cspan.server.serve_settings import ServeSettings
from cspan.server.session import SessionHub

logger = logging.getLogger(__name__)


class _RedactTokens(logging.Filter):
    """Remove ``token=...`` from uvicorn's access log lines."""

    _pattern = re.compile(r"(token=)[^&\s\"]*")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self._pattern.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
        return True


def header_timeout_protocol(timeout_s: float) -> type[Any]:
    """uvicorn's httptools HTTP protocol with a header timeout: a connection whose request line and headers are not
    complete ``timeout_s`` after it opened (or after its previous response) is closed, so that slowly trickling
    clients cannot hold connections forever (uvicorn has no such timeout of its own).

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


def uvicorn_config(app: Any, settings: ServeSettings, **overrides: Any) -> Any:
    """The uvicorn configuration ``cspan serve`` uses: WebSocket size limit, no compression of audio, the header
    timeout (``settings.header_timeout_s``), tokens redacted from the access log."""
    import uvicorn

    for name in ("uvicorn.access", "uvicorn.error"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _RedactTokens) for f in log.filters):
            log.addFilter(_RedactTokens())
    try:
        http: Any = header_timeout_protocol(settings.header_timeout_s)
    except ImportError:
        logger.warning("httptools is not installed: no HTTP header timeout (install uvicorn[standard])")
        http = "auto"
    kwargs: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "http": http,
        "ws_max_size": MAX_WEBSOCKET_MESSAGE_BYTES,
        "ws_per_message_deflate": False,
        "ws_ping_interval": 20.0,
        "ws_ping_timeout": 20.0,
        "timeout_keep_alive": 5,
        "lifespan": "on",
        "timeout_graceful_shutdown": 5,
        "log_level": "info",
    }
    kwargs.update(overrides)
    return uvicorn.Config(app, **kwargs)


def make_server(config: Any) -> Any:
    """A ``uvicorn.Server`` for ``config`` that ends every session (reason ``shutdown``) before uvicorn closes the
    connections (plain uvicorn would close them with 1012 first)."""
    import uvicorn

    class _ServeServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            app = self.config.loaded_app if self.config.loaded else self.config.app
            hub = _find_hub(app)
            if hub is not None:
                with contextlib.suppress(Exception):
                    await hub.end_all("shutdown")
            await super().shutdown(sockets=sockets)

    return _ServeServer(config)


def _find_hub(app: Any) -> SessionHub | None:
    for _ in range(8):  # unwrap uvicorn's middleware wrappers
        state = getattr(app, "state", None)
        hub = getattr(state, "hub", None) if state is not None else None
        if isinstance(hub, SessionHub):
            return hub
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


def serve_command(parser: argparse.ArgumentParser) -> None:
    """Serve live conversations in the browser over WebSocket (several at once on one batched engine)."""
    from cspan.core.settings import add_settings_arguments

    add_settings_arguments(parser, ServeSettings)
    parser.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    from cspan.core.settings import settings_from_args
    from cspan.server.auth import ServeConfigError, check_bind
    from cspan.server.settings_common import check_backends_answer

    settings: ServeSettings = settings_from_args(args)
    check_bind(settings.host, settings.token, insecure_no_token=settings.insecure_no_token)
    if settings.test_hooks:
        logger.warning("test hooks are enabled (--test-hooks): clients may force <ret> and spans")
    loaded: dict[str, Any] = {}

    def load() -> None:
        try:
            loaded["app"] = create_app(settings)
        except BaseException as exc:  # re-raised on the main thread
            loaded["error"] = exc

    loader = threading.Thread(target=load, name="cspan-load", daemon=True)
    loader.start()  # the model loads while the backends are asked whether they answer
    problems = check_backends_answer(settings)
    if problems:
        raise ServeConfigError("; ".join(problems))
    loader.join()
    if "error" in loaded:
        raise loaded["error"]
    app = loaded["app"]
    make_server(uvicorn_config(app, settings)).run()
    return 0


__all__ = ["ServeSettings", "create_app", "header_timeout_protocol", "make_server", "serve_command", "uvicorn_config"]
