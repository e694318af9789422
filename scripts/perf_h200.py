"""GPU performance probes for docs/PERFORMANCE.md (run on the device machine; see scripts/perf_h200.sh).

Subcommands:
  ceilings   device-to-device copy bandwidth and the bf16 matmul rate (random data), the two roofline numbers
  attention  decode attention over a full 3000-position ring at B = 1..128 and a 600-position ragged prefill over
             it: the project's Triton kernels (every candidate config of fused.DECODE_CONFIGS) side by side with
             FlashInfer (when importable: carried wheels) and PyTorch SDPA, with the bytes floor; prints the
             fastest per shape and the DECODE_CONFIGS table to paste
  profile    kernel profiles of the engine's graphed step on a full ring (B = 1 and 64: a plain step, and a step
             reading a 600-column span in one session)
  tune-conv  the fused streaming convolutions against cuDNN, per convolution of a Mimi frame
  pinned     the served step on a full ring with every session's persona pinned past the window (200-frame
             persona prefixes, issue 18's default policy) against the same step with policy none, B = 1 and 32
  tune-prefill  the ragged prefill attention of a 600- and a 256-position span over a full ring: every
             (block_m, block_n, warps, stages) x key splits; and the block's RoPE split and KV write
  overlap    a 601-token block's attention beside B = 64 rows' decode attention on two streams, against one after
             the other, for several configs of both kernels (and FlashInfer's decode)
  trace      FILE: a span step's Chrome trace (``profile`` with PROFILE_TRACE) read per layer, no GPU needed
  bench      ``cspan bench ...`` without installed entry points (arguments follow)
  summary    DIR: the compact summary of a perf_h200.sh run's logs and JSON

Timing: CUDA events around back-to-back graph replays after warm-up; the median of 5 runs of N replays.
"""

from __future__ import annotations

import os
import statistics
import sys

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


RING = 3000
HEADS, HEAD_DIM = 32, 128
LAYERS = 8  # rings per timed graph: far more than the 60 MB L2 at every batch size


def _flashinfer():
    try:
        import flashinfer
    except Exception as exc:  # not carried, or its JIT cannot build: reported, the rest goes on
        print(f"flashinfer: not available ({type(exc).__name__}: {str(exc)[:200]})")
        return None
    print(f"flashinfer {flashinfer.__version__}")
    return flashinfer


@torch.no_grad()
def attention() -> None:
    """Decode over a full ring per batch size, and a 600-token ragged prefill over a full ring (B = 1, and 1 of 64
    sessions), per layer in microseconds (LAYERS layers' rings per timed graph). ATTN_B (optional): the batch sizes
    (default 1 4 8 16 24 32 48 64 80 128); ATTN_PREFILL=0 skips the prefill comparison; ATTN_FORMS (optional, default
    "1 2"): the loop forms swept (the last field of a config; DECODE_CONFIGS' own entries are always timed)."""
    from cspan.core.modules import fused

    fi = _flashinfer()
    forms = os.environ.get("ATTN_FORMS", "1 2").split()
    candidates = sorted(
        {
            *((bn, splits, waves, warps, stages, 1)
              for bn in (32, 64)
              for (splits, waves) in ((64, 8), (16, 2))
              for warps in (4, 8)
              for stages in (2, 3, 4)
              if "1" in forms),
            *((bn, splits, waves, warps, stages, 2)  # the tensor-core form (16 / 8 splits at 8 waves: a wave of
              for bn in (32, 64, 128)                  # 4 programs an SM at one row, docs/perf/round4/ptx)
              for (splits, waves) in ((64, 8), (16, 8), (8, 8), (16, 2))
              for warps in (1, 2, 4)
              for stages in (2, 3)
              if "2" in forms),
            *(cfg for _, cfg in fused.DECODE_CONFIGS),
        }
    )  # fmt: skip
    best_table = []
    print(f"decode over a full ring of {RING} positions, {HEADS} heads x {HEAD_DIM}, bf16, us per layer:")
    sizes = [int(b) for b in os.environ.get("ATTN_B", "1 4 8 16 24 32 48 64 80 128").split()]
    for B in sizes:
        best_table.append((B, _decode_at(B, candidates, fi)))
        torch.cuda.empty_cache()
    print("DECODE_CONFIGS = (" + ", ".join(f"({b}, {cfg})" for b, cfg in best_table) + ")")

    if os.environ.get("ATTN_PREFILL") == "0":
        return
    print(f"ragged prefill of 600 positions over a full ring of {RING}, us per layer:")
    for B in (1, 64):
        _prefill_side_by_side(fi, B)


