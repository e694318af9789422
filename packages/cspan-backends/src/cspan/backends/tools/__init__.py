"""Tool bank: what the router can call when the model emits ``<ret>``.

- :class:`ToolBank`, :class:`Tool`, :class:`ToolResult` (:mod:`.bank`): validation, coercion, timeouts, spoken
  results; ``ToolBank.default()`` has ``get_time``, ``calculate``, ``get_weather`` and the 12 Full-Duplex-Bench v3
  tools; ``ToolBank.fdb_v3()`` only the latter; ``await ToolBank.from_mcp(...)`` mounts any MCP server.
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
