"""Wire models, audio framing and access-control helpers of ``cspan serve``, and that docs/PROTOCOL.md documents
every message type and error code the code has."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from cspan.backends.context_db import ContextDB
from cspan.backends.identity import Principal, issue_token
from cspan.core.errors import ProtocolError
from cspan.server.auth import (
    CredentialAuthenticator,
    ServeConfigError,
    check_bind,
    is_exposed,
    is_loopback_host,
    origin_allowed,
)
from cspan.server.protocol import (
    CLIENT_MESSAGE_TYPES,
    ERROR_CODES,
    PROTOCOL_VERSION,
    SERVER_MESSAGE_TYPES,
    ContextMessage,
    ProtocolCodeError,
    StartMessage,
    StopMessage,
    decode_audio_frame,
    dumps,
    encode_audio_frame,
    event_to_wire,
    parse_client_message,
    parse_server_message,
)


def code_of(text: str) -> str:
    with pytest.raises(ProtocolCodeError) as info:
        parse_client_message(text)
    assert isinstance(info.value, ProtocolError)
    return info.value.code


def test_client_messages_parse() -> None:
    start = parse_client_message(
        json.dumps(
            {
                "type": "start",
                "version": 1,
                "profile": {"name": " Ada ", "location": "London", "timezone": "Europe/London", "lat": 51.5, "lon": 0},
                "voice": "f1",
                "text_prompt": "You help.",
            }
        )
    )
    assert isinstance(start, StartMessage)
    assert start.profile.name == "Ada" and start.profile.lat == 51.5 and start.test is None
    assert isinstance(parse_client_message('{"type": "stop"}'), StopMessage)
    ctx = parse_client_message('{"type": "context", "profile": {"timezone": "Asia/Tokyo"}}')
    assert isinstance(ctx, ContextMessage) and ctx.profile.model_dump(exclude_unset=True) == {"timezone": "Asia/Tokyo"}
    sampled = parse_client_message('{"type":"start","sampling":{"text_temperature":0,"audio_topk":500}}')
    assert sampled.sampling.model_dump() == {
        "text_temperature": 0.0,
        "text_topk": None,
        "audio_temperature": None,
        "audio_topk": 500,
    }
    hooks = parse_client_message('{"type":"start","test":{"force_ret_at":[1.5],"spans":[{"at":2,"text":"Hi."}]}}')
    assert hooks.test.force_ret_at == [1.5] and hooks.test.spans[0].text == "Hi."


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("{oops", "bad_json"),
        ("null", "bad_json"),
        ('"start"', "bad_json"),
        ("[]", "bad_json"),
        ("{}", "unknown_type"),
        ('{"type": "hello"}', "unknown_type"),
        ('{"type": 5}', "unknown_type"),
        ('{"type": "stop", "now": true}', "invalid_message"),
        ('{"type": "context"}', "invalid_message"),
        ('{"type": "start", "profile": {"lat": 91}}', "invalid_message"),
        ('{"type": "start", "profile": {"lon": "east"}}', "invalid_message"),
        ('{"type": "start", "profile": {"timezone": "Nowhere/Atlantis"}}', "invalid_message"),
        ('{"type": "start", "profile": {"user_id": "../etc"}}', "invalid_message"),
        ('{"type": "start", "profile": {"user_id": "ada"}}', "invalid_message"),
        ('{"type": "start", "test": {"force_ret_at": [-1]}}', "invalid_message"),
        ('{"type": "start", "sampling": {"text_temperature": 0.0001}}', "invalid_message"),
        ('{"type": "start", "sampling": {"audio_temperature": 11}}', "invalid_message"),
        ('{"type": "start", "sampling": {"audio_topk": 501}}', "invalid_message"),
        ('{"type": "start", "sampling": {"text_topk": -1}}', "invalid_message"),
        ('{"type": "start", "sampling": {"top_p": 0.9}}', "invalid_message"),
        ('{"type": "start", "text_prompt": "' + "x" * 5000 + '"}', "invalid_message"),
        ("[" * 100000 + "]" * 100000, "bad_json"),
        ("[" * 20000 + "]" * 20000, "bad_json"),
        ('{"type": "start", "profile": {"lat": NaN}}', "bad_json"),  # not JSON (Python's parser takes it)
        ('{"type": "start", "profile": {"lon": -Infinity}}', "bad_json"),
        ('{"type": "start", "profile": {"name": "Ada"}, "x": Infinity}', "bad_json"),
        ('{"type": "start", "seed": 1' + "0" * 5000 + "}", "bad_json"),  # past Python's int-conversion limit
        ('{"type": "start", "profile": {"lat": -' + "9" * 4301 + "}}", "bad_json"),
    ],
)
def test_client_message_errors(text: str, code: str) -> None:
    assert code_of(text) == code


@pytest.mark.parametrize(
    "message",
    [
        {"type": "k" * 100_000},
        {"type": "start", "k" * 100_000: 1},
        {"type": "start", **{f"extra{i}": i for i in range(1000)}},
        {"type": "start", "profile": {f"x{i}" * 1000: i for i in range(100)}, "codecs": [5] * 8},
    ],
)
def test_client_message_errors_do_not_grow_with_the_input(message: dict) -> None:
    with pytest.raises(ProtocolCodeError) as info:
        parse_client_message(json.dumps(message))
    assert len(info.value.message) < 600, info.value.message[:200]


def test_audio_frames() -> None:
    x = np.linspace(-1.5, 1.5, 1920, dtype=np.float32)
    x[3] = np.nan
    pcm = decode_audio_frame(x.astype("<f4").tobytes())
    assert pcm.shape == (1920,) and pcm.dtype == np.float32
    assert np.isnan(pcm[3]) and pcm[0] == -1.5  # as sent: the session core sanitizes (test_sanitize_pcm)
    ints = np.array([-32768, 0, 16384, 32767] * 480, dtype="<i2")
    pcm16 = decode_audio_frame(ints.tobytes())
    assert pcm16[:4].tolist() == [-1.0, 0.0, 0.5, 32767 / 32768]
    y = np.sin(np.arange(1920, dtype=np.float32))
    assert np.array_equal(np.frombuffer(encode_audio_frame(y), dtype="<f4"), y)
    for n in (0, 7679, 1920, 64 * 1024 + 1):  # sizes above --max-message-kib never get here (the app refuses them)
        with pytest.raises(ProtocolCodeError) as info:
            decode_audio_frame(b"\x00" * n)
        assert info.value.code == "bad_frame" and "JSON" not in info.value.message
    for data in (b'{"type":"start"}', b'{"type": "stop"}', b'{"type": "start", "codecs": ["opus"]}'):  # JSON as binary
        with pytest.raises(ProtocolCodeError) as info:
            decode_audio_frame(data)
        assert info.value.code == "bad_frame" and "send JSON messages" in info.value.message


@pytest.mark.parametrize(
    ("samples", "expect", "nonfinite"),
    [
        ([0.5, np.nan, -0.25], [0.5, 0.0, -0.25], 1),
        ([np.inf, -np.inf, 0.0], [0.0, 0.0, 0.0], 2),
        ([2.0, -3.0, 1e30], [1.0, -1.0, 1.0], 0),
        ([np.nan] * 4, [0.0] * 4, 4),
        ([], [], 0),
    ],
)
def test_sanitize_pcm(samples: list[float], expect: list[float], nonfinite: int) -> None:
    """Live audio: NaN and +-Inf become silence (counted), everything is clipped to [-1, 1]."""
    from cspan.core.audio import sanitize_pcm

    clean, n = sanitize_pcm(np.array(samples, dtype=np.float64))
    assert clean.dtype == np.float32 and clean.tolist() == expect and n == nonfinite


def test_server_messages_round_trip() -> None:
    from cspan.core.events import ErrorEvent, SpanEvent

    err = event_to_wire(ErrorEvent(frame=3, t=0.24, stage="asr", message="boom"))
    assert json.loads(dumps(err)) == {
        "type": "error",
        "code": "backend",
        "message": "boom",
        "stage": "asr",
        "frame": 3,
        "t": 0.24,
    }
    span = SpanEvent(frame=7, t=0.56, text="It is 3 pm.", injected_at=0.56, n_frames=9, prefill_ms=float("nan"))
    wire = json.loads(dumps(event_to_wire(span)))
    assert wire["type"] == "span" and wire["prefill_ms"] is None  # non-finite floats are sent as null
    assert parse_server_message(dumps(err)).code == "backend"


def test_protocol_doc_covers_every_message_and_code(repo_root: Path) -> None:
    doc = (repo_root / "docs" / "PROTOCOL.md").read_text()
    assert f"(version {PROTOCOL_VERSION})" in doc
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", doc, flags=re.M))
    for kind in (*CLIENT_MESSAGE_TYPES, *SERVER_MESSAGE_TYPES):
        assert kind in rows, f"message type {kind!r} has no row in docs/PROTOCOL.md"
    for code in ERROR_CODES:
        assert code in rows, f"error code {code!r} has no row in docs/PROTOCOL.md"
    from cspan.server.realtime_events import ERROR_CODES as REALTIME_CODES
    from cspan.server.realtime_events import WARNING_CODES

    for code in (*REALTIME_CODES, *WARNING_CODES):
        assert f"`{code}`" in doc, f"Realtime code {code!r} is not in docs/PROTOCOL.md"
    assert "`--max-message-kib`" in doc


async def test_token_checks() -> None:
    from cspan.server.adapters import Connection
    from cspan.server.adapters.ws import CspanAdapter

    db = ContextDB(":memory:")
    open_server = CredentialAuthenticator(db)  # one person on 127.0.0.1: everyone is the local principal
    assert not await open_server.required()
    assert await open_server.authenticate(None) == Principal.local()
    assert await open_server.authenticate("anything") == Principal.local()
    tok = "abcdefgh-123"
    auth = CredentialAuthenticator(db, token=tok, token_user="kiosk")
    assert await auth.required()
    assert (await auth.authenticate(tok)).user_id == "kiosk"
    for wrong in (None, "", tok[:-1], tok + "4", "abcdefgh-124", "ü" * 12):
        assert await auth.authenticate(wrong) is None, wrong
    # an issued token makes the open server require credentials at once; an admin-only token cannot talk
    _, ada = issue_token(db, "ada")
    _, ops = issue_token(db, "ops", scopes=["admin"])
    assert await open_server.required() and await open_server.authenticate(None) is None
    assert (await open_server.authenticate(ada)).user_id == "ada"
    assert await open_server.authenticate(ops) is None
    db.revoke_tokens(user_id="ada")
    db.revoke_tokens(user_id="ops")
    assert await open_server.required() and await open_server.authenticate(None) is None  # stays closed
    assert await CredentialAuthenticator(ContextDB(":memory:"), always=True).required()
    # /ws: the offered cspan.token.* subprotocol first (echoed), else ?token=
    cred = CspanAdapter.credential(Connection("/ws", {"token": "q"}, {}, ("other", f"cspan.token.{tok}")))
    assert (cred.token, cred.subprotocol) == (tok, f"cspan.token.{tok}")
    cred = CspanAdapter.credential(Connection("/ws", {"token": "q"}, {}, ("other",)))
    assert (cred.token, cred.subprotocol) == ("q", None)
    assert CspanAdapter.credential(Connection("/ws")).token is None


def test_bind_and_origin_rules() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"):
        assert is_loopback_host(host), host
        check_bind(host, None, insecure_no_token=False)
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.com"):
        assert not is_loopback_host(host), host
        with pytest.raises(ServeConfigError, match="--insecure-no-token"):
            check_bind(host, None, insecure_no_token=False)
        check_bind(host, "a-token-123", insecure_no_token=False)
        check_bind(host, None, insecure_no_token=True)
    # a loopback server answering a public name is reached through a proxy: the same rule
    for allowed in (["talk.example.org"], ["*"], ["localhost:9000", "proxy.internal:8443"]):
        assert is_exposed("127.0.0.1", allowed), allowed
        with pytest.raises(ServeConfigError, match=r"--allow-host .* without a token"):
            check_bind("127.0.0.1", None, insecure_no_token=False, allowed=allowed)
        check_bind("127.0.0.1", "a-token-123", insecure_no_token=False, allowed=allowed)
        check_bind("127.0.0.1", None, insecure_no_token=True, allowed=allowed)
    assert not is_exposed("127.0.0.1", ["localhost", "127.0.0.2:8080", "[::1]"])
    assert origin_allowed(None, "127.0.0.1:8080")
    assert origin_allowed("http://127.0.0.1:8080", "127.0.0.1:8080")
    assert origin_allowed("https://talk.example.org", "talk.example.org")
    assert origin_allowed("http://[::1]:8080", "[::1]:8080")
    assert not origin_allowed("http://localhost:8080", "127.0.0.1:8080")
    assert not origin_allowed("http://127.0.0.1:9999", "127.0.0.1:8080")
    assert not origin_allowed("null", "127.0.0.1:8080")
    assert origin_allowed("https://app.example.org/", "127.0.0.1:8080", ["https://app.example.org"])
    assert origin_allowed("http://anything", "h:1", ["*"])


def test_adapters_are_discovered_one_module_each() -> None:
    from cspan.server.adapters import ProtocolAdapter, discover_adapters

    adapters = discover_adapters()
    assert {("cspan", "/ws"), ("moshi", "/api/chat")} <= {(a.name, a.path) for a in adapters}
    assert all(issubclass(a, ProtocolAdapter) for a in adapters)
