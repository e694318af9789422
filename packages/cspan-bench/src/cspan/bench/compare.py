"""``cspan bench report RUN --compare published``: the run beside the published rows, in the paper's layout.

The run's values come from the score files :func:`cspan.bench.run_files.collect` finds, grouped by run (the folder
that holds a benchmark's output folder: ``RUN/qa_llamaq``, ``RUN/fdb_v1``, ``RUN/fdb_v3`` and ``RUN/latency.json``
all belong to the run ``RUN``) and converted to the tables' units:

- Table 1 (:data:`~cspan.bench.published.TABLES` ``qa``, ``math``): each set's ``ref_acc`` / ``resp_acc`` x 100;
- Table 1 delays (``qa_delay``): the sets' ``ttfat_s``, ``keyword_delay_s``, ``e2ekd_s`` averaged over the QA sets
  present (LlamaQ, WebQ, TriviaQA, HaluEval) that have all three, as MoshiRAG macro-averages them (so that
  E2EKD = TTFAT + KD holds for the row too); a run with QA sets but no delays gets the row with "–" and a note;
- Table 2 (``fdb_v1``): by scorer kind; a pause-handling task is Candor or synthetic by its folder name
  (``candor_pause_handling``, ``synthetic_pause_handling``);
- Table 3 (``fdb_v3``): the scorer's metrics, rates in percent for take-turn, interruption and filler;
- span latency: ``mean_ms``, ``sd_ms``, ``p99_ms`` per span length.

Each table lists the published rows with their sources (‡ marks a row whose values could not be checked against
its source, † a row the source reprints), the run's rows (what it was judged or run with in the notes) and, with
plots, ``compare_{table}.png``: one panel per column, a bar per system, the run's highlighted. Tables the run has
no results for are listed as not compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from cspan.bench.fdb_v1 import TaskKind
from cspan.bench.published import (
    MATH_SETS_SHOWN,
    QA_SETS_SHOWN,
    TABLES,
    PublishedData,
    PublishedRow,
    TableLayout,
)
from cspan.bench.render import fmt, markdown_table, pyplot
from cspan.bench.run_files import RunFiles
from cspan.core.constants import FRAME_MS


@dataclass
class RunRow:
    """One run's values in one table (same keys and units as the published rows) and what they rest on."""

    label: str
    values: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _run_of(label: str, run_name: str) -> str:
    parent = str(PurePosixPath(label).parent)
    return run_name if parent in ("", ".") else parent


