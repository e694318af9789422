"""``cspan infer``: play a recording through the full Context Spanning loop and write what the agent said and did.

The recording (any file soundfile reads, any rate, mono or stereo) is framed at 12.5 Hz with lead and tail
silence added, and streamed through :class:`~cspan.core.engine.DuplexEngine` frame by frame by a
:class:`~cspan.core.runtime.Conversation`: voice activity and utterance transcripts on the user channel, every
``<ret>`` answered by the retriever (transcriber + router + Context DB) and injected as a Context Span. Outputs: a
stereo 24 kHz audio file (left = user as heard, right = agent; 16-bit WAV, or FLAC, OGG or MP3 by the extension)
and, optionally, the JSON of :class:`~cspan.server.output.InferOutput` (``docs/OUTPUT.md``).

The settings are declared once, in :class:`InferSettings` (flags, ``CSPAN_*`` environment, ``--config`` file). The
job checks before it loads anything: every setting's range, the outputs' folders (writable, enough free space for
the audio), the input, the Context DB, the device; the backend URLs are checked to answer while the model loads,
and, once the tokenizer is there, the persona to fit the model's attention window and every ``--span`` to read as
tokens.

Outputs are written atomically (a temporary ``.part`` file renamed into place): an interrupted or killed run
(SIGTERM) leaves no output file behind, and one output that cannot be written never costs the other: a WAV that
fails mid-run still gets its JSON written (``output_wav`` null), and a JSON that fails keeps the finished WAV; the
error names the path and the cause. Memory stays bounded over any duration: the conversation keeps no history, the
JSON's growing lists are spooled next to it as they happen (:class:`~cspan.server.output.InferJsonStream`), and
what stays per frame is two 4-byte arrays (the step times and the agent's text tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import math
import sys
import time
import unicodedata
import zoneinfo
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, field_validator

from cspan.backends.urls import redact_url
from cspan.core.constants import FRAME_RATE, MAX_LISTEN_S
from cspan.core.settings import EnvList, add_settings_arguments, settings_from_args
from cspan.server.settings_common import (
    DEFAULT_PERSONA,
    BackendSettings,
    ContextDBSettings,
    ModelSettings,
    ToolSettings,
    Utf8Text,
)

if TYPE_CHECKING:
    from cspan.core.audio import AudioInfo
    from cspan.core.errors import OutputError
    from cspan.core.reads import Read, Reads

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_PERSONA", "InferSettings", "run_infer"]

MAX_SILENCE_S = 600.0
"""Longest ``--lead-silence`` / ``--tail-silence`` (seconds)."""
MAX_INPUT_S = 86400.0
"""Highest ``--max-seconds`` (one day)."""
PROBE_TIMEOUT_S = 5.0
"""How long a backend URL may take to answer the start-up check."""


@dataclass(frozen=True)
class TimedText:
    """``SECONDS:TEXT`` from ``--span``: a reference to inject at a time on the input's own timeline."""

    seconds: float
    text: str


def parse_span(value: str) -> TimedText:
    """``"1.0:The weather is..."`` -> :class:`TimedText`; ``ValueError`` saying what is expected."""
    seconds, sep, text = value.partition(":")
    try:
        t = float(seconds)
    except ValueError:
        t = float("nan")
    if not sep or not (math.isfinite(t) and t >= 0):
        raise ValueError(f"{value[:60]!r}: expected SECONDS:TEXT with SECONDS a number >= 0, e.g. 1.0:Hello")
    if not any(_readable(c) for c in text):  # what a Context Span reads: no tokens from spaces, controls, formats
        raise ValueError(
            f"{value[:60]!r}: the reference TEXT after {seconds}: is empty (only spaces, control or "
            "format characters), e.g. 1.0:Hello"
        )
    return TimedText(t, text.strip())


def _readable(c: str) -> bool:
    """Whether a Context Span reads ``c`` as text: not a space, a control character (read as a space) or a format
    character such as U+200B or U+FEFF (which SentencePiece's normaliser drops)."""
    return not c.isspace() and unicodedata.category(c) not in ("Cc", "Cf")


def frame_at(seconds: float) -> int:
    """The 12.5 Hz frame that contains ``seconds`` (frame k covers [k * 0.08, (k + 1) * 0.08))."""
    return math.floor(seconds * FRAME_RATE + 1e-9)


