"""Identity: credentials map to principals, and a session's user comes from its credential only.

A :class:`Principal` is who is calling (a user id and the scopes granted). :meth:`Authenticator.authenticate`
turns the credential a client presented (the bearer token) into a principal, or ``None`` when it is unknown.
Three sources, tried in this order:

1. **Issued tokens** (``cspan users add USER``): stored in the Context DB as a SHA-256 hash beside a public token
   id; the token reads ``cspan.<id>.<secret>`` (256 random bits). Lookup is by id, then the hashes are compared with
   :func:`hmac.compare_digest`. Revoked tokens (``cspan users revoke``) no longer authenticate.
2. **A token file** (TOML, one ``[[token]]`` table per credential)::

       [[token]]
       user = "ada"
       sha256 = "3b7c...e9"        # sha256 of the token (`cspan users hash` prints it); or token = "..." (plain)
       scopes = ["session"]        # optional, default ["session"]

   Every entry is compared (constant time, no early exit), so timing does not tell which entry, if any, matched.
3. **A shared token** (``cspan serve --token``): one credential for one user id (``shared_user``, default ``local``).

Tokens are random, not passwords, so one SHA-256 suffices (a slow password hash buys nothing against 256 random
bits); what is stored never lets anyone log in. Scopes: :data:`SCOPES`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cspan.backends.context_db.schema import canonical_user_id
from cspan.backends.context_db.user import check_id
from cspan.backends.context_db.workers import run_in
from cspan.backends.errors import BackendError

if TYPE_CHECKING:
    from cspan.backends.context_db import ContextDB, TokenRecord

log = logging.getLogger(__name__)

SCOPES: dict[str, str] = {
    "session": "talk to the model over any protocol; the session's memory is this principal's",
    "admin": "operator routes (/metrics) and other users' data (export, forget)",
}
"""The scopes a credential may grant, with what each allows."""

DEFAULT_SCOPES: tuple[str, ...] = ("session",)
"""Scopes of a token when none are given."""

TOKEN_FILE_TOKEN = re.compile(r"[A-Za-z0-9._~\-]{16,256}")
"""A plain token a token file may hold (and ``cspan users hash`` takes): 16 to 256 characters of ``A-Z a-z 0-9 . _
~ -``, the characters a token may have to travel as a WebSocket subprotocol (``cspan.token.<token>``)."""

TOKEN_PREFIX = "cspan"
MAX_CREDENTIAL_CHARS = 512
"""Longer credentials are refused without hashing."""


class IdentityError(BackendError):
    """A token file or token request is invalid (the message names the file, the entry and the fix)."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: ``user_id`` keys every Context DB row of theirs; ``scopes`` are what they may do.

    ``source`` says how they were recognised: ``"token"`` (issued with ``cspan users``), ``"token-file"``,
    ``"shared-token"`` or ``"local"`` (no authentication configured; a single-user machine).
    ``token_id`` is the issued token's public id (``"token"`` source only).
    """

    user_id: str
    scopes: frozenset[str] = field(default_factory=lambda: frozenset(DEFAULT_SCOPES))
    source: str = "local"
    token_id: str | None = None

    def allows(self, scope: str) -> bool:
        """Whether this principal was granted ``scope``."""
        return scope in self.scopes

    @classmethod
    def local(cls, user_id: str = "local") -> Principal:
        """The principal of an unauthenticated, single-user set-up (a loopback server without tokens): all scopes."""
        return cls(user_id=user_id, scopes=frozenset(SCOPES), source="local")


def hash_token(token: str) -> str:
    """SHA-256 of ``token`` as 64 hex digits (what a token file's ``sha256`` and the Context DB store)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def check_scopes(scopes: Iterable[str], where: str = "scopes") -> list[str]:
    """``scopes`` de-duplicated in order, each one of :data:`SCOPES`.

    Raises:
        IdentityError: an unknown scope (the message lists the known ones).
    """
    out: list[str] = []
    for scope in scopes:
        if scope not in SCOPES:
            raise IdentityError(f"{where}: unknown scope {scope!r}; known scopes: {', '.join(SCOPES)}")
        if scope not in out:
            out.append(scope)
    return out


def issue_token(
    db: ContextDB, user_id: str, *, scopes: Iterable[str] = DEFAULT_SCOPES, label: str = ""
) -> tuple[TokenRecord, str]:
    """Make a new token for ``user_id``, store its hash, and return ``(record, token)``.

    The token (``cspan.<id>.<secret>``) is returned once and never stored; it fits HTTP headers, URLs and WebSocket
    subprotocol names (``A-Z a-z 0-9 . _ -``).

    Raises:
        IdentityError: an unknown scope.
        ValueError: an unusable user id or label.
    """
    chosen = check_scopes(scopes) or list(DEFAULT_SCOPES)
    token_id = secrets.token_hex(6)
    token = f"{TOKEN_PREFIX}.{token_id}.{secrets.token_urlsafe(32)}"
    record = db.add_token(token_id, user_id, hash_token(token), scopes=chosen, label=label)
    return record, token


@dataclass(frozen=True)
class _FileEntry:
    digest: bytes
    principal: Principal


def load_token_file(path: str | Path) -> list[_FileEntry]:
    """Read a token file (see the module docstring).

    An empty file (no ``[[token]]`` table) is valid, and accepts no credential: the caller warns.

    Raises:
        IdentityError: unreadable or not TOML, anything but ``[[token]]`` tables at the top (``[[tokens]]`` is
            named, with the fix), or an entry without ``user``, with neither or both of ``token`` and ``sha256``, a
            malformed hash or an unknown scope (the message names the file and the entry).
    """
    path = Path(path).expanduser()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise IdentityError(f"token file {path} does not exist") from None
    except OSError as exc:
        raise IdentityError(f"token file {path} cannot be read: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise IdentityError(f"token file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"token"})
    if unknown:
        shown = ", ".join(f"[[{k}]]" if isinstance(data[k], list) else repr(k) for k in unknown)
        raise IdentityError(
            f"token file {path}: unknown table or key {shown} at the top; write one [[token]] table per credential "
            '(docs/OPERATORS.md, "Identity")'
        )
    tables = data.get("token", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise IdentityError(f"token file {path}: write one [[token]] table per credential")
    entries = []
    for n, table in enumerate(tables, start=1):
        where = f"token file {path}, [[token]] #{n}"
        unknown = set(table) - {"user", "token", "sha256", "scopes"}
        if unknown:
            raise IdentityError(f"{where}: unknown key(s) {sorted(unknown)}; use user, sha256 (or token), scopes")
        try:
            user = check_id(table.get("user"), "user")
        except ValueError as exc:
            given = table.get("user")
            fixed = canonical_user_id(given) if isinstance(given, str) else ""
            hint = ""
            if fixed and fixed != given:  # an older release's entry: its user's rows are under this id since schema 5
                try:
                    check_id(fixed, "user")  # named only where it is accepted (not when it is wrong otherwise too)
                    hint = f"; write user = {fixed!r} (the Context DB keeps this user's rows under that id)"
                except ValueError:
                    pass
            raise IdentityError(f"{where}: {exc}{hint}") from None
        if ("token" in table) == ("sha256" in table):
            raise IdentityError(f'{where}: give exactly one of sha256 = "..." (preferred) or token = "..."')
        if "token" in table:
            if not isinstance(table["token"], str) or not TOKEN_FILE_TOKEN.fullmatch(table["token"]):
                raise IdentityError(
                    f"{where}: token must be a string of 16 to 256 characters of A-Z a-z 0-9 . _ ~ - (it may travel "
                    'as a WebSocket subprotocol); generate one with: python -c "import secrets; '
                    'print(secrets.token_urlsafe())"'
                )
            digest = hash_token(table["token"])
        else:
            digest = str(table["sha256"]).strip().lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise IdentityError(f"{where}: sha256 must be 64 hex digits (`cspan users hash` prints it)")
        scopes = table.get("scopes", list(DEFAULT_SCOPES))
        if not isinstance(scopes, list):
            raise IdentityError(f'{where}: scopes must be a list such as ["session"]')
        chosen = check_scopes(scopes, where)
        principal = Principal(user_id=user, scopes=frozenset(chosen), source="token-file")
        twin = next((k for k, e in enumerate(entries, start=1) if e.digest == bytes.fromhex(digest)), None)
        if twin is not None:  # the first would always win: the second's user and scopes could never be used
            raise IdentityError(f"{where}: the same credential as [[token]] #{twin}; give each entry its own token")
        entries.append(_FileEntry(bytes.fromhex(digest), principal))
    plain = [n for n, table in enumerate(tables, start=1) if "token" in table]
    if plain:
        _warn_if_readable(path, plain)
    return entries


def _warn_if_readable(path: Path, plain: list[int]) -> None:
    """Warn when a token file that holds plain tokens (entries ``plain``, 1-based) can be read by other users, as a
    settings file holding a credential is warned about (a ``sha256`` entry lets no one in)."""
    if os.name != "posix":
        return
    try:
        mode = path.stat().st_mode
        readable = readable_by_others(path)
    except OSError:
        return
    if readable:
        log.warning(
            "token file %s holds plain tokens ([[token]] #%s) and can be read by other users (mode %03o): anyone who "
            'reads it can connect as those users. chmod 600 %s, or store sha256 = "..." instead (`cspan users hash`)',
            path,
            ", #".join(str(n) for n in plain),
            mode & 0o777,
            path,
        )


def readable_by_others(path: Path) -> bool:
    """Whether a user other than the file's owner (and root) may read the file at ``path`` (POSIX permissions).

    A user needs a read bit of the file (its group's, or everyone's) and the search (x) bit of every folder on the
    way to it (its own folder and each parent, symbolic links resolved). So the file is out of reach when one of
    those folders lets in only its owner, being the file's owner or root: no x for its group or everyone, or x for
    its group only where that group is a private one (the file's owner its one member, as the user private groups
    of Debian and Ubuntu home folders). A group whose members cannot be listed counts as shared. Where an access
    control list is set (Linux: ``setfacl``), the group bits are its mask, what it may grant other users and
    groups, so they count as open to others whatever the owning group; the list itself is not read.

    Raises:
        OSError: the file or a folder on the way cannot be examined.
    """
    import stat

    st = path.stat()
    owner = st.st_uid
    private = _PrivateGroups(owner)

    def group_shut(p: Path, gid: int) -> bool:  # its group bits let in no one but the owner
        return private(gid) and not _has_access_acl(p)

    if not (st.st_mode & stat.S_IROTH or (st.st_mode & stat.S_IRGRP and not group_shut(path, st.st_gid))):
        return False
    for folder in path.resolve().parents:
        d = folder.stat()
        if d.st_uid not in (owner, 0):
            continue  # its owner, another user, passes it
        if not (d.st_mode & stat.S_IXOTH or (d.st_mode & stat.S_IXGRP and not group_shut(folder, d.st_gid))):
            return False
    return True


def _has_access_acl(path: Path) -> bool:
    """Whether ``path`` has an access ACL beyond its mode (Linux's ``system.posix_acl_access``; False where extended
    attributes cannot be listed)."""
    listxattr = getattr(os, "listxattr", None)
    if listxattr is None:
        return False
    try:
        return "system.posix_acl_access" in listxattr(path)
    except OSError:
        return False


class _PrivateGroups:
    """``private(gid)``: whether the user ``owner`` is the one member of the group ``gid`` (by ``/etc/group`` and the
    users' primary groups, through the system's user database); False when the group cannot be looked up, and for a
    group that lists no member at all (its members may come from elsewhere: a service manager, a directory service
    whose users cannot be listed)."""

    def __init__(self, owner: int) -> None:
        self.owner = owner
        self._known: dict[int, bool] = {}

    def __call__(self, gid: int) -> bool:
        if gid not in self._known:
            self._known[gid] = self._look_up(gid)
        return self._known[gid]

    def _look_up(self, gid: int) -> bool:
        import grp
        import pwd

        try:
            name = pwd.getpwuid(self.owner).pw_name
            members = set(grp.getgrgid(gid).gr_mem)
            members |= {user.pw_name for user in pwd.getpwall() if user.pw_gid == gid}
        except (KeyError, OSError):
            return False
        return members == {name}


def may_be_issued(credential: str | None) -> bool:
    """Whether ``credential`` has the shape of an issued token (``cspan.<id>.<secret>``, at most
    :data:`MAX_CREDENTIAL_CHARS`): only such a credential is looked up in the Context DB."""
    if not credential or len(credential) > MAX_CREDENTIAL_CHARS:
        return False
    prefix, _, rest = credential.strip().partition(".")
    token_id, _, secret = rest.partition(".")
    return prefix == TOKEN_PREFIX and bool(token_id) and bool(secret)


class Authenticator:
    """Credential -> :class:`Principal` (see the module docstring for the sources and their order).

    Args:
        db: the Context DB holding issued tokens (``None``: issued tokens are not accepted).
        token_file: a token file (read now; :meth:`reload` reads it again).
        shared_token: one shared credential (``cspan serve --token``), for ``shared_user``.
        shared_user: the user id of the shared token.
        record_use: stamp ``last_used_at`` of an issued token when it authenticates.

    Raises:
        IdentityError: the token file is invalid.
    """

    def __init__(
        self,
        *,
        db: ContextDB | None = None,
        token_file: str | Path | None = None,
        shared_token: str | None = None,
        shared_user: str = "local",
        record_use: bool = True,
    ) -> None:
        self.db = db
        self.token_file = Path(token_file).expanduser() if token_file is not None else None
        self.record_use = record_use
        self._shared = (
            _FileEntry(
                hashlib.sha256(shared_token.encode("utf-8")).digest(),
                Principal(user_id=shared_user, scopes=frozenset(SCOPES), source="shared-token"),
            )
            if shared_token
            else None
        )
        self._entries: list[_FileEntry] = []
        self.reload()

    @property
    def enabled(self) -> bool:
        """Whether any credential source is configured (else a server runs as :meth:`Principal.local`)."""
        return self.db is not None or self.token_file is not None or self._shared is not None

    def reload(self) -> None:
        """Read the token file again (a server calls this on SIGHUP); the old entries stay if it is invalid.

        Raises:
            IdentityError: the token file is invalid.
        """
        if self.token_file is not None:
            self._entries = load_token_file(self.token_file)
            if not self._entries:
                log.warning(
                    "token file %s has no [[token]] entry: none of its credentials is accepted%s",
                    self.token_file,
                    "" if self.db is not None or self._shared is not None else " (every client is refused)",
                )

    def authenticate(self, credential: str | None) -> Principal | None:
        """The principal ``credential`` (a bearer token, without the ``Bearer`` word) belongs to, or None.

        Never raises for a bad credential; a database failure is raised (the caller answers 503, not 401).
        """
        if not credential or len(credential) > MAX_CREDENTIAL_CHARS:
            return None
        credential = credential.strip()
        digest = hashlib.sha256(credential.encode("utf-8", "surrogatepass")).digest()
        found = self._issued(credential, digest)
        if found is not None:
            return found
        return self._static(digest)

    def authenticate_static(self, credential: str | None) -> Principal | None:
        """The principal of ``credential`` among the static credentials only (the token file's entries and the
        shared token, every one compared in constant time), or None; never reads the Context DB, so it may run
        on an event loop."""
        if not credential or len(credential) > MAX_CREDENTIAL_CHARS:
            return None
        return self._static(hashlib.sha256(credential.strip().encode("utf-8", "surrogatepass")).digest())

    def authenticate_issued(self, credential: str | None) -> Principal | None:
        """The principal of ``credential`` among the issued tokens only (reads the Context DB unless it cannot be
        one: see :func:`may_be_issued`), or None.

        Raises:
            ContextDBError: the database failed (the caller answers 503 or 1013, not 401).
        """
        if not may_be_issued(credential):
            return None
        assert credential is not None
        credential = credential.strip()
        return self._issued(credential, hashlib.sha256(credential.encode("utf-8", "surrogatepass")).digest())

    def _static(self, digest: bytes) -> Principal | None:
        match: Principal | None = None
        for entry in [*self._entries, *([self._shared] if self._shared else [])]:
            if hmac.compare_digest(digest, entry.digest):  # every entry compared: no early exit
                match = match or entry.principal
        return match

    async def aauthenticate(self, credential: str | None) -> Principal | None:
        """:meth:`authenticate` in a worker thread (it may read the Context DB): one of the database's executor
        (:attr:`ContextDB.executor <cspan.backends.context_db.ContextDB.executor>`)."""
        return await run_in(self.db.executor if self.db is not None else None, self.authenticate, credential)

    def _issued(self, credential: str, digest: bytes) -> Principal | None:
        if self.db is None:
            return None
        prefix, _, rest = credential.partition(".")
        token_id, _, secret = rest.partition(".")
        if prefix != TOKEN_PREFIX or not token_id or not secret:
            return None
        row = self.db.token_hash(token_id)
        if row is None:
            return None
        record, stored = row
        if not hmac.compare_digest(digest, bytes.fromhex(stored)):
            return None
        if self.record_use:
            self.db.touch_token(token_id)
        return Principal(user_id=record.user_id, scopes=frozenset(record.scopes), source="token", token_id=token_id)
