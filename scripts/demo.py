"""The README's main job on the embedded defaults.

Builds the tiny demo checkpoint if absent (``demo/tiny-checkpoint``, random weights in the released layout: the
real 7B is not reachable offline), then runs ``cspan infer`` on the repository's own recording
(``assets/question_library_24k.wav``: "When does the library open on Sunday?") with the embedded transcriber
(pocketsphinx), the embedded router over ``assets/knowledge/`` and an in-memory Context DB (nothing is remembered
between runs), and a ``<ret>`` forced right after the question, and prints where the outputs are. Pass
``--checkpoint SOURCE`` to use a real checkpoint instead.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cspan(*args: str) -> None:
    cmd = [sys.executable, "-m", "cspan.core.cli", *args]
    print("+ cspan " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="checkpoint to use (default: the tiny demo one)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "demo")
    args = parser.parse_args()
    out = args.out_dir
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = str(out / "tiny-checkpoint")
        if not (Path(checkpoint) / "model.safetensors").exists():
            cspan("model", "tiny", checkpoint, "--seed", "0")
    cspan(
        "infer",
        "--input-wav", str(ROOT / "assets" / "question_library_24k.wav"),
        "--output-wav", str(out / "conversation.wav"),
        "--output-text", str(out / "conversation.json"),
        "--checkpoint", checkpoint,
        "--asr", "sphinx",
        "--router", "local",
        "--knowledge", str(ROOT / "assets" / "knowledge"),
        "--db", ":memory:",  # a demo keeps no memory (a plain `cspan infer` remembers in the platform's data folder)
        "--force-ret-at", "3.0",
        "--lead-silence", "1",
        "--tail-silence", "4",
        "--seed", "1",
    )  # fmt: skip
    print(f"\noutputs:\n  {out / 'conversation.wav'}  (stereo 24 kHz: left = user, right = agent)")
    print(f"  {out / 'conversation.json'}  (words, transcripts, events incl. the Context Span, timing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
