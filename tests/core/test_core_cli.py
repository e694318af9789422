"""The ``cspan`` command line's parser: an unknown argument is refused by the verb that received it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cspan.core.cli import main


@pytest.mark.parametrize(
    ("argv", "prog", "unknown"),
    [
        (["model", "tiny", "OUT", "--bogus", "1"], "cspan model tiny", "--bogus 1"),
        (["infer", "--input-wav", "a.wav", "--output-wav", "b.wav", "--bogus"], "cspan infer", "--bogus"),
    ],
)
def test_an_unknown_argument_is_refused_with_the_verbs_usage(argv, prog, unknown, capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "tiny") if a == "OUT" else a for a in argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(f"usage: {prog} ") and err.endswith(f"{prog}: error: unrecognized arguments: {unknown}\n")
    assert not (tmp_path / "tiny").exists()


@pytest.mark.parametrize("seed", ["-1", "4294967296", "18446744073709551615"])
def test_model_tiny_refuses_a_seed_that_would_wrap(seed: str, capsys, tmp_path) -> None:
    """`cspan model tiny --seed -1`, `4294967295` and `18446744073709551615` wrote identical weights (torch's CPU
    generator keeps 32 bits of the seed): a seed outside 0 .. 2**32 - 1 is a bad setting, before anything is written."""
    assert main(["model", "tiny", str(tmp_path / "tiny"), "--seed", seed]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"cspan model tiny: error: --seed {seed}: must be 0 to 4294967295 (2**32 - 1); a seed outside that range would "
        "repeat another's weights\n"
    )
    assert not (tmp_path / "tiny").exists()


def test_model_tiny_refuses_an_empty_path(capsys, tmp_path, monkeypatch) -> None:
    """`cspan model tiny ""` wrote the checkpoint into the working folder."""
    monkeypatch.chdir(tmp_path)
    assert main(["model", "tiny", ""]) == 2
    assert capsys.readouterr().err == (
        "cspan model tiny: error: OUT_DIR is empty; give the folder to write the tiny checkpoint into\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_version_prints_one_line_on_stdout_and_exits_0(capsys) -> None:
    """`cspan --version` was refused ("the following arguments are required: VERB", exit 2)."""
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 0 and err == ""
    assert out.startswith(f"cspan {version('cspan-core')} (") and out.count("\n") == 1, out
    assert f"cspan-core {version('cspan-core')}" in out


@pytest.mark.parametrize(
    ("argv", "prog", "typo", "suggestion"),
    [
        (["infr"], "cspan", "infr", "infer"),
        (["model", "tinyy"], "cspan model", "tinyy", "tiny"),
    ],
)
def test_a_mistyped_verb_is_refused_with_the_closest_one_suggested(argv, prog, typo, suggestion, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    last = err.splitlines()[-1]
    assert last.startswith(f"{prog}: error: argument ") and f"invalid choice: {typo!r} (choose from " in last, err
    assert last.endswith(f"; did you mean {suggestion!r}?"), err


@pytest.mark.parametrize(
    ("argv", "prog", "unknown", "suggestion"),
    [
        (
            ["infer", "--outptu-text", "x.json"],
            "cspan infer",
            "--outptu-text x.json",
            "; did you mean '--output-text'?",
        ),
        (["infer", "--outptu-text=x.json"], "cspan infer", "--outptu-text=x.json", "; did you mean '--output-text'?"),
        (
            ["infer", "--outptu-text", "x.json", "--quite"],
            "cspan infer",
            "--outptu-text x.json --quite",
            "; did you mean '--output-text' for --outptu-text, '--quiet' for --quite?",
        ),
        (["model", "tiny", "OUT", "--sed", "3"], "cspan model tiny", "--sed 3", "; did you mean '--seed'?"),
        (["db", "export", "bob", "--dbb", "x"], "cspan db export", "--dbb x", "; did you mean '--db'?"),
        (["tools", "list", "--max-chrs", "9"], "cspan tools list", "--max-chrs 9", "; did you mean '--max-chars'?"),
        (
            ["train", "--data-dir", "d", "--out-dir", "OUT", "--lora-rnak", "8"],
            "cspan train",
            "--lora-rnak 8",
            "; did you mean '--lora-rank'?",
        ),
        (["--vrebose", "model", "tiny", "OUT"], "cspan", "--vrebose", "; did you mean '--verbose'?"),
        (["infer", "--zzzzzz"], "cspan infer", "--zzzzzz", ""),  # far from every flag: no suggestion
    ],
)
def test_a_mistyped_flag_is_refused_with_the_closest_one_suggested(argv, prog, unknown, suggestion, capsys, tmp_path):
    """A misspelled verb got `did you mean`, a misspelled flag (`--outptu-text`) only `unrecognized arguments`: the
    verb that received it suggests its closest flag, for every verb."""
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "tiny") if a == "OUT" else a for a in argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.splitlines()[-1] == f"{prog}: error: unrecognized arguments: {unknown}{suggestion}", err
    assert not (tmp_path / "tiny").exists()


_DOC = " (docs/COMING-FROM-MOSHI.md)"


@pytest.mark.parametrize(
    ("verb", "given", "answer"),
    [
        (
            "infer",
            ["--voice-prompt", "NATF2.pt"],
            "--voice-prompt NATF2.pt; --voice-prompt is PersonaPlex's: here, --voice NAME|FILE|RECORDING (NATF2 for "
            "NATF2.pt of the checkpoint's voices, a .pt voice file, or a 2-30 s recording)" + _DOC,
        ),
        ("infer", ["--greedy"], "--greedy; --greedy is PersonaPlex's: here, --temp 0 --temp-text 0" + _DOC),
        (
            "infer",
            ["--topk-text", "25"],
            "--topk-text 25; --topk-text is PersonaPlex's and has no counterpart here: top-k is fixed at upstream's "
            "defaults, 250 for audio and 25 for text" + _DOC,
        ),
        (
            "infer",
            ["--temp-audio", "0.8"],
            "--temp-audio 0.8; --temp-audio is PersonaPlex's: here, --temp TEMP (the audio temperature; --temp-text "
            "is the text's)" + _DOC,
        ),
        (
            "infer",
            ["--hf-repo=nvidia/personaplex-7b-v1", "--quite"],
            "--hf-repo=nvidia/personaplex-7b-v1 --quite; did you mean '--quiet'?; --hf-repo is Moshi's and "
            "PersonaPlex's: here, --checkpoint REPO (a Hugging Face repo or a local folder)" + _DOC,
        ),
        (  # moshi.run_inference's --config alias got "did you mean '--config'?" (our TOML settings file)
            "infer",
            ["--lm-config", "config.json"],
            "--lm-config config.json; --lm-config is Moshi's: here, --checkpoint DIR (the folder's config.json)" + _DOC,
        ),
        (
            "infer",
            ["--batch-size", "8"],
            "--batch-size 8; --batch-size is Moshi's and has no counterpart here: one conversation per run; cspan "
            "serve --max-sessions N batches live conversations" + _DOC,
        ),
        (
            "serve",
            ["--cfg-coef", "1.0"],
            "--cfg-coef 1.0; --cfg-coef is Moshi's and has no counterpart here: no classifier-free guidance "
            "(upstream's default 1.0 is none)" + _DOC,
        ),
        (  # Moshi's Rust server's --cpu got "did you mean '--mcp'?"
            "serve",
            ["--cpu"],
            "--cpu; --cpu is Moshi's Rust server's (moshi-backend): here, --device cpu" + _DOC,
        ),
        ("voice encode", ["--cpu"], "--cpu; --cpu is Moshi's Rust server's (moshi-backend): here, --device cpu" + _DOC),
        (  # python -m moshi.run_inference in.wav out.wav: the files were refused with no word on what to pass
            "infer",
            ["in.wav", "out.wav"],
            "in.wav out.wav; moshi.run_inference's positional IN OUT files are flags here: --input-wav in.wav "
            "--output-wav out.wav" + _DOC,
        ),
        (
            "serve",
            ["--gradio-tunnel"],
            "--gradio-tunnel; --gradio-tunnel is Moshi's and PersonaPlex's and has no counterpart here: no tunnel: "
            "serve with --ssl-certfile and --ssl-keyfile, or behind a reverse proxy" + _DOC,
        ),
    ],
)
def test_an_upstream_flag_is_answered_with_its_counterpart(verb: str, given: list[str], answer: str) -> None:
    """A Moshi or PersonaPlex flag got a look-alike (`--voice-prompt`: "did you mean '--text-prompt'?", `--greedy`:
    "'--seed'?", `--topk-text`: "'--temp-text'?") or nothing (`--temp-audio`): now its counterpart, or that it has
    none (cspan.core.upstream.UPSTREAM_FLAGS, as docs/COMING-FROM-MOSHI.md's tables)."""
    required = {"infer": ["--input-wav", "q.wav", "--output-wav", "o.wav"], "voice encode": ["a.wav", "b.pt"]}
    proc = subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", *verb.split(), "--checkpoint", "/nonexistent", *required.get(verb, []),
         *given],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == f"cspan {verb}: error: unrecognized arguments: {answer}", proc.stderr


