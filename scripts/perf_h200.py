"""GPU performance probes for docs/PERFORMANCE.md (run on the device machine; see scripts/perf_h200.sh).

Subcommands:
  ceilings   device-to-device copy bandwidth and the bf16 matmul rate (random data), the two roofline numbers
  breakdown  the random 7B (PersonaPlex dimensions, bf16): CUDA-graph replay times of the temporal step, the
             depformer + sampling, the span prefill graphs (full ring), Mimi encode / decode, at B = 1 and 32;
             then a kernel profile of one eager step and one 600-position prefill
  bench      ``cspan bench ...`` without installed entry points (arguments follow)

Timing: CUDA events around back-to-back graph replays after warm-up; the median of 5 runs of N replays.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def _events_ms(fn, reps: int, runs: int = 5) -> float:
    """Median over ``runs`` of the mean ms of ``reps`` back-to-back calls of ``fn``, timed with CUDA events."""
    out = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / reps)
    return statistics.median(out)


def _graph(fn, generators=()):
    """Warm ``fn`` up on a side stream, capture it, return the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for gen in generators:
        graph.register_generator_state(gen)
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def ceilings() -> None:
    n = 1 << 30  # 1 GiB of bf16 per buffer: far past the 60 MB L2
    a = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = _events_ms(lambda: b.copy_(a), 20)
    print(f"ceiling copy: {2 * n / ms / 1e9:.2f} TB/s (read + write of {n / 2**30:.0f} GiB in {ms:.3f} ms)")
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = _events_ms(lambda: x @ y, 10)
    print(f"ceiling bf16 matmul: {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s (8192^3 in {ms:.3f} ms, random data)")


