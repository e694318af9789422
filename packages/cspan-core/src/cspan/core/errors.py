"""The error hierarchy of the core package.

Every error the project raises on purpose derives from :class:`CspanError`, and its message says what was
wrong, where, and how to fix it. ``cspan-backends`` cannot import this module (it must not depend on torch or
on ``cspan-core``), so it defines its own ``BackendError`` root with the same conventions; see
``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import errno
import os


class CspanError(Exception):
    """Root of the errors raised by cspan-core and the applications built on it."""


class SettingsError(CspanError):
    """A setting is invalid: out of range, wrong type, an unknown key in a settings file, or a value that does not
    fit what it names (a channel the recording lacks, a time past its end, a voice that cannot be read). The
    message names its source (flag, variable or file key); the ``cspan`` command exits with status 2."""

    exit_code = 2


class CheckpointError(CspanError):
    """A checkpoint file is missing, truncated, corrupt, or does not match the model (names the file and key)."""


class AudioInputError(CspanError):
    """An input recording is missing, empty, undecodable, silent-only or too long (names the file)."""


class ProtocolError(CspanError):
    """A client message violates the wire protocol (names the message type and field)."""


class SpanError(CspanError):
    """A Context Span cannot be built or injected (for example an empty reference)."""


class PersonaTooLongError(CspanError, ValueError):
    """A persona prefix (text prompt and voice) of ``frames`` frames leaves the model no room to talk in its
    ``window``-position attention window: shorten the prompt (characters such as emoji take several tokens each) or
    the voice recording."""

    def __init__(self, message: str, *, frames: int, window: int) -> None:
        super().__init__(message)
        self.frames, self.window = frames, window


class OutputError(CspanError):
    """An output file cannot be written: names the path and the cause (permission, no space, read-only file system).

    Raised before any work when an output folder is unusable, and at the end when writing fails; the outputs that
    could be written are kept (the message says which).
    """

    @classmethod
    def from_os_error(cls, path: object, exc: OSError, *, doing: str = "cannot write") -> OutputError:
        """``"PATH: cannot write: no space left on device; ..."`` from the ``OSError`` of a write to ``path``."""
        return cls(f"{path}: {doing}: {os_error_cause(exc)}{_HINTS.get(exc.errno or 0, '')}")


class Terminated(SystemExit):
    """The process was asked to stop (SIGTERM): raised in the main thread so that cleanup (``finally``, the atomic
    writers' temporary files) runs before the process exits with ``128 + signal``."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


SIGPIPE = 13
"""POSIX's SIGPIPE number (the ``signal`` module has no ``SIGPIPE`` on Windows)."""


class StdoutClosed(Terminated):
    """The reader of standard output went away (``cspan db export bob | head``): raised where the verb wrote, in the
    main thread, so that cleanup runs; ``cspan`` then exits quietly with ``128 + SIGPIPE`` (141), the status a shell
    reports for a standard tool cut off so (``yes | head``). Not an ``OSError``: a verb's ``except OSError`` does not
    report it as an error of its own."""

    def __init__(self) -> None:
        super().__init__(SIGPIPE)


_HINTS = {
    errno.ENOSPC: "; free some space or write the output elsewhere",
    errno.EDQUOT: "; free some space or write the output elsewhere",
    errno.EACCES: "; choose a folder you can write, or fix its permissions",
    errno.EPERM: "; choose a folder you can write, or fix its permissions (or attributes: lsattr)",
    errno.EROFS: "; choose a folder on a writable file system",
}


def os_error_cause(exc: OSError) -> str:
    """The cause of an ``OSError`` in words, lower case: ``"no space left on device"``, ``"permission denied"``,
    ``"read-only file system"``... (``strerror`` of its ``errno``; the exception's text when it has none). An
    ``ssl.SSLError``'s errno is OpenSSL's code, not the system's: its reason is given (``"key values mismatch"``)."""
    if type(exc).__module__ == "ssl":
        return (getattr(exc, "reason", None) or str(exc) or type(exc).__name__).replace("_", " ").lower()
    if exc.errno:
        return os.strerror(exc.errno).lower()
    return str(exc) or type(exc).__name__


def validation_summary(exc: Exception) -> str:
    """One line for a pydantic ``ValidationError``: ``"dim: Input should be a valid integer (got 'abc'); ..."``
    (field path, pydantic's message, the offending value), without pydantic's help URLs and line breaks."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return " ".join(str(exc).split())
    parts = []
    for error in errors():
        where = ".".join(str(p) for p in error.get("loc", ())) or "value"
        value = repr(error.get("input"))
        value = value if len(value) <= 60 else value[:57] + "..."
        parts.append(f"{where}: {error.get('msg', 'invalid')} (got {value})")
    return "; ".join(parts)


def one_line(text: str) -> str:
    """``text`` on one line: its lines (a library's message such as psycopg's, with a tab-indented hint) joined by
    spaces, blank ones dropped."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def describe_os_error(exc: OSError) -> str:
    """One line for an ``OSError`` that reached the command line: the file(s) it names and the cause."""
    files = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
    return f"{files}: {os_error_cause(exc)}" if files else os_error_cause(exc)