@pytest.mark.parametrize("verb", ["infer", "serve"])
@pytest.mark.parametrize("given", [["--seed", "-1"], ["--seed=-7"]])
def test_a_negative_seed_says_what_to_pass_instead(verb: str, given: list[str], capsys) -> None:
    """PersonaPlex's ``--seed -1`` ("no fixed seed") got a bare "Input should be greater than or equal to 0": now
    that it has no counterpart, and what to pass for a different seed each run."""
    assert main([verb, *given]) == 2
    err = capsys.readouterr().err
    value = given[-1].removeprefix("--seed=")
    assert (
        f"cspan {verb}: error: --seed / CSPAN_SEED: got '{value}'; a negative seed (PersonaPlex's --seed -1, 'no "
        "fixed seed') has no counterpart here: the seed is always fixed (0 to 2**63 - 1, default 42424242), so for a "
        "different one each run pass a fresh one, e.g. --seed $RANDOM"
    ) in err, err


def test_an_upstream_flag_that_starts_two_of_ours_is_answered_too(capsys) -> None:
    """Moshi's `--ssl DIR` is a prefix of `--ssl-certfile` and `--ssl-keyfile` (argparse: ambiguous option)."""
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--ssl", "certs"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "cspan serve: error: ambiguous option: --ssl could match --ssl-certfile, --ssl-keyfile; --ssl is Moshi's and "
        "PersonaPlex's: here, --ssl-certfile DIR/cert.pem --ssl-keyfile DIR/key.pem (https and wss; or a reverse "
        "proxy in front)" + _DOC
    )


