"""What every benchmark runner shares: one engine built from a checkpoint, and one recording through the full loop.

:func:`build_session` loads a checkpoint and builds a batch-1 :class:`~cspan.core.engine.DuplexEngine` (CUDA in
bfloat16 when available, else CPU in float32). :func:`render` then plays one user recording through the frame-clock
runtime of the core (:class:`~cspan.core.runtime.Conversation` driven by :func:`~cspan.core.runtime.run_conversation`):
persona prefix, voice activity and utterance transcripts, ``<ret>`` answered by a retriever and injected as a
Context Span, and returns the agent's audio on the recording's own timeline with everything that happened.
:func:`make_router` makes the router over a tool bank the way ``cspan infer`` does, without depending on
``cspan.server`` (see ``docs/ARCHITECTURE.md``); ``cspan.bench.run_commands`` wires the rest of a run's backends.

Timeline convention (all runners): call ``k`` of the engine is given user frame ``k`` (80 ms, samples
``[1920 k, 1920 (k + 1))`` of the recording at 24 kHz) and returns one agent frame; :attr:`Rendered.agent_pcm`
holds those frames back to back, so agent frame ``k`` sits at ``k * 0.08`` s. A live client can only play it once
user frame ``k`` has been heard entirely, which is why the runners that write benchmark outputs shift it by
``output_offset_frames`` (default one frame, as Moshi's and PersonaPlex's clients do; see
``docs/reference/benchmarks.md`` section 1.2).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cspan.backends.urls import redact_url
from cspan.bench.errors import BenchDataError, BenchError, BenchSettingsError

if TYPE_CHECKING:
    from cspan.core.reads import Read

log = logging.getLogger(__name__)

CONVERSATION_PROMPT = "You enjoy having a good conversation."
"""PersonaPlex's Full-Duplex-Bench prompt for pause handling, backchannel and turn-taking."""
TEACHER_PROMPT = "You are a wise and friendly teacher. Answer questions or provide advice in a clear and engaging way."
"""PersonaPlex's Full-Duplex-Bench prompt for user interruption; also the persona of the spoken-QA runs."""

DTYPE_NAMES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}
"""``--dtype`` spellings -> torch dtype attribute names."""


def parse_dtype(name: str | None, device: Any) -> Any:
    """A torch dtype from ``--dtype`` (``bf16``, ``fp16``, ``fp32``...); default bfloat16 on CUDA, float32 else.

    Raises:
        BenchSettingsError: an unknown name (exit status 2).
    """
    import torch

    from cspan.core.devices import default_dtype

    if name is None:
        return default_dtype(device)
    key = DTYPE_NAMES.get(name.lower())
    if key is None:
        raise BenchSettingsError(f"--dtype {name!r} is not a dtype; use one of bf16, fp16, fp32")
    return getattr(torch, key)


def pick_device(name: str | None = None, dtype: str | None = None) -> tuple[Any, Any]:
    """``(device, dtype)``: ``name`` or CUDA when available, else CPU; dtype from :func:`parse_dtype`.

    Raises:
        SettingsError: a device torch does not know (:func:`cspan.core.devices.parse_device`). CspanError: CUDA
            was asked for but is not available. BenchSettingsError: an unknown dtype.
    """
    from cspan.core.devices import parse_device

    device = parse_device(name or None)
    return device, parse_dtype(dtype, device)


def synchronize(device: Any) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# --- the engine --------------------------------------------------------------------------------------------------


