"""Issue 22 (F10-serve, F18): a bad ``--host`` or a busy ``--port`` is one line and exit status 2, found before the
model loads (the socket is bound first), not tracebacks or uvicorn's own message after minutes of loading."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cspan.server.serve import ListenError, bind_socket


def _serve(tiny_checkpoint_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cspan.core.cli", "serve", "--checkpoint", str(tiny_checkpoint_dir), "--device", "cpu"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("host", "expect"),
    [
        ("not..a..host", "not a valid host name"),
        ("nonexistent.invalid", "not an address or a host name that resolves here"),
        ("10.255.255.254", "not an address of this machine"),
        ("a b", "not an address or a host name that resolves here"),
    ],
)
def test_a_bad_host_is_refused_before_loading(host: str, expect: str) -> None:
    with pytest.raises(ListenError, match=expect) as err:
        bind_socket(host, 0)
    assert f"--host {host!r}" in str(err.value) and "\n" not in str(err.value)


def test_busy_port_and_bad_host_on_the_command_line(tiny_checkpoint_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _serve(tiny_checkpoint_dir, "--port", str(port))
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"cspan serve: error: --port {port}: address already in use on 127.0.0.1:{port} (another server?); stop it "
        "or pick another --port\n"
    )
    done = _serve(tiny_checkpoint_dir, "--host", "not..a..host", "--token", "abcdefgh12345")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("cspan serve: error: --host 'not..a..host': ") and "Traceback" not in done.stderr


def test_bound_socket_is_what_uvicorn_serves(tiny_checkpoint_dir: Path) -> None:
    """--port 0 still picks a free port and the server answers on it (the socket bound up front is the one used)."""
    from serve_process import ServeProcess

    server = ServeProcess("--checkpoint", str(tiny_checkpoint_dir), "--device", "cpu", "--port", "0").start()
    try:
        assert server.port and server.port > 0
        import httpx

        assert httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10).status_code == 200
    finally:
        server.kill()


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--allow-origin", "not-an-origin"),
        ("--allow-origin", "ftp://x.example"),
        ("--allow-origin", "https://x.example/path"),
        ("--allow-origin", "http://x:99999"),
        ("--allow-host", "a b/c"),
        ("--allow-host", "http://x.example"),
        ("--allow-host", "x.example:70000"),
        # a wildcard matched no Host (a browser never sends "*"), so every request was refused with 403
        ("--allow-host", "*.example.com"),
        ("--allow-origin", "https://*.example.com"),
    ],
)
def test_allow_origin_and_allow_host_values_are_checked(flag: str, value: str, capsys) -> None:
    """Issue 22 (F19): `--allow-origin not-an-origin` and `--allow-host 'a b/c'` were accepted and matched nothing."""
    from cspan.core.cli import main

    assert main(["serve", "--checkpoint", "none", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cspan serve: error: {flag} / ") and f"{value!r} is not a " in err and err.count("\n") == 1


def test_good_allow_values_pass() -> None:
    from cspan.server.auth import check_allow_host, check_allow_origin

    assert check_allow_origin("https://app.example.com/") == "https://app.example.com"
    assert check_allow_origin("http://[::1]:3000") == "http://[::1]:3000" and check_allow_origin("*") == "*"
    for host in ("app.example.com", "192.168.1.5:8080", "[::1]:8080", "*", "localhost"):
        assert check_allow_host(host) == host
