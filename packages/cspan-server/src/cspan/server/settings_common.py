"""Settings shared by ``cspan infer`` and ``cspan serve``: the model and the backends, each declared once.

:class:`ModelSettings`, :class:`BackendSettings`, :class:`ToolSettings` (``--tools``, ``--mcp``) and
:class:`ContextDBSettings` (``--db``, ``--retention-days``) are pydantic-settings mixins (``cspan.core.settings``): a
verb's settings model inherits them next to its own fields, and its flags, ``CSPAN_*`` environment variables and
``--config`` keys are generated from these declarations, ranges and checks included, so a bad value is refused in
one line (exit status 2) before anything is loaded.

Besides ``CSPAN_ASR`` and ``CSPAN_ROUTER``, the names ``cspan backends env`` prints are read too: ``CSPAN_ASR_URL``
and ``CSPAN_ROUTER_URL`` (below the ``CSPAN_ASR`` / ``CSPAN_ROUTER`` variables and a settings file).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from cspan.backends.errors import ToolError
from cspan.backends.tools.catalog import LIVE_DEFAULT, TOOL_SETS, MCPServerSpec, ToolsSpec, parse_mcp, parse_tools
from cspan.backends.urls import check_http_url, redact_url
from cspan.core.constants import (
    MAX_LISTEN_S,
    MAX_SEED,
    MAX_SPAN_DEADLINE_S,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_TEMPERATURE,
    SERVE_MAX_BLOCK_COLUMNS,
)
from cspan.core.settings import SETTINGS_CONFIG, EnvList

DEFAULT_PERSONA = (
    "You are Ada, a calm and friendly voice assistant. You help people plan their day and find things out, and "
    "you handle everyday requests too, such as looking things up, the weather, times and directions."
)
"""The persona text of ``cspan infer`` and ``cspan serve`` without ``--text-prompt``: one identity (it read "You are
Ada ... You are moshi ...", two). No model needs a fixed sentence here: PersonaPlex takes any role text (its own
examples' default is "You are a wise and friendly teacher. ..."), and a Moshi checkpoint was trained with none
(``--text-prompt ""``, docs/COMING-FROM-MOSHI.md)."""

MAX_TEXT_PROMPT_CHARS = 4000
"""Longest persona text prompt accepted (characters); whether it fits the model's window is checked on its frames."""

LEGACY_ENV = {"asr": "CSPAN_ASR_URL", "router": "CSPAN_ROUTER_URL"}
"""Environment names that ``cspan backends env`` prints, read below the generated ``CSPAN_ASR`` / ``CSPAN_ROUTER``."""


def utf8_text(value: Any) -> Any:
    """Refuse text that is not valid UTF-8 (a command-line argument in another encoding arrives with lone
    surrogates, which the tokenizer and the JSON output cannot take)."""
    if not isinstance(value, str):
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raw = value.encode("utf-8", "surrogateescape")
        bad = value[exc.start].encode("utf-8", "surrogateescape")
        raise ValueError(
            f"not valid UTF-8 text (byte 0x{bad[0]:02x} after {len(value[: exc.start].encode('utf-8', 'replace'))} "
            f"bytes of {len(raw)}); give it in UTF-8 (the terminal's or the file's encoding is another)"
        ) from None
    return value


def _temperature(value: float) -> float:
    if 0.0 < value < MIN_TEMPERATURE:
        raise ValueError(f"use 0 for greedy decoding or a temperature of at least {MIN_TEMPERATURE:g}")
    return value


Utf8Text = Annotated[str, BeforeValidator(utf8_text)]
"""A text setting: any string that is valid UTF-8."""
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False), AfterValidator(_temperature)]
"""A sampling temperature: 0 (greedy) or MIN_TEMPERATURE .. MAX_TEMPERATURE."""
TopK = Annotated[int, Field(ge=0, le=MAX_TOP_K)]
"""A sampling top-k: 0 (every token) to MAX_TOP_K."""