@dataclass
class BenchSession:
    """A loaded checkpoint and the engine over it.

    Attributes:
        checkpoint: the :class:`cspan.core.checkpoint.Checkpoint` (LM, Mimi, tokenizer, voices).
        engine: a :class:`cspan.core.engine.DuplexEngine`.
        device, dtype: where and in which dtype the LM runs (Mimi runs in float32).
        chosen_voice: the :class:`~cspan.core.voice.ChosenVoice` that speaks, or None for no voice prompt.
        source: the checkpoint as given.
    """

    checkpoint: Any
    engine: Any
    device: Any
    dtype: Any
    chosen_voice: Any
    source: str
    _fine_tune_fingerprint: str | None = field(default=None, init=False, repr=False)

    @property
    def voice(self) -> str | None:
        """The voice's name (as ``--voice`` named it, or the default's), or None for no voice prompt."""
        return None if self.chosen_voice is None else self.chosen_voice.name

    @property
    def voice_prompt(self) -> Any:
        """The :class:`~cspan.core.voice.VoicePrompt` the persona prefix reads (codes or PersonaPlex embeddings)."""
        return None if self.chosen_voice is None else self.chosen_voice.prompt

    def identity(self) -> dict[str, Any]:
        """What a result file records about the model: source, files, sizes, dtype, device, the voice that spoke
        (``voice``, ``voice_file``, ``voice_sha256``, ``voice_form``, ``voice_default``:
        :meth:`cspan.core.voice.ChosenVoice.describe`), sampling; and for a fine-tune over its base,
        ``fine_tune_fingerprint``: :func:`cspan.core.checkpoint.weights_fingerprint` of the fine-tune file (what a
        retraining rewrites at the same path), so a resumed run renders again over other weights. A checkpoint
        without a fine-tune has no such key (its results keep their resume keys)."""
        from cspan.core.voice import describe_voice

        lm = self.checkpoint.lm
        engine = self.engine
        fine_tune = getattr(self.checkpoint, "fine_tune", None)
        weights: dict[str, Any] = {}
        if fine_tune is not None:
            if self._fine_tune_fingerprint is None:  # once: a few KiB per tensor, but identity() is asked per run
                from cspan.core.checkpoint import weights_fingerprint

                self._fine_tune_fingerprint = weights_fingerprint(fine_tune, "fine-tune")
            weights["fine_tune_fingerprint"] = self._fine_tune_fingerprint
        return {
            "source": self.source,
            "files": {k: str(v) for k, v in (self.checkpoint.files or {}).items()},
            "dep_q": int(lm.dep_q),
            "num_parameters": int(sum(p.numel() for p in lm.parameters())),
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": str(self.device),
            **describe_voice(self.chosen_voice),
            "temp": engine.audio_params.temperature,
            "temp_text": engine.text_params.temperature,
            "cuda_graphs": bool(engine.cuda_graphs),
            **weights,
        }


def build_session(
    checkpoint: str,
    *,
    device: str | None = None,
    dtype: str | None = None,
    temp: float = 0.8,
    temp_text: float = 0.7,
    voice: str | None = None,
    no_voice: bool = False,
    seed: int = 42424242,
    max_span_frames: int | None = None,
    cuda_graphs: bool | None = None,
) -> BenchSession:
    """Load ``checkpoint`` (Hub repo id, folder or file) and build a batch-1 engine over it.

    Args:
        checkpoint: what :func:`cspan.core.checkpoint.load_checkpoint` accepts.
        device, dtype: see :func:`pick_device`.
        temp, temp_text: audio and text sampling temperatures (0 = greedy).
        voice: ``--voice``, every form ``cspan infer`` takes, resolved and loaded as it does
            (:func:`cspan.core.voice.choose_voice`): a voice name of the checkpoint (``voices/``, PersonaPlex's
            ``voices.tgz``, ``$CSPAN_VOICES_DIR``), a ``.pt`` voice file (codes or PersonaPlex embeddings) or a 2-30 s
            recording; None: infer's default (the first voice of ``voices/``; none for ``voices.tgz`` alone).
        no_voice: no voice prompt at all (persona text only).
        seed: the session's sampler seed (each rendering reseeds it, see :func:`render`).
        max_span_frames: longest Context Span block (default the engine's, 600).
        cuda_graphs: replay the step from CUDA graphs (None: the engine's default, on for CUDA).

    Raises:
        CheckpointError: the checkpoint cannot be loaded (from the core).
        SettingsError: ``--voice`` names no voice or file, or its file cannot be a voice (the message starts with
            ``--voice``; exit status 2).
        BenchError: bad device or dtype.
    """
    from cspan.core.checkpoint import load_checkpoint
    from cspan.core.engine import DuplexEngine
    from cspan.core.voice import check_voice_path, choose_voice

    if not no_voice:
        check_voice_path(voice)  # a --voice path where no file is fails before the model loads
    dev, dt = pick_device(device, dtype)
    ckpt = load_checkpoint(checkpoint, device=dev, dtype=dt)
    kwargs: dict[str, Any] = {
        "temp": temp,
        "temp_text": temp_text,
        "seed": seed,
        "cuda_graphs": cuda_graphs,
        "predict_user": False,  # the user's codes come from the benchmark audio every frame
    }
    if max_span_frames is not None:
        kwargs["max_span_frames"] = max_span_frames
    engine = DuplexEngine(ckpt, batch_size=1, **kwargs)
    chosen = None if no_voice else choose_voice(voice, ckpt)
    return BenchSession(
        checkpoint=ckpt, engine=engine, device=dev, dtype=dt, chosen_voice=chosen, source=str(checkpoint)
    )


