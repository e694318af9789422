"""DNS-rebinding protection for the HTTP servers of this package (``asr-serve``, ``tools serve --transport http``).

A page on ``http://rebind.example:PORT`` can make the victim's browser resolve ``rebind.example`` to 127.0.0.1 and
then talk to a server bound there as if it were same-origin: the browser sends ``Host: rebind.example:PORT`` and
``Origin: http://rebind.example:PORT``. A server that only accepts its own loopback names is out of its reach.

:class:`HostGuard` (pure ASGI middleware, HTTP and WebSocket) enforces: on a loopback bind (127.0.0.0/8, ``::1``,
``localhost``), the ``Host`` header must name a loopback address or ``localhost`` with the port the connection
arrived on (the ASGI ``server`` port; a missing port means the scheme's default), or one of the operator's
``allowed_hosts`` (``NAME`` for any port, ``NAME:PORT`` for one, ``*`` to turn the check off); a request carrying an
``Origin`` must come from such a name as well (``Origin: null`` is refused). Refused requests get ``421`` (a Host
that is not this server's) or ``403`` (a foreign Origin) with a JSON body, before the application sees them. On a
non-loopback bind the check applies only to the names the operator listed (authentication protects that case).

``cspan serve`` can wrap its app the same way: ``HostGuard(app, bind_host=settings.host, allowed_hosts=[...])``.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

__all__ = ["HostGuard", "is_loopback", "parse_allowed_host", "parse_host", "public_names"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})
_DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) only reaches this machine."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def public_names(allowed: Iterable[str]) -> list[str]:
    """The ``--allowed-host`` values that are not loopback names (``*`` included): a proxy forwards them here, so a
    server answering them is reachable beyond this machine even on a loopback bind."""
    names = []
    for entry in allowed:
        text = entry.strip()
        if text.startswith("["):
            host = text[1:].partition("]")[0]
        else:  # host, host:port, or a bare IPv6 address
            host = text.partition(":")[0] if text.count(":") == 1 else text
        if text == "*" or not is_loopback(host):
            names.append(text)
    return names


def parse_host(value: str) -> tuple[str, int | None] | None:
    """``"Name:port"`` / ``"[::1]:port"`` / ``"name"`` -> ``("name", port | None)``, lower-case; None if malformed."""
    value = value.strip()
    if not value or any(c.isspace() for c in value) or "/" in value or "@" in value:
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else ""
    else:
        name, _, port_text = value.partition(":") if value.count(":") == 1 else (value, "", "")
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            return None
        return name.lower().rstrip("."), int(port_text)
    return name.lower().rstrip("."), None


def parse_allowed_host(entry: str) -> tuple[str, int | None] | None:
    """An ``--allowed-host`` value as :func:`parse_host` reads it; None for ``*`` (any name).

    Raises:
        ValueError: a malformed entry (the message gives the form).
    """
    if entry.strip() == "*":
        return None
    parsed = parse_host(entry)
    if parsed is None:
        raise ValueError(f"allowed host {entry!r}: use NAME or NAME:PORT (e.g. voice.example.org:443)")
    return parsed


class HostGuard:
    """ASGI middleware refusing requests whose ``Host`` or ``Origin`` is not this server's (see the module).

    Args:
        app: the ASGI application to protect.
        bind_host: the address the server binds (decides whether loopback names are enforced).
        allowed_hosts: more accepted names: ``NAME`` (any port), ``NAME:PORT``, or ``*`` (no check at all).

    Raises:
        ValueError: a malformed ``allowed_hosts`` entry.
    """

    def __init__(self, app: ASGIApp, *, bind_host: str, allowed_hosts: Iterable[str] = ()) -> None:
        self.app = app
        self.loopback = is_loopback(bind_host)
        self.any_host = False
        self.allowed: list[tuple[str, int | None]] = []
        for entry in allowed_hosts:
            parsed = parse_allowed_host(entry)
            if parsed is None:
                self.any_host = True
            else:
                self.allowed.append(parsed)
        self.active = not self.any_host and (self.loopback or bool(self.allowed))

    def accepts(self, name: str, port: int | None, server_port: int | None) -> bool:
        """Whether ``name:port`` (``port`` None when absent) is one of this server's names."""
        for allowed_name, allowed_port in self.allowed:
            if name == allowed_name and (allowed_port is None or allowed_port == port):
                return True
        return self.loopback and is_loopback(name) and (server_port is None or port == server_port)

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]], send: Any) -> None:
        if not self.active or scope.get("type") not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        server = scope.get("server")
        server_port = int(server[1]) if server and len(server) > 1 and server[1] else None
        default_port = _DEFAULT_PORTS.get(str(scope.get("scheme", "http")), 80)
        host_raw = headers.get(b"host", b"").decode("latin-1")
        host = parse_host(host_raw)
        if host is None or not self.accepts(host[0], host[1] or default_port, server_port):
            await self._refuse(
                scope,
                send,
                421,
                "host_not_allowed",
                f"Host {host_raw!r} is not a name of this server; it answers to localhost, 127.0.0.1 or [::1] with "
                f"port {server_port} (DNS-rebinding protection). An operator can list more names with "
                "--allowed-host NAME[:PORT].",
            )
            return
        origin_raw = headers.get(b"origin")
        if origin_raw is not None and not self._origin_ok(origin_raw.decode("latin-1"), server_port):
            await self._refuse(
                scope,
                send,
                403,
                "origin_not_allowed",
                f"Origin {origin_raw.decode('latin-1')!r} is not this server (DNS-rebinding protection); pages "
                "served from other sites cannot call it. An operator can list names with --allowed-host.",
            )
            return
        await self.app(scope, receive, send)

    def _origin_ok(self, origin: str, server_port: int | None) -> bool:
        parts = urlsplit(origin.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False
        try:
            port = parts.port or _DEFAULT_PORTS[parts.scheme]
        except ValueError:
            return False
        return self.accepts(parts.hostname.lower().rstrip("."), port, server_port)

    @staticmethod
    async def _refuse(scope: Scope, send: Any, status: int, code: str, message: str) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": code})
            return
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
