"""`cspan infer` under bad input and failing surroundings: settings, outputs, backends, the Context DB, signals.

Every case is a cause of issue 22 with several inputs: the error is one line naming what and where, nothing is
loaded before the cheap checks fail, finished work is never thrown away, and a killed run leaves no file behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from fs_faults import fill, read_only_folder, tmpfs
from serve_process import sigint_default

from cspan.backends.context_db import ContextDB
from cspan.core import cli
from cspan.core.errors import CspanError, OutputError, SettingsError
from cspan.core.settings import settings_from_args
from cspan.server.infer import run_infer
from cspan.server.output import InferOutput


@pytest.fixture(scope="module")
def speech(fixtures_dir) -> Path:
    return fixtures_dir / "audio" / "greeting_24k.wav"


def _argv(ckpt: Path, inp: Path, out: Path, *extra: str) -> list[str]:
    return [
        "infer", "--input-wav", str(inp), "--output-wav", str(out / "out.wav"), "--output-text", str(out / "out.json"),
        "--checkpoint", str(ckpt), "--device", "cpu", "--seed", "7", "--quiet",
        "--lead-silence", "0.5", "--tail-silence", "1", "--asr", "none", "--router", "none", *extra,
    ]  # fmt: skip


def _settings(argv: list[str]):
    return settings_from_args(cli.build_parser().parse_args(argv))


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything tries to load a checkpoint (the cheap checks must come first)."""
    import cspan.core.checkpoint as checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the bad input was refused")

    monkeypatch.setattr(checkpoint, "load_checkpoint", refuse)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: nothing listens there


def _cspan(*argv: str | bytes, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", *argv], capture_output=True, timeout=timeout, **kwargs
    )


# ------------------------------------------------------------------------------------------------- settings

BAD_SETTINGS = [
    (["--lead-silence", "inf"], "--lead-silence"),
    (["--lead-silence", "nan"], "--lead-silence"),
    (["--lead-silence", "1e7"], "--lead-silence"),
    (["--lead-silence", "-1"], "--lead-silence"),
    (["--tail-silence", "601"], "--tail-silence"),
    (["--span-delay-s", "inf"], "--span-delay-s"),
    (["--listen-s", "0"], "--listen-s"),
    (["--listen-s", "inf"], "--listen-s"),
    (["--listen-s", "1e9"], "--listen-s"),
    (["--span-deadline-s", "nan"], "--span-deadline-s"),
    (["--span-deadline-s", "0"], "--span-deadline-s"),
    (["--seed", str(2**63)], "--seed"),
    (["--seed", "-1"], "--seed"),
    (["--seed", "1.5"], "--seed"),
    (["--seed", "99999999999999999999999"], "--seed"),
    (["--temp", "inf"], "--temp"),
    (["--temp", "nan"], "--temp"),
    (["--temp", "1e-300"], "--temp"),
    (["--temp", "11"], "--temp"),
    (["--temp-text", "-0.1"], "--temp-text"),
    (["--max-seconds", "inf"], "--max-seconds"),
    (["--max-seconds", "0"], "--max-seconds"),
    (["--channel", "-1"], "--channel"),
    (["--force-ret-at", "nan"], "--force-ret-at"),
    (["--force-ret-at", "inf"], "--force-ret-at"),
    (["--force-ret-at", "-1"], "--force-ret-at"),
    (["--span", "x:hello"], "--span"),
    (["--span", "nan:hello"], "--span"),
    (["--span", "inf:hello"], "--span"),
    (["--span", "1.0"], "--span"),
    (["--span", "1.0:   "], "--span"),
    (["--span", "1.0:\x08\x09"], "--span"),  # control characters only: read as spaces
    (["--span", "1.0:\u200b"], "--span"),  # format characters only: SentencePiece reads no token
    (["--span", "1.0: \ufeff "], "--span"),
    (["--asr", "whisper"], "--asr"),
    (["--asr", "http://"], "--asr"),
    (["--asr", "http://127.0.0.1:99999"], "--asr"),
    (["--router", "notaurl"], "--router"),
    (["--router", "ftp://example.com/v1"], "--router"),
    (["--knowledge", "/nonexistent/notes"], "--knowledge"),
    (["--user-tz", "Mars/Olympus_Mons"], "--user-tz"),
    (["--user-tz", "../../etc/passwd"], "--user-tz"),
    (["--text-prompt", "x" * 51_000], "--text-prompt"),
    (["--user-name", "n" * 500], "--user-name"),
    (["--output-wav", "OUT.m4a"], "--output-wav"),
    (["--output-wav", "out"], "--output-wav"),
    (["--output-wav", "."], "--output-wav"),  # a folder: the same exit status and flag for both outputs
    (["--output-text", "."], "--output-text"),
    (["--checkpoint", ""], "--checkpoint"),  # an unset variable in a script, not a request for the default
    (["--db", "mysql://h/db"], "--db"),
]


