"""Errors of the benchmark package, rooted at :class:`cspan.core.errors.CspanError` so ``cspan bench`` prints them.

Messages say what was wrong, where (the file or URL), and how to fix it.
"""

from __future__ import annotations

from cspan.core.errors import CspanError, SettingsError


class BenchError(CspanError):
    """Root of the benchmark errors."""


class BenchSettingsError(BenchError, SettingsError):
    """A bench setting is out of range or does not fit what it names (names the flag); exit status 2."""


class BenchDataError(BenchError):
    """A benchmark folder or file is missing, unreadable, or not in the benchmark's layout (names the path)."""


class JudgeError(BenchError):
    """The LLM judge could not be reached, failed, or never answered in the required format (names the URL)."""
