"""``cspan asr-serve``'s settings: the older token variable is held to ``--token``'s rules, a token is never echoed,
and a server reachable through a public ``--allowed-host`` name needs a token as a non-loopback bind does."""

from __future__ import annotations

import pytest

from cspan.backends.asr.settings import ASRServeSettings
from cspan.core.settings import SettingsError, load_settings


def test_a_short_older_token_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CSPAN_ASR_TOKEN", "abc")
    with pytest.raises(SettingsError, match="CSPAN_ASR_TOKEN is 3 characters; a token needs at least 8"):
        load_settings(ASRServeSettings, verb="asr-serve")
    monkeypatch.setenv("CSPAN_ASR_TOKEN", "long-enough-token")
    assert load_settings(ASRServeSettings, verb="asr-serve").token == "long-enough-token"
    assert load_settings(ASRServeSettings, {"token": "from-the-flag"}).token == "from-the-flag"  # the flag wins


def test_a_refused_token_is_not_echoed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CSPAN_ASR_TOKEN", raising=False)
    with pytest.raises(SettingsError) as caught:
        load_settings(ASRServeSettings, {"token": "s3cr3t"})
    assert "s3cr3t" not in str(caught.value) and "at least 8 characters" in str(caught.value)


@pytest.mark.parametrize("name", ["asr.example.org", "*", "10.0.0.5:8990"])
def test_a_public_allowed_host_needs_a_token(name: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("CSPAN_ASR_TOKEN", raising=False)
    settings = ASRServeSettings(allowed_host=[name], port=1)
    assert settings.run() == 2
    err = capsys.readouterr().err
    assert f"refusing to serve on --allowed-host {name}" in err and "--insecure-no-token" in err


def test_loopback_allowed_hosts_need_no_token() -> None:
    from cspan.backends.hostguard import public_names

    assert public_names(["localhost:8990", "127.0.0.2", "[::1]:8990", "::1"]) == []
    assert public_names(["localhost", "talk.example.org:443"]) == ["talk.example.org:443"]