def printable(text: str) -> str:
    r"""``text`` for a terminal: each character that is not printable (controls such as ``\x1b``, line breaks,
    format characters) written as its Python escape (``\x12``, ``\n``, ``\u202e``), a file name's byte that is
    not UTF-8 as ``\xNN`` (as the JSON keeps it), so that what a random-weight model or a file name holds can never
    move the cursor or recolour the terminal."""
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(c: str) -> str:
    if "\udc80" <= c <= "\udcff":  # os.fsdecode's stand-in for an undecodable byte
        return f"\\x{ord(c) - 0xDC00:02x}"
    return c.encode("unicode_escape").decode("ascii")


def same_frame_times(times: list[float]) -> list[list[float]]:
    """The groups of ``times`` (in order, each of two or more) that fall in the same 12.5 Hz frame."""
    frames: dict[int, list[float]] = {}
    for t in times:
        frames.setdefault(frame_at(t), []).append(t)
    return [group for group in frames.values() if len(group) > 1]


_IO = {"group": "input and output"}
_CONV = {"group": "conversation"}


class InferSettings(ModelSettings, BackendSettings, ToolSettings, ContextDBSettings):
    """Run a recording through the full loop; write a stereo WAV (user | agent) and a JSON of what happened."""

    input_wav: Path = Field(
        description="the user's recording (WAV, FLAC, OGG, MP3: any file soundfile reads)",
        json_schema_extra={**_IO, "metavar": "FILE"},
    )
    output_wav: Path = Field(
        description="stereo 24 kHz audio, left user, right agent: 16-bit WAV, or FLAC, OGG or MP3 by the extension",
        json_schema_extra={**_IO, "metavar": "FILE"},
    )
    output_text: Path | None = Field(
        None, description="JSON of words, transcripts, events, timing", json_schema_extra={**_IO, "metavar": "FILE"}
    )
    channel: int = Field(0, ge=0, le=255, description="input channel to use (0 = left / mono)", json_schema_extra=_IO)
    max_seconds: float = Field(
        3600.0,
        gt=0.0,
        le=MAX_INPUT_S,
        allow_inf_nan=False,
        description=f"refuse longer inputs (s; at most {MAX_INPUT_S:g})",
        json_schema_extra=_IO,
    )
    lead_silence: float = Field(
        4.0,
        ge=0.0,
        le=MAX_SILENCE_S,
        allow_inf_nan=False,
        description=f"seconds of silence before the input (at most {MAX_SILENCE_S:g})",
        json_schema_extra=_CONV,
    )
    tail_silence: float = Field(
        8.0,
        ge=0.0,
        le=MAX_SILENCE_S,
        allow_inf_nan=False,
        description=f"seconds of silence after the input (at most {MAX_SILENCE_S:g})",
        json_schema_extra=_CONV,
    )
    user_name: Utf8Text = Field(
        "", max_length=200, description="the user's name (persona prefix and profile)", json_schema_extra=_CONV
    )
    user_city: Utf8Text = Field(
        "", max_length=200, description="the user's city (persona prefix and profile)", json_schema_extra=_CONV
    )
    user_tz: str = Field(
        "", description="the user's IANA time zone, e.g. Europe/London (profile)", json_schema_extra=_CONV
    )
    span: EnvList[Utf8Text] = Field(
        default_factory=list,
        description="inject TEXT as a Context Span at SECONDS of the input (no backend); repeatable",
        json_schema_extra={**_CONV, "metavar": "SECONDS:TEXT"},
    )
    force_ret_at: EnvList[Annotated[float, Field(ge=0.0, allow_inf_nan=False)]] = Field(
        default_factory=list,
        description="behave as if the model emitted <ret> at SECONDS of the input; repeatable",
        json_schema_extra={**_CONV, "metavar": "SECONDS"},
    )
    realtime: bool = Field(
        False,
        description="pace the loop to 80 ms per frame and apply references as they arrive (wall clock)",
        json_schema_extra=_CONV,
    )
    span_delay_s: float = Field(
        0.8,
        ge=0.0,
        le=MAX_LISTEN_S,
        allow_inf_nan=False,
        description="offline clock: apply each reference this long (s) after it was asked, whatever the backend's "
        "wall-clock latency (deterministic; ignored with --realtime)",
        json_schema_extra=_CONV,
    )
    quiet: bool = Field(False, description="no progress bar or summary", json_schema_extra=_CONV)

    @field_validator("output_wav", "output_text")
    @classmethod
    def _check_output_file(cls, value: Path | None) -> Path | None:
        if value is not None and value.is_dir():
            raise ValueError("is a directory; pass a file path for the output")
        return value

    @field_validator("output_wav")
    @classmethod
    def _check_output_format(cls, value: Path) -> Path:
        from cspan.core.audio import output_format
        from cspan.core.errors import OutputError

        try:
            output_format(value)
        except OutputError as exc:
            raise ValueError(str(exc).removeprefix(f"{value}: ")) from None
        return value

    @field_validator("user_tz")
    @classmethod
    def _check_time_zone(cls, value: str) -> str:
        if value:
            try:
                zoneinfo.ZoneInfo(value)
            except (zoneinfo.ZoneInfoNotFoundError, ValueError):
                raise ValueError(f"{value!r} is not an IANA time zone name (e.g. Europe/London)") from None
        return value

    @field_validator("span")
    @classmethod
    def _check_spans(cls, value: list[str]) -> list[str]:
        for item in value:
            parse_span(item)
        return value

    @property
    def spans(self) -> list[TimedText]:
        """``--span`` values, parsed."""
        return [parse_span(v) for v in self.span]

    @property
    def outputs(self) -> dict[str, Path]:
        """The output files by their flag."""
        outputs = {"--output-wav": self.output_wav}
        if self.output_text is not None:
            outputs["--output-text"] = self.output_text
        return outputs


