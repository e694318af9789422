"""scripts/fsdp_scaling.py: the multi-GPU benchmark of the 7B (FSDP2, NCCL) runs the same code as this CPU smoke test
(gloo, the tiny shape): the measured run, its checkpoint resumed on another number of processes with the same next
two losses, the JSON it writes and the scaling table of ``--report``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "fsdp_scaling.py"


def _script(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_fsdp_scaling_script_on_cpu_gloo(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # lr 1e-3: the second compared loss moves visibly with the AdamW moments read back
    _script("--device", "cpu", "--shape", "tiny", "--frames", "16", "--warmup", "1", "--steps", "2", "--lr", "1e-3",
            "--gpus", "2", "--resume-on", "1", "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(out))  # fmt: skip
    record = json.loads((out / "fsdp_scaling_2gpu.json").read_text())
    meas = record["measure"]
    assert meas["world_size"] == 2 and meas["global_batch"] == 2 and meas["parameters"] == 4_825_344
    assert len(meas["losses"]) == 3 and all(v > 0 for v in meas["losses"])
    assert meas["frames_per_s"] == pytest.approx(2 * 16 / meas["step_s_median"], rel=1e-3)
    # about 12 bytes a parameter (weights and two AdamW moments, float32), one file per writing rank
    assert 12 * 4_825_344 <= meas["checkpoint"]["bytes"] <= 14 * 4_825_344
    assert record["resume"]["world_size"] == 1 and record["resume"]["accum"] == 2
    check = record["resume_check"]
    assert check["ok"] and check["saved_on"] == 2 and check["resumed_on"] == 1
    assert check["max_rel_diff"] <= 1e-5 and len(check["losses_resumed"]) == 2
    assert not (tmp_path / "ckpt").exists()  # deleted after the check
    assert (out / "fsdp_scaling_2gpu.log").is_file() and (out / "fsdp_scaling_2to1gpu.log").is_file()
    table = _script("--report", str(out / "fsdp_scaling_*.json")).stdout
    assert "| 2 | 2 |" in table and "100.0% |" in table


@pytest.mark.gpu
def test_fsdp_scaling_of_the_7b_on_two_gpus(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    _script("--gpus", "2", "--frames", "256", "--warmup", "1", "--steps", "2", "--out", str(tmp_path))
    meas = json.loads((tmp_path / "fsdp_scaling_2gpu.json").read_text())["measure"]
    assert meas["parameters"] == 8_371_408_896
    assert all(v == v for v in meas["losses"])  # finite
