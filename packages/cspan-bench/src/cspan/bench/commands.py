"""``cspan bench ...``: the benchmark verbs (registered through the ``cspan.commands`` entry point).

Layout of the command tree, built from lists of register functions so that a new action is one function plus one
list entry:

- :data:`BENCH_ACTIONS` -- the actions of ``cspan bench`` (``latency``, ``capacity``, ``fdb-v1``, ``fdb-v3``, ``qa``,
  ``report``, ``serve``: the load client of :mod:`cspan.bench.serve_load`);
- :data:`FDB_V1_ACTIONS` -- the sub-actions of ``cspan bench fdb-v1`` (``score``, ``run``);
- :data:`FDB_V3_ACTIONS` -- the sub-actions of ``cspan bench fdb-v3`` (``score``, ``run``).

The measuring and rendering actions (``latency``, ``capacity``, ``fdb-v1 run``, ``fdb-v3 run``, ``qa``) live in
:mod:`cspan.bench.run_commands`.

Each register function receives the ``add_subparsers()`` object of its group, adds one parser and sets its
``handler`` (``handler(args) -> int``). Handlers import their heavy modules lazily.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cspan.bench.run_commands import (
    add_judge_arguments,
    check_judge,
    make_judge,
    print_summary,
    register_capacity,
    register_fdb_v1_run,
    register_fdb_v3_run,
    register_latency,
    register_qa,
)
from cspan.bench.serve_load import register_serve

ActionRegister = Callable[[Any], None]
"""``register(subparsers)``: add one action parser to an ``argparse`` sub-parser group and set its handler."""


def bench_command(parser: argparse.ArgumentParser) -> None:
    """Benchmarks: span latency, Full-Duplex-Bench v1/v3, spoken QA, run reports (`cspan bench ACTION --help`)."""
    sub = parser.add_subparsers(dest="bench_command", metavar="ACTION", title="actions")
    sub.required = True
    for register in BENCH_ACTIONS:
        register(sub)
    _remove_empty_out_on_failure(sub)


def _remove_empty_out_on_failure(sub: Any) -> None:
    """Wrap the handler of every action of ``sub``: a failed run removes the ``--out`` folder it created and wrote
    nothing into (:func:`~cspan.bench.session.removing_empty_out`)."""
    from cspan.bench.session import removing_empty_out

    for parser in sub.choices.values():
        handler = parser.get_default("handler")
        if handler is not None:
            parser.set_defaults(handler=removing_empty_out(handler))


def _group(sub: Any, name: str, help_text: str, actions: Sequence[ActionRegister], dest: str) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    inner = parser.add_subparsers(dest=dest, metavar="ACTION", title="actions")
    inner.required = True
    for register in actions:
        register(inner)
    _remove_empty_out_on_failure(inner)


def register_fdb_v1(sub: Any) -> None:
    """``cspan bench fdb-v1 ...``."""
    _group(
        sub,
        "fdb-v1",
        "Full-Duplex-Bench v1: pause, backchannel, turn-taking, user interruption.",
        FDB_V1_ACTIONS,
        "fdb_v1_action",
    )


def register_fdb_v3(sub: Any) -> None:
    """``cspan bench fdb-v3 ...``."""
    _group(sub, "fdb-v3", "Full-Duplex-Bench v3: tool use under disfluency.", FDB_V3_ACTIONS, "fdb_v3_action")


# --- fdb-v1 score ----------------------------------------------------------------------------------------------------


def register_fdb_v1_score(sub: Any) -> None:
    """``cspan bench fdb-v1 score``."""
    p = sub.add_parser(
        "score",
        help="score model outputs laid out as the benchmark's dataset",
        description=(
            "Score Full-Duplex-Bench v1 outputs in the benchmark's dataset layout: DATA/{task}/{ID}/ with input.wav, "
            "output.wav and the task's JSON (turn_taking.json, interrupt.json). output.wav is transcribed into "
            "output.json where that is missing. Writes OUT/{task}/summary.json and samples.json."
        ),
    )
    p.add_argument("--data", required=True, help="dataset root holding task folders (or one task folder)")
    p.add_argument(
        "--tasks",
        nargs="+",
        metavar="TASK[=KIND]",
        help="task folders to score (default: every folder whose name names a task); KIND overrides the scorer: "
        "pause_handling, backchannel, turn_taking, user_interruption",
    )
    p.add_argument("--out", help="where summaries go (default: DATA/scores)")
    p.add_argument(
        "--asr",
        default="sphinx",
        help="transcriber for missing output.json, which must give word times: 'sphinx' (default, embedded "
        "pocketsphinx); a URL with a /v1 path segment (http://host:port/v1) or openai+ prefix (openai+http://host:port) "
        "for an OpenAI-compatible /v1/audio/transcriptions endpoint; any other http(s) URL (http://host:port, without "
        "/v1) for a POST /transcribe server such as `cspan asr-serve`",
    )
    p.add_argument(
        "--asr-model", help="model name for an OpenAI-compatible --asr URL, the /v1 kind (default qwen3-asr)"
    )
    p.add_argument(
        "--retranscribe", action="store_true", help="transcribe output.wav again even where output.json exists"
    )
    p.add_argument("--icc-gt", help="backchannel ground truth icc_gt_distribution.json (default: looked up in DATA)")
    p.add_argument(
        "--reuse-ratings",
        action="store_true",
        help="user interruption: use existing rating.json files instead of the judge",
    )
    add_judge_arguments(p, "gpt-4-turbo", "the user-interruption relevance rating")
    p.set_defaults(handler=_fdb_v1_score)


def _resolve_tasks(data: Path, specs: Sequence[str] | None) -> list[tuple[str, Any, Path]]:
    from cspan.bench.errors import BenchDataError, BenchSettingsError
    from cspan.bench.fdb_v1 import infer_task_kind, parse_task_spec, sample_dirs, unrendered_dirs

    if not data.is_dir():
        raise BenchDataError(f"--data {data} is not a folder")
    resolved = []
    if specs:
        for spec in specs:
            name, kind = parse_task_spec(spec)
            folder = data / name
            if not folder.is_dir():
                raise BenchSettingsError(f"--tasks {name!r}: {folder} is not a folder")
            resolved.append((name, kind, folder))
        return resolved
    for folder in sorted(p for p in data.iterdir() if p.is_dir() and not p.name.startswith(".")):
        kind = infer_task_kind(folder.name)
        # a task folder with inputs but no output yet (a run cut short) is scored as n = 0 with a note
        if kind is not None and (sample_dirs(folder, kind) or unrendered_dirs(folder, [])):
            resolved.append((folder.name, kind, folder))
    if not any(sample_dirs(folder, kind) for _, kind, folder in resolved):
        resolved = []  # inputs only (a dataset not rendered yet): nothing to score
    if not resolved:
        kind = infer_task_kind(data.name)
        if kind is not None and sample_dirs(data, kind):
            resolved.append((data.name, kind, data))
    if not resolved:
        raise BenchDataError(
            f"no task folders found in {data}; expected e.g. candor_turn_taking/{{ID}}/output.wav, or name them with "
            "--tasks NAME=KIND"
        )
    return resolved


def _find_icc_gt(arg: str | None, data: Path, task_dir: Path) -> Path:
    from cspan.bench.errors import BenchDataError
    from cspan.bench.fdb_v1 import ICC_GT_JSON

    if arg:
        return Path(arg)
    for candidate in (task_dir / ICC_GT_JSON, data / ICC_GT_JSON, Path.cwd() / ICC_GT_JSON):
        if candidate.is_file():
            return candidate
    raise BenchDataError(
        f"backchannel scoring needs {ICC_GT_JSON} (in the benchmark's v1_v1.5/evaluation folder); put it in {data} "
        "or pass --icc-gt PATH"
    )


async def _transcribe_all(jobs: Sequence[tuple[list[Path], Any]], transcriber: Any, overwrite: bool) -> int:
    from cspan.bench.transcribe import ensure_output_jsons

    written = 0
    try:
        for dirs, kind in jobs:
            written += len(await ensure_output_jsons(dirs, transcriber, kind, overwrite=overwrite))
    finally:
        close = getattr(transcriber, "aclose", None)
        if close is not None:
            await close()
    return written


def _fdb_v1_score(args: argparse.Namespace) -> int:
    from cspan.bench import fdb_v1
    from cspan.bench.session import check_out, check_out_apart
    from cspan.bench.transcribe import make_transcriber

    data = Path(args.data)
    tasks = _resolve_tasks(data, args.tasks)
    out = Path(args.out) if args.out else data / "scores"
    if args.out:  # the default DATA/scores is a folder of its own next to the task folders
        check_out_apart(out, data, inside=False)
        for _, _, folder in tasks:
            check_out_apart(out, folder, what="the task folder")
    check_out(out, folder=True)
    jobs = []
    for _, kind, folder in tasks:
        dirs = fdb_v1.sample_dirs(folder, kind)
        todo = dirs if args.retranscribe else [d for d in dirs if not (d / fdb_v1.OUTPUT_JSON).is_file()]
        if todo:
            jobs.append((todo, kind))
    transcribed = 0
    if jobs:
        transcriber = make_transcriber(args.asr, model=args.asr_model)
        n = sum(len(d) for d, _ in jobs)
        print(f"transcribing {n} output.wav file(s) with {getattr(transcriber, 'endpoint', args.asr)} ...")
        transcribed = asyncio.run(_transcribe_all(jobs, transcriber, args.retranscribe))
    judge = make_judge(args)
    scores = []
    try:
        for name, kind, folder in tasks:
            icc_gt = None
            config: dict[str, Any] = {"data": str(folder), "asr": args.asr if transcribed else "existing output.json"}
            if kind is fdb_v1.TaskKind.BACKCHANNEL:
                from cspan.bench.vad import silero_vad_version

                gt_path = _find_icc_gt(args.icc_gt, data, folder)
                icc_gt = fdb_v1.load_icc_gt(gt_path)
                config.update(icc_gt=str(gt_path), vad=f"silero-vad {silero_vad_version()} at 16 kHz (soxr)")
            if kind is fdb_v1.TaskKind.USER_INTERRUPTION:
                config["judge"] = judge.describe() if judge is not None else None
                config["reuse_ratings"] = bool(args.reuse_ratings)
            score = fdb_v1.score_task(
                folder, kind, task=name, icc_gt=icc_gt, judge=judge, reuse_ratings=args.reuse_ratings
            )
            score.summary.config = config
            scores.append((name, kind, score))
    finally:
        if judge is not None:
            judge.close()
    trouble = judge.trouble() if judge is not None else None
    for name, kind, score in scores:
        if trouble is not None:  # every summary says the judge went down (docs/BENCH.md, Judges)
            score.summary.notes.append(trouble)
        path = fdb_v1.write_task_score(score, out)
        print_summary(f"{name} ({kind.value}, n={score.summary.n})", score.summary, f" -> {path}")
    check_judge(judge, [])
    return 0


# --- fdb-v3 score ----------------------------------------------------------------------------------------------------


def register_fdb_v3_score(sub: Any) -> None:
    """``cspan bench fdb-v3 score``."""
    from cspan.bench.run_commands import non_negative

    p = sub.add_parser(
        "score",
        help="analyse and score tool-use results against the scenarios",
        description=(
            "Score Full-Duplex-Bench v3 results: tool-selection F1, argument accuracy, pass rate, take-turn rate, "
            "latencies (first response, tool call, task completion), interruption and filler rates. RESULTS is a "
            "JSON file ({results, scenarios?} or a list of results) or a folder of result_PROVIDER.json files. The "
            "scenarios come from --scenarios, the file, or --fdb-v3-dir, with each recording's own metadata.json "
            "over them (recorded in the result by `fdb-v3 run`, next to the result, or in --data), as `fdb-v3 run` "
            "scores. With --judge-url each response is first analysed (filler sentence, key-information onset; "
            "written as latency_tool_analysis_PROVIDER.json next to each result and OUT/key_info_analysis.json); "
            "existing analyses are reused, failed ones asked again. Writes summary.json and samples.json."
        ),
    )
    p.add_argument("--results", required=True, help="results file or folder")
    p.add_argument("--scenarios", type=Path, help="scenario file (benchmark_data_v2.json); default: embedded or DIR's")
    p.add_argument(
        "--fdb-v3-dir",
        type=Path,
        help="the benchmark's v3/ folder: its benchmark_data_v2.json and fdb_v3_data_released/ (nothing is run)",
    )
    p.add_argument(
        "--data",
        type=Path,
        help="the recordings folder, for DATA/{folder}/metadata.json scenarios (default: DIR's fdb_v3_data_released)",
    )
    p.add_argument("--provider", help="only result_PROVIDER.json files of a folder (default: every result_*.json)")
    p.add_argument("--out", help="where summary.json goes (default: next to RESULTS)")
    p.add_argument(
        "--numeric-tolerance",
        type=non_negative,
        default=0.05,
        help="relative tolerance for numeric arguments without a judge, >= 0 (default: %(default)s; 0 = exact)",
    )
    p.add_argument("--reanalyze", action="store_true", help="ask the judge again even where an analysis exists")
    add_judge_arguments(p, "gpt-4o", "the response analysis and response quality (arguments use the exact rule)")
    p.set_defaults(handler=_fdb_v3_score)


def _fdb_v3_score(args: argparse.Namespace) -> int:
    from cspan.bench import fdb_v3
    from cspan.bench.errors import BenchDataError
    from cspan.bench.fdb_v3_release import release_inputs
    from cspan.bench.fdb_v3_run import metadata_scenarios
    from cspan.bench.run_commands import score_v3
    from cspan.bench.session import check_out

    results_path = Path(args.results)
    entries, embedded = fdb_v3.load_result_entries(results_path, args.provider)
    scenario_path, data = args.scenarios, args.data
    if args.fdb_v3_dir is not None:
        dir_scenarios, dir_data = release_inputs(args.fdb_v3_dir)
        scenario_path, data = scenario_path or dir_scenarios, data or dir_data
    scenarios = fdb_v3.load_scenarios(scenario_path) if scenario_path else embedded
    if scenarios is None and not metadata_scenarios(entries, data):
        if args.fdb_v3_dir is not None:
            raise BenchDataError(
                f"--fdb-v3-dir {args.fdb_v3_dir} holds no benchmark_data_v2.json, {results_path} embeds no "
                "scenarios and no recording's metadata.json names its expected tool calls; pass --scenarios FILE"
            )
        raise BenchDataError(
            f"{results_path} embeds no scenarios; pass --scenarios benchmark_data_v2.json or --fdb-v3-dir DIR"
        )
    out = Path(args.out) if args.out else (results_path if results_path.is_dir() else results_path.parent)
    check_out(out, folder=True)
    config = {"results": str(results_path), "provider": args.provider}
    score_v3(entries, scenarios, args, out, config=config, data=data)
    return 0


# --- report ----------------------------------------------------------------------------------------------------------


def register_report(sub: Any) -> None:
    """``cspan bench report``."""
    p = sub.add_parser(
        "report",
        help="Markdown tables and PNG plots from a run folder's score files",
        description=(
            "Collect every summary.json (Full-Duplex-Bench v1/v3, spoken QA, ...) and latency.json below RUN_DIR and "
            "write report.md with tables plus PNG plots (latency vs span length, per-task bars). With --compare "
            "published the report opens with the run beside the published rows of the original paper's Tables 1-3 "
            "(and compare_*.png plots)."
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", help="where report.md and the plots go (default: RUN_DIR)")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    p.add_argument(
        "--compare",
        metavar="published|FILE",
        help="put the run beside published results in the original paper's table layout: 'published' (shipped with "
        "cspan-bench: Context Spanning, MoshiRAG, Full-Duplex-Bench v3) or a JSON file of the same format",
    )
    p.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    from cspan.bench.report import build_report
    from cspan.bench.session import check_out

    check_out(args.out, folder=True, first_file="report.md")
    markdown, written = build_report(
        Path(args.run_dir), Path(args.out) if args.out else None, plots=not args.no_plots, compare=args.compare
    )
    print(markdown)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


FDB_V1_ACTIONS: list[ActionRegister] = [register_fdb_v1_score, register_fdb_v1_run]
FDB_V3_ACTIONS: list[ActionRegister] = [register_fdb_v3_score, register_fdb_v3_run]
BENCH_ACTIONS: list[ActionRegister] = [
    register_latency,
    register_capacity,
    register_fdb_v1,
    register_fdb_v3,
    register_qa,
    register_report,
    register_serve,
]
