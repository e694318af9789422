"""``cspan serve`` published under a path prefix by a real reverse proxy: Debian's HAProxy running the configuration
of docs/OPERATORS.md, "Under a path prefix" (read from there, with the ``global`` and ``defaults`` of
``deploy/haproxy.cfg``; only the addresses change, and no TLS), in front of a real ``cspan serve`` (a subprocess on
the tiny checkpoint): ``/voice/`` on the proxy is ``/`` on the server, the prefix stripped.

- Headless Chromium (Playwright) opens ``http://127.0.0.1:PORT/voice/``: the page loads its scripts, reads
  ``info``, opens its WebSocket at ``/voice/ws`` through the proxy and a conversation runs (``listening``, the
  user's transcript, the agent's text, a Context Span); every request the page makes stays under ``/voice/``. The
  page of old asked for ``/static/app.js`` and ``/info`` at the root, outside the prefix, and never loaded.
- Without a browser: ``/voice/ws`` (a websockets client), ``/voice/v1/realtime`` (the OpenAI SDK given
  ``base_url=.../voice/v1``) and ``/voice/api/chat`` (the Moshi handshake) through the proxy; ``/voice`` is
  redirected to ``/voice/`` with its query; no answer has a ``Location`` out of the prefix (Starlette's redirect of
  ``/info/`` named ``http://HOST/info``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets
from chromium import CHROMIUM, chromium_args, fake_microphone, open_page, page_errors, wait_for_conversation, wait_until
from serve_client import Client
from serve_process import ServeProcess, free_port

REPO = Path(__file__).resolve().parents[2]
OPERATORS = REPO / "docs" / "OPERATORS.md"
DEPLOY_CONFIG = REPO / "deploy" / "haproxy.cfg"
PREFIX = "/voice"
SPAN_TEXT = "The Riverside Library opens at ten on Sunday."


def documented_config() -> str:
    """The HAProxy block of docs/OPERATORS.md's "Under a path prefix", as written."""
    section = OPERATORS.read_text().split("\n## Under a path prefix\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```haproxy\n(.*?)```", section, re.S)
    return block


def deploy_sections(*names: str) -> str:
    """The sections ``names`` (``global``, ``defaults``) of ``deploy/haproxy.cfg``, each with its lines."""
    out: list[str] = []
    keep = False
    for line in DEPLOY_CONFIG.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            keep = line.split()[0] in names
        if keep:
            out.append(line)
    return "\n".join(out) + "\n"


def haproxy_config(front: int, replica: int) -> str:
    """The documented block with this test's addresses: the frontend on ``127.0.0.1:front`` without TLS, the replica
    at ``127.0.0.1:replica``."""
    block = documented_config()
    for needed in ("replace-path", "redirect location", "option forwardfor", "server replica 127.0.0.1:8998"):
        assert needed in block, needed
    block = re.sub(r"(?m)^(\s*)bind .*$", rf"\g<1>bind 127.0.0.1:{front}", block)
    block = block.replace("127.0.0.1:8998", f"127.0.0.1:{replica}")
    return deploy_sections("global", "defaults") + "\n" + block


@dataclass
class Published:
    """The replica and the proxy publishing it under :data:`PREFIX`."""

    server: ServeProcess
    front: int
    log: Path

    @property
    def base(self) -> str:
        """The public address of the page: ``http://127.0.0.1:FRONT/voice/``."""
        return f"http://127.0.0.1:{self.front}{PREFIX}/"

    @property
    def ws_base(self) -> str:
        return f"ws://127.0.0.1:{self.front}{PREFIX}/"


@pytest.fixture(scope="module")
def published(tiny_checkpoint_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Published]:
    haproxy = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").is_file() else None)
    if haproxy is None:
        pytest.skip("HAProxy is not installed (.ci/run installs Debian's haproxy)")
    folder = tmp_path_factory.mktemp("prefix")
    front = free_port()
    server = ServeProcess(
        "--checkpoint", tiny_checkpoint_dir, "--device", "cpu", "--port", "0", "--max-sessions", "2",
        "--text-prompt", "You are a helpful assistant.", "--db", ":memory:", "--asr", "sphinx", "--router", "none",
        "--test-hooks", "--max-queued-frames", "25", "--idle-timeout-s", "120",
        # the proxy forwards the browser's Host, 127.0.0.1 with the proxy's port: a loopback name, no credential
        "--allow-host", f"127.0.0.1:{front}",
        name="replica",
    )  # fmt: skip
    server.start()
    config = folder / "haproxy.cfg"
    log = folder / "haproxy.log"
    proxy: subprocess.Popen[bytes] | None = None
    try:
        assert server.port is not None
        config.write_text(haproxy_config(front, server.port))
        subprocess.run([haproxy, "-c", "-q", "-f", str(config)], check=True, timeout=30)
        with log.open("wb") as out:
            proxy = subprocess.Popen([haproxy, "-db", "-f", str(config)], stdout=out, stderr=subprocess.STDOUT)
        published = Published(server, front, log)
        server.wait_healthy()
        for _ in range(100):  # HAProxy listens within a moment of starting
            try:
                if httpx.get(published.base + "health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise AssertionError(f"no /health through the proxy\n{_diagnostics(published)}")
        yield published
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=30)
        server.kill()


