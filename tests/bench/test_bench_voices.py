"""`cspan bench` takes every voice `cspan infer` takes, resolved and loaded the same way, and defaults to infer's
voice; `run.json` records the voice that spoke.

A new user's trial: `cspan bench fdb-v1 run --checkpoint pp2 --voice NATF2` (NATF2 from PersonaPlex's voices.tgz, in
embeddings form only) failed with "load it with load_voice_prompt() for the engine" (exit 1), and without `--voice`
the bench ran with no voice while nothing said so. Real components: the tiny checkpoint, a PersonaPlex-style copy of
it with a voices.tgz, the Full-Duplex-Bench v1 fixture."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import torch
from personaplex_folder import embeddings_voice, personaplex_folder

from cspan.core.checkpoint import load_checkpoint
from cspan.core.prefix import build_persona_prefix

TASK = "pause_handling_example"
NATF2_FRAMES = 12
"""Frames of the codes NATF2 is made from."""


@pytest.fixture(scope="module")
def pp(tiny_checkpoint_dir: Path, tmp_path_factory) -> dict[str, Any]:
    """A PersonaPlex-style folder whose voices.tgz holds NATF2 in embeddings form only, and the codes it was made
    from (also as a codes voice file)."""
    root = tmp_path_factory.mktemp("pp-bench")
    tiny = load_checkpoint(tiny_checkpoint_dir, device="cpu", dtype=torch.float32)
    codes = tiny.load_voice("tiny1")[:, :NATF2_FRAMES]
    folder = personaplex_folder(root / "pp", tiny_checkpoint_dir, {"voices/NATF2.pt": embeddings_voice(codes, tiny.lm)})
    codes_file = root / "natf2-codes.pt"
    torch.save({"codes": codes}, codes_file)
    return {"dir": folder, "codes_file": codes_file, "cache": root / "cspan-cache"}


@pytest.fixture
def pp_env(pp, monkeypatch) -> dict[str, Any]:
    """voices.tgz is extracted into this test's own cache; no voice folder of the environment is seen."""
    monkeypatch.setenv("CSPAN_CACHE_DIR", str(pp["cache"]))
    monkeypatch.delenv("CSPAN_VOICES_DIR", raising=False)
    return pp


def _run_v1(cli, v1_dir: Path, checkpoint: Path, out: Path, *extra: str) -> int:
    return cli(
        "bench", "fdb-v1", "run", "--checkpoint", str(checkpoint), "--data", str(v1_dir), "--out", str(out),
        "--tasks", TASK, "--limit", "1", "--device", "cpu", "--router", "none", "--asr", "none",
        "--temp", "0", "--temp-text", "0", *extra,
    )  # fmt: skip


def _record(out: Path) -> dict[str, Any]:
    (run,) = sorted((out / TASK).glob("*/run.json"))
    return json.loads(run.read_text())


@pytest.mark.slow
def test_fdb_v1_speaks_with_personaplex_embedding_voice(pp_env, v1_dir: Path, cli, tmp_path: Path, capsys) -> None:
    """`--voice NATF2` (embeddings form only, from voices.tgz) runs; the persona prefix reads it as infer does, and
    greedy, it speaks exactly as the codes it was made from (so the voice really is in the prefix)."""
    assert _run_v1(cli, v1_dir, pp_env["dir"], tmp_path / "emb", "--voice", "NATF2") == 0
    err = capsys.readouterr().err
    assert "voice NATF2 (embeddings, " in err
    record = _record(tmp_path / "emb")
    used = record["settings"]["checkpoint"]
    assert used["voice"] == "NATF2" and used["voice_form"] == "embeddings" and used["voice_default"] is False
    assert Path(used["voice_file"]).name == "NATF2.pt"

    ckpt = load_checkpoint(pp_env["dir"], device="cpu", dtype=torch.float32)
    prefix = build_persona_prefix(
        ckpt.tokenizer, record["settings"]["prompt"], ckpt.load_voice_prompt("NATF2"), layout=ckpt.prefix_layout
    )
    assert prefix.voice_frames == NATF2_FRAMES - 1  # PersonaPlex never reads a voice's first frame
    assert record["prefix_frames"] == prefix.num_frames

    assert _run_v1(cli, v1_dir, pp_env["dir"], tmp_path / "codes", "--voice", str(pp_env["codes_file"])) == 0
    by_codes = _record(tmp_path / "codes")
    assert by_codes["settings"]["checkpoint"]["voice_form"] == "codes"
    assert by_codes["prefix_frames"] == record["prefix_frames"] and by_codes["agent_text"] == record["agent_text"]
    a, _ = sf.read(tmp_path / "emb" / TASK / "1" / "output.wav", dtype="float32")
    b, _ = sf.read(tmp_path / "codes" / TASK / "1" / "output.wav", dtype="float32")
    np.testing.assert_array_equal(a, b)