def attention_fp8() -> None:
    """Decode over full FP8 rings (e4m3, one scale per position and head, as the engine's FP8 cache) per batch size,
    every candidate config of the engine's Triton kernel, us per layer against the FP8 bytes floor."""
    from cspan.core.modules import fused

    candidates = sorted(
        {
            *((bn, splits, waves, warps, stages, lanes)
              for bn in (32, 64)
              for (splits, waves) in ((64, 8), (16, 2))
              for warps in (4, 8)
              for stages in (2, 3, 4)
              for lanes in (0, 1)),
            *(cfg for _, cfg in fused.DECODE_CONFIGS_FP8),
        }
    )  # fmt: skip
    print(f"FP8 decode over a full ring of {RING} positions, {HEADS} heads x {HEAD_DIM}, us per layer:")
    for B in (64, 96, 128):
        best = _fp8_decode_at(B, candidates)
        if B == 128 and os.environ.get("FP8_BEST"):  # the best config at 128 rows, for CSPAN_DECODE_CONFIG
            with open(os.environ["FP8_BEST"], "w") as f:
                f.write(",".join(str(x) for x in best))
        torch.cuda.empty_cache()


def _fp8_decode_at(B: int, candidates: list) -> tuple:
    """One batch size of :func:`attention_fp8`: prints the line, returns the best config."""
    from cspan.core.modules import fused
    from cspan.core.modules.rope import rope_tables

    dev = torch.device("cuda")
    keys = [torch.randn(B, HEADS, RING, HEAD_DIM, device=dev).to(torch.float8_e4m3fn) for _ in range(LAYERS)]
    values = [torch.randn(B, HEADS, RING, HEAD_DIM, device=dev).to(torch.float8_e4m3fn) for _ in range(LAYERS)]
    scales = [(torch.rand(B, HEADS, RING, device=dev) + 0.5, torch.rand(B, HEADS, RING, device=dev) + 0.5)
              for _ in range(LAYERS)]  # fmt: skip
    qkv = torch.randn(B, 3 * HEADS * HEAD_DIM, device=dev, dtype=torch.bfloat16)
    rows = torch.arange(B, device=dev)
    positions = torch.full((B,), 10 * RING + 7, dtype=torch.long, device=dev)
    rope = rope_tables(positions, HEAD_DIM, 10_000.0)
    floor = B * RING * HEADS * (HEAD_DIM + 4) * 2 / 4.25e12 * 1e6
    results = {}
    for cfg in candidates:

        def run(cfg=cfg):
            for k, v, sc in zip(keys, values, scales, strict=True):
                fused.decode_attention(qkv, k, v, positions, rows, RING, rope, sc, config=cfg)

        try:
            results[cfg] = _events_ms(_graph(run), 10) * 1000 / LAYERS
        except Exception as exc:
            print(f"  B={B} {cfg}: failed {type(exc).__name__}: {str(exc)[:120]}")
    ranked = sorted(results, key=results.get)
    default = fused.decode_config(B, fp8=True)
    print(
        f"B={B:4d}: floor {floor:7.1f}  default {default} {results.get(default, float('nan')):7.1f}  best "
        + "  ".join(f"{cfg} {results[cfg]:7.1f}" for cfg in ranked[:4]),
        flush=True,
    )
    return ranked[0]


