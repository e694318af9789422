"""The settings of ``cspan serve``, declared once (flags, ``CSPAN_*`` variables and ``--config`` file keys).

:mod:`cspan.core.settings` generates the command line from :class:`ServeSettings`; ranges are checked there, with one
line naming the flag, the variable or the file key, and exit status 2, before anything loads. Model and backend
fields come from :mod:`cspan.server.settings_common` (shared with ``cspan infer``).
"""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings

from cspan.core.settings import SETTINGS_CONFIG
from cspan.server.auth import TOKEN_PATTERN
from cspan.server.settings_common import BackendSettings, ModelSettings

_SERVER = {"group": "server"}
_ACCESS = {"group": "access"}


class ServeSettings(ModelSettings, BackendSettings, BaseSettings):
    """Serve live conversations in the browser over WebSocket (several at once on one batched engine)."""

    model_config = SETTINGS_CONFIG

    host: str = Field(
        "127.0.0.1", description="address to listen on (non-loopback needs --token)", json_schema_extra=_SERVER
    )
    port: int = Field(8080, ge=0, le=65535, description="port (0 picks a free one)", json_schema_extra=_SERVER)
    max_sessions: int = Field(
        4, ge=1, le=256, description="concurrent conversations (the engine's batch size)", json_schema_extra=_SERVER
    )
    idle_timeout_s: float = Field(
        60.0, gt=0.0, le=86400.0, allow_inf_nan=False,
        description="end a session (or a connection that never starts) without audio for this long (s)",
        json_schema_extra=_SERVER,
    )  # fmt: skip
    max_queued_frames: int = Field(
        25, ge=1, le=12500, description="per-session audio queue bound (frames of 80 ms)", json_schema_extra=_SERVER
    )
    slot_every: int = Field(
        0, ge=0, le=100000, description="also send a slot timing message every N frames (0: only with spans)",
        json_schema_extra=_SERVER,
    )  # fmt: skip
    max_text_prompt_chars: int = Field(
        1000, ge=0, le=4000, description="longest persona text prompt a client may send", json_schema_extra=_SERVER
    )
    client_tool_timeout_s: float = Field(
        5.0, gt=0.0, le=600.0, allow_inf_nan=False,
        description="how long a client's own function (OpenAI Realtime tools) may take before the abstain clause is "
        "read instead (s); the span deadline of a session with such tools grows by this much",
        json_schema_extra=_SERVER,
    )  # fmt: skip
    header_timeout_s: float = Field(
        10.0, gt=0.0, le=600.0, allow_inf_nan=False,
        description="close an HTTP connection whose request headers are not complete within this time (s)",
        json_schema_extra=_SERVER,
    )  # fmt: skip
    token: str | None = Field(
        None,
        description="shared secret required on every conversation endpoint (env CSPAN_TOKEN); open the page as "
        "/?token=...",
        json_schema_extra=_ACCESS,
    )
    insecure_no_token: bool = Field(
        False, description="allow a non-loopback --host without a token (trusted LANs)", json_schema_extra=_ACCESS
    )
    allow_origin: list[str] = Field(
        default_factory=list,
        description="another browser origin (scheme://host:port) allowed to open a conversation; repeatable; '*' for "
        "any",
        json_schema_extra={**_ACCESS, "metavar": "ORIGIN"},
    )
    allow_host: list[str] = Field(
        default_factory=list,
        description="another Host name (host or host:port) this server answers to; repeatable; '*' for any. On a "
        "loopback --host only localhost, 127.0.0.1 and [::1] with the bound port are answered (DNS rebinding)",
        json_schema_extra={**_ACCESS, "metavar": "HOST"},
    )
    test_hooks: bool = Field(
        False,
        description="accept start.test (forced <ret>, scheduled spans, seed): tests only",
        json_schema_extra={"hidden": True},
    )

    @field_validator("token")
    @classmethod
    def _token(cls, value: str | None) -> str | None:
        if value is not None and not TOKEN_PATTERN.match(value):
            raise ValueError(
                "must be 8 to 256 characters of A-Z a-z 0-9 . _ ~ - (it travels as a WebSocket subprotocol); "
                'generate one with: python -c "import secrets; print(secrets.token_urlsafe())"'
            )
        return value or None


__all__ = ["ServeSettings"]
