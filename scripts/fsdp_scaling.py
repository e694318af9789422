"""FSDP2 training of the PersonaPlex-shaped 7B (random weights) on N GPUs, and its checkpoint resumed on M GPUs.

One command per GPU count; it starts ``torchrun`` itself, with NVLink multicast off in the children's environment
(``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``) and the repository's
``cspan-core`` / ``cspan-train`` sources on their ``PYTHONPATH``::

    python3 scripts/fsdp_scaling.py --gpus 4 --resume-on 2 --out $OUT     # -> $OUT/fsdp_scaling_4gpu.json
    python3 scripts/fsdp_scaling.py --report $OUT/fsdp_scaling_*.json     # the table, scaling efficiency included

What a run does (``docs/PERFORMANCE.md``, "Multi-GPU"):

1. ``torchrun --nproc-per-node N``: the model is built on the meta device, wrapped as ``cspan train --fsdp`` wraps
   it (:class:`~cspan.train.train.TrainModule`, activation checkpointing, :func:`~cspan.train.train.apply_fsdp`),
   materialised on each GPU with a cheap random init (no rank ever holds the whole model) and trained with the
   trainer's optimizer (:func:`~cspan.train.train.build_optimizer`: AdamW, float32 master weights and moments) under
   bf16 autocast on random token sequences of ``--frames`` frames. Each GPU takes ``--micro-batch`` sequences per
   micro-batch and ``--accum`` micro-batches per step: weak scaling, the global batch grows with N. Sequence ``g``
   of step ``s`` is a function of ``(seed, s, g)`` alone and the loss is normalised over the global batch, as in
   ``cspan train``. Measured: the step time after ``--warmup`` steps, frames (and tokens: 1 + n_q per frame) per
   second, the peak memory of every GPU.
2. With ``--resume-on M``: after the measured steps every rank writes its shards of the weights and AdamW state
   (:func:`~cspan.train.train.save_train_state`, ``torch.distributed.checkpoint``; about 12 bytes a parameter, 100 GB
   for the 7B, to ``--ckpt-dir`` on local disk), then the N-GPU run takes two more steps. A second ``torchrun`` on M
   GPUs reads that checkpoint (:func:`~cspan.train.train.load_train_state`, resharded) and takes the same two steps
   with the same global batch (``--accum`` scaled by N / M): their losses must match the uninterrupted run's within
   ``--rtol`` (the second step's loss is computed after an AdamW update from the restored moments). The checkpoint
   is deleted afterwards (``--keep-ckpt`` keeps it).

``--device cpu --shape tiny`` runs the same code on gloo with the tiny test model (``tests/train``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SOURCES = [REPO / "packages" / "cspan-core" / "src", REPO / "packages" / "cspan-train" / "src"]
# NVLink multicast can put a shared host's GPUs out of service: off in every process this script starts
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
STATE_BYTES_PER_PARAM = 12  # float32 weight + AdamW exp_avg + exp_avg_sq
AFTER_STEPS = 2  # steps compared between the uninterrupted run and the resumed one
CKPT_DIR = Path(".fsdp_scaling_ckpt")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None, help="processes of the measured run (GPUs, or CPU ranks)")
    parser.add_argument("--resume-on", type=int, default=0, help="then resume its checkpoint on this many (0: no)")
    parser.add_argument("--shape", choices=("personaplex-7b", "moshi-7b", "tiny"), default="personaplex-7b")
    parser.add_argument("--frames", type=int, default=3000, help="frames per sequence (cspan train's --context)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-batch")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per step on the measured run")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the timed ones")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo (smoke tests)")
    parser.add_argument("--rtol", type=float, default=None, help="resume check (default 1e-3 cuda/bf16, 1e-5 cpu)")
    parser.add_argument("--ckpt-dir", type=Path, default=None, help=f"on local disk, not $OUT (default {CKPT_DIR})")
    parser.add_argument("--keep-ckpt", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="folder for fsdp_scaling_<N>gpu.json and the logs")
    parser.add_argument("--report", nargs="+", default=None, help="JSON files of runs: print the scaling table")
    # set by the launcher for the torchrun children
    parser.add_argument("--worker", choices=("measure", "resume"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--global-batch", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--start-step", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.report is None and args.worker is None and (args.gpus is None or args.out is None):
        parser.error("give --gpus N and --out DIR (or --report FILES)")
    if args.rtol is None:
        args.rtol = 1e-3 if args.device == "cuda" else 1e-5
    return args


# ---------------------------------------------------------------------------------------------------------------
# Launcher (no torch import: it only starts torchrun and reads what the ranks wrote)
# ---------------------------------------------------------------------------------------------------------------


def child_env(device: str) -> dict[str, str]:
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    paths = [str(p) for p in SOURCES] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if device == "cuda":
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    else:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def torchrun(nproc: int, worker_args: list[str], log: Path, env: dict[str, str]) -> tuple[int, float]:
    """Run this script as ``--worker`` under ``torchrun --standalone``; output to ``log``. Returns (rc, seconds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += [str(Path(__file__).resolve()), *worker_args]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False).returncode
    seconds = time.perf_counter() - t0
    print(f"  rc {rc} after {seconds:.0f} s (log {log})", flush=True)
    return rc, seconds


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""


