"""``cspan tools``: serve the tool bank as an MCP server, list its tools, or call one.

Registered in ``packages/cspan-backends/pyproject.toml`` under ``[project.entry-points."cspan.commands"]`` as
``tools = "cspan.backends.tools.cli:register"`` (the contract is in ``cspan.core.cli``: ``register(parser)`` adds
the arguments and sets ``handler``). This module imports nothing heavy at import time and never imports
``cspan.core``.

Examples::

    cspan tools serve                                   # MCP over stdio (mount with --mcp "cspan tools serve")
    cspan tools serve --transport http --port 8765      # streamable HTTP at http://127.0.0.1:8765/mcp
    cspan tools list --tools fdb-v3
    cspan tools call get_exchange_rate '{"amount": 100, "from_currency": "USD", "to_currency": "EUR"}' --tools fdb-v3
    cspan tools list --tools none --mcp "npx -y @modelcontextprotocol/server-filesystem /srv/notes"
    cspan tools call read_file '{"path": "/srv/notes/a.md"}' --tools none --mcp "allow=read_file -- npx ..."

The tools are chosen by name as everywhere (``--tools``, see :mod:`cspan.backends.tools.catalog`); the default is
clock, calculator and weather (plus ``search_notes`` with ``--knowledge``). ``memory`` is per session and is not
served here. ``list`` and ``call`` also mount MCP servers with ``--mcp SPEC`` (repeatable; the one parser,
:func:`cspan.backends.tools.catalog.parse_mcp`, as ``cspan serve --mcp``), to see which tools a server gives a
router, under which names, and to try one; ``call`` runs an action directly (the operator's call is the
confirmation a router would ask the user for). ``serve`` takes no ``--mcp``: it serves this project's tools, it is
not a proxy of other MCP servers (mount those in ``cspan serve`` directly). Over HTTP on a loopback bind only loopback Host names are answered (DNS-rebinding protection,
:mod:`cspan.backends.hostguard`; ``--allowed-host`` adds names).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from typing import Any

__all__ = ["register"]


SERVED_DEFAULT = "clock,calculator,weather,knowledge"


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1 to 65535)")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds above 0")
    return value


def _http_path(text: str) -> str:
    if not text.startswith("/") or any(c in text for c in "?# \t") or not text.isprintable():
        raise argparse.ArgumentTypeError(f"{text!r} is not an HTTP path: give one starting with '/', e.g. /mcp")
    return text


def _allowed_host(text: str) -> str:
    from cspan.backends.hostguard import parse_allowed_host

    try:
        parse_allowed_host(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _max_chars(text: str) -> int:
    if not text.isdigit() or not 40 <= int(text) <= 4000:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of characters from 40 to 4000")
    return int(text)


def _add_bank_args(parser: argparse.ArgumentParser, *, mcp: bool = False) -> None:
    """The bank's flags (``--tools``, ``--knowledge`` ...); ``mcp``: ``--mcp`` too (``list`` and ``call``)."""
    parser.add_argument(
        "--tools",
        metavar="NAME,...",
        default=None,
        help="tool sets: clock, calculator, weather, knowledge (needs --knowledge), fdb-v3 (the benchmark's mock "
        f"world, fabricated data); default {SERVED_DEFAULT}",
    )
    parser.add_argument("--knowledge", metavar="DIR", default=None, help="notes folder for search_notes")
    parser.add_argument(
        "--world-db",
        metavar="PATH",
        default=None,
        help="SQLite file of the mock world (built at first use; default: in memory, lost at exit)",
    )
    parser.add_argument("--fdb-v3-only", action="store_true", help="same as --tools fdb-v3 (older spelling)")
    parser.add_argument("--weather-url", default=None, help="Open-Meteo forecast base URL (env CSPAN_WEATHER_URL)")
    parser.add_argument("--geocoding-url", default=None, help="Open-Meteo geocoding base URL (env CSPAN_GEOCODING_URL)")
    parser.add_argument(
        "--max-chars", type=_max_chars, default=400, help="cap on result text in characters (default 400)"
    )
    if mcp:
        parser.add_argument(
            "--mcp",
            action="append",
            default=[],
            metavar="SPEC",
            help="mount an MCP server's tools, as cspan serve --mcp does: a stdio command line or a streamable-HTTP "
            "URL, after optional allow=a,b (only these) read=a,b (vouch they change nothing) prefix=p_ timeout=S and "
            "'--' (repeatable; the built-in sets of --tools are mounted too: --tools none for the server's alone)",
        )


async def _bank(args: argparse.Namespace) -> Any:
    from cspan.backends.tools.catalog import ToolsSpec, build_bank

    tools = "fdb-v3" if args.fdb_v3_only else args.tools or SERVED_DEFAULT
    named = {name.strip() for name in (args.tools or "").split(",")}
    if "knowledge" in named and not args.knowledge:
        from cspan.backends.errors import ToolError

        raise ToolError("--tools knowledge needs --knowledge DIR (the notes folder that search_notes reads)")
    # 'default' here is what can be served: the live default but memory (one signed-in user's)
    tools = ",".join(SERVED_DEFAULT if name.strip().lower() == "default" else name for name in tools.split(","))
    spec = ToolsSpec.from_flags(
        tools,
        getattr(args, "mcp", None) or (),  # list and call only
        knowledge=args.knowledge,
        world_db=args.world_db,
        weather_url=args.weather_url,
        geocoding_url=args.geocoding_url,
        max_chars=args.max_chars,
    )
    if "memory" in spec.sets:
        from cspan.backends.errors import ToolError

        raise ToolError("--tools memory: memory tools act for one signed-in user; cspan tools cannot serve them")
    return await build_bank(spec, reconnect_mcp=False)  # one call per command: no next call to reconnect for


