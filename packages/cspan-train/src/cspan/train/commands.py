"""``cspan prepare`` and ``cspan train`` (registered through the ``cspan.commands`` entry points).

Heavy imports (torch, the model) happen inside the handlers so that ``cspan --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from exc
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: must be >= 1")
    return n


def prepare_command(parser: argparse.ArgumentParser) -> None:
    """Encode training dialogues (JSON + stereo audio) into Mimi-code shards and a manifest for `cspan train`."""
    parser.formatter_class = argparse.HelpFormatter  # each help line says its default already
    parser.add_argument("--in-dir", type=Path, help="folder of NAME.json + NAME.wav dialogues (docs/TRAINING.md)")
    parser.add_argument("--out-dir", type=Path, help="dataset folder to write (an existing one is resumed)")
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint whose Mimi, tokenizer and voices are used (folder, file or repo id; default "
        "$CSPAN_CHECKPOINT or the released model); its LM weights are not loaded",
    )
    parser.add_argument("--base", default=None, help="base of a fine-tune checkpoint (default $CSPAN_BASE)")
    parser.add_argument("--workers", type=_positive_int, default=4, help="threads reading and aligning dialogues (4)")
    parser.add_argument(
        "--device", default=None, help="where Mimi runs: cuda, cuda:1, cpu (default: cuda if available)"
    )
    parser.add_argument("--batch-size", type=_positive_int, default=8, help="dialogues per Mimi batch (8)")
    parser.add_argument("--shard-size", type=_positive_int, default=64, help="dialogues per shard file (64)")
    parser.add_argument(
        "--max-span-frames", type=int, default=600, help="longest Context Span block; longer references are cut (600)"
    )
    parser.add_argument("--persona", default=None, help="persona text for dialogues that have none")
    parser.add_argument(
        "--voice",
        default=None,
        help="voice prompt for dialogues that have none: a voice name of the checkpoint (voices/, PersonaPlex's "
        "voices.tgz), a .pt voice file with codes, or a 2-30 s recording",
    )
    parser.add_argument("--strict", action="store_true", help="exit with status 1 when any dialogue was bad")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--print-schema", action="store_true", help="print the dialogue JSON Schema and exit")
    parser.set_defaults(handler=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    if args.print_schema:
        from .schema import dialogue_json_schema

        print(json.dumps(dialogue_json_schema(), indent=2))
        return 0
    if args.in_dir is None or args.out_dir is None:
        print("cspan prepare: error: --in-dir and --out-dir are required", file=sys.stderr)
        return 2
    from .data import PrepareOptions, run_prepare

    summary = run_prepare(
        args.in_dir,
        args.out_dir,
        checkpoint=args.checkpoint,
        base=args.base,
        workers=args.workers,
        device=args.device,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        options=PrepareOptions(
            max_span_frames=args.max_span_frames, default_persona=args.persona, default_voice=args.voice
        ),
        progress=not args.quiet,
    )
    line = f"cspan prepare: {summary.prepared} dialogue(s) prepared into {summary.out_dir}"
    if summary.skipped:
        line += f", {summary.skipped} already done"
    if summary.changed:
        line += f", {summary.changed} changed since, prepared again"
    if summary.failed:
        line += f", {len(summary.failed)} bad dialogue(s) skipped (listed in {summary.out_dir / 'errors.jsonl'})"
    print(line, file=sys.stderr)
    return 1 if (summary.failed and args.strict) else 0


def train_command(parser: argparse.ArgumentParser) -> None:
    """Fine-tune on prepared dialogues with Context Spans spliced in (full or LoRA; torchrun for DDP / FSDP2)."""
    parser.formatter_class = argparse.HelpFormatter  # each help line says its default already
    parser.add_argument("--data-dir", type=Path, required=True, help="a folder written by `cspan prepare`")
    parser.add_argument(
        "--out-dir", type=Path, required=True, help="checkpoints, metrics and export (resumed if present)"
    )
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="what to fine-tune (folder, file or repo id; default $CSPAN_CHECKPOINT or the released model)",
    )
    parser.add_argument("--base", default=None, help="base of a fine-tune checkpoint (default $CSPAN_BASE)")
    g = parser.add_argument_group("LoRA")
    g.add_argument("--lora-rank", type=int, default=0, help="adapter rank; 0 = full fine-tuning (default)")
    g.add_argument("--lora-alpha", type=float, default=None, help="adapter scale numerator (default: the rank)")
    g.add_argument(
        "--lora-targets",
        default="all",
        help="'all' linear layers (default) or comma-separated module patterns, e.g. 'transformer.layers.*'",
    )
    g = parser.add_argument_group("optimisation")
    g.add_argument("--steps", type=_positive_int, default=1000, help="optimizer steps (1000)")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-6 full, 1e-4 LoRA)")
    g.add_argument("--lr-depformer", type=float, default=None, help="depformer learning rate (default 2 x --lr)")
    g.add_argument("--batch-size", type=_positive_int, default=1, help="sequences per micro-batch per process (1)")
    g.add_argument("--accum", type=_positive_int, default=8, help="micro-batches per step (8)")
    g.add_argument("--context", type=int, default=3000, help="training window in positions (3000)")
    g.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up steps (default 5%% of --steps)")
    g.add_argument(
        "--min-lr-ratio",
        type=float,
        default=0.1,
        help="the last step's learning rate, where the cosine ends, as a fraction of the peak (0.1)",
    )
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (0)")
    g.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (1.0)")
    g.add_argument("--seed", type=int, default=0, help="seed of the samples, LoRA init and RNGs (0)")
    g = parser.add_argument_group("loss weights")
    g.add_argument("--w-ret", type=float, default=5.0, help="multiplier of <ret> text targets (5)")
    g.add_argument("--w-pad", type=float, default=0.5, help="multiplier of PAD text targets (0.5)")
    g.add_argument("--w-text", type=float, default=1.0, help="weight of text targets (1)")
    g.add_argument("--w-semantic", type=float, default=1.0, help="weight of the agent semantic codebook (1)")
    g.add_argument("--w-acoustic", type=float, default=0.02, help="weight of every other audio codebook (0.02)")
    g = parser.add_argument_group("span delays (MoshiRAG sampler)")
    g.add_argument("--start-delay-s", type=float, default=1.0, help="earliest block after <ret>, seconds (1.0)")
    g.add_argument("--end-gap-s", type=float, default=1.0, help="latest block before the body, seconds (1.0)")
    g.add_argument("--random-delay-proba", type=float, default=0.2, help="uniform-over-the-lead probability (0.2)")
    g = parser.add_argument_group("runtime")
    g.add_argument("--fsdp", action="store_true", help="shard with FSDP2 fully_shard under torchrun (default DDP)")
    g.add_argument("--device", default=None, help="cuda, cpu (default: cuda:LOCAL_RANK if available)")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="parameter dtype (float32)")
    g.add_argument("--autocast", default="auto", choices=("auto", "bf16", "none"), help="auto (default) = bf16 on CUDA")
    g.add_argument(
        "--no-activation-checkpointing", action="store_true", help="keep activations instead of recomputing them"
    )
    g.add_argument("--ckpt-every", type=_positive_int, default=500, help="steps between checkpoints (500)")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="latest checkpoints kept, 0 = all (2)")
    g.add_argument("--stop-at", type=int, default=None, help="checkpoint and stop after this step (resume later)")
    g.add_argument("--log-every", type=_positive_int, default=10, help="steps between log lines (10)")
    g.add_argument(
        "--export-dtype", default=None, choices=("float32", "bfloat16"), help="exported weights (default: --dtype)"
    )
    g.add_argument(
        "--export-format",
        default="cspan",
        choices=("cspan", "moshi"),
        help="export/ as context_spanning.pt (cspan) or, for LoRA, moshi-finetune's lora.safetensors + config.json",
    )
    parser.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    from .loss import LossWeights
    from .train import TrainConfig, run_training

    cfg = TrainConfig(
        data_dir=args.data_dir,
        out_dir=args.out_dir,
        checkpoint=args.checkpoint,
        base=args.base,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_targets=args.lora_targets,
        steps=args.steps,
        lr=args.lr,
        lr_depformer=args.lr_depformer,
        batch_size=args.batch_size,
        accum=args.accum,
        context=args.context,
        ckpt_every=args.ckpt_every,
        seed=args.seed,
        fsdp=args.fsdp,
        warmup_steps=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay,
        clip=args.clip,
        weights=LossWeights(
            text=args.w_text, pad=args.w_pad, ret=args.w_ret, semantic=args.w_semantic, acoustic=args.w_acoustic
        ),
        device=args.device,
        dtype=args.dtype,
        autocast=args.autocast,
        activation_checkpointing=not args.no_activation_checkpointing,
        stop_at=args.stop_at,
        log_every=args.log_every,
        keep_checkpoints=args.keep_checkpoints,
        export_dtype=args.export_dtype,
        export_format=args.export_format,
        start_delay_s=args.start_delay_s,
        end_gap_s=args.end_gap_s,
        random_sampling_proba=args.random_delay_proba,
    )
    result = run_training(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        done = f"cspan train: step {result.step}"
        if result.loss is not None:
            done += f", loss {result.loss:.4f}"
        done += f"; metrics {result.metrics}"
        if result.export_dir is not None:
            done += f"; exported to {result.export_dir}"
        print(done, file=sys.stderr)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Under torchrun, once every output is written and the process group destroyed: leave without the
        # interpreter's teardown, where gloo's threads sometimes abort the process ("terminate called without an
        # active exception", SIGABRT) and torchrun reports a finished run as failed (as scripts/fsdp_scaling.py does)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


__all__ = ["prepare_command", "train_command"]
