"""A ``CSPAN_*`` variable that no installed verb reads is warned about at start, with the closest known name
(cspan.core.environment); the names cspan reads by name are one declared list that matches the sources."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import get_origin

import pytest
from pydantic import AliasChoices, BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from cspan.core.cli import build_parser
from cspan.core.environment import DIRECT_ENV, known_env_names, settings_env_names, unknown_env, warn_unknown_env
from cspan.core.settings import SETTINGS_CONFIG, SettingsError, load_settings, settings_models

REPO = Path(__file__).resolve().parents[1]


def _cspan(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``cspan backends env`` (cheap: no model, no network) in a fresh process whose only ``CSPAN_*`` variables
    are ``env`` and ``CSPAN_STATE_DIR`` (a read-by-name one, so the run touches nothing outside ``tmp_path``)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CSPAN_")}
    clean.update(CSPAN_STATE_DIR=str(tmp_path), **env)
    return subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", "backends", "env"],
        capture_output=True,
        text=True,
        env=clean,
        timeout=120,
    )


def test_a_misspelled_variable_is_warned_about_with_the_closest_name(tmp_path: Path) -> None:
    out = _cspan(tmp_path, CSPAN_MAX_SESION="64", CSPAN_ASR_SERVE_PROT="8991", CSPAN_NOTHING_LIKE_ANY="1")
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "is not a cspan setting" in line]
    assert len(warnings) == 3, out.stderr  # once per variable
    assert warnings[0].endswith(
        "WARNING cspan.core.environment: CSPAN_ASR_SERVE_PROT is not a cspan setting "
        "(did you mean CSPAN_ASR_SERVE_PORT?); it is ignored"
    )
    assert warnings[1].endswith(
        "CSPAN_MAX_SESION is not a cspan setting (did you mean CSPAN_MAX_SESSIONS?); it is ignored"
    )
    assert warnings[2].endswith("CSPAN_NOTHING_LIKE_ANY is not a cspan setting; it is ignored")
    assert "no backends are running" in out.stderr  # the verb still ran


@pytest.mark.parametrize(
    "env",
    [
        {"CSPAN_MAX_SESSIONS": "64"},  # cspan serve's setting: one environment file serves every verb
        {"CSPAN_ASR_SERVE_PORT": "8991", "CSPAN_ASR_TOKEN": "a-long-token"},  # cspan asr-serve's, and its older name
        {"CSPAN_FIXTURES": "/nowhere", "CSPAN_FUSED": "0"},  # read by name (DIRECT_ENV)
    ],
    ids=["serve-setting", "asr-serve-setting", "read-by-name"],
)
def test_a_known_variable_is_not_warned_about(tmp_path: Path, env: dict[str, str]) -> None:
    out = _cspan(tmp_path, **env)
    assert out.returncode == 0, out.stderr
    assert "is not a cspan setting" not in out.stderr
    assert "WARNING" not in out.stderr


def test_a_variable_the_command_line_names_is_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    environ = {"CSPAN_JUDGE_KEY": "k", "CSPAN_OTHER_KEY": "k"}
    argv = ["bench", "qa", "--judge-key-env", "CSPAN_JUDGE_KEY", "--x=CSPAN_OTHER_KEY"]
    assert warn_unknown_env(environ, [], argv=argv) == []
    assert warn_unknown_env(environ, [], argv=[]) == ["CSPAN_JUDGE_KEY", "CSPAN_OTHER_KEY"]


def test_the_known_names_come_from_every_installed_verbs_model() -> None:
    models = settings_models(build_parser())
    names = {m.__name__ for m in models}
    assert {"ServeSettings", "InferSettings", "ASRServeSettings"} <= names
    known = known_env_names(models)
    assert {"CSPAN_MAX_SESSIONS", "CSPAN_LEAD_SILENCE", "CSPAN_ASR_SERVE_MAX_UPLOAD_MB", "CSPAN_FIXTURES"} <= known
    assert "CSPAN_ASR_SERVE_MAX_SESSIONS" not in known


def test_a_model_variable_in_lower_case_is_read_and_another_setting_is_not_suggested() -> None:
    """pydantic-settings reads a model's variables in any case (its models are not case_sensitive): no warning for
    CSPAN_max_sessions, whose value is used; a name close in letters but another thing gets no suggestion."""
    models = settings_models(build_parser())
    environ = {"CSPAN_max_sessions": "4", "CSPAN_ADMIN_TOKEN": "x", "CSPAN_max_sesion": "4", "CSPAN_FIXTURES": "."}
    assert unknown_env(environ, models) == [("CSPAN_ADMIN_TOKEN", None), ("CSPAN_max_sesion", "CSPAN_MAX_SESSIONS")]


class _Nested(BaseModel):
    depth: int = 1


class _Aliased(BaseSettings):
    model_config = SETTINGS_CONFIG | SettingsConfigDict(env_nested_delimiter="__")

    plain: int = 0
    named: int = Field(0, validation_alias=AliasChoices("OTHER_NAME", "CSPAN_SECOND"))
    nested: _Nested = _Nested()


def test_names_follow_pydantic_settings_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefix and field, aliases without the prefix (as pydantic-settings reads them), nested fields by pattern."""
    exact = {"CSPAN_PLAIN", "OTHER_NAME", "CSPAN_SECOND", "CSPAN_NESTED"}
    assert settings_env_names(_Aliased) == exact | {f"{name}__*" for name in exact}
    monkeypatch.setenv("CSPAN_SECOND", "3")
    monkeypatch.setenv("CSPAN_NESTED__DEPTH", "4")
    assert (_Aliased().named, _Aliased().nested.depth) == (3, 4)  # what the names say is what pydantic reads
    environ = {"CSPAN_SECOND": "3", "CSPAN_NESTED__DEPTH": "4", "CSPAN_NAMED": "5", "CSPAN_PLAN": "1"}
    assert unknown_env(environ, [_Aliased]) == [("CSPAN_NAMED", None), ("CSPAN_PLAN", "CSPAN_PLAIN")]


