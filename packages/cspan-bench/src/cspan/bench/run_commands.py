"""The measuring and rendering actions of ``cspan bench``: ``latency``, ``fdb-v1 run``, ``fdb-v3 run``, ``qa``.

Each ``register_*`` function adds one parser to an ``add_subparsers()`` group and sets its handler; they are listed
in :mod:`cspan.bench.commands` (``BENCH_ACTIONS``, ``FDB_V1_ACTIONS``, ``FDB_V3_ACTIONS``). Handlers import torch and
the runners lazily, so ``cspan --help`` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cspan.core.constants import (
    MAX_LISTEN_S,
    MAX_SEED,
    MAX_SPAN_DEADLINE_S,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    SERVE_MAX_BLOCK_COLUMNS,
)

# --- shared flags ------------------------------------------------------------------------------------------------


def _number(value: str) -> float:
    try:
        t = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from exc
    if not math.isfinite(t):
        raise argparse.ArgumentTypeError(f"{value!r} is not a finite number")
    return t


def non_negative(value: str) -> float:
    """argparse type: a finite number >= 0 (argparse prints a one-line error and exits 2 otherwise)."""
    t = _number(value)
    if t < 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be >= 0")
    return t


def positive(value: str) -> float:
    """argparse type: a finite number > 0."""
    t = _number(value)
    if t <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be > 0")
    return t


def at_least_one(value: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        n = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from exc
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be >= 1")
    return n


def in_range(
    low: float, high: float | None = None, *, integer: bool = False, zero: bool = False, unit: str = ""
) -> Any:
    """argparse type: a finite number (an integer with ``integer``) from ``low`` to ``high`` (None: no upper bound),
    or 0 with ``zero``.

    The one place a bench flag's range is declared: out of it, argparse prints one line naming the flag and the
    range and the command exits with status 2 before anything runs."""

    def show(v: float) -> str:
        return str(int(v)) if integer else f"{v:g}"

    span = f"{show(low)} to {show(high)}{unit}" if high is not None else f">= {show(low)}{unit}"
    wanted = f"0 or {span}" if zero else span

    def parse(value: str) -> float | int:
        if integer:
            try:
                t: float | int = int(value)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from exc
        else:
            t = _number(value)
        if not ((low <= t and (high is None or t <= high)) or (zero and t == 0)):
            raise argparse.ArgumentTypeError(f"{value!r} is out of range: give {wanted}")
        return t

    parse.__name__ = "integer" if integer else "number"
    return parse


MIN_OUTPUT_RATE, MAX_OUTPUT_RATE = 8_000, 192_000
"""Sample rates of a written output.wav (Hz): telephone band to studio audio."""
MAX_TAIL_S = 600.0
"""Silence after an input (s), as ``cspan infer``'s ``--tail-silence``."""
MAX_OFFSET_FRAMES = 125
"""80 ms frames of silence before the agent's first frame: at most 10 s."""
MAX_PACE_MS = 60_000.0
"""``cspan bench latency --pace-ms``: a clock period of at most a minute."""
temperature = in_range(MIN_TEMPERATURE, MAX_TEMPERATURE, zero=True)
"""argparse type of a sampling temperature: 0 (greedy) or 0.001 to 10, as ``cspan infer``."""
seed = in_range(0, MAX_SEED, integer=True)
"""argparse type of a seed: 0 to 2**63 - 1."""


def add_model_arguments(parser: argparse.ArgumentParser, *, prompt_help: str) -> None:
    """``--checkpoint`` (required), voice, persona prompt, sampling, seed, device, dtype."""
    g = parser.add_argument_group("model")
    g.add_argument("--checkpoint", required=True, help="Hugging Face repo id, local folder or file of the model")
    g.add_argument(
        "--voice",
        default=None,
        help="voice prompt, as cspan infer takes it: a voice name of the checkpoint (its voices/, or PersonaPlex's "
        "voices.tgz: NATF2), a .pt voice file (codes, or PersonaPlex's embeddings), or a 2-30 s recording (default: "
        "cspan infer's, the first voice of the checkpoint's voices/; none for voices.tgz, which holds a choice: name "
        "one); run.json records the voice used",
    )
    g.add_argument("--no-voice", action="store_true", help="no voice prompt (persona text only)")
    g.add_argument("--text-prompt", default=None, help=prompt_help)
    temps = f"0 = greedy, else {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}"
    g.add_argument("--temp", type=temperature, default=0.8, help=f"audio sampling temperature ({temps}; default 0.8)")
    g.add_argument(
        "--temp-text", type=temperature, default=0.7, help=f"text sampling temperature ({temps}; default 0.7)"
    )
    g.add_argument(
        "--seed",
        type=seed,
        default=42424242,
        help="base seed, 0 to 2**63-1; each item gets base + hash(item id) (default %(default)s)",
    )
    g.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    g.add_argument("--dtype", default=None, help="bf16, fp16, fp32 (default: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--no-cuda-graphs", action="store_true", help="run the CUDA step eagerly")


