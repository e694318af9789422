"""``cspan bench latency``: the Context Span latency table, the plain step, the whole frame, and batch rows on a full
ring with spans arriving into k of B sessions.

What is timed (wall clock between two device synchronisations, ``torch.cuda.synchronize`` on CUDA):

- **rows**, one per span length ``n`` (default 0, 16, 64, 256, 600 as in the original README's "Context Span
  processing latency" table, ``docs/reference/context-spanning-original.md`` sections 3.2 and 7.5): for ``n > 0``
  ``DuplexEngine.inject_span`` of a block of exactly ``n`` columns (``[12] + (n - 2) tokens + [13]``) followed by
  one decoding step, which reads the block in its forward (the row's ``prefill`` is the injection's host time and
  ``next_step`` the step); ``n = 0`` is a plain step. The decoding step is the LM step (``step_tokens``: temporal
  transformer, text sampling, depformer) by default, or the whole frame with ``row_step="frame"``;
- **step**: the plain LM step alone (and, for dep_q = 16 models with ``predict_user`` off, **step_predict_user**:
  the same step sampling the depformer's user-stream codebooks as well, as upstream PersonaPlex does);
- **frame**: the whole 80 ms frame as a server runs it: Mimi streaming encode of the user PCM, the LM step, Mimi
  streaming decode, and reading the text token and the agent PCM back to the host;
- **batch** (optional): at batch sizes B > 1 (all sessions in lock step) the plain step, the whole frame, and for
  each span length ``n > 0`` the whole frame in which ``span_sessions`` (k) of the B sessions each read an n-column
  span, with that frame's excess over a plain frame. The spans arrive as ``cspan serve`` reads them: injected and
  their step prepared (``DuplexEngine.prepare``) between two frames, then the frame is timed from its start (its
  host tables and decode plan were built while the device idled); ``span_at_tick`` injects them inside the timed
  frame instead, right before its step.

Every series starts from sessions holding ``fill`` positions of history: by default the model's context, a full
ring (a served conversation is there after four minutes: 3000 positions = 240 s), so the attention reads what it
reads late in a conversation; ``fill = 0`` times freshly reset streams (short KV caches). The history is read as
blocks of ordinary text ids (untimed). Each series runs ``warmup`` unmeasured iterations and then ``iters``
measured ones, reporting mean, sample standard deviation, P50 and P99 (linear interpolation), min and max in
milliseconds. Between two span iterations ``gap_steps`` unmeasured plain steps run, so every block is read into a
live stream; the ring keeps ``context`` positions, so a long series of spans never runs out of room. By default
the calls run back to back (the GPU never idles); ``pace_ms`` (80: a server's frame clock) starts every call, timed or
not, on a clock of that period, as a server in real time does, so the GPU idles between frames as it does when
serving: a step that fills the frame back to back can hold a GPU at its power limit, where its clock drops (C81).

The model comes from a checkpoint, or is built at the real 7B dimensions (``LMConfig.personaplex_7b()``, with
``MimiConfig.mimi_24khz()``) with random weights: built on the ``meta`` device and materialised directly on the
target device with a cheap in-place initialisation (:func:`random_lm`, :func:`random_mimi`), so the 8 B
parameters are never allocated on the host first. The output is the JSON that :mod:`cspan.bench.report` reads
(``{gpu, torch, dtype, rows: [{n, mean_ms, sd_ms, p99_ms, ...}], step: {...}}``) plus GPU name, driver, CUDA
version, date, configuration, ``frame`` and ``batch``.
"""

from __future__ import annotations

import datetime as _dt
import math
import platform
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cspan.bench.errors import BenchError, BenchSettingsError
from cspan.bench.session import parse_dtype, synchronize

DEFAULT_SPAN_LENGTHS = (0, 16, 64, 256, 600)
"""Span lengths (columns, markers included) of the original README's table; 0 = a plain step."""
ROOM_TONE_STD = 1e-3
"""Standard deviation of the Gaussian "quiet room" user audio fed while timing (the original's prefill_timing.py)."""


# --- statistics --------------------------------------------------------------------------------------------------


