"""A PersonaPlex-style Hugging Face snapshot of the tiny checkpoint for the server tests: a fake HF cache in the real
layout (blobs, ``refs/main``, snapshot links) of ``nvidia/personaplex-7b-v1`` holding the tiny weights and a
``voices.tgz`` with ``NATF2.pt`` (input embeddings and a token cache, as PersonaPlex saves a voice) and
``NATM1.wav`` (a recording)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from personaplex_folder import pt_bytes, tgz

REPO = "nvidia/personaplex-7b-v1"
NATF2_FRAMES = 12
"""Frames of the codes NATF2 is made from (its embeddings cover NATF2_FRAMES - 1 positions)."""


def fake_hub_repo(hf_home: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """``repo_id`` in a Hugging Face cache as huggingface_hub lays it out; returns the snapshot folder."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    for rel, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * len(Path(rel).parts) + "../blobs") / blob.name)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def personaplex_snapshot(root: Path, tiny_dir: Path, tiny_checkpoint: Any, recording: Path) -> dict[str, Any]:
    """The snapshot under ``root``; returns the environment that makes ``nvidia/personaplex-7b-v1`` load from it
    offline (``env``) and the codes NATF2 was made from (``codes``)."""
    from cspan.core.checkpoint import LM_FILE, MIMI_FILE, TOKENIZER_FILE
    from cspan.core.voice import voice_embeddings_form

    codes = tiny_checkpoint.load_voice("tiny1")[:, :NATF2_FRAMES]
    voices = {
        "voices/NATF2.pt": pt_bytes(voice_embeddings_form(codes, tiny_checkpoint.lm)),
        "voices/NATM1.wav": recording.read_bytes(),
    }
    files = {name: (tiny_dir / name).read_bytes() for name in (LM_FILE, MIMI_FILE, TOKENIZER_FILE, "config.json")}
    files["voices.tgz"] = tgz(voices)
    fake_hub_repo(root / "hf", REPO, files)
    env = {
        "HF_HOME": str(root / "hf"),
        "HF_HUB_OFFLINE": "1",
        "CSPAN_CACHE_DIR": str(root / "cspan-cache"),
    }
    return {"env": env, "codes": codes}
