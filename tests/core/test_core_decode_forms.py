"""The decode kernel's tensor-core form (``DECODE_CONFIGS`` form 2) and the split combine's row invariance, checked
on the CPU through Triton's interpreter (tests/core/decode_forms.py, in a subprocess: the interpreter is chosen when
triton is imported). The GPU runs the same kernels in tests/core/test_core_fused_cuda.py (bf16; the interpreter's
bf16 products are not faithful, so this check runs float16 rings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(
    os.environ.get("CSPAN_TEST_INTERPRETER") != "1",
    reason="Triton's interpreter: opt in with CSPAN_TEST_INTERPRETER=1 (needs triton installed)",
)
def test_tensor_core_decode_and_combine_under_the_interpreter(repo_root: Path) -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CSPAN_FUSED": "1"}
    script = repo_root / "tests" / "core" / "decode_forms.py"
    proc = subprocess.run([sys.executable, "-W", "ignore", str(script)], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["decode_worst_relative_error"] < 5e-3
    assert all(result["combine_rows_invariant"].values())
