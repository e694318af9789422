"""What the report's Markdown and plots share: number formats, the Markdown table, pyplot without a display, and
the frame budget that latency is drawn against.

Used by :mod:`cspan.bench.report` and :mod:`cspan.bench.compare`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def fmt(value: float | None, digits: int = 3) -> str:
    """A number with ``digits`` decimals, or an en dash when missing."""
    return "–" if value is None else f"{value:.{digits}f}"


def fmt_pct(value: float | None) -> str:
    """A rate in [0, 1] as a percentage with one decimal, or an en dash."""
    return "–" if value is None else f"{100 * value:.1f} %"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[str] | None = None) -> str:
    """A Markdown table; ``align`` is one separator cell per column (default: the first left, the others right)."""
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files, no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


__all__ = ["fmt", "fmt_pct", "markdown_table", "pyplot"]
