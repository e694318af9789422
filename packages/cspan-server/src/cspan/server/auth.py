"""Access control of ``cspan serve``: the Host check, the bind-address rule, the Origin check and the credential.

- **Host (DNS rebinding).** A page on another site can make its own host name resolve to 127.0.0.1 and then talk
  to a loopback server as if it were that site (same origin as far as the browser knows). On a loopback bind the
  server therefore answers only requests whose ``Host`` is a loopback name (``localhost``, ``127.x.x.x``,
  ``[::1]``) with the bound port, on every route (the page, ``/info``, ``/metrics``, every protocol), unless the
  operator lists more hosts (``--allow-host``, ``*`` for any). Other binds answer any ``Host`` unless
  ``--allow-host`` is given. Refused: HTTP 403 before any work.
- **Bind address.** Serving on a non-loopback address without a token is refused unless the operator says
  ``--insecure-no-token``: anyone who can reach the port could otherwise talk to the model and read the Context DB
  through it.
- **Origin.** Browsers send ``Origin`` with every WebSocket handshake; a page from another site must not drive a
  session in the user's browser (cross-site WebSocket hijacking). A handshake whose ``Origin`` is neither this
  server's own origin (same host and port as the ``Host`` header) nor in ``--allow-origin`` is closed with 4403.
  Clients that send no ``Origin`` (non-browser programs) are not affected.
- **Credential.** Each protocol says where its client puts the credential (``/ws``: ``?token=`` or the subprotocol
  ``cspan.token.<token>``; see the adapters). An :class:`Authenticator` turns it into a :class:`Principal`, or
  refuses it; the one built in is :class:`TokenAuthenticator` (one shared token, compared in constant time). A
  refused connection is closed with 4401 before any session or model work. A principal that names a user decides
  the Context DB user, whatever the client's messages say.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from cspan.core.errors import CspanError

TOKEN_PATTERN = re.compile(r"^[A-Za-z0-9._~\-]{8,256}$")
"""A token must be usable inside a subprotocol name: 8 to 256 of ``A-Z a-z 0-9 . _ ~ -``."""


class ServeConfigError(CspanError):
    """``cspan serve`` was configured unsafely or inconsistently (names the flag and the fix)."""


def validate_token(token: str) -> str:
    """Check a configured token's alphabet and length; returns it.

    Raises:
        ServeConfigError: the token is shorter than 8 characters or contains characters other than
            ``A-Z a-z 0-9 . _ ~ -`` (generate one with ``python -c "import secrets; print(secrets.token_urlsafe())"``).
    """
    if not TOKEN_PATTERN.match(token):
        raise ServeConfigError(
            "--token / CSPAN_TOKEN must be 8 to 256 characters of A-Z a-z 0-9 . _ ~ - (it travels as a WebSocket "
            'subprotocol); generate one with: python -c "import secrets; print(secrets.token_urlsafe())"'
        )
    return token


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a bind address or a host name) means this machine only.

    ``localhost`` (and ``*.localhost``) and any address in 127.0.0.0/8 or ``::1`` are loopback; every other name or
    address (``0.0.0.0``, ``::``, a LAN address, a host name) is not.
    """
    h = host.strip().strip("[]").lower().rstrip(".")
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None, *, insecure_no_token: bool) -> None:
    """Refuse a non-loopback bind without a token.

    Raises:
        ServeConfigError: ``host`` is not loopback, no token is set, and ``insecure_no_token`` is False.
    """
    if token or insecure_no_token or is_loopback_host(host):
        return
    raise ServeConfigError(
        f"refusing to serve on {host!r} without a token: anyone who reaches this port could use the model. Set "
        "--token (or CSPAN_TOKEN), bind to 127.0.0.1, or pass --insecure-no-token if the network is trusted"
    )


def _split_host(value: str, default_port: str) -> tuple[str, str] | None:
    """``(host, port)`` of a ``Host`` header or ``--allow-host`` value (lower case, IPv6 without brackets)."""
    value = value.strip().lower()
    if not value or any(c in value for c in "/@?#\\ \t"):
        return None
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] or default_port
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
    elif ":" in value:  # a bare IPv6 address
        host, port = value, default_port
    else:
        host, port = value, default_port
    if not host or (port and not port.isdigit()):
        return None
    return host.rstrip("."), port


