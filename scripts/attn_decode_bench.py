"""Decode attention over a full KV ring on the GPU: the project's Triton kernel against FlashInfer and torch SDPA.

One query position per row attends over a full ring of C slots (the 7B's shape: 32 heads of 128, C = 3000),
for batch sizes 1..128. Every method runs L layers' attention back to back on L distinct ring buffers (so the L2
cache never holds the next layer's keys), captured in one CUDA graph; the figure is the graph replay time divided
by L (median of repeats), against the bytes floor (keys + values of every row read once, at the measured copy
bandwidth).

- ours: ``cspan.core.modules.fused.decode_attention`` (also writes the new key/value into the ring), several
  launch configurations (block_n, max_splits, waves, num_warps);
- flashinfer: ``BatchDecodeWithPagedKVCacheWrapper`` in HND layout with one page of C slots per row: the ring
  buffer [B, H, C, Dh] of a layer is used as it is (zero copy); bf16 and fp8 (e4m3, per-tensor scale) keys/values;
- sdpa: ``torch.nn.functional.scaled_dot_product_attention`` over the whole ring.

Usage (on the device): ``python3 scripts/attn_decode_bench.py`` (env BATCHES=1,8,32,64,128 LAYERS=8 C=3000);
writes ``$OUT/attn_decode.json`` and prints a table.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

OUT = os.environ.get("OUT", "/tmp")
BATCHES = [int(x) for x in os.environ.get("BATCHES", "1,8,32,64,128").split(",")]
LAYERS = int(os.environ.get("LAYERS", "8"))
C = int(os.environ.get("C", "3000"))
H, DH = 32, 128
REPEATS = int(os.environ.get("REPEATS", "20"))
CONFIGS = [(32, 64, 8, 4), (64, 64, 8, 4), (64, 64, 4, 8), (128, 64, 4, 8), (64, 16, 2, 4), (128, 16, 2, 8)]
res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "C": C, "H": H, "Dh": DH, "rows": []}


def copy_bandwidth() -> float:
    a = torch.randn(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 2 / ((time.perf_counter() - t) / 20)


def graph_time(fn) -> float:
    """Median seconds of one replay of a graph holding ``fn()`` (L layers); eager with events if capture fails."""
    try:
        return _graph_time(fn)
    except Exception as exc:
        print("  graph capture failed, timing eagerly:", repr(exc)[:160], flush=True)
    times = []
    for _ in range(REPEATS):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1000.0)
    return statistics.median(times)


def _graph_time(fn) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(REPEATS):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1000.0)
    return statistics.median(times)


def bench_batch(B: int, bw: float, fused, flashinfer, workspace) -> dict:
    row: dict = {"B": B}
    gen = torch.Generator(device="cuda").manual_seed(B)
    keys = [torch.randn(B, H, C, DH, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(LAYERS)]
    vals = [torch.randn(B, H, C, DH, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(LAYERS)]
    qkv = torch.randn(B, 1, 3 * H * DH, device="cuda", dtype=torch.bfloat16, generator=gen)
    offset = torch.full((B,), 5 * C + 7, dtype=torch.long, device="cuda")
    floor = B * H * C * DH * 2 * 2 / bw
    row["floor_us"] = floor * 1e6
    for cfg in CONFIGS:

        def ours(cfg=cfg):
            for k, v in zip(keys, vals, strict=True):
                fused.decode_attention(qkv, k, v, offset, C, None, None, cfg)

        try:
            t = graph_time(ours) / LAYERS
            row[f"ours{cfg}"] = t * 1e6
        except Exception as exc:
            row[f"ours{cfg}"] = repr(exc)[:200]
    q = qkv[:, 0, : H * DH].reshape(B, H, DH).contiguous()

    def sdpa():
        for k, v in zip(keys, vals, strict=True):
            torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v)

    try:
        row["sdpa"] = graph_time(sdpa) / LAYERS * 1e6
    except Exception as exc:
        row["sdpa"] = repr(exc)[:200]
    if flashinfer is not None:
        indptr = torch.arange(B + 1, dtype=torch.int32, device="cuda")
        indices = torch.arange(B, dtype=torch.int32, device="cuda")
        last = torch.full((B,), C, dtype=torch.int32, device="cuda")
        for name, kv_dtype in (("flashinfer_bf16", torch.bfloat16), ("flashinfer_fp8", torch.float8_e4m3fn)):
            try:
                t0 = time.perf_counter()
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="HND")
                wrapper.plan(indptr, indices, last, H, H, DH, C, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
                ks = keys if kv_dtype == torch.bfloat16 else [k.to(kv_dtype) for k in keys]
                vs = vals if kv_dtype == torch.bfloat16 else [v.to(kv_dtype) for v in vals]
                wrapper.run(q, (ks[0], vs[0]))
                torch.cuda.synchronize()
                row[f"{name}_first_call_s"] = time.perf_counter() - t0

                def fi(wrapper=wrapper, ks=ks, vs=vs):
                    for k, v in zip(ks, vs, strict=True):
                        wrapper.run(q, (k, v))

                row[name] = graph_time(fi) / LAYERS * 1e6
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q[:, :, None].float(), keys[0].float(), vals[0].float()
                )[:, :, 0]
                got = wrapper.run(q, (ks[0], vs[0])).float()
                row[f"{name}_relerr"] = float((got - ref).norm() / ref.norm())
                del ks, vs
            except Exception as exc:
                row[name] = repr(exc)[:300]
    return row


def main() -> None:
    bw = copy_bandwidth()
    res["copy_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    from cspan.core.modules import fused

    try:
        import flashinfer

        res["flashinfer"] = flashinfer.__version__
    except Exception as exc:
        flashinfer = None
        res["flashinfer_error"] = repr(exc)
        print("flashinfer unavailable:", exc, flush=True)
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    for B in BATCHES:
        row = bench_batch(B, bw, fused, flashinfer, workspace)
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "attn_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\nB     floor_us  " + "  ".join(k for k in res["rows"][0] if k not in ("B", "floor_us")))
    for row in res["rows"]:
        vals_ = [
            f"{v:.1f}" if isinstance(v, float) else str(v)[:12] for k, v in row.items() if k not in ("B", "floor_us")
        ]
        print(f"{row['B']:<5} {row['floor_us']:8.1f}  " + "  ".join(vals_))


if __name__ == "__main__":
    main()