@pytest.mark.parametrize(("extra", "flag"), BAD_SETTINGS, ids=[" ".join(a)[:40] for a, _ in BAD_SETTINGS])
def test_bad_settings_are_one_line_exit_2_before_anything(extra, flag, speech, tmp_path, capsys, no_model_load):
    argv = ["infer", "--input-wav", str(speech), "--output-wav", str(tmp_path / "o.wav"), *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cspan infer: error: {flag} / CSPAN_"), err
    assert err.count("\n") == 1 and len(err) < 600 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--channel", "1"], "--channel 1: .* has 1 channel\\(s\\), numbered 0 to 0"),
        (["--span", "99:too late"], "--span at 99 s is past the end of the conversation"),
        (["--force-ret-at", "500"], "--force-ret-at at 500 s is past the end of the conversation"),
        (["--voice", "nosuchvoice"], "--voice nosuchvoice: .*not a known voice \\(known voices: tiny0, tiny1\\)"),
        # text the tokenizer reads as nothing (its own word-start mark, U+FFFD): it would never be injected
        (["--span", "0.5:ok", "--span", "1.0:\u2581"], "--span at 1 s: ContextSpan: the reference '\u2581' encodes"),
        (["--span", "1.0:\ufffd"], "--span at 1 s: ContextSpan: the reference '\ufffd' encodes to no tokens"),
    ],
    ids=["channel", "span", "force-ret-at", "voice", "span-mark", "span-replacement"],
)
def test_settings_that_do_not_fit_the_input_or_the_checkpoint_exit_2(extra, message, speech, tiny_checkpoint_dir,
                                                                      tmp_path, capsys):  # fmt: skip
    """A bad setting is exit status 2 with its flag first, whether its range is wrong or it does not fit the
    recording (a channel it lacks, a time past its end) or the checkpoint (a voice it does not have)."""
    argv = ["infer", "--input-wav", str(speech), "--output-wav", str(tmp_path / "o.wav"), "--asr", "none",
            "--router", "none", "--checkpoint", str(tiny_checkpoint_dir), "--device", "cpu", "--quiet", *extra]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert re.match(f"cspan infer: error: {message}", err), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_folder_made_after_the_settings_were_read_is_refused_with_its_flag(tmp_path):
    from cspan.core.errors import SettingsError
    from cspan.server.infer import check_outputs

    folder = tmp_path / "o.json"
    folder.mkdir()
    with pytest.raises(SettingsError, match=rf"^--output-text {re.escape(str(folder))}: is a directory"):
        check_outputs([], {"--output-wav": tmp_path / "o.wav", "--output-text": folder})


def test_past_the_end_says_the_times_are_rounded_to_whole_frames(tmp_path, capsys, no_model_load):
    """A 2.74 s input and a 0.5 s tail are 35 and 7 frames: 2.80 s + 0.56 s, which is the 3.36 s limit given."""
    inp = tmp_path / "in.wav"
    sf.write(inp, np.full(65_760, 0.1, dtype=np.float32), 24_000)  # 2.74 s
    argv = ["infer", "--input-wav", str(inp), "--output-wav", str(tmp_path / "o.wav"), "--lead-silence", "0.5",
            "--tail-silence", "0.5", "--asr", "none", "--router", "none", "--span", "100:x"]  # fmt: skip
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        "cspan infer: error: --span at 100 s is past the end of the conversation (input 2.74 s + 0.5 s tail, each "
        "rounded up to whole 80 ms frames: 2.80 s + 0.56 s); use a time below 3.36 s\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.wav"]


