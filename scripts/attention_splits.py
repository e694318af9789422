"""Key splits of the split attention kernels: us per layer by split count and ring fill (device only).

A batch-1 step that reads a 16-column span (17 new tokens: the block and the next position) on a freshly reset
stream ran 0.3–0.9 ms slower than the engine before v2 (C43, C46), much of it in the prefill attention and its
combine: :func:`cspan.core.modules.fused.prefill_attention` sizes its key splits from the ring's capacity (a CUDA
graph cannot key on the fill), 16 for a 17-token block, so on a short ring 15 of 16 splits find no key. This times
the kernel and its combine (CUDA graph of ``LAYERS`` layers, CUDA events) for blocks of 17 / 65 / 257 tokens at
ring fills from fresh to full, for each split count, then the whole batch-1 span step on fresh streams and on a
full ring for each ``PREFILL_WAVES``. ``--decode`` times the decode kernel instead (one new position per row over
its ring, B = 1 / 4 / 8, the same fills, each most-splits bound; the graphs of a step size their splits for a full
ring the same way). Usage (on the device): ``python scripts/attention_splits.py [--kernels-only | --decode]``.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from perf_h200 import HEAD_DIM, HEADS, RING, _events_ms, _graph

LAYERS = 8


def kernel_table() -> None:
    from cspan.core.modules import fused

    dev = torch.device("cuda")
    keys = [torch.randn(1, HEADS, RING, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    values = [torch.randn_like(k) for k in keys]
    row0 = torch.zeros(1, dtype=torch.long, device=dev)
    print("prefill attention + combine, us per layer (B = 1, one block of n tokens)")
    for n in (17, 65, 257):
        q, k, v = (torch.randn(n, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(3))
        for fill in (16, 200, 1000, RING):
            ragged = fused.Ragged.uniform(row0, n, RING).at(torch.full((1,), fill, device=dev))
            row = []
            for splits in (None, 1, 2, 4, 8, 16):

                def run(splits=splits, ragged=ragged, q=q, k=k, v=v):
                    for kk, vv in zip(keys, values, strict=True):
                        fused.prefill_attention(q, k, v, kk, vv, ragged, RING, splits=splits)

                us = _events_ms(_graph(run), 20) * 1000 / LAYERS
                row.append(f"{'default' if splits is None else splits}: {us:6.1f}")
            print(f"  n = {n:3d} fill {fill:4d}:  " + "  ".join(row), flush=True)


def decode_table() -> None:
    from cspan.core.modules import fused

    dev = torch.device("cuda")
    print("decode attention (+ combine), us per layer, by the most key splits allowed (default: DECODE_CONFIGS)")
    for b in (1, 4, 8):
        keys = [torch.randn(b, HEADS, RING, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
        values = [torch.randn_like(k) for k in keys]
        qkv = torch.randn(b, 3 * HEADS * HEAD_DIM, device=dev, dtype=torch.bfloat16)
        rows = torch.arange(b, device=dev)
        base = fused.decode_config(b)
        for fill in (16, 200, 1000, RING + 5):
            positions = torch.full((b,), fill, dtype=torch.long, device=dev)
            row = []
            for most in (None, 1, 2, 4, 8, 16, 64):
                config = None if most is None else (base[0], most, max(base[2], 8), *base[3:])

                def run(config=config, positions=positions, keys=keys, values=values, qkv=qkv, rows=rows):
                    for kk, vv in zip(keys, values, strict=True):
                        fused.decode_attention(qkv, kk, vv, positions, rows, RING, config=config)

                us = _events_ms(_graph(run), 20) * 1000 / LAYERS
                row.append(f"{'default' if most is None else most}: {us:6.1f}")
            print(f"  B = {b:2d} fill {min(fill, RING):4d}:  " + "  ".join(row), flush=True)
        del keys, values


def step_table() -> None:
    from cspan.bench.latency import LatencyBench, LatencyOptions, load_models, make_engine, release_device_memory
    from cspan.core.modules import fused

    dev = torch.device("cuda")
    models = load_models(None, random_7b=True, device=dev, dtype=torch.bfloat16)
    print("batch-1 span n + step, mean ms (fresh: freshly reset streams; full: a full ring)")
    kept = fused.PREFILL_WAVES
    for waves in (4, 2, 1):
        fused.PREFILL_WAVES = waves
        out = []
        for fill, lengths in ((0, (16, 64, 600)), (None, (16, 600))):
            engine = make_engine(models, 1, span_lengths=lengths)
            bench = LatencyBench(engine, LatencyOptions(span_lengths=lengths, iters=30, warmup=3, fill=fill))
            for n in lengths:
                bench.restart()
                s = bench.span_series(n)
                out.append(f"{'fresh' if fill == 0 else 'full'} n={n} {sum(s.total) / len(s.total):6.3f}")
            bench.restart()
            plain = bench.series(bench.lm_step)
            out.append(f"{'fresh' if fill == 0 else 'full'} plain {sorted(plain)[len(plain) // 2]:6.3f}")
            del bench, engine
            release_device_memory(dev)
        print(f"  PREFILL_WAVES {waves}: " + "  ".join(out), flush=True)
    fused.PREFILL_WAVES = kept


if __name__ == "__main__":
    if "--decode" in sys.argv:
        decode_table()
    else:
        kernel_table()
        if "--kernels-only" not in sys.argv:
            step_table()
