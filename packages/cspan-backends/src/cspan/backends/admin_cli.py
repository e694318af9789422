"""``cspan users`` (issue, list, revoke per-user tokens) and ``cspan db`` (export, forget, prune, info).

Both open the Context DB named by ``--db`` (a file, ``:memory:`` or a PostgreSQL URL; default ``$CSPAN_DB``, else
the file in the platform's data directory, see :func:`cspan.backends.context_db.default_db_path`). Registered
under ``[project.entry-points."cspan.commands"]``; nothing heavy is imported until a handler runs, and
``cspan.core`` never is. Errors print one line and exit 1 (2 for bad arguments).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["db_command", "users_command"]


def _add_db(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db",
        metavar="TARGET",
        default=None,
        help="Context DB: a SQLite file, ':memory:' or postgresql://user@host:port/dbname "
        "(default: $CSPAN_DB, else context.sqlite in the platform's data directory)",
    )


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days") from None
    if not math.isfinite(value) or value <= 0 or value > 36500:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of days above 0 and at most 36500")
    return value


def _missing_file(target: str | None) -> str | None:
    """The SQLite file ``target`` names (``--db``, ``$CSPAN_DB`` or the default) when it does not exist, else None
    (also for ``:memory:`` and PostgreSQL)."""
    from cspan.backends.context_db.connection import sqlite_file
    from cspan.backends.context_db.store import resolve_target

    path = sqlite_file(resolve_target(target))
    return None if path is None or os.path.exists(path) else path


def _context_db_file_at(out: Path, target: str | None) -> str | None:
    """Whether ``out`` is a file of the SQLite Context DB ``target`` names: None if not, else ``""`` (the database)
    or the journal it is (``" journal -wal"``). Compared as ``cspan.core.reads`` compares an output with what a
    run reads (docs/OUTPUT.md; this package cannot import it): by real path, and by device and inode where both
    exist (a hard link)."""
    from cspan.backends.context_db.connection import sqlite_file
    from cspan.backends.context_db.store import resolve_target

    db = sqlite_file(resolve_target(target))
    if db is None:
        return None
    real = os.path.realpath(os.path.expanduser(out))
    for suffix in ("", "-wal", "-shm", "-journal"):
        path = db + suffix
        same = os.path.realpath(path) == real
        with contextlib.suppress(OSError):
            same = same or os.path.samefile(path, out)
        if same:
            return f" journal {suffix}" if suffix else ""
    return None


def _handler(
    verb: str, fn: Callable[[argparse.Namespace, Any], int], *, creates: bool = False, reads: bool = False
) -> Callable[[argparse.Namespace], int]:
    """Open the Context DB, run ``fn(args, db)``, close it; one-line errors. Only a verb that ``creates`` (``users
    add``) may name a SQLite file that does not exist yet: the others would create an empty one at a mistyped path.
    A verb that only ``reads`` opens it read-only (a read-only PostgreSQL role may export, list and show it)."""

    def run(args: argparse.Namespace) -> int:
        from cspan.backends.context_db import ContextDB
        from cspan.backends.errors import BackendError

        try:
            missing = None if creates else _missing_file(args.db)
            if missing is not None:
                print(
                    f"cspan {verb}: error: no Context DB at {missing} (nothing was ever stored there); check --db or "
                    "$CSPAN_DB",
                    file=sys.stderr,
                )
                return 1
            db = ContextDB(args.db, read_only=reads)
        except (BackendError, OSError, ValueError) as exc:
            print(f"cspan {verb}: error: {exc}", file=sys.stderr)
            return 1
        try:
            return fn(args, db)
        except (BackendError, OSError, ValueError) as exc:
            print(f"cspan {verb}: error: {exc}", file=sys.stderr)
            return 1
        finally:
            db.close()

    return run


# --------------------------------------------------------------------------------------------- cspan users


def _users_add(args: argparse.Namespace, db: Any) -> int:
    from cspan.backends.identity import issue_token

    try:
        record, token = issue_token(db, args.user, scopes=args.scope or ("session",), label=args.label)
    except ValueError as exc:  # a bad user id or label: exit status 2, as argparse's own refusals
        print(f"cspan users add: error: {exc}", file=sys.stderr)
        return 2
    print(token)
    print(
        f"issued token {record.id} for {record.user_id} (scopes: {', '.join(record.scopes)}) in {db.where}; "
        "it is shown only now: give it to the user (Authorization: Bearer TOKEN)",
        file=sys.stderr,
    )
    return 0


def _users_list(args: argparse.Namespace, db: Any) -> int:
    import time

    records = db.tokens(args.user, revoked=args.all)
    if args.json:
        print(json.dumps([r.model_dump() for r in records], indent=2))
        return 0
    if not records:
        print("no tokens" + (f" for {args.user}" if args.user else ""), file=sys.stderr)
        return 0

    def when(t: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "-"

    print(f"{'TOKEN ID':14s} {'USER':20s} {'SCOPES':16s} {'CREATED':16s} {'LAST USED':16s} {'REVOKED':16s} LABEL")
    for r in records:
        print(
            f"{r.id:14s} {r.user_id:20s} {','.join(r.scopes):16s} {when(r.created_at):16s} "
            f"{when(r.last_used_at):16s} {when(r.revoked_at):16s} {r.label}"
        )
    return 0


def _users_revoke(args: argparse.Namespace, db: Any) -> int:
    if (args.token_id is None) == (args.user is None):
        print("cspan users revoke: error: give a TOKEN_ID or --user USER (one of them)", file=sys.stderr)
        return 2
    count = db.revoke_tokens(token_id=args.token_id, user_id=args.user)
    what = f"token {args.token_id}" if args.token_id else f"tokens of {args.user}"
    if count == 0:
        hint = ""
        if args.token_id and db.tokens(args.token_id):  # a user's name where the verb takes a token id
            hint = (
                f". Fix: {args.token_id} is a user: `cspan users revoke --user {args.token_id}` revokes all of their "
                f"tokens, `cspan users list {args.token_id}` shows each one's id"
            )
        print(f"cspan users revoke: error: no valid {what} in {db.where}{hint}", file=sys.stderr)
        return 1
    print(f"revoked {count} token(s) ({what})")
    return 0


def _users_hash(args: argparse.Namespace) -> int:
    from cspan.backends.identity import TOKEN_FILE_TOKEN, hash_token

    raw = sys.stdin.buffer.readline(4096)
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        print(
            "cspan users hash: error: standard input is not a token (binary or non-ASCII bytes); write the token "
            "(16 characters or more, as `cspan users add` printed it) on one line",
            file=sys.stderr,
        )
        return 2
    if not TOKEN_FILE_TOKEN.fullmatch(token):
        print(
            "cspan users hash: error: write the token on standard input: 16 to 256 characters of A-Z a-z 0-9 . _ ~ - "
            "(it may travel as a WebSocket subprotocol)",
            file=sys.stderr,
        )
        return 2
    print(hash_token(token))
    return 0


def users_command(parser: argparse.ArgumentParser) -> None:
    """Per-user tokens: issue (add), list and revoke them; print a token's hash for a token file."""
    from cspan.backends.identity import SCOPES

    sub = parser.add_subparsers(dest="users_action", metavar="ACTION", title="actions")
    sub.required = True
    add = sub.add_parser("add", help="issue a new token for USER and print it (once)")
    add.add_argument("user", help="the user id the token authenticates as (keys all their Context DB rows)")
    add.add_argument(
        "--scope",
        action="append",
        choices=sorted(SCOPES),
        help="permission granted, repeatable (default: session). " + "; ".join(f"{k}: {v}" for k, v in SCOPES.items()),
    )
    add.add_argument("--label", default="", help="a note for `users list` (which device, who)")
    _add_db(add)
    add.set_defaults(handler=_handler("users add", _users_add, creates=True))

    lister = sub.add_parser("list", help="list issued tokens (ids and metadata, never the tokens)")
    lister.add_argument("user", nargs="?", default=None, help="only this user's tokens")
    lister.add_argument("--all", action="store_true", help="include revoked tokens")
    lister.add_argument("--json", action="store_true", help="print JSON")
    _add_db(lister)
    lister.set_defaults(handler=_handler("users list", _users_list, reads=True))

    revoke = sub.add_parser("revoke", help="revoke one token (TOKEN_ID) or all of a user's (--user)")
    revoke.add_argument("token_id", nargs="?", default=None, help="the token id shown by `users list`")
    revoke.add_argument("--user", default=None, help="revoke every token of this user")
    _add_db(revoke)
    revoke.set_defaults(handler=_handler("users revoke", _users_revoke))

    hasher = sub.add_parser("hash", help="read a token on standard input, print its sha256 for a token file")
    hasher.set_defaults(handler=_users_hash)


