"""MCP bridge: mount any MCP server's tools into a :class:`ToolBank`, and serve a bank as an MCP server.

Both directions use the official ``mcp`` SDK (``pip install 'cspan-backends[mcp]'``, mcp 2.x), imported lazily so
that ``import cspan.backends`` works without it.

Client (:class:`MCPConnection`, used by ``await catalog.mount_mcp(...)``): a stdio subprocess
(:func:`~cspan.backends.tools.mcp_stdio.bounded_stdio_client`, which bounds and reads in linear time what the server
sends, and logs its stderr under ``cspan.backends.tools.mcp.<name>`` sanitised and rate-limited; the SDK's
``stdio_client`` on Windows, the stderr passed through) or a streamable-HTTP endpoint (``mcp.client.streamable_http``), one
``ClientSession`` kept open until ``aclose()``; one found closed (the subprocess exited, the endpoint dropped the
connection) is logged and reconnected at the next call. The transport and session live in an ``AsyncExitStack``
inside one background task that the bank owns: the SDK's anyio cancel scopes must be left by the task that entered
them, and this way a bank opened in one task (a fixture, a server lifespan) can be used and closed from others. Each MCP
tool's ``inputSchema`` becomes a pydantic model (:func:`model_from_json_schema`) so that validation and coercion are
the same as for local tools, while the advertised schema stays the server's own.

Server (:func:`build_mcp_server`, :func:`serve_stdio`, :func:`serve_http`; ``cspan tools serve``): the low-level
``mcp.server.lowlevel.Server`` with ``tools/list`` and ``tools/call`` handlers over a bank. Tool results go out as one
text block (the spoken clause) plus ``structuredContent`` (the tool's data); failures as ``isError`` results whose
text is the :class:`ToolError` message. Each tool carries ``annotations.readOnlyHint`` (read vs action) and
``_meta`` ``{"cspan/kind", "cspan/domain"}`` so that a bank mounted from ``cspan tools serve`` keeps kinds and
domains.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from cspan.backends.errors import ToolError
from cspan.backends.tools.bank import MAX_QUOTED_CHARS, Tool, ToolBank, ToolOutput, render_clause, sanitize_text
from cspan.backends.tools.schema import model_from_json_schema
from cspan.backends.urls import redact_url

if TYPE_CHECKING:
    from mcp.server.lowlevel import Server

__all__ = ["MCPConnection", "build_mcp_server", "model_from_json_schema", "serve_http", "serve_stdio"]

log = logging.getLogger(__name__)

_META_KIND = "cspan/kind"
_META_DOMAIN = "cspan/domain"
_MAX_RESTARTS = 3  # failed reconnects in a row before a lost server is given up
_RESTART_BACKOFF_S = 2.0  # the wait after the n-th failed reconnect is this times 2**(n - 1)


def _require_mcp() -> None:
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise ToolError(
            "the 'mcp' package is not installed; install it with: pip install 'cspan-backends[mcp]'"
        ) from None


def _attr(obj: Any, snake: str, camel: str, default: Any = None) -> Any:
    """Read an SDK model field by its mcp-2 (snake_case) or mcp-1 (camelCase) name."""
    value = getattr(obj, snake, None)
    if value is None:
        value = getattr(obj, camel, default)
    return value if value is not None else default


# --------------------------------------------------------------------------------------------- client


class MCPConnection:
    """One open MCP client session (stdio subprocess or streamable HTTP) and the tools it lists.

    Args:
        command: argv of a stdio server (``[sys.executable, "-m", "pkg.server"]``); the first item is the
            executable, searched on ``PATH``.
        url: streamable-HTTP endpoint instead (``"http://127.0.0.1:8765/mcp"``).
        env: extra environment variables for the subprocess (merged over the SDK's safe default environment).
        cwd: working directory of the subprocess.
        connect_timeout_s: limit for spawning/connecting, the MCP handshake and listing the tools (seconds).
        reconnect: replace a lost connection at the next call (a server's long-lived bank). False for a one-shot
            user such as ``cspan tools call``: a lost connection stays lost, and no message promises a next call.

    A session found closed (a call answered "connection closed", or the session's task ended) is logged once and
    replaced at the next call by a new connection (a new subprocess); that call waits for it. A reconnect that
    fails is tried again only after a back-off (2, 4 s) and, after ``_MAX_RESTARTS`` failures in a row, no more:
    calls then fail with a :class:`ToolError` that says so.

    Raises:
        ToolError: neither or both of ``command`` and ``url``, an empty command, or ``mcp`` not installed.
    """

    def __init__(
        self,
        command: list[str] | None = None,
        *,
        url: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        connect_timeout_s: float = 20.0,
        reconnect: bool = True,
    ) -> None:
        if (command is None) == (url is None):
            raise ToolError("mount_mcp needs exactly one of command=[...] (stdio) or url=... (streamable HTTP)")
        if command is not None and (not command or not all(isinstance(c, str) for c in command)):
            raise ToolError(f"MCP command must be a non-empty list of strings, got {command!r}")
        _require_mcp()
        self.command = list(command) if command is not None else None
        self.url = url
        self.env = dict(env) if env else None
        self.cwd = str(cwd) if cwd is not None else None
        self.connect_timeout_s = connect_timeout_s
        self.reconnect = reconnect
        self._session: Any = None
        self._tools: list[Any] = []
        self._repeatable: set[str] = set()  # the server's names of tools that may be called twice (see call())
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._closing = asyncio.Event()
        self._error: BaseException | None = None
        self._closed = False  # aclose() was called: no reconnects
        self._lost = False  # the session was found closed: reconnect before the next call
        self._failures = 0  # failed reconnects in a row
        self._retry_at = 0.0  # time.monotonic() before which no reconnect is tried
        self._restart_error = ""  # why the last reconnect failed
        self._restarting: asyncio.Task[None] | None = None

    @property
    def state(self) -> str:
        """``up`` (connected), ``reconnecting`` (the connection was lost: the next call reconnects, after the
        back-off if a reconnect failed) or ``down`` (reconnects given up, or closed by :meth:`aclose`).

        What the calls found: a server that exits between calls reads ``up`` until the next call finds it gone."""
        if self._closed or self._failures >= _MAX_RESTARTS or (self._lost and not self.reconnect):
            return "down"
        if self._lost or self._session is None or self._task is None or self._task.done():
            return "reconnecting"
        return "up"

    @property
    def where(self) -> str:
        """The server, in words, for messages."""
        return " ".join(self.command) if self.command is not None else redact_url(str(self.url))

    async def start(self) -> None:
        """Connect, handshake and list the tools; returns when the session is ready.

        Raises:
            ToolError: the server could not be spawned or reached, the handshake failed, or it took longer than
                ``connect_timeout_s``.
        """
        if self._task is not None:
            return
        self._task = asyncio.create_task(self._run(), name=f"mcp-session {self.where}")
        waiter = asyncio.create_task(self._ready.wait())
        try:
            done, _ = await asyncio.wait(
                {waiter, self._task}, timeout=self.connect_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        except BaseException:  # cancelled while connecting: do not leave the subprocess behind
            waiter.cancel()
            await asyncio.shield(self._stop())
            raise
        waiter.cancel()
        if self._ready.is_set() and self._error is None:
            return
        if not done:
            await self._stop()
            raise ToolError(f"MCP server {self.where} did not finish the handshake within {self.connect_timeout_s:g} s")
        error = self._error
        await self._stop()
        raise ToolError(f"cannot connect to MCP server {self.where}: {_describe(error)}") from error

    async def _run(self) -> None:
        from mcp import ClientSession

        try:
            async with contextlib.AsyncExitStack() as stack:
                if self.command is not None and sys.platform != "win32":
                    from cspan.backends.tools.mcp_stdio import bounded_stdio_client

                    stdio = bounded_stdio_client(self.command, env=self.env, cwd=self.cwd)
                    streams = await stack.enter_async_context(stdio)
                elif self.command is not None:
                    from mcp.client.stdio import StdioServerParameters, stdio_client

                    params = StdioServerParameters(
                        command=self.command[0], args=self.command[1:], env=self.env, cwd=self.cwd
                    )
                    streams = await stack.enter_async_context(stdio_client(params, errlog=_errlog(stack)))
                else:
                    from mcp.client.streamable_http import streamable_http_client

                    from cspan.backends.tools.mcp_http import http_client

                    # a 429 / 503 keeps its status and Retry-After (mcp_http): call() decides whether to wait
                    client = await stack.enter_async_context(http_client())
                    streams = await stack.enter_async_context(streamable_http_client(self.url, http_client=client))
                read, write = streams[0], streams[1]
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                tools: list[Any] = []
                cursor = None
                for _ in range(100):
                    if cursor is None:
                        page = await session.list_tools()
                    else:
                        from mcp import types

                        page = await session.list_tools(params=types.PaginatedRequestParams(cursor=cursor))
                    tools.extend(page.tools)
                    cursor = _attr(page, "next_cursor", "nextCursor")
                    if not cursor:
                        break
                self._tools = tools
                self._session = session
                self._ready.set()
                await self._closing.wait()
        except BaseException as exc:  # reported through start() / call()
            if self._error is None and not isinstance(exc, asyncio.CancelledError):
                self._error = exc
            if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                raise
        finally:
            self._session = None

    def remote_names(self) -> list[str]:
        """The names of the tools the server listed, as it spells them."""
        return [remote.name for remote in self._tools]

    def tools(
        self,
        *,
        prefix: str = "",
        timeout_s: float = 10.0,
        allow: Iterable[str] | None = None,
        read_only: Iterable[str] = (),
    ) -> list[Tool]:
        """The server's tools as :class:`Tool` objects (names prefixed, characters outside ``[A-Za-z0-9_-]``
        replaced by ``_``).

        Args:
            prefix: prepended to every local name.
            timeout_s: per-call timeout.
            allow: only these tools (the server's names); None for all.
            read_only: tools to treat as reads whatever their annotations say (the operator vouches for them).

        A tool's kind follows its MCP annotations as the specification defines them: ``readOnlyHint`` true is a
        read; anything else may change state (``readOnlyHint`` defaults to false, ``destructiveHint`` to true) and
        is an action, which the router runs only after the user confirms. ``_meta["cspan/kind"]`` (set by
        ``cspan tools serve``) wins over both.

        Raises:
            ToolError: ``allow`` or ``read_only`` names a tool the server does not have (the message lists them).
        """
        listed = self.remote_names()
        chosen = set(listed) if allow is None else set(allow)
        trusted = set(read_only)
        unknown = sorted((chosen | trusted) - set(listed))
        if unknown:
            raise ToolError(
                f"MCP server {self.where} has no tool(s) {unknown}; it lists: {', '.join(listed) or '(none)'}"
            )
        out = []
        taken: dict[str, str] = {}  # local name -> the server's name
        for remote in self._tools:
            name = remote.name
            if name not in chosen:
                continue
            local = (prefix + re.sub(r"[^A-Za-z0-9_-]", "_", name))[:64]
            if local in taken:
                raise ToolError(
                    f"MCP server {self.where} lists tools {taken[local]!r} and {name!r}, which both become "
                    f"{local!r} here (characters outside A-Z a-z 0-9 _ - become _, names are cut to 64); "
                    "mount one of them only (allow=)"
                )
            taken[local] = name
            schema = dict(_attr(remote, "input_schema", "inputSchema", {}) or {"type": "object"})
            meta = _attr(remote, "meta", "_meta", {}) or {}
            annotations = _attr(remote, "annotations", "annotations")
            read_hint = _attr(annotations, "read_only_hint", "readOnlyHint") if annotations is not None else None
            kind = meta.get(_META_KIND) if meta.get(_META_KIND) in ("read", "action") else None
            if kind is None:
                kind = "read" if read_hint is True or name in trusted else "action"
            idempotent = annotations is not None and _attr(annotations, "idempotent_hint", "idempotentHint") is True
            if kind == "read" or idempotent:
                self._repeatable.add(name)
            out.append(
                Tool(
                    name=local,
                    description=(remote.description or _attr(remote, "title", "title") or name).strip(),
                    parameters=model_from_json_schema(local, schema),
                    fn=self._caller(name),
                    kind=kind,
                    timeout_s=timeout_s,
                    domain=str(meta.get(_META_DOMAIN) or ""),
                    schema=schema,
                )
            )
        return out

    def _caller(self, remote_name: str):
        async def call(**kwargs: Any) -> ToolOutput:
            arguments = {k: v for k, v in kwargs.items() if v is not None}
            return await self.call(remote_name, arguments)

        call.__name__ = f"mcp_{re.sub(r'[^A-Za-z0-9_]', '_', remote_name)}"
        return call

    async def call(self, remote_name: str, arguments: dict[str, Any]) -> ToolOutput:
        """Call a tool on the server; the text blocks joined are the clause, ``structuredContent`` the data.

        An HTTP server that refuses the call with 429 or 503 and a ``Retry-After`` is asked again after that wait
        when the tool may be called twice (a read, or ``idempotentHint``), the wait is at most
        :data:`~cspan.backends.tools.mcp_http.MAX_WAITED_S` and it ends before the call's deadline
        (:func:`~cspan.backends.tools.bank.call_deadline`: the bank's timeout, or the retrieval's deadline where
        nearer), at most :data:`~cspan.backends.tools.mcp_http.MAX_RETRY_AFTER_WAITS` times; otherwise the call
        fails at once, saying what the server asked and why it was not waited.

        Raises:
            ToolError: the connection is closed (``aclose``), or was lost and could not be reconnected; the
                connection closed during this call; the server refused it (429 / 503) and it was not asked again;
                or the server reported an error result.
        """
        waits = 0
        while True:
            session = await self._connected(remote_name)
            try:
                result = await session.call_tool(remote_name, arguments)
                break
            except ToolError:
                raise
            except Exception as exc:
                if not await self._waited(remote_name, exc, waits):
                    self._call_failed(remote_name, session, exc)
                waits += 1
        texts = []
        for block in result.content or []:
            if getattr(block, "type", None) == "text":
                texts.append(block.text)
            elif getattr(block, "type", None) == "resource" and hasattr(getattr(block, "resource", None), "text"):
                texts.append(block.resource.text)
        text = " ".join(t.strip() for t in texts if t and t.strip())
        data = _attr(result, "structured_content", "structuredContent")
        if _attr(result, "is_error", "isError", False):
            said = sanitize_text(text, MAX_QUOTED_CHARS) or "no details"  # the server's words: data, capped
            raise ToolError(f"MCP tool {remote_name!r} reported an error: {said}", tool=remote_name)
        if not text and data is not None:
            text = render_clause(data)
        return ToolOutput(text, data)

    async def _waited(self, remote_name: str, exc: BaseException, waits: int) -> bool:
        """Wait out the server's refusal of a call (see :meth:`call`) and return True, or return False when ``exc``
        is no refusal.

        Raises:
            ToolError: a refusal that is not waited out (the message says what the server asked and why).
        """
        from cspan.backends.tools.bank import call_deadline
        from cspan.backends.tools.mcp_http import MAX_RETRY_AFTER_WAITS, refusal_of, retry_decision

        refusal = refusal_of(exc)
        if refusal is None:
            return False
        deadline = call_deadline()
        left = None if deadline is None else deadline - asyncio.get_running_loop().time()
        why = retry_decision(refusal, repeatable=remote_name in self._repeatable, waits=waits, left_s=left)
        if why is not None:
            wait = refusal.retry_after_s
            asked = "" if wait is None else f": the server asked to retry after {wait:g} s,"
            raise ToolError(
                f"MCP call {remote_name!r} on {self.where}: {refusal}{asked} {why}", tool=remote_name
            ) from exc
        wait = refusal.retry_after_s or 0.0
        log.warning(
            "MCP server %s: %s for %r; the server asked to retry after %g s, waiting (%d/%d)",
            self.where,
            refusal,
            remote_name,
            wait,
            waits + 1,
            MAX_RETRY_AFTER_WAITS,
        )
        await asyncio.sleep(wait)
        return True

    def _call_failed(self, remote_name: str, session: Any, exc: BaseException) -> NoReturn:
        """Raise the :class:`ToolError` of a call that failed with ``exc`` (a lost connection is marked lost)."""
        if _connection_closed(exc):
            self._lose(session, exc)
            then = " (it is reconnected for the next call)" if self.reconnect else ""
            raise ToolError(
                f"MCP call {remote_name!r} on {self.where} failed: the server closed the connection{then}",
                tool=remote_name,
            ) from exc
        raise ToolError(f"MCP call {remote_name!r} on {self.where} failed: {_describe(exc)}", tool=remote_name) from exc

    async def _connected(self, tool: str) -> Any:
        """The open session, after reconnecting one found closed (one reconnect at a time, shared by the callers
        and not cancelled with them).

        Raises:
            ToolError: closed by ``aclose``, or the reconnect failed, waits out its back-off or was given up.
        """
        session = self._session
        if self._closed:
            raise ToolError(f"MCP server {self.where} is not connected (closed)", tool=tool)
        if not self._lost:
            if session is not None and self._task is not None and not self._task.done():
                return session
            self._lose(session, self._error)
        if not self.reconnect:
            raise ToolError(f"MCP server {self.where} closed the connection (not reconnected)", tool=tool)
        if self._failures >= _MAX_RESTARTS:
            raise ToolError(
                f"MCP server {self.where} is down: {self._failures} reconnects in a row failed, no more are tried "
                f"(last: {self._restart_error})",
                tool=tool,
            )
        if self._restarting is None:
            wait = self._retry_at - time.monotonic()
            if wait > 0:
                raise ToolError(
                    f"MCP server {self.where} is down (last reconnect: {self._restart_error}); "
                    f"the next is tried in {wait:.1f} s",
                    tool=tool,
                )
            self._restarting = asyncio.create_task(self._restart(), name=f"mcp-reconnect {self.where}")
        await asyncio.shield(self._restarting)
        if self._closed:
            raise ToolError(f"MCP server {self.where} is not connected (closed)", tool=tool)
        if self._lost or self._session is None:
            raise ToolError(f"MCP server {self.where} is down ({self._restart_error})", tool=tool)
        return self._session

    def _lose(self, session: Any, cause: BaseException | None) -> None:
        """Mark ``session`` closed (logged once per session) so that the next call reconnects."""
        if session is not self._session or self._lost or self._closed:
            return
        self._lost = True
        why = _describe(cause) if cause is not None else "the session ended"
        if self.reconnect:
            log.warning("MCP server %s closed the connection (%s); reconnecting at the next call", self.where, why)
        else:  # the failed call's error says it; a one-shot user makes no next call
            log.info("MCP server %s closed the connection (%s)", self.where, why)

    async def _restart(self) -> None:
        """Replace the lost session by a new connection; a failure is counted and sets the back-off."""
        try:
            await self._stop()
            self._ready, self._closing, self._error = asyncio.Event(), asyncio.Event(), None
            await self.start()
        except ToolError as exc:
            self._failures += 1
            self._restart_error = str(exc)
            self._retry_at = time.monotonic() + _RESTART_BACKOFF_S * 2 ** (self._failures - 1)
            if self._failures >= _MAX_RESTARTS:
                log.error("%s (reconnect %d of %d; no more are tried)", exc, self._failures, _MAX_RESTARTS)
            else:
                log.warning("%s (reconnect %d of %d)", exc, self._failures, _MAX_RESTARTS)
        else:
            self._failures, self._lost = 0, False
            log.warning("MCP server %s reconnected", self.where)
        finally:
            self._restarting = None

    async def aclose(self) -> None:
        """Close the session and the transport (ends the subprocess); idempotent. No reconnect follows."""
        self._closed = True
        restarting = self._restarting
        if restarting is not None:
            restarting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await restarting
        await self._stop()

    async def _stop(self) -> None:
        """End the session's task (it leaves the session and transport, ending the subprocess)."""
        task, self._task = self._task, None
        if task is None:
            return
        self._closing.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=10.0)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        except Exception:
            log.debug("MCP session %s ended with an error", self.where, exc_info=True)


def _errlog(stack: contextlib.AsyncExitStack) -> Any:
    """Where the subprocess's stderr goes on Windows (the SDK's transport takes a file, not a logger): ours if it
    has a file descriptor, else the null device."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        sink = open(os.devnull, "w")  # noqa: SIM115 - closed by the exit stack
        stack.callback(sink.close)
        return sink


def _connection_closed(exc: BaseException) -> bool:
    """Whether a call failed because the connection is gone (the SDK's CONNECTION_CLOSED error)."""
    from mcp.types import CONNECTION_CLOSED

    return getattr(getattr(exc, "error", None), "code", None) == CONNECTION_CLOSED


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions[:3])
    return f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------------------------- server


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def build_mcp_server(bank: ToolBank, *, name: str = "cspan-tools") -> Server:
    """A low-level MCP ``Server`` whose ``tools/list`` and ``tools/call`` are the bank's.

    Raises:
        ToolError: ``mcp`` is not installed.
    """
    _require_mcp()
    from mcp import types
    from mcp.server.lowlevel import Server

    from cspan.backends import __version__

    async def on_list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        tools = []
        for tool in bank.tools():
            meta = {_META_KIND: tool.kind}
            if tool.domain:
                meta[_META_DOMAIN] = tool.domain
            tools.append(
                types.Tool(
                    name=tool.name,
                    description=tool.description,
                    input_schema=tool.json_schema(),
                    annotations=types.ToolAnnotations(
                        read_only_hint=tool.kind == "read",
                        destructive_hint=tool.kind == "action",
                        open_world_hint=False,
                    ),
                    meta=meta,
                )
            )
        return types.ListToolsResult(tools=tools)

    async def on_call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        try:
            result = await bank.call(params.name, params.arguments or {})
        except ToolError as exc:
            return types.CallToolResult(content=[types.TextContent(type="text", text=str(exc))], is_error=True)
        data = result.data
        structured = None
        if data is not None:
            structured = _jsonable(data if isinstance(data, dict) else {"result": data})
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=result.text)], structured_content=structured
        )

    return Server(
        name,
        version=__version__,
        instructions="Context Spanning tool bank: each tool answers with one short spoken clause.",
        on_list_tools=on_list_tools,
        on_call_tool=on_call_tool,
    )


