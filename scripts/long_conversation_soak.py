"""Soak of a long ``cspan infer`` conversation (issue 18): peak RSS per attention window, and where the persona was
pinned or read again.

Builds a recording of ``--minutes`` of user audio (the repository's fixture dialogue, looped, with a pause between
repeats), and runs the real ``cspan infer`` job on it (``cspan.server.infer.run_infer``, on the tiny checkpoint by
default: its window is the real 3000 positions), with ``--persona-policy``, ``--memory-span`` and a given Context
Span every ``--span-every-s`` seconds (no ASR, no router: the cost is the model's). After every frame it samples the
process's resident memory (``/proc/self/statm``) and records, per window of 3000 frames (240 s of conversation),
the peak RSS and the session's position; the ``persona`` and memory-span events come from the JSON ``infer`` writes.

The report (JSON, ``--report``) is rewritten after every window, so a run stopped early keeps the windows it
finished. This is a benchmark, not a test: on a shared CPU the timings are noisy; the RSS figures are what it is for.

Usage::

    nice python scripts/long_conversation_soak.py --minutes 30 --report soak.json
    python scripts/long_conversation_soak.py --checkpoint DIR --minutes 5 --persona-policy reprefix
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT.parent / "shared" / "fixtures" / "audio" / "assistant_dialogue_24k.wav"
WINDOW_FRAMES = 3000
FACT = "The warehouse in Leeds opens at 7:30 and the parcel {k} is on shelf {k}."


def rss_mb() -> float:
    """The process's resident set in MiB (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def build_input(path: Path, minutes: float, source: Path) -> float:
    """Write ``minutes`` of 24 kHz mono audio to ``path``: ``source`` looped with 5 s pauses; returns seconds."""
    audio, sr = sf.read(source, dtype="float32", always_2d=True)
    clip = np.concatenate([audio[:, 0], np.zeros(5 * sr, dtype=np.float32)])
    n = int(minutes * 60 * sr)
    reps = -(-n // len(clip))
    sf.write(path, np.tile(clip, reps)[:n], sr, subtype="PCM_16")
    return n / sr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="checkpoint folder (default: `cspan model tiny`, built here)")
    parser.add_argument("--minutes", type=float, default=30.0, help="minutes of user audio (default 30)")
    parser.add_argument("--persona-policy", default="pinned", choices=("pinned", "reprefix", "none"))
    parser.add_argument("--no-memory-span", action="store_true", help="leave --memory-span off")
    parser.add_argument("--span-every-s", type=float, default=90.0, help="a given Context Span every this many s")
    parser.add_argument("--report", type=Path, default=Path("long_conversation_soak.json"))
    parser.add_argument("--source", type=Path, default=FIXTURE, help="the audio to loop")
    args = parser.parse_args()

    from cspan.core.cli import build_parser
    from cspan.core.settings import settings_from_args
    from cspan.server.infer import run_infer

    work = Path(tempfile.mkdtemp(prefix="cspan-soak-"))
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = work / "tiny"
        cmd = [sys.executable, "-m", "cspan.core.cli", "model", "tiny", str(checkpoint), "--seed", "0"]
        subprocess.run(cmd, check=True, capture_output=True)
    seconds = build_input(work / "input.wav", args.minutes, args.source)
    spans = [
        arg
        for k, t in enumerate(np.arange(30.0, seconds - 1.0, args.span_every_s))
        for arg in ("--span", f"{t:.1f}:{FACT.format(k=k)}")
    ]
    argv = [
        "infer",
        "--input-wav", str(work / "input.wav"),
        "--output-wav", str(work / "out.wav"),
        "--output-text", str(work / "out.json"),
        "--checkpoint", str(checkpoint),
        "--device", "cpu", "--seed", "3", "--quiet", "--asr", "none", "--router", "none",
        "--db", str(work / "context.sqlite"), "--user-name", "Ada", "--user-city", "Leeds",
        "--max-seconds", str(seconds + 1),
        "--persona-policy", args.persona_policy, *spans,
        *([] if args.no_memory_span else ["--memory-span"]),
    ]  # fmt: skip
    settings = settings_from_args(build_parser().parse_args(argv))

    report: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), torch threads 1",
        "checkpoint": str(checkpoint),
        "input_s": seconds,
        "persona_policy": args.persona_policy,
        "memory_span": not args.no_memory_span,
        "spans_given": len(spans) // 2,
        "rss_mb_before_model": round(rss_mb(), 1),
        "windows": [],
        "done": False,
    }
    started = time.monotonic()
    window = {"peak": 0.0}
    report["persona_seen"] = []  # read from the session's record as the run goes (the JSON's events come at the end)
    first = {"pinned": False, "copy": 0}

    def save() -> None:
        report["wall_s"] = round(time.monotonic() - started, 1)
        args.report.write_text(json.dumps(report, indent=2) + "\n")

    def on_frame(k: int, engine) -> None:
        window["peak"] = max(window["peak"], rss_mb())
        persona = engine.sessions.persona.get(0)
        if persona is not None and persona.pinned and not first["pinned"]:
            first["pinned"] = True
            report["persona_seen"].append({"frame": k, "kind": "pin"})
        if persona is not None and persona.first != first["copy"]:
            first["copy"] = persona.first
            report["persona_seen"].append({"frame": k, "kind": "reprefix", "position": persona.first})
        if (k + 1) % WINDOW_FRAMES == 0:
            report["windows"].append(
                {
                    "window": len(report["windows"]),
                    "frames": [k + 1 - WINDOW_FRAMES, k + 1],
                    "position": int(engine.positions[0]),
                    "peak_rss_mb": round(window["peak"], 1),
                    "prefix_in_window": bool(engine.prefix_in_window(0)),
                    "wall_s": round(time.monotonic() - started, 1),
                }
            )
            window["peak"] = 0.0
            save()

    result = asyncio.run(run_infer(settings, on_frame=on_frame))
    doc = json.loads((work / "out.json").read_text())
    if window["peak"]:
        report["windows"].append({"window": len(report["windows"]), "peak_rss_mb": round(window["peak"], 1)})
    persona = [e for e in doc["events"] if e["type"] == "persona"]
    report.update(
        done=True,
        frames=doc["timing"]["frames"],
        window_summary=doc["window"],
        persona_events=[{k: e[k] for k in ("frame", "kind", "position", "positions")} for e in persona],
        memory_spans=[e["frame"] for e in doc["events"] if e["type"] == "span" and e["source"] == "memory"],
        events=len(doc["events"]),
        json_bytes=(work / "out.json").stat().st_size,
        step_ms=doc["timing"]["step"],
        prefix_in_window_at_end=bool(result.engine.prefix_in_window(0)),
    )
    save()
    print(json.dumps({k: v for k, v in report.items() if k != "windows"}, indent=2))
    for w in report["windows"]:
        print(w)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
