"""The temporal transformer's step of one to four rows on a full ring, without blocks: the engine's kernels (cuBLAS
products with their split-K reduces, the fused RMS norms and SiLU gate) against the same layers as
:func:`cspan.core.modules.fused.gemv` launches that take the norm, gate and residual in (the ``CSPAN_GEMV=all``
path of branch ``exp/temporal-gemv``), per GEMV config. Both chains run the engine's decode attention over each
row's full ring, so PDL overlaps and launch gaps are what the engine's step sees. Every chain is timed from one
CUDA graph (events around ``--iters`` replays). Also each product kind alone, 32 in a chain (the engine's form:
the product with its norm or gate kernel; the GEMV form: one launch), to tell which kind each config suits.

    python3 scripts/temporal_gemv_sweep.py                       # the 7B's shapes on the GPU (bf16, 3000-slot rings)
    TRITON_INTERPRET=1 CSPAN_FUSED=1 python3 scripts/temporal_gemv_sweep.py --tiny --no-graph   # a CPU smoke test

``--model depformer`` times the depformer's layers instead (D 1024, 16 heads of 64, gated hidden 2816, its
16-slot ring half full, 48 layers: 8 codebooks of 6 layers, each on its own weights, as the served step runs them),
where the engine already runs GEMV launches (``default``: :data:`cspan.core.modules.fused.GEMV_TILE`).

Prints µs per step and per product, the max |difference| of the chains' outputs, and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from perf_h200 import _events_ms, _graph

from cspan.core.modules import fused
from cspan.core.modules.rope import rope_tables


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--configs", nargs="+", default=None,
                   help="GEMV configs 'elements,warps' (fused.gemv's config; default: per --model)")  # fmt: skip
    p.add_argument("--model", choices=["temporal", "depformer"], default="temporal")
    p.add_argument("--layers", type=int, default=None, help="default: 32 temporal, 48 depformer")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    p.add_argument("--no-graph", action="store_true", help="time eager calls (CPU)")
    p.add_argument("--no-kinds", action="store_true", help="skip the per-kind chains")
    p.add_argument("--out", default=None)
    return p.parse_args()


class Layers:
    """Random weights of the layers (the temporal 7B's: D 4096, 32 heads of 128, gated hidden 11264; or the
    depformer's), made on the device, and the rings of :meth:`use_rows`."""

    def __init__(self, n: int, tiny: bool, model: str, device: torch.device, dtype: torch.dtype) -> None:
        if tiny:
            D, H, hidden, C = 64, 4, 176, 32
        else:
            D, H, hidden, C = (4096, 32, 11264, 3000) if model == "temporal" else (1024, 16, 2816, 16)
        self.D, self.H, self.Dh, self.C, self.hidden, self.n = D, H, D // H, C, hidden, n
        self.device, self.dtype, self.eps = device, dtype, 1e-8
        # the temporal ring full (C earlier positions), the depformer's half (codebook 8 of 16)
        self.position = C if model == "temporal" else C // 2
        self.g = torch.Generator(device=device).manual_seed(0)

        def w(n_out: int, n_in: int) -> torch.Tensor:
            return (torch.randn(n_out, n_in, generator=self.g, device=device) / math.sqrt(n_in)).to(dtype)

        def gain() -> torch.Tensor:
            return 1 + 0.1 * torch.randn(D, generator=self.g, device=device)

        self.layers = [
            dict(qkv=w(3 * D, D), out=w(D, D), gate=w(2 * hidden, D), down=w(D, hidden), a1=gain(), a2=gain())
            for _ in range(n)
        ]

    def use_rows(self, rows: int) -> None:
        """Rings, positions and inputs for ``rows`` rows (the previous ones freed first)."""
        self.keys = self.values = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        shape = (rows, self.H, self.C, self.Dh)
        ring = [torch.randn(shape, generator=self.g, device=self.device, dtype=self.dtype) for _ in range(2 * self.n)]
        self.keys, self.values = ring[: self.n], ring[self.n :]
        self.rows = torch.arange(rows, device=self.device)
        self.pos = torch.full((rows,), self.position, dtype=torch.long, device=self.device)
        self.rope = rope_tables(self.pos, self.Dh, 10000.0)
        self.x = torch.randn(rows, self.D, generator=self.g, device=self.device).to(self.dtype)
        self._xh = torch.randn(rows, self.hidden, generator=self.g, device=self.device).to(self.dtype)

    def attention(self, i: int, qkv: torch.Tensor, rows: int) -> torch.Tensor:
        return fused.decode_attention(
            qkv, self.keys[i], self.values[i], self.pos, self.rows, self.C, self.rope, None, None, None, rows
        )

    def chain(self, x: torch.Tensor, config: tuple[int, int] | str | None) -> torch.Tensor:
        """The step: "cublas" the engine's temporal form, else GEMV launches with ``config`` (None: the default)."""
        return self.engine_chain(x) if config == "cublas" else self.gemv_chain(x, config)

    def engine_chain(self, x: torch.Tensor) -> torch.Tensor:
        """The engine's step today (``StreamingTransformer._fused_step`` without blocks)."""
        update = None
        for i, L in enumerate(self.layers):
            x, h = fused.rms_norm(x, L["a1"], self.eps, update)
            attn = self.attention(i, F.linear(h, L["qkv"]), x.shape[0])
            x, h = fused.rms_norm(x, L["a2"], self.eps, F.linear(attn, L["out"]))
            update = F.linear(fused.silu_gate(F.linear(h, L["gate"])), L["down"])
        return x + update

    def gemv_chain(self, x: torch.Tensor, config: tuple[int, int] | None) -> torch.Tensor:
        """The same layers as GEMV launches (``StreamingTransformer._gemv_step`` of branch exp/temporal-gemv)."""
        h = x
        for i, L in enumerate(self.layers):
            qkv = fused.gemv(h, L["qkv"], norm=(L["a1"], self.eps), config=config)
            attn = self.attention(i, qkv, x.shape[0])
            h = fused.gemv(attn, L["out"], residual=h, config=config)
            g = fused.gemv(h, L["gate"], norm=(L["a2"], self.eps), gate=True, config=config)
            h = fused.gemv(g, L["down"], residual=h, config=config)
        return h

    def kind_chain(self, kind: str, x: torch.Tensor, config: tuple[int, int] | str | None) -> torch.Tensor:
        """The products of one kind, each on its own layer's weights, from the same input ("cublas": the product
        with the kernel the GEMV takes in; None: the GEMV's default config)."""
        outs = []
        for L in self.layers:
            if kind == "qkv":
                y = F.linear(fused.rms_norm(x, L["a1"], self.eps)[1], L["qkv"]) if config == "cublas" else \
                    fused.gemv(x, L["qkv"], norm=(L["a1"], self.eps), config=config)  # fmt: skip
            elif kind == "out":
                y = fused.rms_norm(x, L["a2"], self.eps, F.linear(x, L["out"]))[0] if config == "cublas" else \
                    fused.gemv(x, L["out"], residual=x, config=config)  # fmt: skip
            elif kind == "gate":
                y = fused.silu_gate(F.linear(fused.rms_norm(x, L["a2"], self.eps)[1], L["gate"])) if config == "cublas" \
                    else fused.gemv(x, L["gate"], norm=(L["a2"], self.eps), gate=True, config=config)  # fmt: skip
            else:
                xh = self.hidden_input(x)
                y = (
                    x + F.linear(xh, L["down"])
                    if config == "cublas"
                    else fused.gemv(xh, L["down"], residual=x, config=config)
                )
            outs.append(y)
        return outs[-1]

    def hidden_input(self, x: torch.Tensor) -> torch.Tensor:
        return self._xh


def _time(fn, iters: int, graph: bool) -> tuple[float, torch.Tensor]:
    """µs per call of ``fn()`` and its output: from one CUDA graph (``perf_h200._graph``, timed with its
    ``_events_ms``: the median of 3 runs of ``iters`` replays) when ``graph``, else eager calls (CPU smoke test)."""
    if not graph:
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn()
        return (time.perf_counter() - t0) / iters * 1e6, out
    held: dict[str, torch.Tensor] = {}
    replay = _graph(lambda: held.__setitem__("out", fn()))  # the captured call leaves the graph's output here
    replay()
    return _events_ms(replay, iters, runs=3) * 1000, held["out"]


Config = tuple[int, int] | str | None


def _label(c: Config) -> str:
    return c if isinstance(c, str) else "gemv default" if c is None else f"gemv {c[0]},{c[1]}"


def _sweep(L: Layers, a: argparse.Namespace, configs: list[Config], graph: bool) -> dict:
    """One row count: the whole step per config (the first is the reference), then each product kind alone."""
    x, rows = L.x, L.x.shape[0]
    line: dict = {}
    print(f"\nrows {rows}: {a.layers} layers, ring {L.C} (position {int(L.pos[0])}), us a step:")
    base_us = base = None
    for c in configs:
        us, out = _time(lambda c=c: L.chain(x, c), a.iters, graph)
        line[_label(c)] = round(us, 1)
        if base is None:
            base_us, base = us, out
            print(f"  {_label(c):>18}: {us:8.1f}")
            continue
        diff = float((out.float() - base.float()).abs().max())
        print(f"  {_label(c):>18}: {us:8.1f} ({us - base_us:+7.1f}), max |out - {_label(configs[0])}'s| {diff:.3g}"
              f" (max |out| {float(base.float().abs().max()):.3g})")  # fmt: skip
    if not a.no_kinds:
        for kind in ("qkv", "out", "gate", "down"):
            cells = {}
            for c in configs:
                us, _ = _time(lambda kind=kind, c=c: L.kind_chain(kind, x, c), a.iters, graph)
                cells[_label(c)] = round(us / a.layers, 2)
            line[kind] = cells
            print(f"  {kind:5s} us per product: " + ", ".join(f"{k} {v}" for k, v in cells.items()))
    return line


def main() -> None:
    a = _args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    graph = device.type == "cuda" and not a.no_graph
    temporal = a.model == "temporal"
    a.layers = a.layers or (32 if temporal else 48)
    given = a.configs or (["8192,4", "16384,8", "16384,4", "32768,8"] if temporal else
                          ["4096,4", "4096,2", "16384,4", "16384,8", "2048,2"])  # fmt: skip
    configs: list[Config] = ["cublas", None] + [tuple(int(v) for v in c.split(",")) for c in given]
    if device.type == "cuda":
        print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, PDL {fused.pdl_enabled(device)}")
    print(f"{a.model}: the reference is cuBLAS with the engine's norm and gate kernels; the engine runs "
          + ("it" if temporal else "gemv default"))  # fmt: skip
    results: dict = {"model": a.model, "layers": a.layers, "rows": {}}
    layers = Layers(a.layers, a.tiny, a.model, device, dtype)
    for rows in a.rows:
        layers.use_rows(rows)
        results["rows"][str(rows)] = _sweep(layers, a, configs, graph)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