STDIO_DRAIN_GRACE_S = 5.0
"""At the end of stdin, ``serve_stdio`` waits for the requests in flight at most the longest tool timeout plus this."""


async def serve_stdio(bank: ToolBank, *, name: str = "cspan-tools", drain_s: float | None = None) -> None:
    """Serve ``bank`` over this process's stdin/stdout until the client closes stdin and every request read before
    is answered (at most ``drain_s`` more seconds; default the longest tool timeout plus :data:`STDIO_DRAIN_GRACE_S`).

    The SDK's stdio transport (``mcp.server.stdio``, which keeps handlers' stray output off the wire) reads and
    writes the lines; :class:`_StdioRelay` stands between it and the SDK's server loop, which otherwise drops a line
    that is not a JSON-RPC message without a word (logged at debug level) and, at the end of stdin, cancels the
    requests it is still handling (``JSONRPCDispatcher.run``, mcp 2.x): ``initialize``, ``tools/list`` and two
    ``tools/call`` piped at once were answered only up to the first call.
    """
    import anyio
    from mcp.server.stdio import stdio_server

    server = build_mcp_server(bank, name=name)
    if drain_s is None:
        drain_s = max((tool.timeout_s for tool in bank.tools()), default=0.0) + STDIO_DRAIN_GRACE_S
    async with stdio_server() as (wire_in, wire_out):
        relay = _StdioRelay(wire_in, wire_out, drain_s)
        async with anyio.create_task_group() as tg:
            tg.start_soon(relay.inbound)
            tg.start_soon(relay.outbound)
            await server.run(relay.read, relay.write, server.create_initialization_options())
            await relay.done.wait()  # every response handed to the transport, which writes it before it exits
            tg.cancel_scope.cancel()  # the inbound relay, were the loop to end before stdin did


