"""The README's Python quickstart runs as written (on the tiny checkpoint through ``$CSPAN_CHECKPOINT``)."""

from __future__ import annotations

import re
import shutil

import soundfile as sf


def test_readme_python_quickstart_runs_as_written(repo_root, tiny_checkpoint_dir, fixture_file, tmp_path, monkeypatch,
                                                  capsys) -> None:  # fmt: skip
    readme = (repo_root / "README.md").read_text()
    section = readme.split("### Python: the engine in your own code", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "load_checkpoint(device=device)" in code and "inject_span" in code and 15 <= len(code.splitlines()) <= 30
    shutil.copy(fixture_file("audio", "question_weather_24k.wav"), tmp_path / "question.wav")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CSPAN_CHECKPOINT", str(tiny_checkpoint_dir))
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # our own README, as a user would run it
    engine, words = namespace["engine"], namespace["words"]
    pcm, rate = sf.read(tmp_path / "agent.wav")
    frames = len(namespace["agent"])
    assert rate == 24000 and pcm.shape == (frames * 1920,) and frames > 25
    assert engine.positions[0] > frames + 2  # the persona prefix and the span were read too
    assert isinstance(capsys.readouterr().out, str) and all(isinstance(w, int) for w in words)
