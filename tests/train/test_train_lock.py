"""One ``cspan train`` run per ``--out-dir``: the run holds an exclusive ``flock`` on ``OUT/train.lock`` for its
lifetime; a second run (single process, or every rank of a ``torchrun`` job) is refused at once with exit status 2
and a line naming the folder and the holder; the lock goes with the holder's process, however it ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from in_process import run_cspan as _run

from cspan.train.errors import TrainSettingsError
from cspan.train.train import LOCK_FILE, lock_out_dir

pytestmark = pytest.mark.slow

COMMON = ["--context", "120", "--lr", "3e-3", "--keep-checkpoints", "0", "--seed", "7"]
ONE_STEP = ["--steps", "1", "--batch-size", "1", "--accum", "1"]

HOLDER = """
import sys
from cspan.train.train import lock_out_dir
handle = lock_out_dir(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()  # until the test closes stdin or kills this process
"""


def _args(data: Path, out: Path, tiny: Path) -> list[str]:
    return ["train", "--data-dir", str(data), "--out-dir", str(out), "--checkpoint", str(tiny), *COMMON, *ONE_STEP]


def _hold(out: Path) -> subprocess.Popen[str]:
    """Another process holding the lock of ``out`` (through :func:`lock_out_dir`), until killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
    return proc


def _refusal(out: Path, pid: int) -> str:
    return (
        f"--out-dir {str(out)!r} is in use by another `cspan train` run (process {pid} on {socket.gethostname()}), "
        f"which holds {str(out / LOCK_FILE)!r}"
    )


def test_a_second_run_is_refused_while_the_first_holds_the_out_dir(
    prepared_dir: Path, tiny_dir: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "run"
    holder = _hold(out)
    try:
        capsys.readouterr()
        assert _run(*_args(prepared_dir, out, tiny_dir)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"cspan train: error: {_refusal(out, holder.pid)}") and err.count("\n") == 1, err
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # the refused run wrote nothing, removed nothing
        with pytest.raises(TrainSettingsError, match="is in use by another `cspan train` run"):
            lock_out_dir(out)
    finally:
        holder.kill()  # a crash: SIGKILL, no clean-up of its own
        holder.wait()
    assert holder.returncode == -signal.SIGKILL
    # the kernel dropped the dead holder's lock: the same command now trains, and releases the lock when it ends
    assert _run(*_args(prepared_dir, out, tiny_dir)) == 0
    assert (out / "export").is_dir()
    assert (out / LOCK_FILE).read_text().split() == [str(os.getpid()), socket.gethostname()]
    lock_out_dir(out).close()


def test_every_rank_of_a_torchrun_job_is_refused_and_none_waits(
    prepared_dir: Path, tiny_dir: Path, tmp_path: Path
) -> None:
    """Rank 0 takes the lock and every rank learns the outcome: both ranks print the refusal (rank 0 naming the
    holder) and exit with status 2 (the other rank does not wait in a collective for a rank 0 that has left);
    torchrun reports the failure."""
    out = tmp_path / "run"
    handle = lock_out_dir(out)
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        cmd += ["-m", "cspan.core.cli", *_args(prepared_dir, out, tiny_dir)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # the timeout only stops a hung job (the bug this guards against) from hanging the suite
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    finally:
        handle.close()
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert output.count(f"cspan train: error: {_refusal(out, os.getpid())}") == 1, output  # rank 0
    other = f"cspan train: error: --out-dir {str(out)!r} is in use by another `cspan train` run (rank 0 names it)"
    assert output.count(other) == 1, output
    assert "exitcode  : 2" in output, output  # torchrun's summary of the failed rank
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
