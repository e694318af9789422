"""What a run reads, and the one rule that keeps a run's outputs off it.

Every ``cspan`` verb that writes files lists what it reads in a :class:`Reads` (each entry by the flag that named
it: the input, the checkpoint's files, a settings file, a notes folder, the Context DB ...) and passes it with its
outputs (by their flag) to :func:`check_outputs` before any output is opened and, where it can, before any model
loads. An output is refused (:class:`~cspan.core.errors.SettingsError`, exit status 2, one line naming the output's
flag and path and what it would overwrite) when

- it is a file the run reads, or a hard link to one;
- it is a folder the run reads, or lies inside one (at any depth): every file of a read folder is read, or may be;
- it names the same file as another output;
- a file output is an existing folder (or a device, pipe or socket).

Paths are compared by their real path (``~``, ``..`` and symlinks resolved, a missing tail taken as written), and a
file that exists also by device and inode (``os.path.samefile``), so a hard link, a symlink or another spelling of
a read file is refused as the file itself. An output folder that merely contains a read file or folder is allowed:
the verb writes only its own names there, and those are checked as files where the verb knows them.

The rule is stated for users in ``docs/OUTPUT.md`` ("Outputs never overwrite what the run reads").
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import CspanError, SettingsError

SQLITE_SUFFIXES = ("", "-wal", "-shm", "-journal")
"""The files of a SQLite database: the file, its write-ahead log and shared memory, its rollback journal."""

MAX_WALK = 200_000
"""The most entries of a read folder looked at when an existing output is checked for a hard link into it."""


@dataclass(frozen=True)
class Read:
    """One file or folder a run reads.

    Attributes:
        flag: the flag (or environment variable) that named it, e.g. ``--checkpoint``.
        path: the file or folder.
        what: what it is, as the message says it ("the --checkpoint's tokenizer"); default "the FLAG file / folder".
        folder: every file inside (at any depth) is read.
    """

    flag: str
    path: Path
    what: str = ""
    folder: bool = False

    @property
    def label(self) -> str:
        return self.what or f"the {self.flag} {'folder' if self.folder else 'file'}"


class Reads:
    """The files and folders a run reads (:class:`Read`), added by kind; ``None`` or empty paths are skipped."""

    def __init__(self, items: Iterable[Read] = ()) -> None:
        self.items: list[Read] = list(items)

    def __iter__(self) -> Iterator[Read]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def file(self, flag: str, path: str | os.PathLike[str] | None, what: str = "") -> Reads:
        """A file the run reads (a folder there is taken as a folder)."""
        if path is not None and os.fspath(path):
            p = Path(path).expanduser()
            self.items.append(Read(flag, p, what, folder=p.is_dir()))
        return self

    def folder(self, flag: str, path: str | os.PathLike[str] | None, what: str = "") -> Reads:
        """A folder the run reads (every file inside, at any depth)."""
        if path is not None and os.fspath(path):
            self.items.append(Read(flag, Path(path).expanduser(), what, folder=True))
        return self

    def sqlite(self, flag: str, path: str | os.PathLike[str] | None, what: str = "the Context DB") -> Reads:
        """A SQLite database: its file and its journal files (:data:`SQLITE_SUFFIXES`)."""
        if path is not None and os.fspath(path):
            p = Path(path).expanduser()
            label = f"{what} of {flag} {p}"
            self.items.extend(Read(flag, p.with_name(p.name + s), label) for s in SQLITE_SUFFIXES)
        return self

    def extend(self, other: Iterable[Read]) -> Reads:
        self.items.extend(other)
        return self


def real_path(path: str | os.PathLike[str]) -> Path:
    """``path`` with ``~``, ``..`` and symlinks resolved (a missing tail kept as written)."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def _identity(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(device, inode)`` of an existing file (symlinks followed), else None."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _inside(path: Path, folder: Path) -> bool:
    return path != folder and path.is_relative_to(folder)


def _linked_into(identity: tuple[int, int], folder: Path) -> bool:
    """Whether a file of ``folder`` (at any depth, symlinks followed) is the file ``identity``: a hard link."""
    seen = 0
    for root, dirs, files in os.walk(folder):
        for name in files + dirs:
            seen += 1
            if seen > MAX_WALK:
                return False
            if _identity(os.path.join(root, name)) == identity:
                return True
    return False


def _clash(
    flag: str, out: Path, real: Path, identity: tuple[int, int] | None, read: Read, is_folder: bool
) -> str | None:
    """The refusal for output ``out`` (by ``flag``; a folder of outputs when ``is_folder``) against one read, or
    None."""
    where = real_path(read.path)
    shown = "" if Path(os.path.expanduser(out)) == read.path else f" ({read.path})"
    if not read.folder:
        if real == where or (identity is not None and identity == _identity(read.path)):
            return f"{flag} {out}: is {read.label}{shown}, which the run reads; refusing to overwrite it"
        return None
    if real == where or (identity is not None and identity == _identity(read.path)):
        return f"{flag} {out}: is {read.label}{shown}, which the run reads; write the output elsewhere"
    if _inside(real, where):
        return f"{flag} {out}: lies inside {read.label} {read.path}, which the run reads; write the output outside it"
    if identity is not None and not is_folder and where.is_dir() and _linked_into(identity, where):
        return (
            f"{flag} {out}: is a hard link to a file of {read.label} {read.path}, which the run reads; refusing to "
            "overwrite it"
        )
    return None


def check_outputs(
    outputs: Mapping[str, str | os.PathLike[str] | None],
    reads: Iterable[Read] = (),
    *,
    folders: Mapping[str, str | os.PathLike[str] | None] | None = None,
) -> None:
    """Refuse outputs that would overwrite what the run reads, or each other (see the module docstring).

    Args:
        outputs: the output files by their flag (``None`` values: not written, skipped).
        reads: what the run reads (a :class:`Reads`, or any :class:`Read` items).
        folders: the output folders by their flag (a verb that writes a folder of files: ``cspan model tiny``).

    Raises:
        SettingsError: the first refused output, one line naming its flag, its path and the file or folder it would
            overwrite (exit status 2); nothing is written.
        CspanError: a file output that is a device, pipe or socket.
    """
    reads = sorted(reads, key=lambda r: r.folder)  # a file read first: its message names the file itself
    named = [(flag, Path(p), False) for flag, p in outputs.items() if p is not None and os.fspath(p)]
    named += [(flag, Path(p), True) for flag, p in (folders or {}).items() if p is not None and os.fspath(p)]
    seen: dict[Path, str] = {}
    seen_ids: dict[tuple[int, int], str] = {}
    for flag, out, is_folder in named:
        real = real_path(out)
        identity = _identity(out)
        if not is_folder:
            try:
                mode = os.stat(out).st_mode
            except (OSError, ValueError):
                mode = None
            if mode is not None and stat.S_ISDIR(mode):
                raise SettingsError(f"{flag} {out}: is a directory; pass a file path for the output")
            if mode is not None and not stat.S_ISREG(mode):
                raise CspanError(f"{out}: is not a regular file (a device, pipe or socket); pass a file path")
        for read in reads:
            why = _clash(flag, out, real, identity, read, is_folder)
            if why is not None:
                raise SettingsError(why)
        other = seen.get(real) or (seen_ids.get(identity) if identity is not None else None)
        if other is not None:
            raise SettingsError(f"{other} and {flag} are the same file: {out}; use two different files")
        seen[real] = flag
        if identity is not None:
            seen_ids[identity] = flag


__all__ = ["MAX_WALK", "SQLITE_SUFFIXES", "Read", "Reads", "check_outputs", "real_path"]
