"""Where the host time of a span step goes, phase by phase, without a profiler (device only).

The span series of ``scripts/step_anatomy.py`` (``inject_span`` + one step on a freshly reset stream) spends about
0.5 ms more host time than a plain step (C43). This times, for the plain step and for spans of n columns, each part
of the call with a device synchronisation after it: ``inject_span`` (host), ``_prepare`` (the splice's device ops
and the host tables), the copies into the graph's static inputs, ``replay`` (the host's ``cudaGraphLaunch``, then
the wait for the GPU), and the output clones (with ``--prepared``: ``DuplexEngine.prepare`` after the injection, ``prepare_ahead``, and ``_prepare`` then reads what it built); and, for each graph, its replay alone, timed by the host and by CUDA
events (launch latency + execution). Usage (on the device): ``python scripts/span_phases.py [--spans 16 64 600]
[--batch-size B] [--fill POSITIONS]``: B sessions (default 1), the span into session 0, every session holding
``--fill`` positions of history first (default 0, a fresh stream; 3000 a full ring).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spans", type=int, nargs="*", default=[16, 64, 600])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--fill", type=int, default=0, help="positions of history per session first (3000: a full ring)")
    ap.add_argument(
        "--prepared", action="store_true", help="DuplexEngine.prepare() after the injection (prepare_ahead)"
    )
    args = ap.parse_args()
    from cspan.bench.latency import LatencyBench, LatencyOptions, load_models, make_engine, span_body
    from cspan.core.graphs import clone_outputs
    from cspan.core.span import ContextSpan

    device = torch.device("cuda")
    models = load_models(None, random_7b=True, device=device, dtype=torch.bfloat16)
    engine = make_engine(models, args.batch_size, span_lengths=args.spans)
    sync = torch.cuda.synchronize
    bench = LatencyBench(engine, LatencyOptions(span_lengths=args.spans, iters=64, fill=args.fill))
    bench.restart()  # every session reset, started, and given --fill positions of history
    inputs = bench.inputs
    print(
        f"batch size {args.batch_size}, history {min(engine.positions)}-{max(engine.positions)} positions per session"
    )

    def phases(span: ContextSpan | None) -> dict[str, float]:
        t = {}
        sync()
        t0 = time.perf_counter()
        if span is not None:
            engine.inject_span(0, span)
        ta = time.perf_counter()
        if args.prepared:
            engine.prepare()
        t1 = time.perf_counter()
        batch = engine._prepare()
        t2 = time.perf_counter()
        sync()
        t3 = time.perf_counter()
        user = inputs.next_codes().to(device, torch.long)
        key = engine._key(batch, "tokens", False, True)
        emb = batch.embeddings or (None, None)
        graphs = engine._step_graphs
        captured = graphs.graphs.get(key)
        if captured is None:  # not captured yet: run through the cache
            graphs(key, batch.shape, batch.packed, user, None, *emb)
            sync()
            engine.sessions.advance(batch.rows)
            return {}
        given = (batch.shape, batch.packed, user, None, *emb)
        t4 = time.perf_counter()
        for static, x in zip(captured.inputs, given, strict=True):
            if isinstance(static, torch.Tensor):
                static.copy_(x, non_blocking=True)
        t5 = time.perf_counter()
        sync()
        t6 = time.perf_counter()
        captured.graph.replay()
        t7 = time.perf_counter()
        sync()
        t8 = time.perf_counter()
        clone_outputs(captured.outputs)
        sync()
        t9 = time.perf_counter()
        engine.sessions.advance(batch.rows)
        t10 = time.perf_counter()
        ms = 1000.0
        t.update(
            inject=(ta - t0) * ms, prepare_ahead=(t1 - ta) * ms, prepare_host=(t2 - t1) * ms, prepare_sync=(t3 - t2) * ms,
            copies_host=(t5 - t4) * ms, copies_sync=(t6 - t5) * ms, launch_host=(t7 - t6) * ms,
            replay_rest=(t8 - t7) * ms, clone=(t9 - t8) * ms, advance=(t10 - t9) * ms, total=(t10 - t0) * ms,
        )  # fmt: skip
        return t

    def replay_only(key) -> tuple[float, float]:
        captured = engine._step_graphs.graphs[key]
        host, events = [], []
        for _ in range(10):  # each replay writes the ring: few, so the fill stays near the series' fill
            sync()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            captured.graph.replay()
            b.record()
            sync()
            host.append((time.perf_counter() - t0) * 1000.0)
            events.append(a.elapsed_time(b))
        return statistics.median(host), statistics.median(events)

    def series(name: str, span: ContextSpan | None) -> None:
        rows = [phases(span) for _ in range(args.reps + 5)][5:]
        rows = [r for r in rows if r]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{name:14s} " + "  ".join(f"{k} {v:6.3f}" for k, v in med.items()), flush=True)
        return med

    print("ms per call, medians (each phase followed by a device synchronisation)")
    series("plain", None)
    for n in args.spans:
        span = ContextSpan.from_ids(span_body(n, int(engine.lm.text_card), 0))
        series(f"span n={n}", span)
    for key in engine._step_graphs.graphs:
        if engine._step_graphs.graphs[key] is None:
            continue
        host, ev = replay_only(key)
        shape = key[1]
        print(
            f"replay alone: rows {shape.rows} columns {shape.columns:4d}: host wall {host:6.3f} ms, "
            f"CUDA events {ev:6.3f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
