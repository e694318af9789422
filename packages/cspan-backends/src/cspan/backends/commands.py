"""``cspan backends``: start, check and stop the router LLM and ASR servers (entry-point group ``cspan.commands``).

``backends_command(parser)`` adds its arguments and sets ``handler``; handlers import their heavy modules lazily so
that ``cspan --help`` stays fast. See ``cspan.core.cli`` for the contract. ``cspan asr-serve`` is declared by its
settings model (:class:`cspan.backends.asr.settings.ASRServeSettings`); ``cspan users`` and ``cspan db`` live in
:mod:`cspan.backends.admin_cli`.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from cspan.backends.hostguard import is_loopback
from cspan.backends.urls import check_http_url

__all__ = ["backends_command", "is_loopback"]


def _port(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1 to 65535)")
    return int(text)


def _gpus(text: str) -> str:
    """CUDA_VISIBLE_DEVICES: device indices >= 0 separated by commas (``0``, ``2,3``)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give GPU indices >= 0 separated by commas, e.g. 0 or 2,3")
    return ",".join(parts)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds above 0 and at most 86400")
    return value


def _http_url(text: str) -> str:
    try:
        return check_http_url(text)  # the password, if any, is not echoed
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{exc}: give an OpenAI-compatible server's, e.g. http://127.0.0.1:8000/v1"
        ) from None


def backends_command(parser: argparse.ArgumentParser) -> None:
    """Start, check and stop the router LLM and ASR servers with the released settings (see docs/BACKENDS.md)."""
    from cspan.backends.launcher import ASR_PORT, ROUTER_MODEL, ROUTER_PORT

    sub = parser.add_subparsers(dest="backends_action", metavar="ACTION", title="actions")
    sub.required = True
    st = sub.add_parser("start", help="start the router and ASR servers detached and wait until they answer")
    st.add_argument(
        "--router-model",
        default=None,
        help=f"model vLLM serves (default {ROUTER_MODEL}), what a --router-command's {{model}} becomes (same "
        "default), or the model at --router-url; `cspan backends env` exports a router model only where one applies: "
        "vLLM's, a command's {model}, or this flag's",
    )
    st.add_argument("--router-gpu", type=_gpus, default="1", help="CUDA_VISIBLE_DEVICES of the router (default 1)")
    st.add_argument("--router-port", type=_port, default=ROUTER_PORT, help=f"router port (default {ROUTER_PORT})")
    st.add_argument(
        "--router-url", type=_http_url, default=None, help="use this running OpenAI-compatible server instead"
    )
    st.add_argument(
        "--router-command",
        default=None,
        help="run this command as the router instead of vLLM ({port}, {host}, {model} are substituted)",
    )
    st.add_argument("--no-router", action="store_true", help="start the ASR server only")
    st.add_argument(
        "--asr-engine",
        choices=("vllm", "transformers", "sphinx"),
        default="vllm",
        help="the ASR server: vllm (qwen-asr-serve, the released settings), or `cspan asr-serve` with transformers "
        "(needs --asr-model DIR) or sphinx (default vllm)",
    )
    st.add_argument("--asr-model", default=None, help="ASR model id or directory (vllm default Qwen/Qwen3-ASR-1.7B)")
    st.add_argument("--asr-gpu", type=_gpus, default="0", help="CUDA_VISIBLE_DEVICES of the ASR server (default 0)")
    st.add_argument("--asr-port", type=_port, default=ASR_PORT, help=f"ASR port (default {ASR_PORT})")
    st.add_argument("--no-asr", action="store_true", help="start the router only")
    st.add_argument("--host", default="127.0.0.1", help="interface the servers bind (default 127.0.0.1)")
    st.add_argument(
        "--insecure-no-token",
        action="store_true",
        help="allow a non-loopback --host: the servers started have no authentication (vLLM without --api-key), so "
        "anyone who reaches the ports can use them (trusted networks, or a firewall in front)",
    )
    st.add_argument("--log-dir", type=Path, default=None, help="where the logs go (default: the state folder)")
    st.add_argument("--timeout-s", type=_seconds, default=900.0, help="how long to wait for health (default 900)")
    st.add_argument("--dry-run", action="store_true", help="print the exact command lines and exit")
    st.set_defaults(handler=_backends_start)
    sub.add_parser("status", help="show the recorded servers and whether they answer").set_defaults(
        handler=_backends_status
    )
    sub.add_parser("stop", help="stop the servers this command started").set_defaults(handler=_backends_stop)
    sub.add_parser("env", help="print export lines for eval: CSPAN_ROUTER_URL, CSPAN_ASR_URL ...").set_defaults(
        handler=_backends_env
    )


