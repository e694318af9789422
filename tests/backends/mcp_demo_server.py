"""A tiny stand-alone MCP server (stdio) for the tool-bank tests; it shares no code with cspan.

Run as ``python tests/backends/mcp_demo_server.py``. Built with the SDK's high-level ``MCPServer`` so that the
bank is tested against schemas it did not generate itself:

- ``add(a: int, b: int) -> int``
- ``shout(text: str, times: int = 1) -> str`` (upper-cases ``text``, repeats it)
- ``refuse(reason: str)`` always fails with a deliberate tool error, so the bank must surface the server's message.
- ``crash(code: int = 3)`` ends the server process at once, without a reply (as a crash would).
"""

from __future__ import annotations

import os

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("cspan-demo", log_level="WARNING")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def shout(text: str, times: int = 1) -> str:
    """Upper-case the text and repeat it ``times`` times, separated by spaces."""
    return " ".join([text.upper()] * times)


@server.tool()
def refuse(reason: str) -> str:
    """Always fails with the given reason."""
    raise ToolError(f"refused: {reason}")


@server.tool()
def crash(code: int = 3) -> str:
    """Ends the server process at once, without a reply."""
    os._exit(code)


if __name__ == "__main__":
    server.run("stdio")
