"""The ``cspan serve`` command: bind-address and token checks, and a real run as a subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import websockets
from serve_process import sigint_default

TOKEN = "cli-token-abcdef123"


def cspan(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_non_loopback_bind_without_token_is_refused() -> None:
    proc = cspan("serve", "--host", "0.0.0.0", "--checkpoint", "/nonexistent", "--db", ":memory:")
    assert proc.returncode == 2  # a bad setting, as every other refused start
    assert "refusing to serve on '0.0.0.0' without a token" in proc.stderr
    assert "--insecure-no-token" in proc.stderr


def test_weak_token_is_refused() -> None:
    proc = cspan("serve", "--token", "abc", "--checkpoint", "/nonexistent")
    assert proc.returncode == 2
    assert "--token" in proc.stderr and "8 to 256 characters" in proc.stderr
    proc = cspan("serve", "--checkpoint", "/nonexistent", env={"CSPAN_TOKEN": "has space in it"})
    assert proc.returncode == 2 and "CSPAN_TOKEN" in proc.stderr and "8 to 256 characters" in proc.stderr


def test_a_voice_that_cannot_be_had_is_a_bad_setting(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    """``--voice``: a file that is not there (refused before the model loads) or a name the checkpoint lacks (once
    it has loaded) is exit status 2 with one line naming the flag, as for ``cspan infer``."""
    base = ["serve", "--checkpoint", str(tiny_checkpoint_dir), "--port", "0", "--asr", "none", "--router", "none",
            "--db", str(tmp_path / "db.sqlite"), "--device", "cpu"]  # fmt: skip
    missing = tmp_path / "missing.wav"
    proc = cspan(*base, "--voice", str(missing))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        f"cspan serve: error: --voice {missing}: no such file; pass a voice name, a .pt voice file, or a 2-30 s "
        "recording\n"
    )
    proc = cspan(*base, "--voice", "nosuchvoice")
    assert proc.returncode == 2, proc.stderr
    assert re.search(r"^cspan serve: error: --voice nosuchvoice: .*not a known voice \(known voices: tiny0, tiny1\)",
                     proc.stderr, re.M), proc.stderr  # fmt: skip
    assert "Traceback" not in proc.stderr


def test_a_default_persona_with_no_room_to_talk_is_a_bad_setting(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    """A ``--voice`` (or ``--text-prompt``) whose persona takes more than half the attention window is refused at
    start, as ``cspan infer`` refuses it: ``serve`` started, and every conversation with its default voice failed
    (``persona_failed``, a traceback in the log)."""
    import torch

    base = ["serve", "--checkpoint", str(tiny_checkpoint_dir), "--port", "0", "--asr", "none", "--router", "none",
            "--db", ":memory:", "--device", "cpu"]  # fmt: skip
    voice = tmp_path / "long.pt"
    torch.save({"codes": torch.zeros(8, 2000, dtype=torch.long)}, voice)  # 160 s of codes
    proc = cspan(*base, "--voice", str(voice), "--text-prompt", "You are kind.")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"cspan serve: error: --voice {voice}: the persona takes "), proc.stderr
    assert "2000 of voice prompt" in proc.stderr and "at most 1500 leave room to talk" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_help_lists_the_flags_but_not_the_test_hooks() -> None:
    proc = cspan("serve", "--help")
    assert proc.returncode == 0
    for flag in ("--checkpoint", "--voice", "--text-prompt", "--host", "--port", "--token", "--max-sessions",
                 "--asr", "--router", "--knowledge", "--db", "--idle-timeout-s", "--insecure-no-token"):  # fmt: skip
        assert flag in proc.stdout, flag
    assert "--test-hooks" not in proc.stdout


@pytest.mark.timeout(300)
async def test_serve_subprocess(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    """``cspan serve`` as operators run it: starts, serves the page and a session with the token, keeps the token
    out of its logs (however its key is spelled), says bye to a live session on SIGINT and shuts down cleanly."""
    cmd = [sys.executable, "-m", "cspan.core.cli", "serve", "--checkpoint", str(tiny_checkpoint_dir),
           "--port", "0", "--asr", "none", "--router", "none", "--max-sessions", "1",
           "--db", str(tmp_path / "db.sqlite"), "--device", "cpu"]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "CSPAN_TOKEN": TOKEN},
        preexec_fn=sigint_default,
    )
    lines: list[str] = []
    port: list[int] = []
    found = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"running on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port.append(int(m.group(1)))
                found.set()
        found.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert found.wait(timeout=240) and port, "".join(lines)
        base = f"http://127.0.0.1:{port[0]}"
        async with httpx.AsyncClient(base_url=base) as http:
            health = (await http.get("/health")).json()
            assert health["status"] == "ok" and health["free_slots"] == 1
            assert health["model"] == tiny_checkpoint_dir.name  # not the folders above it: the server's file system
            assert (await http.get("/info")).json()["token_required"] is True
            assert "Context Spanning" in (await http.get("/")).text
            for query in (f"tok%65n={TOKEN}", f"x=1&%74oken={TOKEN}"):  # keys the server decodes to "token"
                assert (await http.get(f"/metrics?{query}")).status_code == 200
        async with websockets.connect(f"ws://127.0.0.1:{port[0]}/ws?token={TOKEN}") as ws:
            await ws.send(json.dumps({"type": "start"}))
            ready = json.loads(await ws.recv())
            assert ready["type"] == "ready"
            proc.send_signal(signal.SIGINT)
            last = None
            async for message in ws:
                if isinstance(message, str):
                    last = json.loads(message)
            assert last is not None and last["type"] == "bye" and last["reason"] == "shutdown"
        assert proc.wait(timeout=60) == 130  # uvicorn re-raises the SIGINT after its clean shutdown (128 + 2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
    log = "".join(lines)
    assert "/ws?token=***" in log  # the access log line is there, redacted
    assert "/metrics?tok%65n=***" in log and "/metrics?x=1&%74oken=***" in log  # so are percent-encoded keys
    assert TOKEN not in log
    assert "Traceback" not in log and "Application shutdown complete" in log


def test_a_refused_token_is_not_echoed() -> None:
    """A ``--token`` (or ``CSPAN_TOKEN``) that is refused is not repeated in the error: it is a credential, and the
    error goes to a terminal, a log or a CI page."""
    from cspan.core.cli import build_parser
    from cspan.core.settings import SettingsError, settings_from_args

    for token in ("short", "has spaces in it", "x" * 257, "ünïcode-token"):
        with pytest.raises(SettingsError, match="--token / CSPAN_TOKEN: must be 8 to 256 characters") as err:
            settings_from_args(build_parser().parse_args(["serve", "--token", token]))
        assert token not in str(err.value)
    assert settings_from_args(build_parser().parse_args(["serve", "--token", "A.b_c~d-e0"])).token == "A.b_c~d-e0"


_LOADING_FOREVER = """
import os, sys, threading
import cspan.server.serve as serve