def _specs(args: argparse.Namespace) -> list:
    from cspan.backends.launcher import asr_spec, router_spec

    specs = []
    if not args.no_router:
        specs.append(
            router_spec(
                model=args.router_model,
                gpu=args.router_gpu,
                port=args.router_port,
                host=args.host,
                url=args.router_url,
                command=args.router_command,
            )
        )
    if not args.no_asr:
        specs.append(
            asr_spec(
                engine=args.asr_engine,
                model=args.asr_model,
                gpu=args.asr_gpu,
                port=args.asr_port,
                host=args.host,
                insecure_no_token=args.insecure_no_token,
            )
        )
    return specs


def _backends_start(args: argparse.Namespace) -> int:
    from cspan.backends.launcher import LauncherError, format_command, start, state_dir

    if args.log_dir is not None and args.log_dir.exists() and not args.log_dir.is_dir():
        print(f"cspan backends start: error: --log-dir {str(args.log_dir)!r} is a file; give a folder", file=sys.stderr)
        return 2
    if args.no_router and args.no_asr:
        print("cspan backends start: error: nothing to start: both --no-router and --no-asr", file=sys.stderr)
        return 2
    starts_a_server = not args.no_asr or (not args.no_router and args.router_url is None)
    if starts_a_server and not is_loopback(args.host) and not args.insecure_no_token:
        print(
            f"cspan backends start: error: refusing to start servers on {args.host} (reachable from other machines): "
            "they are started without authentication; bind 127.0.0.1 (default) and reach them through a tunnel, "
            "start them yourself with a key (vLLM's --api-key, `cspan asr-serve --token`), or pass "
            "--insecure-no-token on a trusted network",
            file=sys.stderr,
        )
        return 2
    if not (args.no_router or args.no_asr or args.router_url) and args.router_port == args.asr_port:
        print(
            f"cspan backends start: error: --router-port and --asr-port are both {args.asr_port}; give each server "
            "its own port (one would answer the other's health check)",
            file=sys.stderr,
        )
        return 2
    try:
        specs = _specs(args)
    except LauncherError as exc:  # flags that do not make a server (--router-command, --asr-engine's model)
        print(f"cspan backends start: error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.dry_run:
            for spec in specs:
                line = format_command(spec) if spec.managed else f"(external, not started) {spec.url}"
                print(f"# {spec.name}: health {spec.health_url}\n{line}")
            return 0
        records = start(specs, log_dir=args.log_dir or state_dir() / "logs", timeout_s=args.timeout_s)
    except LauncherError as exc:
        print(f"cspan backends start: error: {exc}", file=sys.stderr)
        return 1
    for r in records:
        print(f"{r.name}: {r.url} (pid {r.pid}, log {r.log})" if r.managed else f"{r.name}: {r.url} (external)")
    print('run `eval "$(cspan backends env)"` so that cspan infer / serve use them')
    return 0


def _backends_status(args: argparse.Namespace) -> int:
    from cspan.backends.launcher import LauncherError, state_file, status

    try:
        rows = status()
    except LauncherError as exc:
        print(f"cspan backends status: error: {exc}", file=sys.stderr)
        return 1
    if not rows:
        print(f"no servers recorded ({state_file()})")
        return 0
    for row in rows:
        state = "external" if row["running"] is None else "running" if row["running"] else "not running"
        health = "healthy" if row["healthy"] else "not answering"
        print(f"{row['name']:7s} {state:12s} {health:14s} pid={row['pid']} url={row['url']} log={row['log']}")
    return 0 if all(r["healthy"] for r in rows) else 1


def _backends_stop(args: argparse.Namespace) -> int:
    from cspan.backends.launcher import LauncherError, stop

    try:
        stopped = stop()
    except LauncherError as exc:
        print(f"cspan backends stop: error: {exc}", file=sys.stderr)
        return 1
    print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
    return 0


def _backends_env(args: argparse.Namespace) -> int:
    from cspan.backends.launcher import LauncherError, env_lines, not_running

    try:
        lines, gone = env_lines(), not_running()
    except LauncherError as exc:
        print(f"cspan backends env: error: {exc}", file=sys.stderr)
        return 1
    for name in gone:  # still exported (a supervisor may restart it), but said
        print(
            f"cspan backends env: warning: {name} is recorded but its process is gone; `cspan backends status`, "
            "or start it again",
            file=sys.stderr,
        )
    if not lines:  # on standard error: `eval "$(cspan backends env)"` still sets nothing, and says why
        print("cspan backends env: no backends are running (start them with `cspan backends start`)", file=sys.stderr)
        return 0
    print("\n".join(lines))
    return 0
