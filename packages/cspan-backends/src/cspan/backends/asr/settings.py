"""``cspan asr-serve``: its settings, declared once (flags, ``CSPAN_ASR_SERVE_*`` environment, settings file).

The ``cspan`` command builds the verb from :class:`ASRServeSettings` (``cspan.core.cli`` reads a
``pydantic_settings.BaseSettings`` entry point with a ``run()`` method): every field is one flag with its type,
range and help, and a value out of range from any source is a one-line error (exit 2) before anything loads. This
module cannot import ``cspan.core``; it uses the same ``model_config`` values as ``cspan.core.settings``, with its
own environment prefix so that ``CSPAN_PORT`` (``cspan serve``) or ``CSPAN_ASR_MODEL`` (the model name clients send)
never reconfigure this server. ``CSPAN_ASR_TOKEN`` is still read for the token.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["ASRServeSettings"]


def _one_or_json_list(value: Any) -> Any:
    """``cspan.core.settings.EnvList``'s rule, which this module cannot import: a list setting's environment variable
    is a JSON list (``'["a", "b"]'``) or, otherwise, one value as it is; lists (flags, a settings file) pass."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"starts with '[' but is not a JSON list ({exc.msg}); give one value or a JSON list"
            ) from None
    return [value] if text else []


_HostList = Annotated[list[str], NoDecode, BeforeValidator(_one_or_json_list)]
"""A repeatable setting whose variable takes one value as it is, or a JSON list (``cspan.core.settings.EnvList``)."""