def proxied_paths(log: Path) -> list[str]:
    """The paths (with their query) of the requests HAProxy logged, as the client sent them: before the prefix was
    stripped."""
    return re.findall(r'"[A-Z]+ (\S+) HTTP/', log.read_text())


def _diagnostics(published: Published) -> str:
    return f"replica log:\n{published.server.log[-4000:]}\nHAProxy log:\n{published.log.read_text()[-4000:]}"


@pytest.mark.browser
@pytest.mark.timeout(420)
def test_the_page_talks_under_a_path_prefix_behind_haproxy(
    published: Published, fixture_file, tmp_path: Path, repo_root: Path
) -> None:

    mic = fake_microphone(fixture_file("audio", "question_weather_24k.wav"), tmp_path / "mic.wav")
    origin = f"http://127.0.0.1:{published.front}"
    requests: list[str] = []
    sockets: list[str] = []
    with open_page(mic, origin) as (page, console):
        page.on("request", lambda r: requests.append(r.url))
        page.on("websocket", lambda ws: sockets.append(ws.url))
        hooks = json.dumps({"spans": [{"at": 2.0, "text": SPAN_TEXT}]})
        page.goto(published.base + "?" + urlencode({"codec": "opus", "test": hooks}))
        assert page.evaluate("window.isSecureContext") is True
        try:  # the voices come from info: the scripts ran and read it through the proxy
            page.locator("#voice option").nth(1).wait_for(state="attached", timeout=30_000)
        except Exception as exc:
            raise AssertionError(
                f"the page did not load: {console}; requests {requests}\n{_diagnostics(published)}"
            ) from exc
        assert page.input_value("#voice") == "tiny0"
        page.fill("#name", "Ada")

        page.click("#start")
        wait_for_conversation(page, SPAN_TEXT)  # ready, the user's transcript, the agent's words, the span
        assert page.inner_text("#thread .bubble.user.final .text").strip()
        artifacts = repo_root / "test-artifacts"
        artifacts.mkdir(exist_ok=True)
        page.screenshot(path=str(artifacts / "serve-page-prefix.png"), full_page=True)
        page.click("#stop")
        page.wait_for_selector("#downloads:not([hidden])", timeout=60_000)
        assert not page_errors(console), console

    assert sockets == [f"ws://127.0.0.1:{published.front}{PREFIX}/ws"], sockets
    # every request of the page stayed under the prefix: the page, its files and info (what Playwright reports), the
    # two worklets too (which it does not: HAProxy's log has them), and none went elsewhere
    paths = {urlsplit(u).path for u in requests if u.startswith("http")}
    files = ("style.css", "ogg-opus.js", "app.js")
    assert paths == {f"{PREFIX}/", f"{PREFIX}/info", *(f"{PREFIX}/static/{name}" for name in files)}, paths
    proxied = proxied_paths(published.log)
    for name in ("player-worklet.js", "mic-worklet.js"):
        assert f"{PREFIX}/static/{name}" in proxied, proxied
    assert all(path.startswith(PREFIX) for path in proxied), proxied
    assert "refused a request for Host" not in published.server.log, _diagnostics(published)


