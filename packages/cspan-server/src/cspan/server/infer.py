"""``cspan infer``: play a recording through the full Context Spanning loop and write what the agent said and did.

The recording (any file soundfile reads, any rate, mono or stereo) is framed at 12.5 Hz with lead and tail silence
added, and streamed through :class:`~cspan.core.engine.DuplexEngine` frame by frame by a
:class:`~cspan.core.runtime.Conversation`: voice activity and utterance transcripts on the user channel, every
``<ret>`` answered by the retriever (transcriber + router + Context DB) and injected as a Context Span. Outputs: a
stereo 24 kHz 16-bit WAV (left = user as heard, right = agent) and, optionally, the JSON of
:class:`~cspan.server.output.InferOutput` (``docs/OUTPUT.md``). Both are written atomically: a failed run leaves
no output file behind.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_PERSONA = (
    "You are Ada, a calm and friendly assistant who helps people plan their day and find things out. "
    "You are moshi, a capable voice assistant who also handles everyday requests such as looking things up, "
    "the weather, times and directions; the role above is your manner, not the only thing you help with."
)


@dataclass(frozen=True)
class TimedText:
    """``SECONDS:TEXT`` from ``--span``: a reference to inject at a time on the input's own timeline."""

    seconds: float
    text: str


def _parse_span(value: str) -> TimedText:
    seconds, sep, text = value.partition(":")
    try:
        t = float(seconds)
    except ValueError:
        t = float("nan")
    if not sep or not text.strip() or not t >= 0:
        raise argparse.ArgumentTypeError(f"--span {value!r}: expected SECONDS:TEXT with SECONDS >= 0, e.g. 1.0:Hello")
    return TimedText(t, text.strip())


def frame_at(seconds: float) -> int:
    """The 12.5 Hz frame that contains ``seconds`` (frame k covers [k * 0.08, (k + 1) * 0.08))."""
    return math.floor(seconds * 12.5 + 1e-9)


def _non_negative(value: str) -> float:
    try:
        t = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from exc
    if not t >= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: must be >= 0")
    return t


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by ``infer`` and ``serve``: checkpoint, voice, persona, sampling, device."""
    g = parser.add_argument_group("model")
    g.add_argument(
        "--checkpoint",
        default=None,
        help="Hugging Face repo id, local directory or file (default: the released Context Spanning 7B)",
    )
    g.add_argument("--voice", default=None, help="voice name in the checkpoint's voices/ or a .pt file of codes")
    g.add_argument("--text-prompt", default=DEFAULT_PERSONA, help="the persona text prompt")
    g.add_argument("--temp", type=_non_negative, default=0.8, help="audio sampling temperature (0 = greedy)")
    g.add_argument("--temp-text", type=_non_negative, default=0.7, help="text sampling temperature (0 = greedy)")
    g.add_argument("--seed", type=int, default=42424242, help="seed of the session's sampler")
    g.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    g.add_argument("--no-cuda-graphs", action="store_true", help="run the CUDA path eagerly")


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by ``infer`` and ``serve``: transcriber, router, knowledge, Context DB."""
    g = parser.add_argument_group("backends")
    g.add_argument(
        "--asr",
        default=os.environ.get("CSPAN_ASR_URL", "sphinx"),
        help="'sphinx' (embedded), 'none', or a server URL (env CSPAN_ASR_URL)",
    )
    g.add_argument("--asr-model", default=os.environ.get("CSPAN_ASR_MODEL"), help="model name for OpenAI-style ASR")
    g.add_argument(
        "--router",
        default=os.environ.get("CSPAN_ROUTER_URL", "local"),
        help="'local' (embedded), 'none', or an OpenAI-compatible base URL (env CSPAN_ROUTER_URL)",
    )
    g.add_argument(
        "--router-model",
        default=os.environ.get("CSPAN_ROUTER_MODEL", "google/gemma-4-26B-A4B-it"),
        help="model name at the router URL (env CSPAN_ROUTER_MODEL)",
    )
    g.add_argument("--knowledge", type=Path, default=None, help="folder of .txt/.md notes for the local router")
    g.add_argument("--db", default=":memory:", help="Context DB SQLite file (default: in memory)")
    g.add_argument("--listen-s", type=float, default=12.0, help="ASR window when no utterance transcript is usable")
    g.add_argument("--span-deadline-s", type=float, default=2.5, help="drop a span arriving later than this")


