"""Settings that ``cspan serve`` and ``cspan infer`` share, declared once as pydantic mixins.

A verb's settings model (a ``pydantic_settings.BaseSettings`` with :data:`cspan.core.settings.SETTINGS_CONFIG`)
inherits these fields, so the flag, the ``CSPAN_*`` variable, the settings-file key, the range and the help of each
are written here only (:mod:`cspan.core.settings` generates the command line from them)::

    class ServeSettings(ModelSettings, BackendSettings, BaseSettings):
        model_config = SETTINGS_CONFIG
        ...

Backend choices (``--asr``, ``--router``, ``--knowledge``) are validated with the other settings, before any model
is loaded; :func:`check_backends_answer` asks the backend URLs whether they answer (run it while the model loads).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, field_validator, model_validator

from cspan.server.infer import DEFAULT_PERSONA

_MODEL = {"group": "model"}
_BACKENDS = {"group": "backends"}


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
    db: str = Field(
        ":memory:", description="Context DB SQLite file (':memory:': not kept)", json_schema_extra=_BACKENDS
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


__all__ = ["BackendSettings", "ModelSettings", "check_backends_answer"]
