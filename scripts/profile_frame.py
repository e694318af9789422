"""Kernel profile and host timing of the engine's whole frame (Mimi encode, the token step, Mimi decode, host reads)
on full rings: ``python scripts/profile_frame.py --batch-size 112 --kv-dtype fp8`` (random 7B and Mimi; CUDA only).

Prints, per batch size: the frame's wall time (p50 of ``--iters``, host included, as ``cspan bench capacity`` times
it), the step alone (``step_tokens``), and the frame's kernels grouped by name (scripts/perf_h200.py's profile)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from perf_h200 import _kernel_profile


def wall_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def profile_at(models, B: int, kv_dtype: str, iters: int) -> None:
    from cspan.bench.latency import ROOM_TONE_STD, fill_history, make_engine

    device = torch.device("cuda")
    engine = make_engine(models, B, (600,), True, False, kv_dtype, 640)
    pcm = torch.randn(B, 1920) * ROOM_TONE_STD
    zeros = torch.zeros(B, engine.num_codebooks, dtype=torch.long, device=device)
    for _ in range(engine.max_delay + 1):
        engine.step_tokens(zeros)
    fill_history(engine, engine.context or 0)

    def frame():
        out = engine.step(pcm)
        out.text_token.cpu()
        out.agent_pcm.cpu()

    for _ in range(5):
        frame()
        engine.step_tokens(zeros)
    frame_ms = wall_ms(frame, iters)
    step_ms = wall_ms(lambda: engine.step_tokens(zeros), iters)
    print(f"B={B} {kv_dtype}: frame p50 {frame_ms:.2f} ms, step_tokens p50 {step_ms:.2f} ms")
    _kernel_profile(f"B={B} {kv_dtype} frame", frame, reps=3)


@torch.no_grad()
def main() -> None:
    from cspan.bench.latency import load_models, release_device_memory

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[112])
    parser.add_argument("--kv-dtype", default="fp8")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    models = load_models(None, random_7b=True, device=torch.device("cuda"), dtype=torch.bfloat16)
    for B in args.batch_size:
        profile_at(models, B, args.kv_dtype, args.iters)
        release_device_memory(torch.device("cuda"))


if __name__ == "__main__":
    main()
