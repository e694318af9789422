"""``cspan bench fdb-v1 run``: render Full-Duplex-Bench v1 outputs with the duplex model, transcribe and score them.

For every sample folder ``DATA/{task}/{ID}/`` holding ``input.wav``, the recording is played through the full
Context Spanning loop (:func:`cspan.bench.session.render`: persona prefix, voice activity, ``<ret>`` answered by
the retriever and injected as a Context Span) and the agent's audio is written as ``OUT/{task}/{ID}/output.wav``
**on the input's timeline**, as the benchmark's own inference scripts do (``docs/reference/benchmarks.md`` section
1.2): same start, same length (plus ``tail_s`` when asked), at the input's sample rate by default (the backchannel
reference scorer assumes 16 kHz, the rate of most inputs), with the agent's first frame one frame (80 ms) late as
a live client plays it (``output_offset_frames``). The input and the task's JSON files are copied next to it, so
``OUT`` is itself a dataset that the benchmark's scripts and ``cspan bench fdb-v1 score`` read.

Then ``output.json`` is written by a word-timed transcriber (:mod:`cspan.bench.transcribe`, with the benchmark's
crop-and-offset rule for user interruption), every task is scored (:func:`cspan.bench.fdb_v1.score_task`) and
``OUT/{task}/summary.json`` + ``samples.json`` are written, plus ``OUT/summary.md`` (the report's v1 table).

Per sample, ``run.json`` records how the output was made (settings, seed, agent text, Context Spans, events,
timing) and, once scored, the sample's scores. The run is resumable: a sample whose ``run.json`` says it finished
with the same settings is not rendered again, and an existing ``output.json`` is not transcribed again (a
re-rendered sample loses its stale ``output.json`` and ``rating.json``).

Prompts (PersonaPlex's for this benchmark, section 1.9): user interruption "You are a wise and friendly teacher.
..."; every other task "You enjoy having a good conversation.".
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cspan.bench.errors import BenchDataError, BenchSettingsError
from cspan.bench.fdb_v1 import (
    ICC_GT_JSON,
    OUTPUT_JSON,
    OUTPUT_WAV,
    RATING_JSON,
    TaskKind,
    TaskScore,
    infer_task_kind,
    load_icc_gt,
    parse_task_spec,
    score_task,
    write_task_score,
)
from cspan.bench.resume import RenderedAgain
from cspan.bench.session import (
    CONVERSATION_PROMPT,
    TEACHER_PROMPT,
    BenchSession,
    Progress,
    check_audio_inputs,
    read_pcm,
    render,
    seed_for,
    settings_key,
    write_json,
    write_wav,
)

log = logging.getLogger(__name__)

INPUT_WAV = "input.wav"
RUN_JSON = "run.json"
"""Per-sample record of the rendering (and, after scoring, the sample's scores)."""
SUMMARY_MD = "summary.md"
_OWN_FILES = {OUTPUT_WAV, OUTPUT_JSON, RATING_JSON, RUN_JSON}


def task_prompt(kind: TaskKind, override: str | None = None) -> str:
    """The persona prompt of a task: ``override`` when given, else PersonaPlex's prompt for the task."""
    if override:
        return override
    return TEACHER_PROMPT if kind is TaskKind.USER_INTERRUPTION else CONVERSATION_PROMPT


@dataclass
class TaskInput:
    """One task folder of the input dataset: its name, scorer and sample folders (those with ``input.wav``)."""

    name: str
    kind: TaskKind
    folder: Path
    samples: list[Path]


def _sort_key(path: Path) -> tuple[int, int, str]:
    return (0, int(path.name), path.name) if path.name.isdigit() else (1, 0, path.name)


def input_samples(task_dir: Path, kind: TaskKind) -> list[Path]:
    """Sample folders of an input task folder: immediate sub-folders with ``input.wav`` (all-digit names only for
    backchannel, whose IDs key the ground truth), in ID order."""
    found = []
    for entry in task_dir.iterdir():
        if not entry.is_dir() or entry.name.startswith(".") or not (entry / INPUT_WAV).is_file():
            continue
        if kind is TaskKind.BACKCHANNEL and not entry.name.isdigit():
            continue
        found.append(entry)
    return sorted(found, key=_sort_key)


def resolve_input_tasks(data: Path, specs: Sequence[str] | None = None) -> list[TaskInput]:
    """The task folders of an input dataset.

    Args:
        data: the dataset root (``{task}/{ID}/input.wav``) or one task folder.
        specs: ``NAME`` or ``NAME=KIND`` (KIND one of pause_handling, backchannel, turn_taking,
            user_interruption); default every folder whose name names a task.

    Raises:
        BenchDataError: no such folder, or no task with samples.
        BenchSettingsError: a ``--tasks`` entry with an unknown scorer or no such folder (exit status 2).
    """
    if not data.is_dir():
        raise BenchDataError(f"--data {data} is not a folder")
    tasks: list[TaskInput] = []
    if specs:
        for spec in specs:
            name, kind = parse_task_spec(spec)
            folder = data / name if (data / name).is_dir() else (data if data.name == name else data / name)
            if not folder.is_dir():
                raise BenchSettingsError(f"--tasks {name!r}: {data / name} is not a folder")
            tasks.append(TaskInput(name, kind, folder, input_samples(folder, kind)))
    else:
        for folder in sorted(p for p in data.iterdir() if p.is_dir() and not p.name.startswith(".")):
            kind = infer_task_kind(folder.name)
            if kind is not None:
                samples = input_samples(folder, kind)
                if samples:
                    tasks.append(TaskInput(folder.name, kind, folder, samples))
        if not tasks:
            kind = infer_task_kind(data.name)
            if kind is not None and input_samples(data, kind):
                tasks.append(TaskInput(data.name, kind, data, input_samples(data, kind)))
    tasks = [t for t in tasks if t.samples]
    if not tasks:
        raise BenchDataError(
            f"no task folders with samples found in {data}; expected e.g. candor_turn_taking/{{ID}}/input.wav, or "
            "name them with --tasks NAME=KIND"
        )
    return tasks


@dataclass
class V1RunOptions:
    """How to render.

    Attributes:
        text_prompt: persona prompt for every task (None: PersonaPlex's per task, :func:`task_prompt`).
        seed: base seed; sample ``{task}/{ID}`` renders with :func:`~cspan.bench.session.seed_for`.
        tail_s: silence fed after the input and kept in ``output.wav`` (0: the output is exactly as long as the
            input, as the benchmark's scripts make it).
        output_offset_frames: frames of silence before the agent's first frame (1, as a live client hears it).
        output_rate: sample rate of ``output.wav`` (None: the input's).
        force_ret: times after the input's end (s) at which to force a ``<ret>`` (empty: only the model's own).
        realtime: live clock (80 ms per frame).
        config: the :class:`~cspan.core.runtime.ConversationConfig`.
        overwrite: render again even where a finished output with the same settings exists.
        limit: first N samples per task.
        quiet: no progress bar.
        describe: extra settings recorded in ``run.json`` (and part of the resume key): backends, checkpoint.
        rendered_again: the finished outputs this run renders again because their settings differ.
    """

    text_prompt: str | None = None
    seed: int = 42424242
    tail_s: float = 0.0
    output_offset_frames: int = 1
    output_rate: int | None = None
    force_ret: Sequence[float] = ()
    realtime: bool = False
    config: Any = None
    overwrite: bool = False
    limit: int | None = None
    quiet: bool = False
    describe: dict[str, Any] = field(default_factory=dict)
    rendered_again: RenderedAgain = field(default_factory=lambda: RenderedAgain("fdb-v1"))


def _copy_inputs(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.name not in _OWN_FILES and not item.name.startswith("."):
            target = dst / item.name
            if not target.exists() or target.stat().st_size != item.stat().st_size:
                target.unlink(missing_ok=True)
                shutil.copyfile(item, target)


def _finished(out_dir: Path, key: str, settings: dict[str, Any], again: RenderedAgain | None = None) -> bool:
    """Whether ``out_dir`` holds a finished output rendered with these settings (one finished with others is told
    to ``again``)."""
    record = out_dir / RUN_JSON
    if not (record.is_file() and (out_dir / OUTPUT_WAV).is_file()):
        return False
    try:
        data = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    if not (isinstance(data, dict) and data.get("complete")):
        return False
    if data.get("settings_key") == key:
        return True
    if again is not None:
        again.found(out_dir, data.get("settings"), settings)
    return False


async def render_sample(
    session: BenchSession,
    sample_dir: Path,
    out_dir: Path,
    task: TaskInput,
    options: V1RunOptions,
    *,
    transcriber: Any = None,
    retriever: Any = None,
) -> tuple[bool, dict[str, Any]]:
    """Render one sample into ``out_dir`` (``output.wav``, copied inputs, ``run.json``).

    Returns ``(rendered, record)``: ``rendered`` is False when a finished output with the same settings was kept.

    Raises:
        BenchDataError: the input is missing or unreadable.
    """
    from cspan.core.constants import SAMPLE_RATE

    prompt = task_prompt(task.kind, options.text_prompt)
    settings = {
        "prompt": prompt,
        "seed": options.seed,
        "tail_s": options.tail_s,
        "output_offset_frames": options.output_offset_frames,
        "output_rate": options.output_rate,
        "force_ret": list(options.force_ret),
        "realtime": options.realtime,
        **options.describe,
    }
    key = settings_key(settings)
    _copy_inputs(sample_dir, out_dir)
    if not options.overwrite and _finished(out_dir, key, settings, options.rendered_again):
        return False, json.loads((out_dir / RUN_JSON).read_text(encoding="utf-8"))
    for stale in (OUTPUT_JSON, RATING_JSON, RUN_JSON):
        (out_dir / stale).unlink(missing_ok=True)

    native, native_rate = read_pcm(sample_dir / INPUT_WAV)
    pcm, _ = read_pcm(sample_dir / INPUT_WAV, SAMPLE_RATE)
    input_s = native.shape[0] / native_rate
    seed = seed_for(options.seed, f"{task.name}/{sample_dir.name}")
    rendered = await render(
        session,
        pcm,
        text_prompt=prompt,
        seed=seed,
        tail_s=options.tail_s,
        transcriber=transcriber,
        retriever=retriever,
        config=options.config,
        conversation_id=f"fdb-v1/{task.name}/{sample_dir.name}",
        force_ret_s=[input_s + t for t in options.force_ret],
        realtime=options.realtime,
    )
    rate = options.output_rate or native_rate
    length = round((input_s + options.tail_s) * SAMPLE_RATE)
    agent = rendered.output_pcm(offset_frames=options.output_offset_frames, length=length)
    # exactly the input's sample count (plus the tail) at the output rate, whatever the resampler rounds to
    out_len = round(native.shape[0] * rate / native_rate) + round(options.tail_s * rate)
    write_wav(out_dir / OUTPUT_WAV, agent, rate, length=out_len)
    record = {
        "benchmark": "fdb-v1",
        "task": task.name,
        "kind": task.kind.value,
        "id": sample_dir.name,
        "input": str(sample_dir / INPUT_WAV),
        "input_duration_s": input_s,
        "output_wav": str(out_dir / OUTPUT_WAV),
        "output_sample_rate": rate,
        "output_duration_s": out_len / rate,
        "seed": seed,
        "settings": settings,
        "settings_key": key,
        "agent_text": rendered.agent_text,
        "agent_words": [{"text": w.text, "start_s": w.start_s} for w in rendered.agent_words],
        "spans": [e.model_dump(mode="json") for e in rendered.spans()],
        "rets": len(rendered.rets()),
        "events": rendered.events_json(),
        "prefix_frames": rendered.prefix_frames,
        "frames": rendered.frames,
        "wall_s": rendered.wall_s,
        "realtime_factor": rendered.duration_s / max(rendered.wall_s, 1e-9),
        "complete": True,
    }
    write_json(out_dir / RUN_JSON, record)
    return True, record


def _add_scores(score: TaskScore, task_out: Path) -> None:
    for sample in score.samples:
        path = task_out / sample.id / RUN_JSON
        if not path.is_file():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        data["score"] = sample.model_dump(mode="json")
        write_json(path, data)


@dataclass
class V1RunResult:
    """What :func:`run_fdb_v1` did: per task, the samples rendered and kept, and the score (None if not scored)."""

    rendered: int = 0
    kept: int = 0
    transcribed: int = 0
    scores: list[tuple[TaskInput, TaskScore | None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    summary_md: Path | None = None


async def run_fdb_v1(
    session: BenchSession,
    tasks: Sequence[TaskInput],
    out: Path,
    options: V1RunOptions,
    *,
    loop_transcriber: Any = None,
    retriever: Any = None,
    score_transcriber: Any = None,
    icc_gt_path: Path | None = None,
    judge: Any = None,
    asr_label: str = "",
) -> V1RunResult:
    """Render every sample of ``tasks`` into ``out``, then transcribe and score.

    Args:
        session: the model (:func:`~cspan.bench.session.build_session`).
        tasks: from :func:`resolve_input_tasks`.
        out: output root (``out/{task}/{ID}/``).
        options: :class:`V1RunOptions`.
        loop_transcriber, retriever: the conversation loop's backends (None: no utterance transcripts / no
            retrieval).
        score_transcriber: word-timed transcriber for ``output.json`` (None: not transcribed, not scored).
        icc_gt_path: ``icc_gt_distribution.json`` (required to score backchannel tasks).
        judge: the user-interruption judge (``OpenAIJudge``), or None (ratings skipped with a note).

    Raises:
        BenchDataError: a backchannel task without ground truth, unreadable inputs.
    """
    from cspan.bench.report import v1_markdown
    from cspan.bench.transcribe import ensure_output_jsons

    if any(t.kind is TaskKind.BACKCHANNEL for t in tasks) and score_transcriber is not None and icc_gt_path is None:
        raise BenchDataError(
            f"backchannel scoring needs {ICC_GT_JSON} (the benchmark's v1_v1.5/evaluation folder); put it in the "
            "data folder or pass --icc-gt PATH (or --asr none to render only)"
        )
    check_audio_inputs([d / INPUT_WAV for t in tasks for d in t.samples[: options.limit]])
    result = V1RunResult()
    total = sum(len(t.samples[: options.limit]) for t in tasks)
    with Progress(total, "fdb-v1 render", quiet=options.quiet) as bar:
        for task in tasks:
            for sample_dir in task.samples[: options.limit]:
                done, _ = await render_sample(
                    session,
                    sample_dir,
                    out / task.name / sample_dir.name,
                    task,
                    options,
                    transcriber=loop_transcriber,
                    retriever=retriever,
                )
                result.rendered += int(done)
                result.kept += int(not done)
                bar.update()
    again = options.rendered_again.note()
    if again is not None:
        result.notes.append(again)
    if score_transcriber is None:
        result.notes.append("not transcribed or scored (--asr none); score later with `cspan bench fdb-v1 score`")
        result.scores = [(t, None) for t in tasks]
        return result
    icc_gt = load_icc_gt(icc_gt_path) if icc_gt_path is not None else None
    entries = []
    for task in tasks:
        task_out = out / task.name
        dirs = [task_out / d.name for d in task.samples[: options.limit]]
        result.transcribed += len(await ensure_output_jsons(dirs, score_transcriber, task.kind))
        score = score_task(
            task_out,
            task.kind,
            task=task.name,
            icc_gt=icc_gt if task.kind is TaskKind.BACKCHANNEL else None,
            judge=judge if task.kind is TaskKind.USER_INTERRUPTION else None,
            samples=dirs,  # this run's samples, not what an earlier run left in the folder
        )
        score.summary.config = {
            "data": str(task.folder),
            "asr": asr_label,
            "render": {**options.describe, "prompt": task_prompt(task.kind, options.text_prompt)},
        }
        if task.kind is TaskKind.BACKCHANNEL:
            score.summary.config["icc_gt"] = str(icc_gt_path)
        if task.kind is TaskKind.USER_INTERRUPTION:
            score.summary.config["judge"] = judge.describe() if judge is not None else None
        result.scores.append((task, score))
    trouble = judge.trouble() if judge is not None else None
    for task, score in result.scores:
        if score is None:
            continue
        if trouble is not None:  # every summary says the judge went down (docs/BENCH.md, Judges)
            score.summary.notes.append(trouble)
        write_task_score(score, out)
        _add_scores(score, out / task.name)
        entries.append((out.resolve().name, score.summary))
    markdown = "# Full-Duplex-Bench v1\n\n" + v1_markdown(entries) + "\n"
    result.summary_md = out / SUMMARY_MD
    result.summary_md.write_text(markdown, encoding="utf-8")
    return result
