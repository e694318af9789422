"""Safe extraction of a voice archive (NVIDIA PersonaPlex's ``voices.tgz``: ``voices/NATF0.pt`` ...).

PersonaPlex's own code extracts the archive with ``tarfile.extractall`` next to the downloaded file. Here every member
is checked before anything is written: only regular files named ``[voices/]NAME.pt`` or ``[voices/]NAME.wav`` (NAME of
letters, digits, ``_``, ``-``, ``.``) are extracted, flat, into a fresh folder; a link, a device, an absolute path, a
``..`` component or any other name refuses the whole archive, and so do more than :data:`MAX_MEMBERS` members, a file
over :data:`MAX_FILE_BYTES` or more than :data:`MAX_TOTAL_BYTES` in all (the sizes are counted while reading, not
taken from the headers). The folder is written under a temporary name and renamed into place when complete, keyed by
the archive's sha256, so a changed archive is extracted again and a half-written folder is never used.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath

from .errors import CheckpointError

ENV_CACHE = "CSPAN_CACHE_DIR"
"""Where extracted voice archives go (default ``$XDG_CACHE_HOME/cspan`` or ``~/.cache/cspan``)."""
MAX_MEMBERS = 1000
"""Most entries an archive may hold."""
MAX_FILE_BYTES = 256 * 1024 * 1024
"""Largest extracted file."""
MAX_TOTAL_BYTES = 4 * 1024 * 1024 * 1024
"""Most bytes extracted from one archive."""
VOICE_FILE_SUFFIXES = (".pt", ".wav")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_CHUNK = 1 << 20


def default_cache_dir() -> Path:
    """``$CSPAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/cspan``, else ``~/.cache/cspan``."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cspan"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _member_name(archive: Path, member: tarfile.TarInfo) -> str | None:
    """The flat file name a member is extracted to; None for a folder entry.

    Raises:
        CheckpointError: an unsafe or unexpected member (names the archive and the member).
    """
    where = f"voice archive {str(archive)!r}, member {member.name!r}"
    parts = PurePosixPath(member.name).parts
    if member.name.startswith(("/", "\\")) or ".." in parts or any("\\" in p for p in parts):
        raise CheckpointError(f"{where}: unsafe path (absolute or with '..'); the archive is refused")
    if member.isdir():
        if parts not in ((), ("voices",)):
            raise CheckpointError(f"{where}: unexpected folder; a voice archive holds voices/NAME.pt files")
        return None
    if not member.isreg():
        raise CheckpointError(f"{where}: a link or special file; the archive is refused")
    inner = parts[1:] if parts[:1] == ("voices",) else parts
    if len(inner) != 1 or not _NAME.match(inner[0]) or Path(inner[0]).suffix not in VOICE_FILE_SUFFIXES:
        raise CheckpointError(
            f"{where}: unexpected entry; a voice archive holds voices/NAME.pt (or NAME.wav) files only"
        )
    return inner[0]


def extract_voices(archive: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Extract a voice archive (``.tgz`` / ``.tar.gz``) into ``<cache_dir>/voices/<sha256 prefix>/``; returns that
    folder (reused when it is already there).

    Args:
        archive: the archive.
        cache_dir: default :func:`default_cache_dir`.

    Raises:
        CheckpointError: unreadable or corrupt archive, an unsafe or unexpected member, a size limit, no voice in it,
            the cache folder not writable (each names the file).
    """
    archive = Path(archive)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        digest = _sha256(archive)
    except OSError as exc:
        raise CheckpointError(f"voice archive {str(archive)!r} cannot be read ({exc.strerror or exc})") from None
    final = root / "voices" / digest[:32]
    if final.is_dir():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    except OSError as exc:
        raise CheckpointError(
            f"cannot extract voice archive {str(archive)!r}: folder {str(final.parent)!r} is not writable "
            f"({exc.strerror or exc}); set {ENV_CACHE} to a writable folder"
        ) from None
    try:
        _extract_into(archive, tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():  # not a concurrent extraction that won the race
                raise
    except OSError as exc:
        raise CheckpointError(f"cannot extract voice archive {str(archive)!r}: {exc.strerror or exc}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _extract_into(archive: Path, dest: Path) -> None:
    try:
        tar = tarfile.open(archive, mode="r:*")  # noqa: SIM115 (closed by the with block below)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise CheckpointError(f"voice archive {str(archive)!r} is not a readable tar archive ({exc})") from None
    with tar:
        try:
            written = _copy_members(archive, tar, dest)
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise CheckpointError(f"voice archive {str(archive)!r} is truncated or corrupt ({exc})") from None
    if not written:
        raise CheckpointError(f"voice archive {str(archive)!r} holds no voices/NAME.pt file")


def _copy_members(archive: Path, tar: tarfile.TarFile, dest: Path) -> int:
    """Check and copy every member (module docstring); returns the number of files written."""
    count, total, written = 0, 0, 0
    for member in tar:
        count += 1
        if count > MAX_MEMBERS:
            raise CheckpointError(f"voice archive {str(archive)!r} holds more than {MAX_MEMBERS} entries")
        name = _member_name(archive, member)
        if name is None:
            continue
        if member.size > MAX_FILE_BYTES or total + member.size > MAX_TOTAL_BYTES:
            raise CheckpointError(
                f"voice archive {str(archive)!r}, member {member.name!r}: {member.size} bytes is over the size "
                f"limits ({MAX_FILE_BYTES} per file, {MAX_TOTAL_BYTES} in all)"
            )
        target = dest / name
        if target.exists():
            raise CheckpointError(f"voice archive {str(archive)!r}: {name!r} appears twice")
        source = tar.extractfile(member)
        assert source is not None  # a regular file
        size = 0
        with source, target.open("wb") as out:
            while chunk := source.read(_CHUNK):
                size += len(chunk)
                if size > member.size:
                    raise CheckpointError(
                        f"voice archive {str(archive)!r}, member {member.name!r}: more data than its header says; "
                        "the archive is corrupt"
                    )
                out.write(chunk)
        total += size
        written += 1
    return written


__all__ = ["MAX_FILE_BYTES", "MAX_MEMBERS", "MAX_TOTAL_BYTES", "default_cache_dir", "extract_voices"]
