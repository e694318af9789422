"""GPU performance probes for docs/PERFORMANCE.md (run on the device machine; see scripts/perf_h200.sh).

Subcommands:
  ceilings   device-to-device copy bandwidth and the bf16 matmul rate (random data), the two roofline numbers
  breakdown  the random 7B (PersonaPlex dimensions, bf16): CUDA-graph replay times of the temporal step, the
             depformer + sampling, the span prefill graphs (full ring), Mimi encode / decode, at B = 1 and 32;
             then a kernel profile of one eager step and one 600-position prefill
  profile    kernel profiles of the graphed depformer + sampling, temporal step, Mimi encode / decode, frame
  tune-conv  the fused streaming convolutions against cuDNN, per convolution of a Mimi frame
  tune       variants for choosing defaults (PDL, temporal GEMV configs, decode attention configs, span host time)
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


def _kernel_profile(title: str, fn, reps: int = 5) -> None:
    """Profile ``reps`` calls of ``fn`` (graph replays included: CUPTI reports the graph's kernels): kernel count,
    sum of kernel times, first-start-to-last-end span per call, and the kernels grouped by name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    if not kernels:
        print(f"{title}: no kernels reported")
        return
    busy = sum(e.device_time for e in kernels) / reps
    starts = [e.time_range.start for e in kernels]
    ends = [e.time_range.end for e in kernels]
    span = (max(ends) - min(starts)) / reps
    print(f"{title}: {len(kernels) / reps:.0f} kernels per call, kernel time {busy:.1f} us, "
          f"first start to last end {span:.1f} us per call (gaps {span - busy:.1f} us)")  # fmt: skip
    groups: dict[str, list[float]] = {}
    for e in kernels:
        groups.setdefault(e.name[:70], []).append(e.device_time)
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    for name, times in rows[:16]:
        print(
            f"  {sum(times) / reps:8.1f} us/call  {len(times) / reps:6.1f}x  mean {statistics.mean(times):6.2f} us  {name}"
        )


@torch.no_grad()
def profile_graphs() -> None:
    """Kernel profiles of the graphed pieces of a frame (B = 1): depformer + sampling (8 and 16 codebooks),
    temporal step, Mimi encode, Mimi decode, and the whole engine frame."""
    from cspan.bench.latency import random_lm, random_mimi
    from cspan.core.config import LMConfig, MimiConfig
    from cspan.core.sampling import SamplingParams, make_generator, sample_column

    lm = random_lm(LMConfig.personaplex_7b(), "cuda", torch.bfloat16)
    mimi = random_mimi(MimiConfig.mimi_24khz(), "cuda")
    K = lm.num_codebooks
    text, audio = SamplingParams.text(), SamplingParams.audio()
    hidden = torch.randn(1, lm.cfg.dim, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(1, lm.text_card, device="cuda", dtype=torch.bfloat16)
    target = torch.full((1, K), -2, dtype=torch.long, device="cuda")
    dep = lm.new_depformer_state(1)
    gens = [make_generator("cuda", 0)]
    for steps in (lm.dep_q, lm.dep_q // 2):
        replay = _graph(
            lambda steps=steps: sample_column(
                lm, hidden, logits, target, dep, text=text, audio=audio, generators=gens, depformer_steps=steps
            ),
            gens,
        )
        print(f"depformer + sampling, {steps} codebooks: {_events_ms(replay, 50):.3f} ms graph replay")
        _kernel_profile(f"depformer + sampling, {steps} codebooks (graph)", replay)
    state = lm.new_state(1)
    column = torch.randint(0, 2048, (1, K, 1), device="cuda")
    replay = _graph(lambda: lm.temporal(column, state))
    _kernel_profile("temporal step (graph)", replay)
    enc, dec = mimi.new_encoder_state(1), mimi.new_decoder_state(1)
    pcm = torch.randn(1, 1, 1920, device="cuda") * 1e-3
    codes = torch.randint(0, 2048, (1, 8, 1), device="cuda")
    _kernel_profile("mimi encode (graph)", _graph(lambda: mimi.encode_step(pcm, enc)))
    _kernel_profile("mimi decode (graph)", _graph(lambda: mimi.decode_step(codes, dec)))

    from cspan.core.engine import DuplexEngine

    engine = DuplexEngine(lm, mimi=mimi, batch_size=1, cuda_graphs=True, seed=0, predict_user=False)
    frame = torch.randn(1, 1920) * 1e-2  # host PCM, as the bench and the server pass it
    for _ in range(4):
        engine.step(frame)
    _kernel_profile("engine.step (frame graph + host)", lambda: engine.step(frame))


@torch.no_grad()
def tune_conv() -> None:
    """Every streaming convolution of one Mimi frame (encode + decode, random weights), B = 1 and 8: the fused
    kernel (:mod:`cspan.core.modules.fused_conv`) against cuDNN, 20 calls per graph replay."""
    import os

    from cspan.bench.latency import random_mimi
    from cspan.core.config import MimiConfig
    from cspan.core.modules.conv import StreamingConv1d, StreamingConvTranspose1d

    mimi = random_mimi(MimiConfig.mimi_24khz(), "cuda")
    calls: list = []

    def hook(module, args, kwargs):
        calls.append((module, args[0].shape, kwargs.get("activation"), kwargs.get("residual") is not None))

    handles = [
        m.register_forward_pre_hook(hook, with_kwargs=True)
        for m in mimi.modules()
        if isinstance(m, (StreamingConv1d, StreamingConvTranspose1d))
    ]
    enc, dec = mimi.new_encoder_state(1), mimi.new_decoder_state(1)
    mimi.encode_step(torch.randn(1, 1, 1920, device="cuda") * 1e-2, enc)
    mimi.decode_step(torch.randint(0, 2048, (1, 8, 1), device="cuda"), dec)
    for h in handles:
        h.remove()
    totals: dict[str, float] = {}
    for module, shape, act, has_res in calls:
        for B in (1, 8):
            x = torch.randn(B, *shape[1:], device="cuda") * 0.1
            res_shape = None
            times = {}
            for mode in ("cudnn", "fused"):
                os.environ["CSPAN_FUSED"] = "0" if mode == "cudnn" else "1"
                state = module.new_state(B)
                kwargs = {"activation": act} if act is not None else {}
                if has_res:
                    res_shape = module(x, state, **kwargs).shape
                    kwargs["residual"] = torch.randn(res_shape, device="cuda")

                def call(module=module, x=x, state=state, kwargs=kwargs):
                    for _ in range(20):
                        module(x, state, **kwargs)

                try:
                    times[mode] = _events_ms(_graph(call), 10) / 20 * 1000
                except Exception as exc:  # report, keep going
                    print(f"  {mode} failed: {type(exc).__name__}: {str(exc)[:160]}")
                    times[mode] = float("nan")
            os.environ.pop("CSPAN_FUSED", None)
            kind = type(module).__name__.replace("Streaming", "")
            w = module.conv.conv.weight if hasattr(module, "conv") else module.convtr.convtr.weight
            used = "fused" if module.fused_shape(B, shape[2]) else "cudnn"
            print(f"{kind:>16} w{list(w.shape)} x[{B}, {shape[1]}, {shape[2]}] act={act is not None} res={has_res}: "
                  f"cuDNN {times['cudnn']:7.2f} us, fused {times['fused']:7.2f} us -> {used}")  # fmt: skip
            totals[f"B={B} cudnn"] = totals.get(f"B={B} cudnn", 0.0) + times["cudnn"]
            totals[f"B={B} fused"] = totals.get(f"B={B} fused", 0.0) + times["fused"]
            totals[f"B={B} chosen"] = totals.get(f"B={B} chosen", 0.0) + times[used]
    for name, value in totals.items():
        print(f"sum over the frame's convolutions, {name}: {value:.1f} us")


@torch.no_grad()
def tune_prefill() -> None:
    """Prefill attention over a full 3000-position ring, 32 layers' rings per graph (like one prefill): tile
    configs x key splits, for T = 257 and 601 (a span of 256 / 600 with the next position)."""
    from cspan.core.modules import fused

    L, H, C, Dh = 32, 32, 3000, 128
    keys = torch.randn(L, 1, H, C, Dh, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    off = torch.full((1,), 3000, dtype=torch.long, device="cuda")
    for T in (601, 257):
        q, k, v = (torch.randn(1, H, T, Dh, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flop = 4 * T * (C + T / 2) * H * Dh
        results = []
        for cfg in (None, (64, 64, 4, 2), (128, 64, 8, 3), (32, 64, 4, 3)):
            for sp in (None, 1, 2, 3, 4, 6):
                try:

                    def layers(cfg=cfg, sp=sp, q=q, k=k, v=v):
                        for i in range(L):
                            fused.prefill_attention(q, k, v, keys[i], values[i], off, C, None, cfg, sp)

                    us = _events_ms(_graph(layers), 5) * 1000 / L
                    results.append((us, cfg, sp))
                except Exception as exc:
                    print(f"prefill T={T} config {cfg} splits {sp}: failed {type(exc).__name__}: {str(exc)[:100]}")
        results.sort(key=lambda r: r[0])
        auto = {cfg: us for us, cfg, sp in results if sp is None}
        print(f"prefill attention T={T}: default {auto.get(None, float('nan')):.1f} us per layer")
        for us, cfg, sp in results[:6]:
            print(f"  {us:.1f} us ({flop / us / 1e6:.0f} TFLOP/s) config {cfg} splits {sp}")


@torch.no_grad()
def tune() -> None:
    """Variants for choosing defaults: PDL on/off, the temporal step through cuBLAS or the fused GEMV (several
    tile configs), the depformer, decode attention configs over a full and a short ring, and where the host time
    of one graphed span injection goes."""
    import os

    from cspan.bench.latency import random_lm
    from cspan.core.config import LMConfig
    from cspan.core.engine import DuplexEngine
    from cspan.core.modules import fused
    from cspan.core.sampling import SamplingParams, make_generator, sample_column
    from cspan.core.span import span_block

    lm = random_lm(LMConfig.personaplex_7b(), "cuda", torch.bfloat16)
    K = lm.num_codebooks
    text, audio = SamplingParams.text(), SamplingParams.audio()
    column = torch.randint(0, 2048, (1, K, 1), device="cuda")
    hidden = torch.randn(1, lm.cfg.dim, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(1, lm.text_card, device="cuda", dtype=torch.bfloat16)
    target = torch.full((1, K), -2, dtype=torch.long, device="cuda")
    default_large = fused.GEMV_LARGE_CONFIG
    for pdl in ("1", "0"):
        os.environ["CSPAN_PDL"] = pdl
        for temporal_gemv, cfg in ((False, None), (True, (16384, 8)), (True, (8192, 4)), (True, (32768, 8)),
                                   (True, (16384, 4)), (True, (32768, 16))):  # fmt: skip
            if pdl == "0" and cfg not in (None, default_large):
                continue
            lm.transformer.gemv = temporal_gemv
            fused.GEMV_LARGE_CONFIG = cfg or default_large
            try:
                state = lm.new_state(1)
                replay = _graph(lambda state=state: lm.temporal(column, state))
                ms = _events_ms(replay, 30)
                print(f"temporal step pdl={pdl} gemv={temporal_gemv} config={cfg}: {ms:.3f} ms")
                del state, replay
            except Exception as exc:
                print(f"temporal step pdl={pdl} gemv={temporal_gemv} config={cfg}: failed {type(exc).__name__}: {exc}")
        lm.transformer.gemv = None
        fused.GEMV_LARGE_CONFIG = default_large
        dep = lm.new_depformer_state(1)
        gens = [make_generator("cuda", 0)]
        replay = _graph(
            lambda dep=dep, gens=gens: sample_column(
                lm, hidden, logits, target, dep, text=text, audio=audio, generators=gens
            ),
            gens,
        )
        print(f"depformer + sampling pdl={pdl}: {_events_ms(replay, 30):.3f} ms")
        torch.cuda.empty_cache()
    os.environ.pop("CSPAN_PDL", None)

    # decode attention, 32 layers' rings (like one step), full (3000) and short (200) caches
    state = lm.new_state(1)
    cache = state.transformer.cache
    cache.keys.normal_()
    cache.values.normal_()
    qkv = torch.randn(1, 1, 3 * lm.cfg.dim, device="cuda", dtype=torch.bfloat16)
    configs = [None, (64, 32, 4, 4), (64, 32, 4, 8), (128, 32, 4, 8), (64, 64, 8, 4), (32, 64, 8, 4), (128, 16, 4, 8),
               (64, 16, 4, 4), (128, 64, 8, 8)]  # fmt: skip
    totals: dict = {}
    for filled in (3000, 200):
        cache.offset.fill_(filled)
        for cfg in configs:
            try:

                def layers(cfg=cfg, c=cache):
                    for i in range(len(lm.transformer.layers)):
                        fused.decode_attention(qkv, c.keys[i], c.values[i], c.offset, 3000, None, None, cfg)

                us = _events_ms(_graph(layers), 20) * 1000 / len(lm.transformer.layers)
                totals[cfg] = totals.get(cfg, 0.0) + us
                print(f"decode attention ring={filled} config {cfg}: {us:.1f} us per layer")
            except Exception as exc:
                print(f"decode attention ring={filled} config {cfg}: failed {type(exc).__name__}: {str(exc)[:120]}")
    best = min(totals, key=lambda c: totals[c])
    print(f"decode attention best (sum over both rings): {best}, {totals[best]:.1f} us")
    del state, cache
    torch.cuda.empty_cache()

    # Mimi streaming frame under graphs, attention kernels on (default) and off (eager attention), B = 1
    from cspan.bench.latency import random_mimi
    from cspan.core.config import MimiConfig

    mimi = random_mimi(MimiConfig.mimi_24khz(), "cuda")
    pcm = torch.randn(1, 1, 1920, device="cuda") * 1e-3
    codes = torch.randint(0, 2048, (1, 8, 1), device="cuda")
    for on in (True, False):
        for tr in (mimi.encoder_transformer, mimi.decoder_transformer):
            tr.transformer.fused = on
        enc, dec = mimi.new_encoder_state(1), mimi.new_decoder_state(1)
        t_enc = _events_ms(_graph(lambda enc=enc: mimi.encode_step(pcm, enc)), 30)
        t_dec = _events_ms(_graph(lambda dec=dec: mimi.decode_step(codes, dec)), 30)
        print(f"mimi fused attention {on}: encode {t_enc:.3f} ms, decode {t_dec:.3f} ms (graph replays, B=1)")
    for tr in (mimi.encoder_transformer, mimi.decoder_transformer):
        tr.transformer.fused = True

    # host time of one graphed span injection (n = 16), piece by piece, after the graphs exist
    engine = DuplexEngine(lm, batch_size=1, cuda_graphs=True, seed=0)
    user = torch.randint(0, 2048, (1, 8), device="cuda")
    for _ in range(3):
        engine.step_tokens(user)
    block = span_block(list(range(100, 116)), device="cuda")
    span = _span(block)
    for _ in range(3):
        engine.inject_span(0, span)
        engine.step_tokens(user)
    inj = engine.injector
    parts: dict[str, list[float]] = {}

    def timed(name, fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        parts.setdefault(name, []).append((time.perf_counter() - t0) * 1000)
        return out

    for _ in range(20):
        blk, _ids, _ = timed("block_for", lambda: inj.block_for(span, engine.grid.num_rows))
        blk_d = timed("block to device", lambda blk=blk: blk.to("cuda"))
        timed("rows tensor", lambda: torch.tensor([0], dtype=torch.long, device="cuda"))
        timed("graphs.run", lambda blk_d=blk_d: inj.graphs.run(engine.lm_state, blk_d, 0))
        timed("grid.splice", lambda blk_d=blk_d: engine.grid.splice(0, blk_d))
        timed("inject_span (all)", lambda: engine.inject_span(0, span))
        timed("step after", lambda: engine.step_tokens(user))
    for name, values in parts.items():
        print(f"inject n=16 {name}: median {statistics.median(values):.3f} ms")


def _span(block: torch.Tensor):
    from cspan.core.span import ContextSpan

    return ContextSpan.from_ids(block[0].tolist(), markers=False)


def bench(argv: list[str]) -> int:
    from cspan.bench.commands import bench_command
    from cspan.core import cli
    from cspan.core.cli import main

    cli.discover_commands = lambda: {"bench": bench_command}
    return main(["bench", *argv])


SUBCOMMANDS = {
    "ceilings": ceilings,
    "breakdown": breakdown,
    "profile": profile_graphs,
    "tune-conv": tune_conv,
    "tune": tune,
    "tune-prefill": tune_prefill,
}

if __name__ == "__main__":
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "bench":
        sys.exit(bench(rest))
    if cmd not in SUBCOMMANDS:
        sys.exit(f"unknown subcommand {cmd!r}: {', '.join(SUBCOMMANDS)}, bench")
    SUBCOMMANDS[cmd]()