def _fail(verb: str, exc: Exception) -> int:
    print(f"cspan tools {verb}: error: {exc}", file=sys.stderr)
    return 2


def _serve(args: argparse.Namespace) -> int:
    from cspan.backends.commands import is_loopback
    from cspan.backends.hostguard import public_names

    public = public_names(args.allowed_host or []) if args.transport == "http" else []
    if args.transport == "http" and (public or not is_loopback(args.host)) and not args.insecure_no_token:
        where = f"--allowed-host {', '.join(public)} (behind a proxy)" if public else args.host
        print(
            f"cspan tools serve: error: refusing to expose the tool bank on {where} without authentication (the "
            "MCP endpoint has none); bind 127.0.0.1 (default) with loopback names only, or pass --insecure-no-token",
            file=sys.stderr,
        )
        return 2
    from cspan.backends.errors import ListenError, ToolError
    from cspan.backends.http_server import bind_socket
    from cspan.backends.tools.mcp_bridge import serve_http, serve_stdio

    sock = None
    if args.transport == "http":
        try:
            sock = bind_socket(args.host, args.port)  # a bad --host or a busy --port fails before the tools start
        except ListenError as exc:
            return _fail("serve", exc)

    async def main() -> None:
        bank = await _bank(args)
        try:
            if args.transport == "stdio":
                await serve_stdio(bank)
            else:
                print(
                    f"cspan tools: MCP (streamable HTTP) on http://{args.host}:{args.port}{args.path} "
                    f"with {len(bank)} tools",
                    file=sys.stderr,
                )
                await serve_http(
                    bank,
                    host=args.host,
                    port=args.port,
                    path=args.path,
                    allowed_hosts=args.allowed_host or (),
                    sock=sock,
                )
        finally:
            await bank.aclose()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        print("cspan tools serve: interrupted", file=sys.stderr)  # as every verb says it (stdout is MCP's)
        return 130
    except (ToolError, ValueError) as exc:
        return _fail("serve", exc)
    finally:
        if sock is not None:
            sock.close()
    return 0


def _list(args: argparse.Namespace) -> int:
    from cspan.backends.errors import ToolError

    async def main() -> int:
        try:
            bank = await _bank(args)
        except (ToolError, ValueError) as exc:
            return _fail("list", exc)
        try:
            if args.json:
                print(json.dumps(bank.openai_tools(), indent=2, ensure_ascii=False))
            else:
                for tool in bank.tools():
                    fields = ", ".join(tool.json_schema().get("properties", {}))
                    where = f" [{tool.domain}]" if tool.domain else ""
                    confirm = " (needs confirmation)" if tool.needs_confirmation and bank.confirm_actions else ""
                    print(f"{tool.name}({fields})  {tool.kind}{where}{confirm}")
        finally:
            await bank.aclose()
        return 0

    return asyncio.run(main())


def _call(args: argparse.Namespace) -> int:
    from cspan.backends.errors import ToolError

    async def main() -> int:
        try:
            bank = await _bank(args)
        except (ToolError, ValueError) as exc:
            return _fail("call", exc)
        try:
            try:
                bank.validate(args.name, args.arguments)  # an unknown tool or bad arguments: refused, nothing runs
            except ToolError as exc:
                return _fail("call", exc)
            try:
                result = await bank.call(args.name, args.arguments, timeout_s=args.timeout)
            except ToolError as exc:  # the tool ran and failed (timed out, raised): a runtime failure
                print(f"cspan tools call: error: {exc}", file=sys.stderr)
                return 1
        finally:
            await bank.aclose()
        if args.json:
            print(result.model_dump_json(indent=2))
        else:
            print(result.text)
        return 0

    return asyncio.run(main())


def register(parser: argparse.ArgumentParser) -> None:
    """Tool bank: serve it as an MCP server (stdio or HTTP), list its tools, or call one."""
    sub = parser.add_subparsers(dest="tools_command", metavar="ACTION", title="actions")

    serve = sub.add_parser("serve", help="serve the tool bank as an MCP server")
    serve.add_argument("--transport", choices=["stdio", "http"], default="stdio", help="default: stdio")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    serve.add_argument(
        "--insecure-no-token",
        action="store_true",
        help="allow --transport http on a non-loopback address or with a public --allowed-host name (behind a "
        "proxy); the MCP endpoint has no authentication",
    )
    serve.add_argument("--port", type=_port, default=8765, help="HTTP port (default 8765)")
    serve.add_argument(
        "--allowed-host",
        action="append",
        type=_allowed_host,
        metavar="NAME[:PORT]",
        help="another Host name the HTTP server answers to (repeatable; '*' turns the check off); on a loopback "
        "bind only localhost, 127.0.0.1 and [::1] with the bound port are accepted otherwise",
    )
    serve.add_argument("--path", type=_http_path, default="/mcp", help="HTTP endpoint path (default /mcp)")
    _add_bank_args(serve)
    serve.set_defaults(handler=_serve)

    lister = sub.add_parser("list", help="list the tools with their arguments")
    lister.add_argument("--json", action="store_true", help="print the OpenAI tools JSON instead")
    _add_bank_args(lister, mcp=True)
    lister.set_defaults(handler=_list)

    caller = sub.add_parser("call", help="call one tool and print its spoken result")
    caller.add_argument("name", help="tool name, e.g. get_exchange_rate")
    caller.add_argument("arguments", nargs="?", default="{}", help="JSON object of arguments (default {})")
    caller.add_argument("--timeout", type=_seconds, default=None, help="seconds (default: the tool's own)")
    caller.add_argument("--json", action="store_true", help="print the whole ToolResult as JSON")
    _add_bank_args(caller, mcp=True)
    caller.set_defaults(handler=_call)
