"""Issue 22 (F11, F13, F14, F18, F19): bad command-line input to `cspan backends start`, `cspan tools`, `cspan users`
and `cspan db` is one line naming the flag and the fix, before anything runs; nothing is created or waited for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _cspan(*args: str, stdin: bytes = b"", cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    cmd = [sys.executable, "-m", "cspan.core.cli", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, timeout=60, cwd=cwd)


def _one_line(done: subprocess.CompletedProcess[bytes]) -> str:
    err = done.stderr.decode()
    lines = [line for line in err.splitlines() if not line.startswith(("usage:", " "))]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--router-url", "http://127.0.0.1:1/v1", "--no-asr", "--timeout-s", "nan"], "--timeout-s: 'nan'"),
        (["--timeout-s", "-1"], "--timeout-s: '-1'"),
        (["--timeout-s", "inf"], "--timeout-s: 'inf'"),
        (["--router-url", "ftp://x", "--no-asr"], "--router-url: 'ftp://x' is not an http(s) URL"),
        (["--router-url", "http://", "--no-asr"], "--router-url: 'http://' is not an http(s) URL"),
        (["--router-url", "http://u:secret@:1/v1", "--no-asr"], "--router-url: 'http://u:***@:1/v1' is not an http"),
        (["--router-port", "70000"], "--router-port: '70000' is not a TCP port (1 to 65535)"),
        (["--asr-port", "0"], "--asr-port: '0' is not a TCP port"),
        (["--asr-gpu", "-3"], "--asr-gpu: '-3': give GPU indices >= 0"),
        (["--router-gpu", "a"], "--router-gpu: 'a'"),
    ],
)
def test_backends_start_flags_are_checked(args: list[str], expect: str) -> None:
    done = _cspan("backends", "start", *args, "--dry-run")
    assert done.returncode == 2 and expect in _one_line(done)


def test_backends_start_good_flags_still_pass() -> None:
    done = _cspan("backends", "start", "--router-url", "http://127.0.0.1:8000/v1", "--asr-gpu", "2,3", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert b"(external, not started) http://127.0.0.1:8000/v1" in done.stdout


def test_tools_flags_are_checked() -> None:
    done = _cspan("tools", "serve", "--transport", "http", "--path", "no-slash")
    assert done.returncode == 2 and "--path: 'no-slash' is not an HTTP path" in _one_line(done)
    for verb in ("list", "serve"):
        done = _cspan("tools", verb, "--tools", "knowledge")
        assert done.returncode == 2
        assert _one_line(done) == f"cspan tools {verb}: error: --tools knowledge needs --knowledge DIR (the notes " \
            "folder that search_notes reads)"  # fmt: skip


@pytest.mark.parametrize("stdin", [os.urandom(1000) + b"\xff", b"\x00" * 40 + b"\n", "é".encode() * 20])
def test_users_hash_refuses_binary_input(stdin: bytes) -> None:
    done = _cspan("users", "hash", stdin=stdin)
    assert done.returncode == 2 and "cspan users hash: error: " in _one_line(done)


def test_users_hash_of_a_token() -> None:
    done = _cspan("users", "hash", stdin=b"abcdefghijklmnopqrstuvwxyz\n")
    assert done.returncode == 0 and len(done.stdout.strip()) > 16
    for bad in (b"abc def ghi jkl mno p\n", b"abcdefghijklmnop/+==\n"):  # no WebSocket subprotocol carries them
        done = _cspan("users", "hash", stdin=bad)
        assert done.returncode == 2 and "16 to 256 characters of A-Z a-z 0-9 . _ ~ -" in _one_line(done)


def test_a_database_url_we_do_not_speak_is_not_a_folder(tmp_path: Path) -> None:
    done = _cspan("users", "list", "--db", "mysql://u:secret@x/db", cwd=tmp_path)
    line = _one_line(done)
    assert done.returncode == 1 and "'mysql' databases are not supported" in line and "secret" not in line
    assert list(tmp_path.iterdir()) == []  # no ./mysql:/x folder


@pytest.mark.parametrize(
    ("verb", "form"),
    [
        (("db", "info"), "path"),
        (("users", "list"), "path"),
        (("users", "list"), "url"),
        (("users", "add", "u"), "new/"),
    ],
)
def test_a_folder_given_as_the_database_is_named_so(tmp_path: Path, verb: tuple[str, ...], form: str) -> None:
    """``--db FOLDER`` (or ``sqlite:////FOLDER``) is refused saying it is a folder and which file to give, as
    ``cspan serve`` says (was: SQLite's "unable to open database file"); ``--db new/``, a folder not made yet, too
    (was: a file named ``new``)."""
    db = {"path": str(tmp_path), "url": f"sqlite:///{tmp_path}", "new/": str(tmp_path / "new") + "/"}[form]
    done = _cspan(*verb, "--db", db, cwd=tmp_path)
    line = _one_line(done)
    assert done.returncode == 1, line
    folder = tmp_path / "new" if form == "new/" else tmp_path
    what = "ends with a slash, naming a folder" if form == "new/" else "is a folder"
    assert f"{folder}: {what}; give the Context DB's file (e.g. {folder / 'context.sqlite'})" in line
    assert list(tmp_path.iterdir()) == []


def test_a_relative_sqlite_url_names_the_file_beside(tmp_path: Path) -> None:
    """``sqlite:///context.db`` is ``context.db`` in the working folder, for the verbs that check it exists as for
    the database itself (was: looked for at ``/context.db``, "no Context DB")."""
    assert _cspan("users", "add", "ada", "--db", str(tmp_path / "context.db"), cwd=tmp_path).returncode == 0
    done = _cspan("users", "list", "--db", "sqlite:///context.db", cwd=tmp_path)
    assert done.returncode == 0 and b"ada" in done.stdout, done.stderr


def test_db_export_to_a_file_is_private_to_its_owner(tmp_path: Path) -> None:
    """``db export --out`` writes everything stored about a person: the file is 0600 as the database is, whatever
    the umask (it was 0644 under the usual 022: readable by every local user), also when it replaces one."""
    db = tmp_path / "db.sqlite"
    assert _cspan("users", "add", "ada", "--db", str(db)).returncode == 0
    out = tmp_path / "ada.json"
    out.write_text("old")
    out.chmod(0o644)
    old = os.umask(0o022)
    try:
        for _ in range(2):
            assert _cspan("db", "export", "ada", "--db", str(db), "--out", str(out)).returncode == 0
            assert out.stat().st_mode & 0o777 == 0o600 and json.loads(out.read_text())["user_id"] == "ada"
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir() if ".part" in p.name) == []


def test_db_export_into_a_read_only_folder_names_the_file_not_the_part(tmp_path: Path) -> None:
    from fs_faults import read_only_folder

    db = tmp_path / "db.sqlite"
    assert _cspan("users", "add", "ada", "--db", str(db)).returncode == 0
    with read_only_folder(tmp_path / "ro") as ro:
        done = _cspan("db", "export", "ada", "--db", str(db), "--out", str(ro / "a.json"))
    line = _one_line(done)
    assert done.returncode == 1 and line.startswith(f"cspan db export: error: {ro / 'a.json'}: cannot write: ")
    assert ".part" not in line and list(ro.iterdir()) == []


def test_db_export_to_a_directory_says_which_file_to_give(tmp_path: Path) -> None:
    """``--out DIR`` was "DIR: cannot write: is a directory" (exit 1), naming neither the flag nor what to give, and
    ``--out new/`` (no such folder yet) wrote a file called ``new``. Both are a bad argument now (exit 2), refused
    before anything is read, with a file to give instead; nothing is written."""
    db = tmp_path / "db.sqlite"
    assert _cspan("users", "add", "ada", "--db", str(db)).returncode == 0
    (tmp_path / "my dir").mkdir()
    fix = "give the file to write the JSON to, such as"
    for out, what, file in (
        (tmp_path, "is a directory", f"{tmp_path / 'ada.json'}"),
        (f"{tmp_path}/", "is a directory", f"{tmp_path / 'ada.json'}"),
        (tmp_path / "my dir", "is a directory", f"'{tmp_path / 'my dir' / 'ada.json'}'"),
        (f"{tmp_path / 'new'}/", "names a directory (it ends in a separator)", f"{tmp_path / 'new' / 'ada.json'}"),
    ):
        done = _cspan("db", "export", "ada", "--db", str(db), "--out", str(out))
        assert (done.returncode, _one_line(done)) == (
            2,
            f"cspan db export: error: --out {out}: {what}; {fix} {file}, or leave --out out to print it",
        )
    done = _cspan("db", "export", "nobody", "--db", str(db), "--out", str(tmp_path))  # the argument is checked first
    assert done.returncode == 2 and "such as" in _one_line(done)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("db.sqlite")] == ["my dir"]
    assert list((tmp_path / "my dir").iterdir()) == []


def test_db_export_onto_a_read_only_file_system_names_the_file(tmp_path: Path) -> None:
    """Issue 22 (final trial): on a read-only mount even removing the never-written .part fails (EROFS, not ENOENT);
    that must not replace the one-line error with "[Errno 30] Read-only file system: '.a.json.PID.part'"."""
    from fs_faults import tmpfs

    db = tmp_path / "db.sqlite"
    assert _cspan("users", "add", "ada", "--db", str(db)).returncode == 0
    with tmpfs(tmp_path / "ro", read_only=True) as ro:
        done = _cspan("db", "export", "ada", "--db", str(db), "--out", str(ro / "a.json"))
        assert list(ro.iterdir()) == []
    line = _one_line(done)
    assert (
        done.returncode == 1 and line == f"cspan db export: error: {ro / 'a.json'}: cannot write: read-only file system"
    )


@pytest.mark.parametrize(
    "args",
    [
        ["asr-serve", "--engine", "sphinx"],
        ["tools", "serve", "--transport", "http"],
    ],
)
def test_a_busy_port_is_one_line_before_anything_loads(args: list[str]) -> None:
    """Issue 22 (final trial): `cspan asr-serve` and `cspan tools serve --transport http` on a port in use print one
    line naming the flag (exit 2, as `cspan serve` does), not uvicorn's "[Errno 98] error while attempting to bind"
    log and exit status 3."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _cspan(*args, "--port", str(port))
    line = _one_line(done)
    assert done.returncode == 2, done.stderr
    verb = " ".join(args[:2]) if args[0] == "tools" else args[0]
    assert line == (
        f"cspan {verb}: error: --port {port}: address already in use on 127.0.0.1:{port} (another server?); "
        "stop it or pick another --port"
    )


@pytest.mark.parametrize(
    ("user", "shown"),
    [("", "''"), ("x" * 10000, "'" + "x" * 56 + "... (10000 characters)"), ("a\tb", "'a\\tb'")],
)
def test_users_add_refuses_a_bad_user_id_as_a_bad_setting(user: str, shown: str, tmp_path: Path) -> None:
    """`cspan users add ""` exited 1 as if the database had failed, and a 10000-character id was echoed in full:
    a bad id is a bad argument (exit status 2), the message cut with the id's length, and no token is issued."""
    db = tmp_path / "ctx.sqlite"
    done = _cspan("users", "add", user, "--db", str(db))
    assert done.returncode == 2, done.stderr
    err = done.stderr.decode()
    assert err == f"cspan users add: error: user id must be 1 to 200 printable characters, got {shown}\n"
    assert done.stdout == b""


@pytest.mark.parametrize(
    ("label", "shown"),
    [
        ("evil\x1b[2Jwiped", "'evil\\x1b[2Jwiped'"),
        ("laptop\nfake-id  mallory  session,admin", "'laptop\\nfake-id  mallory  session,admin'"),
        ("\u202enimda", "'\\u202enimda'"),
        ("x" * 201, "'" + "x" * 56 + "... (201 characters)"),
    ],
)
def test_users_add_refuses_a_label_that_is_not_printable(label: str, shown: str, tmp_path: Path) -> None:
    """A --label was stored as given and `cspan users list` printed it raw: a terminal escape reached the operator's
    terminal and a newline forged a row of the table. Now refused as a bad id is (exit 2, no token issued)."""
    db = tmp_path / "ctx.sqlite"
    done = _cspan("users", "add", "ada", "--label", label, "--db", str(db))
    assert done.returncode == 2 and done.stdout == b"", done.stderr
    assert done.stderr.decode() == (
        f"cspan users add: error: label must be at most 200 printable characters (no control characters), got {shown}\n"
    )
    assert _cspan("users", "list", "--db", str(db)).stderr == b"no tokens\n"
    done = _cspan("users", "add", "ada", "--label", "ada's laptop (Zürich)", "--db", str(db))
    assert done.returncode == 0 and done.stdout.startswith(b"cspan.")
    assert _cspan("users", "list", "--db", str(db)).stdout.decode().splitlines()[1].endswith(" ada's laptop (Zürich)")


def test_user_ids_with_white_space_at_an_end_are_refused_and_forget_says_when_it_found_nothing(tmp_path: Path) -> None:
    """`cspan users add " "` issued a token for a blank user, and " ada" would be a user apart from "ada" that no
    one can tell from it; `cspan db forget` of an id with nothing stored said only "0 ..." (a typo looked done)."""
    db = tmp_path / "ctx.sqlite"
    for user in (" ", " ada", "ada\n"):
        done = _cspan("users", "add", user, "--db", str(db))
        assert done.returncode == 2 and done.stdout == b"", done.stderr
        assert (
            done.stderr.decode()
            == f"cspan users add: error: user id must not start or end with white space, got {user!r}\n"
        )
    done = _cspan("db", "forget", "adaa", "--yes", "--db", str(db))
    assert done.returncode == 0
    assert done.stdout.decode().startswith("forgot adaa: 0 spans")
    assert "nothing was stored about 'adaa'" in done.stderr.decode() and "check the user id" in done.stderr.decode()
    # a user with only a token: its token is named, not "nothing stored"
    assert _cspan("users", "add", "bob", "--db", str(db)).returncode == 0
    done = _cspan("db", "forget", "bob", "--yes", "--db", str(db))
    assert done.returncode == 0 and done.stdout.decode().startswith("forgot bob: 0 spans")
    assert "nothing but 1 issued token(s) was stored about 'bob'" in done.stderr.decode()
    assert "pass --tokens to delete them too" in done.stderr.decode()
    done = _cspan("db", "forget", "bob", "--yes", "--tokens", "--db", str(db))
    assert done.returncode == 0 and "1 tokens" in done.stdout.decode() and done.stderr == b""


def test_db_verbs_refuse_a_sqlite_file_that_does_not_exist_and_create_nothing(tmp_path: Path) -> None:
    """`cspan db forget --db MISTYPED.sqlite --yes` created an empty Context DB at the mistyped path and reported
    nothing stored: every verb but `users add` (which starts a new DB) now refuses a file that does not exist."""
    missing = tmp_path / "typo.sqlite"
    for verb in (("db", "forget", "ada", "--yes"), ("db", "info"), ("db", "export", "ada"), ("users", "list")):
        done = _cspan(*verb, "--db", str(missing))
        assert done.returncode == 1, done.stderr
        assert done.stderr.decode() == (
            f"cspan {verb[0]} {verb[1]}: error: no Context DB at {missing} (nothing was ever stored there); check "
            "--db or $CSPAN_DB\n"
        )
        assert not missing.exists()
    done = _cspan("users", "add", "ada", "--db", str(missing))
    assert done.returncode == 0 and missing.exists()


def test_backends_start_names_a_file_given_as_log_dir(tmp_path: Path) -> None:
    """A file as --log-dir gave only 'file exists'."""
    log = tmp_path / "log"
    log.write_text("a file")
    done = _cspan("backends", "start", "--log-dir", str(log), "--no-asr", "--no-router")
    assert done.returncode == 2
    assert done.stderr.decode() == f"cspan backends start: error: --log-dir {str(log)!r} is a file; give a folder\n"


def test_backends_start_help_says_what_asr_engine_picks_and_its_default() -> None:
    """`--asr-engine {vllm,transformers,sphinx}` had no help line: nothing said vllm is the default."""
    done = _cspan("backends", "start", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.decode().split())
    assert "--asr-engine {vllm,transformers,sphinx} the ASR server: vllm (qwen-asr-serve" in text
    assert "(needs --asr-model DIR) or sphinx (default vllm)" in text


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["nope"], "unknown tool 'nope'; this bank has: get_time, calculate, get_weather"),
        (["get_time", "{bad"], "tool 'get_time': arguments are not valid JSON ("),
        (["calculate", '{"expr": "2+2"}'], "tool 'calculate': missing required argument 'expression'"),
        (["get_time", "--timeout", "nan"], "argument --timeout: 'nan': give a number of seconds above 0"),
        (["get_time", "--timeout", "-1"], "argument --timeout: '-1': give a number of seconds above 0"),
    ],
)
def test_tools_call_refuses_a_bad_call_as_a_bad_setting(args: list[str], expect: str) -> None:
    """An unknown tool, arguments that are not the tool's and a --timeout of NaN exited 1 (NaN ran with no limit);
    they are the caller's mistakes, refused before the tool runs: 2, as `tools list --tools nope`."""
    done = _cspan("tools", "call", *args)
    assert done.returncode == 2 and _one_line(done).startswith(f"cspan tools call: error: {expect}")
    assert done.stdout == b""


def test_tools_call_a_tool_that_fails_when_it_runs_is_a_runtime_failure() -> None:
    done = _cspan("tools", "call", "calculate", '{"expression": "2+"}')
    assert done.returncode == 1
    assert _one_line(done) == "cspan tools call: error: tool 'calculate': cannot parse '2+' as arithmetic"
    done = _cspan("tools", "call", "calculate", '{"expression": "2+3"}')
    assert done.returncode == 0 and done.stdout == b"2+3 = 5\n"


def test_tools_serve_says_it_was_interrupted() -> None:
    """Ctrl-C stops `cspan tools serve` (HTTP) with 130 and one line saying so, as every verb does (it was silent)."""
    import signal
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "cspan.core.cli", "tools", "serve", "--transport", "http", "--port", str(port)]
    proc = subprocess.Popen(  # SIGINT at its default in the child, whatever the runner inherited
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # serving once the port answers
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.decode().endswith("cspan tools serve: interrupted\n"), err
