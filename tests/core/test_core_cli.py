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
