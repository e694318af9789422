"""``cspan bench report RUN_DIR``: Markdown tables and PNG plots from the score files of a run folder.

Inputs, found anywhere below ``RUN_DIR`` (:func:`cspan.bench.run_files.collect`):

- ``summary.json`` files written by the scorers: Full-Duplex-Bench v1 (one per task,
  :class:`cspan.bench.fdb_v1.TaskSummary`), v3 (:class:`cspan.bench.fdb_v3.V3Summary`), spoken QA (one per set,
  :class:`cspan.bench.qa.QASummary`); summaries of other benchmarks are listed generically (``benchmark``, ``task``,
  ``metrics``);
- ``latency.json`` from the span-latency benchmark (or any ``*latency*.json`` holding ``rows``): ``{"gpu", "torch",
  "dtype", "rows": [{"n", "mean_ms", "sd_ms", "p99_ms"}], "step": {...}}`` (optional; its absence is noted, and a
  ``latency.json`` that is not such a report, or has no rows, is listed under "Skipped files" with the reason).

Outputs in ``out_dir`` (default ``RUN_DIR``): ``report.md`` and, for what is present, ``latency_vs_span.png``,
``fdb_v1_tasks.png``, ``fdb_v3_metrics.png``. The tables follow the layout of the original system's README (span
latency: one column per span length, rows "mean ± sd, ms" and "P99, ms") and of the benchmark papers (one row per
system, arrows mark which way is better).

With ``compare`` (``"published"`` or a JSON file of :mod:`cspan.bench.published`'s format) the report opens with
the run beside the published rows, laid out like the original paper's Tables 1-3 (:mod:`cspan.bench.compare`), and
writes ``compare_{table}.png`` plots.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cspan.bench.errors import BenchDataError
from cspan.bench.fdb_v1 import METRIC_DIRECTIONS as V1_DIRECTIONS
from cspan.bench.fdb_v1 import TaskKind, TaskSummary
from cspan.bench.fdb_v3 import V3Summary
from cspan.bench.qa import qa_table
from cspan.bench.render import fmt, fmt_pct, markdown_table, pyplot
from cspan.bench.run_files import LATENCY_FILE, SUMMARY_FILE, GenericSummary, LatencyReport, collect
from cspan.core.constants import FRAME_MS

log = logging.getLogger(__name__)


# --- formatting ----------------------------------------------------------------------------------------------------


def _arrow(direction: str | None) -> str:
    return {"up": " ↑", "down": " ↓"}.get(direction or "", "")


_KIND_SHORT = {
    TaskKind.PAUSE_HANDLING: "Pause",
    TaskKind.BACKCHANNEL: "BC",
    TaskKind.TURN_TAKING: "TT",
    TaskKind.USER_INTERRUPTION: "UI",
}
_KIND_WORDS = {
    TaskKind.PAUSE_HANDLING: ("pause", "handling"),
    TaskKind.BACKCHANNEL: ("backchannel",),
    TaskKind.TURN_TAKING: ("smooth", "turn", "taking"),
    TaskKind.USER_INTERRUPTION: ("user", "interruption"),
}
_METRIC_LABEL = {"tor": "TOR", "latency_s": "Lat (s)", "frequency": "Freq", "jsd": "JSD", "rating": "Rating"}
_KIND_ORDER = [TaskKind.PAUSE_HANDLING, TaskKind.BACKCHANNEL, TaskKind.TURN_TAKING, TaskKind.USER_INTERRUPTION]


def _variant(summary: TaskSummary) -> str:
    words = [w for w in summary.task.lower().replace("-", "_").split("_") if w]
    rest = [w for w in words if w not in _KIND_WORDS[summary.kind] and w != "example"]
    return " ".join(rest)


def v1_columns(summaries: Sequence[TaskSummary]) -> list[tuple[str, str, str]]:
    """Headline columns ``(task, metric, header)`` for the tasks present, in the benchmark's table order."""
    tasks = sorted({(s.kind, s.task): s for s in summaries}.values(), key=lambda s: (_KIND_ORDER.index(s.kind), s.task))
    columns = []
    for s in tasks:
        variant = _variant(s)
        for metric, direction in V1_DIRECTIONS[s.kind].items():
            header = f"{_KIND_SHORT[s.kind]} {_METRIC_LABEL[metric]}"
            if variant:
                header += f" ({variant})"
            columns.append((s.task, metric, header + _arrow(direction)))
    return columns