def _pct(value: float | None) -> float | None:
    return None if value is None else 100.0 * value


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run_rows(found: RunFiles, run_name: str) -> dict[str, list[RunRow]]:
    """The run's rows per table id (only tables the run has values for)."""
    out: dict[str, dict[str, RunRow]] = {}

    def row(table: str, run: str) -> RunRow:
        return out.setdefault(table, {}).setdefault(run, RunRow(run))

    qa_by_run: dict[str, list[Any]] = {}
    for label, summary in found.qa:
        qa_by_run.setdefault(_run_of(label, run_name), []).append(summary)
    for run, summaries in qa_by_run.items():
        for table, sets in (("qa", QA_SETS_SHOWN), ("math", MATH_SETS_SHOWN)):
            names = dict(sets)
            order = list(names)
            present = sorted((s for s in summaries if s.task in names), key=lambda s: order.index(s.task))
            if not present:
                continue
            r = row(table, run)
            for s in present:
                r.values[f"{s.task}.ref"] = _pct(s.metrics.get("ref_acc"))
                r.values[f"{s.task}.resp"] = _pct(s.metrics.get("resp_acc"))
                judge = s.config.get("judge")
                described = judge.get("model") if isinstance(judge, dict) else judge
                r.notes.append(f"{names[s.task]}: n = {s.n}, judged by {described or 'unknown'}")
        order = [key for key, _ in QA_SETS_SHOWN]
        knowledge = sorted((s for s in summaries if s.task in order), key=lambda s: order.index(s.task))
        if knowledge:
            timed = [s for s in knowledge if all(s.metrics.get(k) is not None for k in _DELAY_KEYS)]
            r = row("qa_delay", run)
            r.values = {k: _mean([s.metrics[k] for s in timed]) for k in _DELAY_KEYS}
            untimed = [s.task for s in knowledge if s not in timed]
            if timed:
                sources = sorted({str(s.config.get("timing", {}).get("words")) for s in timed})
                r.notes.append(
                    f"macro-average over {', '.join(s.task for s in timed)}; word times from {', '.join(sources)}"
                )
            if untimed:
                r.notes.append(f"no delay values in {', '.join(untimed)} (see their summary notes)")

    for label, summary in found.v1:
        run = _run_of(label, run_name)
        r = row("fdb_v1", run)
        m = summary.metrics
        if summary.kind is TaskKind.PAUSE_HANDLING:
            name = summary.task.lower()
            variant = "candor" if "candor" in name else "synthetic" if "synthetic" in name else None
            if variant is None:
                r.notes.append(
                    f"pause task {summary.task!r} left out: name its folder candor_pause_handling or "
                    "synthetic_pause_handling"
                )
                continue
            _put(r, f"pause_handling.tor_{variant}", m.get("tor"), summary.task)
        else:
            prefix = summary.kind.value
            for metric in ("tor", "latency_s", "frequency", "jsd", "rating"):
                key = f"{prefix}.{metric}"
                if key in {c.key for c in TABLES["fdb_v1"].columns}:
                    _put(r, key, m.get(metric), summary.task)

    for label, summary in found.v3:
        run = _run_of(label, run_name)
        r = row("fdb_v3", run)
        m = summary.metrics
        r.values = {
            "tool_selection": m.get("tool_selection"),
            "argument_accuracy": m.get("argument_accuracy"),
            "response_quality": m.get("response_quality"),
            "pass_rate": m.get("pass_rate"),
            "take_turn_rate": _pct(m.get("take_turn_rate")),
            "task_completion_latency_s": m.get("task_completion_latency_s"),
            "interruption_rate": _pct(m.get("interruption_rate")),
            "filler_rate": _pct(m.get("filler_rate")),
        }
        world = summary.config.get("world") or {}
        judge = summary.config.get("judge") or {}
        r.notes.append(
            f"n = {summary.n}; world: {world.get('kind', 'not recorded')}; judge: {judge.get('model', 'none')}"
        )

    for label, report in found.latency:
        run = _run_of(label, run_name)
        r = row("span_latency", run)
        for lat in report.rows:
            r.values.update(
                {f"{lat.n}.mean_ms": lat.mean_ms, f"{lat.n}.sd_ms": lat.sd_ms, f"{lat.n}.p99_ms": lat.p99_ms}
            )
        r.notes.append(f"{report.gpu}, torch {report.torch}, {report.dtype}")
    return {table: list(rows.values()) for table, rows in out.items()}


_DELAY_KEYS = ("ttfat_s", "keyword_delay_s", "e2ekd_s")


def _put(row: RunRow, key: str, value: float | None, task: str) -> None:
    if key in row.values:
        row.notes.append(f"{key} of {task!r} left out: the run has another task for it")
        return
    row.values[key] = value


# --- tables --------------------------------------------------------------------------------------------------------


def _system_name(row: PublishedRow) -> str:
    return f"{row.system}{'†' if row.reprinted else ''}{'‡' if row.unverified else ''}"


def _source_text(row: PublishedRow) -> str:
    return f"{row.source}, from {row.origin}" if row.reprinted else row.source


def _fmt(value: float | None, digits: int) -> str:
    return fmt(value, digits)


def _systems_rows(layout: TableLayout, published: Sequence[PublishedRow], runs: Sequence[RunRow]) -> str:
    header = ["Model", "Source", *[c.header for c in layout.columns]]
    rows = [
        [_system_name(p), _source_text(p), *[_fmt(p.values.get(c.key), c.digits) for c in layout.columns]]
        for p in published
    ]
    rows += [
        [f"**{r.label}** (this run)", "", *[_fmt(r.values.get(c.key), c.digits) for c in layout.columns]] for r in runs
    ]
    return markdown_table(header, rows, ["---", "---"] + ["---:"] * len(layout.columns))