# --------------------------------------------------------------------------------------------- cspan db


def _export_folder_error(out: str, user: str) -> str | None:
    """Why ``--out`` of ``cspan db export`` is no file to write (an existing directory, or a path ending in a
    separator, which names one), with a file to give instead; None when it can be a file."""
    path = Path(out)
    if path.is_dir():
        what = "is a directory"
    elif out.endswith(("/", os.sep)):
        what = "names a directory (it ends in a separator)"
    else:
        return None
    name = f"{user}.json" if os.sep not in user and "/" not in user and not user.startswith(".") else "export.json"
    return (
        f"--out {out}: {what}; give the file to write the JSON to, such as {shlex.quote(str(path / name))}, or leave "
        "--out out to print it"
    )


def _db_export(args: argparse.Namespace, db: Any) -> int:
    folder = None if args.out is None else _export_folder_error(args.out, args.user)
    if folder is not None:  # a bad argument: refused before anything is read
        print(f"cspan db export: error: {folder}", file=sys.stderr)
        return 2
    if args.user not in db.users():
        print(f"cspan db export: error: nothing is stored about {args.user!r} in {db.where}", file=sys.stderr)
        return 1
    text = json.dumps(db.export_user(args.user), indent=2, ensure_ascii=False)
    if args.out is None:
        print(text)
        return 0
    out = Path(args.out)
    clash = _context_db_file_at(out, args.db)
    if clash is not None:
        print(
            f"cspan db export: error: --out {out}: is the Context DB{clash} of --db {db.where}, which the run reads; "
            "refusing to overwrite it",
            file=sys.stderr,
        )
        return 2
    tmp = out.with_name(f".{out.name}.{os.getpid()}.part")
    try:
        # everything about a person: private to its owner, as the database itself (0600), whatever the umask
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text + "\n")
        tmp.replace(out)
    except OSError as exc:
        with contextlib.suppress(OSError):  # on a read-only mount even removing a file never made fails (EROFS)
            tmp.unlink(missing_ok=True)
        cause = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        print(f"cspan db export: error: {out}: cannot write: {cause}", file=sys.stderr)
        return 1
    print(f"wrote everything stored about {args.user} to {out}", file=sys.stderr)
    return 0


