"""``cspan.server.app._send``, the loop that drains a session's outbox to its socket: a client gone mid-send ends it
quietly; a message the server made that cannot be sent (a server bug) is logged as an error, not taken for a
disconnect."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from cspan.server.app import _send


class _Counter:
    def labels(self, *_: str) -> _Counter:
        return self

    def inc(self, *_: float) -> None:
        pass


class _Socket:
    def __init__(self, error: Exception) -> None:
        self.error = error

    async def send_text(self, text: str) -> None:
        raise self.error

    async def close(self, **_: Any) -> None:
        pass


async def _drain(error: Exception) -> SimpleNamespace:
    session = SimpleNamespace(id="s1", gone=False, outbox=asyncio.Queue())
    session.outbox.put_nowait("event")
    adapter = SimpleNamespace(name="realtime", render=lambda item: [f'{{"type": "{item}"}}'])
    await asyncio.wait_for(_send(_Socket(error), session, adapter, SimpleNamespace(wire_bytes=_Counter())), 5)
    return session


@pytest.mark.parametrize(
    ("error", "level"),
    [
        (ConnectionResetError("reset by peer"), logging.DEBUG),
        (UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"), logging.ERROR),
    ],
)
def test_a_send_that_fails_ends_the_session_and_a_server_bug_is_logged(error, level, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="cspan.server.app")
    session = asyncio.run(_drain(error))
    assert session.gone
    (record,) = [r for r in caplog.records if r.name == "cspan.server.app"]
    assert record.levelno == level and "s1" in record.getMessage()
