"""Published results kept as data, and the layout of the tables a run is compared in.

``data/published.json`` (shipped with the package) holds the rows of the original Context Spanning paper's tables
as its README prints them (Table 1: spoken QA and math, ref. / resp. accuracy; Table 2: Full-Duplex-Bench v1;
Table 3: Full-Duplex-Bench v3; the Context Span latency table), MoshiRAG's delay columns (its Table 1: TTFAT, KD,
E2EKD) and its Full-Duplex-Bench v1 row, and the Full-Duplex-Bench v3 paper's Table 2 rows. Every row names its
``source`` (where the number was read) and, for a reprinted row, its ``origin`` (the paper it comes from); the
``sources`` map says what each name is, a row's ``where`` the table it was read from, and ``unverified`` why values
could not be checked against the source (the report marks such rows ‡). Values are as printed, in the unit of
their column (:attr:`Column.unit`: percent, fraction, seconds...), ``null`` where the source prints none.

:data:`TABLES` lays the tables out as the paper does: systems as rows for Table 1, metrics as rows (grouped by
task) and systems as columns for Tables 2 and 3. ``cspan bench report RUN --compare published`` (or ``--compare
FILE`` with the same format) puts the run beside these rows (:mod:`cspan.bench.compare`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from cspan.bench.errors import BenchDataError
from cspan.core.errors import validation_summary

PUBLISHED = "published"
"""``--compare published``: the data shipped with the package."""


UNITS: dict[str, tuple[float, float]] = {
    "%": (0.0, 100.0),
    "fraction": (0.0, 1.0),
    "s": (0.0, math.inf),
    "ms": (0.0, math.inf),
    "per s": (0.0, math.inf),
    "0-5": (0.0, 5.0),
}
"""The unit of a column and the range its values must lie in."""


@dataclass(frozen=True)
class Column:
    """One value of a table: its key in the data, its label, which way is better, the decimals shown, its group
    and its unit (a key of :data:`UNITS`: ``%`` = percent 0-100, ``fraction`` = 0-1, ``s``, ``ms``...)."""

    key: str
    label: str
    direction: str | None = None
    digits: int = 3
    group: str = ""
    unit: str = "fraction"

    @property
    def header(self) -> str:
        arrow = {"up": " ↑", "down": " ↓"}.get(self.direction or "", "")
        return f"{self.label}{arrow}"


@dataclass(frozen=True)
class TableLayout:
    """A table as the paper lays it out (``systems_as_rows``: one row per system; else one row per metric)."""

    id: str
    title: str
    caption: str
    columns: tuple[Column, ...]
    systems_as_rows: bool


QA_SETS_SHOWN = (("llamaq", "LlamaQ"), ("webq", "WebQ"), ("triviaqa", "TriviaQA"), ("halueval", "HaluEval"))
MATH_SETS_SHOWN = (
    ("addsub", "AddSub"),
    ("multiarith", "MultiArith"),
    ("singleeq", "SinglEq"),
    ("svamp", "SVAMP"),
    ("gsm8k", "GSM8K"),
)
SPAN_LENGTHS = (0, 16, 64, 256, 600)
"""The span lengths (frames) of the published latency table."""


def _accuracy_columns(sets: tuple[tuple[str, str], ...]) -> tuple[Column, ...]:
    return tuple(
        Column(f"{key}.{part}", f"{name} {part}.", "up", 1, group=name, unit="%")
        for key, name in sets
        for part in ("ref", "resp")
    )


TABLES: dict[str, TableLayout] = {
    t.id: t
    for t in (
        TableLayout(
            "qa",
            "Table 1. Spoken QA (accuracy, %)",
            "ref. = the injected reference judged against the gold answer; resp. = the model's response.",
            _accuracy_columns(QA_SETS_SHOWN),
            True,
        ),
        TableLayout(
            "math",
            "Table 1 (continued). Spoken math reasoning (accuracy, %)",
            "The math sets were unseen during the original model's training.",
            _accuracy_columns(MATH_SETS_SHOWN),
            True,
        ),
        TableLayout(
            "qa_delay",
            "Table 1 (delays). Time to first answer token, keyword delay, end-to-end keyword delay (s)",
            "MoshiRAG's Table 1 delay columns, macro-averaged over the QA sets (LlamaQ, WebQ, TriviaQA, HaluEval); "
            "E2EKD = TTFAT + KD (a run's three means are over the same answers, those whose keyword was found; "
            "equal up to rounding).",
            (
                Column("ttfat_s", "TTFAT", "down", 2, unit="s"),
                Column("keyword_delay_s", "KD", "down", 2, unit="s"),
                Column("e2ekd_s", "E2EKD", "down", 2, unit="s"),
            ),
            True,
        ),
        TableLayout(
            "fdb_v1",
            "Table 2. Full-Duplex-Bench v1",
            "TOR = take-over rate; backchannel frequency per second; JSD = Jensen-Shannon distance to the human "
            "backchannel timing; latencies in seconds; the interruption response rated 0-5 by an LLM judge.",
            (
                Column("turn_taking.tor", "TOR", "up", 3, "Turn-Taking"),
                Column("turn_taking.latency_s", "Latency, s", "down", 3, "Turn-Taking", unit="s"),
                Column("pause_handling.tor_candor", "TOR, Candor", "down", 3, "Pause Handling"),
                Column("pause_handling.tor_synthetic", "TOR, synthetic", "down", 3, "Pause Handling"),
                Column("backchannel.tor", "TOR", "down", 3, "Backchannel"),
                Column("backchannel.frequency", "Frequency, per s", "up", 3, "Backchannel", unit="per s"),
                Column("backchannel.jsd", "JSD", "down", 3, "Backchannel"),
                Column("user_interruption.tor", "TOR", "up", 3, "User Interruption"),
                Column("user_interruption.rating", "Rating, 0-5", "up", 3, "User Interruption", unit="0-5"),
                Column("user_interruption.latency_s", "Latency, s", "down", 3, "User Interruption", unit="s"),
            ),
            False,
        ),
        TableLayout(
            "fdb_v3",
            "Table 3. Full-Duplex-Bench v3 (tool calling under disfluency)",
            "Tool selection, argument accuracy, response quality and pass rate are fractions; take-turn, interruption "
            "and filler rates are percentages; latency is the task-completion time in seconds.",
            (
                Column("tool_selection", "Tool selection", "up", 3, "Tool Use"),
                Column("argument_accuracy", "Argument accuracy", "up", 3, "Tool Use"),
                Column("response_quality", "Response quality", "up", 3, "Tool Use"),
                Column("pass_rate", "Pass rate", "up", 3, "Tool Use"),
                Column("take_turn_rate", "Take-turn rate, %", "up", 1, "Turn-Taking Dynamics", unit="%"),
                Column("task_completion_latency_s", "Latency, s", "down", 2, "Turn-Taking Dynamics", unit="s"),
                Column("interruption_rate", "Interruption rate, %", "down", 1, "Turn-Taking Dynamics", unit="%"),
                Column("filler_rate", "Filler rate, %", "down", 1, "Turn-Taking Dynamics", unit="%"),
            ),
            False,
        ),
        TableLayout(
            "span_latency",
            "Context Span processing latency (span prefill + one decoding step, ms)",
            "n = span length in frames; n = 0 is a plain step. The 80 ms frame budget must hold.",
            tuple(
                Column(f"{n}.{stat}", f"n={n} {stat}", "down", 1, group=str(n), unit="ms")
                for n in SPAN_LENGTHS
                for stat in ("mean_ms", "sd_ms", "p99_ms")
            ),
            False,
        ),
    )
}
"""The compared tables by id, in the order the report shows them."""


class Source(BaseModel):
    """Where published numbers were read."""

    title: str
    where: str
    note: str = ""


class PublishedRow(BaseModel):
    """One system's published values in one table: where they were read (``source``, and ``where`` in it), the
    paper a reprinted row comes from (``origin``), and ``unverified``: why (some of) its values could not be
    checked against the source ("" = checked)."""

    system: str
    source: str
    origin: str | None = None
    where: str = ""
    unverified: str = ""
    note: str = ""
    values: dict[str, float | None]

    @property
    def reprinted(self) -> bool:
        """The source reprints this row from another paper (``origin``)."""
        return self.origin is not None


class PublishedData(BaseModel):
    """``published.json``: the sources and, per table id, the published rows."""

    format: int = 1
    about: str = ""
    sources: dict[str, Source]
    tables: dict[str, list[PublishedRow]] = Field(default_factory=dict)

    def check(self, where: str) -> PublishedData:
        """Every table id is known, every value key is a column of its table and lies in its unit's range (finite;
        percent 0-100, fractions 0-1, times >= 0...), every source and origin is named.

        Raises:
            BenchDataError: the first inconsistency, with its place.
        """
        for table, rows in self.tables.items():
            layout = TABLES.get(table)
            if layout is None:
                raise BenchDataError(f"{where}: unknown table {table!r}; tables are {', '.join(TABLES)}")
            columns = {c.key: c for c in layout.columns}
            for row in rows:
                unknown = sorted(set(row.values) - set(columns))
                if unknown:
                    raise BenchDataError(f"{where}: {table} / {row.system}: unknown value keys {unknown}")
                for key, value in row.values.items():
                    unit = columns[key].unit
                    low, high = UNITS[unit]
                    if value is not None and not (math.isfinite(value) and low <= value <= high):
                        raise BenchDataError(
                            f"{where}: {table} / {row.system}: {key} = {value} is not a {unit} value "
                            f"({low:g} to {high:g}); give percent as 0-100 and fractions as 0-1"
                        )
                for ref in (row.source, row.origin):
                    if ref is not None and ref not in self.sources:
                        raise BenchDataError(f"{where}: {table} / {row.system}: unknown source {ref!r}")
        return self


def load_published(spec: str | Path = PUBLISHED) -> PublishedData:
    """The published rows: ``"published"`` = the package's ``data/published.json``, else a JSON file of that format.

    Raises:
        BenchDataError: the file is missing, not JSON, or inconsistent (:meth:`PublishedData.check`).
    """
    if str(spec) == PUBLISHED:
        where = "cspan.bench data/published.json"
        text = resources.files("cspan.bench").joinpath("data", "published.json").read_text(encoding="utf-8")
    else:
        path = Path(spec)
        where = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise BenchDataError(f"--compare {path}: not readable ({exc}); use 'published' or a JSON file") from exc
    try:
        data = PublishedData.model_validate(json.loads(text))
    except json.JSONDecodeError as exc:
        raise BenchDataError(f"{where} is not JSON: {exc}") from exc
    except ValidationError as exc:
        raise BenchDataError(f"{where} is not published-results JSON: {validation_summary(exc)}") from exc
    return data.check(where)