def test_default_voice_is_infers_and_is_recorded(pp_env, tiny_checkpoint_dir: Path, fixture_file, capsys) -> None:
    """Without --voice the bench takes the voice `cspan infer` takes (the same function): the first voice of
    voices/ (recorded as the default), none for a voices.tgz alone (recorded as none, and said on the console)."""
    import argparse

    from cspan.bench.run_commands import build_session_from
    from cspan.core.voice import choose_voice

    def resolve_voice(checkpoint: Any, voice: str | None) -> Any:  # what cspan infer reads for --voice
        chosen = choose_voice(voice, checkpoint)
        return None if chosen is None else chosen.prompt

    def args(checkpoint: Path, **kw: Any) -> argparse.Namespace:
        base = {"checkpoint": str(checkpoint), "device": "cpu", "dtype": None, "temp": 0.8, "temp_text": 0.7}
        base |= {"voice": None, "no_voice": False, "seed": 1, "no_cuda_graphs": True, "quiet": False}
        return argparse.Namespace(**(base | kw))

    tiny = build_session_from(args(tiny_checkpoint_dir))
    assert "voice tiny0 (codes, " in capsys.readouterr().err
    infer_voice = resolve_voice(tiny.checkpoint, None)  # what cspan infer reads without --voice
    assert (tiny.voice, tiny.chosen_voice.default) == ("tiny0", True)
    assert tiny.voice_prompt.source == infer_voice.source
    assert torch.equal(tiny.voice_prompt.codes, infer_voice.codes)
    identity = tiny.identity()
    assert identity["voice"] == "tiny0" and identity["voice_default"] is True and identity["voice_form"] == "codes"

    pp = build_session_from(args(pp_env["dir"]))
    said = capsys.readouterr().err
    assert said.startswith("no voice prompt") and "--voice" in said and "NATF2" in said
    assert resolve_voice(pp.checkpoint, None) is None and pp.chosen_voice is None
    identity = pp.identity()
    assert identity["voice"] is None and identity["voice_file"] is None and identity["voice_form"] is None

    none = build_session_from(args(tiny_checkpoint_dir, no_voice=True))
    assert "no voice prompt (--no-voice)" in capsys.readouterr().err
    assert none.identity()["voice"] is None

    # a recording, as infer takes it: encoded with the checkpoint's Mimi, the codes infer reads
    greeting = fixture_file("audio", "greeting_24k.wav")
    rec = build_session_from(args(tiny_checkpoint_dir, voice=str(greeting), quiet=True))
    assert rec.identity()["voice_form"] == "recording" and rec.identity()["voice"] == str(greeting)
    assert torch.equal(rec.voice_prompt.codes, resolve_voice(tiny.checkpoint, str(greeting)).codes)


def _qa_data(root: Path, question: Path) -> Path:
    (root / "audios").mkdir(parents=True)
    (root / "meta.json").write_text(json.dumps([{"id": "q1", "text": "What is the weather in London?", "answer": "x"}]))
    shutil.copyfile(question, root / "audios" / "q1.wav")
    return root


def _v3_data(root: Path, question: Path) -> Path:
    (root / "ecom_001_x").mkdir(parents=True)
    shutil.copyfile(question, root / "ecom_001_x" / "input.wav")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("verb", ["qa", "fdb-v3"])
def test_qa_and_fdb_v3_speak_with_personaplex_embedding_voice(
    verb: str, pp_env, fixture_file, tmp_path: Path, cli, capsys
) -> None:
    """`cspan bench qa --voice NATF2` and `cspan bench fdb-v3 run --voice NATF2` run, recording the voice."""
    question = fixture_file("audio", "question_weather_24k.wav")
    out = tmp_path / "out"
    common = ["--checkpoint", str(pp_env["dir"]), "--voice", "NATF2", "--out", str(out), "--device", "cpu"]
    common += ["--router", "none", "--asr", "none", "--tail-s", "0.5", "--quiet"]
    if verb == "qa":
        data = _qa_data(tmp_path / "qa", question)
        assert cli("bench", "qa", "--set", "halueval", "--data", str(data), *common) == 0, capsys.readouterr().err
        used = json.loads((out / "summary.json").read_text())["config"]["checkpoint"]
    else:
        data = _v3_data(tmp_path / "fdb_v3_data_released", question)
        assert cli("bench", "fdb-v3", "run", "--data", str(data), *common) == 0, capsys.readouterr().err
        used = json.loads((out / "ecom_001_x" / "result_cspan.json").read_text())["settings"]["checkpoint"]
    assert used["voice"] == "NATF2" and used["voice_form"] == "embeddings" and used["voice_default"] is False