def test_a_verb_far_from_every_known_one_gets_no_suggestion(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["zzz"])
    assert exit_.value.code == 2
    assert "did you mean" not in capsys.readouterr().err


def _into_a_closed_pipe(args: list[str], *, unbuffered: bool) -> subprocess.CompletedProcess[bytes]:
    """``cspan ARGS`` with its standard output a pipe whose reader is gone (``cspan ... | head`` once head exits)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    read, write = os.pipe()
    os.close(read)
    try:
        cmd = [sys.executable, "-m", "cspan.core.cli", *args]
        return subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, env=env, timeout=120)
    finally:
        os.close(write)


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize(
    "args",
    [
        ["db", "export", "bob", "--db", "DB"],
        ["db", "info", "--db", "DB"],
        ["tools", "list"],
        ["--version"],
        ["db", "-h"],
    ],
)
def test_a_closed_stdout_pipe_ends_any_verb_quietly(args: list[str], unbuffered: bool, tmp_path: Path) -> None:
    """`cspan db export bob | head` said `cspan db export: error: [Errno 32] Broken pipe` (the verb's own `except
    OSError`), and `--version` a traceback: a standard output whose reader went away ends every verb without a word
    and with status 141 (128 + SIGPIPE), as a standard tool (`yes | head`); the flush at exit does not fail either."""
    db = tmp_path / "db.sqlite"
    added = subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", "users", "add", "bob", "--db", str(db)],
        capture_output=True,
        timeout=60,
    )
    assert added.returncode == 0, added.stderr
    done = _into_a_closed_pipe([str(db) if a == "DB" else a for a in args], unbuffered=unbuffered)
    assert (done.returncode, done.stderr.decode()) == (141, "")


@pytest.mark.parametrize("span", ["-1:hi", "-0.5:hi", "-.5:hi", "-inf:hi"])
def test_a_value_that_starts_as_a_negative_number_reaches_the_flags_own_check(span: str, capsys, tmp_path) -> None:
    """`cspan infer --span "-1:hi"` was refused by argparse (`expected one argument`, a flag as far as it knew) where
    `--span abc` got the range of the value: a word that starts with a minus and a digit is a value."""
    for argv in (["--span", span], [f"--span={span}"]):
        assert (
            main(["infer", "--input-wav", str(tmp_path / "a.wav"), "--output-wav", str(tmp_path / "b.wav"), *argv]) == 2
        )
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"cspan infer: error: --span / CSPAN_SPAN: {span!r}: expected SECONDS:TEXT with SECONDS a number >= 0, "
            "e.g. 1.0:Hello"
        )


@pytest.mark.parametrize(
    ("argv", "last"),
    [
        (["--span", "-x:hi"], "--span: expected one argument; a value that starts with '-' is written --span=-x:hi"),
        (["--span", "--quiet"], "--span: expected one argument"),  # a forgotten value before a flag of the verb
    ],
)
def test_a_missing_value_that_starts_with_a_minus_is_told_how_to_write_it(argv, last, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["infer", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.splitlines()[-1] == f"cspan infer: error: argument {last}", err


def test_ctrl_c_while_the_verbs_are_imported_is_one_line_and_130(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C in the first half second, while ``build_parser`` imports every verb, ends with one line and status 130,
    as it does once the verb runs (was: Python's ``KeyboardInterrupt`` traceback)."""

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    import cspan.core.cli as cli_module

    monkeypatch.setattr(cli_module, "build_parser", interrupted)
    assert main(["infer", "--help"]) == 130
    assert capsys.readouterr().err == "cspan: interrupted\n"
