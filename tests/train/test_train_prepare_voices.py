"""`cspan prepare` finds and reads voices as `cspan infer`, `cspan serve` and `cspan bench` do: the names of a
PersonaPlex-style checkpoint's voices.tgz (also as `NAME.pt`), in codes form or as a recording; a voice in
PersonaPlex's embeddings form only is refused in one line naming the dialogue file and what to do (training needs
Mimi codes).

A new user's trial: a dialogue with "voice": "NATF2" against a checkpoint whose voices.tgz held NATF2 in codes form
was skipped as "neither a file next to the dialogue nor a voice of the checkpoint (known: none)", while `cspan model
info` listed NATF2 and infer took `--voice NATF2`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from personaplex_folder import embeddings_voice, personaplex_folder, pt_bytes
from safetensors import safe_open

from cspan.core.checkpoint import load_checkpoint
from cspan.core.cli import main
from cspan.core.config import PERSONAPLEX
from cspan.core.prefix import build_persona_prefix
from cspan.core.voice import choose_voice
from cspan.train.dataset import read_manifest


@pytest.fixture(scope="module")
def pp(tiny_dir: Path, fixture_file, tmp_path_factory) -> dict[str, Any]:
    """A PersonaPlex-style folder whose voices.tgz holds NATF2 (codes), NATM1 (embeddings only) and NATF3 (a
    recording)."""
    root = tmp_path_factory.mktemp("pp-prepare")
    tiny = load_checkpoint(tiny_dir, device="cpu", dtype=torch.float32)
    natf2 = tiny.load_voice("tiny1")[:, :12]
    voices = {
        "voices/NATF2.pt": pt_bytes({"codes": natf2}),
        "voices/NATM1.pt": embeddings_voice(tiny.load_voice("tiny0")[:, :10], tiny.lm),
        "voices/NATF3.wav": fixture_file("audio", "greeting_24k.wav").read_bytes(),
    }
    return {"dir": personaplex_folder(root / "pp", tiny_dir, voices), "natf2": natf2, "cache": root / "cache"}


@pytest.fixture
def pp_env(pp, monkeypatch) -> dict[str, Any]:
    monkeypatch.setenv("CSPAN_CACHE_DIR", str(pp["cache"]))
    monkeypatch.delenv("CSPAN_VOICES_DIR", raising=False)
    return pp


def _prefix(root: Path, record: Any) -> torch.Tensor:
    with safe_open(str(root / record.shard), framework="pt") as fh:
        return fh.get_tensor(f"{record.name}/prefix").long()


@pytest.mark.slow
def test_dialogue_voices_by_name_of_voices_tgz(pp_env, chat_dialogue, tmp_path: Path, capsys) -> None:
    dialogues = tmp_path / "dlg"
    chat_dialogue(dialogues, "by_name", voice="NATF2")
    chat_dialogue(dialogues, "by_file_name", voice="NATF2.pt")  # PersonaPlex's --voice-prompt spelling
    chat_dialogue(dialogues, "recording", voice="NATF3")
    embeddings = chat_dialogue(dialogues, "embeddings", voice="NATM1")
    out = tmp_path / "data"
    argv = ["prepare", "--in-dir", str(dialogues), "--out-dir", str(out), "--checkpoint", str(pp_env["dir"])]
    assert main([*argv, "--device", "cpu", "--workers", "2", "--quiet"]) == 0
    err = capsys.readouterr().err

    records = {r.name: r for r in read_manifest(out / "manifest.jsonl")}
    assert sorted(records) == ["by_file_name", "by_name", "recording"]
    ckpt = load_checkpoint(pp_env["dir"], device="cpu", dtype=torch.float32)
    assert ckpt.prefix_layout == PERSONAPLEX
    natf2 = build_persona_prefix(ckpt.tokenizer, None, pp_env["natf2"], layout=PERSONAPLEX)
    for name, voice in (("by_name", "NATF2"), ("by_file_name", "NATF2.pt")):
        assert records[name].extra["voice"] == voice
        assert torch.equal(_prefix(out, records[name]), natf2.frames)
    # the recording: Mimi-encoded with the checkpoint's codec, the codes infer speaks with
    heard = choose_voice("NATF3", ckpt)
    assert heard is not None and heard.form == "recording"
    expected = build_persona_prefix(ckpt.tokenizer, None, heard.prompt.codes, layout=PERSONAPLEX)
    assert torch.equal(_prefix(out, records["recording"]), expected.frames)

    # embeddings only: one line naming the dialogue file, why, and what to do
    (line,) = [x for x in err.splitlines() if "embeddings.json" in x]
    assert line.startswith(f"cspan prepare: skipped embeddings.json: dialogue file {str(embeddings)!r}, field voice:")
    assert "NATM1.pt' is a PersonaPlex voice in embeddings form only" in line
    assert "the Mimi codes training needs" in line and "`cspan voice encode IN.wav OUT.pt`" in line
    (error,) = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert Path(error["file"]).name == "embeddings.json" and "embeddings form only" in error["error"]


@pytest.mark.slow
def test_default_voice_by_name_of_voices_tgz(pp_env, chat_dialogue, tmp_path: Path, capsys) -> None:
    """`--voice NATF2` (a voices.tgz name) is the default voice, recorded by its name; `--voice NATM1` (embeddings
    only) is one line naming the flag, exit status 2, nothing written."""
    dialogues = tmp_path / "dlg"
    chat_dialogue(dialogues, "plain")
    argv = ["prepare", "--in-dir", str(dialogues), "--checkpoint", str(pp_env["dir"]), "--device", "cpu", "--quiet"]

    assert main([*argv, "--out-dir", str(tmp_path / "bad"), "--voice", "NATM1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cspan prepare: error: --voice 'NATM1': voice file ") and err.count("\n") == 1, err
    assert "embeddings form only" in err and "cspan voice encode" in err
    assert not (tmp_path / "bad").exists()

    out = tmp_path / "data"
    assert main([*argv, "--out-dir", str(out), "--voice", "NATF2"]) == 0
    (record,) = read_manifest(out / "manifest.jsonl")
    assert record.extra["voice"] == "NATF2" and record.extra["voice_frames"] == 11  # PersonaPlex: N - 1
    assert json.loads((out / "dataset.json").read_text())["default_voice"] == "NATF2"
