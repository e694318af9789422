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
- a message above :data:`~cspan.backends.http_client.INLINE_BYTES` is parsed in a worker thread;
- the server's stderr is read as it comes (a server never blocks on a full pipe) and logged through
  :class:`StderrLog`: attributed, made inert, cut and rate-limited, as the words of an untrusted party.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import subprocess
from collections.abc import AsyncIterator, Sequence
from pathlib import PurePath
from typing import Any

import anyio

from cspan.backends.http_client import off_loop
from cspan.backends.rate import TokenBucket
from cspan.backends.untrusted import loads, sanitize_text

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_STDERR_LINE_CHARS",
    "STDERR_BURST",
    "STDERR_LINES_PER_S",
    "STDERR_LOGGER",
    "StderrLog",
    "bounded_stdio_client",
    "server_name",
]

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
_STDERR_TAIL_S = 0.5  # for the last of a server's stderr to be read once it exited

STDERR_LOGGER = "cspan.backends.tools.mcp"
"""The parent of the loggers a stdio MCP server's stderr goes to: ``cspan.backends.tools.mcp.<name>``."""
MAX_STDERR_LINE_CHARS = 500
"""The longest stderr line logged, in characters after sanitising; a longer one is cut (the record says its size)."""
STDERR_BURST = 50
"""Stderr lines of one server logged at once (a traceback) before :data:`STDERR_LINES_PER_S` applies."""
STDERR_LINES_PER_S = 5.0
"""Stderr lines of one server logged per second beyond the burst; the others are counted and reported."""

# ECMA-48 escape sequences: CSI (colours, cursor moves), OSC (window titles, hyperlinks), the others
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[ -/]*[0-~])")
_KEEP_LINE = 8 * MAX_STDERR_LINE_CHARS  # bytes of a stderr line kept (escapes and UTF-8 take room)
_RUNNER = re.compile(r"(python|pypy|node|deno|bun|bunx|npx|uvx|pipx)[\d.]*(\.exe)?", re.IGNORECASE)


_LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_surrogates(value: Any) -> Any:
    """``value`` (parsed JSON) with every lone surrogate in its strings and keys made U+FFFD."""
    if isinstance(value, str):  # json.loads joins the pairs: a surrogate left is a lone half
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_without_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_without_surrogates(k): _without_surrogates(v) for k, v in value.items()}
    return value


def _parse(line: bytes) -> Any:
    """One line of the server's stdout as the SDK's ``SessionMessage``, or the exception the session is handed.

    JSON may escape half a UTF-16 surrogate pair (``"\\ud83d"``), and JavaScript writes one wherever a string was cut
    between the two halves of an emoji (``text.slice(0, 100)``, then ``JSON.stringify``); pydantic refuses such a
    string, which lost the whole reply: the call waited for its timeout. Such a line is read with U+FFFD for each
    lone half (valid UTF-8 surrogate pairs are untouched).
    """
    from mcp.shared.message import SessionMessage
    from mcp.types import jsonrpc_message_adapter

    try:
        return SessionMessage(jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:  # the SDK hands unparsable lines to the session as exceptions
        if _LONE_SURROGATE.search(line):
            try:
                value = _without_surrogates(loads(line))
                return SessionMessage(jsonrpc_message_adapter.validate_python(value, by_name=False))
            except ValueError:
                pass
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


def server_name(command: Sequence[str]) -> str:
    """The name of a stdio server in its log records: the program's (``cspan``) or, for an interpreter or package
    runner (python, node, npx, uvx, ...), that of the module, script or package it runs (``my_server`` for ``python
    -m my_server``, ``server-filesystem`` for ``npx -y @modelcontextprotocol/server-filesystem /srv``); characters
    outside ``[A-Za-z0-9_-]`` become ``_``, at most 64."""
    name = PurePath(command[0]).name
    if _RUNNER.fullmatch(name):
        words = iter(command[1:])
        for word in words:
            if word == "-m":
                name = next(words, name)
                break
            if not word.startswith("-"):
                name = PurePath(word).name
                break
    name = re.sub(r"\.(py|js|mjs|cjs|ts|exe)$", "", name)
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64] or "server"