def summarize_ms(samples: Sequence[float]) -> dict[str, float | int]:
    """Mean, sample standard deviation (ddof 1; 0 for one sample), P50, P99 (numpy's linear interpolation), min
    and max of ``samples`` in milliseconds, and their count ``iters``.

    Raises:
        ValueError: no samples.
    """
    if not samples:
        raise ValueError("summarize_ms: no samples")
    x = np.asarray(samples, dtype=np.float64)
    return {
        "mean_ms": float(x.mean()),
        "sd_ms": float(x.std(ddof=1)) if x.size > 1 else 0.0,
        "p50_ms": float(np.percentile(x, 50)),
        "p99_ms": float(np.percentile(x, 99)),
        "min_ms": float(x.min()),
        "max_ms": float(x.max()),
        "iters": int(x.size),
    }


class Timer:
    """Wall-clock milliseconds of a region between two synchronisations of ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Run ``fn`` once and return its duration in ms (the device is synchronised before and after)."""
        synchronize(self.device)
        t0 = time.perf_counter()
        fn()
        synchronize(self.device)
        return (time.perf_counter() - t0) * 1000.0


# --- random models at the real dimensions -----------------------------------------------------------------------


def _fan_in(shape: Sequence[int]) -> int:
    return max(1, int(math.prod(shape[1:])))


@torch.no_grad()
def init_cheap_(module: torch.nn.Module, *, seed: int = 0) -> torch.nn.Module:
    """Initialise every parameter and buffer of ``module`` in place, on its own device, without host copies.

    Matrices and convolution kernels: N(0, 1/fan_in); norm gains (``alpha``, 1-D ``weight``): 1; biases: 0;
    LayerScale ``scale``: 0.01; codebooks: ``embedding_sum`` N(0, 1), ``cluster_usage`` and ``_initialized`` 1.
    Good enough for timing (no NaN or overflow), not a trained model. Returns ``module``.
    """
    device = next(module.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "alpha":
            p.fill_(1.0)
        elif leaf == "scale":
            p.fill_(0.01)
        elif leaf == "bias":
            p.zero_()
        elif p.dim() == 1:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 1.0 / math.sqrt(_fan_in(p.shape)), generator=gen)
    for name, b in module.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "embedding_sum":
            b.normal_(0.0, 1.0, generator=gen)
        elif b.is_floating_point():
            b.fill_(1.0)
    return module


def random_lm(cfg: Any, device: torch.device | str, dtype: torch.dtype, *, seed: int = 0) -> Any:
    """An :class:`~cspan.core.lm.LMModel` of configuration ``cfg`` with random weights, built on ``meta`` and
    materialised directly on ``device`` (``to_empty`` + :func:`init_cheap_`), in eval mode.

    ``device="meta"`` returns the bare meta model (shapes only, no memory).
    """
    from cspan.core.lm import LMModel

    model = LMModel(cfg, device="meta", dtype=dtype)
    if torch.device(device).type == "meta":
        return model.eval()
    model = model.to_empty(device=device)
    return init_cheap_(model, seed=seed).eval()


def random_mimi(cfg: Any, device: torch.device | str, *, seed: int = 1) -> Any:
    """A float32 :class:`~cspan.core.mimi.Mimi` of configuration ``cfg`` with random weights, materialised
    directly on ``device``, encoding 8 codebooks, in eval mode."""
    from cspan.core.mimi import Mimi

    mimi = Mimi(cfg, device="meta", dtype=torch.float32).to_empty(device=device)
    init_cheap_(mimi, seed=seed)
    mimi.set_num_codebooks(8)
    return mimi.eval()


# --- the measurement ---------------------------------------------------------------------------------------------


