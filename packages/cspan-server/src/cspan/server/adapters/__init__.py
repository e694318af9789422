"""Wire protocol adapters of ``cspan serve``: one module per protocol, each only translating messages.

To add a protocol, add one module here that defines a :class:`ProtocolAdapter` subclass and names it
``ADAPTER = MyAdapter``; :func:`discover_adapters` finds it and the app serves it at its ``path``. The session
core, and what an adapter may call and must render, is described in :mod:`cspan.server.session` ("Adapter
contract").

Protocols here: ``ws`` (``/ws``, this project's own protocol), ``moshi`` (``/api/chat``, Kyutai's Moshi protocol)
and ``realtime`` (``/v1/realtime``, the OpenAI Realtime API); ``docs/PROTOCOL.md`` has a section for each. Ogg/Opus
for any adapter: :mod:`cspan.server.opus`.
"""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from cspan.server.session import Outbound, Session

T = TypeVar("T")

OFFLOAD_BYTES = 8 * 1024
"""Work on a message above this size runs on a worker thread (:func:`off_loop`); below it, inline (a thread hop
costs more than decoding one frame's page or chunk, and the work is bounded by this size)."""


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` for a message of ``size`` bytes: on a worker thread (``asyncio.to_thread``) above
    :data:`OFFLOAD_BYTES`, so that the event loop, which runs every session's 80 ms frame clock, never waits on one
    client's large message; inline otherwise. ``fn``'s exceptions propagate. An adapter awaits it inside
    ``receive``, so its messages are still handled one at a time and in order."""
    if size <= OFFLOAD_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


@dataclass(frozen=True)
class Connection:
    """What the WebSocket handshake said (read-only).

    Attributes:
        path: the route.
        query: query parameters (the last value of a repeated one).
        headers: request headers (lower-case names).
        subprotocols: the subprotocols the client offered, in order.
    """

    path: str
    query: Mapping[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    subprotocols: tuple[str, ...] = ()


@dataclass(frozen=True)
class Credential:
    """Where a protocol's client put its credential.

    Attributes:
        token: the credential (None: the client gave none).
        subprotocol: the subprotocol to accept the WebSocket with (browsers require the server to echo one of
            theirs), or None.
        conflicting: the client gave two tokens that differ (in two places, or twice in one): refused, as the
            server cannot tell whose connection it is.
    """

    token: str | None = None
    subprotocol: str | None = None
    conflicting: bool = False

    @classmethod
    def first_of(cls, *tokens: str | None, subprotocol: str | None = None) -> Credential:
        """The first token given of ``tokens`` (the protocol's places, in its order of preference); ``conflicting``
        when two of those given differ."""
        given = [token for token in tokens if token]
        return cls(token=given[0] if given else None, subprotocol=subprotocol, conflicting=len(set(given)) > 1)


class ProtocolAdapter(ABC):
    """One wire protocol: translates its messages into session calls, and session outputs into its messages.

    One instance per accepted connection, created by the app with the connection's :class:`Session` (state
    ``connected``). Subclasses set :attr:`name` and :attr:`path` and implement :meth:`receive` and :meth:`render`;
    :meth:`credential` and :meth:`opened` have defaults. Nothing here may block the event loop for long (the frame
    loop shares it): decode and encode per message, keep state per connection, and run what grows with a message
    (decoding its audio, validating a large event) through :func:`off_loop`. The app refuses messages above
    ``--max-message-kib`` before they reach :meth:`receive`.
    """

    name: ClassVar[str]
    """The protocol's label in metrics and logs (``cspan``, ``moshi``, ``realtime``)."""
    path: ClassVar[str]
    """The WebSocket route (``/ws``, ``/api/chat``, ``/v1/realtime``)."""

    def __init__(self, session: Session, connection: Connection) -> None:
        self.session = session
        self.connection = connection

    @classmethod
    def credential(cls, connection: Connection) -> Credential:
        """Where this protocol's client puts its credential; default: the query parameter ``token``."""
        return Credential(token=connection.query.get("token"))

    async def opened(self) -> None:  # noqa: B027 (an optional hook)
        """Called once the connection is accepted, before the first message (e.g. start from query parameters)."""

    @abstractmethod
    async def receive(self, data: bytes | str) -> None:
        """Handle one client message: call the session (``start``, ``push_audio``, ``update_profile``, ``stop``).

        Raise :class:`~cspan.server.session.ClientError` for a bad message: the app reports it through
        :meth:`render` (an :class:`~cspan.server.session.ErrorOut`) and the session goes on.
        """

    @abstractmethod
    def render(self, item: Outbound) -> list[bytes | str]:
        """The wire messages for one session output (in order; empty to send nothing for it)."""


def discover_adapters() -> list[type[ProtocolAdapter]]:
    """The adapter of every module of this package (its ``ADAPTER``), by module name.

    Raises:
        RuntimeError: two adapters share a ``path`` or a ``name``.
    """
    found: list[type[ProtocolAdapter]] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module: Any = importlib.import_module(f"{__name__}.{info.name}")
        adapter = getattr(module, "ADAPTER", None)
        if isinstance(adapter, type) and issubclass(adapter, ProtocolAdapter):
            found.append(adapter)
    for attr in ("path", "name"):
        values = [getattr(a, attr) for a in found]
        if len(values) != len(set(values)):
            raise RuntimeError(f"two protocol adapters share a {attr}: {values}")
    return found


__all__ = ["OFFLOAD_BYTES", "Connection", "Credential", "ProtocolAdapter", "discover_adapters", "off_loop"]