def _metrics_rows(layout: TableLayout, published: Sequence[PublishedRow], runs: Sequence[RunRow]) -> str:
    header = ["Task", "Metric", *[f"**{r.label}** (this run)" for r in runs], *[_system_name(p) for p in published]]
    rows = []
    last_group = None
    for c in layout.columns:
        group = c.group if c.group != last_group else ""
        last_group = c.group
        rows.append(
            [
                group,
                c.header,
                *[_fmt(r.values.get(c.key), c.digits) for r in runs],
                *[_fmt(p.values.get(c.key), c.digits) for p in published],
            ]
        )
    return markdown_table(header, rows, ["---", "---"] + ["---:"] * (len(runs) + len(published)))


def _latency_rows(layout: TableLayout, published: Sequence[PublishedRow], runs: Sequence[RunRow]) -> str:
    lengths = sorted({int(c.group) for c in layout.columns})
    header = ["System", "", *[f"n = {n}" for n in lengths]]
    rows = []
    systems = [(f"**{r.label}** (this run)", r.values) for r in runs] + [(_system_name(p), p.values) for p in published]
    for name, values in systems:

        def mean_sd(n: int, values: dict[str, float | None] = values) -> str:
            mean, sd = values.get(f"{n}.mean_ms"), values.get(f"{n}.sd_ms")
            return "–" if mean is None else f"{mean:.1f} ± {fmt(sd, 1)}"

        rows.append([name, "mean ± sd", *[mean_sd(n) for n in lengths]])
        rows.append(["", "P99", *[_fmt(values.get(f"{n}.p99_ms"), 1) for n in lengths]])
    return markdown_table(header, rows, ["---", "---"] + ["---:"] * len(lengths))


def table_markdown(layout: TableLayout, published: Sequence[PublishedRow], runs: Sequence[RunRow]) -> str:
    """One compared table: title, caption, the table, the published rows' sources and the run's notes."""
    if layout.id == "span_latency":
        body = _latency_rows(layout, published, runs)
    elif layout.systems_as_rows:
        body = _systems_rows(layout, published, runs)
    else:
        body = _metrics_rows(layout, published, runs)
    parts = [f"### {layout.title}", "", layout.caption, "", body]
    if not layout.systems_as_rows or layout.id == "span_latency":
        sources = "; ".join(f"{_system_name(p)}: {_source_text(p)}" for p in published)
        parts += ["", f"Sources: {sources}."]
    notes = [f"- {p.system}: {p.note}" for p in published if p.note]
    notes += [
        f"- {_system_name(p)}: not verified against the source: {p.unverified}" for p in published if p.unverified
    ]
    notes += [f"- {r.label} (this run): {note}" for r in runs for note in r.notes]
    if notes:
        parts += ["", *notes]
    return "\n".join(parts)


def sources_markdown(data: PublishedData, used: set[str]) -> str:
    """The sources the shown rows name, with what and where they are."""
    lines = [
        "### Sources of the published rows",
        "",
        "† = reprinted by the source from the paper named after it; ‡ = values not verified against the source (see "
        "the table's notes).",
        "",
    ]
    for key in sorted(used):
        s = data.sources[key]
        lines.append(f"- **{key}**: {s.title}. {s.where}." + (f" {s.note}" if s.note else ""))
    return "\n".join(lines)


# --- plots ---------------------------------------------------------------------------------------------------------