def _decode_at(B: int, candidates: list, fi) -> tuple:
    """One batch size: every candidate config, SDPA and FlashInfer; prints the line, returns the best config."""
    from cspan.core.modules import fused
    from cspan.core.modules.rope import rope_tables

    dev = torch.device("cuda")
    keys = [torch.randn(B, HEADS, RING, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    values = [torch.randn_like(k) for k in keys]
    qkv = torch.randn(B, 3 * HEADS * HEAD_DIM, device=dev, dtype=torch.bfloat16)
    rows = torch.arange(B, device=dev)
    positions = torch.full((B,), 10 * RING + 7, dtype=torch.long, device=dev)  # a wrapped, full ring
    rope = rope_tables(positions, HEAD_DIM, 10_000.0)
    floor = B * RING * HEADS * HEAD_DIM * 2 * 2 / 4.25e12 * 1e6
    results = {}
    for cfg in candidates:

        def run(cfg=cfg):
            for k, v in zip(keys, values, strict=True):
                fused.decode_attention(qkv, k, v, positions, rows, RING, rope, config=cfg)

        try:
            results[cfg] = _events_ms(_graph(run), 10) * 1000 / LAYERS
        except Exception as exc:
            print(f"  B={B} {cfg}: failed {type(exc).__name__}: {str(exc)[:120]}")
    best = min(results, key=results.get)
    default = fused.decode_config(B)
    line = (
        f"B={B:4d}: floor {floor:7.1f}  ours default {default} {results.get(default, float('nan')):7.1f}  "
        f"ours best {best} {results[best]:7.1f}"
    )
    q = fused.rope_split(qkv, HEADS, rope)[0]  # [B, H, Dh], rotated
    ref = fused.decode_attention(qkv, keys[0], values[0], positions, rows, RING, rope).view(B, HEADS, HEAD_DIM)
    for form in (1, 2):  # the fastest configs of each loop form, and the best one's largest difference from default
        ranked = sorted((c for c in results if c[5] == form), key=results.get)[:3]
        if ranked:
            got = fused.decode_attention(qkv, keys[0], values[0], positions, rows, RING, rope, config=ranked[0])
            err = (got.view_as(ref).float() - ref.float()).abs().max().item()
            print(f"  B={B} form {form}: " + "  ".join(f"{c} {results[c]:6.1f}" for c in ranked)
                  + f"  (max |diff| from default {err:.2e})", flush=True)  # fmt: skip

    def run_sdpa():
        for k, v in zip(keys, values, strict=True):
            torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v)

    line += f"  sdpa {_events_ms(_graph(run_sdpa), 10) * 1000 / LAYERS:7.1f}"
    if fi is not None:  # the engine's use (cspan.core.attention): the rings as HND pages, one per row, zero copy
        try:
            us, err = _flashinfer_decode(fi, B, q, keys, values, ref)
            line += f"  flashinfer(HND, page = ring) {us:7.1f} (max |diff| {err:.2e})"
        except Exception as exc:
            line += f"  flashinfer failed: {type(exc).__name__}: {str(exc)[:160]}"
    print(line, flush=True)
    return best


def _flashinfer_decode_wrapper(fi, B: int, dev: torch.device):
    """FlashInfer's paged decode planned for B full rings: [B, H, C, Dh] per layer = HND pages of C slots, one per
    row (as cspan.core.attention runs it)."""
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND")
    wrapper.plan(
        torch.arange(B + 1, dtype=torch.int32), torch.arange(B, dtype=torch.int32),
        torch.full((B,), RING, dtype=torch.int32), HEADS, HEADS, HEAD_DIM, RING, q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
    )  # fmt: skip
    return wrapper


def _flashinfer_decode(fi, B: int, q, keys, values, ref) -> tuple[float, float]:
    """FlashInfer's paged decode over the same rings: [B, H, C, Dh] per layer = HND pages of C slots, one per row
    (as cspan.core.attention runs it); its output checked against ours on layer 0."""
    wrapper = _flashinfer_decode_wrapper(fi, B, q.device)
    out = wrapper.run(q, (keys[0], values[0]))
    err = (out.float().reshape(ref.shape) - ref.float()).abs().max().item()

    def run():
        for kv in zip(keys, values, strict=True):
            wrapper.run(q, kv)

    for _ in range(3):
        run()
    return _events_ms(run, 10) * 1000 / LAYERS, err


def _prefill_side_by_side(fi, B: int) -> None:
    from cspan.core.modules import fused

    dev = torch.device("cuda")
    n = 600
    keys = [torch.randn(B, HEADS, RING, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    values = [torch.randn_like(k) for k in keys]
    q, k, v = (torch.randn(n, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(3))
    offset = torch.full((B,), 10 * RING, dtype=torch.long, device=dev)
    ragged = _one_span(n, fused.block_m_for(n), offset)
    # the ring's positions + the block's, as the engine's step reads them
    flops = 4 * n * (RING + n / 2) * HEADS * HEAD_DIM

    def run():
        for kk, vv in zip(keys, values, strict=True):
            fused.prefill_attention(q, k, v, kk, vv, ragged, RING)

    us = _events_ms(_graph(run), 10) * 1000 / len(keys)
    line = f"B={B:3d} (span in 1 session): ours {us:7.1f} ({flops / us / 1e6:.0f} TFLOP/s)"
    if fi is not None:
        try:
            pages = RING // 8
            workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            qo_indptr = torch.tensor([0, n], dtype=torch.int32, device=dev)
            kv_indptr = torch.tensor([0, pages], dtype=torch.int32, device=dev)
            indices = torch.arange(pages, dtype=torch.int32, device=dev)
            last = torch.tensor([8], dtype=torch.int32, device=dev)
            wrapper.plan(qo_indptr, kv_indptr, indices, last, HEADS, HEADS, HEAD_DIM, 8, causal=True,
                         q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip
            paged = [
                (
                    kk[:1].transpose(1, 2).reshape(pages, 8, HEADS, HEAD_DIM),
                    vv[:1].transpose(1, 2).reshape(pages, 8, HEADS, HEAD_DIM),
                )
                for kk, vv in zip(keys, values, strict=True)
            ]  # fmt: skip (its NHD layout: a copy)

            def run_fi():
                for kv in paged:
                    wrapper.run(q, kv)

            for _ in range(3):
                run_fi()
            us_fi = _events_ms(run_fi, 10) * 1000 / len(keys)
            line += f"  flashinfer (kv {RING} causal, page 8) {us_fi:7.1f}"
        except Exception as exc:
            line += f"  flashinfer failed: {type(exc).__name__}: {str(exc)[:160]}"
    print(line, flush=True)


def tune_prefill() -> None:
    """Every prefill configuration for a span of n = 600 and 256 new positions in one row of a full ring, us per
    layer (the kernel and, with key splits, the combine), fastest first; then RoPE split + KV write of the block."""
    from cspan.core.modules import fused
    from cspan.core.modules.rope import rope_tables

    dev = torch.device("cuda")
    keys = [torch.randn(1, HEADS, RING, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    values = [torch.randn_like(k) for k in keys]
    offset = torch.full((1,), 10 * RING, dtype=torch.long, device=dev)
    t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731

    def at(n: int) -> None:
        q, k, v = (torch.randn(n, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * n * (RING + n / 2) * HEADS * HEAD_DIM
        results = {}
        for bm in (64, 128):
            ragged = _one_span(n, bm, offset)
            for bn in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3):
                        for splits in (1, 2, 3):
                            cfg = (bm, bn, warps, stages)

                            def run(cfg=cfg, splits=splits, ragged=ragged):
                                for kk, vv in zip(keys, values, strict=True):
                                    fused.prefill_attention(q, k, v, kk, vv, ragged, RING, config=cfg, splits=splits)

                            try:
                                results[(cfg, splits)] = _events_ms(_graph(run), 10) * 1000 / len(keys)
                            except Exception as exc:
                                print(f"  n={n} {cfg} splits {splits}: failed {type(exc).__name__}: {str(exc)[:100]}")
        ragged = _one_span(n, fused.block_m_for(n), offset)

        def run_default(ragged=ragged):
            for kk, vv in zip(keys, values, strict=True):
                fused.prefill_attention(q, k, v, kk, vv, ragged, RING)

        default = _events_ms(_graph(run_default), 10) * 1000 / len(keys)
        print(f"ragged prefill n={n} over a full ring of {RING}: default {fused.PREFILL_CONFIG} {default:.1f} us "
              f"({flops / default / 1e6:.0f} TFLOP/s); fastest:")  # fmt: skip
        for (cfg, splits), us in sorted(results.items(), key=lambda kv: kv[1])[:8]:
            print(f"  {cfg} splits {splits}: {us:7.1f} us ({flops / us / 1e6:.0f} TFLOP/s)")
        qkv = torch.randn(n, 3 * HEADS * HEAD_DIM, device=dev, dtype=torch.bfloat16)
        rope = rope_tables(torch.arange(n, device=dev)[None] + 10 * RING, HEAD_DIM, 10_000.0)
        flat = (rope[0][0], rope[1][0])
        rows, pos = t([0] * n), torch.arange(n, device=dev) + 10 * RING
        kc = torch.zeros(64, HEADS, RING, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        us_rope = _events_ms(_graph(lambda: fused.rope_split(qkv, HEADS, flat)), 20) * 1000
        us_kv = _events_ms(_graph(lambda: fused.kv_write(k, v, kc, vc, rows, pos)), 20) * 1000
        gbps = 4 * n * HEADS * HEAD_DIM * 2 / us_kv / 1e3
        print(f"  rope split {us_rope:.1f} us, kv write {us_kv:.1f} us ({gbps:.0f} GB/s)")

    for n in (600, 256):
        at(n)


def _one_span(n: int, bm: int, offset: torch.Tensor):
    """The ragged layout of row 0 reading n new positions after its ring (``offset`` [B] positions so far)."""
    from cspan.core.modules import fused

    t = lambda x: torch.tensor(x, dtype=torch.long, device=offset.device)  # noqa: E731
    per = -(-n // bm)
    return fused.Ragged(
        seq_row=t([0]), seq_start=t([0]), seq_len=t([n]), qb_seq=t([0] * per), qb_j=t([j * bm for j in range(per)]),
        tok_row=t([0] * n), tok_j=t(list(range(n))), tok_keep=t([1] * n).bool(), block_m=bm,
    ).at(offset)  # fmt: skip


@torch.no_grad()
def overlap() -> None:
    """Does the GPU run a block's attention and other rows' decode attention at once? A 601-token block over one
    full ring and B = 64 rows' decode over full rings, per layer (LAYERS layers per graph, the block's layer before
    the decode's as the engine orders them): each alone, one after the other, and the block on a second stream of
    high priority beside the decode (fork and join per layer), for several configs of both kernels and FlashInfer's
    decode. Microseconds per layer; "hidden" is how much of the shorter kernel the two streams saved."""
    from cspan.core.modules import fused
    from cspan.core.modules.rope import rope_tables

    fi = _flashinfer()
    dev = torch.device("cuda")
    B, n = 64, 601
    dkeys = [torch.randn(B, HEADS, RING, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    dvalues = [torch.randn_like(k) for k in dkeys]
    pkeys = [torch.randn(1, HEADS, RING, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    pvalues = [torch.randn_like(k) for k in pkeys]
    qkv = torch.randn(B, 3 * HEADS * HEAD_DIM, device=dev, dtype=torch.bfloat16)
    rows = torch.arange(B, device=dev)
    positions = torch.full((B,), 10 * RING + 7, dtype=torch.long, device=dev)
    rope = rope_tables(positions, HEAD_DIM, 10_000.0)
    q, k, v = (torch.randn(n, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(3))
    offset = torch.full((1,), 10 * RING, dtype=torch.long, device=dev)
    side = torch.cuda.Stream(dev, priority=-1)
    decoders = {f"triton {cfg}": cfg for cfg in ((32, 64, 8, 4, 4, 1),)}  # the engine's at 64 rows (C73: four others)
    wrapper = None if fi is None else _flashinfer_decode_wrapper(fi, B, dev)
    if wrapper is not None:
        decoders["flashinfer"] = None
    q_fi = qkv[:, : HEADS * HEAD_DIM].reshape(B, HEADS, HEAD_DIM).contiguous()
    # (config, key splits, programs): C73's configs beside the default one and one split, then one split on fewer
    # programs than tiles (each loops over its share: fused.PREFILL_BESIDE_PROGRAMS), per SM
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    prefills = [((64, 64, 4, 3), None, None), ((64, 64, 4, 3), 1, None)]
    prefills += [((64, 64, 4, 3), 1, int(f * sms)) for f in (0.5, 1, 1.5, 2)]

    def decode(name: str, i: int) -> None:
        if decoders[name] is None:
            wrapper.run(q_fi, (dkeys[i], dvalues[i]))
        else:
            fused.decode_attention(qkv, dkeys[i], dvalues[i], positions, rows, RING, rope, config=decoders[name])

    def prefill(pcfg, splits, programs, ragged, i: int) -> None:
        fused.prefill_attention(q, k, v, pkeys[i], pvalues[i], ragged, RING, config=pcfg, splits=splits,
                                programs=programs)  # fmt: skip

    def timed(fn) -> float:
        return _events_ms(_graph(fn), 10) * 1000 / LAYERS

    print(f"B = {B} decode beside a {n}-token block, full rings of {RING}, us per layer:")
    print("| decode | block (config, splits, programs) | decode alone | block alone | one after the other | beside "
          "| hidden |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in decoders:
        alone_d = timed(lambda name=name: [decode(name, i) for i in range(LAYERS)])
        for pcfg, splits, programs in prefills:
            ragged = _one_span(n, pcfg[0], offset)
            args = (pcfg, splits, programs, ragged)

            def apart(name=name, args=args):
                for i in range(LAYERS):
                    prefill(*args, i)
                    decode(name, i)

            def beside(name=name, args=args):
                main = torch.cuda.current_stream()
                for i in range(LAYERS):
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        prefill(*args, i)
                    decode(name, i)
                    main.wait_stream(side)

            try:
                alone_p = timed(lambda args=args: [prefill(*args, i) for i in range(LAYERS)])
                t_apart, t_beside = timed(apart), timed(beside)
            except Exception as exc:
                print(f"| {name} | {pcfg}, {splits}, {programs} | failed: {type(exc).__name__}: {str(exc)[:100]} |")
                continue
            hidden = (t_apart - t_beside) / min(alone_d, alone_p)
            print(f"| {name} | {pcfg}, {splits}, {programs} | {alone_d:.1f} | {alone_p:.1f} | {t_apart:.1f} | "
                  f"{t_beside:.1f} | {hidden:.0%} |", flush=True)  # fmt: skip


@torch.no_grad()
def pinned() -> None:
    """Step time (CUDA events, median of 30) with every session past the window under the ``pinned`` persona policy
    (the sinks placed at the head of every step) against policy ``none``, 200-frame persona prefixes."""
    from cspan.bench.latency import fill_history, random_lm
    from cspan.core.config import LMConfig
    from cspan.core.engine import DuplexEngine
    from cspan.core.kv_cache import KVCache
    from cspan.core.window import PinnedSinks

    for kv in (torch.bfloat16, torch.float8_e4m3fn):  # the kernel path against the tensor path, 3 rows, 2 placed
        caches = []
        for kernel in (False, True):
            gen = torch.Generator(device="cuda").manual_seed(0)
            cache = KVCache(4, 3, 8, 128, 64, torch.device("cuda"), kv, torch.bfloat16)
            cache.keys.copy_(torch.randn(cache.keys.shape, device="cuda", generator=gen).to(kv))
            cache.values.copy_(torch.randn(cache.values.shape, device="cuda", generator=gen).to(kv))
            if cache.key_scale is not None:
                cache.key_scale.fill_(0.01)
                cache.value_scale.fill_(0.01)
            store = PinnedSinks(cache, 10_000.0, kernel=kernel)
            for row, S in ((0, 5), (1, 9), (2, 3)):
                store.add(row, S)
            store.place({0: 1000, 2: 77_777})
            caches.append(cache)
        a, b = caches
        scale = lambda c, x, s: x.float() * (s[..., None] if s is not None else 1.0)  # noqa: E731
        dk = (scale(a, a.keys, a.key_scale) - scale(b, b.keys, b.key_scale)).abs().max().item()
        dv = (scale(a, a.values, a.value_scale) - scale(b, b.values, b.value_scale)).abs().max().item()
        print(f"PinnedSinks kernel vs tensor path, {kv}: max |key diff| {dk:.3g}, max |value diff| {dv:.3g}")

    lm = random_lm(LMConfig.personaplex_7b(), "cuda", torch.bfloat16)
    for B in (1, 32):
        for policy in ("none", "pinned"):
            engine = DuplexEngine(lm, batch_size=B, cuda_graphs=True, seed=0, predict_user=False, persona_policy=policy)
            frames = torch.randint(0, 2000, (lm.num_codebooks, 200), device="cuda")
            for i in range(B):
                engine.set_prefix(i, frames)
            user = torch.randint(0, 2048, (B, 8), device="cuda")
            engine.step_tokens(user)
            fill_history(engine, RING + 10)
            for _ in range(3):
                engine.step_tokens(user)
            times = []
            for _ in range(30):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                engine.step_tokens(user)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            pins = sum(1 for i in range(B) for e in engine.take_window_events(i) if e.kind == "pin")
            print(f"B={B:3d} policy {policy:6s}: step p50 {statistics.median(times):6.2f} ms, "
                  f"max {max(times):6.2f} ms ({pins} of {B} sessions pinned)", flush=True)  # fmt: skip
            del engine
            torch.cuda.empty_cache()


def _kernel_profile(title: str, fn, reps: int = 5, trace: str | None = None) -> None:
    """Profile ``reps`` calls of ``fn`` (graph replays included: CUPTI reports the graph's kernels): kernel count,
    sum of kernel times, first-start-to-last-end span per call, and the kernels grouped by name. ``trace``: also
    write one call's Chrome trace (kernels with their streams and times) to this path."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    if trace:
        with profile(activities=[ProfilerActivity.CUDA]) as one:
            fn()
            torch.cuda.synchronize()
        one.export_chrome_trace(trace)
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
def profile() -> None:
    """Kernel profiles of the engine's graphed token step on a full ring: B = 1 and 64 (``PROFILE_B``, e.g.
    ``"112"``), a plain step and a step in which one session reads a 600-column span; ``PROFILE_KV=fp8`` for the
    FP8 KV cache."""
    from cspan.bench.latency import random_lm
    from cspan.core.config import LMConfig

    lm = random_lm(LMConfig.personaplex_7b(), "cuda", torch.bfloat16)
    for B in [int(b) for b in os.environ.get("PROFILE_B", "1 64").split()]:
        _profile_at(lm, B, os.environ.get("PROFILE_KV", "auto"))
        torch.cuda.empty_cache()


def _profile_at(lm, B: int, kv_dtype: str = "auto") -> None:
    from cspan.bench.latency import fill_history, span_body
    from cspan.core.engine import DuplexEngine
    from cspan.core.span import ContextSpan

    engine = DuplexEngine(lm, batch_size=B, cuda_graphs=True, seed=0, predict_user=False, kv_dtype=kv_dtype)
    user = torch.randint(0, 2048, (B, 8), device="cuda")
    for _ in range(2):
        engine.step_tokens(user)
    fill_history(engine, RING)
    for _ in range(3):
        engine.step_tokens(user)
    _kernel_profile(f"B={B} {kv_dtype} KV plain step on a full ring (graph + host)", lambda: engine.step_tokens(user))
    span = ContextSpan.from_ids(span_body(600, lm.text_card))

    def with_span():
        engine.inject_span(0, span)
        engine.step_tokens(user)

    for _ in range(3):
        with_span()
    traces = os.environ.get("PROFILE_TRACE")  # a folder: one call's Chrome trace of the span step per B
    trace = f"{traces}/trace_span_B{B}.json" if traces else None
    _kernel_profile(f"B={B} step reading a 600-column span in session 0", with_span, trace=trace)
    if trace:
        trace_summary(trace)


def trace_summary(path: str) -> None:
    """What one span step's Chrome trace (``PROFILE_TRACE``; ``.json`` or ``.json.gz``) says about the block's
    attention beside the decode attention, per layer: when each decode attention starts after its inputs are ready
    (the end of the kernel before it on its stream), how long it and the block's attention run, and the step's idle
    time (no kernel on any stream). C77: the decode started 71 us per layer late behind the block's programs.
    Usage (anywhere, no GPU): ``python3 scripts/perf_h200.py trace docs/perf/round4/c77/trace_span_B64.json.gz``."""
    import gzip
    import json

    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        print(f"{path}: no kernels")
        return
    start, end = kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels)
    busy, (lo, hi) = 0.0, (kernels[0]["ts"], kernels[0]["ts"] + kernels[0]["dur"])
    for e in kernels[1:]:
        if e["ts"] > hi:
            busy, lo = busy + hi - lo, e["ts"]
        hi = max(hi, e["ts"] + e["dur"])
    busy += hi - lo
    late, decode, ready = [], [], {}  # ready: stream -> the end of its last kernel so far
    for e in kernels:
        stream = e["args"].get("stream")
        if "BatchDecode" in e["name"] and stream in ready:  # FlashInfer's decode: the temporal rows' from 8 rows on
            late.append(e["ts"] - ready[stream])
            decode.append(e["dur"])
        ready[stream] = e["ts"] + e["dur"]
    block = [e["dur"] for e in kernels if "prefill_attn" in e["name"]]
    print(
        f"{path}: {len(kernels)} kernels, first start to last end {end - start:.1f} us, idle {end - start - busy:.1f} us"
    )
    if late:
        print(f"  decode attention: {len(late)} launches, starts {statistics.mean(late):.1f} us after its inputs "
              f"(max {max(late):.1f}, {sum(late):.1f} per step), runs {statistics.mean(decode):.1f} us")  # fmt: skip
    if block:
        print(f"  block attention: {len(block)} launches, runs {statistics.mean(block):.1f} us")


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


def summary(folder: str) -> None:
    """A compact summary of a perf_h200.sh run's logs and JSON (printed last, so the call's output ends with it)."""
    import json
    from pathlib import Path

    root = Path(folder)

    def load(name):
        path = root / name
        return json.loads(path.read_text()) if path.exists() else None

    def stats(d, key="p50_ms"):
        return "-" if not d else f"{d[key]:.2f}"

    print("##### summary")
    env = root / "env.log"
    if env.exists():
        print("\n".join(line for line in env.read_text().splitlines() if line.strip())[-600:])
    tests = root / "tests.log"
    if tests.exists():
        last = [line for line in tests.read_text().splitlines() if "passed" in line or "failed" in line]
        print("tests:", last[-1] if last else "(no result line)")
    variants = sorted(p.name for p in root.glob("latency_*-[0-9]*.json"))  # the `variants` stage's runs
    for name in ("latency.json", "latency_fp8.json", "latency_fresh.json", "latency_triton.json", *variants):
        doc = load(name)
        if not doc:
            continue
        cfg = doc["config"]
        print(
            f"{name}: kv {cfg.get('kv_dtype')}, fill {cfg.get('fill')}, fused {cfg.get('fused')}, decode "
            f"{cfg.get('decode_attention')}"
        )
        print(f"  B=1 step p50/p99 {stats(doc['step'])}/{stats(doc['step'], 'p99_ms')}, 16 codebooks p50 "
              f"{stats(doc.get('step_predict_user'))}, frame p50 {stats(doc.get('frame'))}")  # fmt: skip
        for r in doc["rows"]:
            print(f"  B=1 n={r['n']}: mean {r['mean_ms']:.2f} p99 {r['p99_ms']:.2f}")
        for r in (doc.get("batch") or {}).get("rows", []):
            f = r.get("frame") or {}
            line = (
                f"  B={r['batch_size']}: step p50/p99 {stats(r['step'])}/{stats(r['step'], 'p99_ms')}, frame "
                f"p50/p99 {stats(f)}/{stats(f, 'p99_ms') if f else '-'}"
            )
            for sp in r.get("spans", []):
                line += (
                    f"; span {sp['n']} into {sp['sessions']}: frame p99 {sp['frame']['p99_ms']:.2f} "
                    f"({sp['minus_plain_p99_ms']:+.2f})"
                )
            print(line)
    for path in sorted(root.glob("baseline_depq*.json")):
        doc = json.loads(path.read_text())
        print(f"{path.name}: copy {doc.get('copy_TBps', 0):.2f} TB/s, floor {doc.get('floor_ms_per_frame', 0):.2f} ms")
        for key, val in doc.items():
            if key.startswith("moshi_b") and isinstance(val, dict):
                parts = [f"n={k} p50 {v['p50']:.2f} p99 {v['p99']:.2f}" for k, v in val.items() if isinstance(v, dict)]
                print(f"  {key}: " + "; ".join(parts))
            elif key.startswith("moshi_b"):
                print(f"  {key}: {str(val)[:160]}")
    att = root / "attention.log"
    if att.exists():
        for line in att.read_text().splitlines():
            if line.startswith(("B=", "DECODE_CONFIGS", "flashinfer", "decode over", "ragged prefill")):
                print(line[:400])
    for name in ("capacity_bf16.json", "capacity_fp8.json"):
        doc = load(name)
        if doc:
            rows = [
                f"B={r['batch_size']} p99 {r['frame']['p99_ms']:.1f}"
                if r.get("fits", True)
                else f"B={r['batch_size']} no fit"
                for r in doc["results"]
            ]
            print(f"{name}: capacity {doc['capacity']} ({', '.join(rows)})")
    doc = load("fp8_kv.json")
    if doc:
        for model, r in doc.items():
            print(f"fp8 {model}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in r.items() if k != "spans"))  # fmt: skip


def bench(argv: list[str]) -> int:
    from cspan.bench.commands import bench_command
    from cspan.core import cli
    from cspan.core.cli import main

    cli.discover_commands = lambda: {"bench": bench_command}
    return main(["bench", *argv])


SUBCOMMANDS = {
    "ceilings": ceilings,
    "attention": attention,
    "attention-fp8": attention_fp8,
    "profile": profile,
    "tune-conv": tune_conv,
    "tune-prefill": tune_prefill,
    "pinned": pinned,
    "overlap": overlap,
}

if __name__ == "__main__":
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "bench":
        sys.exit(bench(rest))
    if cmd == "summary":
        sys.exit(summary(rest[0]))
    if cmd == "trace":
        sys.exit(trace_summary(rest[0]))
    if cmd not in SUBCOMMANDS:
        sys.exit(f"unknown subcommand {cmd!r}: {', '.join(SUBCOMMANDS)}, bench")
    SUBCOMMANDS[cmd]()
