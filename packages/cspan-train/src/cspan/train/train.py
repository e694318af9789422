"""``cspan train``: fine-tune a Moshi-family checkpoint on prepared dialogues with Context Spans spliced in.

One optimizer step (``docs/TRAINING.md``):

1. every rank draws its ``batch_size x accum`` samples; sample ``g`` of step ``s`` has the global index
   ``g = s * (batch_size * accum * world) + (micro * world + rank) * batch_size + j`` and is a pure function of
   ``(seed, g)`` (:class:`cspan.train.dataset.SequenceSampler`): persona prefix, dialogue, Context Span blocks at
   MoshiRAG-sampled delays, a random window of ``--context`` positions;
2. the loss weights of all micro-batches of all ranks are summed first (one all-reduce), so the loss is the
   weighted mean over the whole global batch whatever the split (``torchrun`` with 2 processes equals one process
   with twice the batch);
3. forward (:meth:`cspan.core.lm.LMModel.forward_delayed`, bf16 autocast on CUDA, activation checkpointing per
   transformer layer), backward per micro-batch (gradients synchronised on the last one), clipping at ``--clip``,
   AdamW, warm-up + cosine learning rate;
4. metrics to ``metrics.jsonl`` (and TensorBoard when installed); every ``--ckpt-every`` steps a checkpoint that
   resumes exactly, on any number of processes (:func:`save_train_state`: trainable weights and optimizer state as a
   ``torch.distributed.checkpoint`` that every rank writes its shards of and any world size reads; scheduler; the
   step, which is the data position; the RNGs are reseeded from ``(seed, rank, step)`` at every step, so they need
   no saving).

Resuming on another world size: the samples of step ``s`` are the global indices ``[s * G, (s + 1) * G)`` with
``G = batch_size * accum * world``, whichever rank draws each, and the loss is normalised over the global batch; so
a run resumed with the same ``G`` (e.g. 4 processes x ``--accum 1`` -> 2 processes x ``--accum 2``) takes the same
next step, up to the order of floating-point sums (``docs/TRAINING.md``).

Full fine-tuning or LoRA (``--lora-rank``); single process, DDP or FSDP2 (``fully_shard``, ``--fsdp``) under
``torchrun``. A run locks its ``--out-dir`` for its lifetime (:func:`lock_out_dir`, rank 0 for the job): a second run
there is refused on every rank. At the end the model is exported in the released layout (``OUT/export/``: a
fine-tune ``.pt`` holding ``{"model": state_dict}`` and, for LoRA, the unmerged adapters plus
``{"lora": {"r", "alpha"}}``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from cspan.core.checkpoint import CONFIG_FILE as MODEL_CONFIG_FILE
from cspan.core.checkpoint import EXPORT_INFO, MOSHI_LORA_FILE, checkpoint_reads
from cspan.core.config import CONTEXT_SPANNING
from cspan.core.errors import SettingsError
from cspan.core.files import atomic_file, write_text_atomic
from cspan.core.reads import Reads, check_outputs

from .dataset import PreparedDataset, SamplerConfig, SequenceSampler, TrainingSequence, collate
from .errors import TrainError, TrainSettingsError
from .lora import ALL_LINEAR, add_lora, freeze_all_but_lora, lora_spec, resolve_targets
from .loss import LossWeights, token_weights, weighted_cross_entropy

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
EXPORT_DIR = "export"
EXPORT_FILE = "context_spanning.pt"
EXPORT_FORMATS = ("cspan", "moshi")
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "train_config.json"
COMPLETE_FILE = "COMPLETE"
LOCK_FILE = "train.lock"
"""``OUT/train.lock``: locked (``flock``, exclusive) by the run that trains into ``OUT`` (rank 0 under ``torchrun``) for
its whole lifetime; holds that process's id and host. Left in place after the run (the lock, not the file, is what
counts; the kernel drops it when the process ends, however it ends)."""

# options that define the sample stream and the optimisation, as (key of the config record, flag): a resumed run
# must not change them (the others -- --stop-at, --ckpt-every, --log-every, --keep-checkpoints, --device, --dtype,
# --autocast, --fsdp, activation checkpointing, the export options, the number of processes at the same global
# batch -- say where, how fast or in which precision it runs, not what it learns); the weights trained over are
# compared by content (checkpoint_weights), not by the --checkpoint path
_RESUME_KEYS = (
    ("seed", "--seed"),
    ("context", "--context"),
    ("global_batch", "global batch (--batch-size x --accum x processes)"),
    ("lora_rank", "--lora-rank"),
    ("lora_alpha", "--lora-alpha"),
    ("lora_targets", "--lora-targets"),
    ("steps", "--steps"),
    ("lr", "--lr"),
    ("lr_depformer", "--lr-depformer"),
    ("warmup_steps", "--warmup-steps"),
    ("min_lr_ratio", "--min-lr-ratio"),
    ("weight_decay", "--weight-decay"),
    ("betas", "betas"),
    ("eps", "eps"),
    ("clip", "--clip"),
    ("weights.text", "--w-text"),
    ("weights.pad", "--w-pad"),
    ("weights.ret", "--w-ret"),
    ("weights.semantic", "--w-semantic"),
    ("weights.acoustic", "--w-acoustic"),
    ("start_delay_s", "--start-delay-s"),
    ("end_gap_s", "--end-gap-s"),
    ("random_sampling_proba", "--random-delay-proba"),
    ("dataset_sha256", "--data-dir (its prepared dialogues, sha256)"),
    ("checkpoint_weights", "--checkpoint (its weights, fingerprint)"),
)
_MISSING = object()


def dataset_fingerprint(data_dir: str | Path) -> str | None:
    """What a prepared dataset trains on, as 16 hex digits of a sha256: its dialogues' manifest records sorted by
    name, without where their files lie (shard, source paths: a moved or re-encoded dataset is the same one). None
    when the manifest cannot be read or lists nothing (:class:`PreparedDataset` names that problem)."""
    import hashlib

    from .dataset import MANIFEST_FILE, read_manifest

    try:
        records = read_manifest(Path(data_dir) / MANIFEST_FILE)
    except Exception:
        return None
    if not records:
        return None
    rows = []
    for rec in sorted(records, key=lambda r: r.name):
        row = rec.to_json()
        for where in ("shard", "json", "audio"):
            row.pop(where, None)
        rows.append(row)
    text = json.dumps(rows, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def checkpoint_weights(lm: Path, fine_tune: Path | None = None) -> str:
    """What a run trains over, as its config record's ``checkpoint_weights``: ``lm HEX`` (16 hex digits of the base
    LM weights' :func:`cspan.core.checkpoint.weights_fingerprint`), followed by ``, fine-tune HEX`` when the
    checkpoint is a fine-tune over that base. By content, not by path: the same weights moved to another folder, or
    reached as a Hub id whose cached files are the same, give the same value."""
    from cspan.core.checkpoint import weights_fingerprint

    out = "lm " + weights_fingerprint(lm, "LM")[:16]
    if fine_tune is not None:
        out += ", fine-tune " + weights_fingerprint(fine_tune, "fine-tune")[:16]
    return out


def _record_value(record: dict[str, Any], key: str) -> Any:
    """``record[key]``, where a dotted key reads a nested dict (``weights.ret``); :data:`_MISSING` when absent."""
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


@dataclass
class TrainConfig:
    """Options of one ``cspan train`` run (the CLI flags; ``docs/TRAINING.md``).

    Attributes:
        data_dir: a folder written by ``cspan prepare``.
        out_dir: checkpoints, metrics and the export go here (an existing run there is resumed); locked for the
            run's lifetime (:func:`lock_out_dir`): a second run on it is refused.
        checkpoint, base: what to fine-tune (see :func:`cspan.core.checkpoint.load_checkpoint`).
        lora_rank: 0 = full fine-tuning; r >= 1 = LoRA adapters of rank r (the rest frozen).
        lora_alpha: LoRA scale numerator (default: the rank, i.e. scale 1).
        lora_targets: ``all`` or comma-separated module-name patterns.
        steps: optimizer steps.
        lr: peak learning rate of the temporal transformer and embeddings (default 2e-6 full, 1e-4 LoRA).
        lr_depformer: peak learning rate of the depformer and its heads (default 2 x lr, as the released recipe's
            2e-6 / 4e-6).
        batch_size: sequences per micro-batch per process.
        accum: micro-batches per optimizer step.
        context: longest training window in positions (prefix + frames + span columns).
        ckpt_every: steps between checkpoints (and one at the end).
        seed: seeds the samples, the LoRA initialisation and the RNGs.
        fsdp: shard with FSDP2 (``fully_shard``) instead of DDP when several processes run.
        warmup_steps: linear warm-up (default 5 % of ``steps``, at least 1).
        min_lr_ratio: the cosine ends at ``min_lr_ratio x lr``.
        weight_decay, betas, eps, clip: AdamW and gradient clipping.
        weights: loss weights.
        device: default ``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``.
        dtype: parameter dtype (float32 master weights by default; bfloat16 halves the memory).
        autocast: ``auto`` (bf16 on CUDA, none on CPU), ``bf16`` or ``none``.
        activation_checkpointing: recompute each transformer layer in the backward pass.
        stop_at: stop (after checkpointing) once this step is done; rerun the same command to resume.
        log_every: steps between log lines on stderr (metrics.jsonl gets every step).
        keep_checkpoints: how many of the latest checkpoints to keep (0 = all).
        export_dtype: dtype of the exported weights (default: the parameter dtype).
        export_format: ``cspan`` (``context_spanning.pt``, the released fine-tune layout) or ``moshi``
            (``lora.safetensors`` + ``config.json`` as kyutai-labs/moshi-finetune writes them; LoRA only).
        start_delay_s, end_gap_s, random_sampling_proba: the MoshiRAG delay sampler.
    """

    data_dir: Path
    out_dir: Path
    checkpoint: str | None = None
    base: str | None = None
    lora_rank: int = 0
    lora_alpha: float | None = None
    lora_targets: str = ALL_LINEAR
    steps: int = 1000
    lr: float | None = None
    lr_depformer: float | None = None
    batch_size: int = 1
    accum: int = 8
    context: int = 3000
    ckpt_every: int = 500
    seed: int = 0
    fsdp: bool = False
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    clip: float = 1.0
    weights: LossWeights = field(default_factory=LossWeights)
    device: str | None = None
    dtype: str = "float32"
    autocast: str = "auto"
    activation_checkpointing: bool = True
    stop_at: int | None = None
    log_every: int = 10
    keep_checkpoints: int = 2
    export_dtype: str | None = None
    export_format: str = "cspan"
    start_delay_s: float = 1.0
    end_gap_s: float = 1.0
    random_sampling_proba: float = 0.2

    def resolved(self) -> TrainConfig:
        """A copy with the defaults that depend on other options filled in.

        Raises:
            SettingsError: an option out of range, or an ``--out-dir`` that is or lies inside the ``--data-dir`` or a
                folder of the checkpoint (:func:`cspan.core.reads.check_outputs`) (exit status 2), naming the flag.
        """
        import copy

        cfg = copy.copy(self)
        cfg.data_dir, cfg.out_dir = Path(cfg.data_dir), Path(cfg.out_dir)
        checks = [
            (cfg.steps >= 1, f"--steps must be >= 1, got {cfg.steps}"),
            (cfg.batch_size >= 1, f"--batch-size must be >= 1, got {cfg.batch_size}"),
            (cfg.accum >= 1, f"--accum must be >= 1, got {cfg.accum}"),
            (cfg.context >= 2, f"--context must be >= 2 positions, got {cfg.context}"),
            (cfg.ckpt_every >= 1, f"--ckpt-every must be >= 1, got {cfg.ckpt_every}"),
            (cfg.lora_rank >= 0, f"--lora-rank must be >= 0, got {cfg.lora_rank}"),
            (cfg.seed >= 0, f"--seed must be >= 0, got {cfg.seed}"),
            (cfg.clip > 0, f"--clip must be > 0, got {cfg.clip}"),
            (0.0 <= cfg.min_lr_ratio <= 1.0, f"--min-lr-ratio must be in [0, 1], got {cfg.min_lr_ratio}"),
            (cfg.autocast in ("auto", "bf16", "none"), f"--autocast must be auto, bf16 or none, got {cfg.autocast}"),
            (cfg.export_format in EXPORT_FORMATS, f"--export-format must be cspan or moshi, got {cfg.export_format}"),
            (
                cfg.export_format != "moshi" or cfg.lora_rank >= 1,
                "--export-format moshi writes LoRA adapters (moshi-finetune's lora.safetensors); give --lora-rank R",
            ),
        ]
        w = cfg.weights
        finite = math.isfinite
        numbers = [
            ("--lr", cfg.lr, 0.0, False),
            ("--lr-depformer", cfg.lr_depformer, 0.0, False),
            ("--lora-alpha", cfg.lora_alpha, 0.0, False),
            ("--weight-decay", cfg.weight_decay, 0.0, True),
            ("--clip", cfg.clip, 0.0, False),
            ("--min-lr-ratio", cfg.min_lr_ratio, 0.0, True),
            ("--w-text", w.text, 0.0, True),
            ("--w-pad", w.pad, 0.0, True),
            ("--w-ret", w.ret, 0.0, True),
            ("--w-semantic", w.semantic, 0.0, True),
            ("--w-acoustic", w.acoustic, 0.0, True),
            ("--start-delay-s", cfg.start_delay_s, 0.0, True),
            ("--end-gap-s", cfg.end_gap_s, 0.0, True),
            ("--random-delay-proba", cfg.random_sampling_proba, 0.0, True),
        ]
        for flag, value, low, inclusive in numbers:  # NaN and inf first: they pass every comparison below
            if value is None:
                continue
            if not finite(value):
                raise SettingsError(f"{flag} must be a finite number, got {value}")
            if value < low or (value == low and not inclusive):
                raise SettingsError(f"{flag} must be {'>=' if inclusive else '>'} {low:g}, got {value}")
        checks += [
            (
                cfg.random_sampling_proba <= 1.0,
                f"--random-delay-proba must be in [0, 1], got {cfg.random_sampling_proba}",
            ),
            (w.text + w.pad + w.ret > 0 or w.semantic + w.acoustic > 0, "the loss weights (--w-*) are all 0"),
            (cfg.context <= MAX_CONTEXT, f"--context must be <= {MAX_CONTEXT} positions, got {cfg.context}"),
            (cfg.warmup_steps is None or cfg.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {cfg.warmup_steps}"),
            (cfg.keep_checkpoints >= 0, f"--keep-checkpoints must be >= 0 (0 = all), got {cfg.keep_checkpoints}"),
            (cfg.log_every >= 1, f"--log-every must be >= 1, got {cfg.log_every}"),
            (
                not cfg.out_dir.exists() or cfg.out_dir.is_dir(),
                f"--out-dir {str(cfg.out_dir)!r} is a file; give a folder (a new one, or a run to resume)",
            ),
            (
                not cfg.fsdp or "WORLD_SIZE" in os.environ,
                "--fsdp shards the model over the processes that torchrun starts, and this process was not started "
                "by torchrun; run `torchrun --nproc-per-node N -m cspan.core.cli train ... --fsdp`, or leave --fsdp "
                "out for one process",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise SettingsError(message)
        # the checkpoints and the export never go into the dataset or the checkpoint trained from
        reads = Reads().folder("--data-dir", cfg.data_dir).extend(checkpoint_reads(cfg.checkpoint, base=cfg.base))
        check_outputs({}, reads, folders={"--out-dir": cfg.out_dir})
        if cfg.lr is None:
            cfg.lr = 1e-4 if cfg.lora_rank else 2e-6
        if cfg.lr_depformer is None:
            cfg.lr_depformer = 2.0 * cfg.lr
        if cfg.lora_rank and cfg.lora_alpha is None:
            cfg.lora_alpha = float(cfg.lora_rank)
        if cfg.warmup_steps is None:
            cfg.warmup_steps = max(1, round(0.05 * cfg.steps))
        if cfg.stop_at is not None and not 1 <= cfg.stop_at <= cfg.steps:
            raise SettingsError(f"--stop-at must be in [1, --steps], got {cfg.stop_at}")
        return cfg


MAX_CONTEXT = 1_000_000
"""Longest ``--context`` accepted (positions): far beyond any model's window (3000), short of a number that only
a typo gives."""


def _shown(value: Any) -> str:
    """A recorded or given setting in a message: ``none`` for None, lists as ``a,b``, numbers as Python writes them."""
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(_shown(v) for v in value)
    return str(value)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Learning-rate multiplier (of ``--lr`` and ``--lr-depformer``) of optimizer step ``step`` (0-based, so the
    ``step + 1``-th step of ``metrics.jsonl``) of a run of ``total`` steps.

    Linear warm-up: the n-th step (n = ``step + 1`` <= ``warmup``) uses ``n / warmup``, so the first uses
    ``1 / warmup`` and the last warm-up step exactly 1. Then a half cosine from 1 (at the warm-up's end) down to
    ``min_ratio``, reached exactly by the last step (n = ``total``). A run that ends within its warm-up
    (``warmup >= total``) never decays. The scheduler also asks for n = ``total + 1``
    after the last step (no step uses it): ``min_ratio`` past the warm-up.

    Raises:
        ValueError: ``step``, ``warmup`` negative or ``total`` below 1.
    """
    if step < 0 or warmup < 0 or total < 1:
        raise ValueError(f"lr_factor: step {step} and warmup {warmup} must be >= 0 and total {total} >= 1")
    n = step + 1
    if n <= warmup:
        return n / warmup
    if n >= total:  # exactly min_ratio, which the cosine's rounding need not give
        return min_ratio
    progress = (n - warmup) / (total - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lock_out_dir(out_dir: str | os.PathLike[str]) -> Any:
    """Take the exclusive lock of the training folder ``out_dir`` (created when missing): ``flock`` on
    ``out_dir/train.lock`` (:data:`LOCK_FILE`), without waiting. The lock lasts while the returned open file does:
    close it to release the lock; the kernel releases it when the process ends, a crash or a kill included. The file
    then holds ``PID HOST`` of the holder.

    Raises:
        TrainSettingsError: another process holds the lock (another ``cspan train`` run on the same ``--out-dir``);
            names the folder and, when it could be read, the holder's process id and host (exit status 2).
        OSError: the folder or the lock file cannot be created or opened (read-only file system, permissions).
    """
    import fcntl
    import socket

    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    while True:
        handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held open by the caller: that is the lock)
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().split()
            handle.close()
            who = f" (process {holder[0]} on {holder[1]})" if len(holder) >= 2 else ""
            raise TrainSettingsError(
                f"--out-dir {str(folder)!r} is in use by another `cspan train` run{who}, which holds "
                f"{str(path)!r}: two runs would interleave their checkpoints; wait for it to end, or give another "
                "--out-dir"
            ) from None
        except BaseException:
            handle.close()
            raise
        # the file locked must still be the one at the path: a run removing its own new folder (it failed before
        # its first checkpoint) may have unlinked it between our open and our flock
        try:
            same = os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        handle.close()
        folder.mkdir(parents=True, exist_ok=True)
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()} {socket.gethostname()}\n")
    handle.flush()
    return handle


