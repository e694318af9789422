"""Errors of the backends package.

``cspan-backends`` must not import ``cspan.core`` (which needs torch), so its errors are rooted at
:class:`BackendError` here. The core runtime treats any exception from a backend as a failed retrieval and keeps
the conversation going; see ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations


class BackendError(Exception):
    """Root of backend failures. Messages name the endpoint or tool and the status."""


class TranscriberError(BackendError):
    """A transcription request failed (endpoint, HTTP status or cause in the message)."""


class RouterError(BackendError):
    """The router LLM failed, timed out, or answered something unusable."""


class ToolError(BackendError):
    """A tool call failed: unknown tool, invalid arguments, timeout, or the tool itself raised."""
