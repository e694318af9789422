"""Per-user limits of ``cspan serve`` on a real server (uvicorn on the tiny checkpoint, two users of a token file):
``--max-sessions-per-user`` keeps one user from taking every conversation slot, ``--max-connections-per-user``
bounds the connections one user holds open (each can hold a voice recording or a Realtime item log); the other
user is not affected, and each refusal says why and is counted."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from serve_client import Client, ServerThread
from websockets.exceptions import ConnectionClosed

from cspan.backends.context_db import ContextDB, UserMemory

ANN = "ann-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef"
OPS = "ops-token-0123456789abcdef"


def _token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    entries = [f'user = "ann"\ntoken = "{ANN}"', f'user = "bob"\ntoken = "{BOB}"']
    entries.append(f'user = "ops"\ntoken = "{OPS}"\nscopes = ["admin"]')
    path.write_text("".join(f"[[token]]\n{entry}\n" for entry in entries))
    path.chmod(0o600)
    return path


def _url(server: Any, token: str) -> str:
    return f"{server.ws_url}?token={token}"


def _metric(server: Any, line: str) -> bool:
    return line in httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {OPS}"}).text


async def _until(predicate: Any, timeout: float = 30.0) -> None:
    """Poll ``predicate()`` until true (a safety timeout, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


def test_the_connection_limit_defaults_to_twice_the_sessions_and_at_least_32() -> None:
    from cspan.server.serve_settings import ServeSettings

    assert ServeSettings(max_sessions=4).connections_per_user == 32
    assert ServeSettings(max_sessions=64).connections_per_user == 128
    assert ServeSettings(max_sessions=64, max_connections_per_user=5).connections_per_user == 5


@pytest.mark.timeout(180)
async def test_one_user_cannot_take_every_slot_and_the_other_still_starts(serve, tmp_path: Path) -> None:
    server = serve(max_sessions=3, max_sessions_per_user=2, token_file=_token_file(tmp_path), idle_timeout_s=600)
    async with (
        websockets.connect(_url(server, ANN)) as a1,
        websockets.connect(_url(server, ANN)) as a2,
        websockets.connect(_url(server, ANN)) as a3,
        websockets.connect(_url(server, BOB)) as b1,
    ):
        ann1, ann2, ann3, bob = Client(a1), Client(a2), Client(a3), Client(b1)
        assert (await ann1.start())["type"] == "ready"
        assert (await ann2.start())["type"] == "ready"
        busy = await ann3.start()  # a slot is free, but not for ann
        assert busy == {
            "type": "busy",
            "max_sessions": 3,
            "message": "this user's conversations reached this server's limit per user (2, "
            "--max-sessions-per-user); end one first",
        }
        with pytest.raises(ConnectionClosed) as info:
            await ann3.recv()
        assert info.value.rcvd is not None and info.value.rcvd.code == 1013
        ready = await bob.start()
        assert (ready["type"], ready["profile"]["user_id"]) == ("ready", "bob")
        assert _metric(server, 'cspan_user_limit_refusals_total{limit="sessions",protocol="cspan"} 1.0')
        assert _metric(server, 'cspan_sessions_busy_total{protocol="cspan"} 1.0')

        # once one of ann's conversations ends, she may start another
        assert (await ann1.stop())["reason"] == "stop"
        await _until(lambda: server.hub.slots_of("ann") == 1)
    async with websockets.connect(_url(server, ANN)) as a4:
        assert (await Client(a4).start())["type"] == "ready"


@pytest.mark.timeout(180)
async def test_a_connection_past_the_users_limit_is_closed_1013_and_others_are_not(serve, tmp_path: Path) -> None:
    server = serve(max_sessions=1, max_connections_per_user=3, token_file=_token_file(tmp_path), idle_timeout_s=600)
    held = [await websockets.connect(_url(server, ANN)) for _ in range(3)]
    try:
        await _until(lambda: server.hub.connections_of("ann") == 3)
        async with websockets.connect(_url(server, ANN)) as extra:
            with pytest.raises(ConnectionClosed) as info:
                await extra.recv()
        assert info.value.rcvd is not None
        assert (info.value.rcvd.code, info.value.rcvd.reason) == (
            1013,
            "this user's connections reached this server's limit (3, --max-connections-per-user)",
        )
        assert _metric(server, 'cspan_user_limit_refusals_total{limit="connections",protocol="cspan"} 1.0')

        # the other user connects and starts; ann's held connections are untouched and one of them starts
        async with websockets.connect(_url(server, BOB)) as b1:
            assert (await Client(b1).start())["profile"]["user_id"] == "bob"
        await _until(lambda: server.hub.free_slots() == 1)
        assert (await Client(held[0]).start())["type"] == "ready"

        # a connection that closes frees its place
        await held.pop().close()
        await _until(lambda: server.hub.connections_of("ann") == 2)
        async with websockets.connect(_url(server, ANN)) as again:
            await again.send('{"type": "ping"}')
            await _until(lambda: server.hub.connections_of("ann") == 3)
    finally:
        for ws in held:
            await ws.close()


class _SlowEnds(ContextDB):
    """A real SQLite Context DB whose ``end_conversation`` waits until ``ends`` is set: a session whose client closed
    takes as long to end as the test wants (as a slow database, or transcripts still running, would)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.ends = threading.Event()
        self.ending = threading.Event()

    def user(self, principal: Any) -> UserMemory:
        user_id = principal if isinstance(principal, str) else principal.user_id
        db = self

        class Memory(UserMemory):
            def end_conversation(self, conversation_id: str, **kwargs: Any) -> bool:
                db.ending.set()
                assert db.ends.wait(120), "never let end"
                return super().end_conversation(conversation_id, **kwargs)

        return Memory(self._conn, user_id, executor=self.executor)


@pytest.mark.timeout(180)
async def test_a_closed_connection_frees_its_place_while_its_session_still_ends(
    tiny_checkpoint, tmp_path: Path
) -> None:
    from cspan.server.serve import ServeSettings, create_app

    settings = ServeSettings(
        asr="none", router="none", max_sessions=1, max_connections_per_user=1, db=str(tmp_path / "ctx.sqlite"),
        db_wait_s=10, token_file=_token_file(tmp_path), idle_timeout_s=600, text_prompt="You are a helpful assistant.",
    )  # fmt: skip
    db = _SlowEnds(tmp_path / "ctx.sqlite")
    server = ServerThread(create_app(settings, checkpoint=tiny_checkpoint, db=db), settings).start()
    try:
        first = await websockets.connect(_url(server, ANN))
        assert (await Client(first).start())["type"] == "ready"
        await first.close()  # the client is gone; its session now waits for the Context DB to end it
        assert await asyncio.to_thread(db.ending.wait, 60)
        assert len(server.hub.sessions) == 1  # still ending
        async with websockets.connect(_url(server, ANN)) as again:  # at once: the closed connection holds no place
            await again.send('{"type": "ping"}')  # not a message of /ws: an error, on an open connection
            assert json.loads(await again.recv())["type"] == "error"
            assert server.hub.connections_of("ann") == 1
            async with websockets.connect(_url(server, ANN)) as extra:  # the limit still holds for open ones
                with pytest.raises(ConnectionClosed) as info:
                    await extra.recv()
            assert info.value.rcvd is not None and info.value.rcvd.code == 1013
    finally:
        db.ends.set()
        server.stop()
