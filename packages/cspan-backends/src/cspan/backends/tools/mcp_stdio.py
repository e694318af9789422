"""The stdio transport of an MCP client, with a bound on what the server may send (POSIX).

The SDK's ``mcp.client.stdio.stdio_client`` joins a message's pieces by concatenating and re-splitting the whole
buffer for every 64 KiB read: a tool that answers 20 MB (a ``read_file`` of a large log) costs about 10 s of CPU on
the event loop that paces every live conversation's frames, which all stall meanwhile. This transport is the same
protocol (newline-delimited JSON-RPC over the subprocess's stdin/stdout, the SDK's safe default environment, the
server in its own process group, stopped as the specification says: stdin closed, a grace period, then the group
terminated) with the reading done in linear time and bounded:

- a message above ``max_message_bytes`` is not kept: the rest of its line is read and dropped, and the request it
  answers fails with an error that says so (the id is read from the line's head or tail), so the connection stays
  usable; a message too large whose id cannot be found closes the connection (the bridge reconnects);
- a message above :data:`~cspan.backends.http_client.INLINE_BYTES` is parsed in a worker thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any, TextIO

import anyio

from cspan.backends.http_client import off_loop

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "bounded_stdio_client"]

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
"""The largest message read from a stdio MCP server (4 MiB: a tool result that reaches a span is cut to 400
characters; a long tool list is a few hundred KB)."""

_READ_BYTES = 1 << 16
_GRACE_S = 2.0  # for the server to exit once its stdin is closed (the SDK's PROCESS_TERMINATION_TIMEOUT)
_TERM_S = 2.0  # SIGTERM to SIGKILL of the process group
_ID_HEAD = re.compile(rb'^\s*\{\s*"jsonrpc"\s*:\s*"2\.0"\s*,\s*"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.)*")')
_ID_TAIL = re.compile(rb'"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.)*")\s*\}\s*$')
_KEEP_TAIL = 256  # bytes of an oversized line kept to find its id at the end


def _parse(line: bytes) -> Any:
    from mcp.shared.message import SessionMessage
    from mcp.types import jsonrpc_message_adapter

    try:
        return SessionMessage(jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:  # the SDK hands unparsable lines to the session as exceptions
        log.warning("MCP server sent a line that is not a JSON-RPC message (%s)", type(exc).__name__)
        return exc


def _too_large_reply(head: bytes, tail: bytes, size: int, limit: int) -> bytes | None:
    """A JSON-RPC error answering the request of an oversized message, or None when its id cannot be found."""
    found = _ID_HEAD.match(head) or _ID_TAIL.search(tail)
    if found is None:
        return None
    message = (
        f"the server's reply is {size} bytes, over the limit of {limit} bytes for one MCP message; "
        "refused without keeping it (ask the tool for less, or raise the limit)"
    )
    error = {"code": -32603, "message": message}
    return b'{"jsonrpc": "2.0", "id": ' + found.group(1) + b', "error": ' + json.dumps(error).encode() + b"}"


@contextlib.asynccontextmanager
async def bounded_stdio_client(
    command: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    errlog: TextIO,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> AsyncIterator[tuple[Any, Any]]:
    """Spawn ``command`` and yield ``(read_stream, write_stream)`` for an ``mcp.ClientSession``.

    Args:
        command: the server's argv (the first item searched on ``PATH``).
        env: extra environment variables, over the SDK's safe default environment.
        cwd: the server's working directory.
        errlog: where the server's stderr goes.
        max_message_bytes: the largest message kept (see the module docstring).

    Raises:
        OSError: the server could not be spawned.
    """
    from mcp.client.stdio import get_default_environment
    from mcp.os.posix.utilities import terminate_posix_process_tree

    where = " ".join(command)
    process = await anyio.open_process(
        command, env=get_default_environment() | (env or {}), stderr=errlog, cwd=cwd, start_new_session=True
    )
    assert process.stdin is not None and process.stdout is not None
    stdin, stdout = process.stdin, process.stdout
    to_session, read_stream = anyio.create_memory_object_stream[Any](0)
    write_stream, from_session = anyio.create_memory_object_stream[Any](0)

    async def deliver(line: bytes) -> None:
        if line.strip():  # once the session is gone, what the server still says is read and dropped
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                await to_session.send(await off_loop(len(line), _parse, line))

    async def refuse(head: bytes, tail: bytes, size: int) -> bool:
        """Answer an oversized message's request with an error; False when it names none (close)."""
        reply = _too_large_reply(head, tail, size, max_message_bytes)
        log.warning(
            "MCP server %s sent a message of %d bytes, over the limit of %d bytes; dropped%s",
            where,
            size,
            max_message_bytes,
            "" if reply else " (it names no request: the connection is closed)",
        )
        if reply is not None:
            await deliver(reply)
        return reply is not None

    async def reader() -> None:
        buf = bytearray()
        scanned = 0  # buf[:scanned] holds no newline
        over: tuple[bytes, bytes, int] | None = None  # an oversized line being dropped: head, tail, size so far
        async with to_session:
            with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                while True:
                    buf += await stdout.receive(_READ_BYTES)
                    while (end := buf.find(b"\n", scanned)) >= 0:
                        line, scanned = bytes(buf[:end]), 0
                        del buf[: end + 1]
                        if over is None and len(line) <= max_message_bytes:
                            await deliver(line)
                            continue
                        head, tail, size = over or (line[:_KEEP_TAIL], b"", 0)
                        over = None
                        if not await refuse(head, (tail + line)[-_KEEP_TAIL:], size + len(line)):
                            return
                    if over is None and len(buf) > max_message_bytes:
                        over = (bytes(buf[:_KEEP_TAIL]), b"", 0)
                    if over is not None:  # keep only the tail, for the id
                        over = (over[0], (over[1] + bytes(buf[-_KEEP_TAIL:]))[-_KEEP_TAIL:], over[2] + len(buf))
                        buf.clear()
                    scanned = len(buf)

    async def writer() -> None:
        async with from_session:
            try:
                async for message in from_session:
                    data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await stdin.send(data.encode() + b"\n")
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                await to_session.aclose()  # the server stopped reading: the session sees the connection end

    async def exited(timeout_s: float) -> bool:
        with anyio.move_on_after(timeout_s):
            while process.returncode is None:
                await anyio.sleep(0.01)
        return process.returncode is not None

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)  # reads until the server's stdout ends (a server blocked writing cannot exit)
        tg.start_soon(writer)
        try:
            yield read_stream, write_stream
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled caller must not leave the server running
                read_stream.close()
                write_stream.close()
                with contextlib.suppress(Exception):
                    await stdin.aclose()
                if not await exited(_GRACE_S):
                    await terminate_posix_process_tree(process, _TERM_S)
                    if not await exited(_GRACE_S):
                        log.warning("MCP server %s (pid %d) is still alive after SIGKILL", where, process.pid)
                tg.cancel_scope.cancel()
    with anyio.CancelScope(shield=True), anyio.move_on_after(_GRACE_S), contextlib.suppress(Exception):
        await process.aclose()