def latency_markdown(label: str, report: LatencyReport) -> str:
    """The span-latency table: one column per span length ``n``, rows mean ± sd and P99 (ms)."""
    rows = sorted(report.rows, key=lambda r: r.n)
    header = ["n (frames)", *[str(r.n) for r in rows]]
    body = [
        ["mean ± sd, ms", *[f"{r.mean_ms:.1f} ± {r.sd_ms:.1f}" for r in rows]],
        ["P99, ms", *[f"{r.p99_ms:.1f}" for r in rows]],
    ]
    device = "GPU" if report.gpu != "unknown" and not report.gpu.startswith("cpu") else "device"
    title = f"Run `{label}`: {device} {report.gpu}, torch {report.torch}, dtype {report.dtype}. n = 0 is a plain step."
    parts = [title, "", markdown_table(header, body)]
    if report.step:
        step = report.step
        if {"mean_ms", "sd_ms", "p99_ms"} <= step.keys():
            p50 = f", P50 {step['p50_ms']:.1f} ms" if "p50_ms" in step else ""
            parts += [
                "",
                f"Plain step: {step['mean_ms']:.1f} ± {step['sd_ms']:.1f} ms{p50}, P99 {step['p99_ms']:.1f} ms.",
            ]
        else:
            parts += ["", "Step: " + ", ".join(f"{k} = {v}" for k, v in step.items()) + "."]
    extra = report.model_extra or {}
    other = extra.get("step_predict_user")
    if other:
        parts += [
            "",
            f"Plain step with the depformer's user-stream predictions (all dep_q codebooks): {other['mean_ms']:.1f} ± "
            f"{other['sd_ms']:.1f} ms, P50 {other['p50_ms']:.1f} ms, P99 {other['p99_ms']:.1f} ms.",
        ]
    config = extra.get("config") or {}
    if "predict_user" in config:
        parts += [
            "",
            f"Engine: user-stream predictions {'sampled' if config['predict_user'] else 'skipped'}, spans read "
            f"{'with the next step (deferred)' if config.get('defer_spans') else 'at injection'}"
            + (f"; every series starts from {config['fill']} positions of history." if config.get("fill") else "."),
        ]
    if config.get("pace_ms"):
        parts += [
            "",
            f"Every call started on a {config['pace_ms']:g} ms clock (--pace-ms), as a server in real time runs.",
        ]
    over = [r.n for r in rows if r.p99_ms > FRAME_MS]
    if over:
        parts += ["", f"P99 over the {FRAME_MS:g} ms frame budget at n = {', '.join(map(str, over))}."]
    return "\n".join(parts)


def v1_markdown(entries: Sequence[tuple[str, TaskSummary]]) -> str:
    """Full-Duplex-Bench v1: one headline row per run, then per-task details with standard deviations and notes."""
    columns = v1_columns([s for _, s in entries])
    by_run: dict[str, dict[str, TaskSummary]] = {}
    for label, summary in entries:
        by_run.setdefault(label, {})[summary.task] = summary
    rows = []
    for label, tasks in by_run.items():
        row = [label]
        for task, metric, _ in columns:
            summary = tasks.get(task)
            row.append(fmt(summary.metrics.get(metric)) if summary else "–")
        rows.append(row)
    parts = [markdown_table(["Run", *[h for _, _, h in columns]], rows), "", "Per task:", ""]
    detail_rows = []
    for label, summary in entries:
        values = []
        for metric in V1_DIRECTIONS[summary.kind]:
            value = fmt(summary.metrics.get(metric))
            std = summary.metrics.get(f"{metric}_std")
            values.append(f"{_METRIC_LABEL[metric]} {value}" + (f" ± {fmt(std)}" if std is not None else ""))
        counts = ", ".join(f"{k} {v}" for k, v in summary.counts.items())
        detail_rows.append([label, summary.task, summary.kind.value, str(summary.n), "; ".join(values), counts])
    parts.append(
        markdown_table(["Run", "Task", "Scorer", "n", "Metrics", "Counts"], detail_rows, ["---"] * 4 + ["---", "---"])
    )
    notes = [f"- `{label}` {s.task}: {note}" for label, s in entries for note in s.notes]
    if notes:
        parts += ["", "Notes:", "", *notes]
    return "\n".join(parts)


_V3_HEADLINE = [
    ("tool_selection", "Tool Sel ↑", fmt),
    ("argument_accuracy", "Arg Acc ↑", fmt),
    ("response_quality", "Resp Qual ↑", fmt),
    ("pass_rate", "Pass@1 ↑", fmt),
    ("take_turn_rate", "Turn-take ↑", fmt_pct),
    ("task_completion_latency_s", "Latency (s) ↓", lambda v: fmt(v, 2)),
    ("interruption_rate", "Interrupt ↓", fmt_pct),
    ("filler_rate", "Filler ↓", fmt_pct),
]