def _line_error(exc: Exception) -> Any:
    """The JSON-RPC 2.0 error answering a line the transport could not read as a message: -32700 (parse error) for
    one that is not JSON, -32600 (invalid request) for JSON that is no JSON-RPC message (with its ``id`` when it
    has a usable one, else null, as the specification asks). None for a blank line (nothing was sent)."""
    from mcp import types
    from pydantic import ValidationError

    errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) else []
    first = errors[0] if errors else {"type": "json_invalid", "msg": str(exc), "input": None}
    if first["type"] == "json_invalid":
        if isinstance(first.get("input"), str) and not first["input"].strip():
            return None
        code, message, request_id = types.PARSE_ERROR, f"Parse error: {first['msg']}; send one JSON object a line", None
    else:
        # the message itself is the input of an error about one of its fields (a missing one), not always the first
        sent = next((e["input"] for e in errors if len(e["loc"]) <= 2 and isinstance(e.get("input"), dict)), None)
        request_id = sent.get("id") if sent is not None else None
        if isinstance(request_id, bool) or not isinstance(request_id, int | str):
            request_id = None
        code = types.INVALID_REQUEST
        message = "Invalid Request: not a JSON-RPC 2.0 request, notification or response"
    return types.JSONRPCError(jsonrpc="2.0", id=request_id, error=types.ErrorData(code=code, message=message))