def infer_command(parser: argparse.ArgumentParser) -> None:
    """Run a recording through the full loop; write a stereo WAV (user | agent) and a JSON of what happened."""
    parser.formatter_class = argparse.HelpFormatter  # the generated help shows the defaults itself
    add_settings_arguments(parser, InferSettings)
    parser.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    import os

    from cspan.core.settings import CONFIG_ENV

    config = getattr(args, "config", None) or os.environ.get(CONFIG_ENV) or None
    asyncio.run(run_infer(settings_from_args(args), config=Path(config) if config else None))
    return 0


# ------------------------------------------------------------------------------------------- kept for cspan serve
# ``cspan serve`` still builds its flags with argparse from these two functions; once it declares its settings with
# ModelSettings and BackendSettings (cspan.server.settings_common) they go.


# ------------------------------------------------------------------------------------------------ the pieces


@dataclass
class InferResult:
    """What :func:`run_infer` produced: where the JSON went, and the live objects (for tests and embedding)."""

    output_text: Path | None
    engine: Any
    conversation: Any

    @functools.cached_property
    def output(self) -> Any:
        """The JSON document (:class:`~cspan.server.output.InferOutput`), read from ``output_text`` on first use
        (the run keeps no event list in memory).

        Raises:
            CspanError: the run wrote no JSON (no ``--output-text``).
        """
        from cspan.core.errors import CspanError
        from cspan.server.output import InferOutput

        if self.output_text is None:
            raise CspanError("this run wrote no JSON document (it had no --output-text): there is no output to read")
        return InferOutput.model_validate_json(self.output_text.read_bytes())


def context_db_file(db: str | None) -> Path | None:
    """The SQLite file ``--db`` names (the default one when None), or None: ``:memory:``, a PostgreSQL URL, an
    unsupported URL (reported when the DB is opened)."""
    from cspan.backends.context_db import ContextDBError, resolve_target, sqlite_file

    try:
        path = sqlite_file(resolve_target(db))
    except ContextDBError:
        return None
    return None if path is None else Path(path)


def check_outputs(reads: Iterable[Read], outputs: dict[str, Path]) -> None:
    """Refuse outputs (by their flag) that are folders, collide with each other or would overwrite what the run
    reads (``reads``: :func:`infer_reads`; the rule of :func:`cspan.core.reads.check_outputs`), then check that each
    one's folder can be written (created if missing), before any work.

    Raises:
        SettingsError: a folder, two flags naming the same file, a file or folder the run reads (the flag and the
            file; exit status 2). CspanError: a path that is no regular file. OutputError: a folder that cannot be
            written (path and cause).
    """
    from cspan.core.files import check_writable
    from cspan.core.reads import check_outputs as refuse_overwrites

    refuse_overwrites(outputs, reads)
    for out in outputs.values():
        check_writable(out)