def host_allowed(host_header: str | None, *, bind_host: str, port: int, allowed: Iterable[str] = ()) -> bool:
    """Whether a request's ``Host`` header names this server (see the module docstring, DNS rebinding).

    Args:
        host_header: the request's ``Host`` (None when absent).
        bind_host: the address the server listens on (``--host``).
        port: the port the request arrived on.
        allowed: ``--allow-host`` values: ``host`` (any port), ``host:port``, or ``*`` (anything).

    Returns:
        On a loopback bind: a loopback name with ``port``, or a listed host. On any other bind: any host when nothing
        is listed, else a listed or loopback one.
    """
    allowed = [a.strip().lower() for a in allowed if a.strip()]
    if "*" in allowed:
        return True
    if host_header is None:
        return False
    parsed = _split_host(host_header, "")
    if parsed is None:
        return False
    host, given_port = parsed
    if is_loopback_host(host) and given_port == str(port):
        return True
    for entry in allowed:
        want = _split_host(entry, "")
        if want is not None and want[0] == host and (not want[1] or want[1] == (given_port or "80")):
            return True
    return not allowed and not is_loopback_host(bind_host)


def origin_allowed(origin: str | None, host_header: str | None, allowed: Iterable[str] = ()) -> bool:
    """Whether a WebSocket handshake's ``Origin`` may use this server.

    Allowed: no ``Origin`` (not a browser); an origin whose ``host[:port]`` equals the ``Host`` header (the page
    this server served); an origin listed in ``allowed`` (exact ``scheme://host[:port]``), or ``*`` in ``allowed``.
    """
    if origin is None:
        return True
    allowed = list(allowed)
    if "*" in allowed or origin.rstrip("/") in {a.rstrip("/") for a in allowed}:
        return True
    if origin == "null" or not host_header:
        return False
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    default_port = {"http": "80", "https": "443"}[parts.scheme]
    mine, theirs = _split_host(parts.netloc, default_port), _split_host(host_header, default_port)
    return mine is not None and mine == theirs


# ---------------------------------------------------------------------------------------------------- identity


@dataclass(frozen=True)
class Principal:
    """Who a connection's credential says the client is.

    Attributes:
        name: for logs (``anonymous``, ``token``, or an identity provider's subject).
        user_id: the Context DB user this credential stands for; None lets the client name one (``profile.user_id``)
            or have one made per session.
    """

    name: str = "anonymous"
    user_id: str | None = None


ANONYMOUS = Principal()


class Authenticator(Protocol):
    """Turns a connection's credential into a :class:`Principal` (the seam for identity providers)."""

    required: bool
    """Whether a credential is needed at all (``/info`` reports it; the page asks for a token)."""

    def authenticate(self, credential: str | None) -> Principal | None:
        """The principal of ``credential`` (None when the client gave none), or None to refuse the connection."""
        ...


class TokenAuthenticator:
    """One shared token (``--token`` / ``CSPAN_TOKEN``), or none (everyone is :data:`ANONYMOUS`).

    The credential is compared with :func:`hmac.compare_digest` (constant time).
    """

    def __init__(self, token: str | None) -> None:
        self._token = token.encode("utf-8") if token else None
        self.required = self._token is not None

    def authenticate(self, credential: str | None) -> Principal | None:
        if self._token is None:
            return ANONYMOUS
        if credential is None:
            return None
        ok = hmac.compare_digest(credential.encode("utf-8", errors="replace"), self._token)
        return Principal(name="token") if ok else None


def offered_subprotocols(header: str | None) -> list[str]:
    """The comma-separated ``Sec-WebSocket-Protocol`` header as a list."""
    if not header:
        return []
    return [p.strip() for p in header.split(",") if p.strip()]


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None


__all__ = [
    "ANONYMOUS",
    "TOKEN_PATTERN",
    "Authenticator",
    "Principal",
    "ServeConfigError",
    "TokenAuthenticator",
    "bearer_token",
    "check_bind",
    "host_allowed",
    "is_loopback_host",
    "offered_subprotocols",
    "origin_allowed",
    "validate_token",
]
