"""``cspan serve``: live conversations over WebSocket, several at once on one batched engine.

This module is the command and its uvicorn wiring. The parts, one concern each:

- :mod:`cspan.server.serve_settings`: the settings, declared once (flags, ``CSPAN_*``, ``--config``);
- :mod:`cspan.server.session`: the session core (slots, the 80 ms frame loop, personas, spans, records) and the
  contract protocol adapters follow; :mod:`cspan.server.engine_thread`: every engine call, on one thread;
- :mod:`cspan.server.adapters`: one module per wire protocol (``/ws``: :mod:`cspan.server.adapters.ws`;
  ``/api/chat``: :mod:`cspan.server.adapters.moshi`), :mod:`cspan.server.opus` (Ogg/Opus through sphn);
- :mod:`cspan.server.app`: the app, the page and HTTP routes, the Host guard, the connection runner;
  :mod:`cspan.server.shared_backends`: the transcriber, tool bank and router built once and shared (``infer`` too);
- :mod:`cspan.server.auth`, :mod:`cspan.server.metrics`, :mod:`cspan.server.records`: access control, Prometheus
  metrics, Context DB records; :mod:`cspan.server.db_calls`: every Context DB call, on its own threads, a session's
  writes in order with its messages held behind them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import logging
import os
import re
import signal
import socket
import sys
import threading
import urllib.parse
from typing import Any, NoReturn

from cspan.backends.errors import ListenError
from cspan.backends.http_server import bind_socket, header_timeout_protocol, uvicorn_http
from cspan.server.app import create_app
from cspan.server.protocol import MAX_WEBSOCKET_MESSAGE_BYTES
from cspan.server.serve_settings import ServeSettings
from cspan.server.session import SessionHub

logger = logging.getLogger(__name__)


class _RedactTokens(logging.Filter):
    """Remove from uvicorn's access log lines the value of every ``key=value`` whose key, percent-decoded as the
    server decodes it, ends with ``token`` in any case (``?tok%65n=`` is ``?token=`` to the server), and leave out
    the lines of ``GET /health`` (a load balancer asks every second or so)."""

    _pair = re.compile(r"([^=&?;\s\"]*)=[^&\s\"]*")

    @staticmethod
    def _redact(match: re.Match[str]) -> str:
        key = match.group(1)
        return f"{key}=***" if urllib.parse.unquote_plus(key).lower().endswith("token") else match.group(0)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            if len(record.args) >= 3 and record.args[1] == "GET" and record.args[2] == "/health":
                return False
            record.args = tuple(self._pair.sub(self._redact, a) if isinstance(a, str) else a for a in record.args)
        return True


def uvicorn_config(app: Any, settings: ServeSettings, **overrides: Any) -> Any:
    """The uvicorn configuration ``cspan serve`` uses: WebSocket size limit, no compression of audio, reading after
    the server's close frame bounded (:mod:`cspan.server.ws_protocol`), the header timeout
    (``settings.header_timeout_s``), tokens redacted from the access log, TLS with ``--ssl-certfile`` /
    ``--ssl-keyfile``."""
    import uvicorn

    from cspan.server.ws_protocol import WebSocketProtocol

    for name in ("uvicorn.access", "uvicorn.error"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _RedactTokens) for f in log.filters):
            log.addFilter(_RedactTokens())
    http = uvicorn_http(settings.header_timeout_s)
    kwargs: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "http": http,
        "ws": WebSocketProtocol,
        "ws_max_size": MAX_WEBSOCKET_MESSAGE_BYTES,
        "ws_per_message_deflate": False,
        "ws_ping_interval": 20.0,
        "ws_ping_timeout": 20.0,
        "timeout_keep_alive": 5,
        "lifespan": "on",
        "timeout_graceful_shutdown": 5,
        "log_level": "info",
    }
    if settings.ssl_certfile is not None:
        kwargs["ssl_certfile"] = str(settings.ssl_certfile)
        if settings.ssl_keyfile is not None:
            kwargs["ssl_keyfile"] = str(settings.ssl_keyfile)
    kwargs.update(overrides)
    return uvicorn.Config(app, **kwargs)


def make_server(config: Any) -> Any:
    """A ``uvicorn.Server`` for ``config`` that

    - builds the backends (tool bank, MCP servers) on its event loop before it listens, so that a failure is one
      error (:class:`~cspan.server.auth.ServeConfigError`) rather than a failed lifespan, and inside uvicorn's
      signal capture, so that a stop signal meanwhile shuts down in order;
    - reads the token file again on SIGHUP;
    - on SIGTERM/SIGINT drains for ``--drain-s`` (``/health`` answers 503, new conversations are refused, running
      ones go on), then ends every session (reason ``shutdown``, close 1001) before uvicorn closes the connections
      (plain uvicorn would close them with 1012 first);
    - ends the drain at once on a SIGTERM or SIGINT that comes during it, the rest of the shutdown as orderly as
      after the drain (plain uvicorn forces its exit on a second SIGINT, skipping the app's shutdown, and ignores a
      second SIGTERM); outside the drain (``--drain-s 0``, or after it) a signal does what it does in uvicorn: a
      further SIGINT forces the exit.
    """
    import uvicorn

    class _ServeServer(uvicorn.Server):
        draining = False  # hub.drain is running
        drain_ended = False  # a signal came during the drain: it ends at once

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.draining and not self.drain_ended:  # only then: before and after the drain, uvicorn's rules
                self.drain_ended = True
                captured = getattr(self, "_captured_signals", None)
                if isinstance(captured, list):  # re-raised at the exit (status 128 + the signal)
                    captured.append(sig)
                return
            super().handle_exit(sig, frame)

        async def serve(self, sockets: Any = None) -> None:
            reload = getattr(_find_state(self.config.app, "authenticator"), "reload", None)
            if reload is not None and hasattr(signal, "SIGHUP"):
                with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
                    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
            await super().serve(sockets=sockets)

        async def startup(self, sockets: Any = None) -> None:
            # inside uvicorn's signal capture: a stop signal while the backends are built shuts down in order
            hub = _find_state(self.config.app, "hub")
            if isinstance(hub, SessionHub):
                await hub.prepare()
            await super().startup(sockets=sockets)
            if sockets and not self.should_exit:  # uvicorn says where it listens only for sockets it bound itself
                host, port = self.config.host, sockets[0].getsockname()[1]
                where = f"[{host}]" if ":" in host else host
                scheme = "https" if self.config.ssl else "http"
                logging.getLogger("uvicorn.error").info(
                    "Uvicorn running on %s://%s:%d (Press CTRL+C to quit)", scheme, where, port
                )

        async def shutdown(self, sockets: Any = None) -> None:
            app = self.config.loaded_app if self.config.loaded else self.config.app
            hub = _find_state(app, "hub")
            if isinstance(hub, SessionHub):
                with contextlib.suppress(Exception):
                    self.draining = True
                    try:
                        await hub.drain(hub.settings.drain_s, give_up=lambda: self.drain_ended or self.force_exit)
                    finally:
                        self.draining = False
                    await hub.end_all("shutdown")
            await super().shutdown(sockets=sockets)

    return _ServeServer(config)


def _find_state(app: Any, name: str) -> Any:
    """``app.state.<name>`` of the app inside uvicorn's middleware wrappers (None when absent)."""
    for _ in range(8):
        state = getattr(app, "state", None)
        found = getattr(state, name, None) if state is not None else None
        if found is not None:
            return found
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
    from cspan.core.errors import Terminated
    from cspan.core.settings import settings_from_args
    from cspan.core.voice import check_voice_path

    try:
        settings: ServeSettings = settings_from_args(args)
        _dump_stacks_on_sigusr1()
        check_voice_path(settings.voice)  # a --voice file that is not there fails before the model loads
        if settings.test_hooks:
            logger.warning("test hooks are enabled (--test-hooks): clients may force <ret> and spans")
        sock = bind_socket(settings.host, settings.port)  # a bad --host or a busy --port fails before the model loads
        try:
            return _load_and_serve(settings, sock)
        finally:
            sock.close()
    except Terminated as exc:  # a supervisor's stop before the server ran (during loading: _stop_while_loading)
        if exc.signum != signal.SIGTERM:
            raise
        logger.warning("stopped on SIGTERM before serving")
        return 0


