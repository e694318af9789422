"""The ``cspan`` command line's parser: an unknown argument is refused by the verb that received it."""

from __future__ import annotations

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


def test_a_verb_far_from_every_known_one_gets_no_suggestion(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["zzz"])
    assert exit_.value.code == 2
    assert "did you mean" not in capsys.readouterr().err
