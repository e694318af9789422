"""scripts/fsdp_7b_step.py: the FSDP2 step of the 7B (GPU) runs the same code as this CPU smoke test (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "fsdp_7b_step.py"


def _torchrun(args: list[str], tmp_path: Path, nproc: int = 2) -> dict:
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, str(SCRIPT), *args, "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_fsdp_step_script_on_cpu_gloo(tiny_checkpoint_dir, tmp_path):
    res = _torchrun(["--device", "cpu", "--config", str(tiny_checkpoint_dir / "config.json"), "--frames", "16"],
                    tmp_path)  # fmt: skip
    assert res["world_size"] == 2 and len(res["step_s"]) == 3
    assert all(v > 0 for v in res["loss"]) and res["loss"][-1] < res["loss"][0]


@pytest.mark.gpu
def test_fsdp_step_of_the_7b_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    res = _torchrun(["--frames", "256", "--steps", "2"], tmp_path)
    assert res["parameters"] == 8_371_408_896
    assert all(v == v for v in res["loss"])  # finite