def v3_markdown(entries: Sequence[tuple[str, V3Summary]]) -> str:
    """Full-Duplex-Bench v3: the paper's headline columns, then pass rate by domain and difficulty."""
    rows = [[label, *[f(s.metrics.get(key)) for key, _, f in _V3_HEADLINE]] for label, s in entries]
    parts = [markdown_table(["Run", *[h for _, h, _ in _V3_HEADLINE]], rows), ""]
    extra = [
        [
            label,
            str(s.n),
            fmt(s.metrics.get("response_latency_s"), 2),
            fmt(s.metrics.get("tool_selection_all")),
            fmt(s.metrics.get("argument_accuracy_all")),
        ]
        for label, s in entries
    ]
    parts += [
        markdown_table(["Run", "n", "First-response latency (s) ↓", "Tool Sel (all)", "Arg Acc (all)"], extra),
        "",
    ]
    for group in ("domain", "difficulty", "num_tools"):
        keys = sorted({k for _, s in entries for k in s.breakdowns.get(group, {})})
        if not keys:
            continue
        brows = [[label, *[fmt(s.breakdowns.get(group, {}).get(k)) for k in keys]] for label, s in entries]
        parts += [f"Pass rate by {group.replace('_', ' ')}:", "", markdown_table(["Run", *keys], brows), ""]
    notes = [f"- `{label}`: {note}" for label, s in entries for note in s.notes]
    if notes:
        parts += ["Notes:", "", *notes, ""]
    return "\n".join(parts).rstrip()


def other_markdown(entries: Sequence[tuple[str, GenericSummary]]) -> str:
    """Any other benchmark: one row per summary, its metrics as ``key value`` pairs."""
    rows = [
        [
            label,
            s.benchmark,
            s.task,
            "–" if s.n is None else str(s.n),
            "; ".join(f"{k} {fmt(v)}" for k, v in s.metrics.items()),
        ]
        for label, s in entries
    ]
    return markdown_table(["Run", "Benchmark", "Task", "n", "Metrics"], rows, ["---"] * 5)


# --- plots ---------------------------------------------------------------------------------------------------------