# ---------------------------------------------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class DistInfo:
    """This process's place in the job (``torchrun`` environment variables)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a float64 tensor over ranks (returns it unchanged in a single process)."""
        if self.enabled:
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values


def init_distributed(device: torch.device | None) -> DistInfo:
    """Join the ``torchrun`` process group when ``WORLD_SIZE > 1`` (NCCL on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    info = DistInfo(
        rank=int(os.environ.get("RANK", "0")), world=world, local_rank=int(os.environ.get("LOCAL_RANK", "0"))
    )
    if info.enabled and not dist.is_initialized():
        cuda = (device is None and torch.cuda.is_available()) or (device is not None and device.type == "cuda")
        dist.init_process_group("nccl" if cuda else "gloo")
    return info


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------


class TrainModule(nn.Module):
    """Wraps the LM so that DDP / FSDP2 hooks run around the training forward.

    ``forward(inputs [B, K, L], targets [B, K, L])`` -> (text_logits [B, L, text_card], audio_logits
    [B, dep_q, L, card]) via :meth:`cspan.core.lm.LMModel.forward_delayed`.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        delayed = torch.cat([inputs, targets[:, :, -1:]], dim=2)  # the last column is never read as an input
        return self.lm.forward_delayed(delayed, targets)


def enable_activation_checkpointing(lm: nn.Module) -> int:
    """Recompute every temporal and depformer layer in the backward pass (``torch.utils.checkpoint``,
    non-reentrant); the module tree and state-dict keys are unchanged. Returns the number of layers wrapped."""
    from torch.utils.checkpoint import checkpoint

    count = 0
    for stack in (lm.transformer, lm.depformer):
        for layer in stack.layers:
            inner = layer.forward

            def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
                if torch.is_grad_enabled():
                    return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
                return _inner(*args, **kwargs)

            layer.forward = forward
            count += 1
    return count


