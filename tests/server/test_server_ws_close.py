"""A connection the server closes is gone within :data:`~cspan.server.ws_protocol.CLOSE_FLUSH_S`, even when its peer
stopped reading: asyncio's ``close()`` alone waits for the buffered data to be sent, which a peer with a shut
window never allows (the socket and its buffer were kept as long as the peer's kernel acknowledged)."""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
import pytest
import websockets
from serve_client import Client

from cspan.server import ws_protocol


@pytest.mark.timeout(120)
async def test_a_closed_connection_whose_peer_stopped_reading_is_aborted_after_the_flush_bound(
    serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ws_protocol, "CLOSE_FLUSH_S", 1.0)
    server = serve(uvicorn={"ws_ping_interval": 1.0, "ws_ping_timeout": 1.0})
    connections = server.server.server_state.connections
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.setblocking(False)
    async with websockets.connect(server.ws_url, sock=sock, max_size=None, max_queue=1) as ws:
        assert (await Client(ws).start())["type"] == "ready"
        (conn,) = connections
        # the server's kernel buffer small (its default grows to megabytes on loopback): what the client does not
        # read stays in the server's own buffer after a second of audio, not after a minute
        conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        silence = np.zeros(1920, dtype=np.float32).tobytes()
        buffered = 0
        for _ in range(200):  # audio at the real-time pace; the library stops reading (max_queue=1)
            if not conn.transport.is_closing():
                buffered = conn.transport.get_write_buffer_size()
            if server.hub.free_slots() == 1:  # the keepalive ended the session (slow_client) and closed it
                break
            await ws.send(silence)
            await asyncio.sleep(0.08)
        closed_at = time.monotonic()
        assert server.hub.free_slots() == 1, "the session was not ended for not reading"
        assert buffered > 0  # the server held data the client never read when it closed the connection
        while connections and time.monotonic() - closed_at < ws_protocol.CLOSE_FLUSH_S + 5.0:
            await asyncio.sleep(0.1)
        assert not connections, "the closed connection is still held, with its unsent data"
