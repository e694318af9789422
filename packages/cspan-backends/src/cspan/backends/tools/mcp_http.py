"""The HTTP layer of an MCP client over streamable HTTP (:class:`~cspan.backends.tools.mcp_bridge.MCPConnection`):
a server's 429 (Too Many Requests) or 503 (Service Unavailable) keeps what the server asked.

The SDK reads any non-2xx answer without a JSON-RPC error body as INTERNAL_ERROR "Server returned an error
response": the status and the server's ``Retry-After`` are gone before a caller could honour them.
:class:`RefusalTransport` answers such a refusal of a JSON-RPC request with a JSON-RPC error of its own that carries
both (the SDK passes a non-2xx JSON-RPC error body on as the call's error), and :func:`refusal_of` reads them back from
the error the call raised. The wait is read as every backend reads it
(:func:`~cspan.backends.http_client.advised_wait_s`: ``retry-after-ms``, else ``Retry-After`` in seconds or as an
HTTP-date); whether to wait is the caller's decision (:func:`retry_decision`).

Imported only for an HTTP endpoint: it needs ``httpx2``, which the ``mcp`` SDK (2.x) brings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx2

from cspan.backends.http_client import advised_wait_s

__all__ = [
    "MAX_RETRY_AFTER_WAITS",
    "MAX_WAITED_S",
    "Refusal",
    "RefusalTransport",
    "http_client",
    "refusal_of",
    "retry_decision",
]

MAX_WAITED_S = 30.0
"""The longest ``Retry-After`` an MCP call waits out, in seconds, however long its deadline (a longer one fails the
call at once, saying what the server asked)."""
MAX_RETRY_AFTER_WAITS = 2
"""Refusals of one call waited out before it fails (as :class:`~cspan.backends.http_client.HTTPPolicy`'s default)."""

_REASONS = {429: "Too Many Requests", 503: "Service Unavailable"}
_REFUSAL_CODE = -32029  # JSON-RPC's range for implementation-defined server errors
_REFUSAL_KEY = "cspan/http_refusal"


@dataclass(frozen=True)
class Refusal:
    """A server's 429 or 503 answer to a JSON-RPC request: ``status`` and the wait it asked for (``retry_after_s``,
    seconds; None when it sent no readable ``Retry-After``)."""

    status: int
    retry_after_s: float | None

    def __str__(self) -> str:
        return f"HTTP {self.status} ({_REASONS.get(self.status, 'refused')})"


class RefusalTransport(httpx2.AsyncBaseTransport):
    """An ``httpx2`` transport that passes everything through, but answers a 429 or 503 to a POSTed JSON-RPC request
    (one with an ``id``) with a JSON-RPC error that carries the status and the advised wait (see the module
    docstring). Notifications, the GET event stream and other answers are left as they are.

    Args:
        inner: the transport that sends (default ``httpx2.AsyncHTTPTransport()``).
    """

    def __init__(self, inner: httpx2.AsyncBaseTransport | None = None) -> None:
        self._inner = inner if inner is not None else httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        if request.method != "POST" or response.status_code not in _REASONS:
            return response
        try:
            message = json.loads(request.content)
        except (ValueError, httpx2.RequestNotRead):
            return response
        if not (isinstance(message, dict) and "method" in message and message.get("id") is not None):
            return response
        wait = advised_wait_s(response.headers)
        await response.aclose()
        refusal = Refusal(response.status_code, wait)
        asked = f"; retry after {wait:g} s" if wait is not None else "; no Retry-After"
        error = {"code": _REFUSAL_CODE, "message": f"{refusal}{asked}", "data": {_REFUSAL_KEY: vars(refusal)}}
        body = json.dumps({"jsonrpc": "2.0", "id": message["id"], "error": error}).encode()
        return httpx2.Response(
            response.status_code, headers={"content-type": "application/json"}, content=body, request=request
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


def http_client() -> httpx2.AsyncClient:
    """The client an MCP connection over HTTP uses: the SDK's default timeouts (30 s to connect, write and wait for a
    pooled connection; 300 s to read, as a server may hold an event stream open) over a :class:`RefusalTransport`."""
    return httpx2.AsyncClient(timeout=httpx2.Timeout(30.0, read=300.0), transport=RefusalTransport())


def refusal_of(exc: BaseException) -> Refusal | None:
    """The :class:`Refusal` an MCP call's error carries (made by :class:`RefusalTransport`), else None."""
    data: Any = getattr(getattr(exc, "error", None), "data", None)
    fields = data.get(_REFUSAL_KEY) if isinstance(data, dict) else None
    if not isinstance(fields, dict) or not isinstance(fields.get("status"), int):
        return None
    wait = fields.get("retry_after_s")
    return Refusal(fields["status"], float(wait) if isinstance(wait, int | float) else None)


def retry_decision(refusal: Refusal, *, repeatable: bool, waits: int, left_s: float | None) -> str | None:
    """Whether a refused call is sent again after ``refusal.retry_after_s``: None when it is, else why not (for the
    error message).

    Args:
        refusal: what the server answered.
        repeatable: the tool may be called twice (a read, or one the server marks idempotent); an action is sent once,
            as the backends never repeat a request that may not be safe to repeat.
        waits: refusals of this call waited out so far.
        left_s: seconds left before the call's deadline (None: no deadline known).
    """
    wait = refusal.retry_after_s
    if wait is None:
        return "with no Retry-After; not sent again"
    if not repeatable:
        return "not sent again: the tool may change state (an action is sent once)"
    if waits >= MAX_RETRY_AFTER_WAITS:
        return f"refused again after {waits} wait(s); not sent again"
    if wait > MAX_WAITED_S:
        return f"longer than the {MAX_WAITED_S:g} s an MCP call waits; not waited"
    if left_s is not None and wait >= left_s:
        return f"longer than the {max(left_s, 0.0):.1f} s left before the call's deadline; not waited"
    return None
