"""Draining on a real signal (``cspan serve`` as a subprocess): the first SIGTERM or SIGINT drains for ``--drain-s``
with the running conversation going on; a second one ends the drain at once (the session gets its ``bye``, close
1001) instead of after ``--drain-s`` (was: uvicorn forces its exit only on a repeated SIGINT, so a second SIGTERM
did nothing). SIGUSR1 writes every thread's stack to the log and the conversation goes on."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import websockets
from serve_client import Client
from serve_process import ServeProcess, serve_args


def _wait_draining(server: ServeProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(server.url + "/health", timeout=5).json()["status"] != "draining":
        if time.monotonic() > deadline:
            raise RuntimeError(f"not draining:\n{server.log}")
        time.sleep(0.05)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_second_signal_ends_the_drain_at_once(tiny_checkpoint_dir: Path, sig: signal.Signals) -> None:
    args = serve_args(tiny_checkpoint_dir, "--port", "0", "--drain-s", "120", "--idle-timeout-s", "600")
    server = ServeProcess(*args).start()
    try:
        async with websockets.connect(server.ws(), max_size=None) as ws:
            client = Client(ws)
            assert (await client.start())["type"] == "ready"
            if sig == signal.SIGTERM:  # `kill -USR1`: every thread's stack to the log (OPERATORS.md); it goes on
                server.signal(signal.SIGUSR1)
                await client.stream([np.zeros(1920, dtype=np.float32)] * 5)
                assert server.log.count("(most recent call first)") >= 3, server.log  # the loop, engine, db threads
                assert "cspan/server/" in server.log and server.proc.poll() is None
            server.signal(sig)
            _wait_draining(server)
            await client.stream([np.zeros(1920, dtype=np.float32)] * 5)  # the conversation goes on while draining
            assert client.received.json("bye") == []
            signalled = time.monotonic()
            server.signal(sig)
            _, bye = await client.recv_until(lambda k, m: k == "json" and m["type"] == "bye", timeout=100)
            assert bye["reason"] == "shutdown" and time.monotonic() - signalled < 60  # not the 120 s of the drain
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await client.recv(timeout=30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
        # SIGTERM is how a supervisor stops a server: 0 after the orderly shutdown; Ctrl-C: 130 as for any command
        assert server.wait(timeout=60) == (0 if sig == signal.SIGTERM else 128 + sig)
        assert "Traceback" not in server.log and "Application shutdown complete" in server.log
    finally:
        print(server.log)  # shown when the test fails
        server.kill()
