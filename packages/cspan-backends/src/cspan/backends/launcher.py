"""``cspan backends start|status|stop|env``: run the router LLM and the ASR server the released system used.

The published setup (Context Spanning ``scripts/backends.sh`` and ``benchmark/PROTOCOL.md``, summarised in
``docs/BACKENDS.md``): the router is Gemma-4-26B-A4B-it served by vLLM's OpenAI-compatible server on port 8004
(the router asks for JSON at temperature 0 per request); the ASR is Qwen3-ASR-1.7B served by ``qwen-asr-serve``
(vLLM, OpenAI audio API) on port 8990 with ``--gpu-memory-utilization 0.12 --max-model-len 4096 --max-num-seqs 64
--served-model-name qwen3-asr``, or ``cspan asr-serve`` with the transformers or the embedded sphinx engine.

Each server runs as a detached process (its own session, so it outlives the command) with its GPU pinned through
``CUDA_VISIBLE_DEVICES``, logs to a file, and is recorded in a JSON state file. ``start`` waits until every health
endpoint answers and fails with the tail of a server's log if it dies or the timeout passes. ``stop`` ends only
the processes this state file recorded, after checking that the PID still runs the recorded command.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import string
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

from cspan.backends.errors import BackendError
from cspan.backends.urls import redact_url

ROUTER_MODEL = "google/gemma-4-26B-A4B-it"
ASR_MODEL = "Qwen/Qwen3-ASR-1.7B"
ASR_SERVED_NAME = "qwen3-asr"
ROUTER_PORT = 8004
ASR_PORT = 8990


class LauncherError(BackendError):
    """A backend server could not be started, checked or stopped (names the server and the fix)."""


@dataclass
class ServerSpec:
    """One server to run: its name, command line, environment additions, health URL and client URL."""

    name: str
    command: list[str]
    env: dict[str, str]
    health_url: str
    url: str
    model: str | None = None
    managed: bool = True  # False: an external server we only check


@dataclass
class ServerRecord:
    """A started server as recorded in the state file."""

    name: str
    pid: int | None
    command: list[str]
    log: str | None
    health_url: str
    url: str
    model: str | None
    started_at: float
    managed: bool = True
    env: dict[str, str] = field(default_factory=dict)


def state_dir() -> Path:
    """``$CSPAN_STATE_DIR``, else ``$XDG_STATE_HOME/cspan``, else ``~/.local/state/cspan``."""
    if os.environ.get("CSPAN_STATE_DIR"):
        return Path(os.environ["CSPAN_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "cspan"


def state_file() -> Path:
    return state_dir() / "backends.json"


def _cspan() -> list[str]:
    """The ``cspan`` command of this interpreter (the console script ships with cspan-core)."""
    return [sys.executable, "-m", "cspan.core.cli"]


def router_spec(
    *,
    model: str | None = None,
    gpu: str | None = "1",
    port: int = ROUTER_PORT,
    host: str = "127.0.0.1",
    url: str | None = None,
    command: str | None = None,
    gpu_memory_utilization: float = 0.62,
    max_model_len: int = 8192,
) -> ServerSpec:
    """The router server: vLLM serving ``model`` (default :data:`ROUTER_MODEL`, the released settings), a custom
    ``command`` (``{port}``/``{host}``/``{model}`` substituted, ``{model}`` by ``model`` or :data:`ROUTER_MODEL`),
    or an external ``url`` that is only health-checked.

    The spec's ``model`` (recorded, and exported by :func:`env_lines` as ``CSPAN_ROUTER_MODEL``) is the model the
    router is known to serve, else None: vLLM's; a command's when it was given one (``{model}`` in it, or ``model``
    named); an external server's only when ``model`` is named (the default would mean nothing there).

    Raises:
        LauncherError: ``command`` is empty, has an unclosed quote, or a brace that is not one of the three fields.
    """
    if url:
        parts = urlsplit(url)  # a query (?api-version=...) stays at the end of each URL
        path = parts.path.rstrip("/")
        for end in ("/chat/completions", "/v1"):  # the base, whichever of the three forms chat_url takes is given
            path = path[: -len(end)] if path.endswith(end) else path
        models, v1 = (urlunsplit(parts._replace(path=f"{path}/v1{end}")) for end in ("/models", ""))
        return ServerSpec("router", [], {}, models, v1, model, managed=False)
    served = model or ROUTER_MODEL
    if command is not None:
        try:
            words = shlex.split(command)
            cmd = [word.format(port=port, host=host, model=served) for word in words]
            # the fields the command names (parsed only once format accepted them all)
            fields = {name for word in words for _, name, _, _ in string.Formatter().parse(word) if name}
        except (ValueError, LookupError, AttributeError) as exc:  # an open quote or brace, {name}, {0}, {port.x}
            raise LauncherError(
                f"router: --router-command {command!r}: {type(exc).__name__}: {exc}; only {{port}}, {{host}} and "
                "{model} are substituted (write a literal brace as {{ or }})"
            ) from None
        if not cmd:
            raise LauncherError("router: --router-command is empty; give the command line of the router server")
        if model is None and "model" not in fields:  # a command not told which model: its model is unknown
            served = None
    else:
        cmd = [
            "vllm", "serve", served,
            "--host", host,
            "--port", str(port),
            "--gpu-memory-utilization", str(gpu_memory_utilization),
            "--max-model-len", str(max_model_len),
            "--enable-prefix-caching",
        ]  # fmt: skip
    env = {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}
    base = f"http://{host}:{port}"
    return ServerSpec("router", cmd, env, f"{base}/v1/models", f"{base}/v1", served)


def asr_spec(
    *,
    engine: str = "vllm",
    model: str | None = None,
    gpu: str | None = "0",
    port: int = ASR_PORT,
    host: str = "127.0.0.1",
    insecure_no_token: bool = False,
) -> ServerSpec:
    """The ASR server for ``engine``: ``vllm`` (``qwen-asr-serve``, released settings), ``transformers`` or
    ``sphinx`` (``cspan asr-serve``, given ``--insecure-no-token`` when ``insecure_no_token``: the operator allowed a
    non-loopback ``host`` without authentication)."""
    base = f"http://{host}:{port}"
    insecure = ["--insecure-no-token"] if insecure_no_token else []
    env = {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None and engine != "sphinx" else {}
    if engine == "vllm":
        model = model or ASR_MODEL
        cmd = [
            "qwen-asr-serve", model,
            "--host", host,
            "--port", str(port),
            "--gpu-memory-utilization", "0.12",
            "--max-model-len", "4096",
            "--max-num-seqs", "64",
            "--served-model-name", ASR_SERVED_NAME,
        ]  # fmt: skip
        return ServerSpec("asr", cmd, env, f"{base}/health", f"{base}/v1", ASR_SERVED_NAME)
    if engine == "transformers":
        if not model:
            raise LauncherError("asr: --asr-engine transformers needs --asr-model PATH (a local model directory)")
        cmd = [*_cspan(), "asr-serve", "--engine", "transformers", "--model", model, "--host", host]
        cmd += ["--port", str(port), *insecure]
        return ServerSpec("asr", cmd, env, f"{base}/health", f"{base}/v1", model)
    if engine == "sphinx":
        cmd = [*_cspan(), "asr-serve", "--engine", "sphinx", "--host", host, "--port", str(port), *insecure]
        return ServerSpec("asr", cmd, env, f"{base}/health", f"{base}/v1", "sphinx")
    raise LauncherError(f"asr: unknown engine {engine!r}; use vllm, transformers or sphinx")


def check_requirements(specs: list[ServerSpec]) -> None:
    """Fail early, with the fix, when an executable or the GPU a spec needs is missing.

    Raises:
        LauncherError: naming the missing executable, the extra to install and the embedded alternatives.
    """
    hints = {
        "vllm": "pip install 'cspan-backends[vllm]' (or use the embedded router: --router local in infer/serve)",
        "qwen-asr-serve": "pip install 'cspan-backends[vllm]' (or --asr-engine sphinx, the embedded transcriber)",
    }
    for spec in specs:
        if not spec.managed or not spec.command:
            continue
        exe = spec.command[0]
        if exe in hints and shutil.which(exe) is None:
            raise LauncherError(f"{spec.name}: the executable {exe!r} is not installed: {hints[exe]}")
        if exe in hints and shutil.which("nvidia-smi") is None and not os.environ.get("CSPAN_ASSUME_GPU"):
            raise LauncherError(
                f"{spec.name}: {exe} needs an NVIDIA GPU and none was found (no nvidia-smi); use the embedded "
                "alternatives: --asr-engine sphinx, and --router local in cspan infer/serve"
            )


def _log_tail(path: str | None, lines: int = 30) -> str:
    if not path or not Path(path).exists():
        return "(no log)"
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(log is empty)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as dead
        waited, _ = os.waitpid(pid, os.WNOHANG)
        return waited == 0
    except ChildProcessError:
        return True


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [p.decode(errors="replace") for p in raw.split(b"\0") if p]


def _same_process(record: ServerRecord) -> bool:
    """Whether ``record.pid`` still runs the recorded command (guards against a reused PID)."""
    if record.pid is None or not _alive(record.pid):
        return False
    cmd = _cmdline(record.pid)
    if cmd is None:  # no /proc: trust the PID
        return True
    if not record.command:
        return False
    # The recorded command may be a script that runs under an interpreter ("vllm" -> "python .../vllm"):
    # its arguments must end the live command line and its program name must appear before them.
    tail = record.command[1:]
    head = cmd[: len(cmd) - len(tail)]
    program = Path(record.command[0]).name
    return cmd[len(cmd) - len(tail) :] == tail and any(Path(c).name == program for c in head)


EXTERNAL_CHECK_S = 10.0
"""How long ``start`` gives an external server (``--router-url``) to pass its health check."""


def _answers_soon(url: str, within_s: float) -> bool:
    """Whether ``url`` passes :func:`healthy` within ``within_s`` seconds (asked every half second)."""
    deadline = time.monotonic() + within_s
    while True:
        if healthy(url, timeout_s=min(2.0, within_s)):
            return True
        if time.monotonic() + 0.5 > deadline:
            return False
        time.sleep(0.5)


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``url`` answers HTTP 2xx."""
    try:
        r = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return r.is_success


