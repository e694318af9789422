"""PersonaPlex's base as it ships: a Hub snapshot (fake Hugging Face cache in the real layout) with ``voices.tgz``,
extracted safely; its layout chosen at load; ``--voice NATF2`` (an embedding voice) read into a session; the layout
recorded for fine-tunes; a Hub that cannot be reached."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from cspan.core import archive
from cspan.core.checkpoint import (
    LM_FILE,
    MIMI_FILE,
    TOKENIZER_FILE,
    describe_checkpoint,
    load_checkpoint,
    load_voice,
    resolve_checkpoint,
    resolve_prefix_layout,
)
from cspan.core.config import CONTEXT_SPANNING, PERSONAPLEX
from cspan.core.engine import DuplexEngine
from cspan.core.errors import CheckpointError
from cspan.core.prefix import build_persona_prefix
from cspan.core.voice import voice_embeddings_form

REPO = "nvidia/personaplex-7b-v1"


def _tgz(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _pt_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _fake_hub_repo(hf_home: Path, repo_id: str, files: dict[str, bytes | Path]) -> Path:
    """``repo_id`` in a Hugging Face cache as the hub library lays it out: blobs, refs/main, snapshot links."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    for rel, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        import hashlib

        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * len(Path(rel).parts) + "../blobs") / blob.name)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def snapshot_env(tiny_checkpoint_dir: Path, tiny_checkpoint, fixture_file, tmp_path_factory) -> dict:
    """A PersonaPlex-style snapshot of the tiny weights: no voices/ folder, voices.tgz with NATF2 (embeddings, made
    from the tiny voice's codes as PersonaPlex saves them) and NATM1.wav (a recording)."""
    root = tmp_path_factory.mktemp("pp-hub")
    codes = tiny_checkpoint.load_voice("tiny1")[:, :12]
    form = voice_embeddings_form(codes, tiny_checkpoint.lm)
    wav = fixture_file("audio", "greeting_24k.wav").read_bytes()
    tgz = _tgz([_file("voices/NATF2.pt", _pt_bytes(form)), _file("voices/NATM1.wav", wav)])
    files: dict[str, bytes | Path] = {
        name: tiny_checkpoint_dir / name for name in (LM_FILE, MIMI_FILE, TOKENIZER_FILE, "config.json")
    }
    files["voices.tgz"] = tgz
    snapshot = _fake_hub_repo(root / "hf", REPO, files)
    return {"hf": root / "hf", "cache": root / "cspan-cache", "snapshot": snapshot, "codes": codes}


@pytest.fixture
def offline_hub(snapshot_env, monkeypatch) -> dict:
    monkeypatch.setenv("HF_HOME", str(snapshot_env["hf"]))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("CSPAN_CACHE_DIR", str(snapshot_env["cache"]))
    monkeypatch.delenv("CSPAN_BASE", raising=False)
    monkeypatch.delenv("CSPAN_VOICES_DIR", raising=False)
    return snapshot_env


