"""``cspan infer`` with every voice form: PersonaPlex's ``--voice NATF2`` from a Hub snapshot's ``voices.tgz`` (a
subprocess, as a user runs it), a voice cloned from a recording (``--voice greeting.wav``) and its round trip through
``cspan voice encode``, a bad recording refused before anything loads (``infer`` and ``serve``), and ``--fuse-lora``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import torch
from personaplex_snapshot import NATF2_FRAMES, REPO, personaplex_snapshot

from cspan.core.cli import build_parser
from cspan.core.settings import settings_from_args
from cspan.core.voice import choose_voice
from cspan.server.infer import run_infer

PROMPT = "You are Ada."


def _argv(out: Path, inp: Path, *extra: str) -> list[str]:
    return [
        "infer",
        "--input-wav", str(inp),
        "--output-wav", str(out / "out.wav"),
        "--output-text", str(out / "out.json"),
        "--lead-silence", "0.5",
        "--tail-silence", "0.5",
        "--device", "cpu",
        "--asr", "none",
        "--router", "none",
        "--text-prompt", PROMPT,
        "--seed", "7",
        "--quiet",
        *extra,
    ]  # fmt: skip


def _infer(out: Path, inp: Path, *extra: str) -> Any:
    out.mkdir(parents=True, exist_ok=True)
    return asyncio.run(run_infer(settings_from_args(build_parser().parse_args(_argv(out, inp, *extra)))))


def _cli(capsys, *args: str) -> SimpleNamespace:
    """``cspan ARGS`` in this process (no torch start-up per call)."""
    from cspan.core.cli import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def _frames(persona: Any) -> dict[str, Any]:
    """The persona block's sizes, without the voice it names (``voice``, ``voice_file``...: each run's own)."""
    return persona.model_dump(include={"frames", "voice_frames", "text_tokens", "window"})


@pytest.fixture(scope="module")
def greeting(fixture_file) -> Path:
    return fixture_file("audio", "greeting_24k.wav")


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory, tiny_checkpoint_dir: Path, tiny_checkpoint, greeting: Path) -> dict[str, Any]:
    return personaplex_snapshot(tmp_path_factory.mktemp("pp-snapshot"), tiny_checkpoint_dir, tiny_checkpoint, greeting)


@pytest.fixture
def offline_snapshot(snapshot, monkeypatch) -> dict[str, Any]:
    """``nvidia/personaplex-7b-v1`` resolves to the snapshot in this process."""
    for name, value in snapshot["env"].items():
        monkeypatch.setenv(name, value)
    for name in ("HF_HUB_CACHE", "CSPAN_BASE", "CSPAN_VOICES_DIR", "CSPAN_CHECKPOINT"):
        monkeypatch.delenv(name, raising=False)
    return snapshot


@pytest.mark.timeout(600)
def test_personaplex_snapshot_runs_with_natf2(snapshot, greeting: Path, tmp_path: Path) -> None:
    """``cspan infer --checkpoint nvidia/personaplex-7b-v1 --voice NATF2``: voices.tgz found in the Hub snapshot, the
    embedding voice read in PersonaPlex's layout, the conversation run to the end."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "CSPAN_BASE", "CSPAN_VOICES_DIR")}
    env.update(snapshot["env"])
    argv = _argv(tmp_path, greeting, "--checkpoint", REPO, "--voice", "NATF2", "--temp", "0", "--temp-text", "0")
    done = subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", *argv], env=env, capture_output=True, text=True, timeout=540
    )
    assert done.returncode == 0, done.stderr
    output = json.loads((tmp_path / "out.json").read_text())
    persona = output["persona"]
    assert persona["voice_frames"] == NATF2_FRAMES - 1  # PersonaPlex never reads a voice's first frame
    assert persona["frames"] == NATF2_FRAMES - 1 + 6 + persona["text_tokens"] + 6  # 6 silence frames each side
    assert output["settings"]["voice"] == "NATF2" and output["checkpoint"]["source"] == REPO
    assert (persona["voice"], persona["voice_form"], persona["voice_default"]) == ("NATF2", "embeddings", False)
    assert Path(persona["voice_file"]).name == "NATF2.pt"
    audio, rate = sf.read(tmp_path / "out.wav", dtype="float32")
    assert rate == 24000 and audio.shape[1] == 2 and np.isfinite(audio).all()
    assert len(audio) == output["timing"]["frames"] * 1920


@pytest.mark.timeout(600)
def test_natf2_speaks_as_the_codes_it_was_made_from(offline_snapshot, greeting: Path, tmp_path: Path) -> None:
    """The embedding voice gives the run the codes voice it was saved from gives (greedy: the same words, the same
    audio), and serve-side names (``NATF2.pt``) resolve too."""
    codes_file = tmp_path / "natf2-codes.pt"
    torch.save({"codes": offline_snapshot["codes"]}, codes_file)
    greedy = ("--checkpoint", REPO, "--temp", "0", "--temp-text", "0")
    by_embeddings = _infer(tmp_path / "emb", greeting, *greedy, "--voice", "NATF2.pt")
    by_codes = _infer(tmp_path / "codes", greeting, *greedy, "--voice", str(codes_file))
    assert _frames(by_embeddings.output.persona) == _frames(by_codes.output.persona)
    assert (by_embeddings.output.persona.voice, by_embeddings.output.persona.voice_form) == ("NATF2.pt", "embeddings")
    assert (by_codes.output.persona.voice, by_codes.output.persona.voice_form) == (str(codes_file), "codes")
    assert by_embeddings.output.agent_text == by_codes.output.agent_text
    a, _ = sf.read(tmp_path / "emb" / "out.wav", dtype="float32")
    b, _ = sf.read(tmp_path / "codes" / "out.wav", dtype="float32")
    np.testing.assert_array_equal(a, b)


