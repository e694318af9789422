"""Times in seconds read from result files: a NaN or infinite time is no time at all.

Benchmark results come from other programs (ASR servers, the benchmarks' own scripts); a non-finite time in them
must never reach a mean, a comparison or a JSON file (``NaN`` is not JSON). Models type such fields as
:data:`Seconds`, which reads a non-finite (or non-numeric) value as ``None``, i.e. missing.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator


def finite_or_none(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


Seconds = Annotated[float | None, AfterValidator(finite_or_none)]
"""A time or duration in seconds (anything pydantic reads as a float); a non-finite value reads as missing (None)."""
