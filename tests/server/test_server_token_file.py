"""``--token-file`` on a real ``cspan serve`` (a subprocess, signalled as an operator does): SIGHUP reads the file
again. An invalid file keeps the entries in force; an entry removed ends its running conversation (``bye``
``revoked``, close 4401) while the others go on, and its token is refused from then on."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import pytest
import websockets
from serve_client import Client
from serve_process import ServeProcess, serve_args

KIOSK = 'user = "kiosk"\ntoken = "kiosk-token-0123456789"\n'
EVE = 'user = "eve"\ntoken = "eve-token-01234567890"\n'


async def _ready(server: ServeProcess, token: str) -> Client:
    ws = await websockets.connect(server.ws(), additional_headers={"Authorization": f"Bearer {token}"})
    client = Client(ws)
    assert (await client.start())["type"] == "ready"
    return client


def _wait_log(server: ServeProcess, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in server.log:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {text!r} in the log:\n{server.log}")
        time.sleep(0.05)


@pytest.mark.timeout(300)
async def test_sighup_reads_the_token_file_again(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f"[[token]]\n{KIOSK}\n[[token]]\n{EVE}")
    args = serve_args(tiny_checkpoint_dir, "--port", "0", "--max-sessions", "2", "--db", ":memory:")
    server = ServeProcess(*args, "--token-file", str(tokens), "--idle-timeout-s", "600").start()
    try:
        kiosk, eve = await _ready(server, "kiosk-token-0123456789"), await _ready(server, "eve-token-01234567890")
        tokens.write_text("[[token]\n")  # an invalid file: the entries in force stay
        server.signal(signal.SIGHUP)
        _wait_log(server, "token file not reloaded (the previous one stays in force)")
        assert "is not valid TOML" in server.log

        tokens.write_text(f"[[token]]\n{KIOSK}")  # eve's entry removed
        server.signal(signal.SIGHUP)
        _, bye = await eve.recv_until(lambda k, m: k == "json" and m["type"] == "bye", timeout=30)
        assert bye["reason"] == "revoked"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await eve.recv(timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
        with pytest.raises(websockets.ConnectionClosed) as refused:
            await _ready(server, "eve-token-01234567890")
        assert refused.value.rcvd is not None and refused.value.rcvd.code == 4401
        assert refused.value.rcvd.reason == "unauthorized: wrong token"
        await kiosk.send_json({"type": "stop"})  # kiosk's conversation went on: it ends as the client asks
        closed = await kiosk.until_closed(timeout=30)
        assert kiosk.received.json("bye")[0]["reason"] == "stop" and closed.rcvd.code == 1000
        assert server.proc is not None and server.proc.poll() is None  # SIGHUP never stops the server
    finally:
        print(server.log)  # shown when the test fails
        server.kill()


def test_sighup_without_a_token_file_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """A SIGHUP to a server without --token-file logged "token file reloaded", as if one had been read."""
    from cspan.server.auth import CredentialAuthenticator

    with caplog.at_level(logging.INFO, logger="cspan.server.auth"):
        CredentialAuthenticator(None, token="a-shared-token").reload()
    assert [r.getMessage() for r in caplog.records] == [
        "SIGHUP: no --token-file to read again (issued tokens take effect without a signal)"
    ]


@pytest.mark.timeout(300)
async def test_a_token_file_of_plain_tokens_that_others_can_read_is_warned_about(
    tiny_checkpoint_dir: Path, open_tmp_path: Path
) -> None:
    """A token file holding plain tokens (``token = "..."``) that other users can read lets them connect as its users;
    it was read without a word, while a settings file holding a credential is warned about. The warning names the
    entries and the fix; a private file, or one of ``sha256`` entries only, is not warned about (nor one in a folder
    other users cannot enter: ``test_backends_identity``)."""
    from cspan.backends.identity import hash_token, load_token_file

    tokens = open_tmp_path / "tokens.toml"
    tokens.write_text(f'[[token]]\nuser = "ops"\nsha256 = "{hash_token("ops-token-0123456789")}"\n[[token]]\n{KIOSK}')
    tokens.chmod(0o644)
    args = serve_args(tiny_checkpoint_dir, "--port", "0", "--db", ":memory:", "--token-file", str(tokens))
    server = ServeProcess(*args).start()
    try:
        kiosk = await _ready(server, "kiosk-token-0123456789")
        await kiosk.ws.close()
        assert (
            f"token file {tokens} holds plain tokens ([[token]] #2) and can be read by other users (mode 644)"
            in server.log
        )
        assert f"chmod 600 {tokens}" in server.log
    finally:
        print(server.log)  # shown when the test fails
        server.kill()

    def warnings(text: str, mode: int) -> list[str]:
        tokens.write_text(text)
        tokens.chmod(mode)
        logger = logging.getLogger("cspan.backends.identity")
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logger.addHandler(handler)
        try:
            load_token_file(tokens)
        finally:
            logger.removeHandler(handler)
        return [r.getMessage() for r in records if r.levelno == logging.WARNING]

    assert warnings(f"[[token]]\n{KIOSK}", 0o600) == []
    assert warnings(f'[[token]]\nuser = "ops"\nsha256 = "{hash_token("ops-token-0123456789")}"\n', 0o644) == []
    assert len(warnings(f"[[token]]\n{KIOSK}", 0o604)) == 1