def infer_reads(settings: InferSettings, config: Path | None = None) -> Reads:
    """Everything ``cspan infer`` reads, by its flag, that no output may overwrite: the recording, a ``--voice``
    file (a recording or a ``.pt``; a voice name is no file), the ``--config`` settings file, the Context DB and its
    journal files, the ``--knowledge`` folder, the files an MCP server's command line names, and every file and
    folder of the checkpoint and its base (:func:`cspan.core.checkpoint.checkpoint_reads`: found without downloading
    or loading anything; a Hub checkpoint not in the cache yet is known once loaded)."""
    from cspan.core.checkpoint import checkpoint_reads
    from cspan.core.reads import Reads

    s = settings
    reads = Reads().file("--input-wav", s.input_wav, "the --input-wav recording")
    if s.voice and Path(s.voice).expanduser().is_file():
        reads.file("--voice", s.voice)
    reads.file("--config", config)
    reads.sqlite("--db", context_db_file(s.db))
    reads.folder("--knowledge", s.knowledge)
    for server in s.tools_spec().mcp:
        for arg in server.command or ():
            # the server's program or script, or a file it is given (as an argument, or as --flag=FILE)
            for word in dict.fromkeys((arg, arg.partition("=")[2])):
                path = Path(server.cwd or ".").expanduser() / Path(word).expanduser()
                if word and path.is_file():
                    reads.file("--mcp", path, f"a file of --mcp {server.where}")
    return reads.extend(checkpoint_reads(s.checkpoint, base=s.base))


async def probe_backends(settings: BackendSettings, *, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Check that the backend URLs (``--asr``, ``--router``) answer, all at once: any HTTP response counts.

    Raises:
        CspanError: a URL where nothing answers (refused, unknown host, no answer within ``timeout_s``), with the
            flag, the URL and what to do.
    """
    from cspan.backends.http_client import unanswered
    from cspan.core.errors import CspanError

    checks = {
        flag: (url, fallback, start)
        for flag, url, fallback, start in (
            ("--asr", settings.asr_url, "sphinx", "`cspan backends start` or `cspan asr-serve`"),
            ("--router", settings.router_url, "local", "`cspan backends start`"),
        )
        if url is not None
    }
    if not checks:
        return
    why = await unanswered({flag: url for flag, (url, _, _) in checks.items()}, timeout_s)
    problems = [
        f"{flag} {redact_url(url)}: nothing answers there ({why[flag].why}); start the server ({start}) or fix the URL, "
        f"or use {flag} {fallback}"
        for flag, (url, fallback, start) in checks.items()
        if flag in why
    ]
    if problems:
        raise CspanError("; ".join(problems))


def open_context_db(settings: ContextDBSettings) -> Any:
    """Open (or create) the Context DB of ``--db`` (default: the file in the platform's data directory), applying
    ``--retention-days``.

    Raises:
        CspanError: the file is not a Context DB, is of a newer schema, or its folder cannot be created.
    """
    from cspan.backends.context_db import ContextDBError, resolve_target
    from cspan.backends.context_db.connection import is_postgres_url
    from cspan.core.errors import CspanError, os_error_cause

    target = resolve_target(settings.db)
    where = redact_url(target)  # a PostgreSQL URL's password stays out of the message
    try:
        return settings.open_db()
    except ContextDBError as exc:
        cause = str(exc.__cause__ or exc).replace("--context-db", "--db")
        fix = (
            "check that the server is running and the URL (host, port, database, user)"
            if is_postgres_url(target)
            else "pass a Context DB file or a new path"
        )
        raise CspanError(f"--db {where}: cannot open the Context DB: {cause}; {fix}") from None
    except OSError as exc:
        cause = "a file is in the way of its folder" if isinstance(exc, FileExistsError) else os_error_cause(exc)
        raise CspanError(f"--db {where}: cannot create the Context DB there: {cause}") from None


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


def persona_frames(checkpoint: Any, settings: InferSettings, voice: Any) -> dict[str, Any]:
    """How much of the attention window the persona prefix (in the checkpoint's layout, with ``voice``, a
    :class:`~cspan.core.voice.VoicePrompt` or None) takes; refuses one that leaves too little to talk.

    A persona may take at most half the checkpoint's ``context`` (the 7B's 3000 positions: 1500 frames = 120 s),
    so that at least as much remains for the conversation before the prefix starts leaving the window.

    Returns:
        ``{"frames", "voice_frames", "text_tokens", "window"}`` (``window`` None for an unbounded context).

    Raises:
        SettingsError: the persona is longer than that, with its size and what to shorten (exit status 2).
    """
    from cspan.core.errors import SettingsError
    from cspan.core.prefix import build_persona_prefix

    prefix = build_persona_prefix(
        checkpoint.tokenizer,
        settings.text_prompt,
        voice,
        layout=checkpoint.prefix_layout,
        user_name=settings.user_name or None,
        user_city=settings.user_city or None,
    )
    window = checkpoint.lm_config.context
    info = {
        "frames": prefix.num_frames,
        "voice_frames": prefix.voice_frames,
        "text_tokens": len(prefix.text_ids),
        "window": window,
    }
    too_long = prefix.too_long_for(window, characters=len(settings.text_prompt))
    if too_long is not None and window is not None and prefix.voice_frames >= len(prefix.text_ids):
        voice_name = settings.voice or "(the checkpoint's default voice)"
        raise SettingsError(f"--voice {voice_name}: {too_long}. Use a shorter voice prompt (2-30 s)")
    if too_long is not None:
        raise SettingsError(f"--text-prompt: {too_long}. Shorten the text prompt")
    return info


def check_spans_read(tokenizer: Any, spans: Iterable[TimedText]) -> None:
    """Refuse a ``--span`` the checkpoint's tokenizer reads as nothing (``▁``, U+FFFD, a character its normaliser
    drops): it would never be injected. Run once the tokenizer is loaded, before the first frame.

    Raises:
        SettingsError: naming the span's time (exit status 2).
    """
    from cspan.core.errors import SettingsError, SpanError
    from cspan.core.span import ContextSpan

    if tokenizer is None:  # a bare LM: spans are refused at injection, as without this check
        return
    for span in spans:
        try:
            ContextSpan(span.text).encode(tokenizer)
        except SpanError as exc:
            raise SettingsError(f"--span at {span.seconds:g} s: {exc}") from None


def _json_text(value: Any) -> Any:
    """Strings as the JSON can hold them: a path with bytes that are not UTF-8 keeps them as ``\\xNN``."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        return value
    if isinstance(value, dict):
        return {k: _json_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_text(v) for v in value]
    return value