class ASRServeSettings(BaseSettings):
    """Serve speech recognition over HTTP (POST /transcribe and the OpenAI /v1/audio/transcriptions)."""

    model_config = SettingsConfigDict(
        env_prefix="CSPAN_ASR_SERVE_",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_hide_none_type=True,
        cli_avoid_json=True,
        extra="forbid",
        validate_default=True,
    )

    engine: Literal["sphinx", "transformers"] = Field(
        "sphinx",
        description="sphinx: embedded pocketsphinx, English, low accuracy, no download; transformers: a local "
        "transformers speech-recognition model directory given with --model",
    )
    model: str | None = Field(
        None,
        description="model directory: for transformers, a speech-recognition checkpoint (the released setup uses "
        "Qwen3-ASR-1.7B); for sphinx, an optional Sphinx model folder (default: the bundled en-us model)",
        json_schema_extra={"metavar": "PATH"},
    )
    host: str = Field("127.0.0.1", min_length=1, description="interface to bind (127.0.0.1: this machine only)")
    port: int = Field(8990, ge=1, le=65535, description="TCP port")
    token: str | None = Field(
        None,
        min_length=8,
        description="require 'Authorization: Bearer TOKEN' on every request but /health (also read from "
        "CSPAN_ASR_TOKEN); clients send it with OPENAI_API_KEY / api_key",
        json_schema_extra={"secret": True},  # never echoed in an error
    )
    insecure_no_token: bool = Field(
        False,
        description="allow binding a non-loopback address, or answering a public --allowed-host name (behind a "
        "proxy), without --token (anyone who reaches the port can use it)",
    )
    allowed_host: _HostList = Field(
        default_factory=list,
        description="another Host name this server answers to (NAME or NAME:PORT, repeatable; '*' turns the check "
        "off); on a loopback bind only localhost, 127.0.0.1 and [::1] with the bound port are accepted otherwise "
        "(DNS-rebinding protection)",
        json_schema_extra={"metavar": "NAME[:PORT]"},
    )
    concurrency: int = Field(2, ge=1, le=64, description="clips recognised at the same time, one worker thread each")
    max_queue: int = Field(32, ge=0, le=10_000, description="requests that may wait for a worker; more get HTTP 503")
    header_timeout_s: float = Field(
        10.0, gt=0, le=600, allow_inf_nan=False,
        description="close a connection whose request headers are not complete within this time (s)",
    )  # fmt: skip
    max_seconds: float = Field(
        120.0, gt=0, le=3600, allow_inf_nan=False, description="longest accepted clip in seconds; longer gets 413"
    )
    max_upload_mb: float = Field(
        50.0, gt=0, le=2048, allow_inf_nan=False, description="largest accepted upload in MiB; larger gets 413"
    )
    device: str = Field("auto", description="transformers engine: torch device, e.g. cpu or cuda:0")
    trust_remote_code: bool = Field(
        False,
        description="transformers engine: allow a model directory's own Python code to run (only for models you trust)",
    )

    @field_validator("allowed_host")
    @classmethod
    def _host_names(cls, names: list[str]) -> list[str]:
        from cspan.backends.hostguard import parse_allowed_host

        for name in names:
            parse_allowed_host(name)  # raises ValueError for a malformed one
        return names

    @field_validator("token", mode="before")
    @classmethod
    def _token_from_older_variable(cls, value: object) -> object:
        """``CSPAN_ASR_TOKEN`` when no other source gives the token, held to the same length as ``--token``."""
        if value is None and os.environ.get("CSPAN_ASR_TOKEN"):
            value = os.environ["CSPAN_ASR_TOKEN"]
            if len(value) < 8:
                raise ValueError(f"CSPAN_ASR_TOKEN is {len(value)} characters; a token needs at least 8")
        return value

    def run(self) -> int:
        """Load the engine and serve until interrupted; returns the exit status (2 for a refused configuration)."""
        prog = "cspan asr-serve"
        try:
            import fastapi  # noqa: F401  (fail here, with the fix, rather than half-way through startup)
            import uvicorn  # noqa: F401

            from cspan.backends.asr.server import ASRServerSettings, serve
        except ImportError as exc:
            print(
                f"{prog}: error: the ASR server needs FastAPI and uvicorn ({exc}): pip install 'cspan-backends[server]'",
                file=sys.stderr,
            )
            return 2
        from cspan.backends.asr.engines import EngineLoadError, load_engine
        from cspan.backends.errors import ListenError
        from cspan.backends.hostguard import is_loopback, public_names
        from cspan.backends.http_server import bind_socket

        public = public_names(self.allowed_host)
        if (public or not is_loopback(self.host)) and not self.token and not self.insecure_no_token:
            where = (
                f"{self.host} (reachable from other machines)"
                if not is_loopback(self.host)
                else f"--allowed-host {', '.join(public)} (behind a proxy, reachable by everyone it serves)"
            )
            print(
                f"{prog}: error: refusing to serve on {where} without --token; set --token (or CSPAN_ASR_TOKEN), "
                "bind 127.0.0.1 with loopback names only, or pass --insecure-no-token",
                file=sys.stderr,
            )
            return 2
        try:
            settings = ASRServerSettings(
                max_seconds=self.max_seconds,
                max_upload_bytes=int(self.max_upload_mb * 1024 * 1024),
                max_concurrency=self.concurrency,
                max_queue=self.max_queue,
                header_timeout_s=self.header_timeout_s,
                token=self.token or None,
                bind_host=self.host,
                allowed_hosts=tuple(self.allowed_host),
            )
        except ValueError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        try:
            sock = bind_socket(self.host, self.port)  # a bad --host or a busy --port fails before the engine loads
        except ListenError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return exc.exit_code
        try:
            engine = load_engine(
                self.engine,
                model=self.model,
                workers=self.concurrency,
                device=self.device,
                trust_remote_code=self.trust_remote_code,
            )
        except EngineLoadError as exc:
            sock.close()
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        where = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address in a URL is bracketed
        print(
            f"{prog}: {engine.name} engine ({engine.model}) on http://{where}:{self.port} "
            "(POST /transcribe, POST /v1/audio/transcriptions, GET /health)",
            file=sys.stderr,
        )
        with sock:
            serve(engine, host=self.host, port=self.port, settings=settings, sock=sock)
        return 0