class ModelSettings(BaseSettings):
    """The model: checkpoint, voice, persona, sampling, device (``cspan infer`` and ``cspan serve``)."""

    model_config = SETTINGS_CONFIG

    checkpoint: str | None = Field(
        None,
        description="Hugging Face repo id, local directory or file (default: the released Context Spanning 7B)",
        json_schema_extra={"group": "model"},
    )
    base: str | None = Field(
        None,
        description="base of a fine-tune --checkpoint (a .pt, or moshi-finetune's lora.safetensors): a repo id or a "
        "local directory (default: the base export.json records, else PersonaPlex 7B)",
        json_schema_extra={"group": "model"},
    )
    voice: Utf8Text | None = Field(
        None,
        description="voice prompt: a voice name of the checkpoint (its voices/, or PersonaPlex's voices.tgz: NATF2), "
        "a .pt voice file (codes, or PersonaPlex's embeddings), or a 2-30 s recording (WAV, FLAC, OGG, MP3) to clone "
        "(default: the first voice of the checkpoint's voices/ folder; none for voices.tgz, which holds a choice: name "
        "one)",
        json_schema_extra={"group": "model"},
    )
    text_prompt: Utf8Text = Field(
        DEFAULT_PERSONA,
        max_length=MAX_TEXT_PROMPT_CHARS,
        description=f"the persona text prompt (at most {MAX_TEXT_PROMPT_CHARS} characters, and at most half the "
        "model's attention window with the voice prompt) (default: Ada, a calm and friendly assistant)",
        json_schema_extra={"group": "model", "metavar": "TEXT"},
    )
    temp: Temperature = Field(
        0.8,
        description=f"audio sampling temperature (0 = greedy, else {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g})",
        json_schema_extra={"group": "model"},
    )
    temp_text: Temperature = Field(
        0.7,
        description=f"text sampling temperature (0 = greedy, else {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g})",
        json_schema_extra={"group": "model"},
    )
    seed: int = Field(
        42424242,
        ge=0,
        le=MAX_SEED,
        description="seed of the session's sampler (0 to 2**63 - 1); the default is fixed, so runs repeat: for a "
        "different one each run (PersonaPlex's --seed -1) pass a fresh one, e.g. --seed $RANDOM",
        json_schema_extra={"group": "model"},
    )
    fuse_lora: bool = Field(
        False,
        description="fold a fine-tune's LoRA adapters (its own, or moshi-finetune's lora.safetensors) into the weights "
        "at load: plain linear layers, faster steps (upstream's --fuse-lora)",
        json_schema_extra={"group": "model"},
    )
    device: str | None = Field(
        None, description="cuda, cuda:1, cpu (default: cuda if available)", json_schema_extra={"group": "model"}
    )
    cuda_graphs: bool = Field(
        True,
        description="capture the CUDA step as a graph (--no-cuda-graphs runs it eagerly)",
        json_schema_extra={"group": "model"},
    )
    persona_policy: Literal["pinned", "reprefix", "none"] = Field(
        "pinned",
        description="how the persona stays in the attention window past its end: pinned (its keys stay as sink "
        "positions, the layout of training), reprefix (read again before it leaves) or none (it slides out); "
        "docs/ENGINE.md, 'The persona past the window'",
        json_schema_extra={"group": "model"},
    )
    max_block_columns: int = Field(
        SERVE_MAX_BLOCK_COLUMNS,
        ge=0,
        description="the most Context Span columns one step reads across all sessions (0: no limit); spans past it "
        "wait for the next frames, oldest first, instead of making one frame long for every session",
        json_schema_extra={"group": "model"},
    )
    kv_dtype: Literal["auto", "bf16", "fp16", "fp32", "fp8"] = Field(
        "auto",
        description="the KV cache's storage: auto (the model's dtype), bf16, fp16, fp32, or fp8 (e4m3 with a scale "
        "per position and head: half the memory of bf16, 128 sessions per H200 against 80; its divergence from "
        "bf16 is in docs/PERFORMANCE.md, 'FP8 KV cache: what it changes')",
        json_schema_extra={"group": "model"},
    )
    memory_span: bool = Field(
        False,
        description="when Context Spans leave the attention window, read a short Context DB summary of the "
        "conversation (facts, last references) back in as a span",
        json_schema_extra={"group": "model"},
    )

    @field_validator("checkpoint", "base")
    @classmethod
    def _not_blank(cls, value: str | None) -> str | None:
        """An empty value is a mistake (an unset variable in a script), not a request for the default."""
        if value is not None and not value.strip():
            raise ValueError("is empty; leave it out for the default, or give a repo id, a folder or a file")
        return value

    @field_validator("seed", mode="before")
    @classmethod
    def _no_unseeded(cls, value: object) -> object:
        """A negative seed is PersonaPlex's and Moshi's "no fixed seed" (``--seed -1``), which has no counterpart:
        said so with what to pass instead, rather than as a bare range error."""
        try:
            negative = int(str(value).strip()) < 0
        except ValueError:
            return value  # not an integer: the type's own error
        if negative:
            raise ValueError(
                f"got {value!r}; a negative seed (PersonaPlex's --seed -1, 'no fixed seed') has no counterpart here: "
                "the seed is always fixed (0 to 2**63 - 1, default 42424242), so for a different one each run pass a "
                "fresh one, e.g. --seed $RANDOM"
            )
        return value

    @field_validator("voice")
    @classmethod
    def _check_voice_recording(cls, value: str | None) -> str | None:
        """A recording given as the voice is read now (2-30 s, not silent, audio at all), before any model loads."""
        if value:
            from cspan.core.errors import AudioInputError, os_error_cause
            from cspan.core.voice import is_recording, prepare_voice_audio

            path = Path(value).expanduser()
            try:
                if path.is_file() and is_recording(path):
                    prepare_voice_audio(path)
            except AudioInputError as exc:
                raise ValueError(str(exc)) from None
            except OSError as exc:
                raise ValueError(f"{value}: cannot be read ({os_error_cause(exc)})") from None
        return value