def test_without_seed_the_seed_is_fixed_and_help_and_docs_say_how_to_vary_it(speech, tmp_path, capsys, repo_root):
    """PersonaPlex's ``--seed -1`` (no seed) is refused here (above): the default is a fixed seed, so the help and
    docs/COMING-FROM-MOSHI.md say how to get a different one each run."""
    assert _settings(["infer", "--input-wav", str(speech), "--output-wav", str(tmp_path / "o.wav")]).seed == 42424242
    with pytest.raises(SystemExit):
        cli.main(["infer", "--help"])
    assert "e.g. --seed $RANDOM" in " ".join(capsys.readouterr().out.split())
    row = next(r for r in (repo_root / "docs" / "COMING-FROM-MOSHI.md").read_text().splitlines() if "--seed N" in r)
    assert "no `-1`" in row and "fixed default" in row and "`--seed $RANDOM`" in row


def test_bad_settings_from_the_environment_and_a_settings_file(speech, tmp_path, monkeypatch, capsys, no_model_load):
    base = ["infer", "--input-wav", str(speech), "--output-wav", str(tmp_path / "o.wav")]
    monkeypatch.setenv("CSPAN_LEAD_SILENCE", "inf")
    assert cli.main(base) == 2
    assert "CSPAN_LEAD_SILENCE" in capsys.readouterr().err
    monkeypatch.delenv("CSPAN_LEAD_SILENCE")
    conf = tmp_path / "cspan.toml"
    conf.write_text("[infer]\nlead-silence = 1e7\n", encoding="utf-8")
    assert cli.main([*base, "--config", str(conf)]) == 2
    assert f"{conf}: lead-silence" in capsys.readouterr().err
    monkeypatch.setenv("CSPAN_ROUTER_URL", "not a url")  # the name `cspan backends env` prints
    assert cli.main(base) == 2
    assert "--router" in capsys.readouterr().err


def test_span_text_is_taken_verbatim_and_legacy_env_names_are_read(speech, tmp_path, monkeypatch):
    monkeypatch.setenv("CSPAN_ASR_URL", "http://127.0.0.1:8990")
    monkeypatch.setenv("CSPAN_ROUTER_URL", "http://127.0.0.1:8000/v1")
    s = _settings(
        ["infer", "--input-wav", str(speech), "--output-wav", str(tmp_path / "o.flac"),
         "--span", '1.0:Hello, "world" [1,2]', "--span", "2:a,b", "--force-ret-at", "3"]
    )  # fmt: skip
    assert [(t.seconds, t.text) for t in s.spans] == [(1.0, 'Hello, "world" [1,2]'), (2.0, "a,b")]
    assert s.force_ret_at == [3.0]
    assert (s.asr, s.router) == ("http://127.0.0.1:8990", "http://127.0.0.1:8000/v1")
    monkeypatch.setenv("CSPAN_ASR", "none")  # the generated name wins over the legacy one
    assert _settings(["infer", "--input-wav", str(speech), "--output-wav", "o.wav"]).asr == "none"