def launch(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    n, m = args.gpus, args.resume_on
    global_batch = n * args.micro_batch * args.accum
    if m and global_batch % (m * args.micro_batch):
        print(
            f"--resume-on {m}: the global batch {global_batch} is not a multiple of {m} x --micro-batch",
            file=sys.stderr,
        )
        return 2
    env = child_env(args.device)
    common = ["--shape", args.shape, "--frames", str(args.frames), "--micro-batch", str(args.micro_batch)]
    common += ["--lr", str(args.lr), "--seed", str(args.seed), "--device", args.device]
    common += ["--global-batch", str(global_batch)]
    ckpt = (args.ckpt_dir or CKPT_DIR).resolve()
    record: dict[str, Any] = {"started_utc": datetime.now(UTC).isoformat(timespec="seconds")}
    rc = 0
    with tempfile.TemporaryDirectory() as tmp:
        measured_json = Path(tmp) / "measure.json"
        worker = ["--worker", "measure", "--warmup", str(args.warmup), "--steps", str(args.steps)]
        worker += ["--result", str(measured_json)]
        if m:
            shutil.rmtree(ckpt, ignore_errors=True)
            worker += ["--ckpt-dir", str(ckpt)]
        log = out / f"fsdp_scaling_{n}gpu.log"
        rc, seconds = torchrun(n, [*worker, *common], log, env)
        record["measure"] = json.loads(measured_json.read_text()) if measured_json.is_file() else None
        record["measure_wall_s"] = round(seconds, 1)
        if rc != 0:
            record["error"] = f"torchrun on {n} exited {rc}: " + _tail(log)
        saved = record["measure"] is not None and record["measure"].get("checkpoint") is not None
        if m and saved:
            resumed_json = Path(tmp) / "resume.json"
            start = record["measure"]["checkpoint"]["step"]
            worker = ["--worker", "resume", "--start-step", str(start), "--ckpt-dir", str(ckpt)]
            worker += ["--result", str(resumed_json)]
            log = out / f"fsdp_scaling_{n}to{m}gpu.log"
            rc_resume, seconds = torchrun(m, [*worker, *common], log, env)
            resumed = json.loads(resumed_json.read_text()) if resumed_json.is_file() else None
            record["resume"] = resumed
            record["resume_wall_s"] = round(seconds, 1)
            if rc_resume != 0:
                record["error"] = f"torchrun on {m} (resume) exited {rc_resume}: " + _tail(log)
                rc = rc or rc_resume
            if resumed is not None:
                record["resume_check"] = compare(record["measure"]["after_checkpoint"], resumed["losses"], args.rtol)
                record["resume_check"].update(saved_on=n, resumed_on=m)
                if not record["resume_check"]["ok"]:
                    rc = rc or 1
        elif m:
            record["resume_check"] = {"ok": False, "why": "no checkpoint was written (see measure.checkpoint_skipped)"}
            rc = rc or 1
    if m and not args.keep_ckpt:
        shutil.rmtree(ckpt, ignore_errors=True)
    path = out / f"fsdp_scaling_{n}gpu.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(summary(record), indent=2))
    print(f"wrote {path}")
    return rc


def compare(reference: list[float], resumed: list[float], rtol: float) -> dict[str, Any]:
    """Losses of the uninterrupted run against the resumed one after the same checkpoint."""
    diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(reference, resumed, strict=True)]
    return {
        "losses_uninterrupted": reference,
        "losses_resumed": resumed,
        "max_rel_diff": max(diffs),
        "rtol": rtol,
        "ok": max(diffs) <= rtol,
    }