class _LegacyEnv(PydanticBaseSettingsSource):
    """``CSPAN_ASR_URL`` / ``CSPAN_ROUTER_URL`` (see :data:`LEGACY_ENV`)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        var = LEGACY_ENV.get(field_name)
        return (os.environ.get(var) if var else None), field_name, False

    def __call__(self) -> dict[str, Any]:
        return {
            name: os.environ[var]
            for name, var in LEGACY_ENV.items()
            if name in self.settings_cls.model_fields and os.environ.get(var)
        }


class BackendSettings(BaseSettings):
    """The backends: transcriber, router, knowledge notes, retrieval timing."""

    model_config = SETTINGS_CONFIG

    asr: str = Field(
        "sphinx",
        description="transcriber: 'sphinx' (embedded), 'none', a /transcribe server URL or an OpenAI-style URL "
        "(http://host:port/v1 or openai+URL); env CSPAN_ASR or CSPAN_ASR_URL",
        json_schema_extra={"group": "backends", "metavar": "sphinx|none|URL"},
    )
    asr_model: str | None = Field(
        None,
        description="model name for an OpenAI-style ASR server (default: qwen3-asr)",
        json_schema_extra={"group": "backends"},
    )
    router: str = Field(
        "local",
        description="router: 'local' (embedded), 'none', or an OpenAI-compatible base URL; env CSPAN_ROUTER or "
        "CSPAN_ROUTER_URL",
        json_schema_extra={"group": "backends", "metavar": "local|none|URL"},
    )
    router_model: str = Field(
        "google/gemma-4-26B-A4B-it", description="model name at the router URL", json_schema_extra={"group": "backends"}
    )
    knowledge: Path | None = Field(
        None,
        description="folder of .txt/.md notes for the local router (default: none)",
        json_schema_extra={"group": "backends", "metavar": "DIR"},
    )
    listen_s: float = Field(
        12.0,
        gt=0.0,
        le=MAX_LISTEN_S,
        allow_inf_nan=False,
        description=f"ASR window (s) when no utterance transcript is usable (at most {MAX_LISTEN_S:g})",
        json_schema_extra={"group": "backends"},
    )
    span_deadline_s: float = Field(
        2.5,
        gt=0.0,
        le=MAX_SPAN_DEADLINE_S,
        allow_inf_nan=False,
        description=f"drop a reference applied later than this (s) after its <ret> (at most {MAX_SPAN_DEADLINE_S:g})",
        json_schema_extra={"group": "backends"},
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _LegacyEnv(settings_cls), dotenv_settings, file_secret_settings

    @field_validator("asr")
    @classmethod
    def _check_asr(cls, value: str) -> str:
        spec = value.strip()
        if spec.lower() in ("sphinx", "pocketsphinx", "none"):
            return spec.lower()
        check_http_url(spec.removeprefix("openai+"))
        return spec

    @field_validator("router")
    @classmethod
    def _check_router(cls, value: str) -> str:
        spec = value.strip()
        if spec.lower() in ("local", "none"):
            return spec.lower()
        if not spec.startswith(("http://", "https://")):
            raise ValueError(
                f"{redact_url(value)!r}: use 'local', 'none' or an http(s) URL of an OpenAI-compatible server"
            )
        return check_http_url(spec)

    @field_validator("knowledge")
    @classmethod
    def _check_knowledge(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        if not value.exists():
            raise ValueError(f"{value}: no such folder")
        if not value.is_dir():
            raise ValueError(f"{value}: is a file; pass the folder that holds the .txt/.md notes")
        if not os.access(value, os.R_OK | os.X_OK):
            raise ValueError(f"{value}: cannot be read (permission denied)")
        return value

    @property
    def asr_url(self) -> str | None:
        """The transcriber's URL, or None for the embedded engine or none."""
        return None if self.asr in ("sphinx", "pocketsphinx", "none") else self.asr

    @property
    def router_url(self) -> str | None:
        """The router's URL, or None for the local router or none."""
        return None if self.router in ("local", "none") else self.router

    def backend_urls(self) -> dict[str, str]:
        """``{flag: url}`` of the backends given as URLs."""
        urls = {}
        for flag, value in (("--asr", self.asr), ("--router", self.router)):
            if value.startswith(("http://", "https://", "openai+")):
                urls[flag] = value.removeprefix("openai+")
        return urls


