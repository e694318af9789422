"""Server events checked against the ``openai`` SDK's own models of them (the published Realtime schema), and a
raw Realtime client that checks every event it receives (:class:`RealtimeClient`, :func:`connect_realtime`), and a
recording as the base64 pcm16 chunks a client appends (:func:`pcm16_chunks`).

The SDK parses what it receives without validating it (``construct_type_unchecked``), so a missing required field
or a value outside the schema passes its parsing unnoticed; :func:`check_event` validates each event with the
model of its ``type`` (GA, or beta for a client that asked for the beta names). ``cspan.*`` events are this
server's extensions and have no model.
"""

from __future__ import annotations

import asyncio
import base64
import json
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args, get_origin

import numpy as np
import pydantic
from serve_client import load_frames


def _members(union: Any) -> list[Any]:
    if get_origin(union) is typing.Annotated:
        return _members(get_args(union)[0])
    if get_origin(union) is typing.Union:
        return [m for a in get_args(union) for m in _members(a)]
    return [union]


def _by_type(union: Any) -> dict[str, type[pydantic.BaseModel]]:
    return {v: m for m in _members(union) for v in get_args(m.model_fields["type"].annotation)}


def _models(beta: bool) -> dict[str, type[pydantic.BaseModel]]:
    if beta:
        from openai.types.beta.realtime import RealtimeServerEvent
    else:
        from openai.types.realtime import RealtimeServerEvent
    return _by_type(RealtimeServerEvent)


def check_event(raw: dict[str, Any], *, beta: bool = False) -> None:
    """Assert that ``raw`` is an event of the published schema (or a ``cspan.*`` extension)."""
    kind = raw.get("type")
    if isinstance(kind, str) and kind.startswith("cspan."):
        return
    model = _models(beta).get(str(kind))
    assert model is not None, f"{kind!r} is not a server event of the {'beta' if beta else 'GA'} schema"
    if beta and isinstance(raw.get("session"), dict):
        # the beta session's ``model`` is a Literal of OpenAI's model names; this server names its own checkpoint
        raw = {**raw, "session": {k: v for k, v in raw["session"].items() if k != "model"}}
    try:
        model.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise AssertionError(f"{kind} does not match the SDK's {model.__name__}: {exc}\n{raw}") from None


class RealtimeClient:
    """A raw Realtime connection that keeps every event it received, each checked with :func:`check_event`."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def until(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 120.0) -> dict[str, Any]:
        """Receive until an event satisfies ``predicate`` (returned); TimeoutError after ``timeout`` seconds in all
        (a safety net, not a timing assertion), naming the last events that are not deltas."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            if left <= 0:
                seen = [e["type"] for e in self.events if "delta" not in e["type"]]
                raise TimeoutError(f"not received; events other than deltas: {seen[-30:]}")
            event = json.loads(await asyncio.wait_for(self.ws.recv(), left))
            check_event(event)  # every event as the openai SDK's models define it
            self.events.append(event)
            if predicate(event):
                return event


async def connect_realtime(server: Any) -> tuple[Any, RealtimeClient]:
    """A raw ``/v1/realtime`` connection to ``server`` (a test server with ``url``), after ``conversation.created``."""
    import websockets

    ws = await websockets.connect(server.url.replace("http://", "ws://") + "/v1/realtime", max_size=None)
    client = RealtimeClient(ws)
    await client.until(lambda e: e["type"] == "conversation.created")
    return ws, client


def pcm16_chunks(path: Path, chunk_s: float = 0.2) -> list[str]:
    """A recording as base64 pcm16 chunks at 24 kHz."""
    pcm = np.concatenate(load_frames(path))
    data = (np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2").tobytes()
    step = int(24000 * chunk_s) * 2
    return [base64.b64encode(data[i : i + step]).decode("ascii") for i in range(0, len(data), step)]
