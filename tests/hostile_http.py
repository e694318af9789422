"""A hostile HTTP backend for tests: raw asyncio sockets on 127.0.0.1 in a thread (no framework that would tidy up
what it sends). It answers the transcriber protocols (``.../audio/transcriptions``, ``.../transcribe``) and chat
completions (``.../chat/completions``); the first path segment picks the misbehaviour, e.g.
``http://127.0.0.1:PORT/trickle/v1`` or ``http://127.0.0.1:PORT/gzip_bomb/transcribe``.

Modes: ``ok``; ``stall`` (reads the request, never answers); ``trickle`` (headers, then one byte of the body every
0.2 s, forever); ``trickle_head`` (the status line a byte at a time); ``huge_declared`` (Content-Length of 20 MiB,
streams it); ``huge_chunked`` (chunked, no length, 64 KiB chunks until the client leaves); ``gzip_bomb`` (64 MiB of
spaces gzipped to ~65 KB, with its Content-Length); ``gzip_bomb_chunked`` (the same, chunked); ``big_valid`` (a
valid reply of ~900 KB: ``"hello "`` repeated); ``braces`` (900 000 ``{`` as the text); ``nested`` (300 000 ``[``);
``bigint`` (a 5000-digit number as the text); ``nan`` (``NaN`` as the text); ``control`` (text with ESC, NUL, BEL
and U+202E); ``text_int`` / ``text_list`` / ``text_null`` (a transcript of the wrong type); ``words_str`` /
``words_nan`` (bad word timings); for chat completions also ``calls_str``, ``calls_dict``, ``call_item_str``,
``fn_str``, ``name_int`` (tool calls of the wrong shape), ``message_str``, ``choices_dict``, ``top_list``; ``brotli`` (an unsupported content coding); ``bad_gzip`` (a damaged gzip body).
Refusals, each the odd-numbered requests of its mode (``requests``), then ``ok``: ``limited`` (429 with
``Retry-After: 1``), ``limited_date`` (429 with an HTTP-date 2 s ahead), ``busy`` (503 with ``Retry-After: 1``);
``limited_ms`` (429 with ``retry-after-ms: 300`` and ``Retry-After: 3``), ``limited_bare`` (429 with neither);
``limited_long`` is 429 with ``Retry-After: 3600`` every time, ``limited_absurd`` with a 30-digit one,
``limited_bare_always`` with no header every time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import threading
import time
import zlib
from email.utils import formatdate
from typing import Any

CONTROL_TEXT = "\x1b[2J\x1b[31mwhat is\x00 the\x07 weather\u202e in\u200b London\x1b[0m"


def _chat(content: Any) -> bytes:
    message = {"role": "assistant", "content": content}
    return json.dumps({"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": message}]}).encode()


def _message(message: Any) -> bytes:
    return json.dumps({"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": message}]}).encode()


def _head(status: int = 200, length: int | None = None, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n{size}{extra}Connection: close\r\n\r\n".encode()


def _gzip_of_spaces(size: int) -> bytes:
    """``size`` spaces gzipped, compressed a MiB at a time (never held whole)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = b" " * (1 << 20)
    return b"".join([*(z.compress(block) for _ in range(size >> 20)), z.flush()])