@pytest.mark.parametrize("raw", [b"caf\xe9", b"\xff\xfeprompt", b"ok \xc3"])
def test_a_text_prompt_that_is_not_utf8_is_refused_in_one_line(raw, speech, tmp_path):
    proc = _cspan(
        b"infer", b"--input-wav", os.fsencode(speech), b"--output-wav", os.fsencode(tmp_path / "o.wav"),
        b"--text-prompt", raw, timeout=120,
    )  # fmt: skip
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, err
    assert err.startswith("cspan infer: error: --text-prompt") and "not valid UTF-8" in err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--device", "tpu"], r"--device tpu: not a device torch knows; use cpu, cuda or cuda:N"),
        (["--voice", "no/such/voice.wav"], r"--voice no/such/voice\.wav: no such file; pass a voice name, "),
        (["--output-text", "{out}/out.wav"], r"--output-wav and --output-text are the same file: .*/out\.wav; use "),
    ],
    ids=["device", "voice-file", "same-output"],
)
def test_settings_refused_before_loading_name_their_flag_and_exit_2(extra, message, speech, tiny_checkpoint_dir,
                                                                     tmp_path, capsys, no_model_load):  # fmt: skip
    """A device torch does not know, a --voice file that is not there, one file for both outputs: bad settings
    (exit status 2), one short line naming the flag, before the model loads."""
    extra = [arg.format(out=tmp_path / "out") for arg in extra]
    argv = [*_argv(tiny_checkpoint_dir, speech, tmp_path / "out"), *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(f"cspan infer: error: {message}.*\n", err), err
    assert err.count("\n") == 1 and len(err) < 300
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # the outputs' folder may have been made


# ------------------------------------------------------------------------------ outputs, before anything loads


def test_output_folders_that_cannot_be_written_are_refused_before_loading(
    tiny_checkpoint_dir, speech, tmp_path, no_model_load
):
    (tmp_path / "afile").write_text("x")
    cases = [
        (["--output-wav", str(tmp_path / "afile" / "o.wav")], r"afile/o\.wav: cannot write: not a directory"),
        (["--output-text", str(tmp_path / "afile" / "sub" / "o.json")], r"o\.json: cannot write: not a directory"),
    ]
    with read_only_folder(tmp_path / "ro") as ro:
        cases += [
            (["--output-wav", str(ro / "o.wav")], f"{ro / 'o.wav'}: cannot write: "),
            (["--output-text", str(ro / "o.json")], f"{ro / 'o.json'}: cannot write: "),
            (["--output-text", str(ro / "new" / "o.json")], f"{ro / 'new' / 'o.json'}: cannot write: "),
        ]
        for extra, message in cases:
            argv = _argv(tiny_checkpoint_dir, speech, tmp_path / "ok", *extra)
            with pytest.raises(OutputError, match=message) as err:
                asyncio.run(run_infer(_settings(argv)))
            if str(ro) in message:
                assert "permission denied" in str(err.value) or "operation not permitted" in str(err.value)
        assert list(ro.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ok", "ro"]
    assert list((tmp_path / "ok").iterdir()) == []  # the other output was not written either


def test_a_full_or_read_only_file_system_is_refused_before_loading(
    tiny_checkpoint_dir, speech, tmp_path, no_model_load
):
    with tmpfs(tmp_path / "small", size_kb=64) as small:  # the WAV needs ~300 kB
        argv = _argv(tiny_checkpoint_dir, speech, tmp_path, "--output-wav", str(small / "o.wav"))
        with pytest.raises(OutputError, match=r"o\.wav: cannot write: no space left on device: the output needs"):
            asyncio.run(run_infer(_settings(argv)))
        assert list(small.iterdir()) == []
    with tmpfs(tmp_path / "ro", read_only=True) as ro:
        argv = _argv(tiny_checkpoint_dir, speech, tmp_path, "--output-text", str(ro / "o.json"))
        with pytest.raises(OutputError, match=r"o\.json: cannot write: read-only file system"):
            asyncio.run(run_infer(_settings(argv)))


def test_context_db_problems_name_the_db_flag_before_loading(tiny_checkpoint_dir, speech, tmp_path, no_model_load):
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a SQLite database" * 100)
    (tmp_path / "afile").write_text("x")
    newer = tmp_path / "newer.db"
    import sqlite3

    with sqlite3.connect(newer) as c:
        c.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        c.execute("INSERT INTO schema_version VALUES (999)")
    for db in (garbage, tmp_path / "afile" / "x.db", newer):
        argv = _argv(tiny_checkpoint_dir, speech, tmp_path / "out", "--db", str(db))
        with pytest.raises(CspanError, match=f"--db {db}: cannot") as err:
            asyncio.run(run_infer(_settings(argv)))
        assert "--context-db" not in str(err.value)


def test_context_db_error_through_the_cli_is_one_line(tiny_checkpoint_dir, speech, tmp_path):
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not sqlite" * 500)
    proc = _cspan(*_argv(tiny_checkpoint_dir, speech, tmp_path / "out", "--db", str(garbage)), text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"cspan infer: error: --db {garbage}: cannot open the Context DB")
    assert "--context-db" not in proc.stderr


def test_a_postgresql_server_that_refuses_is_one_line(tiny_checkpoint_dir, speech, tmp_path, capsys, no_model_load):
    """psycopg's message has a second, tab-indented line ("Is the server running on that host..."): joined."""
    pytest.importorskip("psycopg")
    url = f"postgresql://u@127.0.0.1:{_closed_port()}/db"
    assert cli.main(_argv(tiny_checkpoint_dir, speech, tmp_path / "out", "--db", url)) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"cspan infer: error: --db {url}: cannot open the Context DB: "), err
    assert err.count("\n") == 1 and "\t" not in err and "Is the server running" in err


def test_a_postgresql_url_s_password_stays_out_of_the_error(
    tiny_checkpoint_dir, speech, tmp_path, capsys, no_model_load
):
    """The --db URL's password and secret query parameters are redacted (as serve, db and users do), and the fix
    named is the server's, not 'pass a Context DB file' (was the URL as given, password and all)."""
    pytest.importorskip("psycopg")
    url = f"postgresql://dave:pw9999@127.0.0.1:{_closed_port()}/db?sslpassword=zzz"
    assert cli.main(_argv(tiny_checkpoint_dir, speech, tmp_path / "out", "--db", url)) == 1
    err = capsys.readouterr().err
    assert "pw9999" not in err and "zzz" not in err, err
    assert err.startswith("cspan infer: error: --db postgresql://dave:***@127.0.0.1:"), err
    assert "check that the server is running" in err and "Context DB file" not in err, err


def test_a_database_url_of_another_kind_is_a_bad_setting_naming_db(speech, tmp_path, capsys, monkeypatch,
                                                                     no_model_load):  # fmt: skip
    """mysql://... (flag or CSPAN_DB) is refused as a setting, exit status 2, naming --db and keeping the password out
    (was exit status 1, from the Context DB's open, with no flag named)."""
    monkeypatch.setenv("CSPAN_DB", "mysql://ann:pw9999@db.internal/cspan")
    assert cli.main(["infer", "--input-wav", str(speech), "--output-wav", str(tmp_path / "o.wav")]) == 2
    err = capsys.readouterr().err
    assert err == (
        "cspan infer: error: --db / CSPAN_DB: 'mysql' databases are not supported; the Context DB is SQLite (a file "
        "path, sqlite:///PATH or :memory:) or PostgreSQL (postgresql://...)\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_backend_errors_reaching_the_cli_are_one_line(monkeypatch, capsys):
    """Any verb: the backends' own errors (roots that cannot derive from CspanError) print like CspanError."""
    from cspan.backends.context_db import ContextDBError
    from cspan.backends.errors import RouterError

    def failing_verb(exc: BaseException) -> int:
        """``cspan demo`` whose handler raises ``exc``; returns its exit status."""

        def fail(args):
            raise exc

        def register(parser):
            parser.set_defaults(handler=fail)

        monkeypatch.setattr(cli, "discover_commands", lambda: {"demo": register})
        return cli.main(["demo"])

    for exc in (ContextDBError("cannot open Context DB 'x'"), RouterError("router at http://h answered 500")):
        assert failing_verb(exc) == 1
        err = capsys.readouterr().err
        assert err == f"cspan demo: error: {exc}\n"
    # a cause of several lines (a library's message quoted in ours) is joined into one
    for exc in (ContextDBError("--db x: failed: refused\n\tIs it running?\n"), OSError("line one\r\n  line two")):
        assert failing_verb(exc) == 1
        one = "--db x: failed: refused Is it running?" if isinstance(exc, ContextDBError) else "line one line two"
        assert capsys.readouterr().err == f"cspan demo: error: {one}\n"


@pytest.mark.parametrize("which", ["--router", "--asr"])
def test_a_backend_url_where_nothing_answers_is_refused_before_the_model_loads(
    which, tiny_checkpoint_dir, speech, tmp_path, no_model_load
):
    url = f"http://127.0.0.1:{_closed_port()}" + ("/v1" if which == "--router" else "")
    argv = _argv(tiny_checkpoint_dir, speech, tmp_path, which, url)
    with pytest.raises(CspanError, match=f"{which} {url}: nothing answers there") as err:
        asyncio.run(run_infer(_settings(argv)))
    assert "cspan backends start" in str(err.value)
    assert ("cspan asr-serve" in str(err.value)) == (which == "--asr")  # the router is not an ASR server
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_unreachable_backend_through_the_cli_is_one_line_and_a_clean_exit(tiny_checkpoint_dir, speech, tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    proc = _cspan(*_argv(tiny_checkpoint_dir, speech, tmp_path, "--router", url), text=True)
    assert proc.returncode == 1, proc.stderr  # not an abort of a thread still loading the model
    assert proc.stderr == (
        f"cspan infer: error: --router {url}: nothing answers there (connection refused); start the "
        "server (`cspan backends start`) or fix the URL, or use --router local\n"
    )


def test_model_tiny_into_a_folder_that_cannot_be_written_is_one_line(tmp_path):
    with read_only_folder(tmp_path / "ro") as ro:
        proc = _cspan("model", "tiny", str(ro / "tiny"), text=True)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(f"cspan model tiny: error: {ro / 'tiny'}") and proc.stderr.count("\n") == 1, (
        proc.stderr
    )
    assert "permission denied" in proc.stderr or "operation not permitted" in proc.stderr


# --------------------------------------------------------------------------------------- the persona's length


def test_a_voice_prompt_too_long_for_the_window_is_named_as_the_voice(tiny_checkpoint_dir, speech, tmp_path):
    """A 5000-frame voice file was blamed on --text-prompt ("Shorten the text prompt")."""
    import torch

    huge = tmp_path.parent / f"{tmp_path.name}-huge.pt"
    torch.save({"codes": torch.zeros(8, 5000, dtype=torch.long)}, huge)
    argv = _argv(tiny_checkpoint_dir, speech, tmp_path, "--voice", str(huge))
    with pytest.raises(SettingsError, match=rf"--voice {huge}: the persona takes \d+ frames \(5000 of voice prompt"):
        asyncio.run(run_infer(_settings(argv)))
    assert list(tmp_path.iterdir()) == []


def test_a_persona_too_long_for_the_window_is_refused_with_its_size(tiny_checkpoint_dir, speech, tmp_path):
    prompt = "You are a helpful assistant who answers in full sentences. " * 66  # ~3900 characters
    db = tmp_path.parent / f"{tmp_path.name}-db" / "context.sqlite"
    argv = _argv(tiny_checkpoint_dir, speech, tmp_path, "--text-prompt", prompt, "--db", str(db))
    with pytest.raises(
        SettingsError, match=r"--text-prompt: the persona takes (\d+) frames .* of the model's 3000-pos"
    ):
        asyncio.run(run_infer(_settings(argv)))
    assert list(tmp_path.iterdir()) == []
    with ContextDB(db) as memory:  # a run that never talked leaves no conversation (the profile is the user's)
        assert memory.user("local").conversations() == []


# ------------------------------------------------------------------------------------- output formats, NaN input


@pytest.mark.parametrize(("suffix", "fmt"), [(".flac", "FLAC"), (".ogg", "OGG"), (".mp3", "MP3")])
def test_output_audio_is_written_in_the_format_its_name_says(suffix, fmt, tiny_checkpoint_dir, speech, tmp_path):
    out = tmp_path / f"out{suffix}"
    argv = _argv(tiny_checkpoint_dir, speech, tmp_path, "--output-wav", str(out))
    result = asyncio.run(run_infer(_settings(argv)))
    info = sf.info(out)
    assert (info.format, info.samplerate, info.channels) == (fmt, 24_000, 2)
    assert info.duration == pytest.approx(result.output.duration_s, abs=0.1)
    assert json.loads((tmp_path / "out.json").read_text())["output_wav"] == str(out)


def test_non_finite_input_samples_are_silence_and_reported(tiny_checkpoint_dir, speech, tmp_path):
    x, sr = sf.read(speech, dtype="float32")
    x = x.copy()
    x[:50] = np.nan  # the first block: this used to read as a silent file
    x[sr // 2 : sr // 2 + 20] = np.inf  # later: this used to reach the model and the output as clicks
    x[sr : sr + 5] = -np.inf
    x[2 * sr : 2 * sr + 7] *= 1000  # loud float samples: clipped, and counted (issue 22, F19)
    x[2 * sr + 7 : 2 * sr + 9] = [1.5, -2.0]
    bad = tmp_path / "bad.wav"
    sf.write(bad, x, sr, subtype="FLOAT")
    expect_clipped = int(np.count_nonzero(np.abs(x[np.isfinite(x)]) > 1.0))
    assert expect_clipped >= 2
    result = asyncio.run(run_infer(_settings(_argv(tiny_checkpoint_dir, bad, tmp_path / "out"))))
    assert result.output.input_nonfinite_samples == 75
    assert result.output.input_clipped_samples == expect_clipped
    audio, _ = sf.read(tmp_path / "out" / "out.wav", dtype="float32")
    lead = round(result.output.input_offset_s * 24_000)
    user = audio[lead:, 0]
    assert np.isfinite(audio).all()
    assert (user[:50] == 0).all() and (user[sr // 2 : sr // 2 + 20] == 0).all() and (user[sr : sr + 5] == 0).all()


# ------------------------------------------------------------------------------------ failures while it runs


def _start(argv: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cspan.core.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_default,
        **kwargs,
    )


def _wait_for_part(folder: Path, proc: subprocess.Popen, timeout: float = 240) -> Path:
    """The audio's temporary file, once frames are in it (the conversation is running)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for part in folder.iterdir():
            try:
                if part.name.endswith(".part") and part.stat().st_size > 20_000:
                    return part
            except FileNotFoundError:
                pass
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before writing: {proc.communicate()}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("no .part file appeared")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_killed_run_removes_its_part_file(sig, tiny_checkpoint_dir, speech, tmp_path):
    """Issue 22 (F15): SIGHUP (a closed terminal) too."""
    argv = _argv(tiny_checkpoint_dir, speech, tmp_path, "--lead-silence", "120")  # long enough to be caught
    proc = _start(argv)
    _wait_for_part(tmp_path, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == (130 if sig == signal.SIGINT else 128 + sig), err
    assert "Traceback" not in err and (f"terminated by signal {int(sig)}" in err or "interrupted" in err)
    assert list(tmp_path.iterdir()) == []  # neither output, no .part


@pytest.mark.parametrize("when", ["json finished", "wav published"])
def test_a_signal_at_the_end_never_leaves_a_new_wav_beside_an_old_json(
    when, tiny_checkpoint_dir, speech, tmp_path, monkeypatch, capsys
):
    """The two outputs are published together: a SIGTERM once the JSON's temporary file is written (before either
    is in place) leaves the previous run's pair as it was; one that lands between the two renames is acted on once
    both are in place. Before, the WAV was renamed into place before the JSON was written: a signal then left the
    new run's audio beside the previous run's JSON (another seed), and exit status 143."""
    from cspan.core.audio import AtomicAudioWriter
    from cspan.server.output import InferJsonStream

    assert cli.main(_argv(tiny_checkpoint_dir, speech, tmp_path)) == 0  # the previous run's pair
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    cls, name = (InferJsonStream, "finish") if when == "json finished" else (AtomicAudioWriter, "publish")
    original = getattr(cls, name)

    def signalled(self, *args):
        if name == "publish":
            os.kill(os.getpid(), signal.SIGTERM)
        result = original(self, *args)
        if name == "finish":
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(cls, name, signalled)
    assert cli.main(_argv(tiny_checkpoint_dir, speech, tmp_path, "--seed", "8")) == 143
    assert "terminated by signal 15" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "out.wav"]  # no .part left
    if when == "json finished":
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    else:  # both are the new run's
        assert all((tmp_path / n).read_bytes() != data for n, data in before.items())
        assert json.loads((tmp_path / "out.json").read_text())["settings"]["seed"] == 8


def test_json_that_cannot_be_written_keeps_the_finished_wav(tiny_checkpoint_dir, speech, tmp_path):
    """The WAV is published; a previous run's JSON at the same path goes, so that it cannot pass for this run's."""
    with tmpfs(tmp_path / "small", size_kb=4) as small:  # room for the start-up check, not for the JSON
        (small / "o.json").write_text('{"agent_text": "an earlier run"}')
        argv = _argv(tiny_checkpoint_dir, speech, tmp_path, "--output-text", str(small / "o.json"))
        with pytest.raises(OutputError) as err:
            asyncio.run(run_infer(_settings(argv)))
        assert list(small.iterdir()) == []
    message = str(err.value)
    assert f"{small / 'o.json'}: cannot write: no space left on device" in message
    assert f"the previous {small / 'o.json'} was removed (it described another run)" in message
    assert f"({tmp_path / 'out.wav'} written)" in message
    audio, sr = sf.read(tmp_path / "out.wav")
    assert sr == 24_000 and audio.shape[1] == 2 and len(audio) > 24_000
    assert [p.name for p in tmp_path.iterdir() if p.name != "small"] == ["out.wav"]


def test_wav_that_fails_mid_run_keeps_the_complete_json(tiny_checkpoint_dir, speech, tmp_path):
    with tmpfs(tmp_path / "small", size_kb=4096) as small:
        argv = _argv(tiny_checkpoint_dir, speech, tmp_path, "--output-wav", str(small / "o.wav"), "--lead-silence", "8")
        proc = _start(argv)
        _wait_for_part(small, proc)
        fill(small)  # the disk fills up while the run writes the audio
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 1, err
        assert "Traceback" not in err
        assert f"{small / 'o.wav'}: cannot write: no space left on device" in err
        assert f"({tmp_path / 'out.json'} written)" in err
        assert sorted(p.name for p in small.iterdir()) == ["filler.bin"]  # no .part, no half WAV
    doc = InferOutput.model_validate_json((tmp_path / "out.json").read_text())
    assert doc.output_wav is None and doc.timing.frames == round(doc.duration_s * 12.5)


def test_file_names_that_are_not_utf8_work_and_are_shown_escaped(tiny_checkpoint_dir, speech, tmp_path):
    name = os.fsdecode(b"caf\xe9")  # a Latin-1 name on a UTF-8 system
    inp = tmp_path / f"{name}.wav"
    inp.write_bytes(speech.read_bytes())
    out = tmp_path / name
    argv = _argv(tiny_checkpoint_dir, inp, out)
    result = asyncio.run(run_infer(_settings(argv)))
    assert sf.info(os.fsencode(out / "out.wav")).frames == round(result.output.duration_s * 24_000)
    doc = json.loads((out / "out.json").read_bytes())
    assert doc["input"].endswith("caf\\xe9.wav") and doc["settings"]["input_wav"] == doc["input"]


# ------------------------------------------------------------------------------ what reaches the terminal


def test_forced_rets_in_one_frame_are_one_ret_with_a_warning(tiny_checkpoint_dir, speech, tmp_path, caplog):
    """As for ``--span`` (spans at one frame are all injected, nothing refused), times that fall in one frame are
    kept; but a frame holds one ``<ret>``, so they are one forced ``ret``, and a warning names them."""
    argv = _argv(tiny_checkpoint_dir, speech, tmp_path, "--force-ret-at", "1.0", "--force-ret-at", "1.0",
                 "--force-ret-at", "1.01", "--force-ret-at", "2.0")  # fmt: skip
    with caplog.at_level("WARNING", logger="cspan.server.infer"):
        result = asyncio.run(run_infer(_settings(argv)))
    warnings = [r.getMessage() for r in caplog.records if "--force-ret-at" in r.getMessage()]
    assert warnings == [
        "--force-ret-at 1, 1, 1.01 s fall in the same 80 ms frame (0.96 to 1.04 s of the input): one <ret> is "
        "forced there"
    ]
    offset = result.output.input_offset_s
    forced = [round(e.t - offset, 2) for e in result.output.events if e.type == "ret" and e.forced]
    assert forced == [0.96, 2.0]


def test_the_end_of_run_line_escapes_what_a_terminal_would_act_on(tiny_checkpoint_dir, speech, tmp_path, capsys,
                                                                  monkeypatch):  # fmt: skip
    """Random weights say anything (``\\x12``, escape sequences): the summary line shows them escaped, on one line;
    the JSON keeps the text as it was."""
    import cspan.core.runtime as runtime

    said = "hi\x12\x0e \x1b[31mred\nnext \u202eback caf\u00e9 it's"
    monkeypatch.setattr(runtime, "decode_agent_text", lambda tokenizer, tokens: said)
    out = tmp_path / os.fsdecode(b"o\x1b[2J\xe9")
    argv = [a for a in _argv(tiny_checkpoint_dir, speech, out) if a != "--quiet"]
    asyncio.run(run_infer(_settings(argv)))
    line = capsys.readouterr().err.rsplit("\r", 1)[-1]  # after the progress bar
    escaped = "'hi\\x12\\x0e \\x1b[31mred\\nnext \\u202eback caf\u00e9 it's'"
    assert line.endswith(f"; 0 span(s); agent said: {escaped}\n"), line
    assert line.startswith(f"wrote {tmp_path}/o\\x1b[2J\\xe9/out.wav (")
    assert line.count("\n") == 1 and not any(c in line for c in "\x12\x0e\x1b\u202e")
    assert json.loads((out / "out.json").read_bytes())["agent_text"] == said
