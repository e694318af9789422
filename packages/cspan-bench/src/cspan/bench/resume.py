"""Resuming a run: which finished outputs a run renders again, and saying so.

A runner keeps a finished output whose record's ``settings_key`` matches the run's settings and renders the others
again. Those whose settings differ (a flag changed, or a release that records other settings wrote them: after an
upgrade a whole run would be redone without a word) are counted by :class:`RenderedAgain`, which logs the first one
as it is found and gives the run a note naming the settings that differed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def changed_settings(stored: Any, settings: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted names of the settings that differ between ``stored`` (what a finished output's record says it was
    rendered with; not a dict when the record kept none) and ``settings`` (this run's), sorted."""
    if not isinstance(stored, dict):
        return []
    stored, settings = json.loads(json.dumps(stored, default=str)), json.loads(json.dumps(settings, default=str))
    names = []
    for name in sorted(set(stored) | set(settings)):
        old, new = stored.get(name), settings.get(name)
        if isinstance(old, dict) and isinstance(new, dict):
            names += changed_settings(old, new, f"{prefix}{name}.")
        elif name not in stored or name not in settings or old != new:
            names.append(f"{prefix}{name}")
    return names


@dataclass
class RenderedAgain:
    """The finished outputs a resumed run renders again because the settings they were rendered with differ from
    this run's (a flag changed, or a release that records other settings wrote them: an upgrade redoes a whole run
    unless told otherwise). The first one is logged when it is found, so a long run can be stopped before it redoes
    them all; :meth:`note` sums them up for the end of the run."""

    what: str
    count: int = 0
    changed: set[str] = field(default_factory=set)

    def found(self, where: Path, stored: Any, settings: dict[str, Any]) -> None:
        """``where`` (a finished output) is rendered again; ``stored`` is the settings its record holds."""
        changed = changed_settings(stored, settings)
        self.count += 1
        self.changed.update(changed)
        if self.count == 1:
            log.warning(
                "%s: %s was finished with other settings (%s); it is rendered again, as is every finished output "
                "of this run whose settings differ. To keep them, stop now and run with the settings (or the "
                "release) they were rendered with",
                self.what,
                where,
                self._names(changed),
            )

    @staticmethod
    def _names(changed: Iterable[str]) -> str:
        names = sorted(changed)
        if not names:
            return "its record does not say which"
        return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")

    def note(self) -> str | None:
        """One line for the run's notes, or None when nothing finished was rendered again."""
        if not self.count:
            return None
        return (
            f"{self.count} finished output(s) rendered again: they had been rendered with other settings "
            f"({self._names(self.changed)})"
        )
