"""``cspan bench capacity``: how many sessions one device serves in real time, late in conversations, with Context
Spans arriving.

For each candidate batch size B (ascending) and each KV cache dtype: an engine of B sessions, every session
brought to a full ring (the model's context: a conversation four minutes in), then ``frames`` whole frames (Mimi
encode, the step, Mimi decode, the text token and PCM read back) during which Context Spans arrive as a Poisson
process: each session receives one span per ``span_interval_s`` seconds on average (default 30 s, i.e. a rate of
1 / 375 per frame), of a length drawn from an exponential distribution of mean ``span_length`` columns (default
256) clipped to ``[16, max_span]`` (default 600). Spans are injected right before the frame that reads them, as a
server does on its engine thread, and the injection is part of the frame's time. The frame's p99 decides: B
serves in real time when it stays under the 80 ms frame. The capacity is the largest such B; the search stops at
the first B over the budget (or that does not fit in memory). A row in whose timed frames no span arrived (few
frames, a long interval) is noted in the document's ``notes`` and under the printed table: its frame times say
nothing about spans.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cspan.bench.errors import BenchSettingsError
from cspan.bench.latency import (
    ROOM_TONE_STD,
    Models,
    environment,
    fill_history,
    make_engine,
    release_device_memory,
    span_body,
    summarize_ms,
)
from cspan.bench.session import synchronize
from cspan.core.constants import FRAME_MS, SERVE_MAX_BLOCK_COLUMNS

DEFAULT_BATCH_SIZES = (16, 32, 48, 64, 80, 96, 112, 128)


@dataclass
class CapacityOptions:
    """What :func:`run_capacity` measures (see the module docstring).

    Attributes:
        batch_sizes: candidates, tried in ascending order.
        kv_dtypes: KV cache storages ("bf16" / "auto", "fp8").
        frames: timed frames per candidate (after ``warmup`` frames).
        warmup: untimed frames (with the same span arrivals) before the timed ones.
        span_interval_s: mean seconds between two spans of one session (Poisson arrivals).
        span_length: mean span length in columns (exponential, clipped to ``[16, max_span]``).
        max_span: the longest span.
        budget_ms: the frame p99 a batch size must stay under.
        seed: arrivals, lengths and data.
        cuda_graphs: as the engine's.
        max_block_columns: the engine's step budget of span columns (default: the servers',
            :data:`cspan.core.constants.SERVE_MAX_BLOCK_COLUMNS`; None: no budget).
    """

    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES
    kv_dtypes: Sequence[str] = ("auto", "fp8")
    frames: int = 250
    warmup: int = 20
    span_interval_s: float = 30.0
    span_length: int = 256
    max_span: int = 600
    budget_ms: float = FRAME_MS
    seed: int = 0
    cuda_graphs: bool | None = None
    max_block_columns: int | None = SERVE_MAX_BLOCK_COLUMNS

    def check(self) -> None:
        """Raise :class:`BenchSettingsError` (exit status 2) for impossible settings."""
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise BenchSettingsError(f"--batch-size {list(self.batch_sizes)}: give batch sizes >= 1")
        if self.frames < 1 or self.warmup < 0:
            raise BenchSettingsError("--frames must be >= 1 and --warmup >= 0")
        if not self.span_interval_s > 0:  # NaN fails too; inf: no spans
            raise BenchSettingsError(
                f"--span-interval {self.span_interval_s:g}: give a number of seconds > 0 (inf: no spans)"
            )
        if self.max_span < 16:
            raise BenchSettingsError(f"--max-span {self.max_span}: give at least 16 columns")
        if not 16 <= self.span_length <= self.max_span:
            raise BenchSettingsError(
                f"--span-length {self.span_length}: give 16 to --max-span ({self.max_span}) columns"
            )
        if not (math.isfinite(self.budget_ms) and self.budget_ms > 0):
            raise BenchSettingsError(f"--budget-ms {self.budget_ms:g}: give a number of milliseconds > 0")
        if self.max_block_columns is not None and self.max_block_columns < 1:
            raise BenchSettingsError(
                f"--max-block-columns {self.max_block_columns}: give >= 1 columns, or 0 for no limit"
            )


def arrivals(
    batch_size: int, frames: int, options: CapacityOptions, frame_rate: float, gen: np.random.Generator
) -> list[list[tuple[int, int]]]:
    """Per frame, the (session, span length) pairs arriving before it: each session's spans a Poisson process of
    rate ``1 / span_interval_s`` (per frame: ``1 / (span_interval_s * frame_rate)``), lengths exponential of mean
    ``span_length`` clipped to ``[16, max_span]``."""
    rate = 1.0 / (options.span_interval_s * frame_rate)
    counts = gen.poisson(rate, size=(frames, batch_size))
    out: list[list[tuple[int, int]]] = []
    for f in range(frames):
        pairs = []
        for session in np.nonzero(counts[f])[0].tolist():
            for _ in range(int(counts[f, session])):
                n = int(np.clip(round(gen.exponential(options.span_length)), 16, options.max_span))
                pairs.append((session, n))
        out.append(pairs)
    return out


def kv_bytes_per_session(lm: Any, kv_dtype: str) -> int:
    """Bytes of one session's full temporal KV cache (keys and values of every layer, plus FP8 scales)."""
    cfg = lm.cfg
    slots = cfg.context * cfg.num_layers * cfg.num_heads
    if kv_dtype == "fp8":
        return 2 * slots * (cfg.dim // cfg.num_heads + 4)
    itemsize = {"bf16": 2, "fp16": 2}.get(kv_dtype, lm.dtype.itemsize)  # a 16-bit ring of any model; auto: its own
    return 2 * slots * (cfg.dim // cfg.num_heads) * itemsize


def prewarm(engine: Any, pcm: torch.Tensor, text_card: int, max_span: int, seed: int) -> None:
    """Run every shape the measured frames can take once eagerly, once to capture and once replayed: every block
    bucket a frame can fill (one span, or two in two sessions, as the engine's step budget lets them be read
    together), so that no kernel compilation or graph capture falls inside the timed frames (a server does the same
    at start-up; the first use of a shape costs seconds, not milliseconds)."""
    from cspan.core.span import ContextSpan

    for spans in prewarm_spans(engine.plan.block_buckets, max_span, engine.sessions.max_block_columns):
        for _ in range(3):
            for session, n in enumerate(spans[: engine.batch_size]):
                engine.inject_span(session, ContextSpan.from_ids(span_body(n, text_card, seed)))
            engine.step(pcm)
    for _ in range(3):
        engine.step(pcm)


def prewarm_spans(buckets: Sequence[int], max_span: int, budget: int | None) -> list[list[int]]:
    """Span lengths read in one frame that fill each block bucket (a span of n columns is n + 1 ragged tokens):
    the smallest token count of each bucket above 16, by one span while one is long enough, then by two (the
    longest and the rest, while the step budget ``budget`` lets both be read in one step)."""
    out: list[list[int]] = []
    lower = 1
    for bucket in sorted(b for b in buckets if b > 0):
        tokens, lower = max(lower, 17), bucket + 1
        if tokens > bucket:
            continue
        if tokens - 1 <= max_span:
            out.append([tokens - 1])
            continue
        rest = tokens - 2 - max_span
        if rest < 3:
            rest, tokens = 3, max_span + 5
        if tokens > bucket or rest > max_span or (budget is not None and max_span + rest > budget):
            break
        out.append([max_span, rest])
    return out


def run_candidate(
    models: Models, batch_size: int, kv_dtype: str, options: CapacityOptions, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Time one batch size with one KV dtype: its frame statistics and the spans it read."""
    from cspan.core.constants import FRAME_RATE
    from cspan.core.span import ContextSpan

    engine = make_engine(
        models, batch_size, (options.max_span,), options.cuda_graphs, False, kv_dtype, options.max_block_columns
    )
    device = engine.device
    gen = np.random.default_rng(options.seed + batch_size)
    total = options.warmup + options.frames
    plan = arrivals(batch_size, total, options, FRAME_RATE, gen)
    pcm = torch.from_numpy(
        (gen.standard_normal((8, batch_size, 1920)) * ROOM_TONE_STD).astype(np.float32)
    )  # a few frames of room tone, cycled
    text_card = int(models.lm.text_card)
    zeros = torch.zeros(batch_size, engine.num_codebooks, dtype=torch.long, device=device)
    for _ in range(max(2, engine.max_delay + 1)):
        engine.step_tokens(zeros)
    progress(f"B = {batch_size}, {kv_dtype}: filling {batch_size} rings to {engine.context} positions")
    fill_history(engine, engine.context or 0, options.seed)
    if engine.plan.cuda_graphs:
        progress(f"B = {batch_size}, {kv_dtype}: compiling and capturing every block bucket up to {options.max_span}")
    else:
        why = "without CUDA graphs" if device.type == "cuda" else f"no CUDA graphs on {device.type.upper()}"
        progress(f"B = {batch_size}, {kv_dtype}: warming every block bucket up to {options.max_span} ({why})")
    prewarm(engine, pcm[0], text_card, options.max_span, options.seed)
    times: list[float] = []
    span_frames = 0
    spans = 0
    for f in range(total):
        synchronize(device)
        t0 = time.perf_counter()
        for session, n in plan[f]:
            engine.inject_span(session, ContextSpan.from_ids(span_body(n, text_card, options.seed + f)))
        out = engine.step(pcm[f % pcm.shape[0]])
        out.text_token.cpu()
        out.agent_pcm.cpu()
        synchronize(device)
        if f >= options.warmup:
            times.append((time.perf_counter() - t0) * 1000.0)
            spans += len(plan[f])
            span_frames += bool(plan[f])
    stats = summarize_ms(times)
    del engine
    release_device_memory(device)
    return {
        "batch_size": batch_size,
        "kv_dtype": kv_dtype,
        "frame": stats,
        "spans": spans,
        "frames_with_spans": span_frames,
        "real_time": stats["p99_ms"] < options.budget_ms,
    }


def run_capacity(
    models: Models,
    options: CapacityOptions,
    *,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every candidate per KV dtype until one misses the budget or does not fit; the JSON document."""
    options.check()
    context = models.lm.cfg.context
    if context is not None and options.max_span > context:
        raise BenchSettingsError(
            f"--max-span {options.max_span}: longer than the model's context ({context} positions)"
        )
    say = progress or (lambda _msg: None)
    results: list[dict[str, Any]] = []
    capacity: dict[str, int | None] = {}
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    for kv in options.kv_dtypes:
        best = None
        for B in sorted(options.batch_sizes):
            need = B * kv_bytes_per_session(models.lm, kv)
            if free is not None and need > free:  # certain not to fit; near the limit, trying is the only test
                say(f"B = {B}, {kv}: {need / 2**30:.1f} GiB of KV cache does not fit ({free / 2**30:.1f} GiB free)")
                results.append({"batch_size": B, "kv_dtype": kv, "fits": False, "kv_gib": need / 2**30})
                break
            say(f"B = {B}, {kv}")
            try:
                row = run_candidate(models, B, kv, options, say)
            except torch.OutOfMemoryError:
                release_device_memory(device)
                say(f"B = {B}, {kv}: out of device memory ({need / 2**30:.1f} GiB of KV cache)")
                results.append({"batch_size": B, "kv_dtype": kv, "fits": False, "kv_gib": need / 2**30})
                break
            row["fits"] = True
            row["kv_gib"] = need / 2**30
            results.append(row)
            say(f"B = {B}, {kv}: frame p50 {row['frame']['p50_ms']:.1f} ms, p99 {row['frame']['p99_ms']:.1f} ms")
            if not row["real_time"]:
                break
            best = B
        capacity[kv] = best
    notes = [
        f"{r['kv_dtype']}, B = {r['batch_size']}: no span arrived in its {options.frames} timed frames (spans read 0): "
        "its frame times, and a capacity resting on them, say nothing about spans; time more --frames or give a "
        "shorter --span-interval"
        for r in results
        if r.get("fits") and r["spans"] == 0
    ]
    doc: dict[str, Any] = environment(device, dtype)
    doc["config"] = {
        "source": models.source,
        "random_weights": models.random,
        "batch_sizes": list(options.batch_sizes),
        "kv_dtypes": list(options.kv_dtypes),
        "frames": options.frames,
        "warmup": options.warmup,
        "span_interval_s": options.span_interval_s,
        "span_length": options.span_length,
        "max_span": options.max_span,
        "budget_ms": options.budget_ms,
        "max_block_columns": options.max_block_columns,
        "fill": "the model's context (a full ring)",
        "timing": "whole frames (spans injected before them, Mimi, step, host reads), device synchronised",
    }
    doc["results"] = results
    doc["capacity"] = capacity
    doc["notes"] = notes
    return doc


def capacity_table(doc: dict[str, Any]) -> str:
    """Markdown of a capacity document."""
    budget = doc["config"]["budget_ms"]
    lines = [
        f"| KV cache | batch | KV GiB | frame P50, ms | frame P99, ms | spans read | under {budget:g} ms |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in doc["results"]:
        if not r.get("fits", True):
            lines.append(f"| {r['kv_dtype']} | {r['batch_size']} | {r['kv_gib']:.1f} | – | – | – | does not fit |")
            continue
        f = r["frame"]
        ok = "yes" if r["real_time"] else "no"
        lines.append(
            f"| {r['kv_dtype']} | {r['batch_size']} | {r['kv_gib']:.1f} | {f['p50_ms']:.1f} | {f['p99_ms']:.1f} | "
            f"{r['spans']} | {ok} |"
        )
    cap = ", ".join(f"{kv}: {b if b is not None else 'none'}" for kv, b in doc["capacity"].items())
    notes = "".join(f"\n\nNote: {note}." for note in doc.get("notes", []))
    return "\n".join(lines) + f"\n\nSessions per device at frame P99 < {budget:g} ms: {cap}." + notes


__all__ = ["CapacityOptions", "arrivals", "capacity_table", "kv_bytes_per_session", "run_capacity"]