def add_loop_arguments(
    parser: argparse.ArgumentParser,
    *,
    router_default: str,
    asr_default: str = "sphinx",
    tail_default: float = 0.0,
    tools_default: str | None = None,
) -> None:
    """The conversation loop: transcriber, router, knowledge, clock, forced ``<ret>``, tail silence; and, with
    ``tools_default`` (a ``--tools`` value), the router's tools (``--tools``, ``--mcp``; see :func:`make_bank`)."""
    g = parser.add_argument_group("conversation loop")
    g.add_argument(
        "--asr",
        default=os.environ.get("CSPAN_ASR_URL", asr_default),
        help="transcriber: 'sphinx' (embedded), 'none', a URL with a /v1 path segment (http://host:port/v1) or "
        "openai+ prefix for an OpenAI-compatible /v1/audio/transcriptions endpoint, or any other http(s) URL "
        "(http://host:port, without /v1) for a POST /transcribe server such as `cspan asr-serve` (env CSPAN_ASR_URL; "
        "default %(default)s); also writes the word-timed transcripts of the outputs",
    )
    g.add_argument(
        "--asr-model",
        default=os.environ.get("CSPAN_ASR_MODEL"),
        help="model name for an OpenAI-compatible --asr URL, the /v1 kind (env CSPAN_ASR_MODEL; default qwen3-asr)",
    )
    g.add_argument(
        "--router",
        default=os.environ.get("CSPAN_ROUTER_URL", router_default),
        help="'local' (embedded), 'none', or an OpenAI-compatible base URL (env CSPAN_ROUTER_URL; default %(default)s)",
    )
    g.add_argument("--router-model", default=os.environ.get("CSPAN_ROUTER_MODEL"), help="model name at the router URL")
    g.add_argument(
        "--router-timeout-s", type=positive, default=8.0, help="LLM router time limit per request (s, > 0; default 8)"
    )
    g.add_argument("--knowledge", type=Path, default=None, help="folder of .txt/.md notes for the local router")
    if tools_default is not None:
        from cspan.backends.tools.catalog import TOOL_SETS

        g.add_argument(
            "--tools",
            default=tools_default,
            metavar="NAME,...",
            help=f"the router's built-in tool sets, comma-separated: {', '.join(TOOL_SETS)}, 'default' (all but "
            f"fdb-v3, the benchmark's mock world), 'none' (default: {tools_default}; 'memory' needs a Context DB "
            "and is skipped: runs are stateless)",
        )
        g.add_argument(
            "--mcp",
            action="append",
            default=[],
            metavar="SPEC",
            help="mount an MCP server's tools: a stdio command line or a streamable-HTTP URL, after optional "
            "allow=a,b read=a,b prefix=p_ timeout=S and '--' (repeatable; see docs/OPERATORS.md)",
        )
    g.add_argument(
        "--listen-s",
        type=in_range(0.001, MAX_LISTEN_S),
        default=12.0,
        help=f"ASR window when no utterance transcript is usable (s, at most {MAX_LISTEN_S:g}; as cspan infer; default 12)",
    )
    g.add_argument(
        "--span-delay-s",
        type=non_negative,
        default=0.8,
        help="offline clock: inject each reference exactly this long after it was asked (default %(default)s s)",
    )
    g.add_argument(
        "--span-deadline-s",
        type=in_range(0.001, MAX_SPAN_DEADLINE_S),
        default=10.0,
        help=f"drop a reference later than this after <ret> (s, at most {MAX_SPAN_DEADLINE_S:g}; default 10, where cspan "
        "infer's is 2.5)",
    )
    g.add_argument("--realtime", action="store_true", help="live clock: pace to 80 ms per frame, apply on arrival")
    g.add_argument(
        "--force-ret",
        choices=("none", "input-end"),
        default="none",
        help="also behave as if the model emitted <ret> at the end of each input (+ --force-ret-delay-s); "
        "default none: only the model's own <ret>",
    )
    g.add_argument("--force-ret-delay-s", type=non_negative, default=0.0, help="delay of the forced <ret> (s)")
    g.add_argument(
        "--tail-s",
        type=in_range(0, MAX_TAIL_S),
        default=tail_default,
        help=f"silence after each input (s, 0 to {MAX_TAIL_S:g}; default %(default)s)",
    )


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Resuming, limits and progress."""
    g = parser.add_argument_group("run")
    g.add_argument("--limit", type=at_least_one, default=None, help="only the first N items (in ID order), >= 1")
    g.add_argument("--overwrite", action="store_true", help="render again even where a finished output exists")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def run_reads(args: argparse.Namespace) -> Any:
    """What a benchmark run reads besides its data (:class:`cspan.core.reads.Reads`): every file and folder of
    ``--checkpoint``, a ``--voice`` file and the ``--knowledge`` folder; ``--out`` may be or lie inside none of them."""
    from cspan.core.checkpoint import checkpoint_reads

    reads = checkpoint_reads(args.checkpoint)
    if args.voice and Path(args.voice).expanduser().is_file():
        reads.file("--voice", args.voice)
    return reads.folder("--knowledge", getattr(args, "knowledge", None))


async def make_bank(args: argparse.Namespace) -> Any:
    """The router's tool bank of ``--tools`` and ``--mcp`` (MCP servers start here; ``await bank.aclose()``).

    Raises:
        BenchError: an unknown tool set, a malformed ``--mcp``, or an MCP server that does not start.
    """
    from cspan.backends.errors import ToolError
    from cspan.backends.tools.catalog import ToolsSpec, build_bank
    from cspan.bench.errors import BenchError

    try:
        spec = ToolsSpec.from_flags(args.tools, args.mcp, knowledge=args.knowledge)
        return await build_bank(spec)
    except (ToolError, ValueError) as exc:
        raise BenchError(str(exc)) from exc


def make_retriever(args: argparse.Namespace, transcriber: Any, bank: Any) -> tuple[Any, Any]:
    """``(router, retriever)`` over ``bank`` from the shared runner flags (no Context DB: runs are stateless)."""
    from cspan.backends.retriever import Retriever
    from cspan.bench.session import make_router

    router = make_router(
        args.router, bank, model=args.router_model, knowledge=args.knowledge, timeout_s=args.router_timeout_s
    )
    return router, Retriever(transcriber, router, None, deadline_s=args.span_deadline_s)


def loop_transcriber(args: argparse.Namespace) -> Any:
    """The word-timed transcriber of ``--asr`` (None with ``--asr none``): the one a run's loop hears the user with
    and its outputs are transcribed with. The caller closes it (:func:`open_backends` does)."""
    from cspan.bench.transcribe import make_transcriber

    return make_transcriber(args.asr, model=args.asr_model) if args.asr.lower() != "none" else None


@dataclass
class RunBackends:
    """What a run talks to besides the model: the transcriber, the judge (None without ``--judge-url``) and, unless
    ``--router none``, the tool bank and the router with the retriever over it (None otherwise)."""

    transcriber: Any
    judge: Any
    bank: Any = None
    router: Any = None
    retriever: Any = None


@asynccontextmanager
async def open_backends(args: argparse.Namespace, transcriber: Any) -> AsyncIterator[RunBackends]:
    """The :class:`RunBackends` of a run over ``transcriber`` (:func:`loop_transcriber`): the judge of
    ``--judge-url``, then the bank of ``--tools`` / ``--mcp`` (MCP servers start here) and the router and retriever
    of ``--router``. On the way out, whatever happened (an error, Ctrl-C, SIGTERM), the router, the bank and
    ``transcriber`` are closed quietly, then the judge; the judge's record stays readable for
    :func:`check_judge`.

    Raises:
        BenchError: from :func:`make_bank` or the router's settings (after closing what was opened).
    """
    from cspan.bench.session import close_quietly

    backends = RunBackends(transcriber=transcriber, judge=None)
    try:
        backends.judge = make_judge(args)
        if args.router.lower() != "none":
            backends.bank = await make_bank(args)
            backends.router, backends.retriever = make_retriever(args, transcriber, backends.bank)
        yield backends
    finally:
        await close_quietly(backends.router, backends.bank, transcriber)
        if backends.judge is not None:
            backends.judge.close()


def loop_options(args: argparse.Namespace) -> dict[str, Any]:
    """The fields that every runner's options (``V1RunOptions``, ``V3RunOptions``, ``QARunOptions``) take from the
    model, loop and run flags: persona, seed, tail silence, forced ``<ret>`` (``--force-ret input-end``: one this
    long after each input ends; else none), clock, :func:`loop_config`, overwrite and quiet."""
    return {
        "text_prompt": args.text_prompt,
        "seed": args.seed,
        "tail_s": args.tail_s,
        "force_ret": [args.force_ret_delay_s] if args.force_ret == "input-end" else [],
        "realtime": args.realtime,
        "config": loop_config(args),
        "overwrite": args.overwrite,
        "quiet": args.quiet,
    }


def describe_run(args: argparse.Namespace, session: Any) -> dict[str, Any]:
    """The settings a runner records with its results (what makes two runs comparable)."""
    return {
        "checkpoint": session.identity(),
        "asr": args.asr,
        "router": args.router,
        "router_model": args.router_model,
        "knowledge": str(args.knowledge) if args.knowledge else None,
        "tools": getattr(args, "tools", None),
        "mcp": list(getattr(args, "mcp", [])),
        "span_delay_s": None if args.realtime else args.span_delay_s,
        "span_deadline_s": args.span_deadline_s,
    }


def loop_config(args: argparse.Namespace) -> Any:
    """The :class:`~cspan.core.runtime.ConversationConfig` of the loop flags (no partial transcripts: they only
    feed a live page, and the final transcript of each utterance is what a ``<ret>`` uses)."""
    from cspan.core.runtime import ConversationConfig

    return ConversationConfig(
        listen_s=args.listen_s,
        span_deadline_s=args.span_deadline_s,
        span_delay_s=None if args.realtime else args.span_delay_s,
        partial_transcripts=False,
    )


def check_loop(args: argparse.Namespace, *, text_questions: bool = False) -> None:
    """Refuse a loop whose ``<ret>`` could never be answered: a router without a transcriber to hear the question
    (unless the questions are given as text).

    Raises:
        BenchSettingsError: ``--router`` is set and ``--asr none``.
    """
    from cspan.backends.urls import redact_url
    from cspan.bench.errors import BenchSettingsError

    if args.router.lower() != "none" and args.asr.lower() == "none" and not text_questions:
        raise BenchSettingsError(
            f"--router {redact_url(args.router)} needs the user's words: with --asr none no <ret> can be answered; pass --asr "
            "sphinx (or a transcription server URL), or --router none to run without retrieval"
        )


async def check_backends(args: argparse.Namespace, *, timeout_s: float = 5.0) -> None:
    """Ask the ``--router`` and ``--asr`` URLs (when they are URLs) whether something answers HTTP there, before
    any model loads, as ``cspan infer`` does: a run against a dead backend would otherwise play every item, answer
    no ``<ret>``, and score as if the model had asked nothing.

    Raises:
        BenchError: naming the flag, the URL (without its credentials) and the cause.
    """
    from cspan.backends.http_client import unanswered
    from cspan.backends.urls import redact_url
    from cspan.bench.errors import BenchError

    urls = {flag: value for flag, value in (("--router", args.router), ("--asr", args.asr)) if "://" in value}
    why = await unanswered(urls, timeout_s) if urls else {}
    if why:
        raise BenchError(
            "; ".join(
                f"{flag} {redact_url(urls[flag])}: nothing answers there ({no.why}); start that server or fix the URL"
                for flag, no in why.items()
            )
        )


def build_session_from(args: argparse.Namespace, **extra: Any) -> Any:
    """:func:`cspan.bench.session.build_session` from the model flags."""
    from cspan.bench.session import build_session
    from cspan.core.voice import voice_summary

    session = build_session(
        args.checkpoint,
        device=args.device,
        dtype=args.dtype,
        temp=args.temp,
        temp_text=args.temp_text,
        voice=args.voice,
        no_voice=args.no_voice,
        seed=args.seed,
        cuda_graphs=False if args.no_cuda_graphs else None,
        **extra,
    )
    if not getattr(args, "quiet", False):
        said = (
            "no voice prompt (--no-voice)" if args.no_voice else voice_summary(session.chosen_voice, session.checkpoint)
        )
        print(said, file=sys.stderr)
    return session


def add_judge_arguments(parser: argparse.ArgumentParser, default_model: str, what: str) -> None:
    """``--judge-url``, ``--judge-model``, ``--judge-key-env``, ``--judge-attempts``, ``--judge-timeout-s`` (any
    OpenAI-compatible server); out-of-range values are one-line argparse errors (exit 2)."""
    from cspan.bench.judge import DEFAULT_ATTEMPTS, DEFAULT_TIMEOUT_S, DOWN_AFTER

    group = parser.add_argument_group("judge (any OpenAI-compatible chat-completions server)")
    group.add_argument("--judge-url", help=f"server URL (http://host:port/v1); without it {what} is skipped")
    group.add_argument(
        "--judge-model", default=default_model, help="model name (default: %(default)s, the reference's)"
    )
    group.add_argument(
        "--judge-key-env",
        default="OPENAI_API_KEY",
        help="environment variable holding the API key (default: %(default)s)",
    )
    group.add_argument(
        "--judge-attempts",
        type=at_least_one,
        default=DEFAULT_ATTEMPTS,
        help="tries per judge request, >= 1 (default: %(default)s)",
    )
    group.add_argument(
        "--judge-timeout-s",
        type=positive,
        default=DEFAULT_TIMEOUT_S,
        help=f"time limit of one try, seconds (default: %(default)s); after {DOWN_AFTER} requests in a row fail "
        "the judge is taken as down: the rest is not asked, the run says so and exits with status 1",
    )


def make_judge(args: argparse.Namespace) -> Any:
    """The :class:`~cspan.bench.judge.OpenAIJudge` of ``--judge-url`` (None without it)."""
    if not args.judge_url:
        return None
    from cspan.bench.judge import OpenAIJudge

    return OpenAIJudge(
        args.judge_url,
        args.judge_model,
        api_key_env=args.judge_key_env,
        max_attempts=args.judge_attempts,
        timeout_s=args.judge_timeout_s,
    )


def check_judge(judge: Any, notes: list[str]) -> None:
    """After a run: when the judge went down or failed every request, add a note to ``notes`` (the summary's) and
    raise, so the command prints it and exits with status 1 after the outputs are written.

    Raises:
        JudgeError: the judge's :meth:`~cspan.bench.judge.OpenAIJudge.trouble`.
    """
    from cspan.bench.errors import JudgeError

    trouble = judge.trouble() if judge is not None else None
    if trouble is not None:
        if trouble not in notes:
            notes.append(trouble)
        raise JudgeError(f"{trouble}; check --judge-url / --judge-model and run again")


# --- latency -----------------------------------------------------------------------------------------------------


def register_latency(sub: Any) -> None:
    """``cspan bench latency``."""
    p = sub.add_parser(
        "latency",
        help="Context Span latency table: span prefill + one step, plain step, whole frame",
        description=(
            "Time Context Span injection plus one decoding step for span lengths n (0 = a plain step), the plain "
            "step and the whole frame (Mimi encode + step + Mimi decode): wall clock between device "
            "synchronisations, mean ± sd, P50, P99 over many iterations. Prints a Markdown table; --out writes the "
            "JSON that `cspan bench report` reads."
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="Hugging Face repo id, local folder or file")
    src.add_argument(
        "--random-7b",
        action="store_true",
        help="the real 7B dimensions (LMConfig.personaplex_7b, MimiConfig.mimi_24khz) with random weights, built "
        "directly on the GPU",
    )
    p.add_argument("--allow-cpu", action="store_true", help="let --random-7b build the 8 B model on the CPU")
    p.add_argument(
        "--n",
        type=in_range(3, integer=True, zero=True),
        nargs="+",
        default=[0, 16, 64, 256, 600],
        help="span lengths in columns (0 = plain step, else >= 3 and within the model's context; default: 0 16 64 "
        "256 600)",
    )
    p.add_argument(
        "--iters",
        type=in_range(1, integer=True),
        default=100,
        help="measured iterations per series, >= 1 (default %(default)s)",
    )
    p.add_argument(
        "--warmup",
        type=in_range(0, integer=True),
        default=10,
        help="unmeasured iterations before each series (default %(default)s)",
    )
    p.add_argument(
        "--gap-steps",
        type=in_range(0, integer=True),
        default=2,
        help="plain steps between two timed spans (default %(default)s)",
    )
    p.add_argument(
        "--row-step",
        choices=("lm", "frame"),
        default="lm",
        help="the step timed after each span: 'lm' (LM step, default) or 'frame' (with Mimi encode/decode)",
    )
    p.add_argument(
        "--batch-size",
        type=at_least_one,
        nargs="+",
        default=[],
        help="also time the plain step and the whole frame at these batch sizes B > 1 (B = 1 is the main table)",
    )
    history = p.add_mutually_exclusive_group()
    history.add_argument(
        "--fill",
        type=in_range(0, integer=True),
        default=None,
        help="positions of history every session holds before each series (default: the model's context, a full "
        "ring, as after four minutes of conversation)",
    )
    history.add_argument(
        "--fresh", action="store_true", help="time freshly reset streams (short KV caches) instead of a full ring"
    )
    p.add_argument(
        "--span-sessions",
        type=in_range(0, integer=True),
        default=1,
        help="batch rows: the sessions that each read a span in the timed frame (k of B; default %(default)s)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=("auto", "bf16", "fp16", "fp32", "fp8"),
        default="auto",
        help="KV cache storage (default: auto, the model's dtype)",
    )
    p.add_argument(
        "--pace-ms",
        type=in_range(0, MAX_PACE_MS),
        default=0.0,
        help=f"start every call on a clock of this period, 0 to {MAX_PACE_MS:g} ms (80: real time, as a server's "
        "frame clock; default 0: back to back, the GPU never idles)",
    )
    p.add_argument(
        "--span-at-tick",
        action="store_true",
        help="batch rows: inject the spans inside the timed frame, right before its step (default: as cspan serve "
        "reads a span, injected and its step prepared between frames, when it arrives)",
    )
    p.add_argument("--no-frame", action="store_true", help="skip the whole-frame series")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run the CUDA step eagerly (default: graphed)")
    p.add_argument(
        "--predict-user",
        action="store_true",
        help="sample the depformer's user-stream codebooks in every step, as upstream PersonaPlex does (default: "
        "skipped, as cspan serve / infer run, and the plain step is timed both ways)",
    )
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="bf16, fp16, fp32 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument(
        "--threads",
        type=in_range(1, 1024, integer=True),
        default=None,
        help="torch CPU threads, 1 to 1024 (default: torch's)",
    )
    p.add_argument(
        "--seed", type=seed, default=0, help="seed of the random weights and inputs, 0 to 2**63-1 (default 0)"
    )
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (e.g. RUN/latency.json)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(handler=_latency)


def _latency(args: argparse.Namespace) -> int:
    import torch

    from cspan.bench.latency import LatencyOptions, latency_table, load_models, run_latency
    from cspan.bench.session import check_out, pick_device, write_json

    check_out(args.out)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device, dtype = pick_device(args.device, args.dtype)
    options = LatencyOptions(
        span_lengths=args.n,
        iters=args.iters,
        warmup=args.warmup,
        gap_steps=args.gap_steps,
        row_step=args.row_step,
        batch_sizes=args.batch_size,
        frame=not args.no_frame,
        seed=args.seed,
        cuda_graphs=False if args.no_cuda_graphs else None,
        predict_user=args.predict_user,
        fill=0 if args.fresh else args.fill,
        span_sessions=args.span_sessions,
        kv_dtype=args.kv_dtype,
        pace_ms=args.pace_ms,
        span_at_tick=args.span_at_tick,
    )
    options.check()

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"latency: {msg}", file=sys.stderr, flush=True)

    models = load_models(
        args.checkpoint, random_7b=args.random_7b, device=device, dtype=dtype, allow_cpu=args.allow_cpu, seed=args.seed
    )
    say(f"model ready on {device} ({str(dtype).replace('torch.', '')}): {models.source}")
    doc = run_latency(models, options, device=device, dtype=dtype, progress=say)
    print(latency_table(doc, label=(args.out.parent.name or args.out.stem) if args.out else "latency"))
    if args.out is not None:
        write_json(args.out, doc)
        print(f"wrote {args.out}")
    return 0


def register_capacity(sub: Any) -> None:
    """``cspan bench capacity``."""
    p = sub.add_parser(
        "capacity",
        help="sessions per device at frame p99 < 80 ms on full rings with Context Spans arriving",
        description=(
            "For growing batch sizes and each KV cache dtype: fill every session's ring to the model's context, "
            "then time whole frames while spans arrive as a Poisson process (default one per session per 30 s, "
            "mean 256 columns, at most 600). Prints the largest batch whose frame p99 stays under the budget."
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="Hugging Face repo id, local folder or file")
    src.add_argument("--random-7b", action="store_true", help="the real 7B dimensions with random weights (GPU)")
    p.add_argument("--allow-cpu", action="store_true", help="let --random-7b build the 8 B model on the CPU")
    p.add_argument(
        "--batch-size",
        type=at_least_one,
        nargs="+",
        default=list(DEFAULT_CAPACITY_BATCHES),
        help=f"batch sizes to try, in ascending order (default: {' '.join(map(str, DEFAULT_CAPACITY_BATCHES))})",
    )
    p.add_argument(
        "--kv-dtype",
        nargs="+",
        choices=("auto", "bf16", "fp16", "fp8"),
        default=["auto", "fp8"],
        help="KV cache storages to compare (default: auto fp8; auto is the model's dtype)",
    )
    p.add_argument(
        "--frames",
        type=in_range(1, integer=True),
        default=250,
        help="timed frames per batch size, >= 1 (default %(default)s)",
    )
    p.add_argument("--warmup", type=in_range(0, integer=True), default=20, help="untimed frames first (default 20)")
    p.add_argument(
        "--span-interval", type=float, default=30.0, help="mean seconds between a session's spans (default 30)"
    )
    p.add_argument("--span-length", type=int, default=256, help="mean span length in columns (default %(default)s)")
    p.add_argument("--max-span", type=int, default=600, help="the longest span in columns (default %(default)s)")
    p.add_argument("--budget-ms", type=float, default=80.0, help="frame p99 budget (default: the 80 ms frame)")
    p.add_argument(
        "--max-block-columns",
        type=int,
        default=SERVE_MAX_BLOCK_COLUMNS,
        help="span columns one step reads, the rest waiting for the next frames, as cspan serve's "
        "--max-block-columns (default %(default)s; 0: no limit)",
    )
    p.add_argument("--no-cuda-graphs", action="store_true", help="run the CUDA step eagerly (default: graphed)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="bf16, fp16, fp32 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument(
        "--seed", type=seed, default=0, help="seed of the random weights and arrivals, 0 to 2**63-1 (default 0)"
    )
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (e.g. RUN/capacity.json)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(handler=_capacity)


DEFAULT_CAPACITY_BATCHES = (16, 32, 48, 64, 80, 96, 112, 128)


def _capacity(args: argparse.Namespace) -> int:
    from cspan.bench.capacity import CapacityOptions, capacity_table, run_capacity
    from cspan.bench.latency import load_models
    from cspan.bench.session import check_out, pick_device, write_json

    check_out(args.out)
    device, dtype = pick_device(args.device, args.dtype)
    options = CapacityOptions(
        batch_sizes=args.batch_size,
        kv_dtypes=args.kv_dtype,
        frames=args.frames,
        warmup=args.warmup,
        span_interval_s=args.span_interval,
        span_length=args.span_length,
        max_span=args.max_span,
        budget_ms=args.budget_ms,
        seed=args.seed,
        cuda_graphs=False if args.no_cuda_graphs else None,
        max_block_columns=args.max_block_columns or None,
    )
    options.check()

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"capacity: {msg}", file=sys.stderr, flush=True)

    models = load_models(
        args.checkpoint, random_7b=args.random_7b, device=device, dtype=dtype, allow_cpu=args.allow_cpu, seed=args.seed
    )
    doc = run_capacity(models, options, device=device, dtype=dtype, progress=say)
    print(capacity_table(doc))
    if args.out is not None:
        write_json(args.out, doc)
        print(f"wrote {args.out}")
    return 0


# --- fdb-v1 run ---------------------------------------------------------------------------------------------------


def register_fdb_v1_run(sub: Any) -> None:
    """``cspan bench fdb-v1 run``."""
    p = sub.add_parser(
        "run",
        help="render outputs with the duplex model, transcribe and score them (resumable)",
        description=(
            "Play every DATA/{task}/{ID}/input.wav through the full loop and write OUT/{task}/{ID}/output.wav on the "
            "input's timeline (copying the inputs and task JSONs next to it), then output.json (word-timed ASR), "
            "per-sample run.json, OUT/{task}/summary.json and OUT/summary.md. Finished samples are kept on re-runs."
        ),
    )
    p.add_argument("--data", required=True, type=Path, help="dataset root holding task folders (or one task folder)")
    p.add_argument("--out", required=True, type=Path, help="output root (a dataset in the benchmark's layout)")
    p.add_argument(
        "--tasks",
        nargs="+",
        metavar="TASK[=KIND]",
        help="task folders (default: every folder whose name names a task); KIND: pause_handling, backchannel, "
        "turn_taking, user_interruption",
    )
    p.add_argument("--icc-gt", type=Path, help="backchannel ground truth (default: looked up in DATA)")
    p.add_argument(
        "--output-rate",
        type=in_range(MIN_OUTPUT_RATE, MAX_OUTPUT_RATE, integer=True),
        default=None,
        help=f"sample rate of output.wav, {MIN_OUTPUT_RATE} to {MAX_OUTPUT_RATE} Hz (default: the input's, 16 kHz "
        "for most of the benchmark)",
    )
    p.add_argument(
        "--output-offset-frames",
        type=in_range(0, MAX_OFFSET_FRAMES, integer=True),
        default=1,
        help=f"80 ms frames of silence before the agent's first frame, 0 to {MAX_OFFSET_FRAMES} (default 1, as a "
        "live client hears it)",
    )
    add_model_arguments(p, prompt_help="persona prompt for every task (default: PersonaPlex's FDB prompt per task)")
    add_loop_arguments(p, router_default="local", tools_default="default")
    add_run_arguments(p)
    add_judge_arguments(p, "gpt-4-turbo", "the user-interruption relevance rating")
    p.set_defaults(handler=_fdb_v1_run)


def _find_icc_gt(arg: Path | None, data: Path, tasks: Any) -> Path | None:
    """The backchannel ground truth: ``--icc-gt`` (read now, before the model loads and the samples render: a
    :class:`BenchSettingsError` naming it when it is missing or not the ground truth), else looked up in DATA."""
    from cspan.bench.errors import BenchDataError, BenchSettingsError
    from cspan.bench.fdb_v1 import ICC_GT_JSON, TaskKind, load_icc_gt

    if arg is not None:
        try:
            load_icc_gt(arg)
        except BenchDataError as exc:
            raise BenchSettingsError(f"--icc-gt {arg}: {exc}") from None
        return arg
    if not any(t.kind is TaskKind.BACKCHANNEL for t in tasks):
        return None
    for candidate in [*(t.folder / ICC_GT_JSON for t in tasks), data / ICC_GT_JSON, Path.cwd() / ICC_GT_JSON]:
        if candidate.is_file():
            return candidate
    return None


def _fdb_v1_run(args: argparse.Namespace) -> int:
    from cspan.bench.session import check_out, check_out_apart

    check_out_apart(args.out, args.data)
    check_out(args.out, folder=True, reads=run_reads(args))
    return asyncio.run(_fdb_v1_run_async(args))


async def _fdb_v1_run_async(args: argparse.Namespace) -> int:
    from cspan.bench.fdb_v1_run import INPUT_WAV, V1RunOptions, resolve_input_tasks, run_fdb_v1
    from cspan.bench.session import check_audio_inputs

    check_loop(args)
    await check_backends(args)
    tasks = resolve_input_tasks(args.data, args.tasks)
    check_audio_inputs([d / INPUT_WAV for t in tasks for d in t.samples[: args.limit]])  # before the model loads
    icc_gt = _find_icc_gt(args.icc_gt, args.data, tasks)
    session = build_session_from(args)
    async with open_backends(args, loop_transcriber(args)) as backends:
        options = V1RunOptions(
            **loop_options(args),
            output_offset_frames=args.output_offset_frames,
            output_rate=args.output_rate,
            limit=args.limit,
            describe=describe_run(args, session),
        )
        result = await run_fdb_v1(
            session,
            tasks,
            args.out,
            options,
            loop_transcriber=backends.transcriber if backends.retriever is not None else None,
            retriever=backends.retriever,
            score_transcriber=backends.transcriber,
            icc_gt_path=icc_gt,
            judge=backends.judge,
            asr_label=args.asr,
        )
    print(f"fdb-v1: rendered {result.rendered}, kept {result.kept}, transcribed {result.transcribed} -> {args.out}")
    for task, score in result.scores:
        if score is not None:
            print_summary(f"{task.name} ({task.kind.value}, n={score.summary.n})", score.summary)
    for note in result.notes:
        print(f"note: {note}")
    if result.summary_md is not None:
        print(result.summary_md.read_text(encoding="utf-8"))
        print(f"wrote {result.summary_md}")
    check_judge(backends.judge, [])
    return 0


def print_summary(head: str, summary: Any, tail: str = "") -> None:
    """Print ``head: metric value, ...`` (+ ``tail``) for a scorer summary (``metrics``, ``notes``), then its notes."""
    metrics = ", ".join(f"{k} {'n/a' if v is None else f'{v:.4g}'}" for k, v in summary.metrics.items())
    print(f"{head}: {metrics}{tail}")
    for note in summary.notes:
        print(f"  note: {note}")


# --- fdb-v3 run ---------------------------------------------------------------------------------------------------


def register_fdb_v3_run(sub: Any) -> None:
    """``cspan bench fdb-v3 run``."""
    p = sub.add_parser(
        "run",
        help="play the tool-use scenarios through the full loop with the 12 mock tools (resumable)",
        description=(
            "Play every DATA/{example_id}_{speaker}/input.wav through the full loop with a router over the 12 mock "
            "tools (a fresh mock world per scenario) and write OUT/{folder}/output_PROVIDER.wav and "
            "result_PROVIDER.json in the benchmark's result format. With --fdb-v3-dir the benchmark's own mock APIs, "
            "tool declarations and agent persona are used (and its scenarios and data by default); otherwise this "
            "project's world. With --judge-url each response is analysed (filler sentence, key-information onset: "
            "latency_tool_analysis_PROVIDER.json); with scenarios the results are scored into OUT/summary.json. The "
            "router should be an LLM (--router URL --router-model NAME): the local router calls none of the 12 tools."
        ),
    )
    p.add_argument(
        "--data",
        type=Path,
        help="folder of {example_id}_{speaker}/input.wav (default with --fdb-v3-dir: its fdb_v3_data_released/)",
    )
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument(
        "--scenarios", type=Path, help="benchmark_data_v2.json: metadata in the results, and scoring (default: in DIR)"
    )
    p.add_argument(
        "--fdb-v3-dir",
        type=Path,
        help="the benchmark's v3/ folder: run against its mock_apis.py, the tools and persona of lk_agent_tool.py "
        "(mock_apis.py is imported and run: use a copy you trust)",
    )
    p.add_argument("--provider", default="cspan", help="the PROVIDER of result_PROVIDER.json (default %(default)s)")
    p.add_argument(
        "--max-tool-calls", type=at_least_one, default=1, help="tool calls one <ret> may chain, >= 1 (default 1)"
    )
    p.add_argument(
        "--numeric-tolerance",
        type=non_negative,
        default=0.05,
        help="relative tolerance for numeric arguments without a judge, >= 0 (default: %(default)s; 0 = exact)",
    )
    p.add_argument("--reanalyze", action="store_true", help="ask the judge again even where an analysis exists")
    add_model_arguments(p, prompt_help="persona prompt (default: the benchmark agent's with --fdb-v3-dir, else ours)")
    add_loop_arguments(p, router_default="local", tail_default=6.0)
    add_run_arguments(p)
    add_judge_arguments(p, "gpt-4o", "the response analysis and response quality (arguments use the exact rule)")
    p.set_defaults(handler=_fdb_v3_run)


def _fdb_v3_run(args: argparse.Namespace) -> int:
    from cspan.bench.session import check_out, check_out_apart

    if args.data is not None:
        check_out_apart(args.out, args.data)
    check_out(args.out, folder=True, reads=run_reads(args))
    return asyncio.run(_fdb_v3_run_async(args))


def v3_inputs(args: argparse.Namespace, *, need_data: bool) -> tuple[Any, Path | None, dict[str, Any] | None]:
    """``(release, data, scenarios)`` from ``--fdb-v3-dir`` / ``--data`` / ``--scenarios`` (explicit flags win).

    Raises:
        BenchDataError: no data folder when one is needed.
    """
    from cspan.bench import fdb_v3
    from cspan.bench.errors import BenchDataError
    from cspan.bench.fdb_v3_release import load_release

    release = load_release(args.fdb_v3_dir) if getattr(args, "fdb_v3_dir", None) else None
    data = getattr(args, "data", None) or (release.data_dir if release is not None else None)
    if need_data and data is None:
        raise BenchDataError("pass --data (the recordings) or --fdb-v3-dir holding fdb_v3_data_released/")
    scenario_path = args.scenarios or (release.scenarios_path if release is not None else None)
    scenarios = fdb_v3.load_scenarios(scenario_path) if scenario_path else None
    return release, data, scenarios


async def _fdb_v3_run_async(args: argparse.Namespace) -> int:
    from cspan.bench import fdb_v3
    from cspan.bench.fdb_v3_run import V3RunOptions, find_samples, run_fdb_v3, scenarios_from_metadata
    from cspan.bench.session import close_quietly

    check_loop(args)
    await check_backends(args)
    release, data, scenarios = v3_inputs(args, need_data=True)
    samples = find_samples(data, scenarios)
    from_metadata = scenarios_from_metadata(samples)
    if from_metadata:
        scenarios = {**(scenarios or {}), **from_metadata}  # per-folder metadata.json wins, as in the reference
    if args.router.lower() == "local":
        print(
            "note: the local router calls none of the 12 mock tools; pass --router URL --router-model NAME",
            file=sys.stderr,
        )
    session = build_session_from(args)
    transcriber = loop_transcriber(args)
    options = V3RunOptions(
        **loop_options(args),
        provider=args.provider,
        limit=args.limit,
        max_tool_calls=args.max_tool_calls,
        router_timeout_s=args.router_timeout_s,
        release=release,
        describe={
            "checkpoint": session.identity(),
            "asr": args.asr,
            "span_delay_s": None if args.realtime else args.span_delay_s,
            "span_deadline_s": args.span_deadline_s,
        },
    )
    try:
        results, rendered = await run_fdb_v3(
            session,
            samples,
            args.out,
            options,
            router_spec=args.router,
            router_model=args.router_model,
            transcriber=transcriber,
            scenarios=scenarios,
        )
    finally:
        await close_quietly(transcriber)
    print(f"fdb-v3: {len(results)} scenario recording(s), rendered {rendered}, kept {len(results) - rendered}")
    again = options.rendered_again.note()
    if again is not None:
        print(f"note: {again}")
    entries, _ = fdb_v3.load_result_entries(args.out, args.provider)
    summary = score_v3(
        entries,
        scenarios,
        args,
        args.out,
        config={
            "results": str(args.out),
            "provider": args.provider,
            "router": args.router,
            "router_model": args.router_model,
        },
        data=data,
    )
    if summary is None:
        print(f"no scenarios: results written to {args.out}; score with `cspan bench fdb-v3 score`")
    return 0


def score_v3(
    entries: Any, scenarios: Any, args: argparse.Namespace, out: Path, *, config: dict[str, Any], data: Path | None
) -> Any:
    """Analyse the responses (with ``--judge-url``), then score against ``scenarios``; write and print.

    ``run`` and ``score`` share it, so the same results score the same: the scenarios are ``scenarios`` with the
    recordings' own ``metadata.json`` scenarios over them (:func:`~cspan.bench.fdb_v3_run.metadata_scenarios`,
    ``data`` = the recordings folder), and ``config["world"]`` is what the results record.

    Writes ``OUT/key_info_analysis.json`` when a judge ran or analyses existed, and ``OUT/summary.json`` +
    ``samples.json`` when there are scenarios. Returns the :class:`~cspan.bench.fdb_v3.V3Summary` or None.

    Raises:
        JudgeError: after writing, when the judge went down or failed every request (exit status 1).
    """
    from cspan.bench import fdb_v3, fdb_v3_analysis
    from cspan.bench.errors import JudgeError
    from cspan.bench.fdb_v3_run import metadata_scenarios

    scenarios = {**(scenarios or {}), **metadata_scenarios(entries, data)} or None
    judge = make_judge(args)
    try:
        results, analyses, analysis_run = fdb_v3_analysis.analyze_entries(entries, judge, reanalyze=args.reanalyze)
        if analyses:
            path = fdb_v3_analysis.write_report(analyses, analysis_run, out)
            print(f"key-information analysis: {analysis_run.line()} -> {path}")
        if scenarios is None:
            check_judge(judge, [])
            return None
        matcher: Any = fdb_v3.ExactArgumentMatcher(args.numeric_tolerance)
        response_judge = None
        if judge is not None:
            matcher = fdb_v3.JudgeArgumentMatcher(judge, matcher)

            def response_judge(intent: str, transcript: str) -> float | None:
                try:
                    return 1.0 if judge.judge_response(intent, transcript).correct else 0.0
                except JudgeError:
                    return None

        summary, scored = fdb_v3.score_results(scenarios, results, matcher=matcher, response_judge=response_judge)
    finally:
        if judge is not None:
            judge.close()
    world = fdb_v3.results_world(results)
    if world is None:
        summary.notes.append("the results record no world (whose mock APIs, tools and persona they were run with)")
    if str(config.get("router", "")).lower() == "local":
        summary.notes.append(
            "run with the local router, which calls none of the 12 mock tools: tool selection and argument accuracy "
            "measure the router, not the model (pass --router URL --router-model NAME)"
        )
    summary.config = {
        **config,
        "world": world,
        "judge": judge.describe() if judge is not None else None,
        "analysis": analysis_run.model_dump(mode="json") if analyses or judge is not None else None,
        "numeric_tolerance": args.numeric_tolerance,
    }
    trouble = judge.trouble() if judge is not None else None
    if trouble is not None:
        summary.notes.append(trouble)
    path = fdb_v3.write_v3_score(summary, scored, out)
    print_summary(f"fdb-v3 (n={summary.n})", summary)
    print(f"wrote {path}")
    check_judge(judge, summary.notes)
    return summary


# --- qa ----------------------------------------------------------------------------------------------------------


def register_qa(sub: Any) -> None:
    """``cspan bench qa``."""
    from cspan.bench.qa import DEFAULT_TAIL_S, QA_SETS

    p = sub.add_parser(
        "qa",
        help="spoken QA and math through the full loop: ref. and resp. accuracy (resumable)",
        description=(
            "Play each spoken question of a set through the full loop (the model emits <ret>, the router's "
            "reference is injected as a Context Span, the model answers) and judge the reference (ref.) and the "
            "model's spoken answer (resp.) with an OpenAI-compatible judge (--judge-url) or a normalised alias "
            "match, and measure MoshiRAG's delays (TTFAT, keyword delay, end-to-end keyword delay) from the agent "
            "channel's word times. Writes OUT/{id}/output.wav + result.json, OUT/samples.json, OUT/summary.json and "
            "summary.md."
        ),
    )
    p.add_argument("--set", dest="qa_set", required=True, choices=QA_SETS, help="which set")
    p.add_argument(
        "--data",
        required=True,
        type=Path,
        help='the set\'s folder or question file (docs/BENCH.md, "Spoken QA: the data --data reads")',
    )
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument(
        "--question-source",
        choices=("asr", "text"),
        default="asr",
        help="what the router is asked: 'asr' (what the loop heard, default) or 'text' (the dataset's question)",
    )
    p.add_argument("--tts", choices=("espeak-ng",), default=None, help="synthesise missing question audio")
    p.add_argument(
        "--timing-words",
        choices=("auto", "asr", "text"),
        default="auto",
        help="word times of the delays (TTFAT, KD, E2EKD): 'asr' transcribes output.wav, 'text' uses the model's "
        "text stream; 'auto' (default): asr when --asr is not none",
    )
    add_model_arguments(p, prompt_help="persona prompt (default: the teacher persona of the original QA runs)")
    add_loop_arguments(p, router_default="local", tail_default=DEFAULT_TAIL_S, tools_default="clock,calculator")
    add_run_arguments(p)
    add_judge_arguments(p, "gpt-4o-2024-08-06", "the LLM judgement (a normalised alias match is used instead)")
    p.set_defaults(handler=_qa)


def _qa(args: argparse.Namespace) -> int:
    from cspan.bench.session import check_out, check_out_apart

    if args.data.is_dir():  # a set's folder (meta.json, audios/): nothing of a run goes in it
        check_out_apart(args.out, args.data)
    elif args.data.is_file():  # a question file: not its folder or one holding it (its audios/ are beside it)
        check_out_apart(args.out, args.data.parent, what="the folder of --data", inside=False)
    check_out(args.out, folder=True, reads=run_reads(args))
    return asyncio.run(_qa_async(args))


async def _qa_async(args: argparse.Namespace) -> int:
    from cspan.bench.qa import QARunOptions, check_qa_audio, load_qa_items, qa_table, run_qa, timing_source

    check_loop(args, text_questions=args.question_source == "text")
    await check_backends(args)
    items = load_qa_items(args.data, args.qa_set, limit=args.limit)
    check_qa_audio(items, args.tts)  # before the model loads
    # word-timed: the same transcriber serves the loop and the delays' word times of output.wav
    transcriber = loop_transcriber(args)
    timing_source(args.timing_words, transcriber)  # before the model loads
    session = build_session_from(args)
    async with open_backends(args, transcriber) as backends:
        options = QARunOptions(
            **loop_options(args),
            set_name=args.qa_set,
            question_source=args.question_source,
            tts=args.tts,
            timing_words=args.timing_words,
            describe=describe_run(args, session),
        )
        summary, results = await run_qa(
            session,
            items,
            args.out,
            options,
            transcriber=transcriber,
            retriever=backends.retriever,
            judge=backends.judge,
        )
    print(qa_table([summary]))
    for note in summary.notes:
        print(f"note: {note}")
    print(f"wrote {args.out / 'summary.json'} ({len(results)} item(s))")
    check_judge(backends.judge, summary.notes)
    return 0


__all__ = [
    "add_loop_arguments",
    "add_model_arguments",
    "add_run_arguments",
    "build_session_from",
    "check_loop",
    "loop_config",
    "register_capacity",
    "register_fdb_v1_run",
    "register_fdb_v3_run",
    "register_latency",
    "register_qa",
]