# --- backends ----------------------------------------------------------------------------------------------------


def make_router(
    spec: str | None,
    tools: Any,
    *,
    model: str | None = None,
    knowledge: str | Path | None = None,
    db: Any = None,
    max_tool_calls: int = 1,
    timeout_s: float = 8.0,
) -> Any:
    """A router from ``--router``: ``local`` (embedded: clock, arithmetic, notes in ``knowledge``), an
    OpenAI-compatible base URL (:class:`~cspan.backends.router.LLMRouter` over ``tools``), or None for ``none``.

    Raises:
        BenchError: an LLM router without ``--router-model``, or a knowledge folder that does not exist.
    """
    if not spec or spec.lower() == "none":
        return None
    from cspan.backends.router import LLMRouter, LocalRouter

    if spec.lower() == "local":
        try:
            return LocalRouter(tools=tools, db=db, knowledge_dir=knowledge)
        except ValueError as exc:
            raise BenchError(str(exc)) from exc
    if not spec.startswith(("http://", "https://")):
        raise BenchSettingsError(
            f"--router {redact_url(spec)!r}: use 'local', 'none' or an OpenAI-compatible URL (http://host:port/v1)"
        )
    if not model:
        raise BenchSettingsError(f"--router {redact_url(spec)}: pass --router-model NAME (the model the server serves)")
    return LLMRouter(spec, model, tools, max_tool_calls=max_tool_calls, timeout_s=timeout_s)


async def close_quietly(*things: Any) -> None:
    """``await x.aclose()`` (or ``x.close()``) on each object that has one; failures are logged, not raised."""
    for thing in things:
        if thing is None:
            continue
        try:
            closer = getattr(thing, "aclose", None)
            if closer is not None:
                await closer()
                continue
            closer = getattr(thing, "close", None)
            if closer is not None:
                closer()
        except Exception as exc:  # closing must never hide the run's result
            log.warning("closing %s failed: %s", type(thing).__name__, exc)


class FixedQuestionRetriever:
    """A retriever that routes a known question text instead of what was heard.

    The spoken-QA runner's ``--question-source text`` (MoshiRAG's "ground-truth user text" ablation, arXiv
    2604.12928 Table 9): every ``<ret>`` is routed with the dataset's question, whatever the transcriber would
    have made of the audio. Satisfies the core's ``Retriever`` protocol.
    """

    def __init__(self, inner: Any, question: str) -> None:
        self.inner = inner
        self.question = question

    async def retrieve(self, *, audio: Any = None, sample_rate: int | None = None, **kwargs: Any) -> Any:
        """Call the wrapped retriever with ``question=self.question`` (the audio is ignored)."""
        kwargs["question"] = self.question
        return await self.inner.retrieve(**kwargs)


