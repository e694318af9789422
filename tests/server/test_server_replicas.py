"""Scale out on existing engines: two ``cspan serve`` replicas (real subprocesses, the tiny checkpoint on the CPU)
sharing one Context DB on a real PostgreSQL server, behind a real HAProxy (Debian's package) configured as
``deploy/haproxy.cfg`` (read from there; only the addresses change): WebSocket, ``balance leastconn``,
``option httpchk GET /health``.

Sessions spread over both replicas; a fact remembered through one is read through the other (profile, and a
Context Span from the user's notes); the issued token works on both; when a replica is stopped (SIGTERM) its client
gets a clean close (``bye``, 1001) through the balancer and new sessions go only to the other one. A user forgotten
(``cspan db forget``) has her sessions on both replicas ended and nothing they held written back."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import websockets
from serve_client import Client, load_frames
from serve_process import ServeProcess, free_port, serve_args

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "backends"))
from postgres_server import PostgresServer, running_postgres  # noqa: E402

DEPLOY_CONFIG = REPO / "deploy" / "haproxy.cfg"


def haproxy_config(port: int, servers: dict[str, int], stats_socket: Path) -> str:
    """``deploy/haproxy.cfg`` as documented, with this test's addresses: the frontend on ``127.0.0.1:port`` without
    TLS, the public host name ``127.0.0.1:port``, and in every backend the deploy's servers in order as ``servers``
    (name: port on 127.0.0.1); plus a stats socket for the test to read what the checks found."""
    lines = []
    deploy_names: list[str] = []
    for line in DEPLOY_CONFIG.read_text().splitlines():
        stripped = line.strip()
        if stripped == "global":
            line += f"\n    stats socket {stats_socket}"
        elif stripped.startswith("bind "):
            line = f"    bind 127.0.0.1:{port}"
        elif stripped.startswith("server "):
            name = stripped.split()[1]
            if name not in deploy_names:
                deploy_names.append(name)
            server_port = list(servers.values())[deploy_names.index(name)]
            line = f"    server {name} 127.0.0.1:{server_port}"
        lines.append(line.replace("cspan.example.org", f"127.0.0.1:{port}"))
    assert len(deploy_names) == len(servers), deploy_names
    text = "\n".join(lines) + "\n"
    for needed in ("balance leastconn", "option httpchk GET /health", "timeout tunnel", "default_backend any_replica"):
        assert needed in text, needed
    return text


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    yield from running_postgres()


@pytest.fixture
def haproxy_binary() -> str:
    found = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").is_file() else None)
    if found is None:
        pytest.skip("HAProxy is not installed (.ci/run installs Debian's haproxy)")
    return found


def servers_up(stats_socket: Path, backend: str) -> int:
    """How many servers of ``backend`` HAProxy's checks hold up (``show stat`` on its stats socket)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(stats_socket))
        sock.sendall(b"show stat\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    header, *rows = data.decode().splitlines()
    fields = header.lstrip("# ").split(",")
    stats = [dict(zip(fields, row.split(","), strict=False)) for row in rows if row]
    return sum(
        1
        for r in stats
        if r["pxname"] == backend and r["svname"] not in ("BACKEND", "FRONTEND") and r["status"] == "UP"
    )


def healthy(port: int, host: str) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", headers={"Host": host}, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def until(predicate: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not reached: {what}"
        await asyncio.sleep(0.1)


@pytest.mark.timeout(600)
async def test_two_replicas_behind_haproxy_share_one_memory(
    tiny_checkpoint_dir: Path, fixture_file, tmp_path: Path, postgres: PostgresServer, haproxy_binary: str
) -> None:
    from cspan.backends.context_db import ContextDB
    from cspan.backends.identity import issue_token

    with ContextDB(postgres.url) as db:
        _, token = issue_token(db, "ada")
    front = free_port()
    public = f"127.0.0.1:{front}"
    ports = {"a": free_port(), "b": free_port()}
    flags = [
        "--db", postgres.url, "--asr", "sphinx", "--router", "local", "--tools", "clock,memory",
        "--allow-host", public, "--test-hooks", "--span-deadline-s", "30", "--idle-timeout-s", "600",
    ]  # fmt: skip
    replicas = {
        name: ServeProcess(*serve_args(tiny_checkpoint_dir, "--port", str(port), *flags), name=f"replica {name}")
        for name, port in ports.items()
    }
    config = tmp_path / "haproxy.cfg"
    stats_socket = tmp_path / "haproxy.sock"
    config.write_text(haproxy_config(front, ports, stats_socket))
    subprocess.run([haproxy_binary, "-c", "-q", "-f", str(config)], check=True, timeout=30)
    haproxy = subprocess.Popen(
        [haproxy_binary, "-db", "-f", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        for replica in replicas.values():
            replica.start()
        await until(lambda: all(healthy(p, public) for p in ports.values()), "both replicas healthy")
        await until(lambda: servers_up(stats_socket, "replicas") == 2, "HAProxy sees both replicas up")
        url = f"ws://{public}/ws?token={token}"
        frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))
        silence = [np.zeros(1920, dtype=np.float32)] * 8

        def full() -> set[str]:
            """The replicas that answer ``/health`` with 503 (no free slot)."""
            out = set()
            for name, port in ports.items():
                try:
                    answer = httpx.get(f"http://127.0.0.1:{port}/health", headers={"Host": public}, timeout=2)
                except httpx.HTTPError:
                    continue  # stopped
                if answer.status_code == 503:
                    out.add(name)
            return out

        # 1. the first session, with a profile: it lands on one replica ("first")
        async with websockets.connect(url, max_size=None) as ws1:
            c1 = Client(ws1)
            notes = "The weather in London is foggy, says the barometer at home."
            r1 = await c1.start(profile={"name": "Ada", "location": "Leeds", "notes": notes})
            assert r1["type"] == "ready" and r1["profile"]["user_id"] == "ada"
            await c1.stream(silence)
            reading = asyncio.ensure_future(
                c1.until_closed(timeout=600)
            )  # a live client keeps reading (pings are answered)
            (first,) = full()
            other = "b" if first == "a" else "a"

            # 2. the second session goes to the other replica (least connections; the first one is full) and reads
            # what the first stored: the profile at start, the notes through a Context Span
            # HAProxy's health check must have seen the first replica full (a request before that may still go there)
            await until(lambda: servers_up(stats_socket, "replicas") == 1, "HAProxy sees one free replica")
            async with websockets.connect(url, max_size=None) as ws2:
                c2 = Client(ws2)
                r2 = await c2.start(test={"force_ret_at": [3.5]})
                assert r2["type"] == "ready"
                assert full() == {"a", "b"}  # sessions spread over both

                # every slot taken: the page still loads through the balancer, and a third conversation gets the
                # protocol's busy from a replica (not HAProxy's own 503)
                await until(lambda: servers_up(stats_socket, "replicas") == 0, "HAProxy sees no free slot")
                assert servers_up(stats_socket, "any_replica") == 2
                page = httpx.get(f"http://{public}/", timeout=10)
                assert page.status_code == 200 and "<html" in page.text.lower()
                async with websockets.connect(url, max_size=None) as ws3:
                    busy = await Client(ws3).start()
                    assert busy["type"] == "busy", busy
                assert (r2["profile"]["name"], r2["profile"]["location"]) == ("Ada", "Leeds")
                await c2.stream(frames + silence)
                if not c2.received.json("span"):
                    await c2.recv_until(lambda k, m: k == "json" and m["type"] == "span", timeout=120)
                assert "foggy" in c2.received.json("span")[0]["text"]
                await c2.stop()

            # 3. the first replica is stopped: its client gets a clean goodbye through the balancer
            replicas[first].signal(signal.SIGTERM)
            closed = await asyncio.wait_for(reading, 60)
            (bye,) = c1.received.json("bye")
            assert bye["reason"] == "shutdown"
            assert closed.rcvd is not None and closed.rcvd.code == 1001
        assert replicas[first].wait(timeout=60) == 0  # SIGTERM: an orderly shutdown is a clean exit
        assert "Traceback" not in replicas[first].log and "Application shutdown complete" in replicas[first].log

        # 4. new sessions go only to the replica left (the balancer's check found the other one gone)
        for _ in range(2):
            await until(lambda: healthy(front, public), "HAProxy sees the replica left up and free")
            async with websockets.connect(url, max_size=None) as ws:
                client = Client(ws)
                assert (await client.start())["type"] == "ready"
                assert full() == {other}
                await client.stream(silence[:3])
                await client.stop()
        with ContextDB(postgres.url) as db:
            conversations = db.user("ada").conversations()
        assert len(conversations) == 4
        assert {c.settings["session_id"] for c in conversations} >= {r1["session_id"], r2["session_id"]}
    finally:
        haproxy.terminate()
        try:
            out, _ = haproxy.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            haproxy.kill()
            out, _ = haproxy.communicate()
        print("haproxy:", out.decode(errors="replace"))  # shown when the test fails
        for replica in replicas.values():
            print(f"{replica.name}:", replica.log)
        for replica in replicas.values():
            replica.signal(signal.SIGTERM)
        for replica in replicas.values():
            try:
                replica.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            replica.kill()


def test_compose_has_the_topology_of_haproxy_cfg() -> None:
    """``deploy/compose.yaml`` (not run in CI): every replica service is a server of ``deploy/haproxy.cfg`` on the
    port it listens on, its flags are valid ``cspan serve`` settings, and the public name is the same in both."""
    import argparse

    yaml = pytest.importorskip("yaml")
    from cspan.core.settings import add_settings_arguments, settings_from_args
    from cspan.server.serve_settings import ServeSettings

    compose = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())
    cfg = DEPLOY_CONFIG.read_text()
    servers = dict(re.findall(r"^\s+server (\S+) (\S+)$", cfg, flags=re.M))
    replicas = {name: svc for name, svc in compose["services"].items() if name.startswith("cspan-")}
    assert len(replicas) >= 2 and len(servers) == len(replicas)
    for name, service in replicas.items():
        command = service["command"]
        assert command[0] == "serve"
        parser = argparse.ArgumentParser(prog="cspan serve")
        add_settings_arguments(parser, ServeSettings)
        settings = settings_from_args(parser.parse_args([*command[1:], "--db", ":memory:"]))
        assert f"{name}:{settings.port}" in servers.values(), (name, servers)
        assert settings.host == "0.0.0.0" and settings.allow_host == ["cspan.example.org"]
        assert "postgresql://" in service["environment"]["CSPAN_DB"]
    assert "http-check send hdr Host cspan.example.org" in cfg
    backends = re.split(r"^backend ", cfg, flags=re.M)[1:]
    server_lists = {b.split()[0]: re.findall(r"^\s+server (\S+ \S+)$", b, flags=re.M) for b in backends}
    assert set(server_lists) == {"replicas", "any_replica"}
    assert server_lists["replicas"] == server_lists["any_replica"]  # two views of the same replicas
    assert set(compose["services"]["haproxy"]["depends_on"]) == set(replicas)