class ToolSettings(BaseSettings):
    """The tools the router may call (``--tools``, ``--mcp``; :mod:`cspan.backends.tools.catalog`).

    In a settings file: ``tools = "clock,calculator"`` or a list of set names, and ``mcp`` a list whose items are
    ``--mcp`` strings or tables (``{command = [...], allow = [...]}`` / ``{url = "..."}``, the fields of
    :class:`~cspan.backends.tools.catalog.MCPServerSpec`).
    """

    model_config = SETTINGS_CONFIG

    tools: str | None = Field(
        None,
        description=f"built-in tool sets, comma-separated: {', '.join(TOOL_SETS)}; 'default' (all but fdb-v3, the "
        "benchmark's mock world of fabricated flights and accounts), 'none' (default: default)",
        json_schema_extra={"group": "tools", "metavar": "NAME,..."},
    )
    mcp: EnvList[str | MCPServerSpec] = Field(
        default_factory=list,
        description="mount an MCP server's tools: a stdio command line or a streamable-HTTP URL, after optional "
        "allow=a,b (only these) read=a,b (vouch they change nothing) prefix=p_ timeout=S and '--'; repeatable",
        json_schema_extra={"group": "tools", "metavar": "SPEC"},
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


class ContextDBSettings(BaseSettings):
    """Where the Context DB lives and how long it keeps conversations (``--db``, ``--retention-days``)."""

    model_config = SETTINGS_CONFIG

    db: str | None = Field(
        None,
        description="the Context DB: a SQLite file, ':memory:' (nothing kept) or postgresql://USER@HOST:PORT/DB "
        "(replicas sharing one memory) (default: context.sqlite in the platform's data directory, "
        "~/.local/share/cspan on Linux)",
        json_schema_extra={"group": "context db", "metavar": "PATH|URL"},
    )
    retention_days: float | None = Field(
        None,
        gt=0.0,
        le=36500.0,
        allow_inf_nan=False,
        description="delete turns, spans, facts and profiles older than this many days (at start and hourly) "
        "(default: kept until `cspan db forget`)",
        json_schema_extra={"group": "context db"},
    )

    @field_validator("db")
    @classmethod
    def _db(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        if not value:
            raise ValueError("empty; give a file, ':memory:' or a postgresql:// URL (or leave it out)")
        from cspan.backends.context_db import ContextDBError, resolve_target

        try:
            resolve_target(value)  # a URL of a database we do not speak (mysql://...), a folder
        except ContextDBError as exc:  # the URL is shown as (got ...), unless it holds a password
            raise ValueError(str(exc).partition(": ")[2]) from None
        return value

    def open_db(self) -> Any:
        """Open the :class:`~cspan.backends.context_db.ContextDB` these settings name (created and migrated).

        Raises:
            ContextDBError: the database cannot be opened (the message names it and the fix).
        """
        from cspan.backends.context_db import ContextDB

        return ContextDB(self.db, retention_days=self.retention_days)


def check_backends_answer(settings: Any, *, timeout_s: float = 5.0) -> list[str]:
    """Ask every backend URL of ``settings`` (a :class:`BackendSettings`) whether something answers HTTP there
    (:func:`cspan.backends.http_client.unanswered`; call it where no event loop runs, e.g. while the model loads in a
    thread).

    Any HTTP answer counts (a 404 still means a server listens); a refused connection, a name that does not resolve
    or no answer within ``timeout_s`` does not.

    Returns:
        One line per backend that does not answer, naming the flag, the URL and the cause (empty: all answer).
    """
    from cspan.backends.http_client import unanswered

    urls = settings.backend_urls()
    why = asyncio.run(unanswered(urls, timeout_s)) if urls else {}
    return [
        f"{flag} {redact_url(urls[flag])}: "
        + (no.why if no.timed_out else f"does not answer ({no.why}); start that server or choose another {flag}")
        for flag, no in why.items()
    ]


__all__ = [
    "DEFAULT_PERSONA",
    "BackendSettings",
    "ContextDBSettings",
    "ModelSettings",
    "Temperature",
    "ToolSettings",
    "Utf8Text",
    "check_backends_answer",
]
