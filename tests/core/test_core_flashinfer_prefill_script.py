"""scripts/flashinfer_prefill.py: the page lists that let FlashInfer's paged prefill read the engine's ring in position
order (page size 1 through a strided view, the block's keys staged in the scratch row) give exactly the engine's
attention mask, on rings filling, full and wrapped, and blocks longer than the window (CPU, float32)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "flashinfer_prefill.py"


def test_page_lists_read_the_ring_exactly_as_the_engines_mask() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-check"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("max |paged - engine|") == 3 and proc.stdout.endswith("page lists: exact\n")
