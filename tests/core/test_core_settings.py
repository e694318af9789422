"""Settings declared once (cspan.core.settings): flags, environment and settings file from one pydantic model."""

from __future__ import annotations

import logging
import os

import pytest
from pydantic import Field
from pydantic_settings import BaseSettings

from cspan.core import cli
from cspan.core.settings import SETTINGS_CONFIG, SettingsError, load_settings


class DemoSettings(BaseSettings):
    """A demo verb."""

    model_config = SETTINGS_CONFIG

    host: str = Field("127.0.0.1", description="address", json_schema_extra={"group": "server"})
    port: int = Field(8080, ge=0, le=65535, description="port", json_schema_extra={"group": "server"})
    temp: float = Field(0.8, ge=0, allow_inf_nan=False, description="temperature")
    allow_origin: list[str] = Field(default_factory=list, description="origins")
    test_hooks: bool = Field(False, description="hooks", json_schema_extra={"hidden": True})

    def run(self) -> int:
        print(
            f"RUN host={self.host} port={self.port} temp={self.temp} origins={self.allow_origin} "
            f"hooks={self.test_hooks}"
        )
        return 0


def _main(argv: list[str]) -> int:
    parser = cli.build_parser({"demo": DemoSettings})
    args = parser.parse_args(argv)
    return int(args.handler(args))


def test_flags_are_generated_and_parsed(capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(["demo", "--port", "9001", "--allow-origin", "a", "--allow-origin", "b", "--test-hooks"]) == 0
    assert "RUN host=127.0.0.1 port=9001 temp=0.8 origins=['a', 'b'] hooks=True" in capsys.readouterr().out


def test_help_lists_groups_and_hides_hidden(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "server:" in out and "--port" in out and "--config FILE" in out
    assert "--test-hooks" not in out


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["--port", "70000"], "--port"),
        (["--port", "-1"], "--port"),
        (["--temp", "inf"], "--temp"),
        (["--temp", "nan"], "--temp"),
        (["--temp", "-0.5"], "--temp"),
        (["--port", "eighty"], "--port"),
    ],
)
def test_out_of_range_values_name_the_flag(argv: list[str], expect: str) -> None:
    with pytest.raises(SettingsError) as info:
        _main(["demo", *argv])
    assert expect in str(info.value)
    assert info.value.exit_code == 2


