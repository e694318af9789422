"""``cspan model ...`` (checkpoint utilities) and ``cspan voice ...`` (voice prompts), registered through the
``cspan.commands`` entry points.

The verbs sit above the libraries they drive (:mod:`cspan.core.checkpoint`, :mod:`cspan.core.tiny`,
:mod:`cspan.core.voice`). Heavy imports (torch, the models) happen inside the handlers so that ``cspan --help``
stays fast.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

# ---------------------------------------------------------------------------------------------------------------
# `cspan model tiny`, `cspan model info`
# ---------------------------------------------------------------------------------------------------------------


def _cmd_tiny(args: argparse.Namespace) -> int:
    from .tiny import build_tiny_checkpoint

    out = build_tiny_checkpoint(args.out_dir, dep_q=args.dep_q, seed=args.seed, overwrite=args.force)
    print(f"wrote a tiny random checkpoint (dep_q {args.dep_q}, seed {args.seed}) to {out}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from .checkpoint import describe_checkpoint

    text = describe_checkpoint(args.source, revision=args.revision, base=args.base, load=args.load)
    print(text)
    if "\n  key check: FAILED" in text:  # the summary is printed; the status says the weights would not load
        print("cspan model info: error: these weights would not load (see the key check above)", file=sys.stderr)
        return 1
    return 0


def model_command(parser: argparse.ArgumentParser) -> None:
    """Model utilities: build a tiny random checkpoint in the released layout, inspect a checkpoint."""
    # light: torch is imported by the handlers only
    from .checkpoint import DEFAULT_BASE, DEFAULT_CHECKPOINT, ENV_BASE, ENV_CHECKPOINT

    sub = parser.add_subparsers(dest="model_command", metavar="ACTION", title="actions")
    sub.required = True
    tiny = sub.add_parser(
        "tiny",
        help="write a tiny random checkpoint in the released layout",
        description=(
            "Write a small random-weight checkpoint in exactly the released layout (LM and Mimi safetensors, "
            "SentencePiece model, config.json, two voices) for tests and demos without the 7B."
        ),
    )
    tiny.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (created; must be empty unless --force)")
    tiny.add_argument("--dep-q", type=int, choices=(16, 8), default=16, help="depformer codebooks (default 16)")
    tiny.add_argument("--seed", type=int, default=0, help="random seed; the same seed writes identical files")
    tiny.add_argument("--force", action="store_true", help="write into a non-empty folder, replacing the files")
    tiny.set_defaults(handler=_cmd_tiny)

    info = sub.add_parser(
        "info",
        help="print a checkpoint's config, size, dtype, special ids and voices",
        description="Print a checkpoint's files, LM and Mimi configuration, parameter count, dtype, special ids, voices.",
    )
    info.add_argument(
        "source",
        metavar="SOURCE",
        nargs="?",
        default=None,
        help=f"folder, file, hf://owner/repo/file or repo id (default ${ENV_CHECKPOINT} or {DEFAULT_CHECKPOINT})",
    )
    info.add_argument("--revision", default=None, help="Hub revision of SOURCE")
    info.add_argument("--base", default=None, help=f"base of a fine-tune (default ${ENV_BASE} or {DEFAULT_BASE})")
    info.add_argument("--load", action="store_true", help="also load every weight on CPU to check keys and shapes")
    info.set_defaults(handler=_cmd_info)


# ---------------------------------------------------------------------------------------------------------------
# `cspan voice encode`
# ---------------------------------------------------------------------------------------------------------------


def _cmd_encode(args: argparse.Namespace) -> int:
    import torch

    from .checkpoint import (
        checkpoint_reads,
        load_checkpoint,
        load_mimi,
        read_configs,
        resolve_checkpoint,
        resolve_prefix_layout,
    )
    from .config import PERSONAPLEX
    from .constants import SAMPLE_RATE
    from .devices import parse_device
    from .errors import CheckpointError, SettingsError
    from .files import atomic_file, check_writable
    from .reads import Reads, check_outputs
    from .voice import (
        VOICE_TARGET_LUFS,
        check_embeddings_card,
        encode_voice_pcm,
        prepare_voice_audio,
        voice_embeddings_form,
    )

    device = parse_device(args.device or "cpu")  # a bad --device is refused before anything is read or written
    out = Path(args.output)
    if out.suffix != ".pt":
        raise SettingsError(f"output {str(out)!r}: a voice file ends in .pt")
    if out.exists() and out.is_dir():
        raise SettingsError(f"output {str(out)!r} is a folder; give a file name ending in .pt")
    reads = Reads().file("IN", args.input, "the recording IN")
    model = checkpoint_reads(args.checkpoint, base=args.base, folders=False)  # the model's files; voices are not read
    check_outputs({"OUT": out}, reads.extend(model))
    check_writable(out)  # before Mimi loads: a folder that cannot be written fails now, not after the encoding
    audio = prepare_voice_audio(args.input)  # a missing, short or silent recording fails before the checkpoint loads
    files = resolve_checkpoint(args.checkpoint, base=args.base)
    layout = resolve_prefix_layout(files)
    embeddings = layout == PERSONAPLEX if args.embeddings is None else args.embeddings
    lm_cfg, mimi_cfg = read_configs(files.config, [])
    if embeddings:
        try:  # before the LM loads: PersonaPlex's form needs its sine frame to be codes of this codec
            check_embeddings_card(lm_cfg.card)
        except CheckpointError as exc:
            if args.embeddings:  # asked for on the command line: a bad setting
                raise SettingsError(f"--embeddings: checkpoint {files.source!r}: {exc}") from None
            raise CheckpointError(f"checkpoint {files.source!r} (PersonaPlex's prefix layout): {exc}") from None
        ckpt = load_checkpoint(args.checkpoint, base=args.base, device=device)
        mimi, lm = ckpt.mimi, ckpt.lm
    else:
        if files.mimi is None:
            raise CheckpointError(f"checkpoint {files.source!r} has no Mimi weights to encode the recording with")
        mimi, lm = load_mimi(files.mimi, mimi_cfg, device=device), None
    if int(mimi.sample_rate) != SAMPLE_RATE:  # a codec at another rate than 24 kHz: read again at its rate
        audio = prepare_voice_audio(args.input, sample_rate=int(mimi.sample_rate))
    check_outputs({"OUT": out}, checkpoint_reads(args.checkpoint, base=args.base, folders=False))  # now cached
    codes = encode_voice_pcm(audio, mimi)
    payload: dict[str, torch.Tensor] = {"codes": codes}
    if lm is not None:
        payload.update(voice_embeddings_form(codes, lm))
    with atomic_file(out) as tmp:
        torch.save(payload, tmp)
    forms = "codes" + (" + PersonaPlex embeddings" if lm is not None else "")
    print(
        f"wrote {out}: {audio.num_frames} frames ({audio.samples / SAMPLE_RATE:.2f} s, loudness "
        f"{audio.loudness_lufs:.1f} LUFS -> {VOICE_TARGET_LUFS:.0f} LUFS), {forms}; use it with --voice "
        f"{shlex.quote(str(out))}"
    )
    return 0


def voice_command(parser: argparse.ArgumentParser) -> None:
    """Voice prompts: make one from a recording (2-30 s), loudness-normalised and Mimi-encoded."""
    sub = parser.add_subparsers(dest="voice_command", metavar="ACTION", title="actions")
    sub.required = True
    enc = sub.add_parser(
        "encode",
        help="encode a recording as a voice prompt file",
        description=(
            "Encode a 2-30 s recording (any format soundfile reads, any rate; channel 0) as a voice prompt: "
            "loudness-normalised to -24 LUFS and Mimi-encoded as PersonaPlex does. OUT.pt holds {'codes': [8, N]} "
            "and, for checkpoints with PersonaPlex's prefix layout, PersonaPlex's {'embeddings', 'cache'} too."
        ),
    )
    enc.add_argument("input", metavar="IN", help="the recording (WAV, FLAC, OGG ...)")
    enc.add_argument("output", metavar="OUT", help="the voice file to write (.pt)")
    enc.add_argument("--checkpoint", default=None, help="checkpoint whose Mimi encodes (default: the released one)")
    enc.add_argument("--base", default=None, help="base of a fine-tune checkpoint")
    enc.add_argument("--device", default=None, help="where Mimi (and the LM) run (default cpu)")
    enc.add_argument(
        "--embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also write PersonaPlex's embeddings form (default: when the checkpoint uses PersonaPlex's layout)",
    )
    enc.set_defaults(handler=_cmd_encode)


__all__ = ["model_command", "voice_command"]