@pytest.mark.timeout(300)
async def test_forget_ends_the_users_sessions_on_every_replica(serve, postgres: PostgresServer, monkeypatch) -> None:
    """Two replicas (in this process) share one PostgreSQL database; ada talks on both. ``cspan db forget ada --yes``
    (another process) ends both sessions (``bye`` ``forgotten``, 4410) while bob's goes on; what either session held
    (the profile and its notes) is not written back, and ada's next session starts from nothing."""
    import json
    import os

    import psycopg

    from cspan.backends.context_db import ContextDB, Profile
    from cspan.backends.identity import issue_token
    from cspan.server import app as app_module

    monkeypatch.setattr(app_module, "CREDENTIAL_RECHECK_S", 0.5)
    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute("CREATE DATABASE forget_replicas")
    url = postgres.url.rsplit("/", 1)[0] + "/forget_replicas"
    with ContextDB(url) as db:
        tokens = {user: issue_token(db, user)[1] for user in ("ada", "bob")}
        db.user("ada").put_profile(Profile(name="Ada", city="Leeds", notes="forget me"))
    a, b = serve(db=url, max_sessions=2), serve(db=url, max_sessions=2)

    def cspan(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cspan.core.cli", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "CSPAN_DB": url},
        )

    async with (
        websockets.connect(f"{a.ws_url}?token={tokens['ada']}", max_size=None) as ws_a,
        websockets.connect(f"{b.ws_url}?token={tokens['ada']}", max_size=None) as ws_b,
        websockets.connect(f"{b.ws_url}?token={tokens['bob']}", max_size=None) as ws_bob,
    ):
        on_a, on_b, bob = Client(ws_a), Client(ws_b), Client(ws_bob)
        for client in (on_a, on_b):
            ready = await client.start()
            assert ready["type"] == "ready" and ready["profile"]["location"] == "Leeds"
        assert (await bob.start(profile={"name": "Bob"}))["type"] == "ready"
        forgot = await asyncio.to_thread(cspan, "db", "forget", "ada", "--yes")
        assert forgot.returncode == 0, forgot.stderr
        for client in (on_a, on_b):
            closed = await client.until_closed(timeout=600)
            assert closed.rcvd is not None and closed.rcvd.code == 4410
            assert [m["reason"] for m in client.received.json("bye")] == ["forgotten"]
        await asyncio.sleep(1.0)
        assert [s.ending for s in b.hub.sessions if s.principal.user_id == "bob"] == [False]
        assert (await bob.stop())["reason"] == "stop"

    exported = json.loads((await asyncio.to_thread(cspan, "db", "export", "ada")).stdout)
    assert (exported["profile"], exported["facts"], exported["conversations"]) == (None, [], [])
    async with websockets.connect(f"{b.ws_url}?token={tokens['ada']}", max_size=None) as ws:  # a fresh start
        client = Client(ws)
        ready = await client.start(profile={"name": "Ada anew"})
        assert ready["type"] == "ready" and ready["profile"]["location"] == ""
        assert (await client.stop())["reason"] == "stop"
    with ContextDB(url) as db:
        profile = db.user("ada").get_profile()
        assert (profile.name, profile.notes) == ("Ada anew", "") and len(db.user("ada").conversations()) == 1