def run_frames(settings: InferSettings, info: AudioInfo) -> tuple[int, int, int]:
    """``(lead, input, tail)``: the run's frames (12.5 Hz) of lead silence (``--lead-silence`` rounded up to whole
    frames), of the input (as :func:`cspan.core.audio.iter_frames` yields them) and of tail silence."""
    lead = math.ceil(settings.lead_silence * FRAME_RATE - 1e-9)
    tail = math.ceil(settings.tail_silence * FRAME_RATE - 1e-9)
    return lead, info.stream_frames(), tail


def _drop_stale(path: Path, error: OutputError) -> OutputError:
    """This run's JSON could not be written but its WAV was: a previous run's JSON at ``path`` would sit beside the
    new WAV as if it described it, so it goes (best effort); the error returned says so."""
    from cspan.core.errors import OutputError

    try:
        if not path.is_file():
            return error
        path.unlink()
    except OSError as exc:
        return OutputError(f"{error}; the previous {path} is still there (cannot remove it: {exc.strerror or exc})")
    return OutputError(f"{error}; the previous {path} was removed (it described another run)")


async def run_infer(
    settings: InferSettings,
    *,
    on_frame: Callable[[int, Any], None] | None = None,
    config: Path | None = None,
) -> InferResult:
    """The whole ``cspan infer`` job (see the module docstring for the order of the checks).

    ``on_frame(k, engine)`` (optional) is called after frame ``k``'s step, on the event loop (for benchmarks: the
    soak of ``scripts/long_conversation_soak.py`` samples memory there). ``config``: the settings file the settings
    were read from (no output may overwrite it).

    Raises:
        CspanError: bad input, a backend URL where nothing answers, a persona too long for the window (all
            before any output is written). OutputError: an output that cannot be written (names the path and the
            cause; the other output is kept).
    """
    from cspan.core.audio import inspect_audio
    from cspan.core.checkpoint import DEFAULT_CHECKPOINT
    from cspan.core.constants import FRAME_SIZE
    from cspan.core.devices import pick_device
    from cspan.core.errors import CspanError, SettingsError
    from cspan.core.files import check_writable
    from cspan.core.runtime import use_cpu_threads
    from cspan.core.voice import check_voice_path

    s = settings
    # 1. before anything is loaded: the outputs' folders, the input, the free space, the device, the Context DB.
    check_outputs(infer_reads(s, config), s.outputs)
    check_voice_path(s.voice)  # a --voice path where no file is fails before the model loads
    info = inspect_audio(s.input_wav, channel=s.channel, max_seconds=s.max_seconds)
    if info.nonfinite:
        logger.warning("%s: %d NaN or infinite samples read as silence", s.input_wav, info.nonfinite)
    if info.clipped:
        logger.warning("%s: %d samples beyond full scale clipped to +-1.0", s.input_wav, info.clipped)
    lead, n_input, tail = run_frames(s, info)
    total = lead + n_input + tail
    last_s = (n_input + tail) / FRAME_RATE
    for label, t in [*(("--span", x.seconds) for x in s.spans), *(("--force-ret-at", t) for t in s.force_ret_at)]:
        if t >= last_s:
            raise SettingsError(
                f"{label} at {t:g} s is past the end of the conversation (input {info.duration_s:.2f} s + "
                f"{s.tail_silence:g} s tail, each rounded up to whole 80 ms frames: {n_input / FRAME_RATE:.2f} s + "
                f"{tail / FRAME_RATE:.2f} s); use a time below {last_s:.2f} s"
            )
    for group in same_frame_times(s.force_ret_at):  # spans at one frame are all injected; a <ret> is one event
        k = frame_at(group[0])
        logger.warning(
            "--force-ret-at %s s fall in the same 80 ms frame (%.2f to %.2f s of the input): one <ret> is forced there",
            ", ".join(f"{t:g}" for t in group),
            k / FRAME_RATE,
            (k + 1) / FRAME_RATE,
        )
    check_writable(s.output_wav, need_bytes=total * FRAME_SIZE * 2 * 2 + 65536)  # 16-bit stereo, the WAV bound
    device, dtype = pick_device(s.device)
    if device.type == "cpu":
        use_cpu_threads()  # before any thread's first operation: each takes the count then
    source = s.checkpoint or DEFAULT_CHECKPOINT

    from cspan.backends.identity import Principal
    from cspan.server.shared_backends import build_backends, build_transcriber

    db = open_context_db(s)
    memory = db.user(Principal.local())  # one person at this machine: the local user, as `cspan serve` without tokens
    # the run starts from the user's stored profile; only the fields given (--user-name, --user-city, --user-tz)
    # change it, so that a run without them neither erases nor ignores what an earlier one stored
    given = {"name": s.user_name, "city": s.user_city, "timezone": s.user_tz}
    try:  # the write that shows the database takes writes; the conversation is recorded once the model reads it
        profile = memory.merge_profile({k: v for k, v in given.items() if v})
    except Exception as exc:  # sqlite3 errors: a read-only or locked database file
        raise CspanError(f"--db {db.where}: cannot write to the Context DB: {exc}") from None

    # 2. the backend URLs must answer (all checked at once, in milliseconds when they do), then the tools (MCP
    # servers start here) and the model load
    await probe_backends(s)
    backends = await build_backends(s, build_transcriber(s))
    try:
        return await _converse(s, db, memory, profile, backends, info, source, device, dtype, on_frame, config)
    finally:
        await backends.aclose()


