"""A ``cspan train --fsdp`` checkpoint does not depend on the world size: saved by 4 processes (FSDP2 on gloo),
resumed by 2, whose checkpoint 4 resume again (and one process without FSDP), each next step with the loss of the
uninterrupted 4-process run and of one process; and the weights and optimizer state at the end equal the
uninterrupted run's.

Tolerances: the runs differ only in the order of floating-point sums (gradient reduce-scatter over 4 or 2 ranks,
micro-batch accumulation), float32 on the CPU: losses within ``rtol 1e-5`` of the uninterrupted 4-process run (seen:
equal) and ``2e-5`` of one process (as the DDP/FSDP test of ``test_train_run.py``), weights and AdamW moments
within ``rtol 1e-4, atol 1e-6`` (seen: 1.9e-7 absolute).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cspan.train.train import read_train_state

pytestmark = pytest.mark.slow

# global batch 4 in every run: 1 process x accum 4, 4 x accum 1, 2 x accum 2
COMMON = ["--context", "120", "--lr", "3e-3", "--steps", "3", "--seed", "7", "--keep-checkpoints", "0"]
COMMON += ["--log-every", "1"]


def _args(data: Path, out: Path, tiny: Path, *extra: str) -> list[str]:
    return ["train", "--data-dir", str(data), "--out-dir", str(out), "--checkpoint", str(tiny), *COMMON, *extra]


def _train(*args: str) -> None:
    """``cspan train`` in this process, on one thread (see ``test_train_run.py``)."""
    from cspan.core.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(list(args)) == 0
    finally:
        torch.set_num_threads(threads)


def _torchrun(nproc: int, args: list[str]) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["-m", "cspan.core.cli", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stderr


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _ckpt(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:08d}"


def _copy_until(src: Path, dst: Path, step: int) -> Path:
    """A copy of run ``src`` as it was when the checkpoint of ``step`` was its newest."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "export", ignore_errors=True)
    for folder in (dst / "checkpoints").glob("step_*"):
        if int(folder.name.removeprefix("step_")) > step:
            shutil.rmtree(folder)
    return dst


def _assert_states_close(a: Path, b: Path) -> None:
    sa, sb = read_train_state(a), read_train_state(b)
    assert set(sa) == set(sb)
    assert any(k.startswith("model.lm.") for k in sa) and any(k.endswith(".exp_avg_sq") for k in sa)
    for key in sa:
        torch.testing.assert_close(sb[key], sa[key], rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


def test_fsdp_checkpoint_resumes_on_another_world_size(
    prepared_dir: Path, tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cspan.core.cli import main

    single = tmp_path / "single"
    _train(*_args(prepared_dir, single, tiny_dir, "--batch-size", "1", "--accum", "4"))
    straight = tmp_path / "w4"
    _torchrun(4, _args(prepared_dir, straight, tiny_dir, "--fsdp", "--batch-size", "1", "--accum", "1", "--ckpt-every", "1"))  # fmt: skip
    reference = _losses(straight)
    assert len(reference) == 3 and reference[-1] < reference[0]
    np.testing.assert_allclose(reference, _losses(single), rtol=2e-5)
    # every rank wrote its own shards of the step-1 checkpoint: no rank gathered the model
    assert len(list(_ckpt(straight, 1).glob("__*.distcp"))) == 4

    # 4 -> 2: step 2 on 2 processes (accum 2: the same global batch), from the checkpoint 4 processes wrote
    chain = _copy_until(straight, tmp_path / "chain", 1)
    err = _torchrun(2, _args(prepared_dir, chain, tiny_dir, "--fsdp", "--batch-size", "1", "--accum", "2", "--stop-at", "2"))  # fmt: skip
    assert "step 1 of 3" in err
    assert json.loads((_ckpt(chain, 2) / "COMPLETE").read_text())["world"] == 2
    # 2 -> 4: step 3 on 4 processes again, from the checkpoint 2 processes wrote
    err = _torchrun(4, _args(prepared_dir, chain, tiny_dir, "--fsdp", "--batch-size", "1", "--accum", "1"))
    assert "step 2 of 3" in err
    losses = _losses(chain)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    np.testing.assert_allclose(losses, _losses(single), rtol=2e-5)
    _assert_states_close(_ckpt(straight, 3), _ckpt(chain, 3))

    # 4 -> 1: one process without FSDP reads the sharded checkpoint too
    alone = _copy_until(straight, tmp_path / "alone", 2)
    _train(*_args(prepared_dir, alone, tiny_dir, "--batch-size", "1", "--accum", "4"))
    np.testing.assert_allclose(_losses(alone), reference, rtol=1e-5)
    _assert_states_close(_ckpt(straight, 3), _ckpt(alone, 3))

    # another global batch is refused, with the --accum that keeps it
    capsys.readouterr()
    again = _copy_until(straight, tmp_path / "again", 2)
    assert main(_args(prepared_dir, again, tiny_dir, "--batch-size", "1", "--accum", "2")) == 2
    err = capsys.readouterr().err
    assert "global batch (--batch-size x --accum x processes) 4 (now 2)" in err, err
    assert "written by 4 process(es)" in err and "use --accum 4" in err