@pytest.mark.browser
@pytest.mark.timeout(180)
def test_the_page_names_its_own_address_with_a_token_under_a_path_prefix(published: Published, tmp_path: Path) -> None:
    """The notices of a server that wants a token (``info``'s ``token_required``) and of one that refused it (close
    4401) tell the reader to open this page's address with ``?token=``, under the prefix: ``/?token=`` would leave it.
    The replica needs no credential, so both answers are played by the browser's routes."""
    from playwright.sync_api import sync_playwright

    mic = tmp_path / "mic.wav"
    sf.write(mic, np.zeros(24000, dtype=np.float32), 24000, subtype="PCM_16")
    page_url = f"{published.base}?token=wrong-token-0123456789"
    expected = f"open the page as {published.base}?token=YOUR_TOKEN."

    def token_required(route: Any) -> None:
        answer = route.fetch()
        route.fulfill(response=answer, json={**answer.json(), "token_required": True})

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=chromium_args(mic))
        try:
            page = browser.new_context().new_page()
            page.route(f"**{PREFIX}/info", token_required)
            page.goto(published.base)
            page.wait_for_selector("#notice:not([hidden])", timeout=30_000)
            assert expected in page.inner_text("#notice"), page.inner_text("#notice")

            page = browser.new_context().new_page()
            page.route_web_socket(f"**{PREFIX}/ws", lambda ws: ws.close(code=4401, reason="unauthorized"))
            page.goto(page_url)
            page.locator("#voice option").nth(1).wait_for(state="attached", timeout=30_000)
            page.click("#start")
            wait_until(page, "document.getElementById('notice').textContent.includes('refused the token')", 30.0)
            assert expected in page.inner_text("#notice"), page.inner_text("#notice")
        finally:
            browser.close()


@pytest.mark.timeout(300)
async def test_protocols_and_redirects_under_a_path_prefix_behind_haproxy(published: Published) -> None:
    openai = pytest.importorskip("openai")
    base = published.base
    async with httpx.AsyncClient(timeout=10) as http:
        # the proxy sends /voice to /voice/ (the page's relative URLs need the slash), ?token= kept
        for asked, location in (
            (PREFIX, f"{PREFIX}/"),
            (f"{PREFIX}?token=abc&codec=pcm", f"{PREFIX}/?token=abc&codec=pcm"),
        ):
            moved = await http.get(f"http://127.0.0.1:{published.front}{asked}")
            assert (moved.status_code, moved.headers.get("location")) == (301, location), moved
        page = await http.get(base)
        assert page.status_code == 200 and 'src="static/app.js"' in page.text
        info = (await http.get(base + "info")).json()
        assert info["protocols"] == {"cspan": "/ws", "moshi": "/api/chat", "realtime": "/v1/realtime"}
        # no Location from the server: one built from what it sees would leave the prefix (http://HOST/info)
        for path in ("info/", "health/", "static/app.js/", "static/"):
            answer = await http.get(base + path)
            assert answer.status_code == 404 and "location" not in answer.headers, (path, answer.headers)

    # /ws: a conversation through the prefix
    async with websockets.connect(published.ws_base + "ws", max_size=None) as ws:
        client = Client(ws)
        ready = await client.start(test={"spans": [{"at": 0.5, "text": SPAN_TEXT}]})
        assert ready["type"] == "ready", ready
        await client.stream([np.zeros(1920, dtype=np.float32)] * 12)
        if not client.received.json("span"):
            await client.recv_until(lambda k, m: k == "json" and m["type"] == "span", timeout=60)
        assert client.received.json("span")[0]["text"] == SPAN_TEXT
        assert len(client.received.audio()) >= 8
        bye = await client.stop()
        assert bye["type"] == "bye"

    # /v1/realtime: the OpenAI SDK pointed at the prefix (base_url .../voice/v1), as an operator's client would be
    sdk = openai.AsyncOpenAI(api_key="unused-without-a-server-token", base_url=base + "v1")
    async with sdk.realtime.connect(model="cspan-tiny") as conn:

        async def until(kind: str, timeout: float = 60.0) -> dict[str, object]:
            while True:
                event = json.loads(await asyncio.wait_for(conn.recv_bytes(), timeout))
                if event["type"] == kind:
                    return event

        await until("session.created")
        await conn.session.update(
            session={
                "type": "realtime",
                "cspan": {"events": True, "test": {"spans": [[0.5, SPAN_TEXT]]}},  # type: ignore[typeddict-unknown-key]
            }
        )
        await until("session.updated")
        silence = base64.b64encode(np.zeros(4800, dtype="<i2").tobytes()).decode("ascii")  # 0.2 s
        for _ in range(10):
            await conn.input_audio_buffer.append(audio=silence)
        await until("cspan.ready")
        span = await until("cspan.span")
        assert span["text"] == SPAN_TEXT, span

    # /api/chat: the Moshi handshake (0x00), then the session's metadata (0x04)
    async with websockets.connect(published.ws_base + "api/chat", max_size=None) as ws:
        first = await asyncio.wait_for(ws.recv(), 60)
        assert first == b"\x00", first
        second = await asyncio.wait_for(ws.recv(), 30)
        assert isinstance(second, bytes) and second[0] == 4 and json.loads(second[1:])["type"] == "session"

    assert "refused a request for Host" not in published.server.log, _diagnostics(published)
