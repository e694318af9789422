# C97: ran from .device/rope_ab.py with .device/old/fused_old.py = d7d241c's fused.py (formatted for the lint after the call).
"""A/B of the rope_split kernel: this tree's (vectorized pairs) against HEAD's (partner loads at d ^ 1), on the
device: bit equality, and us per call from a CUDA graph of 20 calls."""

import importlib.util
import sys

import torch

from cspan.core.modules import fused

spec = importlib.util.spec_from_file_location("fused_old", ".device/old/fused_old.py")
old = importlib.util.module_from_spec(spec)
sys.modules["fused_old"] = old
spec.loader.exec_module(old)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
H, DH = 32, 128
for N in [int(n) for n in (sys.argv[1:] or ["1", "17", "64", "601", "1025"])]:
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator(device=dev).manual_seed(N)
        qkv = (torch.randn(N, 3 * H * DH, device=dev, generator=gen) * 3).to(dtype)
        pos = torch.randint(0, 100_000, (N,), device=dev, generator=gen)
        rope = fused.rope_tables(pos, DH, 10_000.0)
        new_out = fused.rope_split(qkv, H, rope)
        old_out = old.rope_split(qkv, H, rope)
        same = all(torch.equal(a, b) for a, b in zip(new_out, old_out, strict=True))
        line = f"N={N} {dtype}: bit-equal {same}"
        if dev.type == "cuda":
            times = {}
            for name, fn in (
                ("old", old.rope_split),
                ("new", fused.rope_split),
                ("old2", old.rope_split),
                ("new2", fused.rope_split),
            ):
                g = torch.cuda.CUDAGraph()
                fn(qkv, H, rope)
                torch.cuda.synchronize()
                with torch.cuda.graph(g):
                    for _ in range(20):
                        fn(qkv, H, rope)
                g.replay()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(10):
                    g.replay()
                e.record()
                torch.cuda.synchronize()
                times[name] = s.elapsed_time(e) / 200 * 1000
            floor = 2 * qkv.numel() * qkv.element_size() / 4.2e12 * 1e6
            line += ", us per call: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()) + f" (floor {floor:.2f})"
        print(line, flush=True)