class _StdioRelay:
    """Between the SDK's stdio transport (``wire_in``, ``wire_out``) and its server loop (:attr:`read`,
    :attr:`write`): answers unreadable lines (:func:`_line_error`) and, at the end of stdin, closes the loop's input
    only once every request passed to it is answered (or cancelled by the client), or ``drain_s`` has passed."""

    def __init__(self, wire_in: Any, wire_out: Any, drain_s: float) -> None:
        import anyio

        self._wire_in, self._wire_out, self._drain_s = wire_in, wire_out, drain_s
        self._to_loop, self.read = anyio.create_memory_object_stream[Any](0)
        self.write, self._from_loop = anyio.create_memory_object_stream[Any](0)
        self._pending: dict[Any, int] = {}  # request id -> requests with it not yet answered
        self._changed = anyio.Event()
        self.done = anyio.Event()

    def _settle(self, request_id: Any) -> None:
        left = self._pending.pop(request_id, 0) - 1
        if left > 0:
            self._pending[request_id] = left
        self._changed.set()

    async def inbound(self) -> None:
        import anyio
        from mcp import types
        from mcp.shared.message import SessionMessage

        try:
            async with self._to_loop:
                async for item in self._wire_in:
                    if isinstance(item, Exception):
                        error = _line_error(item)
                        if error is not None:
                            await self._wire_out.send(SessionMessage(error))
                        continue
                    message = item.message
                    if isinstance(message, types.JSONRPCRequest):
                        self._pending[message.id] = self._pending.get(message.id, 0) + 1
                    elif isinstance(message, types.JSONRPCNotification) and message.method == "notifications/cancelled":
                        self._settle((message.params or {}).get("requestId"))  # a cancelled request gets no answer
                    await self._to_loop.send(item)
                with anyio.move_on_after(self._drain_s):
                    while self._pending:
                        self._changed = anyio.Event()
                        await self._changed.wait()
                if self._pending:
                    log.warning(
                        "stdin closed; %d request(s) still unanswered after %g s are cancelled: %s",
                        sum(self._pending.values()),
                        self._drain_s,
                        ", ".join(map(repr, list(self._pending)[:5])),
                    )
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the server loop ended first

    async def outbound(self) -> None:
        import anyio
        from mcp import types

        try:
            async with self._wire_out, self._from_loop:
                async for item in self._from_loop:
                    await self._wire_out.send(item)
                    if isinstance(item.message, types.JSONRPCResponse | types.JSONRPCError):
                        self._settle(item.message.id)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        finally:
            self.done.set()