async def _converse(
    s: InferSettings,
    db: Any,
    memory: Any,
    profile: Any,
    backends: Any,
    info: Any,
    source: str,
    device: Any,
    dtype: Any,
    on_frame: Callable[[int, Any], None] | None = None,
    config: Path | None = None,
) -> InferResult:
    """Steps 2 (the model) to 4 (the outputs) of :func:`run_infer`, with the backends built."""
    import numpy as np
    import torch

    from cspan.core.audio import AtomicAudioWriter, iter_frames
    from cspan.core.checkpoint import load_checkpoint
    from cspan.core.constants import FRAME_SIZE, SAMPLE_RATE
    from cspan.core.engine import DuplexEngine
    from cspan.core.errors import CspanError, OutputError
    from cspan.core.files import stop_signals_deferred
    from cspan.core.reads import check_outputs as refuse_overwrites
    from cspan.core.runtime import Conversation, ConversationConfig, decode_agent_text
    from cspan.core.voice import choose_voice, describe_voice, voice_summary
    from cspan.server.memory_span import MemorySpan, memory_summary
    from cspan.server.output import InferJsonStream, InferOutput, PersonaInfo, Timing, ToolsInfo, timing_stats
    from cspan.server.records import db_recorder

    lead, n_input, tail = run_frames(s, info)
    total = lead + n_input + tail
    transcriber = backends.transcriber
    retriever = backends.for_session(memory)
    checkpoint = await asyncio.to_thread(
        load_checkpoint, source, base=s.base, device=device, dtype=dtype, fuse_lora=s.fuse_lora
    )
    # what the load read, now that a Hub checkpoint is in the cache (before it, only a cached one was known)
    refuse_overwrites(s.outputs, infer_reads(s, config))
    chosen = choose_voice(s.voice, checkpoint)
    voice = None if chosen is None else chosen.prompt
    # the persona names the user as the profile does (the flags, else what the Context DB remembers)
    persona_s = s.model_copy(update={"user_name": profile.name, "user_city": profile.city})
    persona = {**persona_frames(checkpoint, persona_s, voice), **describe_voice(chosen)}
    check_spans_read(checkpoint.tokenizer, s.spans)
    engine = DuplexEngine(
        checkpoint,
        batch_size=1,
        temp=s.temp,
        temp_text=s.temp_text,
        cuda_graphs=None if s.cuda_graphs else False,
        predict_user=False,  # the user's codes come from the input audio every frame
        persona_policy=s.persona_policy,
        max_block_columns=s.max_block_columns or None,
        kv_dtype=s.kv_dtype,
    )
    engine.reset(0, seed=s.seed)
    engine.set_persona(0, s.text_prompt, voice, user_name=profile.name or None, user_city=profile.city or None)
    if not s.quiet:
        window = f" of the {persona['window']}-position window" if persona["window"] else ""
        print(
            f"persona: {persona['frames']} frames{window} ({persona['voice_frames']} of voice prompt, "
            f"{persona['text_tokens']} text tokens); {voice_summary(chosen, checkpoint)}",
            file=sys.stderr,
        )

    try:  # after the model and the persona: a run that fails before it talks leaves no conversation behind
        conversation_id = memory.start_conversation(
            checkpoint=str(source), settings={"input": _json_text(str(s.input_wav))}
        )
    except Exception as exc:
        raise CspanError(f"--db {db.where}: cannot write to the Context DB: {exc}") from None
    recorder = db_recorder(memory, conversation_id)
    tracker = MemorySpan(engine.context) if s.memory_span else None

    def on_event(event: Any) -> None:
        recorder(event)
        if tracker is not None:
            tracker.on_event(event)
        stream.on_event(event)

    config = ConversationConfig(
        listen_s=s.listen_s,
        span_deadline_s=s.span_deadline_s,
        span_delay_s=None if s.realtime else s.span_delay_s,
        keep_history=False,  # the events go to the stream as they happen: memory stays bounded over any duration
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
        on_event=on_event,
    )
    for span in s.spans:
        conversation.schedule_span(lead + frame_at(span.seconds), span.text)
    for t in s.force_ret_at:
        conversation.schedule_ret(lead + frame_at(t))

    def frames() -> Any:
        silence = np.zeros(FRAME_SIZE, dtype=np.float32)
        for _ in range(lead):
            yield silence
        yield from iter_frames(s.input_wav, channel=s.channel)
        for _ in range(tail):
            yield silence

    progress = None
    if not s.quiet:
        from tqdm import tqdm

        progress = tqdm(total=total, unit="frame", desc="infer", file=sys.stderr, leave=False)
    step_ms = np.zeros(total, dtype=np.float32)  # bounded by the input's length (--max-seconds), never per event
    agent_tokens = array("i")  # the agent's text tokens, 4 bytes a frame (agent_text is decoded from them at the end)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(pcm: torch.Tensor) -> Any:
        # Runs in a worker thread so that backend calls (asyncio tasks) progress while the model computes.
        out = engine.step(pcm)
        sync()
        return out

    # 3. the conversation; the audio streams into a temporary file
    started = time.monotonic()
    writer: AtomicAudioWriter | None = AtomicAudioWriter(s.output_wav, sample_rate=SAMPLE_RATE, channels=2)
    try:
        stream = InferJsonStream(s.output_text)  # the JSON's lists, spooled next to it: nothing grows in memory
    except BaseException:
        writer.abort()
        raise
    wav_error: OutputError | None = None
    text_error_said = False
    try:
        for k, user in enumerate(frames()):
            await conversation.before_step(user)
            t0 = time.perf_counter()
            out = await asyncio.to_thread(step, torch.from_numpy(user)[None])
            step_ms[k] = (time.perf_counter() - t0) * 1000
            token = int(out.text_token[0]) if bool(out.valid[0]) else None
            if token is not None and token >= 0:
                agent_tokens.append(token)
            await conversation.after_step(token, bool(out.is_ret[0]))
            due = tracker.after_step(engine.positions[0]) if tracker is not None else None
            if due is not None:  # spans left the window: the summary is read at the head of the next frame
                summary = memory_summary(memory, conversation_id, profile, due.left)
                if summary:
                    conversation.schedule_span(conversation.frame, summary, source="memory")
            agent = out.agent_pcm[0].detach().float().cpu().numpy()
            if writer is not None:
                try:
                    writer.write(np.stack([user, agent], axis=1))
                except OutputError as exc:
                    # The audio is lost (its partial file goes now, which also frees the space); the conversation
                    # goes on so that the JSON is complete. Without a JSON there is nothing left to save.
                    writer.abort()
                    writer, wav_error = None, exc
                    if stream.spooling:
                        logger.error("%s; the conversation goes on for %s", exc, s.output_text)
            if stream.error is not None and not text_error_said:  # the JSON's spool cannot be written (a full disk)
                text_error_said = True
                if writer is not None:
                    logger.error("%s; the conversation goes on for %s", stream.error, s.output_wav)
            if writer is None and not stream.spooling:  # no output is left to save
                raise OutputError("; ".join(str(e) for e in (wav_error, stream.error) if e is not None))
            if progress is not None:
                progress.update(1)
            if on_frame is not None:
                on_frame(k, engine)
            if s.realtime:
                delay = started + (k + 1) / FRAME_RATE - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)
        await conversation.finish()
    except BaseException:
        if writer is not None:
            writer.abort()
        stream.drop()
        raise
    finally:
        if progress is not None:
            progress.close()
    wall = time.monotonic() - started

    # 4. the outputs: each one written on its own, so that one failing never costs the other; both are finished
    # first (still .part files: a signal now leaves nothing behind), then published in one step that no stop
    # signal splits (a new WAV next to a previous run's JSON would look like one run)
    if writer is not None:
        try:
            writer.finish()
        except OutputError as exc:
            writer, wav_error = None, exc
    try:
        agent_text = decode_agent_text(checkpoint.tokenizer, agent_tokens)
        text_error: OutputError | None = None

        def finish_text() -> None:
            nonlocal text_error
            document = InferOutput(
                input=_json_text(str(s.input_wav)),
                output_wav=None if wav_error is not None else _json_text(str(s.output_wav)),
                sample_rate=SAMPLE_RATE,
                duration_s=total / FRAME_RATE,
                input_offset_s=lead / FRAME_RATE,
                input_nonfinite_samples=info.nonfinite,
                input_clipped_samples=info.clipped,
                persona=PersonaInfo(**persona),
                window=stream.window(engine, s.persona_policy),
                agent_text=agent_text,
                agent_words=[],  # the stream's spooled lists take their places
                user_transcripts=[],
                events=[],
                timing=Timing(
                    frames=total,
                    step=timing_stats(step_ms.tolist()),
                    prefill=timing_stats(stream.prefill_ms.tolist()),
                    realtime_factor=(total / FRAME_RATE) / max(wall, 1e-9),
                ),
                settings=_json_text(s.model_dump(mode="json", exclude={"mcp": {"__all__": {"env"}}})),  # env: secrets
                checkpoint=checkpoint_identity(checkpoint, device, dtype),
                tools=ToolsInfo(sets=list(backends.sets), names=sorted(backends.tool_names())),
            )
            try:
                stream.finish(document)
            except OutputError as exc:
                text_error = exc

        if s.output_text is not None:
            finish_text()
        with stop_signals_deferred():
            if writer is not None:
                try:
                    writer.publish()
                except OutputError as exc:
                    wav_error = exc
                    if s.output_text is not None and text_error is None:
                        finish_text()  # again, with output_wav null
                writer = None
            if s.output_text is not None and text_error is None:
                try:
                    stream.publish()
                except OutputError as exc:
                    text_error = exc
            if text_error is not None and wav_error is None and s.output_wav is not None:
                text_error = _drop_stale(s.output_text, text_error)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        stream.drop()  # written or failed, the spool goes
    try:
        memory.end_conversation(conversation_id)
    except Exception as exc:  # the outputs matter more than the Context DB's bookkeeping (a forgotten user too)
        logger.warning("--db %s: could not record the end of the conversation: %s", db.where, exc)
    try:
        db.close()
    except Exception as exc:
        logger.warning("--db %s: could not close it: %s", db.where, exc)
    if wav_error is not None or text_error is not None:
        kept = [str(p) for p, e in ((s.output_wav, wav_error), (s.output_text, text_error)) if p and e is None]
        lines = [str(e) for e in (wav_error, text_error) if e is not None]
        raise OutputError("; ".join(lines) + (f" ({', '.join(kept)} written)" if kept else ""))
    if not s.quiet:
        print(
            f"wrote {printable(str(s.output_wav))} ({total / FRAME_RATE:.1f} s, stereo: left user, right agent)"
            + (f" and {printable(str(s.output_text))}" if s.output_text else "")
            + f"; {stream.spans} span(s); agent said: '{printable(agent_text[:120])}'",
            file=sys.stderr,
        )
    return InferResult(output_text=s.output_text, engine=engine, conversation=conversation)