@torch.no_grad()
def test_personaplex_snapshot_loads_and_runs_with_natf2(offline_hub) -> None:
    ckpt = load_checkpoint(REPO, dtype=torch.float32)
    assert ckpt.prefix_layout == PERSONAPLEX
    assert ckpt.voices == {} and sorted(ckpt.archive_voices) == ["NATF2", "NATM1"]  # by name, never a default
    assert ckpt.archive_voices["NATF2"].parent.parent.parent == offline_hub["cache"]  # under CSPAN_CACHE_DIR
    voice = ckpt.load_voice_prompt("NATF2")
    assert voice.kind == "embeddings" and voice.embeddings.shape == (11, 64)
    assert ckpt.load_voice_prompt("NATF2.pt").source == voice.source  # PersonaPlex's file-name spelling
    recording = ckpt.load_voice_prompt("NATM1")
    assert recording.kind == "codes" and recording.codes.shape == (8, 46)
    with pytest.raises(CheckpointError, match="without the Mimi codes this needs") as refused:  # no codes in it,
        load_voice("NATF2", ckpt)  # no recording beside it: what to do, in the words of the command line
    assert "cspan voice encode" in str(refused.value) and "()" not in str(refused.value)

    # a session reads the PersonaPlex prefix with NATF2 and streams on: the same as the codes it was made from
    user = torch.randint(0, 2048, (1, 8, 6), generator=torch.Generator().manual_seed(5))

    def session(v):
        prefix = build_persona_prefix(ckpt.tokenizer, "You are Ada.", v, layout=ckpt.prefix_layout)
        engine = DuplexEngine(ckpt, temp=0, temp_text=0)
        report = engine.set_persona(0, "You are Ada.", v)
        assert report.num_frames == prefix.num_frames
        engine.step_tokens(user[:, :, 0])  # the prefix's step (PersonaPlex's conversation call 0)
        return prefix, torch.stack([engine.step_tokens(user[:, :, j]).frame[0] for j in range(user.shape[-1])])

    prefix, frames = session(voice)
    assert prefix.num_frames == 11 + 12 + len(prefix.text_ids) and prefix.embeddings is not None
    _, by_codes = session(offline_hub["codes"])
    assert torch.equal(frames, by_codes)


def test_model_info_lists_the_archive_voices(offline_hub) -> None:
    text = describe_checkpoint(REPO)
    assert "persona prefix layout: personaplex" in text
    assert "voices of voices.tgz: 2" in text
    assert "NATF2: PersonaPlex embeddings, 11 frames" in text and "NATM1: recording" in text


def test_voice_archive_in_a_local_folder(tiny_checkpoint_dir: Path, snapshot_env, tmp_path, monkeypatch) -> None:
    """A local copy of the repo: voices.tgz marks it as PersonaPlex's; an existing voices/ folder is used as is."""
    folder = tmp_path / "pp"
    shutil.copytree(tiny_checkpoint_dir, folder)
    shutil.rmtree(folder / "voices")
    shutil.copyfile(snapshot_env["snapshot"] / "voices.tgz", folder / "voices.tgz")
    monkeypatch.setenv("CSPAN_CACHE_DIR", str(tmp_path / "cache"))
    files = resolve_checkpoint(folder)
    assert resolve_prefix_layout(files) == PERSONAPLEX and sorted(files.archive_voices) == ["NATF2", "NATM1"]
    (folder / "voices").mkdir()  # as PersonaPlex's own code extracts voices.tgz: its voices are the archive's
    torch.save({"codes": torch.zeros(8, 3, dtype=torch.long)}, folder / "voices" / "mine.pt")
    again = resolve_checkpoint(folder)
    assert again.voices == {} and sorted(again.archive_voices) == ["mine"]


def test_layout_recorded_in_config_and_for_fine_tunes(tiny_checkpoint_dir: Path, tmp_path: Path) -> None:
    import json

    assert resolve_prefix_layout(resolve_checkpoint(tiny_checkpoint_dir)) == CONTEXT_SPANNING  # no PersonaPlex mark
    base = tmp_path / "base"
    shutil.copytree(tiny_checkpoint_dir, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "prefix_layout": "personaplex"}))
    assert resolve_prefix_layout(resolve_checkpoint(base)) == PERSONAPLEX
    ft = tmp_path / "ft" / "context_spanning.pt"
    ft.parent.mkdir()
    torch.save({"model": {}}, ft)
    assert resolve_prefix_layout(resolve_checkpoint(ft, base=base)) == CONTEXT_SPANNING  # a Context Spanning .pt
    (ft.parent / "export.json").write_text(json.dumps({"base": str(base), "prefix_layout": "personaplex"}))
    assert resolve_prefix_layout(resolve_checkpoint(ft)) == PERSONAPLEX
    (base / "config.json").write_text(json.dumps({**config, "prefix_layout": "sideways"}))
    with pytest.raises(CheckpointError, match=r"prefix_layout.*sideways.*context-spanning"):
        resolve_checkpoint(base)


