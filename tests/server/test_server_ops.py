"""Operators' guarantees of ``cspan serve`` with the real parts (uvicorn, SQLite, an MCP server as a subprocess, a
scripted OpenAI-compatible router): a session's memory is its credential's principal's and no protocol reaches
another user's rows; tools are what ``--tools`` / ``--mcp`` say (no mock world by default), actions wait for a
confirmation; ``/health`` tells a balancer when to send no more; settings come from flags or a settings file."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import websockets
from serve_client import Client

from cspan.backends.context_db import ContextDB
from cspan.backends.errors import ToolError
from cspan.backends.identity import issue_token

REPO = Path(__file__).resolve().parents[2]
MCP_DEMO = REPO / "tests" / "backends" / "mcp_demo_server.py"
SILENCE = [np.zeros(1920, dtype=np.float32)] * 40  # 3.2 s


class FixedTranscriber:
    """Hears ``text`` in any audio (the tests are about whose memory answers, not about speech recognition)."""

    def __init__(self, text: str) -> None:
        self.text = text

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> str:
        return self.text


@pytest.fixture
def users(tmp_path: Path) -> dict[str, Any]:
    """A Context DB file with issued tokens for ada and bob (session scope) and ops (admin only), and a locker code
    remembered for each of ada and bob."""
    path = tmp_path / "context.sqlite"
    with ContextDB(path) as db:
        tokens = {user: issue_token(db, user)[1] for user in ("ada", "bob")}
        tokens["ops"] = issue_token(db, "ops", scopes=["admin"])[1]
        db.user("ada").set_fact("locker_code", "ada-4711")
        db.user("bob").set_fact("locker_code", "bob-0815")
    return {"db": path, **tokens}


def ws_url(server: Any, token: str) -> str:
    return f"{server.ws_url}?token={token}"


async def close_code(url: str) -> int:
    async with websockets.connect(url) as ws:
        with pytest.raises(websockets.ConnectionClosed) as info:
            await ws.recv()
    return info.value.rcvd.code


async def first_span(client: Client, frames: list[np.ndarray]) -> dict[str, Any]:
    """Stream ``frames``, then read until a ``span`` event has arrived (the server's clock goes on without audio);
    returns it."""
    await client.stream(frames)
    if not client.received.json("span"):
        await client.recv_until(lambda k, m: k == "json" and m["type"] == "span", timeout=60)
    return client.received.json("span")[0]


@pytest.mark.timeout(300)
async def test_no_protocol_reads_another_users_memory(serve, users) -> None:
    """ada and bob each remembered a locker code. Through ``/ws``, ``/api/chat`` and ``/v1/realtime`` a session
    hears only its own principal's, whatever the client sends (a ``user_id`` in a profile is refused); the rows a
    session writes are its principal's; a token without the ``session`` scope, a wrong one or none is refused before
    any session."""
    import aiohttp
    import sphn

    server = serve(
        db=str(users["db"]),
        router="local",
        tools="clock,memory",
        transcriber=FixedTranscriber("what is my locker code"),
    )
    assert await close_code(server.ws_url) == 4401  # issued tokens exist: a credential is required
    assert await close_code(ws_url(server, users["ops"])) == 4401  # admin scope only: may not talk
    assert await close_code(ws_url(server, users["ada"] + "x")) == 4401
    assert server.hub.free_slots() == 1

    # /ws as ada, pretending to be bob in the profile
    async with websockets.connect(ws_url(server, users["ada"]), max_size=None) as ws:
        client = Client(ws)
        refused = await client.start(profile={"user_id": "bob"})
        assert (
            refused["type"] == "error" and refused["code"] == "invalid_message" and "credential" in refused["message"]
        )
        ready = await client.start(profile={"name": "Ada"}, test={"force_ret_at": [0.4]})
        assert ready["type"] == "ready" and ready["profile"]["user_id"] == "ada"
        span = await first_span(client, SILENCE)
        await client.stop()
    assert "ada-4711" in span["text"] and "bob-0815" not in span["text"]
    ada_conversation = ready["conversation_id"]

    # /api/chat (the Moshi protocol) as bob, token in the Authorization header
    writer = sphn.OpusStreamWriter(24000)
    async with aiohttp.ClientSession() as http:
        url = f"ws://127.0.0.1:{server.port}/api/chat"
        async with http.ws_connect(url, headers={"Authorization": f"Bearer {users['bob']}"}) as ws:
            assert (await ws.receive()).data == b"\x00"
            info = json.loads((await ws.receive()).data[1:])
            (session,) = [s for s in server.hub.sessions if s.protocol == "moshi"]
            assert session.principal.user_id == "bob"
            session.conversation.schedule_ret(session.conversation.frame + 2)  # the tiny model's own <ret> is rare
            moshi_span = None
            for frame in SILENCE:
                await ws.send_bytes(b"\x01" + writer.append_pcm(frame))
                while moshi_span is None:
                    try:
                        msg = await asyncio.wait_for(ws.receive(), 0.05)
                    except TimeoutError:
                        break
                    if msg.data[0] == 4 and json.loads(msg.data[1:]).get("type") == "span":
                        moshi_span = json.loads(msg.data[1:])
                if moshi_span is not None:
                    break
    assert moshi_span is not None, "no span reached the Moshi client"
    assert "bob-0815" in moshi_span["text"] and "ada-4711" not in moshi_span["text"]

    # /v1/realtime (the OpenAI Realtime API) as ada, claiming bob in the profile extension
    realtime_span, realtime_conversation = await realtime_session(server, users["ada"])
    assert "ada-4711" in realtime_span["text"] and "bob-0815" not in realtime_span["text"]

    async def ended(cid: str, user: str) -> bool:
        conv = server.hub.db.user(user).get_conversation(cid)
        return conv is not None and conv.ended_at is not None

    deadline = time.monotonic() + 30
    while not (await ended(ada_conversation, "ada") and await ended(info["conversation_id"], "bob")):
        assert time.monotonic() < deadline, "conversations not ended"
        await asyncio.sleep(0.1)
    with ContextDB(users["db"]) as db:  # what is on disk, read as an operator would
        ada, bob = db.user("ada"), db.user("bob")
        assert bob.get_conversation(ada_conversation) is None and bob.spans(ada_conversation) == []
        assert ada.get_conversation(info["conversation_id"]) is None
        assert ada.get_conversation(realtime_conversation) is not None
        assert bob.get_conversation(realtime_conversation) is None
        (ada_span,) = ada.spans(ada_conversation)
        assert "ada-4711" in ada_span.text and ada_span.injected_at is not None
        assert [t.text for t in ada.turns(ada_conversation) if t.role == "user"] == ["what is my locker code"]
        assert ada.get_profile().name == "Ada" and bob.get_profile().name == ""
        assert set(db.users()) == {"ada", "bob", "ops"}

    # operators' numbers need the admin scope
    assert httpx.get(server.url + "/metrics").status_code == 401
    headers = {"Authorization": f"Bearer {users['ada']}"}
    assert httpx.get(server.url + "/metrics", headers=headers).status_code == 403
    headers = {"Authorization": f"Bearer {users['ops']}"}
    assert (
        'cspan_auth_failures_total{protocol="cspan",reason="token"} 3.0'
        in httpx.get(server.url + "/metrics", headers=headers).text
    )
    assert httpx.get(server.url + "/info").json()["token_required"] is True


async def realtime_session(server: Any, token: str) -> tuple[dict[str, Any], str]:
    """A ``/v1/realtime`` session with ``token``: a profile naming another user is refused, then a forced ``<ret>``;
    returns ``(the cspan.span event, the conversation id)``."""
    url = f"ws://127.0.0.1:{server.port}/v1/realtime?model=cspan"
    async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {token}"}) as ws:

        async def until(kind: str) -> dict[str, Any]:
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if event["type"] == kind:
                    return event

        await until("session.created")
        claim = {"type": "session.update", "session": {"cspan": {"profile": {"user_id": "bob"}}}}
        await ws.send(json.dumps(claim))
        error = await until("error")
        assert error["error"]["code"] == "invalid_event" and "user_id" in error["error"]["message"]
        hooks = {"events": True, "test": {"force_ret_at": [0.4]}}
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "cspan": hooks}}))
        await until("session.updated")
        chunk = base64.b64encode(bytes(2 * 4800)).decode("ascii")  # 0.2 s of pcm16 silence at 24 kHz
        for _ in range(16):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        ready = await until("cspan.ready")
        span = await until("cspan.span")
    return span, ready["conversation_id"]


async def refusal(url: str, **kwargs: Any) -> tuple[int, str]:
    """Connect, then wait for the server to close; the close code and reason."""
    async with websockets.connect(url, **kwargs) as ws:
        with pytest.raises(websockets.ConnectionClosed) as info:
            await ws.recv()
    return info.value.rcvd.code, info.value.rcvd.reason


@pytest.mark.timeout(300)
async def test_two_credentials_that_differ_are_refused_on_every_protocol(serve, users) -> None:
    """A handshake carrying two different tokens (ada's and bob's, in two places or twice in one) is closed with
    4401 "conflicting credentials" on ``/ws``, ``/api/chat`` and ``/v1/realtime``, before any session, and with 401 on
    ``/metrics`` (which used the header's); the same token twice is one credential. An admin-only token is told it
    lacks the ``session`` scope."""
    server = serve(db=str(users["db"]))
    ada, bob = users["ada"], users["bob"]
    base = f"ws://127.0.0.1:{server.port}"
    conflicting = (4401, "unauthorized: conflicting credentials (two different tokens); give one")
    as_ada = {"additional_headers": {"Authorization": f"Bearer {ada}"}}
    attempts = [
        (f"{base}/ws?token={bob}", {"subprotocols": [f"cspan.token.{ada}"]}),
        (f"{base}/ws", {"subprotocols": [f"cspan.token.{ada}", f"cspan.token.{bob}"]}),
        (f"{base}/ws?token={ada}&token={bob}", {}),
        (f"{base}/api/chat?token={bob}", as_ada),
        (f"{base}/v1/realtime?model=cspan&token={bob}", as_ada),
        (f"{base}/v1/realtime?model=cspan", {**as_ada, "subprotocols": ["realtime", f"openai-insecure-api-key.{bob}"]}),
    ]
    for url, kwargs in attempts:
        assert await refusal(url, **kwargs) == conflicting, (url, kwargs)
    assert await refusal(f"{base}/ws?token={users['ops']}") == (4401, "unauthorized: the token lacks the session scope")
    assert await refusal(f"{base}/ws?token={ada}x") == (4401, "unauthorized: wrong token")
    assert server.hub.free_slots() == 1 and not server.hub.sessions

    ops = users["ops"]
    as_ops = {"Authorization": f"Bearer {ops}"}
    async with httpx.AsyncClient(base_url=server.url) as http:
        for url, headers in [
            (f"/metrics?token={ada}", as_ops),  # an admin's header and a user's query
            (f"/metrics?token={ops}", {"Authorization": f"Bearer {ada}"}),
            (f"/metrics?token={ops}&token={ada}", {}),
        ]:
            answer = await http.get(url, headers=headers)
            assert answer.status_code == 401, (url, headers)
            assert answer.json() == {"detail": "conflicting credentials (two different tokens); give one"}
            assert answer.headers["www-authenticate"] == "Bearer"
        for url, headers in [(f"/metrics?token={ops}", as_ops), (f"/metrics?token={ops}&token={ops}", {})]:
            answer = await http.get(url, headers=headers)  # the same token twice is one
            assert answer.status_code == 200 and "cspan_sessions_active 0.0" in answer.text, (url, headers)

    async with websockets.connect(f"{base}/ws?token={ada}", subprotocols=[f"cspan.token.{ada}"]) as ws:
        assert ws.subprotocol == f"cspan.token.{ada}"
        ready = await Client(ws).start()
        assert ready["type"] == "ready" and ready["profile"]["user_id"] == "ada"
        await Client(ws).stop()


@pytest.mark.timeout(300)
async def test_a_revoked_credential_ends_its_running_sessions(serve, users, monkeypatch) -> None:
    """ada (``/ws``) and bob (``/v1/realtime``) are talking; ada's token is revoked (``cspan users revoke``): her
    session ends with ``bye`` reason ``revoked`` and close 4401 while bob's goes on; then bob is forgotten with his
    tokens (``cspan db forget bob --tokens``): his Realtime session ends with ``session_ended`` (``revoked``)."""
    from cspan.server import app as app_module

    monkeypatch.setattr(app_module, "CREDENTIAL_RECHECK_S", 0.2)
    server = serve(db=str(users["db"]), max_sessions=2)
    async with (
        websockets.connect(ws_url(server, users["ada"]), max_size=None) as ws,
        websockets.connect(
            f"ws://127.0.0.1:{server.port}/v1/realtime?model=cspan",
            additional_headers={"Authorization": f"Bearer {users['bob']}"},
        ) as rt,
    ):
        ada = Client(ws)
        assert (await ada.start())["type"] == "ready"
        assert json.loads(await rt.recv())["type"] == "session.created"
        await asyncio.sleep(1.0)  # a few checks pass while both tokens are valid
        assert all(not s.ending for s in server.hub.sessions)
        with ContextDB(users["db"]) as db:  # what `cspan users revoke --user ada` does, from another process
            assert db.revoke_tokens(user_id="ada") == 1
        assert (await ada.until_closed(timeout=30)).rcvd.code == 4401
        (bye,) = ada.received.json("bye")
        assert bye["reason"] == "revoked" and "revoked" in bye["message"]
        (bob,) = [s for s in server.hub.sessions if s.principal.user_id == "bob"]
        assert not bob.ending
        with ContextDB(users["db"]) as db:
            db.forget_user("bob", tokens=True)
        ended = None
        while ended is None:
            event = json.loads(await asyncio.wait_for(rt.recv(), 30))
            if event["type"] == "error" and event["error"]["code"] == "session_ended":
                ended = event
        assert ended["error"]["param"] == "revoked"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await asyncio.wait_for(rt.recv(), 30)
        assert closed.value.rcvd.code == 4401
    assert await close_code(ws_url(server, users["ada"])) == 4401


@pytest.mark.timeout(300)
async def test_forget_ends_the_users_running_sessions_and_nothing_comes_back(serve, users, monkeypatch) -> None:
    """ada talks on ``/ws`` with a stored profile whose notes say "forget me"; ``cspan db forget ada --yes`` runs in
    another process; her session then sends a profile update. Nothing written before the erase comes back (the
    session's copy of the profile is refused, not written back), her session ends with ``bye`` reason ``forgotten``
    and close 4410, and bob's session goes on. A new session of ada afterwards starts from nothing and is stored as
    usual."""
    from cspan.backends.context_db import Profile
    from cspan.server import app as app_module

    monkeypatch.setattr(app_module, "CREDENTIAL_RECHECK_S", 2.0)
    with ContextDB(users["db"]) as db:
        db.user("ada").put_profile(Profile(name="Ada", city="Leeds", notes="forget me"))
    server = serve(db=str(users["db"]), max_sessions=2)
    env = {"CSPAN_DB": str(users["db"])}
    async with (
        websockets.connect(ws_url(server, users["ada"]), max_size=None) as ws,
        websockets.connect(ws_url(server, users["bob"]), max_size=None) as ws_bob,
    ):
        ada, bob = Client(ws), Client(ws_bob)
        ready = await ada.start()
        assert ready["type"] == "ready" and ready["profile"]["name"] == "Ada"
        assert (await bob.start())["type"] == "ready"
        forgot = await asyncio.to_thread(cspan, "db", "forget", "ada", "--yes", env=env)
        assert forgot.returncode == 0 and "1 profiles" in forgot.stdout, forgot.stderr
        await ada.send_json({"type": "context", "profile": {"name": "Ada again"}})  # refused: ends the session
        assert (await ada.until_closed(timeout=30)).rcvd.code == 4410
        (bye,) = ada.received.json("bye")
        assert bye["reason"] == "forgotten" and "cspan db forget" in bye["message"]
        (bob_session,) = [s for s in server.hub.sessions if s.principal.user_id == "bob"]
        assert not bob_session.ending
        await asyncio.sleep(2 * app_module.CREDENTIAL_RECHECK_S)  # bob's memory was not erased: his checks pass
        assert not bob_session.ending
        assert (await bob.stop())["reason"] == "stop"

    exported = json.loads((await asyncio.to_thread(cspan, "db", "export", "ada", env=env)).stdout)
    assert exported["profile"] is None and exported["facts"] == [] and exported["conversations"] == []
    assert "forget me" not in json.dumps(exported) and "Ada again" not in json.dumps(exported)
    with ContextDB(users["db"]) as db:
        assert db.user("bob").get_profile() is not None and len(db.user("bob").conversations()) == 1

    async with websockets.connect(ws_url(server, users["ada"]), max_size=None) as ws:  # a fresh start
        ada = Client(ws)
        ready = await ada.start(profile={"name": "Ada anew"})
        assert ready["type"] == "ready" and ready["profile"]["name"] == "Ada anew"
        assert ready["profile"]["location"] == ""  # not Leeds: nothing from before the erase
        await ada.send_json({"type": "context", "profile": {"location": "York"}})
        await ada.stream(SILENCE[:5])
        assert (await ada.stop())["reason"] == "stop"
    with ContextDB(users["db"]) as db:
        profile = db.user("ada").get_profile()
        assert (profile.name, profile.city, profile.notes) == ("Ada anew", "York", "")
        (conversation,) = db.user("ada").conversations()
        assert conversation.ended_at is not None


@pytest.mark.timeout(300)
async def test_forget_ends_a_local_session_that_writes_nothing(serve, tmp_path: Path, monkeypatch) -> None:
    """Without credentials every session is ``local``; forgetting ``local`` (another connection to the database) ends
    its running session by the periodic check alone (the client sends nothing): ``bye`` ``forgotten``, close 4410."""
    from cspan.server import app as app_module

    monkeypatch.setattr(app_module, "CREDENTIAL_RECHECK_S", 0.2)
    path = tmp_path / "local.sqlite"
    server = serve(db=str(path))
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        assert (await client.start(profile={"name": "Lo", "notes": "forget me"}))["type"] == "ready"
        await asyncio.sleep(1.0)  # a few checks pass while nothing was forgotten
        (session,) = server.hub.sessions
        assert not session.ending
        with ContextDB(path) as db:
            assert db.user("local").get_profile().notes == "forget me"
            db.forget_user("local")
        assert (await client.until_closed(timeout=30)).rcvd.code == 4410
        (bye,) = client.received.json("bye")
        assert bye["reason"] == "forgotten"
    with ContextDB(path) as db:
        assert db.users() == [] and db.user("local").get_profile() is None


async def test_a_proxied_loopback_server_requires_credentials(serve, tiny_checkpoint, tmp_path: Path) -> None:
    """A replica on 127.0.0.1 behind HAProxy answers the public name (``--allow-host``): without a valid credential
    it is refused at start. A loopback server whose database had issued tokens, all revoked since, stays closed
    after a restart (token or none, through HAProxy's name or 127.0.0.1)."""
    from cspan.server.auth import ServeConfigError
    from cspan.server.serve import ServeSettings, create_app

    path = tmp_path / "revoked.sqlite"
    with ContextDB(path) as db:
        token = issue_token(db, "zoe")[1]
        db.revoke_tokens(user_id="zoe")
    for db_target in (":memory:", str(path)):
        settings = ServeSettings(asr="none", router="none", db=db_target, allow_host=["talk.example.org"])
        with pytest.raises(ServeConfigError, match=r"--allow-host talk\.example\.org without a token"):
            create_app(settings, checkpoint=tiny_checkpoint)
    server = serve(db=str(path))  # a restart after revoking every token
    assert httpx.get(server.url + "/info").json()["token_required"] is True
    for url in (server.ws_url, f"{server.ws_url}?token={token}"):
        assert await close_code(url) == 4401, url
    assert httpx.get(server.url + "/metrics").status_code == 401


@pytest.mark.timeout(300)
async def test_tools_are_configuration_and_actions_wait_for_a_confirmation(serve, users, stub_llm) -> None:
    """``--tools clock,memory --mcp 'allow=shout,add read=shout -- python mcp_demo_server.py'`` with an LLM router:
    the router sees exactly those tools plus the principal's memory tools (no mock world, no ``refuse``), an MCP
    read runs, an MCP action (``add``: not annotated read-only) is held back for a confirmation, and
    ``remember_fact`` writes the session principal's memory only."""
    stub_llm.reset(
        {"tool": "shout", "arguments": {"text": "hello", "times": 2}},
        {"tool": "add", "arguments": {"a": 2, "b": 3}},
        {"tool": "remember_fact", "arguments": {"key": "favourite colour", "value": "green"}},
    )
    server = serve(
        db=str(users["db"]),
        router=stub_llm.url,
        router_model="stub",
        tools="clock,memory",
        mcp=[f"allow=shout,add read=shout -- {sys.executable} {MCP_DEMO}"],
        transcriber=FixedTranscriber("please do it"),
        span_deadline_s=20.0,
    )
    bank = server.hub.backends.bank
    assert sorted(bank.names()) == ["add", "get_time", "shout"]
    async with websockets.connect(ws_url(server, users["ada"]), max_size=None) as ws:
        client = Client(ws)
        assert (await client.start(test={"force_ret_at": [0.4, 1.6, 2.8]}))["type"] == "ready"
        await client.stream(SILENCE)
        while len(client.received.json("span")) < 3:
            await client.recv_until(lambda k, m: k == "json" and m["type"] in ("span", "no_span"), timeout=60)
        await client.stop()
    spans = [m["text"] for m in client.received.json("span")]
    assert len(spans) == 3, client.received.json("no_span") + client.received.json("error")
    assert "HELLO HELLO" in spans[0]
    assert "confirmation needed" in spans[1] and "add" in spans[1]
    assert "remembered" in spans[2]
    offered = {t["function"]["name"] for t in stub_llm.requests[0]["tools"]}
    assert offered == {"get_time", "shout", "add", "recall_memory", "remember_fact"}
    with ContextDB(users["db"]) as db:
        assert {f.key: f.value for f in db.user("ada").facts()}["favourite_colour"] == "green"
        assert "favourite_colour" not in {f.key for f in db.user("bob").facts()}

    # the operator sees the MCP server's state on /metrics (a lost one is reconnected at the next call)
    def mcp_gauge() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {users['ops']}"}).text
        return {s: float(re.search(rf'^cspan_mcp_servers{{state="{s}"}} (\S+)$', text, re.M)[1]) for s in STATES}

    STATES = ("up", "reconnecting", "down")
    assert mcp_gauge() == {"up": 1.0, "reconnecting": 0.0, "down": 0.0}
    (pid,) = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _runs(d, MCP_DEMO)]
    os.kill(pid, signal.SIGKILL)  # the MCP server dies between calls: the next call finds it gone

    def shout(text: str) -> str:  # a router's call, on the server's event loop (the MCP session's)
        call = asyncio.run_coroutine_threadsafe(bank.call("shout", {"text": text}), bank.mcp[0]._task.get_loop())
        return call.result(timeout=60).text

    with pytest.raises(ToolError, match="closed the connection"):
        shout("lost")
    assert mcp_gauge() == {"up": 0.0, "reconnecting": 1.0, "down": 0.0}
    assert shout("again") == "AGAIN"
    assert mcp_gauge() == {"up": 1.0, "reconnecting": 0.0, "down": 0.0}


@pytest.mark.timeout(300)
async def test_health_tells_a_balancer_when_to_send_no_more(serve) -> None:
    server = serve(max_sessions=1)
    ok = httpx.get(server.url + "/health")
    assert ok.status_code == 200 and ok.json()["status"] == "ok" and ok.json()["free_slots"] == 1
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        assert (await client.start())["type"] == "ready"
        full = httpx.get(server.url + "/health")
        assert full.status_code == 503 and full.json()["status"] == "full" and full.json()["free_slots"] == 0
        await client.stop()
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    server.hub.draining = True  # what SIGTERM does first (see test_server_replicas for the real signal)
    draining = httpx.get(server.url + "/health")
    assert draining.status_code == 503 and draining.json()["status"] == "draining"
    async with websockets.connect(server.ws_url) as ws:
        busy = await Client(ws).start()
        assert busy["type"] == "busy" and "shutting down" in busy["message"]


def _runs(proc: Path, script: Path) -> bool:
    """Whether the process of ``/proc/PID`` is a child of this one running ``script``."""
    try:
        parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        return parent == os.getpid() and str(script) in (proc / "cmdline").read_bytes().decode().split("\0")
    except (OSError, ValueError, IndexError):  # gone, or not ours
        return False


def cspan(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_tool_settings_from_flags_environment_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cspan.core.settings import SettingsError, load_settings
    from cspan.server.serve_settings import ServeSettings

    config = tmp_path / "serve.toml"
    config.write_text(
        f"""
[serve]
tools = ["clock", "calculator", "memory"]
retention-days = 30
db = "{tmp_path / "c.sqlite"}"

[[serve.mcp]]
command = ["{sys.executable}", "{MCP_DEMO}"]
allow = ["add"]
read = ["add"]

[[serve.mcp]]
url = "http://127.0.0.1:8765/mcp"
prefix = "web_"
"""
    )
    s = load_settings(ServeSettings, config=config, verb="serve")
    spec = s.tools_spec()
    assert spec.sets == ["clock", "calculator", "memory"] and s.retention_days == 30
    assert spec.mcp[0].command == [sys.executable, str(MCP_DEMO)] and spec.mcp[0].read_only == ["add"]
    assert spec.mcp[1].url == "http://127.0.0.1:8765/mcp" and spec.mcp[1].prefix == "web_"
    # the live default: every built-in set but the benchmark's mock world
    assert "fdb-v3" not in load_settings(ServeSettings, {"db": ":memory:"}).tools_spec().sets
    # a repeatable setting from the environment: one value as it is, or a JSON list; flags win
    monkeypatch.setenv("CSPAN_MCP", "allow=add prefix=m_ http://127.0.0.1:8765/mcp")
    monkeypatch.setenv("CSPAN_ALLOW_HOST", "talk.example.org")
    monkeypatch.setenv("CSPAN_ALLOW_ORIGIN", '["https://a.example", "https://b.example"]')
    s = load_settings(ServeSettings, {"db": ":memory:"})
    assert s.tools_spec().mcp[0].url == "http://127.0.0.1:8765/mcp" and s.tools_spec().mcp[0].prefix == "m_"
    assert s.allow_host == ["talk.example.org"] and s.allow_origin == ["https://a.example", "https://b.example"]
    assert load_settings(ServeSettings, {"allow_host": ["x.example"]}).allow_host == ["x.example"]
    monkeypatch.setenv("CSPAN_ALLOW_HOST", "[talk")
    with pytest.raises(SettingsError, match="CSPAN_ALLOW_HOST: starts with '\\[' but is not a JSON list"):
        load_settings(ServeSettings)
    for name in ("CSPAN_MCP", "CSPAN_ALLOW_HOST", "CSPAN_ALLOW_ORIGIN"):
        monkeypatch.delenv(name)

    for args, message in [
        (["--tools", "clock,travel"], "--tools / CSPAN_TOOLS: unknown tool set 'travel'"),
        (["--mcp", "allow=a,b"], "--mcp / CSPAN_MCP: 'allow=a,b': give a stdio command line"),
        (["--retention-days", "0"], "--retention-days"),
        (["--ssl-keyfile", str(config)], "needs --ssl-certfile"),
        (["--token-file", str(tmp_path / "none.toml")], "--token-file"),
    ]:
        proc = cspan("serve", "--checkpoint", "/nonexistent", *args)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
    # a commas-bearing --mcp is one value, and the command line wins over the file
    proc = cspan("serve", "--help")
    for flag in ("--tools", "--mcp", "--token-file", "--token-user", "--retention-days", "--ssl-certfile", "--drain-s"):
        assert flag in proc.stdout, flag


async def test_tools_the_local_router_never_calls_are_named_at_start(caplog) -> None:
    """``--router local`` (the default) calls only get_time and calculate: MCP tools and get_weather given with
    ``--tools`` / ``--mcp`` are named in a warning at start (README's one-GPU example looked as if they were used)."""
    from cspan.server.serve_settings import ServeSettings
    from cspan.server.shared_backends import build_backends

    settings = ServeSettings(
        router="local", db=":memory:", tools="clock,weather", mcp=[f"allow=add -- {sys.executable} {MCP_DEMO}"]
    )
    with caplog.at_level("WARNING", logger="cspan.server.shared_backends"):
        backends = await build_backends(settings, None)
        await backends.aclose()
    (warning,) = [r.getMessage() for r in caplog.records if "--router local" in r.getMessage()]
    assert "get_weather, add will not be called" in warning and "--router URL" in warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="cspan.server.shared_backends"):
        backends = await build_backends(ServeSettings(router="local", db=":memory:"), None)  # the default: quiet
        await backends.aclose()
    assert not [r for r in caplog.records if "--router local" in r.getMessage()]


def test_operators_page_documents_every_serve_setting() -> None:
    """docs/OPERATORS.md has a row for every setting of ``cspan serve`` (the test hooks aside)."""
    from cspan.server.serve_settings import ServeSettings

    doc = (REPO / "docs" / "OPERATORS.md").read_text()
    for name, field in ServeSettings.model_fields.items():
        if (field.json_schema_extra or {}).get("hidden"):
            continue
        flag = "--no-cuda-graphs" if name == "cuda_graphs" else "--" + name.replace("_", "-")
        assert f"`{flag}`" in doc, f"{flag} is not documented in docs/OPERATORS.md"


async def test_infer_and_bench_take_the_same_tool_flags() -> None:
    """``cspan infer`` and the bench runners (``fdb-v1 run``, ``qa``) take ``--tools`` / ``--mcp``; the runners' bank
    is built from them (an MCP subprocess mounted; no mock world unless named); ``fdb-v3 run`` keeps its own world."""
    import argparse

    from cspan.bench.run_commands import make_bank

    for verb in (["infer"], ["bench", "fdb-v1", "run"], ["bench", "qa"]):
        help_text = cspan(*verb, "--help").stdout
        assert "--tools" in help_text and "--mcp" in help_text, verb
    assert "--mcp" not in cspan("bench", "fdb-v3", "run", "--help").stdout
    args = argparse.Namespace(tools="default", mcp=[f"allow=add -- {sys.executable} {MCP_DEMO}"], knowledge=None)
    bank = await make_bank(args)
    try:
        assert sorted(bank.names()) == ["add", "calculate", "get_time", "get_weather"]
    finally:
        await bank.aclose()
    args.tools = "default,fdb-v3"
    args.mcp = []
    bank = await make_bank(args)
    try:
        assert {"book_flight", "search_flights", "get_time"} <= set(bank.names())
    finally:
        await bank.aclose()