async def test_a_postgresql_outage_ends_no_conversation_and_its_end_refuses_none(
    serve, postgres: PostgresServer
) -> None:
    """PostgreSQL stops while ada talks on a replica and starts again: her conversation goes on to its ``bye``, one
    opened during the outage is closed with 1013 (its issued token cannot be checked; try again), ``/metrics`` asked
    with an issued admin token answers 503 saying so (was: 500 and a traceback per scrape), the server keeps
    running; and after PostgreSQL restarts while the replica is idle, the next conversation starts on the first try
    (was: refused with 1013, the first statement on the connection the restart had ended)."""
    import psycopg

    from cspan.backends.context_db import ContextDB, Profile
    from cspan.backends.identity import issue_token

    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute("CREATE DATABASE outage")
    url = postgres.url.rsplit("/", 1)[0] + "/outage"
    with ContextDB(url) as db:
        token = issue_token(db, "ada")[1]
        admin = issue_token(db, "ops", scopes=["admin"])[1]
        db.user("ada").put_profile(Profile(name="Ada", city="Leeds"))
    replica = serve(db=url, max_sessions=2)
    scrape = {"Authorization": f"Bearer {admin}"}
    silence = [np.zeros(1920, dtype=np.float32)] * 12
    async with websockets.connect(f"{replica.ws_url}?token={token}", max_size=None) as ws:
        talking = Client(ws)
        assert (await talking.start())["profile"]["location"] == "Leeds"
        await asyncio.to_thread(postgres.stop_server)
        try:
            await talking.stream(silence)
            async with websockets.connect(f"{replica.ws_url}?token={token}", max_size=None) as ws_refused:
                closed = await Client(ws_refused).until_closed(timeout=60)
            assert closed.rcvd is not None and closed.rcvd.code == 1013, closed
            assert "credentials cannot be checked now" in closed.rcvd.reason
            metrics = await asyncio.to_thread(httpx.get, f"{replica.url}/metrics", headers=scrape, timeout=30)
            assert (metrics.status_code, metrics.headers["retry-after"]) == (503, "5")
            assert metrics.json() == {"detail": "credentials cannot be checked now; try again"}
        finally:
            await asyncio.to_thread(postgres.start_server)
        await talking.stream(silence)
        assert (await talking.stop())["reason"] == "stop"
    metrics = await asyncio.to_thread(httpx.get, f"{replica.url}/metrics", headers=scrape, timeout=30)
    assert metrics.status_code == 200 and 'cspan_sessions_started_total{protocol="cspan"} 1.0' in metrics.text
    await asyncio.to_thread(postgres.restart)  # while the replica is idle: its connection ends unused
    async with websockets.connect(f"{replica.ws_url}?token={token}", max_size=None) as ws:
        client = Client(ws)
        ready = await client.start()
        assert ready["type"] == "ready" and ready["profile"]["location"] == "Leeds"
        assert (await client.stop())["reason"] == "stop"
    with ContextDB(url) as db:
        assert db.user("ada").get_profile().city == "Leeds" and len(db.user("ada").conversations()) == 2