@dataclass
class LatencyOptions:
    """What :func:`run_latency` measures.

    Attributes:
        span_lengths: the ``n`` of the rows (0 = plain step; others >= 3); the batch rows time the ``n > 0`` ones.
        iters: measured iterations per series.
        warmup: unmeasured iterations before each series (and warm-up frames at the start).
        gap_steps: unmeasured plain steps between two span iterations.
        row_step: ``"lm"`` (the LM step after the span) or ``"frame"`` (Mimi encode + LM step + Mimi decode).
        batch_sizes: batch sizes B > 1 for the batch series (empty: none).
        frame: time the whole frame.
        seed: sampler and data seed.
        cuda_graphs: replay the step from a CUDA graph (None: the engine's default, on for CUDA; False: eager).
        predict_user: the engine samples the depformer's user-stream codebooks too (upstream PersonaPlex); False
            (the default, as ``cspan serve`` and ``cspan infer`` run) skips them, since the user's codes arrive
            every frame. With False the plain step is also timed with them (``step_predict_user``).
        fill: positions of history every session holds before each series (None: the model's context, a full ring;
            0: a freshly reset stream).
        span_sessions: k, the sessions of a batch that read a span in the same frame (batch rows).
        kv_dtype: the engine's KV cache storage ("auto", "bf16", "fp8", ...).
        pace_ms: start every call, timed or not, on a clock of this period in ms (80: real time, a server's frame
            clock); 0 (the default): back to back. A call that overruns the period starts the next one at once.
        span_at_tick: in the batch span frames, inject the spans inside the timed frame, right before its step
            (the step then builds its inputs itself); False (the default): as ``cspan serve`` reads a span, injected
            and its step prepared (``DuplexEngine.prepare``) when it arrives, between two frames, and the frame
            timed from its start. Either way the injection's host time is reported (``inject_samples_ms``).
    """

    span_lengths: Sequence[int] = DEFAULT_SPAN_LENGTHS
    iters: int = 100
    warmup: int = 10
    gap_steps: int = 2
    row_step: str = "lm"
    batch_sizes: Sequence[int] = ()
    frame: bool = True
    seed: int = 0
    cuda_graphs: bool | None = None
    predict_user: bool = False
    fill: int | None = None
    span_sessions: int = 1
    kv_dtype: str = "auto"
    pace_ms: float = 0.0
    span_at_tick: bool = False

    def check(self, context: int | None = None) -> None:
        """Raise :class:`BenchSettingsError` (exit status 2) for impossible settings; with the model's ``context`` (positions of its KV
        ring), also for a span or a history that cannot fit it (a span longer than the ring cannot be read in one
        piece, and its buffers would be sized by ``--n``; history beyond a full ring changes nothing and takes as
        many steps as positions)."""
        if self.iters < 1:
            raise BenchSettingsError(f"--iters must be >= 1, got {self.iters}")
        if self.warmup < 0 or self.gap_steps < 0:
            raise BenchSettingsError("--warmup and --gap-steps must be >= 0")
        bad = [n for n in self.span_lengths if n != 0 and n < 3]
        if bad or any(n < 0 for n in self.span_lengths):
            raise BenchSettingsError(
                f"--n {bad or list(self.span_lengths)}: a span needs n >= 3 columns (12, token, 13)"
            )
        if self.row_step not in ("lm", "frame"):
            raise BenchSettingsError(f"--row-step {self.row_step!r}: use 'lm' or 'frame'")
        if any(b < 1 for b in self.batch_sizes):
            raise BenchSettingsError(f"--batch-size {list(self.batch_sizes)}: batch sizes must be >= 1")
        if not (math.isfinite(self.pace_ms) and self.pace_ms >= 0):
            raise BenchSettingsError(f"--pace-ms must be a finite number >= 0 ms, got {self.pace_ms}")
        if self.fill is not None and self.fill < 0:
            raise BenchSettingsError(f"--fill must be >= 0 positions, got {self.fill}")
        if self.span_sessions < 0 or any(self.span_sessions > b for b in self.batch_sizes):
            raise BenchSettingsError(
                f"--span-sessions {self.span_sessions}: between 0 and the smallest batch size {list(self.batch_sizes)}"
            )
        rows = [b for b in self.batch_sizes if b > 1]  # B = 1 is the main table, not a batch row
        if not rows and (self.span_sessions != 1 or self.span_at_tick):  # else ignored without a word
            flag = f"--span-sessions {self.span_sessions}" if self.span_sessions != 1 else "--span-at-tick"
            raise BenchSettingsError(f"{flag}: acts on the batch rows only; give them with --batch-size B (B > 1)")
        if context:
            long = [n for n in self.span_lengths if n > context - 1]
            if long:
                raise BenchSettingsError(
                    f"--n {long}: a span must fit the model's context of {context} positions (n <= {context - 1})"
                )
            if self.fill is not None and self.fill > context:
                raise BenchSettingsError(
                    f"--fill {self.fill}: more than the model's context of {context} positions (a full ring); "
                    f"leave --fill out for a full ring"
                )


@dataclass
class _Inputs:
    """Pre-drawn inputs of one engine: user codes [iters, B, 8] on the device, user PCM [iters, B, 1920] on the
    host (a server receives PCM from the network), span body ids."""

    codes: torch.Tensor
    pcm: torch.Tensor
    k: int = 0

    def next_codes(self) -> torch.Tensor:
        c = self.codes[self.k % self.codes.shape[0]]
        self.k += 1
        return c

    def next_pcm(self) -> torch.Tensor:
        p = self.pcm[self.k % self.pcm.shape[0]]
        self.k += 1
        return p