def plot_table(layout: TableLayout, published: Sequence[PublishedRow], runs: Sequence[RunRow], path: Path) -> Path:
    """One panel per column (metric), a horizontal bar per system that has a value; the run's bars highlighted."""
    plt = pyplot()
    columns = [c for c in layout.columns if not c.key.endswith(".sd_ms")]
    ncols = min(4, len(columns))
    nrows = -(-len(columns) // ncols)
    systems = [(f"{r.label} (run)", r.values, True) for r in runs] + [
        (_system_name(p), p.values, False) for p in published
    ]
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 0.35 * len(systems) * nrows + 1.2 * nrows))
    flat = list(axes.flat) if hasattr(axes, "flat") else [axes]
    for ax, column in zip(flat, columns, strict=False):
        shown = [(name, v[column.key], run) for name, v, run in systems if v.get(column.key) is not None]
        names = [s[0] for s in shown]
        ax.barh(
            range(len(shown)),
            [s[1] for s in shown],
            color=["#dd8452" if s[2] else "#4c72b0" for s in shown],
        )
        ax.set_yticks(range(len(shown)), names, fontsize=7)
        ax.invert_yaxis()
        title = f"{column.group}: {column.header}" if column.group and not layout.systems_as_rows else column.header
        ax.set_title(title, fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    for ax in flat[len(columns) :]:
        ax.axis("off")
    fig.suptitle(layout.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency(layout: TableLayout, published: Sequence[PublishedRow], runs: Sequence[RunRow], path: Path) -> Path:
    """Latency vs span length per system: mean ± sd (error bars) and P99 (dashed), with the 80 ms frame budget."""
    plt = pyplot()
    lengths = sorted({int(c.group) for c in layout.columns})
    fig, ax = plt.subplots(figsize=(7, 4.2))
    systems = [(f"{r.label} (run)", r.values) for r in runs] + [(_system_name(p), p.values) for p in published]
    for name, values in systems:
        xs = [n for n in lengths if values.get(f"{n}.mean_ms") is not None]
        line = ax.errorbar(
            xs,
            [values[f"{n}.mean_ms"] for n in xs],
            yerr=[values.get(f"{n}.sd_ms") or 0.0 for n in xs],
            marker="o",
            capsize=3,
            label=f"{name} mean ± sd",
        )
        p99 = [n for n in xs if values.get(f"{n}.p99_ms") is not None]
        ax.plot(
            p99, [values[f"{n}.p99_ms"] for n in p99], linestyle="--", color=line[0].get_color(), label=f"{name} P99"
        )
    ax.axhline(FRAME_MS, color="grey", linestyle=":", label=f"{FRAME_MS:g} ms frame budget")
    ax.set_xlabel("span length n (frames)")
    ax.set_ylabel("prefill + next step (ms)")
    ax.set_title(layout.title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- the section ---------------------------------------------------------------------------------------------------


def compare_section(
    found: RunFiles, run_name: str, data: PublishedData, out_dir: Path | None
) -> tuple[str, list[Path]]:
    """Markdown of every table the run has values for (run beside the published rows) and, with ``out_dir``, the
    plots written there. Returns ``(markdown, plot files)``."""
    runs = run_rows(found, run_name)
    parts = [
        "## Compared with the published tables",
        "",
        "The run's numbers beside the published rows, laid out like the Context Spanning paper's tables. Scores "
        "depend on the judge, the transcriber and (for v3) the world the run used: see each table's notes.",
    ]
    written: list[Path] = []
    used: set[str] = set()
    missing = [layout.title for table_id, layout in TABLES.items() if not runs.get(table_id)]
    for table_id, layout in TABLES.items():
        rows = runs.get(table_id)
        if not rows:
            continue
        published = data.tables.get(table_id, [])
        used |= {p.source for p in published} | {p.origin for p in published if p.origin}
        parts += ["", table_markdown(layout, published, rows)]
        if out_dir is not None:
            name = f"compare_{table_id}.png"
            plot = plot_latency if table_id == "span_latency" else plot_table
            written.append(plot(layout, published, rows, out_dir / name))
            parts += ["", f"![{layout.title}]({name})"]
    if not runs:
        parts += ["", "_The run has no values for any published table._"]
    else:
        if missing:
            parts += ["", f"Not compared (the run has no results for them): {'; '.join(missing)}."]
        parts += ["", sources_markdown(data, used)]
    return "\n".join(parts), written
