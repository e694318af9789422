"""Where a batch-1 step's wall time goes: GPU busy time against host time, per kind of call.

Runs against whatever ``cspan`` is on the path (this tree, or an older one for a before/after comparison), on the
random 7B with freshly reset streams, as the bench's ``--fresh`` table does. For each kind of call (plain LM step,
whole frame, a span of n columns + the step) it prints the median wall time between two device synchronisations,
the GPU busy time of the same calls (the union of the kernels' intervals in a torch.profiler trace, so kernels that
overlap under PDL are not counted twice), the kernel count per call, and the host operations that took the most
time. Usage (on the device): ``python scripts/step_anatomy.py [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch


def _busy_ms(trace: dict, calls: int) -> tuple[float, float]:
    """(GPU busy ms per call, kernels per call) from a chrome trace."""
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in trace["traceEvents"]
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    busy, end, count = 0.0, -1.0, 0
    for a, b in spans:
        count += 1
        if a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy / 1000.0 / calls, count / calls


def _timeline(trace: dict, name: str) -> dict:
    """Per profiled call (a ``call`` range): the host lead before its first kernel, the GPU's idle gaps between its
    kernels, and each kernel's exclusive time (the part of its interval no earlier kernel covers, so a kernel
    launched early under PDL is charged only for what it adds). Prints the totals and the largest gaps."""
    events = trace["traceEvents"]
    calls = sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "call" and e.get("cat") == "user_annotation"
    )
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"][:70])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    exclusive: dict[str, float] = {}
    gaps: list[tuple[float, str, str]] = []
    lead = 0.0
    starts = [c0 for c0, _ in calls] + [float("inf")]
    for i, (c0, _) in enumerate(calls):  # a call's kernels start before the next call (a sync separates them)
        mine = [k for k in kernels if c0 <= k[0] < starts[i + 1]]
        if not mine:
            continue
        lead += mine[0][0] - c0
        end, prev = mine[0][0], "(call start)"
        for a, b, kname in mine:
            if a > end:
                gaps.append((a - end, prev, kname))
            exclusive[kname] = exclusive.get(kname, 0.0) + max(0.0, b - max(a, end))
            if b > end:
                end, prev = b, kname
    n = max(1, len(calls))
    print(
        f"-- {name}: timeline per call: host lead {lead / n:.1f} us, idle gaps {sum(g for g, _, _ in gaps) / n:.1f} us"
    )
    for g, a, b in sorted(gaps, reverse=True)[:12]:
        print(f"   gap {g:7.1f} us  after {a[:45]:45s} before {b[:45]}")
    print(f"-- {name}: exclusive time per call (us)")
    for k, us in sorted(exclusive.items(), key=lambda kv: -kv[1])[:30]:
        print(f"   {us / n:9.1f}  {k}")
    return {
        "lead_us": lead / n,
        "gaps_us": sum(g for g, _, _ in gaps) / n,
        "exclusive_us": {k: v / n for k, v in exclusive.items()},
    }


def anatomy(name: str, fn, sync, calls: int = 20, reps: int = 50) -> dict:
    for _ in range(5):
        fn()
    sync()
    wall = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        wall.append((time.perf_counter() - t0) * 1000.0)
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            with record_function("call"):
                fn()
            sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    busy, kernels = _busy_ms(trace, calls)
    timeline = _timeline(trace, name)
    per_name: dict[str, list[float]] = {}
    for e in trace["traceEvents"]:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            entry = per_name.setdefault(e["name"][:90], [0, 0.0])
            entry[0] += 1
            entry[1] += e["dur"]
    print(f"-- {name}: kernels per call (count, us)")
    for k, (c, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:45]:
        print(f"   {c / calls:7.1f} {us / calls:9.1f}  {k}")
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
    row = {"name": name, "wall_p50_ms": statistics.median(wall), "gpu_busy_ms": busy, "kernels": kernels, **timeline}
    print(
        f"== {name}: wall p50 {row['wall_p50_ms']:.3f} ms, GPU busy {busy:.3f} ms/call, "
        f"{kernels:.0f} kernels/call, host-only {row['wall_p50_ms'] - busy:.3f} ms"
    )
    print(host)
    if HOST_PROFILE:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            fn()
            sync()
        profiler.disable()
        print(f"-- {name}: host functions (cProfile over {calls} calls, by own time)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(22)
    return row


HOST_PROFILE = False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--spans", type=int, nargs="*", default=[16, 600])
    ap.add_argument("--host-profile", action="store_true", help="also profile the host functions (cProfile)")
    args = ap.parse_args()
    global HOST_PROFILE
    HOST_PROFILE = args.host_profile
    from cspan.bench.latency import _inputs, load_models, make_engine, span_body
    from cspan.core.span import ContextSpan

    device = torch.device("cuda")
    models = load_models(None, random_7b=True, device=device, dtype=torch.bfloat16)
    try:
        engine = make_engine(models, 1, span_lengths=args.spans)
    except TypeError:  # the bench of the engine before v2 (9236a36) took the device and dtype
        engine = make_engine(models, 1, device, torch.bfloat16, args.spans)
    inputs = _inputs(engine, 64, 0)
    sync = torch.cuda.synchronize
    engine.reset(0, seed=0)
    for _ in range(4):
        engine.step_tokens(inputs.next_codes())

    def lm_step():
        engine.step_tokens(inputs.next_codes())

    def frame():
        out = engine.step(inputs.next_pcm())
        out.text_token.cpu()
        out.agent_pcm.cpu()

    rows = [anatomy("plain step", lm_step, sync), anatomy("frame", frame, sync)]
    for n in args.spans:
        span = ContextSpan.from_ids(span_body(n, int(engine.lm.text_card), 0))

        def with_span(span=span):
            engine.inject_span(0, span)
            lm_step()

        rows.append(anatomy(f"span n={n} + step", with_span, sync, calls=10, reps=30))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