def _db_forget(args: argparse.Namespace, db: Any) -> int:
    if not args.yes:
        print(
            f"cspan db forget: error: this deletes everything remembered about {args.user!r} in {db.where}; "
            "pass --yes to confirm",
            file=sys.stderr,
        )
        return 2
    counts = db.forget_user(args.user, tokens=args.tokens)
    print(f"forgot {args.user}: " + ", ".join(f"{n} {table}" for table, n in counts.items()))
    if not any(counts.values()):  # still recorded as forgotten (a running session ends): the erasure is idempotent
        kept = [] if args.tokens else db.tokens(args.user)
        print(
            f"cspan db forget: nothing but {len(kept)} issued token(s) was stored about {args.user!r} in {db.where}; "
            "pass --tokens to delete them too"
            if kept
            else f"cspan db forget: nothing was stored about {args.user!r} in {db.where}; check the user id "
            "(`cspan users list` names the users with tokens)",
            file=sys.stderr,
        )
    return 0


def _db_prune(args: argparse.Namespace, db: Any) -> int:
    counts = db.prune(args.days)
    print(f"removed rows older than {args.days:g} days: " + ", ".join(f"{n} {t}" for t, n in counts.items()))
    return 0


def _db_info(args: argparse.Namespace, db: Any) -> int:
    info = {
        "db": db.where,
        "engine": db.dialect,
        "journal_mode": db.journal_mode,
        "schema_version": db.schema_version(),
        "users": len(db.users()),
    }
    print(json.dumps(info, indent=2))
    return 0


def db_command(parser: argparse.ArgumentParser) -> None:
    """The Context DB: export or forget what is stored about a user, apply retention, show where it is."""
    sub = parser.add_subparsers(dest="db_action", metavar="ACTION", title="actions")
    sub.required = True
    export = sub.add_parser("export", help="print (or write) everything stored about USER as JSON")
    export.add_argument("user", help="user id")
    export.add_argument("--out", default=None, metavar="FILE", help="write the JSON to this file instead of stdout")
    _add_db(export)
    export.set_defaults(handler=_handler("db export", _db_export, reads=True))

    forget = sub.add_parser("forget", help="delete everything remembered about USER (profile, facts, conversations)")
    forget.add_argument("user", help="user id")
    forget.add_argument("--tokens", action="store_true", help="also delete the user's issued tokens")
    forget.add_argument("--yes", action="store_true", help="confirm the deletion")
    _add_db(forget)
    forget.set_defaults(handler=_handler("db forget", _db_forget))

    prune = sub.add_parser("prune", help="remove rows older than --days (the retention setting, run once)")
    prune.add_argument("--days", type=_days, required=True, help="age limit in days (above 0)")
    _add_db(prune)
    prune.set_defaults(handler=_handler("db prune", _db_prune))

    info = sub.add_parser("info", help="where the Context DB is, its engine, schema version and user count")
    _add_db(info)
    info.set_defaults(handler=_handler("db info", _db_info, reads=True))