@pytest.mark.timeout(600)
def test_cloned_voice_round_trips_through_voice_encode(
    tiny_checkpoint_dir: Path, tiny_checkpoint, greeting: Path, tmp_path: Path, capsys
) -> None:
    """``--voice greeting.wav`` clones the recording; ``cspan voice encode`` writes the same codes to a file, which
    gives the same prefix and so the same conversation."""
    mine = tmp_path / "mine.pt"
    done = _cli(capsys, "voice", "encode", str(greeting), str(mine), "--checkpoint", str(tiny_checkpoint_dir))
    assert done.returncode == 0, done.stderr
    by_recording = choose_voice(str(greeting), tiny_checkpoint).prompt  # as --voice reads it
    by_file = choose_voice(str(mine), tiny_checkpoint).prompt
    assert by_recording.kind == by_file.kind == "codes"
    assert torch.equal(by_recording.codes, by_file.codes) and by_file.codes.shape == (8, 46)

    ckpt = ("--checkpoint", str(tiny_checkpoint_dir))
    wav = _infer(tmp_path / "wav", greeting, *ckpt, "--voice", str(greeting))
    pt = _infer(tmp_path / "pt", greeting, *ckpt, "--voice", str(mine))
    assert wav.output.persona.voice_frames == pt.output.persona.voice_frames == 46
    assert _frames(wav.output.persona) == _frames(pt.output.persona)
    assert (wav.output.persona.voice_form, pt.output.persona.voice_form) == ("recording", "codes")
    a, _ = sf.read(tmp_path / "wav" / "out.wav", dtype="float32")
    b, _ = sf.read(tmp_path / "pt" / "out.wav", dtype="float32")
    np.testing.assert_array_equal(a, b)
    assert wav.output.agent_text == pt.output.agent_text


def _short(greeting: Path, path: Path) -> None:
    sf.write(path, sf.read(greeting, dtype="float32")[0][:24000], 24000)


def _silent(greeting: Path, path: Path) -> None:
    sf.write(path, np.zeros(72000, dtype=np.float32), 24000)


def _not_audio(greeting: Path, path: Path) -> None:
    path.write_bytes(b"RIFF not really a wave file" * 10)


@pytest.mark.parametrize("command", ["infer", "serve"])
@pytest.mark.parametrize(
    ("make", "expect"),
    [(_short, "1.00 s long"), (_silent, "is silent"), (_not_audio, "cannot decode audio")],
    ids=["short", "silent", "not-audio"],
)
def test_bad_recording_as_voice_is_refused_before_loading(
    command: str, make, expect: str, greeting: Path, tmp_path: Path, capsys
) -> None:
    voice = tmp_path / "voice.wav"
    make(greeting, voice)
    missing = ("--checkpoint", str(tmp_path / "no-such-checkpoint"), "--voice", str(voice))
    if command == "infer":
        argv = _argv(tmp_path, greeting, *missing)
    else:
        argv = ["serve", *missing, "--asr", "none", "--router", "none", "--db", ":memory:"]
    done = _cli(capsys, *argv)
    assert done.returncode == 2, done.stderr  # a bad setting: refused before the (missing) checkpoint is looked at
    assert "--voice" in done.stderr and expect in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out.wav").exists()


@pytest.fixture(scope="module")
def lora_dir(tiny_checkpoint_dir: Path, tmp_path_factory) -> Path:
    """A moshi-finetune adapter (``lora.safetensors`` + ``config.json``) on the tiny model's text head."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("lora")
    weight = load_file(tiny_checkpoint_dir / "model.safetensors")["text_linear.weight"]
    gen = torch.Generator().manual_seed(1)
    save_file(
        {
            "text_linear.lora_A.weight": torch.randn(4, weight.shape[1], generator=gen) * 0.05,
            "text_linear.lora_B.weight": torch.randn(weight.shape[0], 4, generator=gen) * 0.05,
        },
        folder / "lora.safetensors",
    )
    config = json.loads((tiny_checkpoint_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "lora": True, "lora_rank": 4, "lora_scaling": 2.0}))
    return folder


@pytest.mark.timeout(600)
def test_fuse_lora_folds_the_adapters(lora_dir: Path, tiny_checkpoint_dir: Path, greeting: Path, tmp_path, monkeypatch):
    from cspan.core.lora import LoRALinear

    monkeypatch.setenv("CSPAN_BASE", str(tiny_checkpoint_dir))  # the base from the environment ...
    kept = _infer(tmp_path / "kept", greeting, "--checkpoint", str(lora_dir))
    monkeypatch.delenv("CSPAN_BASE")  # ... and from --base, as docs/COMING-FROM-MOSHI.md gives it
    fused = _infer(
        tmp_path / "fused", greeting, "--checkpoint", str(lora_dir), "--base", str(tiny_checkpoint_dir), "--fuse-lora"
    )
    assert fused.engine.checkpoint.files["lm"] == tiny_checkpoint_dir / "model.safetensors"
    assert fused.output.settings["base"] == str(tiny_checkpoint_dir)
    assert any(isinstance(m, LoRALinear) for m in kept.engine.lm.modules())
    assert not any(isinstance(m, LoRALinear) for m in fused.engine.lm.modules())
    assert fused.engine.checkpoint.lora["merged"] and fused.output.settings["fuse_lora"] is True
