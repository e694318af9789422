"""A ``/ws`` client that starts a conversation and then sends one message over and over, as fast as its socket takes
it, while it reads what comes back: ``python flood_client.py WS_URL junk|pcm16 SECONDS``.

Run as a process of its own by ``test_server_flood.py``: a flood from the test's own process would take the GIL from
the server under test (a thread of it). Prints ``{"ready": true}`` once the session is ready, then, when the server
closed the connection (or after SECONDS of flood), one JSON line: ``sent`` (messages), ``bye`` (the ``bye`` message or
null) and ``bye_s`` (seconds from the first message of the flood to it), ``close`` ([code, reason] or null),
``errors`` (the ``error`` messages received).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import websockets

PAYLOADS = {"junk": b"x", "pcm16": bytes(3840)}
"""``junk``: one byte, not a frame (``bad_frame``; the smallest message: the most of them behind the close frame);
``pcm16``: one valid 80 ms frame of silence."""


async def main(url: str, kind: str, seconds: float) -> dict[str, Any]:
    payload = PAYLOADS[kind]
    result: dict[str, Any] = {"sent": 0, "bye": None, "bye_s": None, "close": None, "errors": []}
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "start"}))
        while True:
            msg = await asyncio.wait_for(ws.recv(), 60)
            if isinstance(msg, str) and json.loads(msg)["type"] == "ready":
                break
        print(json.dumps({"ready": True}), flush=True)
        t0 = time.monotonic()

        async def flood() -> None:
            while time.monotonic() - t0 < seconds:
                await ws.send(payload)
                result["sent"] += 1
                if result["sent"] % 64 == 0:
                    await asyncio.sleep(0)  # let the reader run
            await ws.close()

        flooding = asyncio.ensure_future(flood())
        try:
            while True:
                msg = await ws.recv()
                if isinstance(msg, str):
                    event = json.loads(msg)
                    if event["type"] == "error":
                        result["errors"].append(event)
                    elif event["type"] == "bye":
                        result["bye"], result["bye_s"] = event, time.monotonic() - t0
        except websockets.ConnectionClosed as closed:
            if closed.rcvd is not None:
                result["close"] = [closed.rcvd.code, closed.rcvd.reason]
        finally:
            flooding.cancel()
            await asyncio.gather(flooding, return_exceptions=True)
    return result


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))), flush=True)
