"""What a run folder holds for ``cspan bench report``: its score files, found and parsed.

Found anywhere below ``RUN_DIR`` by :func:`collect`:

- ``summary.json`` files written by the scorers: Full-Duplex-Bench v1 (one per task,
  :class:`cspan.bench.fdb_v1.TaskSummary`), v3 (:class:`cspan.bench.fdb_v3.V3Summary`), spoken QA (one per set,
  :class:`cspan.bench.qa.QASummary`); summaries of other benchmarks are read generically (:class:`GenericSummary`);
- span-latency files (:class:`LatencyReport`): ``latency.json``, or any ``*latency*.json`` holding ``rows``.

A file that does not parse is listed in :attr:`RunFiles.skipped` with the reason. The report
(:mod:`cspan.bench.report`) and its comparison with the published rows (:mod:`cspan.bench.compare`) both read a
:class:`RunFiles`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cspan.bench.errors import BenchDataError
from cspan.bench.fdb_v1 import TaskSummary
from cspan.bench.fdb_v3 import V3Summary
from cspan.bench.qa import QASummary
from cspan.core.errors import validation_summary

LATENCY_FILE = "latency.json"
LATENCY_GLOB = "*latency*.json"
"""Span-latency files: ``latency.json`` or any ``*latency*.json`` whose JSON holds a ``rows`` list."""
SUMMARY_FILE = "summary.json"


class LatencyRow(BaseModel):
    """One span length: ``n`` frames (0 = a plain step), mean / standard deviation / 99th percentile in ms."""

    model_config = ConfigDict(extra="allow")

    n: int
    mean_ms: float
    sd_ms: float
    p99_ms: float


class LatencyReport(BaseModel):
    """``latency.json`` of the span-latency benchmark."""

    model_config = ConfigDict(extra="allow")

    gpu: str = "unknown"
    torch: str = "unknown"
    dtype: str = "unknown"
    rows: list[LatencyRow] = Field(default_factory=list)
    step: dict[str, Any] = Field(default_factory=dict)


class GenericSummary(BaseModel):
    """Any other ``summary.json`` with a ``benchmark`` name and numeric ``metrics``."""

    model_config = ConfigDict(extra="allow")

    benchmark: str
    task: str = ""
    n: int | None = None
    metrics: dict[str, float | None] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)


@dataclass
class RunFiles:
    """What :func:`collect` found: each summary with its run label (its folder relative to ``RUN_DIR``)."""

    v1: list[tuple[str, TaskSummary]] = field(default_factory=list)
    v3: list[tuple[str, V3Summary]] = field(default_factory=list)
    qa: list[tuple[str, QASummary]] = field(default_factory=list)
    other: list[tuple[str, GenericSummary]] = field(default_factory=list)
    latency: list[tuple[str, LatencyReport]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _label(run_dir: Path, folder: Path) -> str:
    rel = folder.relative_to(run_dir).as_posix()
    return run_dir.resolve().name if rel in ("", ".") else rel


def collect(run_dir: Path) -> RunFiles:
    """Find and parse every ``summary.json`` and ``latency.json`` below ``run_dir``.

    Files that do not parse are listed in ``skipped`` (with the reason) instead of stopping the report.

    Raises:
        BenchDataError: ``run_dir`` is not a folder.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise BenchDataError(
            f"run folder {run_dir} is a file, not a folder; give the folder that holds the run's summary.json and "
            "latency.json files"
        )
    if not run_dir.is_dir():
        raise BenchDataError(f"run folder {run_dir} does not exist")
    found = RunFiles()
    for path in sorted(run_dir.rglob(SUMMARY_FILE)):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            bench = data.get("benchmark") if isinstance(data, dict) else None
            if bench == "fdb-v1":
                # A v1 run label is the folder holding the task folders.
                found.v1.append((_label(run_dir, path.parent.parent), TaskSummary.model_validate(data)))
            elif bench == "fdb-v3":
                found.v3.append((_label(run_dir, path.parent), V3Summary.model_validate(data)))
            elif bench == "qa":
                found.qa.append((_label(run_dir, path.parent), QASummary.model_validate(data)))
            elif isinstance(bench, str):
                found.other.append((_label(run_dir, path.parent), GenericSummary.model_validate(data)))
            else:
                found.skipped.append(f"{path}: no 'benchmark' field")
        except (OSError, json.JSONDecodeError, ValidationError) as exc:
            found.skipped.append(f"{path}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    for path in sorted(run_dir.rglob(LATENCY_GLOB)):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not (isinstance(data, dict) and isinstance(data.get("rows"), list)):
                if path.name == LATENCY_FILE:  # named as ours but unusable: say so
                    found.skipped.append(f"{path}: not a span-latency report (no 'rows' list in a JSON object)")
                continue  # another benchmark's latency file (no span-latency rows): not ours to report
            report = LatencyReport.model_validate(data)
            if not report.rows:
                found.skipped.append(f"{path}: no span-latency rows ('rows' is empty)")
                continue
            found.latency.append((_label(run_dir, path.parent), report))
        except (OSError, json.JSONDecodeError) as exc:
            found.skipped.append(f"{path}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        except ValidationError as exc:
            found.skipped.append(f"{path}: not a span-latency report ({validation_summary(exc)})")
    return found


__all__ = [
    "LATENCY_FILE",
    "LATENCY_GLOB",
    "SUMMARY_FILE",
    "GenericSummary",
    "LatencyReport",
    "LatencyRow",
    "RunFiles",
    "collect",
]
