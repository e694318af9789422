"""cspan.core.settings: repeated flags taken verbatim, every decoding failure as one line naming its source."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings

from cspan.core import cli
from cspan.core.settings import SETTINGS_CONFIG, SettingsError, load_settings


class ListSettings(BaseSettings):
    """A verb with repeatable flags."""

    model_config = SETTINGS_CONFIG

    note: list[str] = Field(default_factory=list, description="repeatable text")
    at: list[Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(default_factory=list, description="times")
    name: str = Field("x", max_length=10, description="a name (default: x, the letter)")

    @field_validator("name")
    @classmethod
    def _no_digits(cls, value: str) -> str:
        if any(c.isdigit() for c in value):
            raise ValueError("no digits, please")
        return value

    def run(self) -> int:
        print(f"RUN note={self.note!r} at={self.at!r}")
        return 0


def _settings(argv: list[str]) -> ListSettings:
    from cspan.core.settings import settings_from_args

    return settings_from_args(cli.build_parser({"demo": ListSettings}).parse_args(["demo", *argv]))


@pytest.mark.parametrize(
    "values",
    [
        ["1.0:Hello, world"],
        ['say "hi"', "[1,2]", '["a","b"]', "{}", "a,b,c", ""],
        ["trailing backslash \\", "null", "true", "3"],
    ],
)
def test_repeated_flags_are_taken_verbatim(values):
    argv = [x for v in values for x in ("--note", v)]
    assert _settings(argv).note == values


@pytest.mark.parametrize("bad", ["nan", "inf", "-1", "abc", "1,2"])
def test_bad_item_of_a_repeated_flag_names_the_flag(bad):
    with pytest.raises(SettingsError, match=r"^--at / CSPAN_AT") as err:
        _settings(["--at", "1", "--at", bad])
    assert err.value.exit_code == 2


def test_malformed_list_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("CSPAN_NOTE", "[1,")
    with pytest.raises(SettingsError, match="CSPAN_NOTE"):
        load_settings(ListSettings)


def test_messages_are_short_and_plain(capsys, monkeypatch):
    with pytest.raises(SettingsError) as err:
        _settings(["--name", "y" * 50_000])
    assert len(str(err.value)) < 300 and "(50000 characters)" in str(err.value)
    with pytest.raises(SettingsError, match=r"^--name / CSPAN_NAME: no digits, please \(got 'a1'\)$"):
        _settings(["--name", "a1"])
    monkeypatch.setattr(cli, "discover_commands", lambda: {"demo": ListSettings})
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "(default: x, the letter)" in out and "(default: x)" not in out
