"""Frames per second of the served frame on the CPU: B sessions of the tiny checkpoint, as ``cspan serve`` runs them.

Each frame does what one tick of ``cspan serve`` does, in the same order and on one thread: the sessions' voice
activity in one pass and, for every session, ``Conversation.before_step`` (utterance bookkeeping; a transcriber that
answers at once, so the utterance path is live), ONE ``DuplexEngine.step`` over the B sessions (Mimi encode, the LM step, Mimi decode),
the host copies of its outputs (what the server sends), and ``Conversation.after_step`` for every session. The
user audio is the repository's recording (``assets/question_library_24k.wav``), looped, a different offset per
session.

Prints, per batch size: frames/s on the wall clock, and CPU-bound frames/s (frames per CPU second of the process:
what the frame rate would be with the process alone on its cores; it includes any CPU an idle intra-op worker
spins away), the median and best of the repeats (real time is 12.5 frames/s); and a per-frame breakdown in CPU
milliseconds (min and median over all measured frames): ``head`` (voice activity and all sessions'
``before_step``), ``encode`` / ``lm`` / ``decode`` (inside the engine step: Mimi encode, the token step, Mimi
decode), ``copies`` (device -> host numpy) and ``tail`` (all sessions' ``after_step``). Wall-clock figures on a
shared machine are noisy: quote the medians, with the best for the spread.

Usage::

    python scripts/cpu_frame_bench.py                        # builds the tiny checkpoint in a temporary folder
    python scripts/cpu_frame_bench.py --checkpoint DIR --batch-size 1 4 --frames 150 --repeats 3 --threads 1
    python scripts/cpu_frame_bench.py --batch-size 1 8 --live 1   # one live session on a batch-8 engine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("head", "encode", "lm", "decode", "copies", "tail")


@dataclass
class _Transcript:
    text: str = ""
    words: None = None


class _InstantTranscriber:
    """Answers every clip at once with an empty transcript (the bench times the frame, not a backend)."""

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> _Transcript:
        return _Transcript()


def _user_audio(frames: int, batch: int) -> np.ndarray:
    """[batch, frames, 1920] float32: the repository's recording looped, session i starting 1.1 * i s later."""
    from cspan.core.audio import read_audio
    from cspan.core.constants import FRAME_SIZE, SAMPLE_RATE

    pcm = read_audio(ROOT / "assets" / "question_library_24k.wav")
    need = frames * FRAME_SIZE
    out = np.empty((batch, frames, FRAME_SIZE), dtype=np.float32)
    for i in range(batch):
        start = int(1.1 * i * SAMPLE_RATE) % len(pcm)
        reps = -(-(start + need) // len(pcm))
        out[i] = np.tile(pcm, reps)[start : start + need].reshape(frames, FRAME_SIZE)
    return out


def run(checkpoint: str, batch: int, frames: int, warmup: int, seed: int, live: int | None = None) -> dict:
    """One timed run: a fresh engine of B sessions, the first ``live`` of them (all when None) live with a
    conversation each, the rest idle (``DuplexEngine.set_live``: not stepped, as a server's free rows); returns
    frames/s and the per-frame part times (ms)."""
    from cspan.core.checkpoint import load_checkpoint
    from cspan.core.engine import DuplexEngine
    from cspan.core.runtime import Conversation, voice_activity

    ckpt = load_checkpoint(checkpoint, device="cpu")
    engine = DuplexEngine(ckpt, batch_size=batch, seed=seed, predict_user=False)  # as serve builds it (on the CPU)
    live = batch if live is None else live
    engine.set_live(list(range(live, batch)), False)
    conversations = [
        Conversation(engine=engine, session=i, tokenizer=ckpt.tokenizer, transcriber=_InstantTranscriber())
        for i in range(live)
    ]
    audio = _user_audio(warmup + frames, batch)
    idle = np.zeros((batch - live, audio.shape[-1]), dtype=np.float32)  # an idle row's PCM: silence
    mimi = engine.mimi
    clock = {"encode": 0.0, "decode": 0.0}
    now = time.process_time  # CPU seconds of the process (all its threads): what a part costs, load or not

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = now()
            try:
                return fn(*args, **kwargs)
            finally:
                clock[name] += now() - t0

        return wrapper

    mimi.encode_step = timed("encode", mimi.encode_step)  # instance attributes: the engine calls these
    mimi.decode_step = timed("decode", mimi.decode_step)
    times: dict[str, list[float]] = {part: [] for part in PARTS}

    async def loop() -> tuple[float, float]:
        start = cpu_start = 0.0
        for k in range(warmup + frames):
            if k == warmup:
                start, cpu_start = time.perf_counter(), now()
            clock["encode"] = clock["decode"] = 0.0
            t0 = now()
            user = list(audio[:live, k])
            voiced = voice_activity(conversations, user)  # all sessions' detectors in one pass, as serve does
            for conv, frame, frame_voiced in zip(conversations, user, voiced, strict=True):
                await conv.before_step(frame, voiced=frame_voiced)
            t1 = now()
            pcm = audio[:, k] if live == batch else np.concatenate([audio[:live, k], idle])
            out = engine.step(torch.from_numpy(pcm))
            t2 = now()
            agent = out.agent_pcm.detach().float().cpu().numpy()
            text = out.text_token.cpu().numpy()
            is_ret = out.is_ret.cpu().numpy()
            valid = out.valid.cpu().numpy()
            t3 = now()
            for i, conv in enumerate(conversations):
                ok = bool(valid[i])
                await conv.after_step(int(text[i]) if ok else None, bool(is_ret[i]) if ok else False)
            t4 = now()
            assert agent.shape == (batch, 1920)
            if k >= warmup:
                step = t2 - t1
                lm = step - clock["encode"] - clock["decode"]
                for part, seconds in zip(
                    PARTS, (t1 - t0, clock["encode"], lm, clock["decode"], t3 - t2, t4 - t3), strict=True
                ):
                    times[part].append(seconds * 1e3)
        elapsed, cpu = time.perf_counter() - start, now() - cpu_start
        for conv in conversations:
            await conv.finish()
        return elapsed, cpu

    with torch.inference_mode():
        elapsed, cpu = asyncio.run(loop())
    return {"fps": frames / elapsed, "cpu_fps": frames / cpu, "times": times}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="checkpoint folder (default: build the tiny one, seed 0)")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 4], help="sessions (default: 1 4)")
    parser.add_argument("--frames", type=int, default=150, help="measured frames per run (default 150 = 12 s)")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured frames first (default 10)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per batch size (default 3)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: as cspan serve, use_cpu_threads)"
    )
    parser.add_argument(
        "--live", type=int, default=None, help="live sessions of each batch, the rest idle (default: all live)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    else:
        from cspan.core.runtime import use_cpu_threads

        use_cpu_threads()  # what cspan serve / infer do on the CPU

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            from cspan.core.tiny import build_tiny_checkpoint

            checkpoint = str(build_tiny_checkpoint(Path(tmp) / "tiny", seed=0))
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s), checkpoint {checkpoint}, "
            f"{args.frames} frames x {args.repeats} runs per batch size; real time = 12.5 frames/s",
            flush=True,
        )
        report = {"torch": torch.__version__, "threads": torch.get_num_threads(), "batches": {}}
        for batch in args.batch_size:
            live = batch if args.live is None else min(args.live, batch)
            runs = [run(checkpoint, batch, args.frames, args.warmup, args.seed, live) for _ in range(args.repeats)]
            fps = [r["fps"] for r in runs]
            cpu_fps = [r["cpu_fps"] for r in runs]
            parts = {p: [t for r in runs for t in r["times"][p]] for p in PARTS}
            print(
                f"B={batch}{f' ({live} live)' if live < batch else ''}: wall {statistics.median(fps):6.1f} frames/s median, best {max(fps):6.1f} "
                f"(runs {', '.join(f'{f:.1f}' for f in fps)}); "
                f"CPU-bound {statistics.median(cpu_fps):6.1f} frames/s median, best {max(cpu_fps):6.1f} "
                f"= {statistics.median(cpu_fps) / 12.5:4.2f}x real time"
            )
            print("   CPU ms/frame " + " ".join(f"{p:>15s}" for p in PARTS))
            print(
                "   min / median "
                + " ".join(f"{min(parts[p]):6.2f} /{statistics.median(parts[p]):7.2f}" for p in PARTS)
            )
            report["batches"][batch] = {
                "live": live,
                "wall_fps": fps,
                "cpu_fps": cpu_fps,
                "parts_cpu_ms": {p: {"min": min(v), "median": statistics.median(v)} for p, v in parts.items()},
            }
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
