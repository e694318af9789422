"""Settings that ``cspan serve`` and ``cspan infer`` share, declared once as pydantic mixins.

A verb's settings model (a ``pydantic_settings.BaseSettings`` with :data:`cspan.core.settings.SETTINGS_CONFIG`)
inherits these fields, so the flag, the ``CSPAN_*`` variable, the settings-file key, the range and the help of each
are written here only (:mod:`cspan.core.settings` generates the command line from them)::

    class ServeSettings(ModelSettings, BackendSettings, BaseSettings):
        model_config = SETTINGS_CONFIG
        ...

Backend choices (``--asr``, ``--router``, ``--knowledge``, ``--tools``, ``--mcp``, ``--db``) are validated with the
other settings, before any model is loaded; :func:`check_backends_answer` asks the backend URLs whether they answer
(run it while the model loads).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, field_validator, model_validator

from cspan.backends.errors import ToolError
from cspan.backends.tools.catalog import LIVE_DEFAULT, TOOL_SETS, MCPServerSpec, ToolsSpec, parse_mcp, parse_tools
from cspan.server.infer import DEFAULT_PERSONA

_MODEL = {"group": "model"}
_BACKENDS = {"group": "backends"}
_TOOLS = {"group": "tools"}
_MEMORY = {"group": "context db"}


class ModelSettings(BaseModel):
    """The model, the persona and sampling (``--checkpoint``, ``--voice``, ``--text-prompt``, ``--temp``, ...)."""

    checkpoint: str | None = Field(
        None,
        description="Hugging Face repo id, local directory or file (None: the released Context Spanning 7B)",
        json_schema_extra=_MODEL,
    )
    voice: str | None = Field(
        None,
        description="voice name in the checkpoint's voices/ or a .pt file of codes (None: the first voice; '': none)",
        json_schema_extra=_MODEL,
    )
    text_prompt: str = Field(
        DEFAULT_PERSONA, max_length=4000, description="the persona text prompt", json_schema_extra=_MODEL
    )
    temp: float = Field(
        0.8, ge=0.0, le=10.0, allow_inf_nan=False, description="audio sampling temperature (0 = greedy)",
        json_schema_extra=_MODEL,
    )  # fmt: skip
    temp_text: float = Field(
        0.7, ge=0.0, le=10.0, allow_inf_nan=False, description="text sampling temperature (0 = greedy)",
        json_schema_extra=_MODEL,
    )  # fmt: skip
    seed: int = Field(
        42424242,
        ge=0,
        le=2**63 - 1,
        description="seed of the sampler (session n gets seed + n)",
        json_schema_extra=_MODEL,
    )
    device: str | None = Field(
        None, description="cuda, cuda:1, cpu (None: cuda if available)", json_schema_extra=_MODEL
    )
    cuda_graphs: bool = Field(
        True,
        description="replay the frame from CUDA graphs on a GPU (--no-cuda-graphs: eager)",
        json_schema_extra=_MODEL,
    )


def _choice_or_url(value: str, flag: str, choices: tuple[str, ...], what: str) -> str:
    spec = value.strip()
    if spec.lower() in choices:
        return spec.lower()
    url = spec.removeprefix("openai+") if flag == "--asr" else spec
    parts = urlsplit(url)
    if parts.scheme in ("http", "https") and parts.hostname:
        try:
            parts.port  # noqa: B018 - raises ValueError for a port out of range
        except ValueError as exc:
            raise ValueError(f"{spec!r}: {exc}") from None
        return spec
    raise ValueError(f"{spec!r}: use {', '.join(repr(c) for c in choices)} or an http(s) URL of {what}")


class BackendSettings(BaseModel):
    """Transcriber, router, knowledge notes, Context DB and retrieval timing (``--asr``, ``--router``, ...)."""

    asr: str = Field(
        "sphinx",
        description="'sphinx' (embedded), 'none', or a transcription server URL (http://host:port, .../v1)",
        json_schema_extra=_BACKENDS,
    )
    asr_model: str | None = Field(
        None, description="model name for an OpenAI-style ASR URL", json_schema_extra=_BACKENDS
    )
    router: str = Field(
        "local",
        description="'local' (embedded), 'none', or an OpenAI-compatible base URL",
        json_schema_extra=_BACKENDS,
    )
    router_model: str = Field(
        "google/gemma-4-26B-A4B-it", description="model name at the router URL", json_schema_extra=_BACKENDS
    )
    knowledge: Path | None = Field(
        None, description="folder of .txt/.md notes for the local router", json_schema_extra=_BACKENDS
    )
    listen_s: float = Field(
        12.0, gt=0.0, le=600.0, allow_inf_nan=False,
        description="seconds of audio transcribed when no utterance transcript is usable", json_schema_extra=_BACKENDS,
    )  # fmt: skip
    span_deadline_s: float = Field(
        2.5, gt=0.0, le=3600.0, allow_inf_nan=False,
        description="drop a Context Span arriving later than this after its <ret> (s)", json_schema_extra=_BACKENDS,
    )  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _legacy_environment(cls, data: Any) -> Any:
        """``CSPAN_ASR_URL`` / ``CSPAN_ROUTER_URL`` (what ``cspan backends env`` exports) where neither the flag,
        ``CSPAN_ASR`` / ``CSPAN_ROUTER`` nor the settings file gave a value."""
        if isinstance(data, dict):
            for name, env in (("asr", "CSPAN_ASR_URL"), ("router", "CSPAN_ROUTER_URL")):
                if data.get(name) is None and os.environ.get(env):
                    data = {**data, name: os.environ[env]}
        return data

    @field_validator("asr")
    @classmethod
    def _asr(cls, value: str) -> str:
        return _choice_or_url(value, "--asr", ("sphinx", "pocketsphinx", "none"), "a transcription server")

    @field_validator("router")
    @classmethod
    def _router(cls, value: str) -> str:
        return _choice_or_url(value, "--router", ("local", "none"), "an OpenAI-compatible server")

    @field_validator("knowledge")
    @classmethod
    def _knowledge(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        path = value.expanduser()
        if not path.is_dir():
            raise ValueError(f"{str(value)!r} is not a folder (a folder of .txt/.md notes)")
        return path

    def backend_urls(self) -> dict[str, str]:
        """``{flag: url}`` of the backends given as URLs."""
        urls = {}
        for flag, value in (("--asr", self.asr), ("--router", self.router)):
            if value.startswith(("http://", "https://", "openai+")):
                urls[flag] = value.removeprefix("openai+")
        return urls


class ToolSettings(BaseModel):
    """The tools the router may call (``--tools``, ``--mcp``; :mod:`cspan.backends.tools.catalog`).

    In a settings file: ``tools = "clock,calculator"`` or a list of set names, and ``mcp`` a list whose items are
    ``--mcp`` strings or tables (``{command = [...], allow = [...]}`` / ``{url = "..."}``, the fields of
    :class:`~cspan.backends.tools.catalog.MCPServerSpec`).
    """

    tools: str | None = Field(
        None,
        description=f"built-in tool sets, comma-separated: {', '.join(TOOL_SETS)}; 'default' (all but fdb-v3, the "
        "benchmark's mock world of fabricated flights and accounts), 'none' (default: default)",
        json_schema_extra={**_TOOLS, "metavar": "NAME,..."},
    )
    mcp: list[str | MCPServerSpec] = Field(
        default_factory=list,
        description="mount an MCP server's tools: a stdio command line or a streamable-HTTP URL, after optional "
        "allow=a,b (only these) read=a,b (vouch they change nothing) prefix=p_ timeout=S and '--'; repeatable",
        json_schema_extra={**_TOOLS, "metavar": "SPEC"},
    )

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            value = ",".join(str(v) for v in value) or "none"
        if isinstance(value, str):
            try:
                parse_tools(value)
            except ToolError as exc:
                raise ValueError(str(exc).removeprefix("--tools: ")) from None
            return value.strip()
        return value

    @field_validator("mcp", mode="after")
    @classmethod
    def _mcp(cls, values: list[str | MCPServerSpec]) -> list[str | MCPServerSpec]:
        out: list[str | MCPServerSpec] = []
        for value in values:
            if isinstance(value, str):
                try:
                    value = parse_mcp(value)
                except ToolError as exc:
                    raise ValueError(str(exc).removeprefix("--mcp ")) from None
            out.append(value)
        return out

    @property
    def tool_sets(self) -> list[str]:
        """The built-in sets chosen (the live default when ``--tools`` is not given)."""
        return list(LIVE_DEFAULT) if self.tools is None else parse_tools(self.tools)

    def tools_spec(self, **fields: Any) -> ToolsSpec:
        """The :class:`~cspan.backends.tools.catalog.ToolsSpec` of these settings; ``fields`` are its other fields
        (``knowledge=``, ``world_db=``, ...)."""
        servers = [s if isinstance(s, MCPServerSpec) else parse_mcp(s) for s in self.mcp]
        return ToolsSpec(sets=self.tool_sets, mcp=servers, **fields)


class ContextDBSettings(BaseModel):
    """Where the Context DB lives and how long it keeps conversations (``--db``, ``--retention-days``)."""

    db: str | None = Field(
        None,
        description="the Context DB: a SQLite file, ':memory:' (nothing kept) or postgresql://USER@HOST:PORT/DB "
        "(replicas sharing one memory) (default: context.sqlite in the platform's data directory, "
        "~/.local/share/cspan on Linux)",
        json_schema_extra={**_MEMORY, "metavar": "PATH|URL"},
    )
    retention_days: float | None = Field(
        None,
        gt=0.0,
        le=36500.0,
        allow_inf_nan=False,
        description="delete turns, spans, facts and profiles older than this many days (at start and hourly) "
        "(default: kept until `cspan db forget`)",
        json_schema_extra=_MEMORY,
    )

    @field_validator("db")
    @classmethod
    def _db(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        if not value:
            raise ValueError("empty; give a file, ':memory:' or a postgresql:// URL (or leave it out)")
        return value

    def open_db(self) -> Any:
        """Open the :class:`~cspan.backends.context_db.ContextDB` these settings name (created and migrated).

        Raises:
            ContextDBError: the database cannot be opened (the message names it and the fix).
        """
        from cspan.backends.context_db import ContextDB

        return ContextDB(self.db, retention_days=self.retention_days)


def check_backends_answer(settings: Any, *, timeout_s: float = 5.0) -> list[str]:
    """Ask every backend URL of ``settings`` (a :class:`BackendSettings`) whether something answers HTTP there.

    Any HTTP answer counts (a 404 still means a server listens); a refused connection, a name that does not resolve
    or no answer within ``timeout_s`` does not. Runs the requests concurrently (threads); meant to run while the
    model loads.

    Returns:
        One line per backend that does not answer, naming the flag, the URL and the cause (empty: all answer).
    """
    import concurrent.futures

    import httpx

    def probe(item: tuple[str, str]) -> str | None:
        flag, url = item
        try:
            httpx.get(url, timeout=timeout_s, follow_redirects=False)
        except httpx.TimeoutException:
            return f"{flag} {url}: no answer within {timeout_s:g} s"
        except httpx.HTTPError as exc:
            cause = str(exc) or type(exc).__name__
            return f"{flag} {url}: does not answer ({cause}); start that server or choose another {flag}"
        return None

    items = list(settings.backend_urls().items())
    if not items:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(items)) as pool:
        return [line for line in pool.map(probe, items) if line]


__all__ = ["BackendSettings", "ContextDBSettings", "ModelSettings", "ToolSettings", "check_backends_answer"]