def http_app(
    bank: ToolBank,
    *,
    host: str = "127.0.0.1",
    path: str = "/mcp",
    allowed_hosts: Iterable[str] = (),
    name: str = "cspan-tools",
) -> Any:
    """The streamable-HTTP ASGI app serving ``bank`` at ``path``, behind :class:`~cspan.backends.hostguard.HostGuard`
    (the SDK's own Host check is replaced by it: one rule, the bound port included, for every route)."""
    from mcp.server.transport_security import TransportSecuritySettings

    from cspan.backends.hostguard import HostGuard

    server = build_mcp_server(bank, name=name)
    app = server.streamable_http_app(
        streamable_http_path=path,
        host=host,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    return HostGuard(app, bind_host=host, allowed_hosts=allowed_hosts)


async def serve_http(
    bank: ToolBank,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    path: str = "/mcp",
    allowed_hosts: Iterable[str] = (),
    name: str = "cspan-tools",
    sock: socket.socket | None = None,
) -> None:
    """Serve ``bank`` over streamable HTTP at ``http://host:port{path}`` with uvicorn until interrupted (request
    headers must be complete within 10 s: :func:`~cspan.backends.http_server.header_timeout_protocol`). ``sock``:
    the socket of :func:`~cspan.backends.http_server.bind_socket` for ``host``:``port`` (bound here when None).

    Raises:
        ListenError: ``host``:``port`` cannot be bound (a busy port, a host name that does not resolve).
    """
    import uvicorn

    from cspan.backends.http_server import bind_socket, uvicorn_http

    sock = sock or bind_socket(host, port)

    app = http_app(bank, host=host, path=path, allowed_hosts=allowed_hosts, name=name)
    config = uvicorn.Config(
        app, host=host, port=port, http=uvicorn_http(10.0), timeout_keep_alive=5, log_level="warning", lifespan="on"
    )
    await uvicorn.Server(config).serve(sockets=[sock])