@torch.no_grad()
def breakdown() -> None:
    from cspan.bench.latency import random_lm, random_mimi
    from cspan.core.config import LMConfig, MimiConfig
    from cspan.core.sampling import SamplingParams, make_generator, sample_column
    from cspan.core.span import PrefillGraphs, span_block

    t0 = time.perf_counter()
    lm = random_lm(LMConfig.personaplex_7b(), "cuda", torch.bfloat16)
    mimi = random_mimi(MimiConfig.mimi_24khz(), "cuda")
    nbytes = sum(p.numel() * p.element_size() for p in lm.parameters())
    temporal_bytes = sum(p.numel() * p.element_size() for p in lm.transformer.parameters())
    print(
        f"model: {nbytes / 1e9:.2f} GB of weights ({temporal_bytes / 1e9:.2f} GB temporal), {time.perf_counter() - t0:.1f} s"
    )
    K = lm.num_codebooks
    text, audio = SamplingParams.text(), SamplingParams.audio()
    for B in (1, 32):
        state = lm.new_state(B)
        column = torch.randint(0, 2048, (B, K, 1), device="cuda")
        replay = _graph(lambda: lm.temporal(column, state))  # noqa: B023 (used in this iteration)
        t_temporal = _events_ms(replay, 50)
        hidden = torch.randn(B, lm.cfg.dim, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(B, lm.text_card, device="cuda", dtype=torch.bfloat16)
        target = torch.full((B, K), -2, dtype=torch.long, device="cuda")
        dep = lm.new_depformer_state(B)
        gens = [make_generator("cuda", i) for i in range(B)]
        replay = _graph(
            lambda: sample_column(lm, hidden, logits, target, dep, text=text, audio=audio, generators=gens),  # noqa: B023
            gens,
        )
        t_dep = _events_ms(replay, 50)
        print(f"B={B}: temporal step {t_temporal:.3f} ms, depformer + sampling {t_dep:.3f} ms (graph replays)")
        del state
    torch.cuda.empty_cache()

    # span prefill graphs on a full ring (3000 positions of random keys): the bench's steady state
    state = lm.new_state(1)
    cache = state.transformer.cache
    cache.keys.normal_()
    cache.values.normal_()
    cache.offset.fill_(3000)
    graphs = PrefillGraphs(lm, 600)
    for n in (16, 64, 256, 600):
        block = span_block(list(range(100, 100 + n)), device="cuda")
        graphs.run(state, block, 0)
        ms = _events_ms(lambda block=block: graphs.run(state, block, 0), 10)
        flop = 2 * temporal_bytes / 2 * n
        print(f"prefill n={n}: {ms:.3f} ms graph replay (bucket {next(s for s in graphs.buckets if s >= n)}), "
              f"{flop / ms / 1e9:.0f} TFLOP/s on the weights")  # fmt: skip

    # prefill attention alone, full ring, T = 600 and 16: block-size sweep (block_m, block_n, warps, stages)
    from cspan.core.modules import fused

    H, Dh = lm.cfg.num_heads, lm.cfg.dim // lm.cfg.num_heads
    for T in (600, 16):
        q, k, v = (torch.randn(1, H, T, Dh, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        off = torch.full((1,), 3000, dtype=torch.long, device="cuda")
        flop = 4 * T * (3000 + T / 2) * H * Dh
        configs = [
            None,
            (64, 64, 4, 3),
            (128, 64, 8, 3),
            (128, 64, 8, 2),
            (64, 128, 8, 2),
            (128, 128, 8, 2),
            (64, 32, 4, 3),
        ]
        for cfg in configs if T > 16 else [None, (16, 64, 4, 3), (16, 128, 4, 2), (16, 32, 4, 2)]:
            try:
                args = (q, k, v, cache.keys[0], cache.values[0], off, 3000)
                ms = _events_ms(lambda args=args, cfg=cfg: fused.prefill_attention(*args, config=cfg), 20)
                print(f"prefill attention T={T} config {cfg}: {ms * 1000:.1f} us, {flop / ms / 1e9:.0f} TFLOP/s")
            except Exception as exc:  # a config that does not compile (shared memory) is reported, not fatal
                print(f"prefill attention T={T} config {cfg}: failed {type(exc).__name__}: {str(exc)[:120]}")

    # one depformer-sized product, fused GEMV kernel vs cuBLAS, 20 calls per graph replay (B = 1)
    import torch.nn.functional as F

    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    alpha = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    for n, kdim, gate in ((3072, 1024, False), (1024, 1024, False), (5632, 1024, True), (1024, 2816, False)):
        w = torch.randn(n, kdim, device="cuda", dtype=torch.bfloat16) / 32
        xk = x if kdim == 1024 else torch.randn(1, kdim, device="cuda", dtype=torch.bfloat16)

        def ours(w=w, xk=xk, gate=gate):
            for _ in range(20):
                fused.gemv(xk, w, norm=(alpha, 1e-8) if gate else None, gate=gate)

        def cublas(w=w, xk=xk):
            for _ in range(20):
                F.linear(xk, w)

        t_ours, t_cublas = (_events_ms(_graph(f), 20) / 20 * 1000 for f in (ours, cublas))
        print(f"gemv {n}x{kdim}{' +norm+gate' if gate else ''}: fused {t_ours:.2f} us, cuBLAS linear {t_cublas:.2f} us, "
              f"{n * kdim * 2 / t_ours / 1e6:.2f} TB/s")  # fmt: skip

    # depformer with and without the fused GEMV layers (B = 1)
    hidden = torch.randn(1, lm.cfg.dim, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(1, lm.text_card, device="cuda", dtype=torch.bfloat16)
    target = torch.full((1, K), -2, dtype=torch.long, device="cuda")
    dep = lm.new_depformer_state(1)
    gens = [make_generator("cuda", 0)]
    for gemv in (True, False):
        lm.depformer.gemv = gemv
        replay = _graph(
            lambda: sample_column(lm, hidden, logits, target, dep, text=text, audio=audio, generators=gens), gens
        )
        print(f"depformer + sampling B=1, gemv={gemv}: {_events_ms(replay, 50):.3f} ms")
    lm.depformer.gemv = None

    # Mimi streaming under graphs, B = 1
    enc, dec = mimi.new_encoder_state(1), mimi.new_decoder_state(1)
    pcm = torch.randn(1, 1, 1920, device="cuda") * 1e-3
    codes = torch.randint(0, 2048, (1, 8, 1), device="cuda")
    print(f"mimi encode {_events_ms(_graph(lambda: mimi.encode_step(pcm, enc)), 50):.3f} ms, "
          f"decode {_events_ms(_graph(lambda: mimi.decode_step(codes, dec)), 50):.3f} ms (graph replays, B=1)")  # fmt: skip

    # kernel profile: one eager step, one eager 600-position prefill
    from torch.profiler import ProfilerActivity, profile

    from cspan.core.engine import DuplexEngine

    engine = DuplexEngine(lm, batch_size=1, cuda_graphs=False, seed=0)
    user = torch.randint(0, 2048, (1, 8), device="cuda")
    for _ in range(3):
        engine.step_tokens(user)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step_tokens(user)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time for e in kernels) / 1000
    print(f"eager step: {len(kernels)} GPU kernels/copies, {busy:.3f} ms GPU busy (sum of kernel times)")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=14, max_name_column_width=60))
    for n in (600, 16):
        block = span_block(list(range(100, 100 + n)), device="cuda")
        engine.inject_span(0, _span(block))  # warm-up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.inject_span(0, _span(block))
            torch.cuda.synchronize()
        print(f"eager prefill n={n}:")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=10, max_name_column_width=60))


def _span(block: torch.Tensor):
    from cspan.core.span import ContextSpan

    return ContextSpan.from_ids(block[0].tolist(), markers=False)


def bench(argv: list[str]) -> int:
    from cspan.bench.commands import bench_command
    from cspan.core import cli
    from cspan.core.cli import main

    cli.discover_commands = lambda: {"bench": bench_command}
    return main(["bench", *argv])


if __name__ == "__main__":
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "ceilings":
        ceilings()
    elif cmd == "breakdown":
        breakdown()
    elif cmd == "bench":
        sys.exit(bench(rest))
    else:
        sys.exit(f"unknown subcommand {cmd!r}: ceilings, breakdown, bench")
