"""The error hierarchy of the core package.

Every error the project raises on purpose derives from :class:`CspanError`, and its message says what was
wrong, where, and how to fix it. ``cspan-backends`` cannot import this module (it must not depend on torch or
on ``cspan-core``), so it defines its own ``BackendError`` root with the same conventions; see
``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations


class CspanError(Exception):
    """Root of the errors raised by cspan-core and the applications built on it."""


class CheckpointError(CspanError):
    """A checkpoint file is missing, truncated, corrupt, or does not match the model (names the file and key)."""


class AudioInputError(CspanError):
    """An input recording is missing, empty, undecodable, silent-only or too long (names the file)."""


class ProtocolError(CspanError):
    """A client message violates the wire protocol (names the message type and field)."""


class SpanError(CspanError):
    """A Context Span cannot be built or injected (for example an empty reference)."""
