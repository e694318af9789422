"""``cspan prepare`` on dialogues spoken by espeak-ng: shards, manifest, alignment, spans, bad files, resumption."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from cspan.core.checkpoint import load_checkpoint
from cspan.core.cli import main
from cspan.core.constants import EPAD, PAD, RET
from cspan.core.prefix import build_persona_prefix
from cspan.train.data import read_stereo
from cspan.train.dataset import PreparedDataset, read_manifest


def _tensors(root: Path, shard: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    with safe_open(str(root / shard), framework="pt") as fh:
        return fh.get_tensor(f"{name}/codes"), fh.get_tensor(f"{name}/prefix")


def test_manifest_and_reported_bad_dialogues(prepared_dir: Path) -> None:
    records = {r.name: r for r in read_manifest(prepared_dir / "manifest.jsonl")}
    assert sorted(records) == ["cafe", "chat", "weather"]
    assert len(records["cafe"].spans) == 1 and len(records["weather"].spans) == 1 and not records["chat"].spans
    errors = [json.loads(line) for line in (prepared_dir / "errors.jsonl").read_text().splitlines()]
    by_file = {Path(e["file"]).name: e["error"] for e in errors}
    assert set(by_file) == {"bad_field.json", "no_audio.json"}
    assert "bad_field.json" in by_file["bad_field.json"] and "field turns[0]" in by_file["bad_field.json"]
    assert "no audio next to it" in by_file["no_audio.json"]
    info = json.loads((prepared_dir / "dataset.json").read_text())
    assert info["format"] == "cspan-train/1" and info["num_codebooks"] == 8 and info["card"] == 2048
    assert len(list((prepared_dir / "shards").glob("shard-*.safetensors"))) == 2  # 3 dialogues, 2 per shard
    assert len(PreparedDataset(prepared_dir)) == 3


def test_codes_text_row_and_span(prepared_dir: Path, espeak_dir: Path, tiny_dir: Path) -> None:
    ckpt = load_checkpoint(tiny_dir, device="cpu", dtype=torch.float32)
    rec = {r.name: r for r in read_manifest(prepared_dir / "manifest.jsonl")}["cafe"]
    codes, prefix = _tensors(prepared_dir, rec.shard, "cafe")
    assert codes.dtype == torch.int16
    codes = codes.long()
    user, agent, rate, _ = read_stereo(espeak_dir / "cafe.wav")
    assert rate == 22050
    T = -(-len(user) // 1920)
    assert codes.shape == (17, T) and rec.frames == T
    # audio rows: the agent (right channel) in rows 1..8, the user (left) in rows 9..16, as an unbatched encode
    with torch.no_grad():
        for pcm, rows in ((agent, slice(1, 9)), (user, slice(9, 17))):
            alone = ckpt.mimi.encode(torch.from_numpy(pcm)[None, None])[0, :8]
            assert torch.equal(codes[rows], alone)
    # text row: the agent's words in order, <ret> on the frame before the grounded turn, EPAD before words
    dialogue = json.loads((espeak_dir / "cafe.json").read_text())
    agent_turn = dialogue["turns"][1]
    text = codes[0]
    words = [t for t in text.tolist() if t not in (PAD, EPAD, RET)]
    assert ckpt.tokenizer.decode(words) == " ".join(w["word"] for w in agent_turn["words"])
    first = int(agent_turn["words"][0]["start"] * 12.5)
    assert text[first].item() == ckpt.tokenizer.encode("let")[0]
    assert text[first - 1].item() == RET and int((text == RET).sum()) == 1
    (span,) = rec.spans
    assert span.ret_frame == first - 1
    body = agent_turn["words"][9]
    assert body["word"] == "the"
    body_frame = int(body["start"] * 12.5)
    assert text[body_frame].item() == ckpt.tokenizer.encode("the")[0] and text[body_frame - 1].item() == EPAD
    assert span.deadline_frame == body_frame - 2
    assert list(span.ids) == [12, *ckpt.tokenizer.encode(agent_turn["reference"]), 13]
    assert span.tool == "lookup_hours" and span.arguments == {"place": "Silver Spoon Cafe"}
    # the persona prefix is the engine's layout
    expected = build_persona_prefix(ckpt.tokenizer, "You are Ada, a helpful park ranger.", None)
    assert torch.equal(prefix.long(), expected.frames)


def test_prefix_with_voice_and_profile(prepared_dir: Path, tiny_dir: Path) -> None:
    ckpt = load_checkpoint(tiny_dir, device="cpu", dtype=torch.float32)
    rec = {r.name: r for r in read_manifest(prepared_dir / "manifest.jsonl")}["weather"]
    _, prefix = _tensors(prepared_dir, rec.shard, "weather")
    expected = build_persona_prefix(
        ckpt.tokenizer,
        "You are Ada, a weather assistant.",
        ckpt.load_voice("tiny0"),
        user_name="Priya",
        user_city="Sydney",
    )
    assert torch.equal(prefix.long(), expected.frames)
    assert rec.prefix_frames == expected.num_frames and rec.extra["voice"] == "tiny0"
    assert "The user's name is Priya. The user is in Sydney." in rec.extra["persona"]


def test_resume_skips_finished_dialogues(
    prepared_dir: Path, espeak_dir: Path, tiny_dir: Path, tmp_path: Path, capsys
) -> None:
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(prepared_dir, out)
    argv = ["prepare", "--in-dir", str(espeak_dir), "--out-dir", str(out), "--checkpoint", str(tiny_dir)]
    argv += ["--device", "cpu", "--quiet"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "0 dialogue(s) prepared" in err and "3 already done" in err and "2 bad dialogue(s)" in err
    # drop one finished dialogue from the manifest: only that one is prepared again, into a new shard
    lines = (out / "manifest.jsonl").read_text().splitlines()
    kept = [line for line in lines if json.loads(line)["name"] != "chat"]
    (out / "manifest.jsonl").write_text("\n".join(kept) + "\n")
    assert main([*argv, "--strict"]) == 1  # --strict: bad dialogues give exit status 1
    err = capsys.readouterr().err
    assert "1 dialogue(s) prepared" in err
    records = {r.name: r for r in read_manifest(out / "manifest.jsonl")}
    assert sorted(records) == ["cafe", "chat", "weather"]
    assert records["chat"].shard == "shards/shard-00002.safetensors"
    original = {r.name: r for r in read_manifest(prepared_dir / "manifest.jsonl")}["chat"]
    assert torch.equal(
        _tensors(out, records["chat"].shard, "chat")[0], _tensors(prepared_dir, original.shard, "chat")[0]
    )


def test_a_dialogue_edited_since_it_was_prepared_is_prepared_again(
    prepared_dir: Path, espeak_dir: Path, tiny_dir: Path, tmp_path: Path, capsys
) -> None:
    """After a dialogue's JSON was edited (its reference text), a rerun said "3 already done" and kept the old span,
    although the manifest records json_sha256. A dialogue whose file changed since is now prepared again (its old
    record leaves the manifest even when the new file is bad); the unchanged ones are skipped as before."""
    dialogues, out = tmp_path / "dialogues", tmp_path / "data"
    shutil.copytree(espeak_dir, dialogues)  # another folder: unchanged files are recognised by their contents
    shutil.copytree(prepared_dir, out)
    cafe = json.loads((dialogues / "cafe.json").read_text())
    cafe["turns"][1]["reference"] = "The Silver Spoon Cafe opens at nine AM tomorrow."
    (dialogues / "cafe.json").write_text(json.dumps(cafe))
    weather = json.loads((dialogues / "weather.json").read_text())
    weather["turns"][1]["body_word"] = 99  # past the turn's words: now a bad dialogue
    (dialogues / "weather.json").write_text(json.dumps(weather))
    argv = ["prepare", "--in-dir", str(dialogues), "--out-dir", str(out), "--checkpoint", str(tiny_dir)]
    argv += ["--device", "cpu", "--quiet"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "2 dialogue(s) changed since they were prepared (cafe.json, weather.json): preparing them again" in err
    assert "resuming, 1 of 5 dialogues are already prepared" in err
    assert f"1 dialogue(s) prepared into {out}, 1 already done, 1 changed since, prepared again, 3 bad" in err, err
    assert "skipped weather.json: " in err
    before = {r.name: r for r in read_manifest(prepared_dir / "manifest.jsonl")}
    after = {r.name: r for r in read_manifest(out / "manifest.jsonl")}
    assert sorted(after) == ["cafe", "chat"]  # weather's stale record left with its edit
    assert after["chat"] == before["chat"]
    assert after["cafe"].shard == "shards/shard-00002.safetensors" != before["cafe"].shard
    assert after["cafe"].spans[0].reference == "The Silver Spoon Cafe opens at nine AM tomorrow."
    assert before["cafe"].spans[0].reference == "The Silver Spoon Cafe opens at seven thirty AM tomorrow."
    assert after["cafe"].spans[0].ids != before["cafe"].spans[0].ids
    assert after["cafe"].extra["json_sha256"] == hashlib.sha256((dialogues / "cafe.json").read_bytes()).hexdigest()
    codes, _ = _tensors(out, after["cafe"].shard, "cafe")  # same audio: same codes
    assert torch.equal(codes[1:], _tensors(prepared_dir, before["cafe"].shard, "cafe")[0][1:])
    assert len(PreparedDataset(out)) == 2
    # nothing changed since: all skipped
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"0 dialogue(s) prepared into {out}, 2 already done, 3 bad" in err and "changed" not in err, err


def test_print_schema(capsys) -> None:
    assert main(["prepare", "--print-schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "Dialogue" and "turns" in schema["properties"]


def test_read_stereo_applies_the_audio_rules_of_every_surface(tmp_path: Path, caplog) -> None:
    """The rules of cspan.core.audio: non-finite samples read as silence and counted; an absurd header rate refused
    with the same words as every other reader."""
    import struct

    import numpy as np
    import pytest
    import soundfile as sf

    from cspan.train.errors import DataError

    x = (0.3 * np.sin(np.arange(24_000) / 5.0)).astype(np.float32)
    stereo = np.stack([x, x], axis=1)
    stereo[100:105, 0] = np.nan
    stereo[200, 1] = -np.inf
    path = tmp_path / "nan.wav"
    sf.write(path, stereo, 24_000, subtype="FLOAT")
    with caplog.at_level("WARNING", logger="cspan.train.data"):
        user, agent, _, _ = read_stereo(path)
    assert np.isfinite(user).all() and np.isfinite(agent).all() and (user[100:105] == 0).all() and agent[200] == 0
    assert f"audio file {str(path)!r}: 6 NaN or infinite samples read as silence" in caplog.messages

    data = bytes(4 * 4800)
    fmt = struct.pack("<IHHIIHH", 16, 1, 2, 2_000_000_000, (2_000_000_000 * 4) % 2**32, 4, 16)
    bogus = tmp_path / "bogus.wav"
    bogus.write_bytes(
        b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + fmt + b"data" + struct.pack("<I", len(data)) + data
    )
    with pytest.raises(DataError, match=r"declares a sample rate of 2000000000 Hz, outside 1000\.\.768000 Hz"):
        read_stereo(bogus)


def test_missing_or_damaged_shards_are_named_by_train_and_encoded_again_by_prepare(
    prepared_dir: Path, espeak_dir: Path, tiny_dir: Path, tmp_path: Path, capsys
) -> None:
    """A missing shard made `cspan train` say "run `cspan prepare` again (it re-encodes what is missing)", and
    prepare then said "already done" and wrote nothing; a truncated shard gave a SafetensorError traceback in train
    (and an out folder behind) and prepare did not notice. Train now names the file in one line before anything is
    written; prepare checks the shards it counts as done (header, size, tensors) and encodes their dialogues again."""
    import os

    out = tmp_path / "copy"
    shutil.copytree(prepared_dir, out)
    records = {r.name: r for r in read_manifest(out / "manifest.jsonl")}
    damaged = out / records["cafe"].shard
    missing = out / records["weather"].shard
    assert damaged != missing
    os.truncate(damaged, damaged.stat().st_size - 10)  # the header still parses: the size gives it away
    missing.unlink()

    run = tmp_path / "run"
    argv = ["train", "--data-dir", str(out), "--out-dir", str(run), "--checkpoint", str(tiny_dir), "--context", "120"]
    assert main([*argv, "--steps", "1", "--accum", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"cspan train: error: shard {str(damaged)!r} is damaged (") and "truncated" in err, err
    assert "(and 1 other shard(s))" in err and "run `cspan prepare` again" in err
    assert not run.exists()

    argv = ["prepare", "--in-dir", str(espeak_dir), "--out-dir", str(out), "--checkpoint", str(tiny_dir)]
    assert main([*argv, "--device", "cpu", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"shard {str(damaged)!r} is damaged (" in err and f"shard {str(missing)!r} is missing" in err, err
    assert "3 dialogue(s) prepared" in err and "already done" not in err, err
    after = {r.name: r for r in read_manifest(out / "manifest.jsonl")}
    assert sorted(after) == ["cafe", "chat", "weather"]
    dataset = PreparedDataset(out)  # every shard whole again
    original = {r.name: r for r in read_manifest(prepared_dir / "manifest.jsonl")}
    for name, rec in after.items():
        codes, prefix = _tensors(out, rec.shard, name)
        assert torch.equal(codes, _tensors(prepared_dir, original[name].shard, name)[0])
        assert prefix.shape[1] == rec.prefix_frames
    assert len(dataset) == 3


LONG_PERSONA = " ".join(["word"] * 5000)


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        (["--max-span-frames", "0"], "--max-span-frames 0: must be at least 3 (a Context Span block holds"),
        (
            ["--voice", "nosuchvoice"],
            "--voice 'nosuchvoice': neither a voice file nor a voice of the checkpoint (known: tiny0, tiny1)",
        ),
        (
            ["--persona", LONG_PERSONA],
            "--persona: the persona takes 15017 frames (0 of voice prompt, 15016 text tokens from 24999 characters) "
            "of the model's 3000-position attention window; at most 1500 leave room to talk; shorten it",
        ),
        (["--out-dir", "FILE"], "--out-dir 'FILE' is a file; give a folder (a new one, or one to resume)"),
    ],
)
def test_global_flags_are_checked_up_front(
    flags, expect, espeak_dir: Path, tiny_dir: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """`--max-span-frames 0` skipped every grounded dialogue ("must be at least 3") and exited 0; `--voice
    nosuchvoice` blamed each dialogue's voice field; a 5000-word `--persona` gave 15017 prefix frames against a
    3000-position window. Each is now one line naming the flag, exit status 2, before anything is written."""
    monkeypatch.chdir(tmp_path)
    Path("FILE").write_text("not a folder")
    argv = ["prepare", "--in-dir", str(espeak_dir), "--out-dir", str(tmp_path / "data"), "--checkpoint", str(tiny_dir)]
    assert main([*argv, "--device", "cpu", "--quiet", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cspan prepare: error: {expect}") and err.count("\n") == 1, err
    assert not (tmp_path / "data").exists()


def test_a_moshi_finetune_dataset_folder_is_named(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    """moshi-finetune's dataset is a ``data.jsonl`` list of wavs in subfolders: given its folder, prepare said only
    "holds no *.json dialogue file"; now it names the list as one it does not read."""
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "data.jsonl").write_text(json.dumps({"path": "data_stereo/a.wav", "duration": 8.0}) + "\n")
    argv = ["prepare", "--in-dir", str(tmp_path / "ds"), "--out-dir", str(tmp_path / "data"), "--checkpoint"]
    assert main([*argv, str(tiny_dir), "--device", "cpu", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"cspan prepare: error: --in-dir {str(tmp_path / 'ds')!r} holds no *.json dialogue file (format: "
        "docs/TRAINING.md); data.jsonl is a list of files (moshi-finetune's data.jsonl?), which cspan prepare does "
        "not read: give the folder of the dialogues themselves\n"
    )
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        (["--max-span-frames", "300"], "--max-span-frames 300: {out} was prepared with --max-span-frames 600"),
        (["--persona", "You are Bob."], "--persona 'You are Bob.': {out} was prepared with --persona none (not given)"),
        (["--voice", "tiny1"], "--voice 'tiny1': {out} was prepared with --voice none (not given)"),
    ],
)
def test_resuming_with_other_encoding_settings_is_refused(
    flags, expect, prepared_dir: Path, espeak_dir: Path, tiny_dir: Path, tmp_path: Path, capsys
) -> None:
    """Resuming with another --max-span-frames (or default persona or voice) was accepted and dataset.json rewritten:
    one dataset would hold dialogues encoded two ways. Refused naming the flag and both values; nothing changes."""
    out = tmp_path / "copy"
    shutil.copytree(prepared_dir, out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    argv = ["prepare", "--in-dir", str(espeak_dir), "--out-dir", str(out), "--checkpoint", str(tiny_dir)]
    assert main([*argv, "--device", "cpu", "--quiet", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cspan prepare: error: {expect.format(out=repr(str(out)))}") and err.count("\n") == 1, err
    assert "resume with that value, or prepare into a new --out-dir" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


@pytest.mark.parametrize(
    ("recorded", "expect"),
    [
        ({"prefix_layout": "personaplex"}, "was prepared with the 'personaplex' persona prefix layout, this "
         "checkpoint uses 'context-spanning'"),
        ({"tokenizer_sha256": "0" * 64}, f"was prepared with another tokenizer (sha256 {'0' * 64})"),
        ({"codec_sha256": "f" * 64}, "was prepared with another codec (Mimi of "),
        ({"card": 1024}, "was prepared with another codec; "),
    ],
    ids=["layout", "tokenizer", "codec", "card"],
)  # fmt: skip
def test_resuming_into_a_dataset_of_another_checkpoint_is_a_bad_setting(
    recorded: dict, expect: str, prepared_dir: Path, espeak_dir: Path, tiny_dir: Path, tmp_path: Path
) -> None:
    """`cspan prepare` into an --out-dir prepared with another persona prefix layout (or tokenizer, or codec) exited
    with status 1, while resuming with another --persona or --max-span-frames exited 2. Every resume mismatch is a
    setting that does not fit the --out-dir: exit status 2, one line naming the flag (--checkpoint), nothing
    changed."""
    import os
    import subprocess
    import sys

    out = tmp_path / "copy"
    shutil.copytree(prepared_dir, out)
    info = json.loads((out / "dataset.json").read_text())
    (out / "dataset.json").write_text(json.dumps({**info, **recorded}, indent=2) + "\n")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    env = {k: v for k, v in os.environ.items() if not k.startswith("CSPAN_")}
    done = subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", "prepare", "--in-dir", str(espeak_dir), "--out-dir", str(out),
         "--checkpoint", str(tiny_dir), "--device", "cpu", "--quiet"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"cspan prepare: error: --checkpoint {str(tiny_dir)!r}: {str(out)!r} {expect}"), (
        done.stderr
    )
    assert (
        done.stderr.endswith("; prepare into a new --out-dir, or delete the old one\n") and done.stderr.count("\n") == 1
    ), done.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("verb", ["prepare", "train"])
def test_help_states_each_default_once(verb: str, capsys) -> None:
    """`cspan prepare --help` showed '(4) (default: 4)': the help lines say their defaults, the formatter added them
    again."""
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "threads reading and aligning dialogues (4)" in out or verb == "train"
    assert "(default: 4)" not in out and "(default: 1000)" not in out and "(default: None)" not in out, out
