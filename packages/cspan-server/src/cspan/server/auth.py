"""Access control of ``cspan serve``: the shared token, the bind-address rule and the WebSocket Origin check.

- **Token.** When a token is configured (``--token`` or ``CSPAN_TOKEN``), ``/ws`` requires it, either as the
  query parameter ``?token=<token>`` or as the offered subprotocol ``cspan.token.<token>`` (what the page uses, so
  the token stays out of URLs and access logs). Candidates are compared with :func:`hmac.compare_digest` (constant
  time). A refused connection is closed with code 4401 before any session or model work.
- **Bind address.** Serving on a non-loopback address without a token is refused unless the operator says
  ``--insecure-no-token``: anyone who can reach the port could otherwise talk to the model and read the Context DB
  through it.
- **Origin.** Browsers send ``Origin`` with every WebSocket handshake; a page from another site must not drive a
  session in the user's browser (cross-site WebSocket hijacking). A handshake whose ``Origin`` is neither this
  server's own origin (same host and port as the ``Host`` header) nor in ``--allow-origin`` is closed with 4403.
  Clients that send no ``Origin`` (non-browser programs) are not affected.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from cspan.core.errors import CspanError
from cspan.server.protocol import TOKEN_SUBPROTOCOL_PREFIX

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
    """Whether binding to ``host`` only accepts connections from this machine.

    ``localhost`` and any address in 127.0.0.0/8 or ``::1`` are loopback; every other name or address
    (``0.0.0.0``, ``::``, a LAN address, a host name) is not.
    """
    h = host.strip().strip("[]").lower()
    if h == "localhost":
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


@dataclass(frozen=True)
class AuthResult:
    """Outcome of :func:`authenticate`: whether the handshake may proceed, and the subprotocol to echo (the
    client's ``cspan.token.*`` offer, echoed even when refused so that a browser sees the 4401 close code)."""

    ok: bool
    subprotocol: str | None
    reason: str = ""


def offered_subprotocols(header: str | None) -> list[str]:
    """The comma-separated ``Sec-WebSocket-Protocol`` header as a list."""
    if not header:
        return []
    return [p.strip() for p in header.split(",") if p.strip()]


def authenticate(token: str | None, query: Mapping[str, str], subprotocols: Iterable[str]) -> AuthResult:
    """Check a WebSocket handshake against the configured token.

    Args:
        token: the configured token, or None (no authentication).
        query: the request's query parameters (``token``).
        subprotocols: the subprotocols the client offered (``cspan.token.<token>``).

    Returns:
        :class:`AuthResult`. Every candidate is compared in constant time, and all candidates are compared
        (no early exit on the first mismatch).
    """
    offered = [p for p in subprotocols if p.startswith(TOKEN_SUBPROTOCOL_PREFIX)]
    echo = offered[0] if offered else None
    if not token:
        return AuthResult(ok=True, subprotocol=echo)
    expected = token.encode("utf-8")
    candidates = [p[len(TOKEN_SUBPROTOCOL_PREFIX) :] for p in offered]
    if "token" in query:
        candidates.append(query["token"])
    if not candidates:
        return AuthResult(ok=False, subprotocol=echo, reason="missing token: add ?token=... or offer cspan.token.*")
    ok = False
    for cand in candidates:
        ok |= hmac.compare_digest(cand.encode("utf-8", errors="replace"), expected)
    return AuthResult(ok=ok, subprotocol=echo, reason="" if ok else "wrong token")


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

    def norm(netloc: str) -> str:
        netloc = netloc.lower()
        if netloc.startswith("["):
            host, _, rest = netloc[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else default_port
        elif ":" in netloc:
            host, _, port = netloc.rpartition(":")
        else:
            host, port = netloc, default_port
        return f"{host}:{port}"

    return norm(parts.netloc) == norm(host_header)


__all__ = [
    "AuthResult",
    "ServeConfigError",
    "authenticate",
    "check_bind",
    "is_loopback_host",
    "offered_subprotocols",
    "origin_allowed",
    "validate_token",
]
