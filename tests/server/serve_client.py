"""Test helpers for ``cspan serve``: a uvicorn server thread and a websockets protocol client."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


class ServerThread:
    """A ``cspan serve`` app served by uvicorn in a background thread on a free port of 127.0.0.1 (``uvicorn``:
    overrides of :func:`~cspan.server.serve.uvicorn_config`'s uvicorn settings, e.g. a shorter keepalive)."""

    def __init__(self, app: Any, settings: Any, **uvicorn: Any) -> None:
        from cspan.server.serve import make_server, uvicorn_config

        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/ws"
        config = uvicorn_config(app, settings, log_level=os.environ.get("CSPAN_TEST_LOG", "warning"), **uvicorn)
        self.server = make_server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("cspan serve test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()

    @property
    def hub(self) -> Any:
        """The app's :class:`~cspan.server.session.SessionHub`."""
        return self.app.state.hub


@dataclass
class Received:
    """What a protocol client received, in order: ``("audio", ndarray)`` or ``("json", dict)``."""

    items: list[tuple[str, Any]] = field(default_factory=list)

    def json(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [m for k, m in self.items if k == "json" and (kind is None or m["type"] == kind)]

    def audio(self) -> list[np.ndarray]:
        return [m for k, m in self.items if k == "audio"]

    def types(self) -> list[str]:
        return [m["type"] if k == "json" else "audio" for k, m in self.items]


class Client:
    """A websockets client speaking the protocol: flow-controlled streaming and message collection."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.received = Received()
        self.sent_frames = 0

    async def send_json(self, message: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(message))

    async def recv(self, timeout: float = 60.0) -> tuple[str, Any]:
        data = await asyncio.wait_for(self.ws.recv(), timeout)
        if isinstance(data, bytes):
            assert len(data) == 7680, f"agent frame of {len(data)} bytes"
            item: tuple[str, Any] = ("audio", np.frombuffer(data, dtype="<f4"))
        else:
            item = ("json", json.loads(data))
        self.received.items.append(item)
        return item

    async def recv_until(self, predicate: Callable[[str, Any], bool], timeout: float = 120.0) -> tuple[str, Any]:
        """Receive until ``predicate(kind, message)`` holds; returns that item. ``timeout`` is a safety net."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"condition not met; received types {self.received.types()[-20:]}")
            kind, msg = await self.recv(timeout=left)
            if predicate(kind, msg):
                return kind, msg

    async def until_closed(self, timeout: float = 60.0) -> Any:
        """Receive until the server closes the connection (``timeout``: the longest wait for one message); returns
        how it closed (the ``websockets.ConnectionClosed``)."""
        import websockets

        try:
            while True:
                await self.recv(timeout=timeout)
        except websockets.ConnectionClosed as closed:
            return closed

    async def start(self, **fields: Any) -> dict[str, Any]:
        await self.send_json({"type": "start", **fields})
        _, ready = await self.recv_until(lambda k, m: k == "json" and m["type"] in ("ready", "busy", "error"))
        return ready

    async def stream(self, frames: list[np.ndarray], *, window: int = 4) -> None:
        """Send ``frames`` while receiving, at most ``window`` frames ahead of the agent frames received since the
        call began (about real time: the server sends one agent frame per 80 ms tick and consumes at most one user
        frame per tick)."""
        audio_at_start = len(self.received.audio())
        for sent, frame in enumerate(frames):
            while sent - (len(self.received.audio()) - audio_at_start) >= window:
                await self.recv()
            await self.ws.send(np.ascontiguousarray(frame, dtype="<f4").tobytes())
            self.sent_frames += 1

    async def stop(self) -> dict[str, Any]:
        """Send ``stop`` and receive until ``bye``; returns it."""
        await self.send_json({"type": "stop"})
        _, bye = await self.recv_until(lambda k, m: k == "json" and m["type"] == "bye")
        return bye


def load_frames(path: Path) -> list[np.ndarray]:
    """A recording as 1920-sample float32 frames at 24 kHz."""
    from cspan.core.audio import iter_frames

    return list(iter_frames(path))