def apply_fsdp(lm: nn.Module, module: nn.Module, device_type: str, world: int) -> None:
    """Shard with FSDP2 (``torch.distributed.fsdp.fully_shard``): one unit per temporal and depformer layer, then
    the rest (embeddings, heads) at the root ``module``. Parameters are sharded in place (DTensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (world,))
    for stack in (lm.transformer, lm.depformer):
        for layer in stack.layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)


def _dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise TrainError(f"dtype {name!r} is not supported for training; use float32 or bfloat16")
    return table[name]


def _is_depformer(name: str) -> bool:
    return name.startswith(("depformer", "linears"))


def _strip(name: str) -> str:
    for prefix in ("module.", "_orig_mod.", "lm."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


@contextmanager
def _grad_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip DDP / FSDP2 gradient synchronisation on all but the last micro-batch."""
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(enabled)
        yield
    elif not enabled and hasattr(module, "no_sync"):  # DDP
        with module.no_sync():
            yield
    else:
        yield


def build_optimizer(
    module: nn.Module,
    *,
    lr: float,
    lr_depformer: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of ``module`` in two groups: the temporal transformer and embeddings at
    ``lr``, the depformer and its heads at ``lr_depformer``. The fused CUDA kernel on GPUs (no full-size temporaries:
    one step of the 7B on one GPU fits), the ``foreach`` one elsewhere."""
    temporal, depth = [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (depth if _is_depformer(_strip(name)) else temporal).append(p)
    groups = [g for g in ({"params": temporal, "lr": lr}, {"params": depth, "lr": lr_depformer}) if g["params"]]
    fused = all(p.device.type == "cuda" for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused or None)


@contextmanager
def _stop_signals_seen() -> Iterator[list[int]]:
    """Record the stop signals (SIGINT, and ``cspan``'s SIGTERM, SIGHUP, SIGQUIT) that land while the block runs;
    each still raises as before (``KeyboardInterrupt``, :class:`~cspan.core.errors.Terminated`). A library that
    catches that exception and raises its own instead (DCP's ``CheckpointException`` wrapping the
    ``KeyboardInterrupt``, torch.save's ``unexpected pos``) cannot hide that the run was stopped: the caller reads
    the list. Only signals whose handler is a Python function are watched (the main thread's)."""
    from cspan.core.cli import stop_handlers_replaced

    seen: list[int] = []

    def recording(handler: Any) -> Any:
        def handle(num: int, frame: Any) -> None:
            seen.append(num)
            handler(num, frame)

        return handle

    with stop_handlers_replaced(recording):
        yield seen


def _raise_stop(signum: int) -> None:
    """Raise what stopping on ``signum`` raises: ``KeyboardInterrupt`` (SIGINT) or ``Terminated``."""
    import signal

    from cspan.core.errors import Terminated

    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes a single process whenever no process group exists: that is the intent here."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        yield


def _sharded_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # sharded (DTensor) entries under FSDP2, plain tensors otherwise; frozen weights (LoRA's base) are not training
    # state: they come from the checkpoint being fine-tuned
    return StateDictOptions(full_state_dict=False, ignore_frozen_params=True, strict=False)


def save_train_state(folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write the trainable weights and the optimizer state of ``module`` to ``folder`` as a
    ``torch.distributed.checkpoint`` (``.metadata`` + ``__RANK_I.distcp`` files, ``__0_0.distcp`` for one process): every rank writes its own FSDP2 shards
    (replicated tensors once), no rank gathers the whole model. Keys are the parameters' fully qualified names
    (``model.lm.<name>``, ``optimizer.state.lm.<name>.exp_avg``, ...) whatever the wrapping (none, DDP or FSDP2), so
    :func:`load_train_state` reads it on any number of processes and either wrapping. A collective: every rank calls
    it, with ``folder`` on a file system that all ranks share."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer, options=_sharded_options())
    with _single_process_quiet():
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=folder, no_dist=not dist.is_initialized())


def load_train_state(folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore what :func:`save_train_state` wrote into ``module`` and ``optimizer``, resharding to this job's
    layout (each rank reads the slices of its own shards). A collective, as the save.

    Raises:
        TrainError: ``folder`` is not such a checkpoint, or lacks a trainable weight of ``module``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (folder / ".metadata").is_file():
        raise TrainError(
            f"{str(folder)!r} is not a torch.distributed.checkpoint folder (no .metadata); a checkpoint of an older "
            "cspan train (model.pt, optimizer.pt) cannot be resumed: start a new --out-dir"
        )
    model_sd, optim_sd = get_state_dict(module, optimizer, options=_sharded_options())
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=folder, no_dist=not dist.is_initialized())
    except Exception as exc:  # DCP raises CheckpointException (a RuntimeError) listing each rank's failure
        raise TrainError(f"cannot read the training state in {str(folder)!r}: {exc}") from exc
    set_state_dict(
        module,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_sharded_options(),
    )


def read_train_state(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a :func:`save_train_state` folder, whole, in one process without a process group (inspection
    and tests): ``{"model.lm.<name>": weight, "optimizer.state.lm.<name>.exp_avg": ..., ...}`` on the CPU.

    Raises:
        TrainError: ``folder`` is not such a checkpoint.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        raise TrainError(f"{str(folder)!r} is not a torch.distributed.checkpoint folder (no .metadata)")
    metadata = dcp.FileSystemReader(folder).read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=folder, no_dist=True)
    return state


# ---------------------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    """What a run did: steps done (in total), the last step's loss, the export folder (None when stopped early)."""

    step: int
    loss: float | None
    export_dir: Path | None
    metrics: Path


class Trainer:
    """One training run (see the module docstring). ``Trainer(cfg).run()``.

    Raises:
        TrainError, DataError, CheckpointError: bad options, data or checkpoint.
    """

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg.resolved()
        self.dist = DistInfo()
        self.device = torch.device("cpu")
        self.tb: Any = None
        self._weights: str | None = None  # checkpoint_weights(), once found

    # -- setup ---------------------------------------------------------------------------------------------------

    def _load_model(self) -> None:
        from cspan.core.checkpoint import load_checkpoint

        cfg = self.cfg
        dtype = _dtype(cfg.dtype)
        load_device = "cpu" if (cfg.fsdp and self.dist.enabled) else self.device
        self.ckpt = load_checkpoint(cfg.checkpoint, device=load_device, dtype=dtype, base=cfg.base)
        lm = self.ckpt.lm
        lm.train()
        if cfg.lora_rank:
            gen = torch.Generator().manual_seed(cfg.seed)
            if self.ckpt.lora is not None:
                # a LoRA fine-tune: keep training its own adapters (same rank and scale), nothing new is wrapped
                spec = lora_spec(lm)
                assert spec is not None
                if spec["r"] != cfg.lora_rank or spec["alpha"] != cfg.lora_alpha:
                    raise TrainError(
                        f"the checkpoint already has LoRA adapters (r {spec['r']}, alpha {spec['alpha']}); continue "
                        f"them with --lora-rank {spec['r']} --lora-alpha {spec['alpha']}, or fine-tune everything "
                        "(--lora-rank 0)"
                    )
            else:
                names = resolve_targets(lm, cfg.lora_targets)
                assert cfg.lora_alpha is not None
                add_lora(lm, names, cfg.lora_rank, cfg.lora_alpha, gen)
            self.trainable = freeze_all_but_lora(lm)
        else:
            for p in lm.parameters():
                p.requires_grad_(True)
            self.trainable = sum(p.numel() for p in lm.parameters())
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(lm)
        self.lm = lm
        module: nn.Module = TrainModule(lm)
        if self.dist.enabled and cfg.fsdp:
            apply_fsdp(lm, module, self.device.type, self.dist.world)
        elif self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            module = DistributedDataParallel(module, device_ids=ids)
        self.module = module

    def _build_optimizer(self) -> None:
        cfg = self.cfg
        assert cfg.lr is not None and cfg.lr_depformer is not None and cfg.warmup_steps is not None
        self.optimizer = build_optimizer(
            self.module,
            lr=cfg.lr,
            lr_depformer=cfg.lr_depformer,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )
        warmup, total, ratio = cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, warmup, total, ratio))

    def _check_spans_fit(self) -> None:
        """Refuse a ``--context`` that the longest Context Span block of the dataset fills: a crop starting at that
        block would hold nothing else, a sample without a single target (a step of such samples trains on nothing).

        Raises:
            TrainSettingsError: naming ``--context``, the block, its dialogue and ``--max-span-frames``.
        """
        longest = max(((len(s.ids), r.name) for r in self.dataset.records for s in r.spans), default=None)
        if longest is not None and longest[0] >= self.cfg.context:
            n, name = longest
            raise TrainSettingsError(
                f"--context {self.cfg.context} does not hold the longest Context Span block of --data-dir "
                f"{str(self.cfg.data_dir)!r} ({n} positions, dialogue {name!r}): a window would see the block and "
                f"nothing to learn from; give --context above {n}, or prepare the data again with a lower "
                f"--max-span-frames (cspan prepare cuts longer references)"
            )

    def _check_data(self) -> None:
        """Refuse a dataset whose codes or text ids this checkpoint does not read (another codec, tokenizer or
        vocabulary): a :class:`TrainSettingsError` naming ``--checkpoint`` and ``--data-dir`` (exit status 2)."""
        from .data import codec_fingerprint, file_sha256

        info = self.dataset.info
        lm = self.lm
        where = (
            f"--checkpoint {self.ckpt.source!r} does not fit --data-dir {str(self.cfg.data_dir)!r}, prepared from "
            f"{info.get('checkpoint')!r}"
        )
        fix = "prepare the data with this checkpoint (cspan prepare --checkpoint ...) or train the one it was prepared from"
        if int(info.get("card", lm.card)) != lm.card or 2 * int(info.get("num_codebooks", 8)) + 1 != lm.num_codebooks:
            raise TrainSettingsError(
                f"{where}: its codes are {info.get('num_codebooks')} codebooks of {info.get('card')} codes, the model "
                f"reads {lm.n_q} streams of {lm.card}; {fix}"
            )
        files = self.ckpt.files
        recorded = info.get("codec_sha256")
        if recorded is not None and "mimi" in files:
            mine = codec_fingerprint(Path(files["mimi"]), self.ckpt.mimi_config)
            if recorded != mine:
                raise TrainSettingsError(
                    f"{where}: it was encoded with another codec (Mimi fingerprint {recorded[:12]}, this checkpoint's "
                    f"{mine[:12]}), so its codes mean other sounds to this model; {fix}"
                )
        recorded = info.get("tokenizer_sha256")
        if recorded is not None and "tokenizer" in files:
            mine = file_sha256(Path(files["tokenizer"]))
            if recorded != mine:
                raise TrainSettingsError(
                    f"{where}: it was tokenised with another tokenizer (sha256 {recorded[:12]}, this checkpoint's "
                    f"{mine[:12]}); {fix}"
                )
        if int(info.get("text_vocab", 0)) > lm.text_card:
            raise TrainSettingsError(
                f"{where}: it was tokenised with a {info.get('text_vocab')}-piece vocabulary, larger than the model's "
                f"text_card {lm.text_card}; {fix}"
            )
        ctx = lm.cfg.context
        if ctx is not None and self.cfg.context > ctx:
            log.warning("--context %d is longer than the model's attention window %d", self.cfg.context, ctx)

    # -- checkpoints ------------------------------------------------------------------------------------------------

    def _ckpt_root(self) -> Path:
        return self.cfg.out_dir / CHECKPOINTS_DIR

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint folder of ``out_dir`` (None when there is none)."""
        root = self._ckpt_root()
        if not root.is_dir():
            return None
        done = sorted(p for p in root.glob("step_*") if (p / COMPLETE_FILE).is_file())
        return done[-1] if done else None

    def check_weights_finite(self, step: int) -> None:
        """Refuse to save or export weights holding NaN or inf (every rank checks its shards; all stop together).

        Raises:
            TrainError: naming the step; nothing is written.
        """
        bad = 0.0
        for p in self.module.parameters():
            if p.requires_grad:
                local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
                if not bool(torch.isfinite(local).all()):
                    bad = 1.0
                    break
        if float(self.dist.all_sum(torch.tensor([bad], dtype=torch.float64, device=self.device))[0]) > 0:
            raise TrainError(
                f"step {step}: the weights hold NaN or inf values (the training diverged); nothing was saved or "
                f"exported; the checkpoints in {self.cfg.out_dir / CHECKPOINTS_DIR} are kept. Lower --lr or raise "
                "--warmup-steps"
            )

    def save_checkpoint(self, step: int) -> Path:
        """Write ``checkpoints/step_{step:08d}/`` atomically (a temporary folder, renamed once every rank is done) and
        prune old ones: the trainable weights and optimizer state (:func:`save_train_state`, every rank writes its
        shards), ``trainer.pt`` (step, scheduler) and ``COMPLETE`` (step, world size, global batch, options)."""
        self.check_weights_finite(step)
        root = self._ckpt_root()
        final = root / f"step_{step:08d}"
        tmp = root / f".step_{step:08d}.tmp"
        with _stop_signals_seen() as stopped:
            try:
                self._write_checkpoint(step, tmp, final)
            except BaseException:
                # an interrupted or failed save leaves no temporary folder (a resume would remove it anyway); a
                # signal that a library turned into its own error (DCP's CheckpointException, torch.save's
                # 'unexpected pos') is raised as what it is, so the run ends as any interrupted one (exit 130)
                if self.dist.is_main:
                    shutil.rmtree(tmp, ignore_errors=True)
                if stopped:
                    _raise_stop(stopped[0])
                raise
        if stopped:  # the signal was swallowed inside the save, which completed: stop now, the checkpoint is whole
            _raise_stop(stopped[0])
        if self.dist.is_main:
            keep = self.cfg.keep_checkpoints
            if keep > 0:
                done = sorted(p for p in root.glob("step_*") if (p / COMPLETE_FILE).is_file())
                for old in done[:-keep]:
                    shutil.rmtree(old, ignore_errors=True)
        self.dist.barrier()
        return final

    def _write_checkpoint(self, step: int, tmp: Path, final: Path) -> None:
        """Write the checkpoint of ``step`` into ``tmp`` and rename it to ``final`` once every rank is done."""
        if self.dist.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.dist.barrier()
        save_train_state(tmp, self.module, self.optimizer)
        if self.dist.is_main:
            torch.save({"step": step, "scheduler": self.scheduler.state_dict()}, tmp / "trainer.pt")
        self.dist.barrier()
        if self.dist.is_main:
            record = self._config_record()
            meta = {"step": step, "world": self.dist.world, "global_batch": record["global_batch"], "config": record}
            (tmp / COMPLETE_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)

    def load_checkpoint(self, folder: Path) -> int:
        """Restore the trainable weights, optimizer and scheduler from ``folder``, written by any number of processes
        with or without FSDP2; returns its step. Its options were checked against this run's before the model loaded
        (:meth:`check_resume`, in :meth:`run`)."""
        load_train_state(folder, self.module, self.optimizer)
        trainer = torch.load(folder / "trainer.pt", map_location="cpu", weights_only=True)
        self.scheduler.load_state_dict(trainer["scheduler"])
        return int(trainer["step"])

    def check_resume(self, folder: Path) -> None:
        """Refuse to resume the checkpoint ``folder`` with options that change the samples or the optimisation
        (:data:`_RESUME_KEYS`, the global batch included: a run on another number of processes must keep
        ``batch_size x accum x world``, and the checkpoint's weights by :func:`checkpoint_weights`, their content
        fingerprint); cheap, so called before the model loads as well. A key the record lacks (a checkpoint written
        before it was recorded) is not compared.

        Raises:
            TrainSettingsError: naming each such flag with its recorded and its new value (exit status 2).
        """
        try:
            meta = json.loads((folder / COMPLETE_FILE).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise TrainError(f"{str(folder / COMPLETE_FILE)!r}: unreadable ({exc}); remove {str(folder)!r}") from None
        saved = meta.get("config", {}) if isinstance(meta, dict) else {}
        now = self._config_record()
        changed = []
        for key, flag in _RESUME_KEYS:
            old, new = _record_value(saved, key), _record_value(now, key)
            # old: a record written before the key existed; new: a dataset that cannot be read, weights not found
            if old is not _MISSING and new is not _MISSING and old != new:
                changed.append((key, flag, old, new))
        if not changed:
            return
        out = str(self.cfg.out_dir)
        details = ", ".join(f"{flag} {_shown(old)} (now {_shown(new)})" for _, flag, old, new in changed)
        hint = f"resume with the recorded values, or start over in a new --out-dir (or delete {out!r})"
        keys = [key for key, *_ in changed]
        if "global_batch" in keys:
            hint = self._global_batch_hint(int(saved["global_batch"]), int(saved.get("world", 1))) + "; " + hint
        if "checkpoint_weights" in keys:  # other weights: a path may hold them now, or the same ones lie elsewhere
            base = f" --base {saved['base']!r}" if saved.get("base") else ""
            hint = (
                f"it was trained over the weights --checkpoint {saved.get('checkpoint')!r}{base} held then (the same "
                "weights in another folder resume); " + hint
            )
        raise TrainSettingsError(
            f"--out-dir {out!r} holds a run trained with other settings (checkpoint {folder.name}): {details}; {hint}"
        )

    def _global_batch_hint(self, saved: int, saved_world: int) -> str:
        cfg, world = self.cfg, self.dist.world
        where = f"it was written by {saved_world} process(es) with a global batch of {saved} (batch x accum x world)"
        if saved % (cfg.batch_size * world) == 0:
            accum = saved // (cfg.batch_size * world)
            return f"{where}: with {world} process(es) and --batch-size {cfg.batch_size} use --accum {accum}"
        return f"{where}: choose --batch-size and --accum with batch x accum x {world} = {saved}"

    def _config_record(self) -> dict[str, Any]:
        cfg = self.cfg
        record = asdict(cfg)
        record["data_dir"], record["out_dir"] = str(cfg.data_dir), str(cfg.out_dir)
        record["betas"] = list(cfg.betas)
        record["global_batch"] = cfg.batch_size * cfg.accum * self.dist.world
        record["world"] = self.dist.world
        if not hasattr(self, "_dataset_sha256"):  # once: the dataset a run trains on does not change under it
            self._dataset_sha256 = dataset_fingerprint(cfg.data_dir)
        if self._dataset_sha256 is not None:
            record["dataset_sha256"] = self._dataset_sha256
        weights = self._checkpoint_weights()
        if weights is not None:
            record["checkpoint_weights"] = weights
        return record

    def _checkpoint_weights(self) -> str | None:
        """:func:`checkpoint_weights` of this run's checkpoint, once: before the model loads from the files it
        resolves to (a Hub id from the Hugging Face cache only, nothing downloaded), after from the loaded ones.
        None while they cannot be found so (the load reports why; :meth:`_run` then checks the resume again)."""
        if self._weights is None:
            from cspan.core.checkpoint import resolve_checkpoint
            from cspan.core.errors import CheckpointError

            try:
                if hasattr(self, "ckpt"):
                    self._weights = checkpoint_weights(Path(self.ckpt.files["lm"]), self.ckpt.fine_tune)
                else:
                    files = resolve_checkpoint(self.cfg.checkpoint, base=self.cfg.base, cache_only=True)
                    self._weights = checkpoint_weights(files.lm, files.fine_tune)
            except (CheckpointError, OSError):
                return None
        return self._weights

    # -- export -----------------------------------------------------------------------------------------------------

    def export(self, step: int) -> Path:
        """Write ``OUT/export/`` in the released fine-tune layout (rank 0 writes; every rank must call).

        ``context_spanning.pt`` = ``{"model": state_dict}`` loaded over the base by
        :func:`cspan.core.checkpoint.load_checkpoint`: the full state dict for full fine-tuning; for LoRA the
        unmerged adapters (``<name>.lora_A`` / ``<name>.lora_B``, with ``{"lora": {"r", "alpha"}}``) and -- when the
        training checkpoint was itself a fine-tune over its base -- every other weight too (``<name>.base.weight``
        included), so the file loads over that base. The checkpoint's voices are copied to ``voices/``.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self.check_weights_finite(step)
        options = StateDictOptions(full_state_dict=True, cpu_offload=self.dist.enabled)
        full = get_model_state_dict(self.module, options=options)
        out = self.cfg.out_dir / EXPORT_DIR
        if self.dist.is_main:
            spec = lora_spec(self.lm)
            adapters_only = spec is not None and self.ckpt.fine_tune is None
            dtype = _dtype(self.cfg.export_dtype) if self.cfg.export_dtype else _dtype(self.cfg.dtype)
            state: dict[str, torch.Tensor] = {}
            for key, value in full.items():
                name = _strip(key)
                if adapters_only and not name.endswith((".lora_A", ".lora_B")):
                    continue
                value = value.detach().cpu()
                state[name] = value.to(dtype) if value.is_floating_point() else value
            out.mkdir(parents=True, exist_ok=True)
            # An export of the other format (an earlier invocation's --export-format) goes: load_checkpoint takes
            # lora.safetensors over context_spanning.pt, so a stale one would be loaded instead of this export.
            stale = (EXPORT_FILE,) if self.cfg.export_format == "moshi" else (MOSHI_LORA_FILE, MODEL_CONFIG_FILE)
            for name in stale:
                (out / name).unlink(missing_ok=True)
            if self.cfg.export_format == "moshi":
                self._write_moshi(out, state, spec)
            else:
                payload: dict[str, Any] = {"model": state}
                if spec is not None:
                    payload["lora"] = spec
                with atomic_file(out / EXPORT_FILE) as tmp:
                    torch.save(payload, tmp)
            if self.ckpt.voices:
                (out / "voices").mkdir(exist_ok=True)
                for name, path in sorted(self.ckpt.voices.items()):
                    shutil.copyfile(path, out / "voices" / f"{name}{path.suffix}")
            files = {k: str(Path(v).absolute()) for k, v in self.ckpt.files.items()}
            # The base this export loads over (read by load_checkpoint when neither --base nor CSPAN_BASE is given):
            # the folder of the base model's weights, which the training checkpoint was itself loaded from, as an
            # absolute path, so that the export loads from any working directory.
            if "lm" in self.ckpt.files:
                base = str(Path(self.ckpt.files["lm"]).parent.resolve())
            else:
                base = str(self.ckpt.source)
            info = {
                "step": step,
                "base": base,
                "trained_from": str(self.ckpt.source),
                "base_files": files,
                "lora": spec,
                "adapters_only": adapters_only,
                "format": self.cfg.export_format,
                "prefix_layout": self.dataset.info.get("prefix_layout", CONTEXT_SPANNING.name),
                "dtype": str(dtype).removeprefix("torch."),
                "load": "cspan infer --checkpoint " + str(out.resolve()),
            }
            write_text_atomic(out / EXPORT_INFO, json.dumps(info, indent=2) + "\n")
        self.dist.barrier()
        return out

    def _write_moshi(self, out: Path, state: dict[str, torch.Tensor], spec: dict[str, Any] | None) -> None:
        """``lora.safetensors`` + ``config.json`` as kyutai-labs/moshi-finetune writes them (LoRA adapters)."""
        from safetensors.torch import save_file

        from cspan.core.lora import moshi_lora_state

        assert spec is not None  # resolved() requires --lora-rank for this format
        r, scaling = int(spec["r"]), float(spec["alpha"]) / int(spec["r"])
        tensors = moshi_lora_state(state, self.lm, r=r, scaling=scaling)
        config = self.ckpt.lm_config.to_upstream()
        config.update(lora=True, lora_rank=r, lora_scaling=scaling)
        # Upstream passes every key it does not know to LMModel(**config), so a "prefix_layout" here would stop
        # Moshi's loader (TypeError: unexpected keyword argument); the layout is recorded in export.json beside it.
        config.pop("prefix_layout", None)
        with atomic_file(out / MOSHI_LORA_FILE) as tmp:  # published with ordinary permissions (safetensors: 0600)
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        write_text_atomic(out / MODEL_CONFIG_FILE, json.dumps(config, indent=2) + "\n")

    # -- the loop ---------------------------------------------------------------------------------------------------

    def _autocast(self) -> Any:
        mode = self.cfg.autocast
        if mode == "bf16" or (mode == "auto" and self.device.type == "cuda"):
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _micro_batches(self, step: int) -> list[list[TrainingSequence]]:
        cfg, info = self.cfg, self.dist
        per_step = cfg.batch_size * cfg.accum * info.world
        out = []
        for m in range(cfg.accum):
            first = step * per_step + (m * info.world + info.rank) * cfg.batch_size
            out.append([self.sampler.sample(first + j) for j in range(cfg.batch_size)])
        return out

    def _open_metrics(self, start_step: int) -> Any:
        path = self.cfg.out_dir / METRICS_FILE
        if not self.dist.is_main:
            return None
        kept = []
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    if int(json.loads(line)["step"]) <= start_step:
                        kept.append(line)
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue
        path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.cfg.out_dir / "tensorboard"), purge_step=start_step + 1)
        except ImportError:
            print(
                f"cspan train: tensorboard is not installed (pip install 'cspan-train[tensorboard]'); metrics go to "
                f"{path} only",
                file=sys.stderr,
            )
            self.tb = None
        return path.open("a", encoding="utf-8")

    def run(self) -> TrainResult:
        """Train (resuming from the latest checkpoint in ``out_dir``) and export; returns a :class:`TrainResult`."""
        from cspan.core.devices import parse_device

        cfg = self.cfg
        # --device (a bare cuda is cuda:LOCAL_RANK), else cuda:LOCAL_RANK when CUDA is available, else the CPU
        self.device = parse_device(cfg.device or None, cuda_index=int(os.environ.get("LOCAL_RANK", "0")))
        self.dist = init_distributed(self.device)
        try:
            return self._run()
        finally:
            if self.tb is not None:
                self.tb.close()
            if self.dist.enabled and dist.is_initialized():
                dist.destroy_process_group()

    @contextmanager
    def _out_dir_locked(self) -> Iterator[None]:
        """Hold the lock of ``out_dir`` (:func:`lock_out_dir`) for the block: rank 0 takes it, and every rank learns
        the outcome (a sum over ranks of rank 0's code: tensors, no pickled objects), so that when rank 0 is refused
        every rank raises at once instead of waiting in the next collective for a rank 0 that has left.

        Raises:
            TrainSettingsError: another run holds the lock (exit status 2), on every rank (rank 0's message names
                the holder).
            TrainError: rank 0 could not take it for another reason (rank 0 raises its own ``OSError``).
        """
        info = self.dist
        handle = None
        error: BaseException | None = None
        code = 0.0  # rank 0's outcome: 0 locked, 1 refused (another run), 2 another error
        if info.is_main:
            try:
                handle = lock_out_dir(self.cfg.out_dir)
            except (TrainSettingsError, OSError) as exc:
                error, code = exc, 1.0 if isinstance(exc, TrainSettingsError) else 2.0
        if info.enabled:
            code = float(info.all_sum(torch.tensor([code], dtype=torch.float64, device=self.device))[0])
        if error is not None:
            raise error
        where = f"--out-dir {str(self.cfg.out_dir)!r}"
        if code == 1.0:
            raise TrainSettingsError(f"{where} is in use by another `cspan train` run (rank 0 names it)")
        if code:
            raise TrainError(f"rank 0 could not lock {where} (rank 0 says why)")
        try:
            yield
        finally:
            if handle is not None:
                handle.close()

    def _run(self) -> TrainResult:
        cfg, info = self.cfg, self.dist
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        created = not cfg.out_dir.exists()
        with self._out_dir_locked():  # one run at a time per --out-dir, from before its first read of it
            try:
                return self._run_locked()
            except BaseException:
                # a run that stopped (error, Ctrl-C) before its first checkpoint leaves no folder that looks like a
                # run (the lock file goes with it)
                if created and info.is_main and self.latest_checkpoint() is None:
                    shutil.rmtree(cfg.out_dir, ignore_errors=True)
                raise

    def _run_locked(self) -> TrainResult:
        cfg, info = self.cfg, self.dist
        seed_rngs(cfg.seed, info.rank)
        latest = self.latest_checkpoint()
        if latest is not None:  # options that a resume refuses: before the data and the model load
            self.check_resume(latest)
        unchecked = latest is not None and self._checkpoint_weights() is None
        self.dataset = PreparedDataset(cfg.data_dir)
        self._check_spans_fit()
        self._load_model()
        if unchecked:  # the weights' files could not be found before the load (a Hub id not in the cache)
            self.check_resume(latest)
        self._check_data()
        self.sampler = SequenceSampler(
            self.dataset,
            self.lm.delays,
            self.lm.initial_tokens()[0, :, 0].tolist(),
            SamplerConfig(
                seed=cfg.seed,
                context=cfg.context,
                start_delay_s=cfg.start_delay_s,
                end_gap_s=cfg.end_gap_s,
                random_sampling_proba=cfg.random_sampling_proba,
            ),
        )
        self._build_optimizer()
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        return self._train()

    def _train(self) -> TrainResult:
        """Resume from the latest checkpoint of ``out_dir`` (created), train, checkpoint and export."""
        cfg, info = self.cfg, self.dist
        start = 0
        latest = self.latest_checkpoint()
        if latest is not None:
            start = self.load_checkpoint(latest)
            if info.is_main:
                print(f"cspan train: resuming from {latest} (step {start} of {cfg.steps})", file=sys.stderr)
        if cfg.stop_at is not None and cfg.stop_at <= start < cfg.steps:  # the same command again: not past STEP
            if info.is_main:
                print(
                    f"cspan train: already at step {start} (--stop-at {cfg.stop_at}); nothing to do: raise --stop-at "
                    "or leave it out to go on",
                    file=sys.stderr,
                )
            return TrainResult(step=start, loss=None, export_dir=None, metrics=cfg.out_dir / METRICS_FILE)
        if info.is_main:  # this invocation's options: on a resume they differ from the first's in the runtime ones only
            (cfg.out_dir / CONFIG_FILE).write_text(json.dumps(self._config_record(), indent=2) + "\n", encoding="utf-8")
        if info.is_main:
            mode = f"LoRA r={cfg.lora_rank} alpha={cfg.lora_alpha}" if cfg.lora_rank else "full fine-tuning"
            shard = "FSDP2" if (cfg.fsdp and info.enabled) else ("DDP" if info.enabled else "single process")
            print(
                f"cspan train: {len(self.dataset)} dialogues, {mode} ({self.trainable:,} trainable values), {shard} "
                f"x {info.world} on {self.device}, global batch {cfg.batch_size * cfg.accum * info.world}, "
                f"steps {start} -> {cfg.steps}",
                file=sys.stderr,
            )
        metrics = self._open_metrics(start)
        last_loss: float | None = None
        step = start
        try:
            while step < cfg.steps:
                t0 = time.perf_counter()
                seed_rngs(cfg.seed, info.rank, step)
                record = self._train_step(step)
                step += 1
                record["step"] = step
                record["step_s"] = round(time.perf_counter() - t0, 4)
                last_loss = record["loss"]
                if metrics is not None:
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                    if self.tb is not None:
                        for key in ("loss", "text_loss", "audio_loss", "lr", "grad_norm"):
                            self.tb.add_scalar(f"train/{key}", record[key], step)
                    if step % cfg.log_every == 0 or step == cfg.steps or step == 1:
                        print(
                            f"step {step}/{cfg.steps} loss {record['loss']:.4f} (text {record['text_loss']:.4f}, "
                            f"audio {record['audio_loss']:.4f}) lr {record['lr']:.3g} grad {record['grad_norm']:.3g} "
                            f"{record['step_s']:.2f} s",
                            file=sys.stderr,
                            flush=True,
                        )
                stop = cfg.stop_at is not None and step >= cfg.stop_at and step < cfg.steps
                if step % cfg.ckpt_every == 0 or step == cfg.steps or stop:
                    self.save_checkpoint(step)
                if stop:
                    if info.is_main:
                        print(f"cspan train: stopped after step {step} (--stop-at); rerun to resume", file=sys.stderr)
                    return TrainResult(step=step, loss=last_loss, export_dir=None, metrics=cfg.out_dir / METRICS_FILE)
        finally:
            if metrics is not None:
                metrics.close()
        export_dir = self.export(step)
        return TrainResult(step=step, loss=last_loss, export_dir=export_dir, metrics=cfg.out_dir / METRICS_FILE)

    def _train_step(self, step: int) -> dict[str, Any]:
        cfg, info = self.cfg, self.dist
        dep_q = self.lm.dep_q
        micro = [collate(seqs) for seqs in self._micro_batches(step)]
        weights = [token_weights(t, m, dep_q, cfg.weights) for _, t, m in micro]
        local = torch.tensor(
            [
                sum(float(tw.sum()) for tw, _ in weights),
                sum(float(aw.sum()) for _, aw in weights),
                sum(float(m[:, 0].sum()) for _, _, m in micro),
                sum(float(m[:, 1 : 1 + dep_q].sum()) for _, _, m in micro),
                sum(float(i.shape[0] * i.shape[2]) for i, _, _ in micro),
            ],
            dtype=torch.float64,
        )
        totals = info.all_sum(local.to(self.device)).cpu()
        w_text = max(float(totals[0]), 1e-12)
        w_audio = max(float(totals[1]), 1e-12)
        sums = torch.zeros(2, dtype=torch.float64)
        self.module.train()
        for m, ((inputs, targets, _mask), (tw, aw)) in enumerate(zip(micro, weights, strict=True)):
            last = m == len(micro) - 1
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            tw, aw = tw.to(self.device), aw.to(self.device)
            with _grad_sync(self.module, last):
                with self._autocast():
                    text_logits, audio_logits = self.module(inputs, targets)
                text_sum, audio_sum = weighted_cross_entropy(text_logits, audio_logits, targets, tw, aw)
                loss = (text_sum / w_text + audio_sum / w_audio) * info.world
                loss.backward()
            sums += torch.stack([text_sum.detach(), audio_sum.detach()]).double().cpu()
        grad_norm = torch.nn.utils.clip_grad_norm_([p for p in self.module.parameters() if p.requires_grad], cfg.clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if not math.isfinite(float(grad_norm)):  # the global norm: every rank stops here together
            raise TrainError(
                f"step {step + 1}: the loss diverged (gradient norm {float(grad_norm)}); stopped before the update, "
                f"nothing exported; the checkpoints in {cfg.out_dir / CHECKPOINTS_DIR} are kept. Lower --lr, raise "
                "--warmup-steps, or check the data"
            )
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        sums = info.all_sum(sums.to(self.device)).cpu()
        text_loss, audio_loss = float(sums[0]) / w_text, float(sums[1]) / w_audio
        return {
            "loss": text_loss + audio_loss,
            "text_loss": text_loss,
            "audio_loss": audio_loss,
            "lr": lrs[0],
            "lr_depformer": lrs[-1],
            "grad_norm": float(grad_norm),
            "text_targets": int(totals[2]),
            "audio_targets": int(totals[3]),
            "positions": int(totals[4]),
            "samples": cfg.batch_size * cfg.accum * info.world,
        }


# ---------------------------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------------------------


def seed_rngs(seed: int, rank: int, *keys: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and every CUDA device) global generators from
    ``(seed, rank, *keys)`` through :class:`numpy.random.SeedSequence`. The trainer calls it before every step with
    ``keys = (step,)``: the RNG state is a function of the step, so a checkpoint needs none and stays valid for another
    number of processes (nothing in a step draws from these generators today -- samples have their own -- but
    dropout or the like would then be reproducible on a resume with the same world size)."""
    value = int(np.random.SeedSequence([seed, rank, *keys]).generate_state(1)[0])
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def run_training(cfg: TrainConfig) -> TrainResult:
    """Run ``cspan train`` with ``cfg`` (see :class:`Trainer`)."""
    return Trainer(cfg).run()


__all__ = [
    "DistInfo",
    "TrainConfig",
    "TrainModule",
    "TrainResult",
    "Trainer",
    "apply_fsdp",
    "build_optimizer",
    "enable_activation_checkpointing",
    "load_train_state",
    "lock_out_dir",
    "lr_factor",
    "read_train_state",
    "run_training",
    "save_train_state",
    "seed_rngs",
]