class RecordingRouter:
    """Wraps a router and keeps every tool call it made, with the conversation time it was asked at.

    ``calls`` gets one ``{"function", "args", "timestamp_start", "error"?}`` per executed tool call
    (``RouteResult.calls``), and one with ``error`` for a call that was attempted but failed (unknown
    arguments, a tool error, an action refused by the router's guard). ``clock()`` gives the current
    conversation time in seconds.
    """

    def __init__(self, inner: Any, clock: Any) -> None:
        self.inner = inner
        self.clock = clock
        self.calls: list[dict[str, Any]] = []

    async def route(self, req: Any) -> Any:
        """Route through the wrapped router and record its tool calls."""
        t = float(self.clock())
        result = await self.inner.route(req)
        made = list(getattr(result, "calls", None) or [])
        for call in made:
            self.calls.append({"function": call.name, "args": dict(call.arguments), "timestamp_start": t})
        if not made and getattr(result, "tool", None) and getattr(result, "error", None):
            self.calls.append(
                {
                    "function": result.tool,
                    "args": dict(result.arguments or {}),
                    "timestamp_start": t,
                    "error": result.error,
                }
            )
        return result

    async def aclose(self) -> None:
        """Close the wrapped router."""
        await close_quietly(self.inner)


# --- one recording through the loop ------------------------------------------------------------------------------


@dataclass
class AgentWord:
    """A word of the agent's text stream: its text and the time (s) of its first token's frame."""

    text: str
    start_s: float


@dataclass
class Rendered:
    """One recording played through the full loop.

    Attributes:
        agent_pcm: float32 [frames * 1920] at 24 kHz, agent frame k at ``k * 0.08`` s (see the module docstring).
        frames: number of 80 ms frames fed (input frames plus tail).
        input_frames: frames that hold the recording (the last one zero-padded).
        events: the conversation's events (:mod:`cspan.core.events`), times on the recording's timeline.
        agent_text: the decoded text stream (special tokens removed).
        agent_words: words of the text stream with their frame times.
        prefix_frames: frames of the persona prefix.
        wall_s: wall-clock seconds of the rendering.
        seed: the sampler seed used.
    """

    agent_pcm: np.ndarray
    frames: int
    input_frames: int
    events: list[Any]
    agent_text: str
    agent_words: list[AgentWord]
    prefix_frames: int
    wall_s: float
    seed: int

    @property
    def duration_s(self) -> float:
        """Seconds of conversation rendered (frames * 0.08)."""
        from cspan.core.constants import FRAME_RATE

        return self.frames / FRAME_RATE

    def spans(self) -> list[Any]:
        """The :class:`~cspan.core.events.SpanEvent` s, in order."""
        return [e for e in self.events if getattr(e, "type", None) == "span"]

    def rets(self) -> list[Any]:
        """The :class:`~cspan.core.events.RetEvent` s (emitted or forced), in order."""
        return [e for e in self.events if getattr(e, "type", None) == "ret"]

    def output_pcm(self, *, offset_frames: int = 1, length: int | None = None) -> np.ndarray:
        """The agent audio as a client plays it: ``offset_frames`` frames of silence first, then
        :attr:`agent_pcm`, cut or zero-padded to ``length`` samples (default: the length of ``agent_pcm``).

        Returns float32 [length] at 24 kHz.
        """
        from cspan.core.constants import FRAME_SIZE

        n = self.agent_pcm.shape[0] if length is None else int(length)
        pad = np.zeros(max(0, offset_frames) * FRAME_SIZE, dtype=np.float32)
        out = np.concatenate([pad, self.agent_pcm])[:n]
        if out.shape[0] < n:
            out = np.concatenate([out, np.zeros(n - out.shape[0], dtype=np.float32)])
        return out

    def events_json(self) -> list[dict[str, Any]]:
        """Events as JSON-ready dicts."""
        return [e.model_dump(mode="json") for e in self.events]


def agent_words(events: Iterable[Any]) -> list[AgentWord]:
    """Group the text events' SentencePiece pieces into words (a piece starting with a space starts a word)."""
    words: list[AgentWord] = []
    for ev in events:
        if getattr(ev, "type", None) != "text":
            continue
        if ev.text.startswith(" ") or not words:
            words.append(AgentWord(text=ev.text.strip(), start_s=float(ev.t)))
        else:
            words[-1].text += ev.text
    return [w for w in words if w.text]