async def test_info_answers_during_a_postgresql_outage_on_a_loopback_replica_without_credentials(
    serve, postgres: PostgresServer
) -> None:
    """A replica on 127.0.0.1 with no ``--token``, no token file and no issued token asks the Context DB per request
    whether a token has been issued since: while PostgreSQL is away ``/info`` answered 500 (the page could not even
    build its form). Now it answers 200 with everything it knows and ``token_required: null`` (cannot be checked
    now), ``/health`` stays 200, a conversation is closed with 1013 (try again), and once PostgreSQL is back
    ``token_required`` is false again."""
    import psycopg

    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute("CREATE DATABASE info_outage")
    url = postgres.url.rsplit("/", 1)[0] + "/info_outage"
    replica = serve(db=url)

    def get(path: str) -> httpx.Response:
        return httpx.get(f"{replica.url}{path}", timeout=30)

    before = await asyncio.to_thread(get, "/info")
    assert before.status_code == 200 and before.json()["token_required"] is False
    await asyncio.to_thread(postgres.stop_server)
    try:
        during = await asyncio.to_thread(get, "/info")
        assert during.status_code == 200, during.text
        assert during.json() == {**before.json(), "token_required": None}
        assert (await asyncio.to_thread(get, "/health")).status_code == 200
        async with websockets.connect(replica.ws_url, max_size=None) as ws:
            closed = await Client(ws).until_closed(timeout=60)
        assert closed.rcvd is not None and closed.rcvd.code == 1013, closed
        assert closed.rcvd.reason == "credentials cannot be checked now; try again"
    finally:
        await asyncio.to_thread(postgres.start_server)
    after = await asyncio.to_thread(get, "/info")
    assert after.status_code == 200 and after.json() == before.json()
