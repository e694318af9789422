"""`cspan backends start|status|stop|env` with real detached processes on 127.0.0.1."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CSPAN = [sys.executable, "-m", "cspan.core.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CSPAN, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = dict(os.environ)
    e["CSPAN_STATE_DIR"] = str(tmp_path / "state")
    for k in ("CSPAN_ROUTER_URL", "CSPAN_ROUTER_MODEL", "CSPAN_ASR_URL", "CSPAN_ASR_MODEL"):
        e.pop(k, None)
    return e


def test_dry_run_prints_the_released_command_lines(env):
    out = _run(["backends", "start", "--dry-run"], env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert (
        "CUDA_VISIBLE_DEVICES=1 vllm serve google/gemma-4-26B-A4B-it --host 127.0.0.1 --port 8004 "
        "--gpu-memory-utilization 0.62 --max-model-len 8192 --enable-prefix-caching"
    ) in lines
    assert (
        "CUDA_VISIBLE_DEVICES=0 qwen-asr-serve Qwen/Qwen3-ASR-1.7B --host 127.0.0.1 --port 8990 "
        "--gpu-memory-utilization 0.12 --max-model-len 4096 --max-num-seqs 64 --served-model-name qwen3-asr"
    ) in lines


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "asr-box.example.org"])
def test_a_non_loopback_host_needs_insecure_no_token(env, host):
    """The servers start without authentication (vLLM without --api-key): reachable from other machines only when
    the operator says so, and then `cspan asr-serve` is told too (it would refuse on its own)."""
    out = _run(["backends", "start", "--host", host, "--dry-run"], env)
    assert out.returncode == 2 and f"refusing to start servers on {host}" in out.stderr and out.stdout == ""
    out = _run(["backends", "start", "--host", host, "--no-router", "--asr-engine", "sphinx", "--dry-run"], env)
    assert out.returncode == 2
    out = _run(
        [
            "backends",
            "start",
            "--host",
            host,
            "--no-router",
            "--asr-engine",
            "sphinx",
            "--insecure-no-token",
            "--dry-run",
        ],
        env,
    )
    assert out.returncode == 0 and f"--host {host} --port 8990 --insecure-no-token" in out.stdout
    out = _run(
        ["backends", "start", "--host", host, "--no-asr", "--router-url", "http://10.0.0.9:8004/v1", "--dry-run"], env
    )
    assert out.returncode == 0  # nothing started here listens


def test_missing_vllm_names_the_extra_and_the_embedded_alternatives(env):
    env["PATH"] = "/nonexistent"
    out = _run(["backends", "start", "--no-router"], env)
    assert out.returncode == 1
    assert "cspan-backends[vllm]" in out.stderr and "--asr-engine sphinx" in out.stderr


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().split()[2] == "Z":
            continue
        alive.append(pid)
    return alive


def test_start_status_env_stop_with_sphinx_asr_and_a_local_router(env, tmp_path):
    router_port, asr_port = _free_port(), _free_port()
    router_cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(HERE / 'fake_openai_router.py'))} --port {{port}}"
    start = _run(
        [
            "backends", "start",
            "--router-command", router_cmd, "--router-port", str(router_port), "--router-model", "fake-router",
            "--asr-engine", "sphinx", "--asr-port", str(asr_port),
            "--timeout-s", "240",
        ],
        env,
    )  # fmt: skip
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        status = _run(["backends", "status"], env)
        assert status.returncode == 0, status.stdout + status.stderr
        rows = status.stdout.splitlines()
        assert any(r.startswith("router") and "running" in r and "healthy" in r for r in rows)
        assert any(r.startswith("asr") and "running" in r and "healthy" in r for r in rows)

        exports = _run(["backends", "env"], env).stdout.splitlines()
        assert f"export CSPAN_ROUTER_URL=http://127.0.0.1:{router_port}/v1" in exports
        assert "export CSPAN_ROUTER_MODEL=fake-router" in exports
        assert f"export CSPAN_ASR_URL=http://127.0.0.1:{asr_port}/v1" in exports
        # `eval "$(cspan backends env)"` makes cspan infer default to these servers
        probe = (
            "from cspan.core.cli import build_parser; from cspan.core.settings import settings_from_args; "
            "s = settings_from_args(build_parser().parse_args(['infer', '--input-wav', 'x', '--output-wav', 'y.wav'])); "
            "print(s.router, s.router_model, s.asr)"
        )
        shell = f'eval "$({shlex.join(CSPAN)} backends env)"; {shlex.quote(sys.executable)} -c {shlex.quote(probe)}'
        seen = subprocess.run(["bash", "-c", shell], env=env, capture_output=True, text=True, timeout=120)
        assert seen.stdout.split() == [
            f"http://127.0.0.1:{router_port}/v1",
            "fake-router",
            f"http://127.0.0.1:{asr_port}/v1",
        ], seen.stderr
        import json

        state = json.loads((Path(env["CSPAN_STATE_DIR"]) / "backends.json").read_text())
        pids = [s["pid"] for s in state["servers"]]
        assert len(_pids_alive(pids)) == 2
        asr_pid = next(s["pid"] for s in state["servers"] if s["name"] == "asr")
        os.killpg(asr_pid, signal.SIGKILL)  # the ASR server dies: env still exports it, and says so
        deadline = time.monotonic() + 30
        while _pids_alive([asr_pid]) and time.monotonic() < deadline:
            time.sleep(0.2)
        dead = _run(["backends", "env"], env)
        assert f"export CSPAN_ASR_URL=http://127.0.0.1:{asr_port}/v1" in dead.stdout.splitlines()
        assert "warning: asr is recorded but its process is gone" in dead.stderr and "router" not in dead.stderr
    finally:
        stop = _run(["backends", "stop"], env)
    assert stop.returncode == 0, stop.stderr
    assert "router" in stop.stdout
    deadline = time.monotonic() + 30
    while _pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pids_alive(pids) == []
    assert not (Path(env["CSPAN_STATE_DIR"]) / "backends.json").exists()


def test_server_exiting_at_startup_fails_with_its_log_tail(env, tmp_path):
    t0 = time.monotonic()
    out = _run(
        ["backends", "start", "--no-router", "--asr-engine", "transformers", "--asr-model", str(tmp_path / "missing"),
         "--asr-port", str(_free_port()), "--timeout-s", "120"],
        env,
    )  # fmt: skip
    assert out.returncode == 1
    assert "asr: exited during start-up" in out.stderr
    assert "missing" in out.stderr  # the server's own message, from its log
    assert time.monotonic() - t0 < 120
    assert _run(["backends", "status"], env).stdout.startswith("no servers recorded")


def test_an_external_router_that_does_not_answer_fails_in_seconds_and_nothing_is_recorded(env):
    """`--router-url` of a server that is not there waited the whole --timeout-s (900 s) and stayed in
    backends.json, so `cspan backends env` exported it; starting nothing said "all healthy"."""
    t0 = time.monotonic()
    out = _run(["backends", "start", "--no-asr", "--router-url", f"http://127.0.0.1:{_free_port()}/v1"], env)
    assert out.returncode == 1 and time.monotonic() - t0 < 60
    assert (
        "router: nothing healthy answers http://127.0.0.1:" in out.stderr and "only checked, not started" in out.stderr
    )
    env_out = _run(["backends", "env"], env)
    assert env_out.stdout == "" and "no backends are running" in env_out.stderr
    nothing = _run(["backends", "start", "--no-asr", "--no-router"], env)
    assert nothing.returncode == 2 and "nothing to start" in nothing.stderr


def test_an_external_router_url_with_a_query_is_checked_and_exported_with_it(env):
    """The query of --router-url (Azure's ?api-version=...) stays at the end of the URLs checked and exported (was
    appended to: http://h/v1?api-version=2/v1/models, never healthy)."""
    port = _free_port()
    router = subprocess.Popen([sys.executable, str(HERE / "fake_openai_router.py"), "--port", str(port)])
    try:
        url = f"http://127.0.0.1:{port}/v1?api-version=2"
        out = _run(["backends", "start", "--no-asr", "--router-url", url], env)
        assert out.returncode == 0, out.stdout + out.stderr
        # its model is not known (no --router-model): only the URL is exported, not the launcher's default model
        assert _run(["backends", "env"], env).stdout.splitlines() == [f"export CSPAN_ROUTER_URL={shlex.quote(url)}"]
    finally:
        router.terminate()
        router.wait(timeout=30)


def test_router_spec_records_the_model_only_where_it_applies() -> None:
    """The model recorded (and exported as CSPAN_ROUTER_MODEL) is the one the router is known to serve: vLLM's, a
    --router-command's when it was given one ({model} in it, or --router-model), an external server's when named;
    otherwise none (the default gemma had been recorded for every router, a command that serves another model too)."""
    from cspan.backends.launcher import ROUTER_MODEL, router_spec

    assert router_spec().model == ROUTER_MODEL and router_spec().command[:3] == ["vllm", "serve", ROUTER_MODEL]
    assert router_spec(model="m").model == "m"
    assert router_spec(command="srv --port {port}").model is None
    assert router_spec(command="srv --port {port} --x {{model}}").model is None  # a literal brace, not the field
    assert router_spec(command="srv --port {port}", model="m").model == "m"
    served = router_spec(command="srv --port {port} --model {model}")
    assert served.model == ROUTER_MODEL and served.command == ["srv", "--port", "8004", "--model", ROUTER_MODEL]
    named = router_spec(command="srv --served-model-name={model}", model="m")
    assert named.model == "m" and named.command == ["srv", "--served-model-name=m"]
    assert router_spec(url="http://h:8/v1").model is None
    assert router_spec(url="http://h:8/v1", model="gpt-4.1-mini").model == "gpt-4.1-mini"


def test_env_exports_no_router_model_for_a_router_command_without_one(env):
    """`cspan backends start --router-command CMD` (no {model}, no --router-model) then `cspan backends env` exported
    CSPAN_ROUTER_MODEL=google/gemma-4-26B-A4B-it, a model that server does not serve, over the shell's own value."""
    port = _free_port()
    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(HERE / 'fake_openai_router.py'))} --port {{port}}"
    start = _run(
        ["backends", "start", "--no-asr", "--router-command", command, "--router-port", str(port), "--timeout-s", "120"],
        env,
    )  # fmt: skip
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        exports = _run(["backends", "env"], env)
        assert exports.returncode == 0 and exports.stderr == ""
        assert exports.stdout.splitlines() == [f"export CSPAN_ROUTER_URL=http://127.0.0.1:{port}/v1"]
        # eval'd in a shell that names its router model: that value stays
        shell = f'eval "$({shlex.join(CSPAN)} backends env)"; echo "$CSPAN_ROUTER_URL $CSPAN_ROUTER_MODEL"'
        seen = subprocess.run(
            ["bash", "-c", shell], env={**env, "CSPAN_ROUTER_MODEL": "my-model"}, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert seen.stdout.split() == [f"http://127.0.0.1:{port}/v1", "my-model"], seen.stderr
    finally:
        stop = _run(["backends", "stop"], env)
    assert stop.returncode == 0 and "router" in stop.stdout, stop.stderr


def test_router_spec_takes_each_form_of_the_router_url() -> None:
    """--router-url as the server, its /v1 or its chat-completions endpoint (the three forms the router's chat_url
    takes): the same /v1/models check and /v1 base (the full endpoint had been checked at
    .../chat/completions/v1/models, never healthy)."""
    from cspan.backends.launcher import router_spec

    for given in ("http://h:8/x", "http://h:8/x/", "http://h:8/x/v1", "http://h:8/x/v1/chat/completions"):
        for query in ("", "?api-version=2"):
            spec = router_spec(url=given + query)
            assert (spec.health_url, spec.url) == (f"http://h:8/x/v1/models{query}", f"http://h:8/x/v1{query}"), given


@pytest.mark.parametrize(
    ("command", "said"),
    [
        ("srv --port {prot}", "--router-command 'srv --port {prot}': KeyError: 'prot'"),
        ("srv {", "Single '{' encountered"),
        ('srv "--port {port}', "No closing quotation"),
        ("srv {0}", "IndexError"),
        ("srv {port.x}", "AttributeError"),
        (" ", "--router-command is empty"),
    ],
)
def test_a_router_command_that_makes_no_command_line_is_one_line_and_status_2(env, command, said):
    """A --router-command with a brace that is not {port}, {host} or {model}, or an open quote, ended `cspan backends
    start` in a traceback (KeyError, ValueError from str.format or shlex), --dry-run included."""
    out = _run(["backends", "start", "--no-asr", "--dry-run", "--router-command", command], env)
    assert out.returncode == 2 and out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith("cspan backends start: error: router: --router-command") and said in line
    ok = _run(["backends", "start", "--no-asr", "--dry-run", "--router-command", "srv --port {port} --x {{y}}"], env)
    assert ok.returncode == 0 and "CUDA_VISIBLE_DEVICES=1 srv --port 8004 --x '{y}'" in ok.stdout.splitlines()


def test_the_router_and_the_asr_server_on_one_port_are_refused(env):
    """--router-port 8004 --asr-port 8004 was accepted: each server's health check could be answered by the other
    (vLLM and qwen-asr-serve both answer /health) while the second failed to bind, or `start` said "all healthy"."""
    out = _run(["backends", "start", "--dry-run", "--router-port", "8004", "--asr-port", "8004"], env)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (
        "cspan backends start: error: --router-port and --asr-port are both 8004; give each server its own port (one "
        "would answer the other's health check)"
    )
    alone = _run(["backends", "start", "--dry-run", "--no-asr", "--router-port", "8990", "--asr-port", "8990"], env)
    assert alone.returncode == 0
