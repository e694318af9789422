"""``cspan bench fdb-v3 run``: Full-Duplex-Bench v3 (tool use under disfluency) scenarios through the full loop.

Input: the benchmark's released layout, ``DATA/{example_id}_{speaker_id}/input.wav`` (human recordings, 48 kHz,
with an optional ``metadata.json``), and optionally the scenario file ``benchmark_data_v2.json``
(``docs/reference/benchmarks.md`` section 2.2). Each recording (plus ``tail_s`` of silence, 6 s in the original)
is played through the loop (:func:`cspan.bench.session.render`) with a router over **only** the 12 mock tools of
the benchmark, a fresh world per scenario so one booking never leaks into another, and every tool call the router
makes is recorded (:class:`cspan.bench.session.RecordingRouter`). As in the original system, each ``<ret>`` can
produce one tool call unless ``--max-tool-calls`` lets the router chain.

Two worlds, recorded as ``world`` in every result and in ``summary.json``:

- this project's (default): ``fdb_v3_bank()`` over :mod:`cspan.backends.tools.world` and the persona
  :data:`V3_PROMPT`; numbers are comparable in kind with the paper's, not digit for digit;
- the benchmark's own release (``--fdb-v3-dir``, :class:`cspan.bench.fdb_v3_release.FDBv3Release`): its
  ``mock_apis.py``, the tool declarations and the persona of its LiveKit agent, as the published rows were run.

Output per scenario, next to a copy of nothing (the inputs stay where they are): ``OUT/{folder}/output_{provider}.wav``
(the agent at 24 kHz on the input's timeline, one frame late as a client hears it) and
``OUT/{folder}/result_{provider}.json`` in the benchmark's result format (:class:`cspan.bench.fdb_v3.V3Result`):
``example_id``, ``actual_tool_calls`` (``[{function, args, timestamp_start}]``, the time the retrieval was asked),
``transcript`` (the model's text stream, as the original system reported it), ``asr_chunks`` and
``input_asr_chunks`` (word-timed ASR of output and input), ``user_speech_end_rel`` (end of the word before the
first inter-word gap over 2 s in the input, else its last word's end), ``audio_agent_speech_start`` (first output
word), plus the scenario's domain, difficulty, title, ``num_expected_calls``, ``input_duration_s``, the
recording's ``metadata.json`` as ``recording_metadata`` (its scenario, when it has one, is what the result is scored
against, by ``run`` and by ``score`` alike: :func:`metadata_scenarios`) and the retrieval events. With scenarios, the
run is scored at the end (:func:`cspan.bench.fdb_v3.score_results`) into ``OUT/summary.json`` and ``samples.json``.
Finished scenarios are kept on re-runs (same settings).
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cspan.bench.errors import BenchDataError
from cspan.bench.fdb_v3 import ResultEntry, V3Result, V3Scenario
from cspan.bench.fdb_v3_release import FDBv3Release
from cspan.bench.resume import RenderedAgain
from cspan.bench.session import (
    BenchSession,
    Progress,
    RecordingRouter,
    close_quietly,
    read_pcm,
    render,
    seed_for,
    settings_key,
    write_json,
    write_wav,
)

log = logging.getLogger(__name__)

INPUT_WAV = "input.wav"
METADATA_JSON = "metadata.json"
USER_END_GAP_S = 2.0
"""An inter-word gap longer than this ends the user's request (the benchmark's ``user_speech_end_rel`` rule)."""
DEFAULT_TAIL_S = 6.0
"""Silence after each recording (the original system's v3 runner)."""

V3_PROMPT = (
    "You are a helpful voice assistant with live access to twelve services: flight search and booking, travel "
    "document updates, credit card benefits, currency exchange, bill autopay, apartment search, commute times, "
    "apartment search filters, order tracking, product search and the shopping cart. When the user asks for one of "
    "these, have it done right away and tell them the result in a short sentence."
)
"""The persona of the v3 runs (this project's wording; the original used the benchmark's LiveKit agent text)."""

_SPEAKER_SUFFIX = re.compile(r"^(?P<example>.+)_(?P<speaker>[0-9a-fA-F]{8,})$")


@dataclass
class V3Sample:
    """One recording: its folder, the scenario id it plays and its metadata."""

    folder: Path
    example_id: str
    metadata: dict[str, Any] = field(default_factory=dict)


def _example_id(folder: Path, metadata: dict[str, Any], scenarios: dict[str, V3Scenario] | None) -> str:
    for key in ("example_id", "scenario_id", "id"):
        value = metadata.get(key)
        if isinstance(value, str | int) and str(value):
            return str(value)
    name = folder.name
    if scenarios:
        parts = name.split("_")
        for k in range(len(parts), 0, -1):
            candidate = "_".join(parts[:k])
            if candidate in scenarios:
                return candidate
    m = _SPEAKER_SUFFIX.match(name)
    return m.group("example") if m else name


def find_samples(data: Path, scenarios: dict[str, V3Scenario] | None = None) -> list[V3Sample]:
    """The recordings below ``data``: sub-folders (one or two levels down) holding ``input.wav``, by name.

    Raises:
        BenchDataError: ``data`` is not a folder or holds no recording.
    """
    if not data.is_dir():
        raise BenchDataError(f"--data {data} is not a folder")
    folders = sorted(p.parent for p in data.glob(f"*/{INPUT_WAV}"))
    if not folders:
        folders = sorted(p.parent for p in data.glob(f"*/*/{INPUT_WAV}"))
    if not folders and (data / INPUT_WAV).is_file():
        folders = [data]
    if not folders:
        raise BenchDataError(f"{data} holds no {{example_id}}_{{speaker_id}}/{INPUT_WAV} recordings")
    samples = []
    for folder in folders:
        metadata: dict[str, Any] = {}
        meta_path = folder / METADATA_JSON
        if meta_path.is_file():
            try:
                loaded = json.loads(meta_path.read_text(encoding="utf-8"))
                metadata = loaded if isinstance(loaded, dict) else {}
            except (OSError, json.JSONDecodeError) as exc:
                raise BenchDataError(f"{meta_path} is not readable JSON ({exc})") from exc
        samples.append(V3Sample(folder=folder, example_id=_example_id(folder, metadata, scenarios), metadata=metadata))
    return samples


def _metadata_scenario(metadata: Any, example_id: str, where: str) -> V3Scenario | None:
    """The scenario a recording's ``metadata.json`` defines (one with ``expected_tool_calls``), or None."""
    from pydantic import ValidationError

    if not isinstance(metadata, dict) or "expected_tool_calls" not in metadata:
        return None
    try:
        return V3Scenario.model_validate({**metadata, "id": example_id})
    except ValidationError as exc:
        raise BenchDataError(f"{where} is not a v3 scenario: {exc}") from exc


def scenarios_from_metadata(samples: Sequence[V3Sample]) -> dict[str, V3Scenario]:
    """Scenarios defined by the recordings' own ``metadata.json`` (those with ``expected_tool_calls``), by id.

    The benchmark's runner merges them over ``benchmark_data_v2.json`` (a folder's metadata wins).

    Raises:
        BenchDataError: a metadata file with ``expected_tool_calls`` that is not a scenario.
    """
    found = {}
    for sample in samples:
        scenario = _metadata_scenario(sample.metadata, sample.example_id, str(sample.folder / METADATA_JSON))
        if scenario is not None:
            found[sample.example_id] = scenario
    return found


def metadata_scenarios(entries: Sequence[ResultEntry], data: Path | None = None) -> dict[str, V3Scenario]:
    """The recordings' own scenarios for already written results, by example id (a folder's metadata wins over
    ``benchmark_data_v2.json``, as in the benchmark's runner), from the first of: the ``recording_metadata`` a result
    records (the runner copies the recording's ``metadata.json`` there), a ``metadata.json`` next to the result file (the
    benchmark's layout: results inside the data folders), ``data/{folder}/metadata.json``.

    Raises:
        BenchDataError: a metadata file that is not readable JSON, or not a scenario.
    """
    found: dict[str, V3Scenario] = {}
    for path, result in entries:
        extra = result.model_extra or {}
        metadata, where = extra.get("recording_metadata"), f"recording_metadata of {path or result.example_id}"
        if metadata is None:
            folder = extra.get("folder") or (path.parent.name if path is not None else None)
            candidates = [path.parent / METADATA_JSON] if path is not None else []
            if data is not None and isinstance(folder, str):
                candidates.append(data / folder / METADATA_JSON)
            for candidate in candidates:
                if candidate.is_file():
                    try:
                        metadata, where = json.loads(candidate.read_text(encoding="utf-8")), str(candidate)
                    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                        raise BenchDataError(f"{candidate} is not readable JSON ({exc})") from exc
                    break
        scenario = _metadata_scenario(metadata, result.example_id, where)
        if scenario is not None:
            found[result.example_id] = scenario
    return found


def chunks_of(words: Sequence[Any] | None, offset_s: float = 0.0) -> list[dict[str, Any]]:
    """Transcriber words -> the benchmark's ``[{text, timestamp: [start, end]}]`` chunks."""
    return [{"text": w.text, "timestamp": [w.start_s + offset_s, w.end_s + offset_s]} for w in (words or [])]


def user_speech_end(chunks: Sequence[dict[str, Any]], gap_s: float = USER_END_GAP_S) -> float | None:
    """End of the word before the first inter-word gap longer than ``gap_s`` (seconds), else the last word's end;
    None without words. Source: the benchmark's ``user_speech_end_rel`` (section 2.2)."""
    if not chunks:
        return None
    for prev, nxt in itertools.pairwise(chunks):
        if nxt["timestamp"][0] - prev["timestamp"][1] > gap_s:
            return float(prev["timestamp"][1])
    return float(chunks[-1]["timestamp"][1])


@dataclass
class V3RunOptions:
    """How to run the scenarios (see :class:`cspan.bench.fdb_v1_run.V1RunOptions` for the shared fields).

    Attributes:
        provider: the ``{provider}`` of ``result_{provider}.json`` / ``output_{provider}.wav``.
        max_tool_calls: tool calls one ``<ret>`` may chain (1 as the original).
        router_timeout_s: LLM router time limit per request.
        release: the benchmark's released world (``--fdb-v3-dir``); None = this project's.
        rendered_again: the finished scenarios this run renders again because their settings differ.
    """

    provider: str = "cspan"
    text_prompt: str | None = None
    seed: int = 42424242
    tail_s: float = DEFAULT_TAIL_S
    output_offset_frames: int = 1
    force_ret: Sequence[float] = ()
    realtime: bool = False
    config: Any = None
    overwrite: bool = False
    limit: int | None = None
    quiet: bool = False
    max_tool_calls: int = 1
    router_timeout_s: float = 8.0
    release: FDBv3Release | None = None
    describe: dict[str, Any] = field(default_factory=dict)
    rendered_again: RenderedAgain = field(default_factory=lambda: RenderedAgain("fdb-v3"))

    @property
    def persona(self) -> str:
        """``text_prompt``, else the release agent's instructions, else :data:`V3_PROMPT`."""
        if self.text_prompt:
            return self.text_prompt
        return self.release.persona if self.release is not None else V3_PROMPT

    def world(self) -> dict[str, Any]:
        """What the results record as ``world``: whose mock APIs, tools and persona the run used."""
        if self.release is not None:
            world = self.release.describe()
        else:
            world = {
                "kind": "cspan",
                "tools": "ToolBank.fdb_v3(): this project's 12 tools over cspan.backends.tools.world",
                "persona": "cspan V3_PROMPT",
            }
        if self.text_prompt:
            world["persona"] = "custom (--text-prompt)"
        return world


async def _transcribe(transcriber: Any, pcm: Any, rate: int) -> list[dict[str, Any]]:
    from cspan.bench.errors import BenchError
    from cspan.bench.transcribe import transcribe_pcm

    if transcriber is None:
        return []
    try:
        output = await transcribe_pcm(transcriber, pcm, rate)
    except BenchError as exc:
        log.warning("transcription failed: %s", exc)
        return []
    return [{"text": c.text, "timestamp": [c.start, c.end]} for c in output.chunks]


async def run_scenario(
    session: BenchSession,
    sample: V3Sample,
    out_dir: Path,
    options: V3RunOptions,
    *,
    router_spec: str,
    router_model: str | None,
    transcriber: Any = None,
    scenario: V3Scenario | None = None,
) -> tuple[bool, V3Result]:
    """Play one recording with a fresh 12-tool bank; write its output WAV and result JSON.

    Returns ``(rendered, result)``; ``rendered`` is False when a finished result with the same settings was kept.
    """
    from cspan.backends.retriever import Retriever
    from cspan.backends.tools.catalog import fdb_v3_bank
    from cspan.bench.session import make_router
    from cspan.core.constants import FRAME_RATE, SAMPLE_RATE

    provider = options.provider
    result_path = out_dir / f"result_{provider}.json"
    wav_path = out_dir / f"output_{provider}.wav"
    world = options.world()
    settings = {
        "prompt": options.persona,
        "world": world,
        "seed": options.seed,
        "tail_s": options.tail_s,
        "output_offset_frames": options.output_offset_frames,
        "force_ret": list(options.force_ret),
        "realtime": options.realtime,
        "max_tool_calls": options.max_tool_calls,
        "router": router_spec,
        "router_model": router_model,
        **options.describe,
    }
    key = settings_key(settings)
    if not options.overwrite and result_path.is_file() and wav_path.is_file():
        try:
            old = json.loads(result_path.read_text(encoding="utf-8"))
            if old.get("complete") and old.get("settings_key") == key:
                return False, V3Result.model_validate(old)
            if old.get("complete"):
                options.rendered_again.found(result_path, old.get("settings"), settings)
        except (OSError, json.JSONDecodeError, ValueError):
            pass

    native, native_rate = read_pcm(sample.folder / INPUT_WAV)
    pcm, _ = read_pcm(sample.folder / INPUT_WAV, SAMPLE_RATE)
    input_s = native.shape[0] / native_rate
    bank = await options.release.tool_bank() if options.release is not None else fdb_v3_bank(confirm_actions=False)
    inner = make_router(
        router_spec,
        bank,
        model=router_model,
        max_tool_calls=options.max_tool_calls,
        timeout_s=options.router_timeout_s,
    )
    recorder = None
    retriever = None
    clock: dict[str, Any] = {}
    if inner is not None:
        recorder = RecordingRouter(inner, lambda: clock["conversation"].frame / FRAME_RATE)
        retriever = Retriever(transcriber, recorder, None, deadline_s=getattr(options.config, "span_deadline_s", None))
    try:
        rendered = await render(
            session,
            pcm,
            text_prompt=options.persona,
            seed=seed_for(options.seed, sample.folder.name),
            tail_s=options.tail_s,
            transcriber=transcriber if retriever is not None else None,
            retriever=retriever,
            config=options.config,
            conversation_id=f"fdb-v3/{sample.folder.name}",
            force_ret_s=[input_s + t for t in options.force_ret],
            realtime=options.realtime,
            on_conversation=lambda conv: clock.__setitem__("conversation", conv),
        )
    finally:
        await close_quietly(recorder, bank)
    length = round((input_s + options.tail_s) * SAMPLE_RATE)
    agent = rendered.output_pcm(offset_frames=options.output_offset_frames, length=length)
    write_wav(wav_path, agent, SAMPLE_RATE)
    input_chunks = await _transcribe(transcriber, native, native_rate)
    output_chunks = await _transcribe(transcriber, agent, SAMPLE_RATE)
    payload: dict[str, Any] = {
        "example_id": sample.example_id,
        "actual_tool_calls": recorder.calls if recorder is not None else [],
        "transcript": rendered.agent_text,
        "asr_transcript": " ".join(c["text"] for c in output_chunks),
        "asr_chunks": output_chunks,
        "input_asr_chunks": input_chunks,
        "user_speech_end_rel": user_speech_end(input_chunks),
        "audio_agent_speech_start": float(output_chunks[0]["timestamp"][0]) if output_chunks else None,
        "input_duration_s": input_s,
        "folder": sample.folder.name,
        "provider": provider,
        "world": world,
        "recording_metadata": sample.metadata or None,
        "retrieval_events": [
            e.model_dump(mode="json")
            for e in rendered.events
            if getattr(e, "type", None) in ("ret", "question", "span", "no_span", "late", "error")
        ],
        "agent_words": [{"text": w.text, "start_s": w.start_s} for w in rendered.agent_words],
        "seed": rendered.seed,
        "settings": settings,
        "settings_key": key,
        "wall_s": rendered.wall_s,
        "complete": True,
    }
    if scenario is not None:
        payload.update(
            domain=scenario.domain,
            difficulty=scenario.difficulty,
            title=scenario.title,
            num_expected_calls=len(scenario.expected_tool_calls),
        )
    write_json(result_path, payload)
    return True, V3Result.model_validate(payload)


async def run_fdb_v3(
    session: BenchSession,
    samples: Sequence[V3Sample],
    out: Path,
    options: V3RunOptions,
    *,
    router_spec: str,
    router_model: str | None = None,
    transcriber: Any = None,
    scenarios: dict[str, V3Scenario] | None = None,
) -> tuple[list[V3Result], int]:
    """Run every scenario recording; returns the results (in folder order) and how many were rendered now."""
    results = []
    rendered = 0
    chosen = list(samples)[: options.limit] if options.limit is not None else list(samples)
    with Progress(len(chosen), "fdb-v3", quiet=options.quiet) as bar:
        for sample in chosen:
            done, result = await run_scenario(
                session,
                sample,
                out / sample.folder.name,
                options,
                router_spec=router_spec,
                router_model=router_model,
                transcriber=transcriber,
                scenario=(scenarios or {}).get(sample.example_id),
            )
            rendered += int(done)
            results.append(result)
            bar.update()
    return results, rendered
