"""Errors of the benchmark package, rooted at :class:`cspan.core.errors.CspanError` so ``cspan bench`` prints them.

Messages say what was wrong, where (the file or URL), and how to fix it.
"""

from __future__ import annotations

from cspan.core.errors import CspanError


class BenchError(CspanError):
    """Root of the benchmark errors."""


class BenchDataError(BenchError):
    """A benchmark folder or file is missing, unreadable, or not in the benchmark's layout (names the path)."""


class JudgeError(BenchError):
    """The LLM judge could not be reached, failed, or never answered in the required format (names the URL)."""