def test_cli_main_exits_2_with_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "discover_commands", lambda: {"demo": DemoSettings})
    assert cli.main(["demo", "--port", "70000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cspan demo: error: --port") and "Traceback" not in err


def test_precedence_cli_env_file_default(tmp_path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    conf = tmp_path / "cspan.toml"
    conf.write_text('port = 1\n[demo]\nport = 2\ntemp = 0.25\nallow-origin = ["x"]\n', encoding="utf-8")
    assert _main(["demo", "--config", str(conf)]) == 0
    assert "port=2 temp=0.25 origins=['x']" in capsys.readouterr().out  # the [demo] table wins over the top level
    monkeypatch.setenv("CSPAN_PORT", "3")
    assert _main(["demo", "--config", str(conf)]) == 0
    assert "port=3 temp=0.25" in capsys.readouterr().out  # environment over file
    assert _main(["demo", "--config", str(conf), "--port", "4"]) == 0
    assert "port=4 temp=0.25" in capsys.readouterr().out  # command line over environment
    monkeypatch.delenv("CSPAN_PORT")
    conf.write_text("temp = 0.5\n[demo]\nport = 2\n[infer]\nport = 9\n", encoding="utf-8")
    assert _main(["demo", "--config", str(conf)]) == 0
    assert "port=2 temp=0.5" in capsys.readouterr().out  # the top level is read beside the [demo] table
    conf.write_text('input-wav = "a.wav"\n[demo]\nport = 2\n', encoding="utf-8")
    with pytest.raises(
        SettingsError, match=r"unknown key 'input-wav' at the top level, which every command reads, for `cspan demo`"
    ):
        load_settings(DemoSettings, config=conf, verb="demo")


def test_bad_settings_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.toml"
    bad.write_text("port = [", encoding="utf-8")
    with pytest.raises(SettingsError, match="not valid TOML") as info:
        load_settings(DemoSettings, config=bad, verb="demo")
    assert "config.json" not in str(info.value)
    model_config = tmp_path / "config.json"  # Moshi's --config: the model's config, JSON
    model_config.write_text('{"dim": 4096, "num_heads": 32}', encoding="utf-8")
    with pytest.raises(SettingsError, match=r"not a model's config\.json .* given with --checkpoint"):
        load_settings(DemoSettings, config=model_config, verb="demo")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("prot = 1\n", encoding="utf-8")
    with pytest.raises(SettingsError, match=r"unknown key 'prot' .*\(did you mean 'port'\?\)$"):
        load_settings(DemoSettings, config=unknown, verb="demo")  # the closest key, not the list
    ranged = tmp_path / "range.toml"
    ranged.write_text("port = 99999\n", encoding="utf-8")
    with pytest.raises(SettingsError, match=r"range\.toml: port"):
        load_settings(DemoSettings, config=ranged, verb="demo")
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(DemoSettings, config=tmp_path / "missing.toml", verb="demo")


class TypedSettings(BaseSettings):
    """Boolean, numeric and list fields, as a settings file gives them."""

    model_config = SETTINGS_CONFIG

    slots: int = Field(1, ge=1)
    limit: int | None = Field(None, ge=0)
    temp: float = Field(0.8, ge=0, allow_inf_nan=False)
    graphs: bool = True
    marks: list[float] = Field(default_factory=list)
    name: str = "x"


@pytest.mark.parametrize(
    ("line", "expect"),
    [
        ("slots = true", "slots: must be a whole number, not true$"),
        (
            'slots = "3"',
            r'slots: must be a whole number, not "3" \(TOML values are typed: write 3, without the quotes\)',
        ),
        ("limit = false", "limit: must be a whole number, not false$"),
        ("temp = true", "temp: must be a number, not true$"),
        ('temp = "0.5"', r'temp: must be a number, not "0.5" \(TOML values are typed: write 0.5, without'),
        ("graphs = 1", "graphs: must be true or false, not 1$"),
        ('graphs = "yes"', 'graphs: must be true or false, not "yes"$'),
        (
            'graphs = "false"',
            r'graphs: must be true or false, not "false" \(TOML values are typed: write false, without the quotes\)',
        ),
        ('marks = [1.0, "2"]', r'marks: an item must be a number, not "2" \(TOML values are typed: write 2,'),
        ('marks = "1.5"', r'marks: must be a list, not "1.5" \(TOML values are typed: write \[1.5, 3\] for two'),
        ('marks = "[true, 2]"', r'marks: must be a list, not "\[true, 2\]"'),
        ("slots = 2024-01-01", "slots: must be a whole number, not 2024-01-01$"),
        ("graphs = 07:32:00", "graphs: must be true or false, not 07:32:00$"),
        ("marks = [1979-05-27T07:32:00Z]", "marks: an item must be a number, not 1979-05-27T07:32:00[+]00:00$"),
    ],
)
def test_a_settings_files_values_are_taken_as_typed(tmp_path, line: str, expect: str) -> None:  # type: ignore[no-untyped-def]
    """TOML values are typed: a file's ``true`` or ``"3"`` is refused for a number and ``1`` or ``"yes"`` for a boolean,
    naming the file and key (was: converted, ``slots = true`` ran one slot), as a client's message is."""
    path = tmp_path / "typed.toml"
    path.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(SettingsError, match=f"^settings file {path}: {expect}"):
        load_settings(TypedSettings, config=path, verb="demo")


def test_a_settings_files_typed_values_are_taken(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """What a file writes as its field's type is taken: an integer for a number, a whole float for a whole number
    (pydantic's rule), ``false``, a list of numbers, text."""
    path = tmp_path / "typed.toml"
    path.write_text(
        'slots = 3.0\nlimit = 7\ntemp = 2\ngraphs = false\nmarks = [1, 2.5]\nname = "y"\n', encoding="utf-8"
    )
    got = load_settings(TypedSettings, config=path, verb="demo")
    assert (got.slots, got.limit, got.temp, got.graphs, got.marks, got.name) == (3, 7, 2.0, False, [1.0, 2.5], "y")


def test_a_home_folder_in_a_settings_file_is_expanded(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from cspan.server.serve_settings import ServeSettings

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "notes").mkdir()
    config = tmp_path / "serve.toml"
    config.write_text('[serve]\nknowledge = "~/notes"\n', encoding="utf-8")
    assert load_settings(ServeSettings, config=config, verb="serve").knowledge == tmp_path / "notes"


def test_test_switches_come_from_the_command_line_only(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A hidden field (``--test-hooks``) in a settings file or the environment is refused, not applied: a stray
    file or variable must not turn test hooks on for a public server."""
    hooks = tmp_path / "hooks.toml"
    hooks.write_text("[demo]\ntest-hooks = true\n", encoding="utf-8")
    with pytest.raises(
        SettingsError, match=r"'test-hooks' is --test-hooks, a test switch taken from the command line only \(remove it"
    ):
        load_settings(DemoSettings, config=hooks, verb="demo")
    hooks.write_text("test_hooks = true\n", encoding="utf-8")  # as a settings file of e3b68c5 could hold it
    with pytest.raises(SettingsError, match=r"'test_hooks' is --test-hooks, a test switch"):
        load_settings(DemoSettings, config=hooks, verb="demo")
    monkeypatch.setenv("CSPAN_TEST_HOOKS", "1")
    with pytest.raises(SettingsError, match="CSPAN_TEST_HOOKS: --test-hooks is a test switch, taken from the command"):
        load_settings(DemoSettings)
    monkeypatch.delenv("CSPAN_TEST_HOOKS")
    assert load_settings(DemoSettings, {"test_hooks": True}).test_hooks


def test_environment_values_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CSPAN_TEMP", "inf")
    with pytest.raises(SettingsError, match="CSPAN_TEMP"):
        load_settings(DemoSettings)


@pytest.mark.parametrize(
    ("flags", "hidden"),
    [
        ({"router": "http://bob:pw-Secret1@h:99999/v1"}, "bob:***@h"),
        ({"router": "ftp://bob:pw-Secret1@h/v1"}, "bob:***@h"),
        ({"asr": "ftp://h/v1?api_key=pw-Secret1"}, "api_key=***"),
        ({"asr": "ftp://h/v1?session_id=pw-Secret1"}, "session_id=***"),  # the backends' SECRET_PARAM names
    ],
)
def test_a_password_in_a_refused_url_is_not_echoed(flags: dict[str, str], hidden: str) -> None:
    from cspan.server.serve_settings import ServeSettings

    with pytest.raises(SettingsError) as caught:
        load_settings(ServeSettings, flags)
    assert "pw-Secret1" not in str(caught.value) and hidden in str(caught.value)


def test_a_bad_flag_is_named_as_the_flag_even_when_the_file_sets_it_too(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    conf = tmp_path / "cspan.toml"
    conf.write_text('[demo]\nport = 2\nallow-origin = ["x"]\n', encoding="utf-8")
    parser = cli.build_parser({"demo": DemoSettings})
    with pytest.raises(SettingsError, match=r"^--port / CSPAN_PORT: .*less than or equal to 65535"):
        args = parser.parse_args(["demo", "--config", str(conf), "--port", "70000"])
        args.handler(args)
    with pytest.raises(SettingsError, match=r"^--allow-origin / CSPAN_ALLOW_ORIGIN: "):
        load_settings(DemoSettings, {"allow_origin": [5]}, config=conf, verb="demo")


def test_a_table_that_names_no_verb_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A misspelled ``[sevre]`` would leave every setting under it unread, the server on its defaults."""
    conf = tmp_path / "cspan.toml"
    conf.write_text("[dmeo]\nport = 2\n", encoding="utf-8")
    with pytest.raises(
        SettingsError, match=r"cspan\.toml: \[dmeo\] names no installed cspan verb \(installed: .*demo.*serve"
    ):
        load_settings(DemoSettings, config=conf, verb="demo")
    conf.write_text("port = { a = 1 }\n", encoding="utf-8")  # a setting given as a table: its type is refused
    with pytest.raises(SettingsError, match=r"cspan\.toml: port: must be a whole number, not {a = 1}$"):
        load_settings(DemoSettings, config=conf, verb="demo")


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_a_credential_in_a_file_others_can_read_is_warned_about(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    from cspan.server.serve_settings import ServeSettings

    conf = tmp_path / "serve.toml"
    conf.write_text('[serve]\ntoken = "a-long-Secret-token"\ndb = "postgresql://u:pw@h/db"\n', encoding="utf-8")
    conf.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="cspan.core.settings"):
        load_settings(ServeSettings, config=conf, verb="serve")
    assert "holds a credential (token, db) and can be read by other users (mode 644); chmod 600" in caplog.text
    assert "a-long-Secret-token" not in caplog.text and "pw@" not in caplog.text
    caplog.clear()
    conf.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="cspan.core.settings"):
        load_settings(ServeSettings, config=conf, verb="serve")
    conf.write_text("[serve]\nport = 8081\n", encoding="utf-8")
    conf.chmod(0o644)  # nothing secret in it: no warning
    with caplog.at_level(logging.WARNING, logger="cspan.core.settings"):
        load_settings(ServeSettings, config=conf, verb="serve")
    assert caplog.text == ""
