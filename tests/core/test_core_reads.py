"""The one rule that keeps a run's outputs off what it reads (``cspan.core.reads``; docs/OUTPUT.md, "Outputs never
overwrite what the run reads"), and what a checkpoint makes read (``checkpoint_reads``), found without downloading."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from cspan.core.checkpoint import LM_FILE, TOKENIZER_FILE, checkpoint_reads
from cspan.core.errors import CspanError, SettingsError
from cspan.core.reads import Reads, check_outputs


def _refused(outputs: dict, reads: Reads, match: str, **kwargs) -> None:
    with pytest.raises(SettingsError, match=match) as err:
        check_outputs(outputs, reads, **kwargs)
    assert "\n" not in str(err.value)


def test_a_read_file_is_refused_under_any_name(tmp_path: Path) -> None:
    model = tmp_path / "ckpt" / "model.bin"
    model.parent.mkdir()
    model.write_bytes(b"weights")
    (tmp_path / "sub").mkdir()
    os.link(model, tmp_path / "hard.bin")
    (tmp_path / "soft.bin").symlink_to(model)
    reads = Reads().file("--model", model, "the --model's weights")
    for name in (model, tmp_path / "sub" / ".." / "ckpt" / "model.bin", tmp_path / "hard.bin", tmp_path / "soft.bin"):
        _refused({"--out": name}, reads, rf"^--out {name}: is the --model's weights.*refusing to overwrite it$")
    check_outputs({"--out": tmp_path / "other.bin"}, reads)  # a file beside it is fine
    assert model.read_bytes() == b"weights"


def test_a_read_folder_is_refused_with_everything_inside_it(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    (notes / "deep").mkdir(parents=True)
    (notes / "a.md").write_text("note")
    outside = tmp_path / "linked.md"
    os.link(notes / "a.md", outside)  # a hard link to a read folder's file, from outside it
    (tmp_path / "via").symlink_to(notes)
    reads = Reads().folder("--knowledge", notes)
    _refused({"--out": notes / "a.md"}, reads, "lies inside the --knowledge folder")
    _refused({"--out": notes / "deep" / "new.json"}, reads, "lies inside the --knowledge folder")
    _refused({"--out": tmp_path / "via" / "new.json"}, reads, "lies inside the --knowledge folder")
    _refused({"--out": outside}, reads, "is a hard link to a file of the --knowledge folder")
    _refused({}, reads, "is the --knowledge folder", folders={"--out-dir": notes})
    _refused({}, reads, "lies inside the --knowledge folder", folders={"--out-dir": notes / "deep"})
    check_outputs({}, reads, folders={"--out-dir": tmp_path})  # a folder holding a read folder: only its own names


def test_the_context_db_and_its_journal_files_are_read(tmp_path: Path) -> None:
    db = tmp_path / "memory.sqlite"
    reads = Reads().sqlite("--db", db)
    for suffix in ("", "-wal", "-shm", "-journal"):
        _refused({"--output-text": f"{db}{suffix}"}, reads, rf"is the Context DB of --db {db}")


def test_outputs_that_are_one_file_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.wav").write_bytes(b"x")
    os.link(tmp_path / "a.wav", tmp_path / "b.json")
    (tmp_path / "c.json").symlink_to(tmp_path / "new.wav")  # dangling: the file it would make
    _refused(
        {"--wav": tmp_path / "a.wav", "--text": tmp_path / "b.json"}, Reads(), "--wav and --text are the same file"
    )
    _refused({"--wav": tmp_path / "new.wav", "--text": tmp_path / "c.json"}, Reads(), "are the same file")
    _refused({"--text": tmp_path}, Reads(), "is a directory")
    with pytest.raises(CspanError, match="not a regular file"):
        check_outputs({"--text": "/dev/null"}, Reads())


def test_checkpoint_reads_of_a_folder_a_file_and_a_fine_tune(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint_dir, ckpt)
    folder = checkpoint_reads(ckpt)
    _refused({"--o": ckpt / "new.json"}, folder, "lies inside the --checkpoint folder")
    _refused({"--o": ckpt / TOKENIZER_FILE}, folder, "is the --checkpoint's tokenizer")

    alone = checkpoint_reads(ckpt / LM_FILE)  # a file: its files, not its whole folder
    _refused({"--o": ckpt / "config.json"}, alone, "is the --checkpoint's config.json")
    _refused({"--o": ckpt / "voices" / "x.pt"}, alone, "lies inside the --checkpoint's voices folder")
    check_outputs({"--o": ckpt / "out.wav"}, alone)

    ft = tmp_path / "run"
    ft.mkdir()
    (ft / "model.pt").write_bytes(b"not loaded")
    (ft / "export.json").write_text(json.dumps({"base": str(ckpt)}))
    tuned = checkpoint_reads(ft / "model.pt")
    _refused({"--o": ft / "model.pt"}, tuned, "is the --checkpoint's fine-tune")
    _refused({"--o": ft / "export.json"}, tuned, "is the --checkpoint's export.json")
    _refused({"--o": ckpt / LM_FILE}, tuned, "is the base checkpoint's LM weights")
    _refused({"--o": ckpt / "x.json"}, tuned, "lies inside the base checkpoint folder")
    check_outputs({"--o": ft / "out.wav"}, tuned)
    only_model = checkpoint_reads(ft / "model.pt", folders=False)  # `cspan voice encode`: no voices, no folders
    check_outputs({"--o": ckpt / "voices" / "new.pt"}, only_model)


def test_checkpoint_reads_of_a_hub_repo_come_from_the_cache_only(
    tiny_checkpoint_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """A repo id resolves to its cached snapshot (read whole) without the network; one not cached is no error."""
    import huggingface_hub

    hub = tmp_path / "hf" / "hub" / "models--acme--tiny"
    snapshot = hub / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_checkpoint_dir, snapshot)
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("CSPAN_VOICES_DIR", raising=False)
    calls = []
    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(
        huggingface_hub, "snapshot_download", lambda *a, **k: calls.append(k["local_files_only"]) or real(*a, **k)
    )
    _refused({"--o": snapshot / "out.json"}, checkpoint_reads("acme/tiny"), "lies inside the --checkpoint folder")
    assert len(checkpoint_reads("acme/not-cached")) == 0
    assert calls == [True, True]