_READ = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*["'](CSPAN_\w+)["']""")


def test_every_variable_read_by_name_is_declared_once() -> None:
    """Every ``"CSPAN_..."`` name of the packages' sources (constants and ``os.environ`` reads) and every one read
    from the environment by the tests and noxfile.py is in DIRECT_ENV, and every name of DIRECT_ENV is read."""
    in_sources = set()
    for path in REPO.glob("packages/*/src/**/*.py"):
        in_sources |= {n for n in re.findall(r"""["'](CSPAN_\w+)["']""", path.read_text()) if not n.endswith("_")}
    read_by_tools = set()
    for path in [*REPO.glob("tests/**/*.py"), REPO / "noxfile.py"]:
        read_by_tools |= set(_READ.findall(path.read_text()))
    read = in_sources | read_by_tools
    assert read - set(DIRECT_ENV) == set(), "read by name but not in cspan.core.environment.DIRECT_ENV"
    assert set(DIRECT_ENV) - read == set(), "in DIRECT_ENV but read nowhere"


_PLAIN_VALUES: dict[str, tuple[str, object]] = {
    # a repeatable setting's field: one plain value for its variable, and the item the setting then holds
    "span": ("0.5:From env, with a comma", "0.5:From env, with a comma"),
    "force_ret_at": ("0.5", 0.5),
    "mcp": ("https://a.example/mcp", "https://a.example/mcp"),
    "allow_origin": ("https://talk.example.org", "https://talk.example.org"),
    "allow_host": ("talk.example.org", "talk.example.org"),
    "allowed_host": ("talk.example.org:443", "talk.example.org:443"),
}


def _list_fields() -> list[tuple[type[BaseSettings], str]]:
    """Every list-typed setting of every installed verb's model."""
    return [
        (model, name)
        for model in settings_models(build_parser())
        for name, field in model.model_fields.items()
        if get_origin(field.annotation) is list
    ]


def test_every_repeatable_setting_takes_one_plain_value_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/OPERATORS.md: a repeatable flag's variable takes one value as it is, or a JSON list for several. Every
    list-typed field of every verb's model is held to it (CSPAN_SPAN="0.5:From env" was refused with
    pydantic-settings' 'error parsing value for field "span" from source "EnvSettingsSource"')."""
    fields = _list_fields()
    assert {name for _, name in fields} == set(_PLAIN_VALUES), "give each repeatable setting a plain value here"
    assert len(fields) >= 7  # infer: mcp, span, force_ret_at; serve: mcp, allow_origin, allow_host; asr-serve
    for name in os.environ:
        if name.startswith("CSPAN_"):
            monkeypatch.delenv(name)
    required = {"input_wav": tmp_path / "in.wav", "output_wav": tmp_path / "out.wav"}  # cspan infer's
    for model, name in fields:
        env = f"{model.model_config.get('env_prefix', '')}{name}".upper()
        given = {k: v for k, v in required.items() if k in model.model_fields}
        plain, item = _PLAIN_VALUES[name]
        with monkeypatch.context() as m:
            m.setenv(env, plain)
            value = getattr(load_settings(model, given), name)
            assert [getattr(v, "url", v) for v in value] == [item], (env, value)  # an MCP server is parsed
            m.setenv(env, json.dumps([plain, plain]))  # several: a JSON list
            assert len(getattr(load_settings(model, given), name)) == 2, env
            m.setenv(env, "")
            assert getattr(load_settings(model, given), name) == [], env
            m.setenv(env, "[" + plain)
            with pytest.raises(SettingsError, match=rf"{env}: starts with '\[' but is not a JSON list"):
                load_settings(model, given)
            assert getattr(load_settings(model, {**given, name: [plain]}), name) != [], env  # the flag wins
