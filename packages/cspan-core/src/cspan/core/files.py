"""Output files: up-front checks, atomic writing, and one mapping of write failures to :class:`OutputError`.

Every output of a ``cspan`` verb (audio, JSON, a voice ``.pt``, a checkpoint folder, a benchmark table) is written
to a temporary ``.NAME.*.part`` file or folder next to its destination and renamed into place only when complete,
so a crash, a full disk or a kill never leaves a partial output that looks finished. The temporary files and
folders of a process that exits (an exception, SIGTERM / SIGHUP / SIGQUIT through ``cspan``'s handler,
``sys.exit``) are removed.

- :func:`check_writable`: before any work, that an output can be written (folder created, a file made and removed
  there, free space);
- :func:`write_text_atomic`, :func:`write_bytes_atomic`: a whole file at once;
- :func:`atomic_file`: a file that a library writes by name (``torch.save``, safetensors' ``save_file``);
- :func:`atomic_folder`: a folder of files, published at once;
- :func:`stop_signals_deferred`: outputs that belong together (``cspan infer``'s audio and JSON) published as one
  step: a stop signal that lands meanwhile is acted on once all are in place;
- :func:`write_error`: the :class:`~cspan.core.errors.OutputError` of any failed write (``OSError``, or a library's
  own error: its cause is found by writing a probe file with Python's own I/O in the same folder).

Errors name the destination the user asked for (never the ``.part``) and the cause: permission denied, no space
left on device, read-only file system, not a directory. :class:`~cspan.core.audio.AtomicAudioWriter` streams audio
through the same temporary files.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from cspan.core.errors import OutputError

_PARTS: set[Path] = set()
"""Temporary files and folders of unfinished outputs of this process, removed at exit if still there."""


@atexit.register
def _remove_parts() -> None:
    for part in list(_PARTS):
        _remove(part)
    _PARTS.clear()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def default_mode(*, folder: bool = False) -> int:
    """The permissions a plain ``open(..., "w")`` (``mkdir`` for a folder) gives a new entry: 0o666 (0o777) minus
    the umask. ``mkstemp`` and ``mkdtemp`` make private ones; a finished output gets these."""
    mask = os.umask(0o022)
    os.umask(mask)
    return (0o777 if folder else 0o666) & ~mask


def _make_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # the folder's name is taken by a file
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path.parent)) from None


def new_part(path: Path, *, folder: bool = False) -> Path:
    """A new empty temporary file (or folder) next to ``path``, registered for removal at exit.

    Raises:
        OSError: the folder cannot be created or written.
    """
    _make_parent(path)
    if folder:
        part = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent))
    else:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
        os.close(fd)
        part = Path(tmp)
    _PARTS.add(part)
    return part


def drop_part(part: Path) -> None:
    """Remove a temporary file or folder of :func:`new_part` (and forget it)."""
    _PARTS.discard(part)
    _remove(part)


def publish_part(part: Path, path: Path) -> Path:
    """Rename a finished temporary file (or folder) of :func:`new_part` onto ``path``, with ordinary permissions.

    A folder replaces a missing or empty folder at ``path``; a file replaces a file.

    Raises:
        OSError: the rename failed (the temporary entry is left for the caller to drop).
    """
    os.chmod(part, default_mode(folder=part.is_dir()))
    os.replace(part, path)
    _PARTS.discard(part)
    return path


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Hold back Ctrl-C and the stop signals (SIGTERM, SIGHUP, SIGQUIT) while the block runs, then act on the first
    that landed (its handler runs as it would have: ``KeyboardInterrupt``, ``cspan``'s ``Terminated``).

    For publishing outputs that belong together (renames: microseconds), so that a signal can never leave one
    published and its companion not -- a new WAV next to the previous run's JSON. Only signals whose handler is a
    Python function are held (in the main thread; elsewhere the block just runs).
    """
    from .cli import stop_handlers_replaced

    landed: list[int] = []
    try:
        with stop_handlers_replaced(lambda _handler: lambda num, _frame: landed.append(num)) as previous:
            yield
    finally:
        if landed:  # its own handler, as if it had landed now
            previous[landed[0]](landed[0], None)


def check_writable(path: str | os.PathLike[str], *, need_bytes: int = 0) -> None:
    """Check, before any work, that an output can be written at ``path``.

    Creates the folder if missing, creates and removes a temporary file there (exactly what the atomic writers
    do), and checks that at least ``need_bytes`` are free on its file system.

    Raises:
        OutputError: naming ``path`` and the cause (not a directory, permission denied, read-only file system, no
            space left on device).
    """
    path = Path(path)
    try:
        drop_part(new_part(path))
        free = shutil.disk_usage(path.parent).free
    except OSError as exc:
        raise OutputError.from_os_error(path, exc) from None
    if free < need_bytes:
        raise OutputError(
            f"{path}: cannot write: no space left on device: the output needs about {need_bytes / 1e6:.1f} MB and "
            f"{free / 1e6:.1f} MB are free in {path.parent}; free some space or write the output elsewhere"
        )