@pytest.mark.parametrize(
    ("extra", "why"),
    [({}, "could not be reached"), ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set")],
    ids=["unreachable", "offline"],
)
def test_unreachable_hub_gives_a_clear_error(tmp_path: Path, extra: dict[str, str], why: str) -> None:
    """PersonaPlex's repo with no network (or HF_HUB_OFFLINE) and no cache: a CheckpointError that says what to do."""
    env = {
        "HF_HOME": str(tmp_path / "hf"),
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "HF_HUB_ETAG_TIMEOUT": "2",
        "HF_HUB_DOWNLOAD_TIMEOUT": "2",
        "PATH": "/usr/bin:/bin",
        **extra,
    }
    done = subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", "model", "info", REPO],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert REPO in done.stderr and "--checkpoint DIR" in done.stderr and why in done.stderr


# --- voices.tgz is extracted safely --------------------------------------------------------------------------------


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, None


@pytest.mark.parametrize(
    ("members", "expect"),
    [
        ([_file("../evil.pt", b"x")], "unsafe path"),
        ([_file("voices/../../evil.pt", b"x")], "unsafe path"),
        ([_file("/tmp/evil.pt", b"x")], "unsafe path"),
        ([_link("voices/NATF2.pt", "/etc/passwd")], "link or special file"),
        ([_file("voices/a.pt", b"x"), _link("voices/b.pt", "voices/a.pt", tarfile.LNKTYPE)], "link or special"),
        ([_file("voices/run.sh", b"#!/bin/sh\n")], "unexpected entry"),
        ([_file("voices/deep/NATF2.pt", b"x")], "unexpected entry"),
        ([_file("voices/a.pt", b"x"), _file("a.pt", b"y")], "appears twice"),
        ([], "holds no voices"),
    ],
)
def test_unsafe_or_unexpected_archives_are_refused(tmp_path: Path, members, expect: str) -> None:
    tgz = tmp_path / "voices.tgz"
    tgz.write_bytes(_tgz(members))
    with pytest.raises(CheckpointError, match=expect) as err:
        archive.extract_voices(tgz, tmp_path / "cache")
    assert str(tgz) in str(err.value)
    assert not (tmp_path / "evil.pt").exists() and not list((tmp_path / "cache" / "voices").iterdir())


def test_archive_size_and_count_limits_and_corruption(tmp_path: Path, monkeypatch) -> None:
    tgz = tmp_path / "voices.tgz"
    tgz.write_bytes(_tgz([_file("voices/a.pt", b"x" * 100), _file("voices/b.pt", b"y" * 100)]))
    monkeypatch.setattr(archive, "MAX_FILE_BYTES", 50)
    with pytest.raises(CheckpointError, match="size limits"):
        archive.extract_voices(tgz, tmp_path / "c1")
    monkeypatch.setattr(archive, "MAX_FILE_BYTES", 1000)
    monkeypatch.setattr(archive, "MAX_TOTAL_BYTES", 150)
    with pytest.raises(CheckpointError, match="size limits"):
        archive.extract_voices(tgz, tmp_path / "c2")
    monkeypatch.setattr(archive, "MAX_TOTAL_BYTES", 10_000)
    monkeypatch.setattr(archive, "MAX_MEMBERS", 1)
    with pytest.raises(CheckpointError, match="more than 1 entries"):
        archive.extract_voices(tgz, tmp_path / "c3")
    monkeypatch.setattr(archive, "MAX_MEMBERS", 10)
    folder = archive.extract_voices(tgz, tmp_path / "c4")
    assert sorted(p.name for p in folder.iterdir()) == ["a.pt", "b.pt"]
    assert archive.extract_voices(tgz, tmp_path / "c4") == folder  # extracted once, reused
    cut = tmp_path / "cut.tgz"
    cut.write_bytes(tgz.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=r"truncated or corrupt|not a readable"):
        archive.extract_voices(cut, tmp_path / "c5")