def load_state() -> list[ServerRecord]:
    path = state_file()
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        return [ServerRecord(**r) for r in data.get("servers", [])]
    except (OSError, ValueError, TypeError) as exc:
        raise LauncherError(f"{path}: unreadable state file ({exc}); delete it if no server is running") from exc


def save_state(records: list[ServerRecord]) -> None:
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.part")
    tmp.write_text(json.dumps({"servers": [asdict(r) for r in records]}, indent=2))
    os.replace(tmp, path)


def format_command(spec: ServerSpec) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.env.items())
    cmd = shlex.join(spec.command)
    return f"{env} {cmd}".strip()


def start(
    specs: list[ServerSpec],
    *,
    log_dir: Path,
    timeout_s: float = 900.0,
    progress: bool = True,
) -> list[ServerRecord]:
    """Start every managed spec detached, wait for all health checks, record them; return the records.

    Raises:
        LauncherError: a server is already recorded as running, exits during start-up (with its log tail), or is
            not healthy within ``timeout_s`` (with its log tail). Servers started by this call are stopped again.
    """
    existing = [r for r in load_state() if r.managed and _same_process(r)]
    clash = {r.name for r in existing} & {s.name for s in specs}
    if clash:
        raise LauncherError(f"already running: {', '.join(sorted(clash))}; run `cspan backends stop` first")
    if not specs:
        raise LauncherError("nothing to start: every server is turned off (--no-asr, --no-router)")
    check_requirements(specs)
    for spec in specs:  # an external server is there already, or it is a mistake: no wait, nothing recorded
        if not spec.managed and not _answers_soon(spec.health_url, EXTERNAL_CHECK_S):
            raise LauncherError(
                f"{spec.name}: nothing healthy answers {redact_url(spec.health_url)} within {EXTERNAL_CHECK_S:g} s "
                f"(an external --{spec.name}-url is only checked, not started); start that server first or fix the URL"
            )
    for spec in specs:
        if spec.managed and healthy(spec.health_url, timeout_s=1.0):
            raise LauncherError(
                f"{spec.name}: something already answers {spec.health_url}; stop it or choose another port "
                f"(--{spec.name}-port)"
            )
    log_dir.mkdir(parents=True, exist_ok=True)
    records: list[ServerRecord] = []
    for spec in specs:
        if not spec.managed:
            records.append(
                ServerRecord(spec.name, None, [], None, spec.health_url, spec.url, spec.model, time.time(), False)
            )
            continue
        log = log_dir / f"{spec.name}.log"
        env = {**os.environ, **spec.env}
        with open(log, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {format_command(spec)}\n".encode())
            out.flush()
            try:
                proc = subprocess.Popen(
                    spec.command,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
            except OSError as exc:
                stop(records)
                raise LauncherError(f"{spec.name}: cannot run {spec.command[0]!r}: {exc}") from exc
        records.append(
            ServerRecord(
                spec.name, proc.pid, spec.command, str(log), spec.health_url, spec.url, spec.model, time.time(),
                True, spec.env,
            )
        )  # fmt: skip
    save_state([*existing, *records])
    deadline = time.monotonic() + timeout_s
    pending = {r.name: r for r in records}
    t0 = time.monotonic()
    while pending:
        for name, rec in list(pending.items()):
            if rec.managed and rec.pid is not None and not _alive(rec.pid):
                stop(records)
                save_state(existing)
                raise LauncherError(f"{name}: exited during start-up; last lines of {rec.log}:\n{_log_tail(rec.log)}")
            if healthy(rec.health_url):
                del pending[name]
        if not pending:
            break
        if time.monotonic() > deadline:
            if progress:
                print(file=sys.stderr)  # end the progress line before the error
            names = ", ".join(sorted(pending))
            tails = "\n".join(f"--- {r.name} ({r.log}):\n{_log_tail(r.log)}" for r in pending.values())
            stop(records)
            save_state(existing)
            raise LauncherError(f"not healthy after {timeout_s:.0f} s: {names}\n{tails}")
        if progress:
            waited = time.monotonic() - t0
            print(f"\rwaiting for {', '.join(sorted(pending))} ... {waited:5.0f} s", end="", file=sys.stderr)
        time.sleep(0.5)
    if progress:
        print(f"\rall healthy after {time.monotonic() - t0:.1f} s" + " " * 20, file=sys.stderr)
    return records


def stop(records: list[ServerRecord] | None = None, *, timeout_s: float = 20.0) -> list[str]:
    """Stop the recorded managed servers (SIGTERM to their process group, then SIGKILL); return their names.

    Only processes whose PID still runs the recorded command are signalled. With ``records`` None, the state
    file's servers are stopped and the state file is removed.
    """
    from_state = records is None
    records = load_state() if records is None else records
    stopped: list[str] = []
    targets = [r for r in records if r.managed and r.pid is not None and _same_process(r)]
    for r in targets:
        try:
            os.killpg(r.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(r.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    for r in targets:
        while _alive(r.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(r.pid):
            try:
                os.killpg(r.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        stopped.append(r.name)
    if from_state:
        state_file().unlink(missing_ok=True)
    return stopped


def status() -> list[dict[str, object]]:
    """One row per recorded server: name, pid, running, healthy, url, log."""
    rows = []
    for r in load_state():
        running = _same_process(r) if r.managed else None
        rows.append(
            {
                "name": r.name,
                "pid": r.pid,
                "running": running,
                "healthy": healthy(r.health_url),
                "url": r.url,
                "model": r.model,
                "log": r.log,
            }
        )
    return rows


def not_running() -> list[str]:
    """The names of recorded servers this launcher started whose process is gone (no health check: quick)."""
    return [r.name for r in load_state() if r.managed and not _same_process(r)]


def env_lines() -> list[str]:
    """``export`` lines telling ``cspan infer`` / ``cspan serve`` where the recorded servers are: each server's URL,
    and its model only where one was recorded (a router started by ``--router-command`` without ``{model}`` or
    ``--router-model``, or an external ``--router-url`` without ``--router-model``, has none: no
    ``CSPAN_ROUTER_MODEL`` line, so a value already in the shell stays)."""
    out = []
    for r in load_state():
        if r.name == "router":
            out.append(f"export CSPAN_ROUTER_URL={shlex.quote(r.url)}")
            if r.model:
                out.append(f"export CSPAN_ROUTER_MODEL={shlex.quote(r.model)}")
        elif r.name == "asr":
            out.append(f"export CSPAN_ASR_URL={shlex.quote(r.url)}")
            if r.model and r.model not in ("sphinx",):
                out.append(f"export CSPAN_ASR_MODEL={shlex.quote(r.model)}")
    return out
