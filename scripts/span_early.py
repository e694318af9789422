"""What a span frame costs when its host work is done before the frame's tick (device probe, paced).

A server runs frames on an 80 ms clock: between two frames the GPU idles, so every millisecond of host work a span
step does before its first kernel lands on that frame. This times, on an ``--pace-ms`` clock, for B sessions on
full rings and a span into session 0, four kinds of frame interleaved round by round:

- ``plain``: a plain step;
- ``late``: ``inject_span`` at the tick, then the step (what ``cspan bench latency --pace-ms`` times);
- ``inject-early``: ``inject_span`` between the previous frame and the tick, then the step at the tick;
- ``prepared``: ``inject_span`` and ``DuplexEngine.prepare`` between the previous frame and the tick (what
  ``cspan serve`` does); at the tick the step takes the head, applies its splice and reads the prepared inputs;
- ``prepare-early``: ``inject_span`` and the step's head (``DuplexEngine._prepare``: the queue taken, the block
  spliced on the device, the host tables, the decode plan) between the previous frame and the tick; at the tick
  the step runs on that kept batch.

Each frame is timed from the tick to the device synchronisation after it; the early work is timed too (host wall,
then a synchronisation). Usage (on the device): ``python scripts/span_early.py [--batch-size 64] [--spans 16 600]
[--iters 30] [--pace-ms 80]``; ``--checkpoint DIR --device cpu`` runs it on a small model (a check, not a timing).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--spans", type=int, nargs="*", default=[16, 600])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--gap-steps", type=int, default=2)
    ap.add_argument("--pace-ms", type=float, default=80.0)
    ap.add_argument("--fill", type=int, default=None, help="positions of history first (default: a full ring)")
    ap.add_argument("--checkpoint", default=None, help="a checkpoint instead of the random 7B")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from cspan.bench.latency import LatencyBench, LatencyOptions, load_models, make_engine, span_body
    from cspan.bench.session import synchronize
    from cspan.core.span import ContextSpan

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    models = load_models(args.checkpoint, random_7b=args.checkpoint is None, device=device, dtype=dtype)
    engine = make_engine(models, args.batch_size, span_lengths=args.spans)
    options = LatencyOptions(span_lengths=args.spans, iters=args.iters, fill=args.fill, pace_ms=args.pace_ms)
    bench = LatencyBench(engine, options)
    bench.restart()
    sync = lambda: synchronize(device)  # noqa: E731
    prepare = engine._prepare
    print(f"batch size {args.batch_size}, positions {min(engine.positions)}-{max(engine.positions)}, "
          f"paced {args.pace_ms} ms", flush=True)  # fmt: skip

    def frame(kind: str, span: ContextSpan) -> tuple[float, float]:
        """(frame ms from the tick, early host ms) of one frame of ``kind``."""
        for _ in range(args.gap_steps):
            bench.pace()
            bench.lm_step()
        sync()
        early = 0.0
        kept = None
        if kind in ("inject-early", "prepared", "prepare-early"):
            t0 = time.perf_counter()
            engine.inject_span(0, span)
            if kind == "prepared":
                engine.prepare()
            if kind == "prepare-early":
                kept = prepare()
            sync()
            early = (time.perf_counter() - t0) * 1000.0
        bench.pace()
        t0 = time.perf_counter()
        if kind == "late":
            engine.inject_span(0, span)
        if kept is not None:
            engine._prepare = lambda: kept
        try:
            bench.lm_step()
        finally:
            engine._prepare = prepare
        sync()
        return (time.perf_counter() - t0) * 1000.0, early

    kinds = ["plain", "late", "inject-early", "prepared", "prepare-early"]
    for n in args.spans:
        span = ContextSpan.from_ids(span_body(n, int(engine.lm.text_card), 0))
        times: dict[str, list[float]] = {k: [] for k in kinds}
        early: dict[str, list[float]] = {k: [] for k in kinds}
        for it in range(args.warmup + args.iters):
            order = kinds[it % len(kinds) :] + kinds[: it % len(kinds)]  # rotate the order round by round
            for kind in order:
                ms, host = frame(kind, span)
                if it >= args.warmup:
                    times[kind].append(ms)
                    early[kind].append(host)
        plain = times["plain"]
        p50 = statistics.median(plain)
        p99 = _p99(plain)
        print(f"n = {n}: plain p50 {p50:.3f} p99 {p99:.3f} ms ({len(plain)} frames)", flush=True)
        for kind in kinds[1:]:
            t = times[kind]
            print(
                f"  {kind:14s} p50 {statistics.median(t):7.3f} (+{statistics.median(t) - p50:6.3f})  "
                f"p99 {_p99(t):7.3f} (+{_p99(t) - p99:6.3f})  mean {statistics.fmean(t):7.3f}  "
                f"early host p50 {statistics.median(early[kind]):.3f} ms",
                flush=True,
            )


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * 0.99
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


if __name__ == "__main__":
    main()
