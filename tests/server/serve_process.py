"""``cspan serve`` as a real subprocess for the operator tests (persistence, TLS, replicas): started with the
command line an operator types, its log collected, stopped with a signal."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def sigint_default() -> None:
    """``preexec_fn`` of a child the test may stop with SIGINT: SIGINT back to its default before exec, so Python
    turns it into KeyboardInterrupt (exit 130) even when the test runner was started with SIGINT ignored (a
    background job of a non-interactive shell passes SIG_IGN down, and Python then installs no handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """``python -m cspan.core.cli serve ARGS`` with its output collected (``log``); ``port`` is read from uvicorn's
    "running on" line (so ``--port 0`` works)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, name: str = "serve") -> None:
        self.args = [str(a) for a in args]
        self.env = {**os.environ, **(env or {})}
        self.name = name
        self.lines: list[str] = []
        self.port: int | None = None
        self.scheme = "http"
        self._found = threading.Event()
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self, timeout: float = 240.0) -> ServeProcess:
        cmd = [sys.executable, "-m", "cspan.core.cli", "serve", *self.args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env, preexec_fn=sigint_default
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._found.wait(timeout) or self.port is None:
            self.kill()
            raise RuntimeError(f"{self.name} did not start:\n{self.log}")
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"running on (https?)://[^:]+:(\d+)", line)
            if m:
                self.scheme, self.port = m.group(1), int(m.group(2))
                self._found.set()
        self._found.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def ws(self, path: str = "/ws") -> str:
        return f"{'wss' if self.scheme == 'https' else 'ws'}://127.0.0.1:{self.port}{path}"

    def wait_healthy(self, timeout: float = 60.0, **httpx_kwargs: object) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2.0, **httpx_kwargs).status_code == 200:  # type: ignore[arg-type]
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not healthy:\n{self.log}")
            time.sleep(0.1)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL, after asking a server that is still running for every thread's stack (SIGUSR1, into :attr:`log`):
        a server that had to be killed shows where it was stuck."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.send_signal(signal.SIGUSR1)
                self.proc.wait(timeout=2.0)  # the dump is written in the signal handler; the server goes on
            self.proc.kill()
            self.proc.wait(timeout=30)
            if self._reader is not None:
                self._reader.join(timeout=5.0)  # the rest of its output (the stacks) into the log


def serve_args(checkpoint: Path, *extra: str) -> list[str]:
    """The lean set-up of these tests: the tiny checkpoint on the CPU, one slot, a short persona."""
    return [
        "--checkpoint", str(checkpoint), "--device", "cpu", "--max-sessions", "1",
        "--text-prompt", "You are a helpful assistant.", *extra,
    ]  # fmt: skip
