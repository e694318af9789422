"""No output of a run overwrites what the run reads (docs/OUTPUT.md, "Outputs never overwrite what the run reads").

A new user's `cspan infer --output-text demo/tiny-checkpoint/model.safetensors` exited 0 and replaced the model's
weights with the JSON; so did the tokenizer, config.json, a voice and a --knowledge note. Each output here is
refused with exit status 2 and one line naming the flag and the file, before the model loads, and every file the
run reads is byte-identical afterwards. `cspan voice encode` and `cspan db export` follow the same rule.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from cspan.core import cli


@pytest.fixture
def no_model_load(monkeypatch):
    import cspan.core.checkpoint as checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the output was refused")

    monkeypatch.setattr(checkpoint, "load_checkpoint", refuse)


def _digests(*roots: Path) -> dict[str, str]:
    files = [p for root in roots for p in ([root] if root.is_file() else sorted(root.rglob("*"))) if p.is_file()]
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture
def world(tiny_checkpoint_dir: Path, fixtures_dir: Path, tmp_path: Path, monkeypatch) -> dict[str, Path]:
    """A copy of the tiny checkpoint, a fine-tune over it, a notes folder, a Context DB, an MCP script, links."""
    monkeypatch.delenv("CSPAN_CONFIG", raising=False)
    monkeypatch.delenv("CSPAN_VOICES_DIR", raising=False)
    ckpt = tmp_path / "demo" / "tiny-checkpoint"
    shutil.copytree(tiny_checkpoint_dir, ckpt)
    ft = tmp_path / "ft"
    ft.mkdir()
    (ft / "model.pt").write_bytes(b"a fine-tune (never loaded here)")
    (ft / "export.json").write_text(json.dumps({"base": str(ckpt)}))
    kn = tmp_path / "kn"
    kn.mkdir()
    (kn / "library.md").write_text("# Library\nOpen 9 to 5.\n")
    voices = tmp_path / "myvoices"
    voices.mkdir()
    shutil.copyfile(ckpt / "voices" / "tiny0.pt", voices / "me.pt")
    db = tmp_path / "memory.sqlite"
    db.write_bytes(b"SQLite format 3\x00 keep me")
    (tmp_path / "srv.py").write_text("print('an MCP server')\n")
    (tmp_path / "infer.toml").write_text('asr = "none"\n')
    os.link(ckpt / "tokenizer_spm_32k_3.model", tmp_path / "hard.model")
    (tmp_path / "ckpt-link").symlink_to(ckpt)
    inp = tmp_path / "short.wav"
    shutil.copyfile(fixtures_dir / "audio" / "greeting_24k.wav", inp)
    return {"tmp": tmp_path, "ckpt": ckpt, "ft": ft, "kn": kn, "voices": voices, "db": db, "in": inp}


INFER_CASES = [
    # (extra flags, the message after "cspan infer: error: "), {ckpt} etc. filled from the world
    (["--output-text", "{ckpt}/model.safetensors"], "--output-text {ckpt}/model.safetensors: is the --checkpoint's LM weights"),
    (["--output-text", "{ckpt}/tokenizer_spm_32k_3.model"], "--output-text {ckpt}/tokenizer_spm_32k_3.model: is the --checkpoint's tokenizer"),
    (["--output-text", "{ckpt}/tokenizer-e351c8d8-checkpoint125.safetensors"], "is the --checkpoint's Mimi weights"),
    (["--output-text", "{ckpt}/config.json"], "--output-text {ckpt}/config.json: is the --checkpoint's config.json"),
    (["--output-text", "{ckpt}/voices/tiny0.pt"], "--output-text {ckpt}/voices/tiny0.pt: lies inside the --checkpoint folder {ckpt}"),
    (["--output-wav", "{ckpt}/o.wav"], "--output-wav {ckpt}/o.wav: lies inside the --checkpoint folder"),
    (["--output-text", "{tmp}/hard.model"], "--output-text {tmp}/hard.model: is the --checkpoint's tokenizer ({ckpt}/tokenizer"),
    (["--output-text", "{tmp}/ckpt-link/config.json"], "is the --checkpoint's config.json ({ckpt}/config.json)"),
    (["--output-text", "{tmp}/kn/../demo/tiny-checkpoint/README.md"], "lies inside the --checkpoint folder"),
    (["--output-text", "{kn}/library.md", "--knowledge", "{kn}"], "--output-text {kn}/library.md: lies inside the --knowledge folder {kn}"),
    (["--output-text", "{kn}/new.json", "--knowledge", "{kn}"], "lies inside the --knowledge folder"),
    (["--output-text", "{db}-wal", "--db", "{db}"], "--output-text {db}-wal: is the Context DB of --db {db}"),
    (["--output-text", "{tmp}/srv.py", "--mcp", "python3 {tmp}/srv.py"], "is a file of --mcp python3 {tmp}/srv.py"),
    (["--output-text", "{tmp}/infer.toml", "--mcp", "mcp-srv --data={tmp}/infer.toml"], "is a file of --mcp mcp-srv --data="),
    (["--output-text", "{tmp}/infer.toml", "--config", "{tmp}/infer.toml"], "is the --config file"),
    (["--output-text", "{voices}/me.pt", "--voice", "{voices}/me.pt"], "is the --voice file"),
    (["--output-wav", "{in}"], "--output-wav {in}: is the --input-wav recording"),
    (["--output-text", "{tmp}/o.wav"], "--output-wav and --output-text are the same file"),
    (["--output-text", "{ft}/export.json", "--checkpoint", "{ft}/model.pt"], "is the --checkpoint's export.json"),
    (["--output-text", "{ft}/model.pt", "--checkpoint", "{ft}/model.pt"], "is the --checkpoint's fine-tune"),
    (["--output-text", "{ckpt}/model.safetensors", "--checkpoint", "{ft}/model.pt"], "is the base checkpoint's LM weights"),
    (["--output-text", "{ckpt}/x.json", "--checkpoint", "{ft}", "--base", "{ckpt}"], "lies inside the base checkpoint folder"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "message"), INFER_CASES, ids=[f"{i}" for i in range(len(INFER_CASES))])
def test_infer_refuses_an_output_over_what_the_run_reads(extra, message, world, capsys, no_model_load) -> None:
    fill = {k: str(v) for k, v in world.items()}
    extra = [arg.format(**fill) for arg in extra]
    before = _digests(world["ckpt"], world["ft"], world["kn"], world["voices"], world["db"], world["in"], world["tmp"])
    argv = [
        "infer", "--input-wav", fill["in"], "--output-wav", f"{fill['tmp']}/o.wav", "--checkpoint", fill["ckpt"],
        "--device", "cpu", "--quiet", "--asr", "none", "--router", "none", "--db", ":memory:", *extra,
    ]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("cspan infer: error: ") and message.format(**fill) in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    after = _digests(world["ckpt"], world["ft"], world["kn"], world["voices"], world["db"], world["in"], world["tmp"])
    assert after == before
    assert not (world["tmp"] / "o.wav").exists() and not list(world["tmp"].rglob("*.part"))


def test_voices_dir_of_the_environment_is_read(world, capsys, monkeypatch, no_model_load) -> None:
    monkeypatch.setenv("CSPAN_VOICES_DIR", str(world["voices"]))
    argv = ["infer", "--input-wav", str(world["in"]), "--output-wav", str(world["voices"] / "o.wav"),
            "--checkpoint", str(world["ckpt"]), "--device", "cpu", "--quiet", "--db", ":memory:"]  # fmt: skip
    assert cli.main(argv) == 2
    assert "lies inside the voices folder of $CSPAN_VOICES_DIR" in capsys.readouterr().err
    assert sorted(p.name for p in world["voices"].iterdir()) == ["me.pt"]


def test_voice_encode_refuses_an_output_over_the_model_or_the_recording(world, capsys) -> None:
    ckpt, ft = world["ckpt"], world["ft"]
    rec = world["tmp"] / "rec.pt"  # a recording under a .pt name: the input itself
    shutil.copyfile(world["in"], rec)
    cases = [
        ([str(world["in"]), str(ft / "model.pt"), "--checkpoint", str(ft / "model.pt")], "is the --checkpoint's fine-tune"),
        ([str(rec), str(rec), "--checkpoint", str(ckpt)], f"OUT {rec}: is the recording IN"),
        ([str(world["in"]), str(world["tmp"] / "hard.pt"), "--checkpoint", str(ckpt)], "is the --checkpoint's config.json"),
    ]  # fmt: skip
    os.link(ckpt / "config.json", world["tmp"] / "hard.pt")  # another name of a file the model reads
    before = _digests(ckpt, ft, rec)
    for args, message in cases:
        assert cli.main(["voice", "encode", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("cspan voice encode: error: ") and message in err and err.count("\n") == 1, err
    assert _digests(ckpt, ft, rec) == before
    # the model's files alone are read: a new voice may go into the checkpoint's voices folder
    assert (
        cli.main(["voice", "encode", str(world["in"]), str(ckpt / "voices" / "mine.pt"), "--checkpoint", str(ckpt)])
        == 0
    )
    assert (ckpt / "voices" / "mine.pt").is_file()


def test_db_export_refuses_the_context_db_and_its_journals(tmp_path, capsys) -> None:
    from cspan.backends.context_db import ContextDB
    from cspan.backends.context_db.models import Profile

    path = tmp_path / "memory.sqlite"
    db = ContextDB(str(path))
    db.user("alice").put_profile(Profile(user_id="alice", name="Alice"))
    db.close()
    os.link(path, tmp_path / "hard.json")
    (tmp_path / "sub").mkdir()
    before = _digests(tmp_path)
    for out, what in [(path, "Context DB"), (tmp_path / "sub" / ".." / "memory.sqlite-wal", "Context DB journal -wal"),
                      (tmp_path / "hard.json", "Context DB")]:  # fmt: skip
        assert cli.main(["db", "export", "alice", "--db", str(path), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert (
            err == f"cspan db export: error: --out {out}: is the {what} of --db {path}, which the run reads; "
            "refusing to overwrite it\n"
        ), err
    assert _digests(tmp_path) == before
    assert cli.main(["db", "export", "alice", "--db", str(path), "--out", str(tmp_path / "alice.json")]) == 0
    assert json.loads((tmp_path / "alice.json").read_text())["user_id"] == "alice"


def test_train_refuses_an_out_dir_in_the_checkpoint_folder(world, capsys, monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = _digests(world["ckpt"])
    argv = ["train", "--data-dir", str(world["tmp"] / "data"), "--out-dir", str(world["ckpt"]),
            "--checkpoint", str(world["ckpt"])]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--out-dir {world['ckpt']}: is the --checkpoint folder, which the run reads" in err, err
    assert _digests(world["ckpt"]) == before
