"""A throw-away PostgreSQL server for tests: Debian's ``postgresql`` binaries, ``initdb`` into a temporary folder.

``PostgresServer.start()`` finds ``initdb``/``pg_ctl`` (``PATH``, then ``pg_config --bindir``, then
``/usr/lib/postgresql/*/bin``), initialises a cluster with trust authentication for the user ``cspan``, and starts
it on a free 127.0.0.1 port with its unix socket in the data folder and ``fsync`` off (tests need no durability
across power cuts). PostgreSQL refuses to run as root: as root, the server runs as the ``postgres`` system user that
Debian's package creates (else ``nobody``), through :class:`subprocess.Popen`'s ``user``/``group`` arguments, in a
folder under ``/tmp`` that user owns. ``url`` is ready for :class:`~cspan.backends.context_db.ContextDB`.
``stop_server``/``start_server`` take it away and back as an administrator would; ``freeze``/``thaw`` (SIGSTOP and
SIGCONT to its processes) make it a server that stops answering without closing its connections, as a hung host.

Other test folders can use it too: ``sys.path.insert(0, str(REPO / "tests" / "backends"))``, then
``from postgres_server import PostgresServer, postgres_binaries``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


def postgres_binaries() -> Path | None:
    """The folder holding ``initdb`` and ``pg_ctl``, or None when PostgreSQL is not installed."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False)
        folder = Path(out.stdout.strip())
        if (folder / "initdb").is_file():
            return folder
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(folder, "initdb").is_file() and Path(folder, "pg_ctl").is_file():
            return Path(folder)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """One PostgreSQL cluster in a temporary folder (see the module docstring)."""

    def __init__(self, user: str = "cspan", database: str = "cspan") -> None:
        self.bin = postgres_binaries()
        self.user = user
        self.database = database
        self.port = 0
        self.root: Path | None = None
        self._run_as: dict[str, object] = {}

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.database}"

    def _run(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        assert self.bin is not None
        cmd = [str(self.bin / args[0]), *args[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **self._run_as)  # type: ignore[call-overload]
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def start(self) -> PostgresServer:
        if self.bin is None:
            raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
        self.root = Path(tempfile.mkdtemp(prefix="cspan-pg-"))
        if os.geteuid() == 0:
            try:
                account = pwd.getpwnam("postgres")
            except KeyError:
                account = pwd.getpwnam("nobody")
            os.chown(self.root, account.pw_uid, account.pw_gid)
            self._run_as = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": [], "cwd": self.root}
        data = self.root / "data"
        self._run("initdb", "-D", str(data), "-U", self.user, "--auth=trust", "-E", "UTF8", "--no-sync")
        self.port = _free_port()
        self.start_server()
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, self.database)
        return self

    def start_server(self) -> None:
        """Start the cluster's server (again, after :meth:`stop_server`: the same port and data)."""
        assert self.root is not None
        data = self.root / "data"
        options = f"-p {self.port} -k {data} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off"
        self._run(
            "pg_ctl", "-D", str(data), "-o", options, "-l", str(self.root / "server.log"), "-w", "-t", "60", "start"
        )

    def stop_server(self) -> None:
        """Stop the server as an administrator would (``pg_ctl stop -m fast``: open connections are ended), keeping
        its data for :meth:`start_server`."""
        assert self.root is not None
        self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "fast", "-w", "-t", "60", "stop")

    def restart(self) -> None:
        """:meth:`stop_server`, then :meth:`start_server`."""
        self.stop_server()
        self.start_server()

    def processes(self) -> list[int]:
        """The server's processes (Linux): the postmaster (``postmaster.pid``), then its children (from ``/proc``)."""
        assert self.root is not None
        postmaster = int((self.root / "data" / "postmaster.pid").read_text().split()[0])
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # ended while it was read
            if ppid == postmaster:
                children.append(int(stat.parent.name))
        return [postmaster, *children]

    def freeze(self) -> None:
        """Freeze the server as a hung host would (SIGSTOP to every process of it): its connections stay open, the
        kernel still acknowledges, nothing answers. :meth:`thaw` lets it go on."""
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT to every process of the server (after :meth:`freeze`)."""
        self._signal(signal.SIGCONT)

    def _signal(self, signum: int) -> None:
        """``signum`` to every process of the server; one that ended since it was listed (a backend whose client
        closed) is passed over."""
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def stop(self) -> None:
        if self.root is None:
            return
        try:
            self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop")
        except RuntimeError:
            pass
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


def running_postgres() -> Iterator[PostgresServer]:
    """The body of a test module's ``postgres`` fixture: a started server (stopped after the module), or the
    module's tests skipped where PostgreSQL is not installed (``.ci/run`` installs Debian's ``postgresql``)."""
    import pytest

    if postgres_binaries() is None:
        pytest.skip("PostgreSQL is not installed (.ci/run installs Debian's postgresql)")
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.stop()