fired = []

def signal_at(moment):  # the process signals itself once, at that moment (no timing to race)
    if os.environ.get("SIGNAL_AT") == moment and not fired:
        fired.append(moment)
        os.kill(os.getpid(), int(os.environ["SIGNAL"]))

def create_app(settings):  # the model loading, here never finishing (the check is the main thread's)
    signal_at("loader-start")  # lands while the main thread is still starting this thread
    print("loading", flush=True)
    threading.Event().wait()

def bind_socket(*args):
    signal_at("bind")
    return bind(*args)

async def prepare(hub):  # the backends built on the server's loop, after the model loaded
    signal_at("backends")
    return await build(hub)

bind, serve.bind_socket = serve.bind_socket, bind_socket
build, serve.SessionHub.prepare = serve.SessionHub.prepare, prepare
if os.environ["SIGNAL_AT"] != "backends":
    serve.create_app = create_app
from cspan.core.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("moment", ["loading", "loader-start", "bind", "backends"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_before_serving_ends_at_once_with_the_stop_status(
    tiny_checkpoint_dir: Path, sig: signal.Signals, moment: str
) -> None:
    """A supervisor stopping ``cspan serve`` while its model loads: the process ended under the loading thread,
    inside torch, and its C++ runtime aborted it (status 134, "terminate called without an active exception"); a
    signal that interrupted waiting for that thread also marked it as ended (Python's join). Now it ends at once, as
    after an orderly shutdown: status 0 after SIGTERM, 130 after Ctrl-C, one line saying why; so does a signal that
    lands before the main thread has returned from starting the loader (CI's machine: 143, "terminated by signal
    15"), or before the loading (binding the port). Once the model is loaded, while the backends are built, it shuts
    down in order (it printed nothing after SIGTERM, and a traceback after SIGINT)."""
    args = ["serve", "--checkpoint", str(tiny_checkpoint_dir), "--device", "cpu", "--port", "0", "--db", ":memory:"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOADING_FOREVER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SIGNAL_AT": moment, "SIGNAL": str(int(sig))},
        preexec_fn=sigint_default,
    )
    try:
        if moment == "loading":
            assert proc.stdout is not None and proc.stdout.readline() == "loading\n"
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == (0 if sig == signal.SIGTERM else 130), err
    if moment == "bind":
        said = "stopped on SIGTERM before serving" if sig == signal.SIGTERM else "cspan serve: interrupted"
    elif moment == "backends":
        said = "Finished server process" if sig == signal.SIGTERM else "cspan serve: interrupted"
    else:
        said = f"stopped on {sig.name} while the model was loading"
    assert said in err and "Traceback" not in err
