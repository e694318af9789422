"""Errors of the backends package.

``cspan-backends`` must not import ``cspan.core`` (which needs torch), so its errors are rooted at
:class:`BackendError` here. The core runtime treats any exception from a backend as a failed retrieval and keeps
the conversation going; see ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations


class BackendError(Exception):
    """Root of backend failures. Messages name the endpoint or tool and the status."""


class TranscriberError(BackendError):
    """A transcription request failed (endpoint, HTTP status or cause in the message).

    ``endpoint`` is the URL (or ``"pocketsphinx"`` for the embedded engine) and ``status`` the HTTP status code,
    or ``None`` when no response came back (connection refused, timeout, bad input).
    """

    def __init__(self, message: str, *, endpoint: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.status = status


class RouterError(BackendError):
    """The router LLM failed, timed out, or answered something unusable."""


class ToolError(BackendError):
    """A tool call failed: unknown tool, invalid arguments, timeout, or the tool itself raised.

    ``tool`` is the tool's name (``None`` when the failure is not tied to one tool) and ``field`` the argument
    that failed validation (``None`` for other failures).
    """

    def __init__(self, message: str, *, tool: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.tool = tool
        self.field = field


class ListenError(BackendError):
    """A server cannot listen on ``--host`` / ``--port``: a host name that does not resolve, an address this
    machine does not have, a port in use or reserved (exit status 2, as a bad setting)."""

    exit_code = 2
