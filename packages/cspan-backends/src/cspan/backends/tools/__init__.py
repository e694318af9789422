"""Tool bank: what the router can call when the model emits ``<ret>``.

- :class:`ToolBank`, :class:`Tool`, :class:`ToolResult` (:mod:`.bank`): the registry: validation, coercion,
  timeouts, spoken results, :meth:`ToolBank.derive` for a session's view.
- :mod:`.catalog`: tools as configuration: built-in sets by name (clock, calculator, weather, knowledge, memory;
  the Full-Duplex-Bench v3 mock world only as ``fdb-v3``), ``--mcp`` specs with allow lists, ``build_bank``,
  ``session_bank``, ``callback_tool``, ``mount_mcp`` (one MCP server). ``fdb_v3_bank(confirm_actions=False)`` is
  the benchmark's bank.
- :mod:`.world`: the deterministic SQLite mock world behind the Full-Duplex-Bench v3 tools.
- :mod:`.builtin` (clock, calculator), :mod:`.weather` (Open-Meteo), :mod:`.mcp_bridge` (MCP client and server).
- ``cspan tools serve|list|call`` (:mod:`.cli`).
"""

from cspan.backends.errors import ToolError
from cspan.backends.tools.bank import (
    DEFAULT_MAX_CHARS,
    Tool,
    ToolArgs,
    ToolBank,
    ToolKind,
    ToolOutput,
    ToolResult,
    render_clause,
    sanitize_text,
)

__all__ = [
    "DEFAULT_MAX_CHARS",
    "Tool",
    "ToolArgs",
    "ToolBank",
    "ToolError",
    "ToolKind",
    "ToolOutput",
    "ToolResult",
    "render_clause",
    "sanitize_text",
]