def write_error(path: str | os.PathLike[str], exc: BaseException, *, near: Path | None = None) -> OutputError:
    """The :class:`OutputError` for a failed write to ``path``.

    An ``OSError`` gives its own cause, and so does a library's error that quotes an ``errno`` (safetensors'
    ``SafetensorError``: "... (os error 28)"). Libraries that say nothing of the cause (libsndfile's "System
    error", ``torch.save``'s ``RuntimeError``) have it found by writing a 64 KiB probe file with Python's own I/O
    in the same folder (the folder of ``near`` when given: where the failed write went).
    """
    path = Path(path)
    cause = _os_error_in(exc)
    if cause is not None:
        return OutputError.from_os_error(path, cause)
    probe = None
    try:
        probe = new_part(near if near is not None else path)
        with probe.open("wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
    except OSError as cause:
        return OutputError.from_os_error(path, cause)
    finally:
        if probe is not None:
            drop_part(probe)
    return OutputError(f"{path}: cannot write: {exc}")


_ERRNO_IN_TEXT = re.compile(r"\((?:os error|errno) (\d+)\)|\[errno (\d+)\]", re.IGNORECASE)
"""How libraries quote an ``errno`` in their own errors: Rust's ``(os error 28)``, Python's ``[Errno 28]``."""


def _os_error_in(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind ``exc``: itself, one it was raised from, or an ``errno`` its text quotes."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno:
            return current
        found = _ERRNO_IN_TEXT.search(str(current))
        if found:
            number = int(found.group(1) or found.group(2))
            return OSError(number, os.strerror(number))
        current = current.__cause__ or current.__context__
    return exc if isinstance(exc, OSError) else None


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """The temporary path to write ``path``'s content to; renamed onto ``path`` when the block ends without an
    exception. On any exception the temporary file is removed, ``path`` is untouched, and a write failure
    (``OSError`` or a library's I/O error) is raised as :class:`OutputError`.

    Example::

        with atomic_file(out) as tmp:
            torch.save(payload, tmp)

    Raises:
        OutputError: the folder cannot be written, the write or the rename failed (path and cause).
    """
    path = Path(path)
    try:
        part = new_part(path)
    except OSError as exc:
        raise OutputError.from_os_error(path, exc) from None
    try:
        yield part
        publish_part(part, path)
    except OutputError:
        drop_part(part)
        raise
    except Exception as exc:
        error = write_error(path, exc)
        drop_part(part)
        raise error from exc
    except BaseException:
        drop_part(part)
        raise


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write a file through a temporary file and an atomic rename; returns ``path``.

    Raises:
        OutputError: the folder or the file cannot be written (path and cause); the destination is untouched.
    """
    with atomic_file(path) as part:
        part.write_bytes(data)
    return Path(path)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write a UTF-8 text file through a temporary file and an atomic rename; returns ``path``.

    Raises:
        OutputError: the folder or the file cannot be written (path and cause); the destination is untouched.
    """
    return write_bytes_atomic(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike[str], *, replace_files: bool = False) -> Iterator[Path]:
    """A temporary folder to build ``path``'s files in, published when the block ends without an exception.

    A missing ``path`` appears as the finished folder in one rename, so the folder never exists half-written. An
    existing folder (empty, or any with ``replace_files``) is kept -- its permissions, its owner, a file system
    mounted on it -- and the files are built in a temporary folder inside it, then each moved into place (one
    rename each; its other files stay). On any exception the temporary folder is removed, and a write failure is
    raised as :class:`OutputError` naming ``path``.

    Raises:
        OutputError: ``path`` is a file, or a non-empty folder without ``replace_files``; the folder cannot be
            written; a write or the rename failed (path and cause).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{path}: cannot write a folder there: it is a file")
    if path.is_dir() and any(path.iterdir()) and not replace_files:
        raise OutputError(f"{path}: cannot write a folder there: it is not empty")
    inside = path.is_dir()  # build on the folder's own file system (it may be a mount point)
    try:
        part = new_part(path / path.name if inside else path, folder=True)
    except OSError as exc:
        raise OutputError.from_os_error(path, exc) from None
    try:
        yield part
        if inside:
            for entry in sorted(part.rglob("*")):
                target = path / entry.relative_to(part)
                if entry.is_dir():
                    target.mkdir(exist_ok=True)
                else:
                    os.chmod(entry, default_mode())
                    os.replace(entry, target)
            drop_part(part)
        else:
            for entry in part.rglob("*"):
                os.chmod(entry, default_mode(folder=entry.is_dir()))
            publish_part(part, path)
    except OutputError:
        drop_part(part)
        raise
    except Exception as exc:
        error = write_error(path, exc, near=part)  # the probe goes next to the temporary folder, on its file system
        drop_part(part)
        raise error from exc
    except BaseException:
        drop_part(part)
        raise


__all__ = [
    "atomic_file",
    "atomic_folder",
    "check_writable",
    "default_mode",
    "drop_part",
    "new_part",
    "publish_part",
    "stop_signals_deferred",
    "write_bytes_atomic",
    "write_error",
    "write_text_atomic",
]