def summary(record: dict[str, Any]) -> dict[str, Any]:
    meas = record.get("measure") or {}
    keys = ("world_size", "frames_per_s", "frames_per_s_per_gpu", "step_s_median", "peak_allocated_gib_max")
    out = {k: meas.get(k) for k in keys}
    if "resume_check" in record:
        out["resume_check"] = {
            k: record["resume_check"].get(k) for k in ("saved_on", "resumed_on", "max_rel_diff", "ok")
        }
    if "error" in record:
        out["error"] = record["error"].splitlines()[0]
    return out


def report(files: list[str]) -> int:
    """Print a markdown table of runs, scaling efficiency against the smallest GPU count that ran."""
    runs = []
    for name in sorted({f for pattern in files for f in glob.glob(pattern)}):
        meas = json.loads(Path(name).read_text()).get("measure") or {}
        if meas.get("frames_per_s"):
            runs.append(meas)
    if not runs:
        print("no run with a measurement", file=sys.stderr)
        return 1
    runs.sort(key=lambda r: r["world_size"])
    base = runs[0]
    print(f"| GPUs | global batch | step s (median) | frames/s | frames/s per GPU | tokens/s | peak GiB per GPU | "
          f"efficiency vs {base['world_size']} |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        eff = r["frames_per_s_per_gpu"] / base["frames_per_s_per_gpu"]
        print(
            f"| {r['world_size']} | {r['global_batch']} | {r['step_s_median']:.3f} | {r['frames_per_s']:.0f} | "
            f"{r['frames_per_s_per_gpu']:.0f} | {r['tokens_per_s']:.0f} | {r['peak_allocated_gib_max']:.1f} | "
            f"{eff:.1%} |"
        )
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Worker (one torchrun rank)
# ---------------------------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from cspan.core.config import LMConfig
    from cspan.core.lm import LMModel
    from cspan.core.tiny import tiny_lm_config
    from cspan.train.train import (
        TrainModule,
        apply_fsdp,
        build_optimizer,
        enable_activation_checkpointing,
        load_train_state,
        save_train_state,
    )

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    G, micro = args.global_batch, args.micro_batch
    if G % (world * micro):
        raise SystemExit(f"global batch {G} is not a multiple of {world} ranks x micro-batch {micro}")
    accum = G // (world * micro)

    cfg = {"personaplex-7b": LMConfig.personaplex_7b, "moshi-7b": LMConfig.moshi_7b, "tiny": tiny_lm_config}[
        args.shape
    ]()
    with torch.device("meta"):
        lm = LMModel(cfg, device="meta", dtype=torch.float32)
    n_params = sum(p.numel() for p in lm.parameters())
    lm.train()
    enable_activation_checkpointing(lm)
    module = TrainModule(lm)
    apply_fsdp(lm, module, device.type, world)
    module.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
    with torch.no_grad():
        for name, p in module.named_parameters():
            shard = p.to_local() if hasattr(p, "to_local") else p
            if name.endswith("alpha") or "norm" in name:
                shard.fill_(1.0)
            else:
                shard.normal_(0.0, 0.02, generator=gen)
    optimizer = build_optimizer(module, lr=args.lr, lr_depformer=2 * args.lr)
    K, L, dep_q = cfg.n_q + 1, args.frames, cfg.dep_q

    def sequence(step: int, g: int) -> torch.Tensor:
        """Sequence ``g`` of ``step``: random text and audio tokens [K, L + 1], a function of (seed, step, g)."""
        seq_gen = torch.Generator().manual_seed(int(np.random.SeedSequence([args.seed, step, g]).generate_state(1)[0]))
        text = torch.randint(0, cfg.text_card, (1, L + 1), generator=seq_gen)
        audio = torch.randint(0, cfg.card, (K - 1, L + 1), generator=seq_gen)
        return torch.cat([text, audio])

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def train_step(step: int) -> tuple[float, float]:
        """One optimizer step over the global batch; returns (loss, seconds)."""
        sync()
        t0 = time.perf_counter()
        n_text, n_audio = G * L, G * L * dep_q
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        for a in range(accum):
            first = (a * world + rank) * micro
            batch = torch.stack([sequence(step, first + j) for j in range(micro)]).to(device)
            inputs, targets = batch[:, :, :-1], batch[:, :, 1:]
            module.set_requires_gradient_sync(a == accum - 1)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                text_logits, audio_logits = module(inputs, targets)
            text = F.cross_entropy(text_logits.float().flatten(0, 1), targets[:, 0].flatten(), reduction="sum")
            audio_t = targets[:, 1 : 1 + dep_q].flatten()
            audio = F.cross_entropy(audio_logits.float().flatten(0, 2), audio_t, reduction="sum")
            ((text / n_text + audio / n_audio) * world).backward()  # FSDP2 averages gradients over the ranks
            sums += torch.stack([text.detach() / n_text, audio.detach() / n_audio]).double()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(sums)
        loss = float(sums.sum())
        sync()
        return loss, time.perf_counter() - t0

    def peaks() -> dict[str, list[float]]:
        mine = [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)] if cuda else [0, 0]
        table = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(world)]
        dist.all_gather(table, torch.tensor(mine, dtype=torch.float64, device=device))
        return {
            "peak_allocated_gib": [round(float(t[0]) / 2**30, 2) for t in table],
            "peak_reserved_gib": [round(float(t[1]) / 2**30, 2) for t in table],
        }

    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device) if cuda else "cpu (gloo)",
        "torch": torch.__version__,
        "world_size": world,
        "shape": args.shape,
        "parameters": n_params,
        "frames": L,
        "tokens_per_frame": K,
        "micro_batch": micro,
        "accum": accum,
        "global_batch": G,
        "precision": "float32 master weights and AdamW moments, bf16 autocast" if cuda else "float32",
        "activation_checkpointing": True,
    }
    if args.worker == "measure":
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        losses, times = [], []
        for step in range(args.warmup + args.steps):
            loss, seconds = train_step(step)
            losses.append(loss)
            times.append(seconds)
            if rank == 0:
                print(f"step {step + 1}: loss {loss:.4f}, {seconds:.3f} s", flush=True)
        timed = sorted(times[args.warmup :])
        median = timed[len(timed) // 2]
        result.update(
            losses=losses,
            step_s=[round(t, 4) for t in times],
            step_s_median=round(median, 4),
            frames_per_s=round(G * L / median, 1),
            frames_per_s_per_gpu=round(G * L / median / world, 1),
            tokens_per_s=round(G * L * K / median, 1),
            **peaks(),
        )
        result["peak_allocated_gib_max"] = max(result["peak_allocated_gib"])
        if args.ckpt_dir is not None:
            step = args.warmup + args.steps
            need = STATE_BYTES_PER_PARAM * n_params * 1.02
            if rank == 0:
                args.ckpt_dir.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            decision = [shutil.disk_usage(args.ckpt_dir).free]
            dist.broadcast_object_list(decision, src=0)  # every rank takes rank 0's decision
            free = decision[0]
            if free < need:
                result["checkpoint_skipped"] = (
                    f"{free / 1e9:.1f} GB free at {args.ckpt_dir}, {need / 1e9:.1f} GB needed"
                )
            else:
                if rank == 0:
                    print(f"saving the training state of step {step} to {args.ckpt_dir}", flush=True)
                sync()
                t0 = time.perf_counter()
                save_train_state(args.ckpt_dir, module, optimizer)
                sync()
                dist.barrier()
                size = sum(f.stat().st_size for f in args.ckpt_dir.iterdir() if f.is_file())
                result["checkpoint"] = {
                    "step": step,
                    "save_s": round(time.perf_counter() - t0, 2),
                    "bytes": size,
                    "files": len(list(args.ckpt_dir.iterdir())),
                    "disk_free_gb_before": round(free / 1e9, 1),
                }
                result["after_checkpoint"] = [train_step(step + i)[0] for i in range(AFTER_STEPS)]
    else:
        t0 = time.perf_counter()
        load_train_state(args.ckpt_dir, module, optimizer)
        sync()
        dist.barrier()
        result["load_s"] = round(time.perf_counter() - t0, 2)
        if rank == 0:
            print(f"read the training state of step {args.start_step} in {result['load_s']} s", flush=True)
        result["losses"] = [train_step(args.start_step + i)[0] for i in range(AFTER_STEPS)]
        result.update(peaks())
    if rank == 0 and args.result is not None:
        args.result.write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        return report(args.report)
    if args.worker is not None:
        rc = worker(args)
        # Every result is written and the process group destroyed: leave without the interpreter's teardown, where
        # gloo's threads sometimes abort the process ("terminate called without an active exception", SIGABRT),
        # which torchrun then reports as a failed run (seen on CPU in long test sessions).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
