"""Access control of ``cspan serve``: the Host check, the bind-address rule, the Origin check and the credential.

- **Host (DNS rebinding).** A page on another site can make its own host name resolve to 127.0.0.1 and then talk
  to a loopback server as if it were that site (same origin as far as the browser knows). On a loopback bind the
  server therefore answers only requests whose ``Host`` is a loopback name (``localhost``, ``127.x.x.x``,
  ``[::1]``) with the bound port, on every route (the page, ``/info``, ``/metrics``, every protocol), unless the
  operator lists more hosts (``--allow-host``, ``*`` for any). Other binds answer any ``Host`` unless
  ``--allow-host`` is given. Refused: HTTP 403 before any work.
- **Bind address.** Serving on a non-loopback address without credentials (``--token``, ``--token-file`` or a token
  issued with ``cspan users add``) is refused unless the operator says ``--insecure-no-token``: anyone who can reach
  the port could otherwise talk to the model and read the Context DB through it.
- **Origin.** Browsers send ``Origin`` with every WebSocket handshake; a page from another site must not drive a
  session in the user's browser (cross-site WebSocket hijacking). A handshake whose ``Origin`` is neither this
  server's own origin (same host and port as the ``Host`` header) nor in ``--allow-origin`` is closed with 4403.
  Clients that send no ``Origin`` (non-browser programs) are not affected.
- **Credential.** Each protocol says where its client puts the credential (``/ws``: ``?token=`` or the subprotocol
  ``cspan.token.<token>``; see the adapters). An :class:`Authenticator` turns it into a
  :class:`~cspan.backends.identity.Principal`, or refuses it; the one built in is :class:`CredentialAuthenticator`
  (issued tokens, a token file, the shared token; compared in constant time). A refused connection is closed with
  4401 before any session or model work. The principal's user id is the session's Context DB user; no client
  message can name another.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from cspan.backends.context_db.workers import run_in
from cspan.core.errors import CspanError

if TYPE_CHECKING:
    from cspan.backends.identity import Principal

logger = logging.getLogger(__name__)

TOKEN_PATTERN = re.compile(r"^[A-Za-z0-9._~\-]{8,256}$")
"""A token must be usable inside a subprotocol name: 8 to 256 of ``A-Z a-z 0-9 . _ ~ -``."""


class ServeConfigError(CspanError):
    """``cspan serve`` was configured unsafely or inconsistently (names the flag and the fix)."""


class UnsafeBindError(ServeConfigError):
    """A bind address (or ``--allow-host``) that others can reach, with no credentials: a bad setting (exit 2)."""

    exit_code = 2


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


def public_names(allowed: Iterable[str]) -> list[str]:
    """The ``--allow-host`` values that are not loopback names (``*`` included): names a reverse proxy or balancer
    forwards to this server, so that others reach it though it listens on loopback."""
    names = []
    for entry in allowed:
        parsed = _split_host(entry, "") if entry.strip() != "*" else ("*", "")
        if parsed is None or not is_loopback_host(parsed[0]):
            names.append(entry.strip())
    return names


def is_exposed(host: str, allowed: Iterable[str] = ()) -> bool:
    """Whether others than this machine's user can reach the server: a non-loopback bind, or a loopback one that
    answers a public name (``--allow-host``: behind a reverse proxy or a load balancer)."""
    return not is_loopback_host(host) or bool(public_names(allowed))


def check_bind(host: str, credentials: object, *, insecure_no_token: bool, allowed: Iterable[str] = ()) -> None:
    """Refuse to be reachable by others without credentials.

    Args:
        host: the bind address.
        credentials: truthy when some credential can authenticate (a shared token, a token file, issued tokens).
        insecure_no_token: the operator's ``--insecure-no-token``.
        allowed: the ``--allow-host`` values (a public name makes a loopback server reachable through a proxy).

    Raises:
        UnsafeBindError: the server is exposed (:func:`is_exposed`), there are no credentials, and
            ``insecure_no_token`` is False.
    """
    if credentials or insecure_no_token or not is_exposed(host, allowed):
        return
    if is_loopback_host(host):
        raise UnsafeBindError(
            f"refusing to answer --allow-host {', '.join(public_names(allowed))} without a token: behind a proxy "
            "or balancer anyone who reaches it could use the model as the one local user. Issue tokens with "
            "`cspan users add USER`, set --token (or CSPAN_TOKEN) or --token-file, or pass --insecure-no-token if "
            "the network is trusted"
        )
    raise UnsafeBindError(
        f"refusing to serve on {host!r} without a token: anyone who reaches this port could use the model. Set "
        "--token (or CSPAN_TOKEN) or --token-file, issue tokens with `cspan users add USER`, bind to 127.0.0.1, or "
        "pass --insecure-no-token if the network is trusted"
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


def host_allowed(
    host_header: str | None, *, bind_host: str, port: int, allowed: Iterable[str] = (), scheme: str = "http"
) -> bool:
    """Whether a request's ``Host`` header names this server (see the module docstring, DNS rebinding).

    Args:
        host_header: the request's ``Host`` (None when absent).
        bind_host: the address the server listens on (``--host``).
        port: the port the request arrived on.
        allowed: ``--allow-host`` values: ``host`` (any port), ``host:port``, or ``*`` (anything).
        scheme: the request's (ASGI ``scope["scheme"]``): a ``Host`` without a port means its default port, 443 for
            ``https`` and ``wss``, else 80 (a browser leaves the port out of ``Host`` on ``--port 80``).

    Returns:
        On a loopback bind: a loopback name with ``port``, or a listed host. On any other bind: any host when nothing
        is listed, else a listed or loopback one.
    """
    allowed = [a.strip().lower() for a in allowed if a.strip()]
    if "*" in allowed:
        return True
    if host_header is None:
        return False
    parsed = _split_host(host_header, "443" if scheme in ("https", "wss") else "80")
    if parsed is None:
        return False
    host, given_port = parsed
    if is_loopback_host(host) and given_port == str(port):
        return True
    for entry in allowed:
        want = _split_host(entry, "")
        if want is not None and want[0] == host and (not want[1] or want[1] == given_port):
            return True
    return not allowed and not is_loopback_host(bind_host)


def check_allow_origin(value: str) -> str:
    """An ``--allow-origin`` value: ``*`` or a browser origin ``scheme://host[:port]`` (http or https, nothing
    after the port), as browsers send it; returns it without a trailing slash.

    Raises:
        ValueError: what is wrong and an example.
    """
    value = value.strip()
    if value == "*":
        return value
    parts = urlsplit(value)
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.username is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or not port_ok
        or _split_host(parts.netloc, "") is None
        or "*" in parts.netloc
    ):
        raise ValueError(
            f"{value!r} is not a browser origin: give scheme://host[:port] (http or https, no path or wildcard: list "
            "each origin), e.g. https://app.example.com or http://localhost:3000, or '*' for any"
        )
    return value.rstrip("/")


def check_allow_host(value: str) -> str:
    """An ``--allow-host`` value: ``*``, ``host`` or ``host:port`` (``[v6]:port`` for IPv6); returns it.

    Raises:
        ValueError: what is wrong and an example.
    """
    value = value.strip()
    parsed = None if value == "*" or "*" in value else _split_host(value, "")
    if value != "*" and (parsed is None or (parsed[1] and not 0 < int(parsed[1]) < 65536)):
        raise ValueError(
            f"{value!r} is not a host name: give host or host:port (no scheme, path, spaces or wildcard: list each "
            "name), e.g. app.example.com or 192.168.1.5:8080, or '*' for any"
        )
    return value


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


class Authenticator(Protocol):
    """Turns a connection's credential into a :class:`~cspan.backends.identity.Principal` (the seam for identity
    providers). The principal's ``user_id`` is the session's Context DB user; nothing a client sends changes it."""

    async def required(self) -> bool:
        """Whether a credential is needed now (``/info`` reports it; the page asks for a token).

        Raises:
            Exception: the store of issued credentials cannot be asked now (``ContextDBError``: PostgreSQL away);
                ``/info`` then reports None, ``/metrics`` answers 503 and a conversation is closed with 1013.
        """
        ...

    async def authenticate(self, credential: str | None, *, scope: str | None = "session") -> Principal | None:
        """The principal of ``credential`` (None when the client gave none) if it was granted ``scope`` (None: any
        scope), or None to refuse the request."""
        ...


class CredentialAuthenticator:
    """The credentials of ``cspan serve``: issued tokens (``cspan users add``, in the Context DB), a token file, the
    shared ``--token`` (one principal, ``token_user``); :class:`cspan.backends.identity.Authenticator` compares
    them in constant time.

    A credential is required when ``--token`` or ``--token-file`` is set, when others can reach the server (it
    listens beyond loopback or answers a public ``--allow-host`` name, behind a proxy; unless ``insecure_no_token``),
    or once the Context DB holds an issued token, revoked ones included (checked per connection until then, so
    ``cspan users add`` takes effect at once; revoking every token later does not open the server, restart or not).
    Otherwise (one person on 127.0.0.1) every session is
    :meth:`Principal.local() <cspan.backends.identity.Principal.local>`. A conversation needs the ``session``
    scope.

    Where the Context DB is needed, and where not: while a credential is required for good (``--token``,
    ``--token-file``, an exposed server, or a token seen issued), the static credentials (the shared token, the
    token file's entries) are compared on the caller's thread (the event loop; constant time, no database), a
    missing credential or one that is not shaped like an issued token is refused at once, and only a credential
    shaped like one (``cspan.<id>.<secret>``) is looked up in the Context DB, on the database's executor (``cspan
    serve``: the Context DB threads). So a frozen database refuses no static credential, and a client without
    one gets 4401, not 1013. Only a loopback server with no credentials configured asks the database whether a
    token was issued since, on every connection.

    Args:
        db: the Context DB holding issued tokens (None: none are accepted).
        token: the shared token; token_user: its user id.
        token_file: a token file (read now; :meth:`reload` reads it again).
        always: require a credential whatever is configured (an exposed server, :func:`is_exposed`).

    Raises:
        IdentityError: the token file is invalid.
    """

    def __init__(
        self,
        db: Any = None,
        *,
        token: str | None = None,
        token_user: str = "local",
        token_file: str | Path | None = None,
        always: bool = False,
    ) -> None:
        from cspan.backends.identity import Authenticator as Credentials

        self.db = db
        self.credentials = Credentials(db=db, token_file=token_file, shared_token=token, shared_user=token_user)
        self.configured = bool(token or token_file or always)
        self._open_at: float | None = None  # time.monotonic() of the database's last answer "no token issued"

    def reload(self) -> None:
        """Read the token file again (on SIGHUP); the old entries stay when it is invalid (logged)."""
        from cspan.backends.identity import IdentityError

        if self.credentials.token_file is None:
            logger.info("SIGHUP: no --token-file to read again (issued tokens take effect without a signal)")
            return
        try:
            self.credentials.reload()
        except IdentityError as exc:
            logger.error("token file not reloaded (the previous one stays in force): %s", exc)
        else:
            logger.info("token file reloaded")

    def _required(self) -> bool:
        """Whether a credential is required (reads the Context DB until a token is seen issued; a worker thread)."""
        if not self.configured and self.db is not None:
            if self.db.tokens(revoked=True):
                self.configured = True  # for good: revoking every token must not open the server to anyone
            else:
                self._open_at = time.monotonic()
        return self.configured

    def _executor(self) -> Any:
        return getattr(self.db, "executor", None)

    async def required(self) -> bool:
        if self.configured or self.db is None:  # known without the database
            return self.configured
        return await run_in(self._executor(), self._required)

    def open_within(self, max_age_s: float) -> bool:
        """Whether the Context DB answered, at most ``max_age_s`` seconds ago, that no token was issued (so that,
        unless one was issued since, no credential is required); False once a credential is required for good.
        Never reads the database."""
        opened = self._open_at
        return not self.configured and opened is not None and time.monotonic() - opened <= max_age_s

    def _authenticate(self, credential: str | None, scope: str | None) -> Principal | None:
        from cspan.backends.identity import Principal

        if not self._required():
            return Principal.local()
        return self._allowed(self.credentials.authenticate(credential), scope)

    @staticmethod
    def _allowed(principal: Principal | None, scope: str | None) -> Principal | None:
        return principal if principal is not None and (scope is None or principal.allows(scope)) else None

    async def authenticate(self, credential: str | None, *, scope: str | None = "session") -> Principal | None:
        """The principal of ``credential`` if it was granted ``scope`` (None: any), else None (see the class
        docstring for what reads the Context DB).

        Raises:
            ContextDBError: the database holding the issued tokens failed (a lookup it needed).
        """
        from cspan.backends.identity import may_be_issued

        if not self.configured:  # open unless a token was issued since: only the database can tell
            return await run_in(self._executor(), self._authenticate, credential, scope)
        principal = self.credentials.authenticate_static(credential)  # here, on the loop: no database
        if principal is None and self.db is not None and may_be_issued(credential):
            principal = await run_in(self._executor(), self.credentials.authenticate_issued, credential)
        return self._allowed(principal, scope)


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
    "TOKEN_PATTERN",
    "Authenticator",
    "CredentialAuthenticator",
    "ServeConfigError",
    "bearer_token",
    "check_bind",
    "host_allowed",
    "is_exposed",
    "is_loopback_host",
    "offered_subprotocols",
    "origin_allowed",
    "public_names",
]