class HostileServer:
    """Start with :meth:`start`; ``url(mode, path)`` is an endpoint; ``requests`` counts requests per mode."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._bomb = _gzip_of_spaces(64 << 20)
        self.port = 0

    def start(self) -> HostileServer:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop)
        self._server = future.result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def url(self, mode: str, path: str = "/v1") -> str:
        return f"http://127.0.0.1:{self.port}/{mode}{path}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1]
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            length = int(headers.get("content-length", "0") or 0)
            if length:
                await reader.readexactly(length)
            mode = path.strip("/").split("/")[0]
            self.requests[mode] = self.requests.get(mode, 0) + 1
            await self._answer(mode, "chat/completions" in path, writer, self.requests[mode])
        with contextlib.suppress(Exception):
            writer.close()

    async def _answer(self, mode: str, chat: bool, writer: asyncio.StreamWriter, nth: int) -> None:
        def body(text: Any) -> bytes:
            return _chat(text) if chat else json.dumps({"text": text}).encode()

        async def send(data: bytes) -> None:
            writer.write(data)
            await writer.drain()

        simple: dict[str, bytes] = {
            "ok": body("What is the weather in London?"),
            "big_valid": body("hello " * 150_000),
            "braces": body("{" * 900_000),
            "nested": b"[" * 300_000 + b"]" * 300_000,
            "bigint": b'{"text": 1' + b"0" * 5000 + b"}",
            "nan": b'{"text": NaN}' if not chat else _chat(None).replace(b"null", b"NaN"),
            "control": body(CONTROL_TEXT),
            "text_int": body(12345),
            "text_list": body(["a", "b"]) if not chat else _chat([{"type": "text", "text": "It is sunny."}]),
            "text_null": b'{"text": null}',
            "words_str": b'{"text": "hi", "words": "abc"}',
            "words_nan": b'{"text": "hi", "words": [{"word": "hi", "start": -1, "end": "soon"}]}',
        }
        if chat:  # messages of the wrong shape (valid JSON)
            simple.update(
                calls_str=_message({"role": "assistant", "tool_calls": "get_weather"}),
                calls_dict=_message({"role": "assistant", "tool_calls": {"0": {"function": {"name": "x"}}}}),
                call_item_str=_message({"role": "assistant", "tool_calls": ["get_weather"]}),
                fn_str=_message({"role": "assistant", "tool_calls": [{"type": "function", "function": "get_weather"}]}),
                name_int=_message({"role": "assistant", "tool_calls": [{"function": {"name": 7, "arguments": "{}"}}]}),
                message_str=json.dumps({"choices": [{"message": "hello"}]}).encode(),
                choices_dict=json.dumps({"choices": {"0": {"message": {"content": "hi"}}}}).encode(),
                top_list=b"[1, 2, 3]",
            )
        retry_after = {
            "limited": (429, "1"),
            "limited_date": (429, formatdate(time.time() + 2, usegmt=True)),
            "busy": (503, "1"),
            "limited_long": (429, "3600"),
            "limited_absurd": (429, "9" * 30),
            "limited_ms": (429, "3\r\nretry-after-ms: 300"),
            "limited_bare": (429, None),
            "limited_bare_always": (429, None),
        }
        always = ("limited_long", "limited_absurd", "limited_bare_always")
        if mode in retry_after and (nth % 2 == 1 or mode in always):
            status, after = retry_after[mode]
            data = b'{"error": {"message": "slow down \x1b[31mplease\x1b[0m"}}'
            await send(_head(status, len(data), "" if after is None else f"Retry-After: {after}\r\n") + data)
        elif mode in retry_after:
            await send(_head(200, len(simple["ok"])) + simple["ok"])
        elif mode in simple:
            data = simple[mode]
            await send(_head(200, len(data)) + data)
        elif mode == "stall":
            await asyncio.sleep(3600)
        elif mode == "trickle":
            await send(_head(200, 100_000))
            while True:
                await send(b" ")
                await asyncio.sleep(0.2)
        elif mode == "trickle_head":
            for byte in _head(200, 2):
                await send(bytes([byte]))
                await asyncio.sleep(0.2)
        elif mode == "huge_declared":
            await send(_head(200, 20 << 20))
            for _ in range(320):
                await send(b" " * 65536)
        elif mode == "huge_chunked":
            await send(_head(200, None))
            chunk = b"[" * 65536
            while True:
                await send(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        elif mode == "gzip_bomb":
            await send(_head(200, len(self._bomb), "Content-Encoding: gzip\r\n") + self._bomb)
        elif mode == "gzip_bomb_chunked":
            await send(_head(200, None, "Content-Encoding: gzip\r\n"))
            for i in range(0, len(self._bomb), 4096):
                piece = self._bomb[i : i + 4096]
                await send(b"%x\r\n" % len(piece) + piece + b"\r\n")
            await send(b"0\r\n\r\n")
        elif mode == "brotli":
            await send(_head(200, 4, "Content-Encoding: br\r\n") + b"abcd")
        elif mode == "bad_gzip":
            data = gzip.compress(body("hello"))[:-12] + b"garbage!" * 4
            await send(_head(200, len(data), "Content-Encoding: gzip\r\n") + data)
        else:
            data = b'{"error": "unknown mode"}'
            await send(_head(404, len(data)) + data)