class StderrLog:
    """A stdio MCP server's stderr as log records, such that an untrusted server can neither forge nor flood the
    operator's log.

    Each line is one WARNING record of the logger ``cspan.backends.tools.mcp.<name>`` (:data:`STDERR_LOGGER`),
    reading ``MCP server <name>: <line>``: ANSI escape sequences removed, other control and format characters made
    spaces (:func:`~cspan.backends.untrusted.sanitize_text`), cut to :data:`MAX_STDERR_LINE_CHARS` (a longer line's
    record gives its size in bytes). At most :data:`STDERR_BURST` lines are logged at once and
    :data:`STDERR_LINES_PER_S` a second after that (a token bucket); the lines over it are counted, not kept, and
    one record says how many and their bytes (newlines not counted) before the next line logged, and at the end.
    Memory is bounded (a line's first 4000 bytes are kept) and a flood costs C-speed work only: Python work per
    piece read is bounded by the lines logged.

    Args:
        name: the server's name, as :func:`server_name` makes it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.log = logging.getLogger(f"{STDERR_LOGGER}.{self.name}")
        self._bucket = TokenBucket(STDERR_LINES_PER_S, STDERR_BURST)
        self._line = bytearray()  # the head of the line being read
        self._size = 0  # its bytes so far
        self._dropped = self._dropped_bytes = 0

    def feed(self, data: bytes) -> None:
        """Take the next piece of the stream (any length, lines split anywhere)."""
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            self._add(data[start:end])
            if not self._end_line():  # over the limit: the piece's other whole lines are counted, not read
                last = data.rfind(b"\n")
                lines = data.count(b"\n", end + 1, last + 1)
                self._dropped += lines
                self._dropped_bytes += last - end - lines
                start = last + 1
                break
            start = end + 1
        self._add(data[start:])

    def close(self) -> None:
        """The stream ended: log its last line (one without a newline) and report what was not logged."""
        if self._size:
            self._end_line()
        self._report()

    def _add(self, piece: bytes) -> None:
        self._size += len(piece)
        room = _KEEP_LINE - len(self._line)
        if room > 0:
            self._line += piece[:room]

    def _end_line(self) -> bool:
        """The line read is complete: logged if the bucket allows (True), else counted (False)."""
        logged = self._bucket.take()
        if logged:
            self._report()
            text = sanitize_text(_ANSI.sub("", self._line.decode("utf-8", "replace")), MAX_STDERR_LINE_CHARS)
            if text:
                size = f" (a line of {self._size} bytes)" if self._size > MAX_STDERR_LINE_CHARS else ""
                self.log.warning("MCP server %s: %s%s", self.name, text, size)
        else:
            self._dropped += 1
            self._dropped_bytes += self._size
        self._line.clear()
        self._size = 0
        return logged

    def _report(self) -> None:
        if self._dropped:
            self.log.warning(
                "MCP server %s: %d stderr line(s) (%d bytes) not logged, over the limit of %d lines at once and "
                "%g a second",
                self.name,
                self._dropped,
                self._dropped_bytes,
                STDERR_BURST,
                STDERR_LINES_PER_S,
            )
            self._dropped = self._dropped_bytes = 0


@contextlib.asynccontextmanager
async def bounded_stdio_client(
    command: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> AsyncIterator[tuple[Any, Any]]:
    """Spawn ``command`` and yield ``(read_stream, write_stream)`` for an ``mcp.ClientSession``; the server's
    stderr goes to a :class:`StderrLog` named by :func:`server_name`.

    Args:
        command: the server's argv (the first item searched on ``PATH``).
        env: extra environment variables, over the SDK's safe default environment.
        cwd: the server's working directory.
        max_message_bytes: the largest message kept (see the module docstring).

    Raises:
        OSError: the server could not be spawned.
    """
    from mcp.client.stdio import get_default_environment
    from mcp.os.posix.utilities import terminate_posix_process_tree

    where = " ".join(command)
    process = await anyio.open_process(
        command, env=get_default_environment() | (env or {}), stderr=subprocess.PIPE, cwd=cwd, start_new_session=True
    )
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    stdin, stdout, stderr = process.stdin, process.stdout, process.stderr
    errors = StderrLog(server_name(command))  # what the server writes to stderr: logged as untrusted words
    stderr_ended = anyio.Event()
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

    async def drain_stderr() -> None:
        try:
            with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                while True:
                    errors.feed(await stderr.receive(_READ_BYTES))
        finally:
            errors.close()
            stderr_ended.set()

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
        tg.start_soon(drain_stderr)  # read as it comes: a server blocked on a full stderr pipe would hang
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
                with anyio.move_on_after(_STDERR_TAIL_S):  # its last words (a traceback), unless a child holds the pipe
                    await stderr_ended.wait()
                tg.cancel_scope.cancel()
    with anyio.CancelScope(shield=True), anyio.move_on_after(_GRACE_S), contextlib.suppress(Exception):
        await process.aclose()