def _inputs(engine: Any, count: int, seed: int) -> _Inputs:
    gen = torch.Generator().manual_seed(seed)
    B, C = engine.batch_size, engine.num_codebooks
    card = int(engine.lm.card)
    codes = torch.randint(0, card, (count, B, C), generator=gen).to(engine.device)
    pcm = torch.randn((count, B, 1920), generator=gen) * ROOM_TONE_STD
    return _Inputs(codes=codes, pcm=pcm)


def span_body(n: int, text_card: int, seed: int = 0) -> list[int]:
    """``n - 2`` ordinary text ids (drawn in ``[32, text_card)``, so no special id) for a block of exactly ``n``
    columns once the 12 / 13 markers are added."""
    gen = torch.Generator().manual_seed(seed + n)
    low = min(32, max(0, text_card - 1))
    return torch.randint(low, text_card, (n - 2,), generator=gen).tolist()


FILL_TOKENS_PER_STEP = 8192
"""History filling reads at most this many block columns per step (all sessions together)."""


def fill_history(engine: Any, positions: int, seed: int = 0, step: Callable[[], Any] | None = None) -> None:
    """Bring every session of ``engine`` to at least ``positions`` positions of history: blocks of ordinary text
    ids (at most ``max_span_frames`` each) read as Context Spans, at most :data:`FILL_TOKENS_PER_STEP` columns per
    step, one step after each round (untimed). ``step`` steps the engine (default: ``step_tokens`` with zero user
    codes). Returns once every span is read (an engine with a ``max_block_columns`` budget reads them over more
    steps)."""
    from cspan.core.span import ContextSpan

    longest = max(3, int(engine.max_span_frames))
    text_card = int(engine.lm.text_card)
    if step is None:
        zeros = torch.zeros(engine.batch_size, engine.num_codebooks, dtype=torch.long, device=engine.device)

        def step() -> Any:
            return engine.step_tokens(zeros)

    while True:
        short = [i for i in range(engine.batch_size) if engine.positions[i] + 1 < positions]
        if not short:
            break
        budget = FILL_TOKENS_PER_STEP
        for i in short:
            n = min(longest, max(3, positions - engine.positions[i] - 1))
            if n > budget and budget < FILL_TOKENS_PER_STEP:
                break
            engine.inject_span(i, ContextSpan.from_ids(span_body(n, text_card, seed + i)))
            budget -= n
        step()
    while engine.sessions.blocks:  # spans an engine's step budget held back (the positions above count them)
        step()
    synchronize(engine.device)


@dataclass
class _Series:
    total: list[float] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)
    next_step: list[float] = field(default_factory=list)


