"""A PersonaPlex-style checkpoint folder made from the tiny checkpoint, for the tests of every verb that takes a
voice: the tiny weights, no ``voices/``, and a ``voices.tgz`` as PersonaPlex ships it (``voices/NAME.pt`` ...), whose
voices are given in any of the forms a voice takes (codes, PersonaPlex's input embeddings and token cache, a
recording). A folder holding ``voices.tgz`` is PersonaPlex's base: its prefix layout, its archive voices."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path
from typing import Any


def tgz(files: dict[str, bytes]) -> bytes:
    """A gzipped tar of ``files`` (name -> bytes), regular files only, as PersonaPlex's ``voices.tgz``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def pt_bytes(obj: Any) -> bytes:
    """``torch.save(obj)`` as bytes."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def personaplex_folder(out: Path, tiny_dir: Path, voices: dict[str, bytes]) -> Path:
    """A copy of the tiny checkpoint folder ``tiny_dir`` at ``out`` without its ``voices/`` and with a
    ``voices.tgz`` holding ``voices`` (archive member name, e.g. ``voices/NATF2.pt`` -> bytes); returns ``out``."""
    shutil.copytree(tiny_dir, out, ignore=shutil.ignore_patterns("voices"))
    (out / "voices.tgz").write_bytes(tgz(voices))
    return out


def embeddings_voice(codes: Any, lm: Any) -> bytes:
    """The ``.pt`` bytes of a PersonaPlex voice in embeddings form only (``{"embeddings", "cache"}``, no codes) of
    ``codes`` [8, N], as PersonaPlex saves one (:func:`cspan.core.voice.voice_embeddings_form`)."""
    from cspan.core.voice import voice_embeddings_form

    form = voice_embeddings_form(codes, lm)
    assert set(form) == {"embeddings", "cache"}
    return pt_bytes(form)