def seed_for(base: int, key: str) -> int:
    """A per-item seed: ``base`` plus a stable hash of ``key`` (same item, same seed, on every machine)."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return (int(base) + int.from_bytes(digest[:4], "little")) % (2**31 - 1)


async def render(
    session: BenchSession,
    pcm: np.ndarray,
    *,
    text_prompt: str | None,
    seed: int,
    tail_s: float = 0.0,
    transcriber: Any = None,
    retriever: Any = None,
    config: Any = None,
    profile: Any = None,
    conversation_id: Any = None,
    force_ret_s: Sequence[float] = (),
    spans: Sequence[tuple[float, str]] = (),
    realtime: bool = False,
    user_name: str | None = None,
    user_city: str | None = None,
    on_conversation: Any = None,
) -> Rendered:
    """Play one recording through the full loop on session 0 of ``session.engine``.

    The session is reset with ``seed`` and given the persona prefix (``text_prompt`` and the session's voice); the
    recording, then ``tail_s`` seconds of silence, are streamed frame by frame by a
    :class:`~cspan.core.runtime.Conversation` (:func:`~cspan.core.runtime.run_conversation`).

    Args:
        session: from :func:`build_session`.
        pcm: float32 [S] mono at 24 kHz.
        text_prompt: persona prompt (None / "" for none).
        seed: sampler seed of this rendering.
        tail_s: silence appended after the recording (seconds).
        transcriber, retriever: the loop's backends (None disables utterance transcripts / retrieval).
        config: a :class:`~cspan.core.runtime.ConversationConfig` (default: offline clock, 0.8 s span delay).
        profile, conversation_id: passed to the retriever.
        force_ret_s: times (s) at which to behave as if the model emitted ``<ret>``.
        spans: ``(time_s, text)`` references to inject without any backend.
        realtime: pace to 80 ms per frame (live clock) instead of running as fast as possible.
        user_name, user_city: added to the persona prefix.
        on_conversation: called with the :class:`~cspan.core.runtime.Conversation` before streaming (to hook
            clocks, e.g. :class:`RecordingRouter`).

    Returns:
        :class:`Rendered`.
    """
    from cspan.core.constants import FRAME_RATE, FRAME_SIZE
    from cspan.core.runtime import Conversation, ConversationConfig, run_conversation

    engine = session.engine
    pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
    input_frames = max(1, math.ceil(pcm.shape[0] / FRAME_SIZE))
    tail_frames = max(0, round(tail_s * FRAME_RATE))
    total = input_frames + tail_frames
    padded = np.zeros(total * FRAME_SIZE, dtype=np.float32)
    padded[: pcm.shape[0]] = pcm

    engine.reset(0, seed=seed)
    report = engine.set_persona(
        0, text_prompt or None, session.voice_prompt, user_name=user_name or None, user_city=user_city or None
    )
    conversation = Conversation(
        engine,
        0,
        tokenizer=session.checkpoint.tokenizer,
        transcriber=transcriber,
        retriever=retriever,
        config=config if config is not None else ConversationConfig(span_delay_s=0.8),
        profile=profile,
        conversation_id=conversation_id,
    )
    for t in force_ret_s:
        conversation.schedule_ret(min(total - 1, max(0, round(t * FRAME_RATE))))
    for t, text in spans:
        conversation.schedule_span(min(total - 1, max(0, round(t * FRAME_RATE))), text)
    if on_conversation is not None:
        on_conversation(conversation)

    out = np.zeros(total * FRAME_SIZE, dtype=np.float32)

    def keep(k: int, _user: np.ndarray, agent: np.ndarray) -> None:
        out[k * FRAME_SIZE : (k + 1) * FRAME_SIZE] = agent

    frames = (padded[k * FRAME_SIZE : (k + 1) * FRAME_SIZE] for k in range(total))
    started = time.monotonic()
    await run_conversation(engine, conversation, frames, realtime=realtime, on_frame=keep)
    wall = time.monotonic() - started
    text = conversation.agent_text()
    return Rendered(
        agent_pcm=out,
        frames=total,
        input_frames=input_frames,
        events=list(conversation.events),
        agent_text=text,
        agent_words=agent_words(conversation.events),
        prefix_frames=int(report.num_frames),
        wall_s=wall,
        seed=int(seed),
    )


# --- files -------------------------------------------------------------------------------------------------------


def read_pcm(path: Path, sample_rate: int | None = None) -> tuple[np.ndarray, int]:
    """Read an audio file as float32 mono [S] (channels averaged), resampled to ``sample_rate`` when given.

    Returns ``(pcm, rate)``. Raises :class:`~cspan.bench.errors.BenchDataError` for a missing or unreadable file.
    """
    from cspan.bench.transcribe import read_audio_mono

    pcm, sr = read_audio_mono(path)
    if sample_rate is not None and sr != sample_rate:
        from cspan.core.audio import resample

        pcm, sr = resample(pcm, sr, sample_rate), sample_rate
    return pcm, sr


def check_audio_inputs(paths: Sequence[Path], what: str = "input") -> None:
    """Refuse a run whose inputs are not all readable audio, before its first item renders: one broken example
    found halfway used to stop a run with half its outputs written and no summary. Only the headers are read
    (``soundfile.info``), so a long dataset is checked in a moment.

    Raises:
        BenchDataError: naming the first few missing or unreadable files and how many there are.
    """
    import soundfile as sf

    bad = []
    for path in paths:
        if not path.is_file():
            bad.append(f"{path} is missing")
            continue
        try:
            info = sf.info(str(path))
        except (RuntimeError, sf.LibsndfileError, OSError) as exc:
            bad.append(f"{path} is not readable audio ({exc})")
            continue
        if info.frames <= 0 or info.samplerate <= 0:
            bad.append(f"{path} holds no audio")
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise BenchDataError(
            f"{len(bad)} of {len(paths)} {what} file(s) cannot be played: {'; '.join(bad[:3])}{more}; fix or remove "
            "them (nothing was rendered)"
        )


def write_wav(path: Path, pcm: np.ndarray, sample_rate: int, *, length: int | None = None) -> Path:
    """Write float32 mono ``pcm`` [S] (24 kHz) as a 16-bit WAV at ``sample_rate`` (resampled with soxr),
    atomically (a crash never leaves a partial file); ``length`` cuts or zero-pads the result to exactly that many
    samples at ``sample_rate``."""
    from cspan.core.audio import AtomicWavWriter, resample
    from cspan.core.constants import SAMPLE_RATE

    data = resample(pcm, SAMPLE_RATE, sample_rate) if sample_rate != SAMPLE_RATE else np.asarray(pcm, np.float32)
    if length is not None:
        data = np.concatenate([data[:length], np.zeros(max(0, length - data.shape[0]), dtype=np.float32)])
    writer = AtomicWavWriter(path, sample_rate=sample_rate, channels=1)
    try:
        writer.write(data)
    except BaseException:
        writer.abort()
        raise
    return _readable(writer.commit())


def check_out(
    path: str | Path | None, *, folder: bool = False, first_file: str = "summary.json", reads: Iterable[Read] = ()
) -> None:
    """Check, before any model loads or anything is measured, that ``--out`` can be written: a file (``folder``
    False: the JSON of ``latency``, ``capacity``) or a folder of outputs (created if missing), and that it is none of
    the files and lies in none of the folders the command reads (``reads``: :func:`cspan.core.reads.check_outputs`).
    ``None`` passes.

    ``first_file``: a file the command writes into the folder, named in the message when it cannot be written.

    Raises:
        OutputError: naming the path and the cause (a file where a folder is wanted or the reverse, permission
            denied, read-only file system, not a directory). SettingsError: ``--out`` is or lies inside what the
            command reads (exit status 2).
    """
    from cspan.core.errors import OutputError
    from cspan.core.files import check_writable
    from cspan.core.reads import check_outputs

    if path is None:
        return
    path = Path(path)
    if folder:
        if path.exists() and not path.is_dir():
            raise OutputError(f"{path}: cannot write: it is a file; --out names a folder here")
        check_outputs({}, reads, folders={"--out": path})
        _note_missing_folders(path)
        check_writable(path / first_file)
    else:
        if path.is_dir():
            raise OutputError(f"{path}: cannot write: it is a folder; --out names the JSON file here")
        check_outputs({"--out": path}, reads)
        _note_missing_folders(path.parent)
        check_writable(path)


_CREATED_OUT: list[Path] = []
"""Folders :func:`check_out` created for ``--out`` (innermost first), removed again by :func:`remove_empty_out` when
the command fails before writing anything into them."""


def _note_missing_folders(folder: Path) -> None:
    missing = []
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            break
        missing.append(candidate)
    _CREATED_OUT.extend(missing)


def remove_empty_out() -> None:
    """Remove the folders :func:`check_out` created that are still empty (a failed run leaves no empty ``--out``)."""
    while _CREATED_OUT:
        folder = _CREATED_OUT.pop(0)
        try:
            folder.rmdir()  # only an empty folder; one holding outputs stays
        except OSError:
            pass


def removing_empty_out(handler: Any) -> Any:
    """``handler`` (``fn(args) -> int``) that, when it fails (an exception or a non-zero status), removes the
    ``--out`` folders :func:`check_out` created and nothing was written into."""
    import functools

    @functools.wraps(handler)
    def run(args: Any) -> int:
        _CREATED_OUT.clear()
        try:
            status = int(handler(args) or 0)
        except BaseException:
            remove_empty_out()
            raise
        if status != 0:
            remove_empty_out()
        _CREATED_OUT.clear()
        return status

    return run


def check_out_apart(
    out: str | Path,
    data: str | Path,
    *,
    out_flag: str = "--out",
    what: str = "the --data folder",
    inside: bool = True,
) -> None:
    """Refuse an output folder that would write over the input dataset: ``out`` is the ``data`` folder (``what``
    names it in the message), contains it or (``inside``) lies inside it. Paths are compared resolved (symlinks,
    ``..``).

    Raises:
        SettingsError: naming the flag and why (exit status 2), before anything is read or written.
    """
    from cspan.core.errors import SettingsError

    real_out, real_data = Path(out).resolve(), Path(data).resolve()
    why = None
    if real_out == real_data:
        why = f"is {what} {data}"
    elif real_data.is_relative_to(real_out):
        why = f"contains {what} {data}"
    elif inside and real_out.is_relative_to(real_data):
        why = f"is inside {what} {data}"
    if why is not None:
        raise SettingsError(
            f"{out_flag} {out}: {why}; the outputs would be written among the benchmark's own files: choose an "
            f"{out_flag} folder outside {data}"
        )


def write_json(path: Path, payload: Any) -> Path:
    """Write ``payload`` as indented JSON through an atomic rename."""
    from cspan.core.files import write_text_atomic

    return _readable(write_text_atomic(path, json.dumps(payload, indent=2, ensure_ascii=False, default=str) + "\n"))


def _readable(path: Path) -> Path:
    """Give a file written through a private temporary file the usual ``rw-r--r--`` permissions."""
    path.chmod(0o644)
    return path


def settings_key(settings: dict[str, Any]) -> str:
    """A short stable hash of run settings: a resumed run re-renders a sample whose settings changed."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class Progress:
    """A tqdm progress bar on stderr (or nothing when ``quiet``)."""

    total: int
    desc: str
    quiet: bool = False
    _bar: Any = field(default=None, init=False)

    def __enter__(self) -> Progress:
        if not self.quiet:
            import sys

            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.desc, unit="item", file=sys.stderr, leave=False)
        return self

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` items."""
        if self._bar is not None:
            self._bar.update(n)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
