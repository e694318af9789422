"""A bank for the router and retriever tests: ``get_time``, ``calculate``, ``get_weather`` and the 12 tools of the
Full-Duplex-Bench v3 mock world (actions confirmed). Not a product bank: the mock world answers from fabricated data.
Import it as ``from banks import make_mixed_bank`` (pytest puts this folder on the path)."""

from __future__ import annotations

from pathlib import Path

from cspan.backends.tools.bank import DEFAULT_MAX_CHARS, ToolBank
from cspan.backends.tools.catalog import builtin_tools, fdb_v3_bank


def make_mixed_bank(
    *,
    world_db: str | Path | None = None,
    weather_base_url: str | None = None,
    geocoding_base_url: str | None = None,
    max_chars: int = DEFAULT_MAX_CHARS,
) -> ToolBank:
    bank = fdb_v3_bank(world_db, max_chars=max_chars, confirm_actions=True)
    for tool in builtin_tools(
        ["clock", "calculator", "weather"], weather_url=weather_base_url, geocoding_url=geocoding_base_url
    ):
        bank.register(tool)
    return bank