def plot_latency(entries: Sequence[tuple[str, LatencyReport]], path: Path) -> Path:
    """Latency vs span length: mean ± sd (error bars) and P99 per run, with the 80 ms frame budget."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, report in entries:
        rows = sorted(report.rows, key=lambda r: r.n)
        xs = [r.n for r in rows]
        line = ax.errorbar(
            xs,
            [r.mean_ms for r in rows],
            yerr=[r.sd_ms for r in rows],
            marker="o",
            capsize=3,
            label=f"{label} mean ± sd",
        )
        ax.plot(
            xs, [r.p99_ms for r in rows], linestyle="--", marker="x", color=line[0].get_color(), label=f"{label} P99"
        )
    ax.axhline(FRAME_MS, color="grey", linestyle=":", label=f"{FRAME_MS:g} ms frame budget")
    ax.set_xlabel("span length n (frames)")
    ax.set_ylabel("prefill + next step (ms)")
    ax.set_title("Context Span processing latency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _bar_panel(ax: Any, names: Sequence[str], values: Sequence[float | None], title: str) -> None:
    shown = [0.0 if v is None else v for v in values]
    bars = ax.bar(range(len(names)), shown, color=["#bbbbbb" if v is None else "#4c72b0" for v in values])
    for bar, v in zip(bars, values, strict=True):
        ax.annotate(
            "n/a" if v is None else f"{v:.3g}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)


def plot_v1(entries: Sequence[tuple[str, TaskSummary]], path: Path) -> Path:
    """One panel per scored task, a bar per headline metric (label marks which way is better)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(entries), figsize=(3.2 * len(entries), 3.6), squeeze=False)
    for ax, (label, s) in zip(axes[0], entries, strict=True):
        metrics = V1_DIRECTIONS[s.kind]
        names = [_METRIC_LABEL[m] + _arrow(d) for m, d in metrics.items()]
        _bar_panel(ax, names, [s.metrics.get(m) for m in metrics], f"{label}\n{s.task} (n={s.n})")
    fig.suptitle("Full-Duplex-Bench v1", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_v3(entries: Sequence[tuple[str, V3Summary]], path: Path) -> Path:
    """Per run: the rate metrics (0-1), the latencies (s), and pass rate by domain."""
    plt = pyplot()
    fig, axes = plt.subplots(len(entries), 3, figsize=(12, 3.6 * len(entries)), squeeze=False)
    rates = [
        "tool_selection",
        "argument_accuracy",
        "response_quality",
        "pass_rate",
        "take_turn_rate",
        "interruption_rate",
        "filler_rate",
    ]
    times = ["response_latency_s", "task_completion_latency_s"]
    for row, (label, s) in zip(axes, entries, strict=True):
        _bar_panel(row[0], rates, [s.metrics.get(k) for k in rates], f"{label}: rates")
        row[0].set_ylim(0, 1.1)
        _bar_panel(row[1], times, [s.metrics.get(k) for k in times], f"{label}: latency (s)")
        domains = s.breakdowns.get("domain", {})
        _bar_panel(row[2], list(domains), list(domains.values()), f"{label}: pass rate by domain")
        row[2].set_ylim(0, 1.1)
    fig.suptitle("Full-Duplex-Bench v3", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- the report ----------------------------------------------------------------------------------------------------


def build_report(
    run_dir: Path, out_dir: Path | None = None, *, plots: bool = True, compare: str | Path | None = None
) -> tuple[str, list[Path]]:
    """Write ``report.md`` (and the plots) for ``run_dir`` into ``out_dir`` (default ``run_dir``).

    ``compare``: ``"published"`` (the package's published rows) or a file of that format: the run beside them in
    the original paper's layout, first in the report.

    Returns ``(markdown, written files)``. Raises :class:`BenchDataError` when ``run_dir`` is missing or holds no
    score file at all, or ``compare`` is not readable.
    """
    out_dir = out_dir or run_dir
    published = None
    if compare is not None:
        from cspan.bench.published import load_published

        published = load_published(compare)
    found = collect(run_dir)
    if not (found.v1 or found.v3 or found.qa or found.other or found.latency):
        detail = f" (unreadable: {'; '.join(found.skipped)})" if found.skipped else ""
        raise BenchDataError(
            f"{run_dir} holds no {SUMMARY_FILE} or {LATENCY_FILE}{detail}; score a run first with "
            "`cspan bench fdb-v1 score`, `cspan bench fdb-v3 score` or `cspan bench qa`"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    sections = [f"# Benchmark report: `{run_dir.resolve().name}`"]
    if published is not None:
        from cspan.bench.compare import compare_section

        markdown, plotted = compare_section(found, run_dir.resolve().name, published, out_dir if plots else None)
        sections.append(markdown)
        written += plotted
    if found.latency:
        sections.append("## Context Span processing latency (prefill + one decoding step)")
        sections += [latency_markdown(label, rep) for label, rep in found.latency]
        if plots:
            written.append(plot_latency(found.latency, out_dir / "latency_vs_span.png"))
            sections.append("![latency vs span length](latency_vs_span.png)")
    if found.v1:
        sections += ["## Full-Duplex-Bench v1", v1_markdown(found.v1)]
        if plots:
            written.append(plot_v1(found.v1, out_dir / "fdb_v1_tasks.png"))
            sections.append("![Full-Duplex-Bench v1 per task](fdb_v1_tasks.png)")
    if found.v3:
        sections += ["## Full-Duplex-Bench v3 (tool use under disfluency)", v3_markdown(found.v3)]
        if plots:
            written.append(plot_v3(found.v3, out_dir / "fdb_v3_metrics.png"))
            sections.append("![Full-Duplex-Bench v3 metrics](fdb_v3_metrics.png)")
    if found.qa:
        sections += ["## Spoken QA (ref. / resp. accuracy, MoshiRAG's delays)"]
        for label in dict.fromkeys(label for label, _ in found.qa):
            sections += [f"Run `{label}`:", qa_table([s for lab, s in found.qa if lab == label])]
    if found.other:
        sections += ["## Other benchmarks", other_markdown(found.other)]
    if not found.latency:
        unusable = next(run_dir.rglob(LATENCY_FILE), None) is not None  # there is one, listed as skipped
        what = f"usable {LATENCY_FILE} in this run (see Skipped files)" if unusable else f"{LATENCY_FILE} in this run"
        sections.append(f"_No {what}: span latency not measured._")
    if found.skipped:
        sections += ["Skipped files:", "\n".join(f"- {s}" for s in found.skipped)]
    markdown = "\n\n".join(sections) + "\n"
    report_path = out_dir / "report.md"
    report_path.write_text(markdown, encoding="utf-8")
    written.insert(0, report_path)
    log.info("wrote %s", ", ".join(str(p) for p in written))
    return markdown, written
