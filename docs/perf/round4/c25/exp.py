"""Where the batch-1 span step's non-GPU time goes (device experiment, not part of the product)."""

import statistics
import time

import torch

from cspan.bench.latency import _inputs, load_models, make_engine, span_body
from cspan.core import graphs as G
from cspan.core.span import ContextSpan

dev = torch.device("cuda")
models = load_models(None, random_7b=True, device=dev, dtype=torch.bfloat16)
sync = torch.cuda.synchronize


def p50(x):
    return round(statistics.median(x), 3)


def run(tag):
    eng = make_engine(models, 1, span_lengths=[16, 64])
    inputs = _inputs(eng, 64, 0)
    eng.reset(0, seed=0)
    phases = {}
    prep = eng._prepare

    def tprep():
        t = time.perf_counter()
        r = prep()
        phases.setdefault("prepare", []).append((time.perf_counter() - t) * 1e3)
        return r

    eng._prepare = tprep
    gc = eng._step_graphs

    class Wrap:
        def __init__(s, inner):
            s.inner = inner

        def __getattr__(s, k):
            return getattr(s.inner, k)

        def __call__(s, *a):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            e0.record()
            r = s.inner(*a)
            e1.record()
            phases.setdefault("graph_call_host", []).append((time.perf_counter() - t) * 1e3)
            phases.setdefault("_ev", []).append((e0, e1))
            return r

    eng._step_graphs = Wrap(gc)

    def step():
        return eng.step_tokens(inputs.next_codes())

    for _ in range(8):
        step()
    sync()

    def series(name, fn, reps=40, gap=0):
        phases.clear()
        wall = []
        for _ in range(6):
            for _ in range(gap):
                step()
            sync()
            fn()
            sync()
        phases.clear()
        for _ in range(reps):
            for _ in range(gap):
                step()
            sync()
            phases.clear() if False else None
            t = time.perf_counter()
            fn()
            sync()
            wall.append((time.perf_counter() - t) * 1e3)
        n = reps
        pr = phases.get("prepare", [])[-1 :: -(gap + 1)][:n]
        gh = phases.get("graph_call_host", [])[-1 :: -(gap + 1)][:n]
        ev = [a.elapsed_time(b) for a, b in phases.get("_ev", [])[-1 :: -(gap + 1)][:n]]
        print(
            f"{tag:10s} {name:18s} wall p50 {p50(wall):7.3f}  prepare {p50(pr):6.3f}  graph call host {p50(gh):6.3f}  graph GPU(ev) {p50(ev):7.3f}",
            flush=True,
        )

    series("plain", step)
    for n in (16, 64):
        span = ContextSpan.from_ids(span_body(n, int(eng.lm.text_card), 0))

        def sp(span=span):
            eng.inject_span(0, span)
            step()

        for gap in (0, 2):
            series(f"n={n} gap={gap}", sp, gap=gap)
    eng = None  # drop it before the next engine
    torch.cuda.empty_cache()


run("shared")
orig = G.GraphCache._capture


def own_pool(self, inputs):
    self._pool = None
    return orig(self, inputs)


G.GraphCache._capture = own_pool
run("own-pool")
