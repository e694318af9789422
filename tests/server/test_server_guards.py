"""``cspan serve`` against hostile or careless input (issue 22): DNS rebinding (Host check on every route and
protocol), non-finite wire audio, numeric and backend settings refused before anything loads, trickling HTTP
headers, and a stop in the middle of a sentence."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import websockets
from serve_client import Client, load_frames

from cspan.core import cli

HTTP_ROUTES = ["/", "/info", "/metrics", "/health", "/static/app.js"]


def refused_hosts(port: int) -> list[str]:
    """``Host`` values a rebinding page (or a confused proxy) could send to a loopback server on ``port``."""
    return [
        f"rebind.example:{port}",
        "rebind.example",
        f"127.0.0.1:{port + 1}",
        "localhost",  # port 80, not the bound port
        f"localhost.rebind.example:{port}",
        f"127.0.0.1.nip.io:{port}",
        f"127.0.0.1:{port}@rebind.example",
        f"[::1]:{port + 1}",
        "",
    ]


def allowed_hosts(port: int) -> list[str]:
    return [f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"127.9.9.9:{port}", f"[::1]:{port}"]


async def ws_status(port: int, host: str, path: str = "/ws", **kwargs) -> int | str:
    """Open a WebSocket to 127.0.0.1:``port`` whose handshake says ``Host: host``: "open", or the HTTP status of a
    refused handshake."""
    try:
        async with websockets.connect(f"ws://{host or 'x'}{path}", host="127.0.0.1", port=port, **kwargs) as ws:
            if not host:  # websockets always derives Host from the URI: an empty one is checked over HTTP only
                return "skipped"
            await ws.send(json.dumps({"type": "stop"}))
            return "open"
    except websockets.exceptions.InvalidStatus as exc:
        return exc.response.status_code


async def test_dns_rebinding_is_refused_on_every_route(serve) -> None:
    server = serve()
    port = server.port
    async with httpx.AsyncClient(base_url=server.url) as http:
        for host in refused_hosts(port):
            for route in HTTP_ROUTES:
                r = await http.get(route, headers={"Host": host})
                assert r.status_code == 403, (host, route, r.status_code)
                assert "--allow-host" in r.text
            if host:
                assert await ws_status(port, host, origin=f"http://{host}") == 403, host
        for host in allowed_hosts(port):
            for route in HTTP_ROUTES:
                assert (await http.get(route, headers={"Host": host})).status_code == 200, (host, route)
            assert await ws_status(port, host) == "open", host
        metrics = (await http.get("/metrics")).text
    refused = (len(refused_hosts(port)) * (len(HTTP_ROUTES) + 1)) - 1
    assert f"cspan_host_refused_total {float(refused)}" in metrics
    assert server.hub.free_slots() == 1  # no session work for a refused handshake


async def test_two_host_headers_are_refused(serve) -> None:
    """Issue 22 (final trial): a request with two Host fields (a loopback one first, then another) is refused like a
    foreign Host (it was answered from the first), as `cspan asr-serve` and `cspan tools serve` refuse it."""
    server = serve()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        f"GET /info HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nHost: rebind.example:{server.port}\r\n"
        "Connection: close\r\n\r\n".encode()
    )
    await writer.drain()
    status = (await reader.readline()).decode()
    writer.close()
    assert status.startswith("HTTP/1.1 403"), status


async def test_listed_hosts_are_answered(serve) -> None:
    token = "a-test-token-123"  # a public name is served through a proxy: credentials are required
    server = serve(allow_host=["talk.example.org", "proxy.internal:8443"], token=token)
    port = server.port
    async with httpx.AsyncClient(base_url=server.url) as http:
        for host, status in [
            ("talk.example.org", 200),
            (f"talk.example.org:{port}", 200),
            ("proxy.internal:8443", 200),
            ("proxy.internal:8444", 403),
            ("other.example.org", 403),
            (f"127.0.0.1:{port}", 200),
        ]:
            assert (await http.get("/info", headers={"Host": host})).status_code == status, host
    assert await ws_status(port, "talk.example.org", f"/ws?token={token}", origin="https://talk.example.org") == "open"


def test_host_rule_on_other_binds() -> None:
    from cspan.server.auth import host_allowed

    for host in ("anything.example", "10.0.0.5:8080", "localhost:1"):
        assert host_allowed(host, bind_host="0.0.0.0", port=8080)
    assert host_allowed("talk.example.org", bind_host="0.0.0.0", port=8080, allowed=["talk.example.org"])
    assert not host_allowed("evil.example", bind_host="0.0.0.0", port=8080, allowed=["talk.example.org"])
    assert host_allowed("evil.example", bind_host="127.0.0.1", port=8080, allowed=["*"])
    assert not host_allowed(None, bind_host="127.0.0.1", port=8080)


def test_host_without_port_means_the_schemes_default() -> None:
    """A browser leaves the default port out of ``Host``: ``cspan serve --port 80`` (or 443 with TLS) on loopback
    was answered 403 for ``Host: localhost``, and ``--allow-host NAME:443`` refused ``Host: NAME`` over https."""
    from cspan.server.auth import host_allowed

    assert host_allowed("localhost", bind_host="127.0.0.1", port=80)
    assert host_allowed("127.0.0.1", bind_host="127.0.0.1", port=80, scheme="ws")
    assert host_allowed("localhost", bind_host="127.0.0.1", port=443, scheme="https")
    assert host_allowed("[::1]", bind_host="::1", port=443, scheme="wss")
    assert not host_allowed("localhost", bind_host="127.0.0.1", port=443)  # http: port 80, not this server's
    assert not host_allowed("localhost", bind_host="127.0.0.1", port=8080, scheme="https")
    pinned = ["talk.example.org:443"]
    assert host_allowed("talk.example.org", bind_host="127.0.0.1", port=8080, allowed=pinned, scheme="https")
    assert not host_allowed("talk.example.org", bind_host="127.0.0.1", port=8080, allowed=pinned)
    assert host_allowed("talk.example.org", bind_host="127.0.0.1", port=8080, allowed=["talk.example.org:80"])


async def test_host_guard_reads_the_scheme() -> None:
    """The middleware passes the request's scheme: ``Host: localhost`` reaches a TLS server on loopback port 443."""
    from cspan.server.app import HostGuard

    reached: list[str] = []

    async def app(scope, receive, send) -> None:
        reached.append(scope["scheme"])

    metrics = SimpleNamespace(host_refused=SimpleNamespace(inc=lambda: None))
    guard = HostGuard(app, SimpleNamespace(host="127.0.0.1", allow_host=[]), metrics)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    for scheme in ("https", "wss", "http"):
        scope = {"type": "http", "scheme": scheme, "server": ("127.0.0.1", 443), "headers": [(b"host", b"localhost")]}
        await guard(scope, None, send)
    assert reached == ["https", "wss"]
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [403]


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda x: x.__setitem__(0, np.nan), id="nan-first"),
        pytest.param(lambda x: x.__setitem__(slice(100, 200), np.inf), id="inf-block"),
        pytest.param(lambda x: x.__setitem__(slice(None), -np.inf), id="all-neg-inf"),
        pytest.param(lambda x: x.__setitem__(slice(None, None, 2), np.nan), id="nan-every-other"),
    ],
)
async def test_non_finite_wire_audio_becomes_silence(serve, fixture_file, bad) -> None:
    server = serve()
    frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))[:8]
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        assert (await client.start())["type"] == "ready"
        poisoned = []
        for k, frame in enumerate(frames):
            frame = frame.copy()
            if k in (1, 4):
                bad(frame)
            poisoned.append(frame)
        await client.stream(poisoned)
        bye = await client.stop()
    errors = client.received.json("error")
    assert [e["code"] for e in errors] == ["bad_audio"]  # reported once, the session went on
    assert "NaN or infinite" in errors[0]["message"]
    assert bye["stats"]["consumed_frames"] == 8 and bye["stats"]["errors"] == 1
    assert all(np.isfinite(a).all() and np.abs(a).max() <= 1.0 for a in client.received.audio())


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--port", "70000"], "--port"),
        (["--port", "-1"], "--port"),
        (["--max-sessions", "300"], "--max-sessions"),
        (["--max-sessions", "0"], "--max-sessions"),
        (["--idle-timeout-s", "inf"], "--idle-timeout-s"),
        (["--idle-timeout-s", "nan"], "--idle-timeout-s"),
        (["--max-queued-frames", "1e9"], "--max-queued-frames"),
        (["--temp", "-1"], "--temp"),
        (["--span-deadline-s", "inf"], "--span-deadline-s"),
        (["--listen-s", "0"], "--listen-s"),
        (["--seed", str(2**64)], "--seed"),
        (["--header-timeout-s", "0"], "--header-timeout-s"),
        (["--max-text-prompt-chars", "99999"], "--max-text-prompt-chars"),
        (["--asr", "whisper"], "--asr"),
        (["--asr", "ftp://host/x"], "--asr"),
        (["--router", "gpt"], "--router"),
        (["--router", "http://host:99999/v1"], "--router"),
        (["--knowledge", "/nonexistent/notes"], "--knowledge"),
        (["--token", "short"], "--token"),
        (["--db-wait-s", "1e-9"], "--db-wait-s"),  # a healthy database would refuse every conversation
        (["--db-wait-s", "30"], "--db-wait-s"),  # 30 s of silence, a backlog, a shutdown without bye
    ],
)
def test_bad_settings_exit_2_before_loading(argv: list[str], names: str, capsys: pytest.CaptureFixture[str]) -> None:
    # --checkpoint points nowhere: reaching the model would fail differently (exit 1), so exit 2 proves the
    # setting was refused before anything loaded
    assert cli.main(["serve", "--checkpoint", "/nonexistent/ckpt", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cspan serve: error: {names}"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_settings_file_and_environment_ranges(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    conf = tmp_path / "serve.toml"
    conf.write_text("[serve]\nmax-sessions = 1000\n", encoding="utf-8")
    assert cli.main(["serve", "--checkpoint", "/nonexistent/ckpt", "--config", str(conf)]) == 2
    assert "serve.toml: max-sessions" in capsys.readouterr().err
    conf.write_text("max_sesions = 2\n", encoding="utf-8")  # a typo: the closest key, as for a variable
    assert cli.main(["serve", "--checkpoint", "/nonexistent/ckpt", "--config", str(conf)]) == 2
    assert capsys.readouterr().err == (
        f"cspan serve: error: settings file {conf}: unknown key 'max_sesions' at the top level, which every command "
        "reads, for `cspan serve` (did you mean 'max-sessions'?)\n"
    )
    monkeypatch.setenv("CSPAN_PORT", "123456")
    assert cli.main(["serve", "--checkpoint", "/nonexistent/ckpt"]) == 2
    assert "CSPAN_PORT" in capsys.readouterr().err


def test_backend_urls_that_do_not_answer_stop_the_start(tiny_checkpoint_dir: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    argv = ["serve", "--checkpoint", str(tiny_checkpoint_dir), "--device", "cpu", "--port", "0"]
    for backend in (["--router", f"http://127.0.0.1:{dead}/v1"], ["--asr", f"http://127.0.0.1:{dead}"]):
        assert cli.main([*argv, *backend]) == 1
        err = capsys.readouterr().err
        assert f"{backend[0]} http://127.0.0.1:{dead}" in err and "does not answer" in err, err
        assert "Traceback" not in err


def test_a_bad_context_db_is_one_line(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    for bad in ("not a database\n" * 100, "\x00" * 4096):
        path = tmp_path / "db.sqlite"
        path.write_text(bad, encoding="utf-8")
        assert cli.main(["serve", "--checkpoint", "/nonexistent/ckpt", "--db", str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("cspan serve: error: backends") and "Context DB" in err, err
        assert "Traceback" not in err


async def test_trickling_headers_are_cut_off(serve) -> None:
    """200 connections sending a request line byte by byte are closed after the header timeout; the server
    answers a normal request meanwhile and afterwards."""
    server = serve(header_timeout_s=1.0)

    async def trickle() -> float:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            for byte in b"GET /info HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
                writer.write(bytes([byte]))
                await writer.drain()
                if await _closed(reader, 0.25):
                    return loop.time() - t0
            return float("inf")
        except ConnectionError:
            return loop.time() - t0
        finally:
            writer.close()

    tasks = [asyncio.ensure_future(trickle()) for _ in range(200)]
    await asyncio.sleep(0.3)
    async with httpx.AsyncClient(base_url=server.url) as http:
        assert (await http.get("/health")).status_code == 200
    held = await asyncio.gather(*tasks)
    assert all(t < 10.0 for t in held), sorted(held)[-5:]
    async with httpx.AsyncClient(base_url=server.url) as http:
        assert (await http.get("/health")).status_code == 200


async def test_a_trickled_body_does_not_hold_the_connection(serve) -> None:
    """A request whose body keeps coming a byte at a time after its response (405: the route reads no body) is
    closed the header timeout after it was answered, not held for as long as the client trickles; a request whose
    dropped body arrives in time keeps its connection, as does a complete one."""
    server = serve(header_timeout_s=1.0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    host = f"127.0.0.1:{server.port}"
    try:
        writer.write(f"POST /health HTTP/1.1\r\nHost: {host}\r\nContent-Length: 100000000\r\n\r\n".encode())
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"HTTP/1.1 405 ")
        closed = False
        for _ in range(40):  # 4 s of trickling, beyond uvicorn's 5 s keep-alive only because it is reset
            with contextlib.suppress(ConnectionError):
                writer.write(b"x")
                await writer.drain()
            if await _closed_after_response(reader, 0.1):
                closed = True
                break
        assert closed, "the connection was held open while the body trickled"
    finally:
        writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:  # a body sent in full to a route that reads none: answered, and the connection goes on
        writer.write(f"POST /health HTTP/1.1\r\nHost: {host}\r\nContent-Length: 200000\r\n\r\n".encode())
        writer.write(b"x" * 200_000)
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"HTTP/1.1 405 ")
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        await asyncio.sleep(1.5)  # past the header timeout: the drained connection is not closed by it
        writer.write(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        await asyncio.wait_for(reader.readuntil(b"HTTP/1.1 200 "), 10)
    finally:
        writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:  # keep-alive still works for requests that are complete
        for _ in range(2):
            writer.write(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            await writer.drain()
            assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"HTTP/1.1 200 ")
            await asyncio.wait_for(reader.readuntil(b'"protocol_version":1}'), 10)
    finally:
        writer.close()


async def _closed_after_response(reader: asyncio.StreamReader, wait_s: float) -> bool:
    """Whether the connection ends within ``wait_s`` (the rest of a response already sent is read and skipped)."""
    try:
        while data := await asyncio.wait_for(reader.read(4096), wait_s):
            del data
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


async def _closed(reader: asyncio.StreamReader, wait_s: float) -> bool:
    try:
        data = await asyncio.wait_for(reader.read(1), wait_s)
    except TimeoutError:
        return False
    return data == b""


@pytest.mark.timeout(300)
async def test_stop_mid_sentence_still_gives_the_final_transcript(serve, fixture_file) -> None:
    server = serve(asr="sphinx")
    frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))
    speech = [k for k, f in enumerate(frames) if np.abs(f).max() > 0.05]
    cut = speech[len(speech) * 2 // 3]  # two thirds into the question: the user is speaking
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        assert (await client.start())["type"] == "ready"
        await client.stream(frames[:cut])
        bye = await client.stop()
    finals = [m for m in client.received.json("user_text") if m["final"]]
    assert len(finals) == 1 and finals[0]["text"], client.received.json("user_text")
    assert client.received.types().index("user_text") < client.received.types().index("bye")
    stats = bye["stats"]
    assert stats["consumed_frames"] == cut and stats["silence_frames"] <= 12


def test_legacy_backend_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cspan backends env`` exports CSPAN_ASR_URL / CSPAN_ROUTER_URL: still read, below CSPAN_ASR and the flag."""
    from cspan.core.settings import load_settings
    from cspan.server.serve_settings import ServeSettings

    monkeypatch.setenv("CSPAN_ASR_URL", "http://asr.local:8990/v1")
    monkeypatch.setenv("CSPAN_ROUTER_URL", "http://llm.local:8000/v1")
    s = load_settings(ServeSettings)
    assert (s.asr, s.router) == ("http://asr.local:8990/v1", "http://llm.local:8000/v1")
    assert s.backend_urls() == {"--asr": "http://asr.local:8990/v1", "--router": "http://llm.local:8000/v1"}
    monkeypatch.setenv("CSPAN_ASR", "none")
    assert load_settings(ServeSettings).asr == "none"
    assert load_settings(ServeSettings, {"router": "local"}).router == "local"


async def test_an_unexpected_error_reaches_the_client_without_its_text() -> None:
    """An unexpected exception while a message is handled answers ``internal`` with its type and the session id; its
    text (which may name paths or other internals) stays in the server's log, and the session goes on."""
    from types import SimpleNamespace

    from cspan.server.app import _handle

    sent: list[tuple[str, str]] = []
    session = SimpleNamespace(id="s-1", client_error=lambda code, message: sent.append((code, message)))

    async def failing() -> None:
        raise RuntimeError("cannot open /srv/cspan/secret/voices/x.pt")

    await _handle(session, failing())  # type: ignore[arg-type]
    assert sent == [("internal", "an unexpected server error (RuntimeError); the server log has it (session s-1)")]