def _dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` writes every thread's stack to the process's standard error (file descriptor 2, whatever
    ``sys.stderr`` was replaced by), even with the event loop stuck (:mod:`faulthandler`); not where there is no
    SIGUSR1 or no such descriptor."""
    if not hasattr(signal, "SIGUSR1") or sys.__stderr__ is None:
        return
    with contextlib.suppress(OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


def _stop_while_loading(exc: BaseException) -> NoReturn:
    """End the process now, on a stop signal that came while the model loads on its thread: the interpreter cannot
    finish under a thread inside torch (its C++ runtime aborts: status 134, "terminate called without an active
    exception"), and nothing was served yet. Status 0 after SIGTERM, as after an orderly shutdown (a supervisor's
    stop); 130 after Ctrl-C; 128 + the signal otherwise."""
    from cspan.core.errors import Terminated

    if isinstance(exc, Terminated):
        signum = exc.signum
        status = 0 if signum == signal.SIGTERM else 128 + signum
    else:
        signum, status = signal.SIGINT, 130
    logger.warning("stopped on %s while the model was loading", signal.Signals(signum).name)
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


def _load_and_serve(settings: ServeSettings, sock: socket.socket) -> int:
    from cspan.core.errors import Terminated
    from cspan.server.auth import ServeConfigError
    from cspan.server.settings_common import check_backends_answer

    loaded: dict[str, Any] = {}
    done = threading.Event()  # not Thread.join/is_alive: a join interrupted by a signal marks the thread stopped

    def load() -> None:
        try:
            loaded["app"] = create_app(settings)
        except BaseException as exc:  # re-raised on the main thread
            loaded["error"] = exc
        finally:
            done.set()

    try:  # a signal can land while start() still waits for the thread to run: already inside the try
        threading.Thread(target=load, name="cspan-load", daemon=True).start()  # loads while the backends are asked
        problems = check_backends_answer(settings)
        if problems:
            raise ServeConfigError("; ".join(problems))
        done.wait()
    except (Terminated, KeyboardInterrupt) as exc:
        if not done.is_set():
            _stop_while_loading(exc)
        raise
    if "error" in loaded:
        raise loaded["error"]
    app = loaded["app"]

    server = make_server(uvicorn_config(app, settings))
    try:
        server.run(sockets=[sock])
    except Terminated as exc:  # uvicorn re-raises the signal once it has shut down
        if exc.signum != signal.SIGTERM or not server.started:  # before it listened: _handle says so
            raise
        logger.info("stopped on SIGTERM after an orderly shutdown")
    return 0  # SIGTERM is how a supervisor (systemd, Kubernetes, docker stop) asks a server to stop: a clean exit


__all__ = [
    "ListenError",
    "ServeSettings",
    "bind_socket",
    "create_app",
    "header_timeout_protocol",
    "make_server",
    "serve_command",
    "uvicorn_config",
]