class LatencyBench:
    """Times one engine (see the module docstring). ``engine`` is a :class:`~cspan.core.engine.DuplexEngine`."""

    def __init__(self, engine: Any, options: LatencyOptions) -> None:
        self.engine = engine
        self.options = options
        self.device = engine.device
        self.timer = Timer(self.device)
        count = max(8, options.iters + options.warmup)
        self.inputs = _inputs(engine, count, options.seed)
        context = engine.context or 0
        self.fill = context if options.fill is None else options.fill
        self._tick: float | None = None  # when the next paced call may start (time.perf_counter)

    # -- primitives --------------------------------------------------------------------------------------------

    def lm_step(self) -> None:
        """One LM step for every session (no codec)."""
        self.engine.step_tokens(self.inputs.next_codes())

    def frame(self) -> None:
        """One whole frame: PCM in (host), Mimi encode, LM step, Mimi decode, text token and PCM to the host."""
        out = self.engine.step(self.inputs.next_pcm())
        out.text_token.cpu()
        out.agent_pcm.cpu()

    def pace(self) -> None:
        """With ``pace_ms``: wait for the next tick of the frame clock (none when the last call overran it)."""
        period = self.options.pace_ms / 1000.0
        if not period:
            return
        now = time.perf_counter()
        if self._tick is not None and now < self._tick:
            time.sleep(self._tick - now)
            now = self._tick
        self._tick = now + period

    def restart(self) -> None:
        """Reset every session and start its stream with a few frames (a span needs a running stream), then fill
        its history to the bench's fill (a full ring by default)."""
        for i in range(self.engine.batch_size):
            self.engine.reset(i, seed=self.options.seed + i)
        for _ in range(max(2, self.engine.max_delay + 1)):
            self.lm_step()
        fill_history(self.engine, self.fill, self.options.seed, self.lm_step)

    def series(self, fn: Callable[[], Any]) -> list[float]:
        """``warmup`` unmeasured then ``iters`` measured runs of ``fn`` (ms)."""
        for _ in range(self.options.warmup):
            self.pace()
            fn()
        synchronize(self.device)
        times = []
        for _ in range(self.options.iters):
            self.pace()
            times.append(self.timer(fn))
        return times

    def span_series(
        self,
        n: int,
        sessions: Sequence[int] = (0,),
        step: Callable[[], Any] | None = None,
        arrive_early: bool = False,
    ) -> _Series:
        """Spans of ``n`` columns into ``sessions`` + one step, ``warmup`` + ``iters`` times, with ``gap_steps``
        steps between. ``arrive_early``: the spans are injected and the step prepared before the step's tick (as
        ``cspan serve`` does when a span arrives between frames), and only the step is timed (``total``); else
        the injection is timed with the step (``total`` = ``prefill`` + ``next_step``)."""
        from cspan.core.span import ContextSpan

        body = span_body(n, int(self.engine.lm.text_card), self.options.seed)
        span = ContextSpan.from_ids(body)
        if step is None:
            step = self.frame if self.options.row_step == "frame" else self.lm_step
        result = _Series()
        for k in range(self.options.warmup + self.options.iters):
            for _ in range(self.options.gap_steps):
                self.pace()
                self.lm_step()
            if arrive_early:  # between two frames: the span arrives, its step is prepared; then the frame's tick
                synchronize(self.device)
                ta = time.perf_counter()
                reports = [self.engine.inject_span(i, span) for i in sessions]
                self.engine.prepare()
                arrival = (time.perf_counter() - ta) * 1000.0
                self.pace()
                synchronize(self.device)
                t0 = t1 = time.perf_counter()
            else:
                self.pace()
                synchronize(self.device)
                t0 = time.perf_counter()
                reports = [self.engine.inject_span(i, span) for i in sessions]
                t1 = time.perf_counter()
                arrival = (t1 - t0) * 1000.0
            step()
            synchronize(self.device)
            t2 = time.perf_counter()
            if any(r.n != n for r in reports):
                raise BenchError(f"span of {n} columns was read as {reports[0].n}; raise --max-span-frames")
            if k >= self.options.warmup:
                result.total.append((t2 - t0) * 1000.0)
                result.prefill.append(arrival)
                result.next_step.append((t2 - t1) * 1000.0)
        return result

    # -- the table ---------------------------------------------------------------------------------------------

    def run(self, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Measure everything for this engine; returns ``{"rows", "step", "frame"}``."""
        say = progress or (lambda _msg: None)
        self.restart()
        for _ in range(self.options.warmup):
            if self.engine.mimi is not None and self.options.frame:
                self.frame()
            self.lm_step()
        say("plain step")
        step = summarize_ms(self.series(self.lm_step))
        step_predict_user = None
        if not self.engine.predict_user and self.engine.dep_q > self.engine.num_codebooks:
            say("plain step with the user-stream predictions")
            self.engine.predict_user = True
            step_predict_user = summarize_ms(self.series(self.lm_step))
            self.engine.predict_user = False
        frame = None
        if self.options.frame and self.engine.mimi is not None:
            say("whole frame")
            self.restart()
            frame = summarize_ms(self.series(self.frame))
        rows = []
        for n in self.options.span_lengths:
            self.restart()
            if n == 0:
                say("n = 0 (plain step)")
                fn = self.frame if self.options.row_step == "frame" else self.lm_step
                rows.append({"n": 0, **summarize_ms(self.series(fn))})
                continue
            say(f"n = {n}")
            s = self.span_series(n)
            prefill, nxt = summarize_ms(s.prefill), summarize_ms(s.next_step)
            rows.append(
                {
                    "n": n,
                    **summarize_ms(s.total),
                    "prefill_mean_ms": prefill["mean_ms"],
                    "prefill_p99_ms": prefill["p99_ms"],
                    "next_step_mean_ms": nxt["mean_ms"],
                    "next_step_p99_ms": nxt["p99_ms"],
                }
            )
        return {"rows": rows, "step": step, "step_predict_user": step_predict_user, "frame": frame}

    def run_batch(self, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Plain step, whole frame and span frames for all sessions of this engine (``per_session_mean_ms`` = mean
        / B; ``spans``: k sessions read an n-column span in the timed frame, with its excess over a plain frame)."""
        say = progress or (lambda _msg: None)
        B = self.engine.batch_size
        self.restart()
        step = summarize_ms(self.series(self.lm_step))
        out: dict[str, Any] = {"batch_size": B, "step": step, "step_per_session_mean_ms": step["mean_ms"] / B}
        timed = self.frame if self.options.frame and self.engine.mimi is not None else self.lm_step
        if self.options.frame and self.engine.mimi is not None:
            frame = summarize_ms(self.series(self.frame))
            out["frame"] = frame
            out["frame_per_session_mean_ms"] = frame["mean_ms"] / B
        plain = out.get("frame", step)
        k = self.options.span_sessions
        spans = []
        for n in [n for n in self.options.span_lengths if n > 0] if k else []:
            say(f"batch {B}: spans of {n} columns into {k} sessions")
            sessions = [(j * B) // k for j in range(k)]  # spread over the batch
            series = self.span_series(n, sessions, timed, arrive_early=not self.options.span_at_tick)
            s = summarize_ms(series.total)
            spans.append(
                {
                    "n": n,
                    "sessions": k,
                    "frame": s,
                    "minus_plain_p50_ms": s["p50_ms"] - plain["p50_ms"],
                    "minus_plain_p99_ms": s["p99_ms"] - plain["p99_ms"],
                    # each timed frame in order, and the host time of its injection (with the step's preparation
                    # when the spans arrive before the frame, the default; else part of the frame): a p99's source
                    "frame_samples_ms": [round(x, 3) for x in series.total],
                    "inject_samples_ms": [round(x, 3) for x in series.prefill],
                    "inject_samples_cover": "inject_span, inside the frame"
                    if self.options.span_at_tick
                    else "inject_span + DuplexEngine.prepare, between frames (not part of the frame)",
                }
            )
        out["spans"] = spans
        return out


# --- the environment ---------------------------------------------------------------------------------------------


def nvidia_driver() -> str | None:
    """The NVIDIA driver version from ``nvidia-smi`` (None when the tool is absent or fails)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return lines[0] if lines else None


def environment(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """``gpu`` (the GPU's name, or ``cpu: <processor>``), ``gpu_name``, ``driver``, ``torch``, ``cuda``, ``dtype``,
    ``date`` (UTC, ISO 8601), ``host``."""
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    cpu = platform.processor() or platform.machine()
    return {
        "gpu": gpu_name or f"cpu: {cpu}",
        "gpu_name": gpu_name,
        "driver": nvidia_driver() if device.type == "cuda" else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(dtype).replace("torch.", ""),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
    }


def _lm_summary(lm: Any) -> dict[str, Any]:
    cfg = lm.cfg
    return {
        "dim": cfg.dim,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "context": cfg.context,
        "n_q": cfg.n_q,
        "dep_q": cfg.dep_q,
        "depformer_dim": cfg.depformer_dim,
        "depformer_num_layers": cfg.depformer_num_layers,
        "text_card": cfg.text_card,
        "card": cfg.card,
        "num_parameters": int(sum(p.numel() for p in lm.parameters())),
    }


def _mimi_summary(mimi: Any) -> dict[str, Any] | None:
    if mimi is None:
        return None
    return {
        "sample_rate": int(mimi.sample_rate),
        "frame_rate": float(mimi.frame_rate),
        "num_codebooks": int(mimi.num_codebooks),
        "num_parameters": int(sum(p.numel() for p in mimi.parameters())),
    }


# --- building the models and running ----------------------------------------------------------------------------


@dataclass
class Models:
    """The LM, Mimi and tokenizer to time, and where they came from."""

    lm: Any
    mimi: Any
    tokenizer: Any
    source: str
    random: bool


def load_models(
    checkpoint: str | None,
    *,
    random_7b: bool,
    device: torch.device,
    dtype: torch.dtype,
    allow_cpu: bool = False,
    seed: int = 0,
) -> Models:
    """The models to time: a checkpoint (any source :func:`~cspan.core.checkpoint.load_checkpoint` takes), or
    the 7B (``LMConfig.personaplex_7b()``) and the real Mimi (``MimiConfig.mimi_24khz()``) with random weights.

    Raises:
        BenchSettingsError: neither or both of ``checkpoint`` and ``random_7b``. BenchError: ``random_7b`` on a CPU
            without ``allow_cpu`` (it would need 16-32 GB of host memory and minutes per frame).
    """
    if (checkpoint is None) == (not random_7b):
        raise BenchSettingsError("give exactly one of --checkpoint DIR and --random-7b")
    if random_7b:
        if device.type == "cpu" and not allow_cpu:
            raise BenchError(
                "--random-7b builds the 8 B-parameter model: it needs a CUDA GPU (none is available, or --device cpu "
                "was given). Pass --allow-cpu to build it in host memory anyway (16 GB in bf16, 32 GB in fp32; "
                "seconds per frame), or time a small model with --checkpoint DIR"
            )
        from cspan.core.config import LMConfig, MimiConfig

        lm = random_lm(LMConfig.personaplex_7b(), device, dtype, seed=seed)
        mimi = random_mimi(MimiConfig.mimi_24khz(), device, seed=seed + 1)
        return Models(lm=lm, mimi=mimi, tokenizer=None, source="random personaplex_7b + mimi_24khz", random=True)
    from cspan.core.checkpoint import load_checkpoint

    assert checkpoint is not None
    ckpt = load_checkpoint(checkpoint, device=device, dtype=dtype)
    return Models(lm=ckpt.lm, mimi=ckpt.mimi, tokenizer=ckpt.tokenizer, source=str(checkpoint), random=False)


def make_engine(
    models: Models,
    batch_size: int,
    span_lengths: Sequence[int] = (),
    cuda_graphs: bool | None = None,
    predict_user: bool = False,
    kv_dtype: str = "auto",
    max_block_columns: int | None = None,
) -> Any:
    """A :class:`~cspan.core.engine.DuplexEngine` over ``models`` whose ``max_span_frames`` admits every length
    (``cuda_graphs`` None: the engine's default, on for CUDA; ``max_block_columns``: its step budget of span
    columns, None for none)."""
    from cspan.core.constants import DEFAULT_MAX_SPAN_FRAMES
    from cspan.core.engine import DuplexEngine

    return DuplexEngine(
        models.lm,
        batch_size=batch_size,
        seed=0,
        mimi=models.mimi,
        tokenizer=models.tokenizer,
        max_span_frames=max([DEFAULT_MAX_SPAN_FRAMES, *span_lengths]),
        cuda_graphs=cuda_graphs,
        predict_user=predict_user,
        kv_dtype=kv_dtype,
        max_block_columns=max_block_columns,
    )


def release_device_memory(device: torch.device) -> None:
    """Free what a dropped engine held (its CUDA graphs and caches refer to it in cycles, so collect first): the
    next, larger engine needs that memory (a full 3000-position ring is 1.57 GB of bf16 KV per session)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def decode_attention_name(plan: Any) -> str:
    """How the engine's step reads the KV ring, as the report says it: the Triton kernel or FlashInfer's decode
    (fused path), or torch's ``scaled_dot_product_attention`` (eager: the CPU, and CUDA without the fused kernels;
    it was reported as "triton" there)."""
    if not plan.fused:
        return "eager (torch scaled_dot_product_attention)"
    return "triton" if plan.library is None else f"flashinfer ({plan.library})"


def run_latency(
    models: Models,
    options: LatencyOptions,
    *,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every series and return the JSON document (see the module docstring)."""
    options.check(context=models.lm.cfg.context)
    say = progress or (lambda _msg: None)
    kw = {"cuda_graphs": options.cuda_graphs, "predict_user": options.predict_user, "kv_dtype": options.kv_dtype}
    engine = make_engine(models, 1, options.span_lengths, **kw)
    bench = LatencyBench(engine, options)
    measured = bench.run(progress=say)
    plan, fill = engine.plan, bench.fill
    del bench, engine
    release_device_memory(device)
    batch_rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for B in options.batch_sizes:
        if B == 1:
            continue
        say(f"batch {B}")
        try:
            batch_engine = make_engine(models, B, options.span_lengths, **kw)
            batch_rows.append(LatencyBench(batch_engine, options).run_batch(progress=say))
        except torch.OutOfMemoryError as exc:  # a batch that does not fit: say so, keep the rows measured so far
            say(f"batch {B}: out of device memory, skipped ({str(exc).splitlines()[0]})")
            skipped.append({"batch_size": B, "error": "out of device memory"})
        batch_engine = None
        release_device_memory(device)
    doc: dict[str, Any] = environment(device, dtype)
    doc["config"] = {
        "source": models.source,
        "random_weights": models.random,
        "device": str(device),
        "lm": _lm_summary(models.lm),
        "mimi": _mimi_summary(models.mimi),
        "span_lengths": list(options.span_lengths),
        "iters": options.iters,
        "warmup": options.warmup,
        "gap_steps": options.gap_steps,
        "row_step": options.row_step,
        "cuda_graphs": bool(plan.cuda_graphs),
        "fused": bool(plan.fused),
        "kv_dtype": str(plan.kv_dtype).replace("torch.", ""),
        "decode_attention": decode_attention_name(plan),
        "predict_user": options.predict_user,
        "defer_spans": True,  # a span is read in the step that follows it (the engine's only way)
        "fill": fill,
        "span_sessions": options.span_sessions,
        "pace_ms": options.pace_ms,
        "span_at_tick": options.span_at_tick,
        "timing": "wall clock between device synchronisations (torch.cuda.synchronize on CUDA)",
        "span_ids": "[12] + (n - 2) random ordinary text ids + [13]",
    }
    doc["rows"] = measured["rows"]
    doc["step"] = measured["step"]
    doc["step_predict_user"] = measured["step_predict_user"]
    doc["frame"] = measured["frame"]
    doc["batch"] = {"sizes": [r["batch_size"] for r in batch_rows], "rows": batch_rows, "skipped": skipped}
    return doc


def latency_table(doc: dict[str, Any], label: str = "latency") -> str:
    """Markdown of a latency document: the report's span table (:func:`cspan.bench.report.latency_markdown`),
    then the whole frame and the batch rows."""
    from cspan.bench.report import latency_markdown
    from cspan.bench.run_files import LatencyReport

    parts = [latency_markdown(label, LatencyReport.model_validate(doc))]
    frame = doc.get("frame")
    if frame:
        parts.append(
            f"Whole frame (Mimi encode + step + Mimi decode): {frame['mean_ms']:.1f} ± {frame['sd_ms']:.1f} ms, "
            f"P50 {frame['p50_ms']:.1f} ms, P99 {frame['p99_ms']:.1f} ms."
        )
    rows = (doc.get("batch") or {}).get("rows") or []
    if rows:
        lines = [
            "| batch | step mean ± sd, ms | step P50, ms | step P99, ms | per session, ms | frame mean ± sd, ms | "
            "frame P50, ms | frame P99, ms |"
        ]
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            s, f = r["step"], r.get("frame")
            frame_cells = (
                f"{f['mean_ms']:.1f} ± {f['sd_ms']:.1f} | {f['p50_ms']:.1f} | {f['p99_ms']:.1f}" if f else "– | – | –"
            )
            lines.append(
                f"| {r['batch_size']} | {s['mean_ms']:.1f} ± {s['sd_ms']:.1f} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | "
                f"{r['step_per_session_mean_ms']:.2f} | {frame_cells} |"
            )
        parts.append("\n".join(lines))
        span_lines = []
        for r in rows:
            for sp in r.get("spans") or []:
                f = sp["frame"]
                span_lines.append(
                    f"| {r['batch_size']} | {sp['n']} | {sp['sessions']} | {f['p50_ms']:.1f} | {f['p99_ms']:.1f} | "
                    f"{sp['minus_plain_p50_ms']:+.1f} | {sp['minus_plain_p99_ms']:+.1f} |"
                )
        if span_lines:
            head = (
                "| batch | span n | sessions with a span | frame P50, ms | frame P99, ms | minus plain P50 | "
                "minus plain P99 |"
            )
            parts.append("\n".join([head, "|---:|---:|---:|---:|---:|---:|---:|", *span_lines]))
            at_tick = (doc.get("config") or {}).get("span_at_tick")
            parts.append(
                "The spans were injected inside the timed frame, right before its step (--span-at-tick)."
                if at_tick
                else "The spans arrived between two frames, as cspan serve reads them: injected and their step "
                "prepared then, the frame timed from its start."
            )
    return "\n\n".join(parts)


__all__ = [
    "DEFAULT_SPAN_LENGTHS",
    "LatencyBench",
    "LatencyOptions",
    "Models",
    "environment",
    "fill_history",
    "init_cheap_",
    "latency_table",
    "load_models",
    "make_engine",
    "parse_dtype",
    "random_lm",
    "random_mimi",
    "run_latency",
    "span_body",
    "summarize_ms",
]