def infer_command(parser: argparse.ArgumentParser) -> None:
    """Run a recording through the full loop; write a stereo WAV (user | agent) and a JSON of what happened."""
    parser.add_argument("--input-wav", required=True, type=Path, help="the user's recording (WAV, FLAC, OGG)")
    parser.add_argument("--output-wav", required=True, type=Path, help="stereo 24 kHz WAV: left user, right agent")
    parser.add_argument("--output-text", type=Path, default=None, help="JSON of words, transcripts, events, timing")
    parser.add_argument("--channel", type=int, default=0, help="input channel to use (0 = left / mono)")
    parser.add_argument("--max-seconds", type=float, default=3600.0, help="refuse longer inputs")
    parser.add_argument("--lead-silence", type=_non_negative, default=4.0, help="seconds of silence before input")
    parser.add_argument("--tail-silence", type=_non_negative, default=8.0, help="seconds of silence after input")
    parser.add_argument("--user-name", default="", help="the user's name (persona prefix and profile)")
    parser.add_argument("--user-city", default="", help="the user's city (persona prefix and profile)")
    parser.add_argument("--user-tz", default="", help="the user's IANA timezone (profile)")
    parser.add_argument(
        "--span",
        action="append",
        type=_parse_span,
        default=[],
        metavar="SECONDS:TEXT",
        help="inject TEXT as a Context Span at SECONDS of the input (no backend); repeatable",
    )
    parser.add_argument(
        "--force-ret-at",
        action="append",
        type=_non_negative,
        default=[],
        metavar="SECONDS",
        help="behave as if the model emitted <ret> at SECONDS of the input; repeatable",
    )
    parser.add_argument("--realtime", action="store_true", help="pace the loop to 80 ms per frame (live clock)")
    parser.add_argument(
        "--span-delay-s",
        type=_non_negative,
        default=0.8,
        help="offline clock: apply each reference this long after it was asked (deterministic; ignored with "
        "--realtime, where references apply on arrival)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    add_model_arguments(parser)
    parser.add_argument(
        "--kv-dtype",
        choices=("auto", "bf16", "fp16", "fp32", "fp8"),
        default="auto",
        help="KV cache storage (fp8: half)",
    )
    add_backend_arguments(parser)
    parser.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    asyncio.run(run_infer(args))
    return 0


@dataclass
class InferResult:
    """What :func:`run_infer` produced: the JSON model, and the live objects (for tests and embedding)."""

    output: Any
    engine: Any
    conversation: Any


def pick_device(name: str | None) -> tuple[Any, Any]:
    """``(device, dtype)``: CUDA in bf16 when available (or asked), else CPU in float32.

    Raises:
        CspanError: an unknown device name, or CUDA asked for where torch has none.
    """
    import torch

    from cspan.core.errors import CspanError

    try:
        device = torch.device(name) if name else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    except RuntimeError as exc:
        raise CspanError(f"--device {name!r}: {exc}; use cpu, cuda or cuda:N") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CspanError(
            f"--device {name}: this torch has no CUDA device (torch {torch.__version__}); use --device cpu"
        )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtype


def check_outputs(inputs: list[Path], outputs: list[Path]) -> None:
    """Refuse output paths that are folders, collide with each other, or would overwrite an input.

    Raises:
        CspanError: naming the offending path.
    """
    from cspan.core.errors import CspanError

    seen: dict[Path, Path] = {}
    resolved_inputs = {p.resolve() for p in inputs}
    for out in outputs:
        real = out.resolve()
        if real.is_dir():
            raise CspanError(f"{out}: is a directory; pass a file path for the output")
        if real in resolved_inputs:
            raise CspanError(f"{out}: is also the input; refusing to overwrite the recording")
        if real in seen:
            raise CspanError(f"{out}: given for two outputs ({seen[real]} and {out}); use two different files")
        seen[real] = out


def build_backends(args: argparse.Namespace, *, profile: Any, db: Any) -> tuple[Any, Any]:
    """``(transcriber, retriever)`` from the flags (either may be ``None`` when disabled)."""
    from cspan.backends.asr import transcriber_from_url
    from cspan.backends.retriever import Retriever
    from cspan.backends.router import LLMRouter, LocalRouter
    from cspan.backends.tools import ToolBank
    from cspan.core.errors import CspanError

    transcriber = None
    try:
        if args.asr and args.asr.lower() != "none":
            transcriber = transcriber_from_url(args.asr, model=args.asr_model)
        if not args.router or args.router.lower() == "none":
            return transcriber, None
        tools = ToolBank.default()
        if args.router.lower() == "local":
            router = LocalRouter(tools=tools, db=db, knowledge_dir=args.knowledge)
        elif args.router.startswith(("http://", "https://")):
            router = LLMRouter(args.router, args.router_model, tools)
        else:
            raise ValueError(
                f"--router {args.router!r}: use 'local', 'none' or an http(s) URL of an OpenAI-compatible server"
            )
    except ValueError as exc:
        raise CspanError(str(exc)) from exc
    retriever = Retriever(transcriber, router, db, deadline_s=args.span_deadline_s)
    return transcriber, retriever


def resolve_voice(checkpoint: Any, voice: str | None) -> Any:
    """Voice codes ``[8, P]`` for ``--voice`` (a name in the checkpoint or a file); the first voice by default."""
    from cspan.core.checkpoint import load_voice

    if voice is None:
        if not checkpoint.voices:
            return None
        voice = sorted(checkpoint.voices)[0]
    return load_voice(voice, checkpoint)


def checkpoint_identity(checkpoint: Any, device: Any, dtype: Any) -> dict[str, Any]:
    lm = checkpoint.lm
    return {
        "source": str(checkpoint.source),
        "files": {k: str(v) for k, v in (checkpoint.files or {}).items()},
        "dep_q": int(checkpoint.lm_config.dep_q),
        "num_parameters": int(sum(p.numel() for p in lm.parameters())),
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
    }


async def run_infer(args: argparse.Namespace) -> InferResult:
    """The whole ``cspan infer`` job. Raises ``CspanError`` subclasses on bad input (before writing anything)."""
    import numpy as np
    import torch

    from cspan.core.audio import AtomicWavWriter, inspect_audio, iter_frames, write_text_atomic
    from cspan.core.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
    from cspan.core.constants import FRAME_RATE, FRAME_SIZE, SAMPLE_RATE
    from cspan.core.engine import DuplexEngine
    from cspan.core.errors import CspanError
    from cspan.core.events import SpanEvent, TextEvent, UserTextEvent
    from cspan.core.runtime import Conversation, ConversationConfig
    from cspan.server.output import AgentWord, InferOutput, Timing, UserTranscript, timing_stats
    from cspan.server.records import db_recorder

    info = inspect_audio(args.input_wav, channel=args.channel, max_seconds=args.max_seconds)
    outputs = [args.output_wav] + ([args.output_text] if args.output_text is not None else [])
    check_outputs([args.input_wav], outputs)
    lead = math.ceil(args.lead_silence * FRAME_RATE - 1e-9)
    tail = math.ceil(args.tail_silence * FRAME_RATE - 1e-9)
    n_input = -(-round(info.duration_s * SAMPLE_RATE) // FRAME_SIZE)
    total = lead + n_input + tail
    last_s = (n_input + tail) / FRAME_RATE
    for label, t in [*(("--span", s.seconds) for s in args.span), *(("--force-ret-at", t) for t in args.force_ret_at)]:
        if t >= last_s:
            raise CspanError(
                f"{label} at {t:g} s is past the end of the conversation (input {info.duration_s:.2f} s + "
                f"{args.tail_silence:g} s tail); use a time below {last_s:.2f} s"
            )
    device, dtype = pick_device(args.device)
    source = args.checkpoint or DEFAULT_CHECKPOINT
    checkpoint = load_checkpoint(source, device=device, dtype=dtype)
    engine = DuplexEngine(
        checkpoint,
        batch_size=1,
        temp=args.temp,
        temp_text=args.temp_text,
        cuda_graphs=False if args.no_cuda_graphs else None,
        kv_dtype=args.kv_dtype,
        predict_user=False,  # the user's codes come from the input audio every frame
    )
    engine.reset(0, seed=args.seed)
    voice_codes = resolve_voice(checkpoint, args.voice)
    engine.set_persona(
        0, args.text_prompt, voice_codes, user_name=args.user_name or None, user_city=args.user_city or None
    )

    from cspan.backends.context_db import ContextDB, Profile

    db = ContextDB(args.db)
    profile = Profile(name=args.user_name, city=args.user_city, timezone=args.user_tz)
    db.put_profile(profile)
    conversation_id = db.start_conversation(
        profile.user_id, checkpoint=str(source), settings={"input": str(args.input_wav)}
    )
    transcriber, retriever = build_backends(args, profile=profile, db=db)

    config = ConversationConfig(
        listen_s=args.listen_s,
        span_deadline_s=args.span_deadline_s,
        span_delay_s=None if args.realtime else args.span_delay_s,
    )
    conversation = Conversation(
        engine,
        0,
        tokenizer=checkpoint.tokenizer,
        transcriber=transcriber,
        retriever=retriever,
        config=config,
        profile=profile,
        conversation_id=conversation_id,
        on_event=db_recorder(db, conversation_id),
    )
    for span in args.span:
        conversation.schedule_span(lead + frame_at(span.seconds), span.text)
    for t in args.force_ret_at:
        conversation.schedule_ret(lead + frame_at(t))

    def frames() -> Any:
        silence = np.zeros(FRAME_SIZE, dtype=np.float32)
        for _ in range(lead):
            yield silence
        yield from iter_frames(args.input_wav, channel=args.channel)
        for _ in range(tail):
            yield silence

    progress = None
    if not args.quiet:
        from tqdm import tqdm

        progress = tqdm(total=total, unit="frame", desc="infer", file=sys.stderr, leave=False)
    step_ms: list[float] = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(pcm: torch.Tensor) -> Any:
        # Runs in a worker thread so that backend calls (asyncio tasks) progress while the model computes.
        out = engine.step(pcm)
        sync()
        return out

    started = time.monotonic()
    writer = AtomicWavWriter(args.output_wav, sample_rate=SAMPLE_RATE, channels=2)
    try:
        for k, user in enumerate(frames()):
            await conversation.before_step(user)
            t0 = time.perf_counter()
            out = await asyncio.to_thread(step, torch.from_numpy(user)[None])
            step_ms.append((time.perf_counter() - t0) * 1000)
            valid = bool(out.valid[0])
            await conversation.after_step(int(out.text_token[0]) if valid else None, bool(out.is_ret[0]))
            agent = out.agent_pcm[0].detach().float().cpu().numpy()
            writer.write(np.stack([user, agent], axis=1))
            if progress is not None:
                progress.update(1)
            if args.realtime:
                delay = started + (k + 1) / FRAME_RATE - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)
        await conversation.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        if progress is not None:
            progress.close()
    wall = time.monotonic() - started

    events = conversation.events
    words: list[AgentWord] = []
    for ev in events:
        if isinstance(ev, TextEvent):
            if ev.text.startswith(" ") or not words:
                words.append(AgentWord(text=ev.text.strip(), start_s=ev.t, frame=ev.frame))
            else:
                words[-1].text += ev.text
    words = [w for w in words if w.text]
    transcripts = [
        UserTranscript(utterance=ev.utterance, start_s=ev.start_s, end_s=ev.end_s, text=ev.text)
        for ev in events
        if isinstance(ev, UserTextEvent) and ev.final
    ]
    prefills = [ev.prefill_ms for ev in events if isinstance(ev, SpanEvent)]
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "handler"}
    settings["span"] = [{"seconds": s.seconds, "text": s.text} for s in args.span]
    output = InferOutput(
        input=str(args.input_wav),
        output_wav=str(args.output_wav),
        sample_rate=SAMPLE_RATE,
        duration_s=total / FRAME_RATE,
        input_offset_s=lead / FRAME_RATE,
        agent_text=conversation.agent_text(),
        agent_words=words,
        user_transcripts=transcripts,
        events=events,
        timing=Timing(
            frames=total,
            step=timing_stats(step_ms),
            prefill=timing_stats(prefills),
            realtime_factor=(total / FRAME_RATE) / max(wall, 1e-9),
        ),
        settings=settings,
        checkpoint=checkpoint_identity(checkpoint, device, dtype),
    )
    try:
        if args.output_text is not None:
            write_text_atomic(args.output_text, output.model_dump_json(indent=2) + "\n")
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    db.end_conversation(conversation_id)
    db.close()
    if not args.quiet:
        spans = sum(isinstance(e, SpanEvent) for e in events)
        print(
            f"wrote {args.output_wav} ({total / FRAME_RATE:.1f} s, stereo: left user, right agent)"
            + (f" and {args.output_text}" if args.output_text else "")
            + f"; {spans} span(s); agent said: {output.agent_text[:120]!r}",
            file=sys.stderr,
        )
    return InferResult(output=output, engine=engine, conversation=conversation)
