"""The settings of ``cspan serve``, declared once (flags, ``CSPAN_*`` variables and ``--config`` file keys).

:mod:`cspan.core.settings` generates the command line from :class:`ServeSettings`; ranges are checked there, with one
line naming the flag, the variable or the file key, and exit status 2, before anything loads. Model, backend,
tool and Context DB fields come from :mod:`cspan.server.settings_common` (shared with ``cspan infer``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings

from cspan.backends.context_db.user import check_id
from cspan.core.settings import SETTINGS_CONFIG, EnvList
from cspan.server.auth import TOKEN_PATTERN, check_allow_host, check_allow_origin
from cspan.server.settings_common import BackendSettings, ContextDBSettings, ModelSettings, ToolSettings

_SERVER = {"group": "server"}
_ACCESS = {"group": "access"}


class ServeSettings(ModelSettings, BackendSettings, ToolSettings, ContextDBSettings, BaseSettings):
    """Serve live conversations in the browser over WebSocket (several at once on one batched engine)."""

    model_config = SETTINGS_CONFIG

    host: str = Field(
        "127.0.0.1",
        description="address to listen on (another than loopback needs credentials: --token, --token-file or tokens "
        "issued with `cspan users add`)",
        json_schema_extra=_SERVER,
    )
    port: int = Field(8080, ge=0, le=65535, description="port (0 picks a free one)", json_schema_extra=_SERVER)
    max_sessions: int = Field(
        4, ge=1, le=256, description="concurrent conversations (the engine's batch size)", json_schema_extra=_SERVER
    )
    max_sessions_per_user: int = Field(
        0, ge=0, le=256,
        description="conversation slots one user (a credential's user id) may hold at once: another start of theirs "
        "is refused with busy (0: no limit but --max-sessions). The shared --token's clients are one user, as are "
        "all clients of a server without credentials",
        json_schema_extra=_SERVER,
    )  # fmt: skip
    max_connections_per_user: int = Field(
        0, ge=0, le=65536,
        description="WebSocket connections one user may hold open at once, started or not: one more is closed with "
        "1013 (0: twice --max-sessions, at least 32)",
        json_schema_extra=_SERVER,
    )  # fmt: skip
    idle_timeout_s: float = Field(
        60.0, gt=0.0, le=86400.0, allow_inf_nan=False,
        description="end a session (or a connection that never starts) without audio for this long (s)",
        json_schema_extra=_SERVER,
    )  # fmt: skip
    max_queued_frames: int = Field(
        25, ge=1, le=12500, description="per-session audio queue bound (frames of 80 ms)", json_schema_extra=_SERVER
    )
    max_message_kib: int = Field(
        256, ge=16, le=16384,
        description="largest WebSocket message a client may send, on every protocol (KiB): a larger one is refused "
        "with a too_large error before it is read, and the session goes on",
        json_schema_extra=_SERVER,
    )  # fmt: skip
    max_messages_per_s: int = Field(
        200, ge=10, le=100000,
        description="messages a client may send a second, on every protocol (a burst of one second's worth; bytes: "
        "16 of the largest messages a second): a faster client is read more slowly, so that it cannot take the "
        "frame clock from the other sessions",
        json_schema_extra=_SERVER,
    )  # fmt: skip
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
        description="a shared credential: one user (--token-user) with every scope (env CSPAN_TOKEN); open the page "
        "as /?token=...",
        json_schema_extra={**_ACCESS, "secret": True},  # never echoed in an error
    )
    token_user: str = Field(
        "local",
        description="the user id the shared --token stands for (its Context DB memory)",
        json_schema_extra={**_ACCESS, "metavar": "USER"},
    )
    token_file: Path | None = Field(
        None,
        description="TOML file of credentials: [[token]] tables with user, sha256 (or token) and scopes; read at "
        "start and on SIGHUP (docs/OPERATORS.md)",
        json_schema_extra={**_ACCESS, "metavar": "FILE"},
    )
    insecure_no_token: bool = Field(
        False,
        description="allow a non-loopback --host, or a public --allow-host name (behind a proxy), without "
        "credentials: every session is the user 'local' (trusted LANs)",
        json_schema_extra=_ACCESS,
    )
    allow_origin: EnvList[str] = Field(
        default_factory=list,
        description="another browser origin (scheme://host:port) allowed to open a conversation; repeatable; '*' for "
        "any",
        json_schema_extra={**_ACCESS, "metavar": "ORIGIN"},
    )
    allow_host: EnvList[str] = Field(
        default_factory=list,
        description="another Host name (host or host:port) this server answers to; repeatable; '*' for any. On a "
        "loopback --host only localhost, 127.0.0.1 and [::1] with the bound port are answered (DNS rebinding)",
        json_schema_extra={**_ACCESS, "metavar": "HOST"},
    )
    ssl_certfile: Path | None = Field(
        None,
        description="serve https and wss with this PEM certificate (chain) file (uvicorn's; with --ssl-keyfile)",
        json_schema_extra={**_SERVER, "metavar": "FILE"},
    )
    ssl_keyfile: Path | None = Field(
        None,
        description="the PEM private key of --ssl-certfile (not needed when the certificate file holds it)",
        json_schema_extra={**_SERVER, "metavar": "FILE"},
        validate_default=True,  # the pair is loaded once both are known (below), with or without this flag
    )
    db_wait_s: float = Field(
        0.5, ge=0.1, le=10.0, allow_inf_nan=False,
        description="how long a session holds everything it sends (the agent's audio too: its client hears up to "
        "this long of silence when the database stops answering) behind its Context DB write (a transcript is sent "
        "once its turn is stored), and a start, a token lookup or a memory read waits for the database, before going "
        "on without it (s, 0.1 to 10): below 0.1 a healthy database's commits would outlast it; above 10 the silence, "
        "the backlog sent at once and the shutdown's wait for bye grow too long; a retrieval during a stall may wait "
        "twice this (its context, the local router's facts): keep that well under --span-deadline-s",
        json_schema_extra={"group": "context db"},
    )  # fmt: skip
    drain_s: float = Field(
        0.0, ge=0.0, le=86400.0, allow_inf_nan=False,
        description="on SIGTERM/SIGINT, refuse new conversations (/health answers 503) and let running ones go on "
        "for up to this long before ending them (s)",
        json_schema_extra=_SERVER,
    )  # fmt: skip
    test_hooks: bool = Field(
        False,
        description="accept start.test (forced <ret>, scheduled spans, seed): tests only",
        json_schema_extra={"hidden": True},
    )
    unpaced: bool = Field(
        False,
        description="no 80 ms clock: a frame runs as soon as every live session has audio queued (or after one "
        "frame's time without): tests only, to play long conversations faster than real time",
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

    @field_validator("allow_origin")
    @classmethod
    def _allow_origin(cls, values: list[str]) -> list[str]:
        return [check_allow_origin(v) for v in values]

    @field_validator("allow_host")
    @classmethod
    def _allow_host(cls, values: list[str]) -> list[str]:
        return [check_allow_host(v) for v in values]

    @field_validator("token_user")
    @classmethod
    def _token_user(cls, value: str) -> str:
        return check_id(value, "user id")

    @field_validator("token_file", "ssl_certfile", "ssl_keyfile")
    @classmethod
    def _readable_file(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        path = value.expanduser()
        if not path.is_file():
            # a relative path in a settings file is read from the working directory, not from the file's folder
            where = "" if path.is_absolute() else f" (a relative path is read from the working directory, {Path.cwd()})"
            raise ValueError(f"{str(value)!r} is not a file{where}")
        return path

    @field_validator("ssl_certfile")
    @classmethod
    def _certificate(cls, value: Path | None) -> Path | None:
        if value is not None:
            _check_certificate(value)
        return value

    @field_validator("ssl_keyfile")
    @classmethod
    def _key_needs_certificate(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        certfile = info.data.get("ssl_certfile")
        if value is not None and certfile is None and "ssl_certfile" not in info.data:
            return value  # the certificate flag failed on its own, and says so
        if value is not None and certfile is None:
            raise ValueError("needs --ssl-certfile (the certificate this key belongs to)")
        if certfile is not None:
            check_tls_files(certfile, value)
        return value

    @property
    def tls(self) -> bool:
        """Whether the server speaks https/wss."""
        return self.ssl_certfile is not None

    @property
    def connections_per_user(self) -> int:
        """The WebSocket connections one user may hold open at once: ``max_connections_per_user``, or when 0, twice
        ``max_sessions`` and at least 32 (a user's tabs and reconnects, and the clients of a shared token)."""
        return self.max_connections_per_user or max(32, 2 * self.max_sessions)


def check_tls_files(certfile: Path, keyfile: Path | None) -> None:
    """Load the certificate chain and its key as uvicorn will, so that files that cannot serve TLS are a bad
    setting named here (exit 2) rather than OpenSSL's ``PEM lib`` error at start-up. The certificate file alone is
    checked by ``--ssl-certfile``'s validator (:func:`_check_certificate`), the pair by ``--ssl-keyfile``'s.

    Raises:
        ValueError: what is wrong and in which file (no key, a key of another certificate, an encrypted key).
    """
    import ssl

    def encrypted() -> bytes:
        raise ValueError(
            f"{keyfile or certfile}: the private key is encrypted; cspan serve reads an unencrypted key (openssl "
            "pkey -in KEY -out plain-key.pem, readable by the server's user only)"
        )

    if keyfile is None and b"PRIVATE KEY-----" not in certfile.read_bytes():
        raise ValueError(f"not given, and {certfile} holds no private key; pass the key with --ssl-keyfile")
    if keyfile is not None and b"PRIVATE KEY-----" not in keyfile.read_bytes():
        raise ValueError(f"{keyfile}: holds no PEM private key (-----BEGIN ... PRIVATE KEY-----)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile, password=encrypted)
    except ssl.SSLError as exc:
        if exc.reason in ("KEY_VALUES_MISMATCH", "NO_CERTIFICATE_ASSIGNED"):  # another key; or one of another type
            raise ValueError(
                f"{keyfile or certfile}: is not the private key of the certificate in {certfile}"
            ) from None
        raise ValueError(f"{certfile} with {keyfile or 'its key'}: cannot serve TLS ({exc.reason or exc})") from None


def _check_certificate(certfile: Path) -> None:
    """ValueError unless ``certfile`` holds a PEM certificate that OpenSSL reads."""
    import ssl

    text = certfile.read_bytes()
    if b"-----BEGIN CERTIFICATE-----" not in text:
        raise ValueError(f"{certfile}: holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cadata=text.decode("ascii", "replace"))
    except ssl.SSLError as exc:
        raise ValueError(f"{certfile}: its certificate cannot be read ({exc.reason or exc})") from None


__all__ = ["ServeSettings", "check_tls_files"]