def test_a_voice_that_is_not_there_is_one_line_naming_the_flag(pp_env, v1_dir: Path, tmp_path: Path, cli, capsys):
    """A name that is no voice, or a path where no file is (refused before the model loads): exit 2 and one line
    naming --voice (and the known voices), never a Python function."""
    for voice, expect in (
        ("NOPE", "--voice NOPE: voice 'NOPE' is not a file and 'NOPE' is not a known voice (known voices: NATF2)"),
        ("./nope.pt", "--voice ./nope.pt: no such file; pass a voice name, a .pt voice file, or a 2-30 s recording"),
    ):
        code = _run_v1(cli, v1_dir, pp_env["dir"], tmp_path / "out", "--voice", voice)
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.startswith(f"cspan bench fdb-v1 run: error: {expect}") and err.count("\n") == 1, err
        assert "()" not in err and not (tmp_path / "out").exists()


def test_a_voice_file_changed_in_place_is_another_voice(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    """The voice's record holds the SHA-256 of its file, so a resumed run whose voice file was replaced under the
    same path renders again (was: the path alone was compared, and the old voice's samples were kept)."""
    import hashlib

    from cspan.bench.session import settings_key
    from cspan.core.voice import CheckpointVoices, choose_voice

    voices = {p.stem: p for p in (tiny_checkpoint_dir / "voices").glob("*.pt")}
    checkpoint = CheckpointVoices(voices={}, archive_voices={}, lm_config=None, prefix_layout=None)
    mine = tmp_path / "mine.pt"
    keys = []
    for name in ("tiny0", "tiny1"):
        shutil.copy(voices[name], mine)
        described = choose_voice(str(mine), checkpoint).describe()
        assert described["voice_sha256"] == hashlib.sha256(mine.read_bytes()).hexdigest()
        assert described["voice_file"] == str(mine)
        keys.append(settings_key({"checkpoint": described}))
    assert keys[0] != keys[1]


@pytest.mark.slow
def test_a_fine_tune_retrained_at_the_same_path_is_rendered_again(
    v1_dir: Path, tiny_checkpoint_dir: Path, tmp_path: Path, cli, capsys, monkeypatch
) -> None:
    """The resume key named the checkpoint's files by path: a fine-tune retrained into the same export folder kept
    the old model's results ("rendered 0, kept 1"). The record holds the fine-tune file's weights fingerprint: the
    same weights saved again keep the sample, other weights render it again; a base without a fine-tune records no
    such key (its results keep their resume keys)."""
    from cspan.core.checkpoint import weights_fingerprint

    monkeypatch.delenv("CSPAN_VOICES_DIR", raising=False)
    base = load_checkpoint(tiny_checkpoint_dir, device="cpu", dtype=torch.float32)
    weight = base.lm.text_linear.weight.detach().clone()
    export = tmp_path / "export"
    export.mkdir()
    (export / "export.json").write_text(json.dumps({"base": str(tiny_checkpoint_dir)}))
    fine_tune = export / "context_spanning.pt"
    out = tmp_path / "out"

    def run(delta: float) -> tuple[str, dict[str, Any]]:
        torch.save({"model": {"text_linear.weight": weight + delta}}, fine_tune)  # a (re)training's export
        capsys.readouterr()
        assert _run_v1(cli, v1_dir, export, out) == 0
        said = capsys.readouterr().out
        return said[said.index("fdb-v1: rendered") :].split(",")[0], _record(out)["settings"]["checkpoint"]

    said, first = run(0.5)
    assert said == "fdb-v1: rendered 1" and first["files"]["fine_tune"] == str(fine_tune)
    assert first["fine_tune_fingerprint"] == weights_fingerprint(fine_tune)
    said, again = run(0.5)  # the same weights exported again (a new file, torch's new serialization id)
    assert said == "fdb-v1: rendered 0" and again == first
    said, other = run(-0.5)  # retrained: other weights at the same path
    assert said == "fdb-v1: rendered 1" and other["fine_tune_fingerprint"] != first["fine_tune_fingerprint"]
    assert {k: v for k, v in other.items() if k != "fine_tune_fingerprint"} == {
        k: v for k, v in first.items() if k != "fine_tune_fingerprint"
    }
    # the base alone: no fine-tune, no fingerprint key
    assert _run_v1(cli, v1_dir, tiny_checkpoint_dir, tmp_path / "base-out") == 0
    assert "fine_tune_fingerprint" not in _record(tmp_path / "base-out")["settings"]["checkpoint"]
