"""Identity: issued tokens (stored hashed), token files, the shared token, and the `cspan users` / `cspan db` verbs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cspan.backends.context_db import ContextDB
from cspan.backends.identity import Authenticator, IdentityError, Principal, hash_token, issue_token


def test_issued_tokens_authenticate_their_user_until_revoked(tmp_path: Path) -> None:
    db = ContextDB(tmp_path / "c.sqlite")
    record, token = issue_token(db, "ada", scopes=["session"], label="phone")
    _, admin_token = issue_token(db, "root", scopes=["session", "admin"])
    auth = Authenticator(db=db)
    who = auth.authenticate(token)
    assert who == Principal(user_id="ada", scopes=frozenset({"session"}), source="token", token_id=record.id)
    assert who.allows("session") and not who.allows("admin")
    assert auth.authenticate(admin_token).allows("admin")
    # the token itself is stored nowhere: only its hash
    raw = (tmp_path / "c.sqlite").read_bytes() + (tmp_path / "c.sqlite-wal").read_bytes()
    assert token.encode() not in raw and hash_token(token).encode() in raw
    assert db.tokens("ada")[0].last_used_at is not None
    for bad in (None, "", token + "x", token[:-1] + ("A" if token[-1] != "A" else "B"), "cspan.nope.x", "x" * 5000):
        assert auth.authenticate(bad) is None
    assert db.revoke_tokens(token_id=record.id) == 1
    assert auth.authenticate(token) is None and db.tokens("ada") == [] and len(db.tokens("ada", revoked=True)) == 1
    with pytest.raises(IdentityError, match="unknown scope"):
        issue_token(db, "ada", scopes=["root"])
    db.close()


def test_token_file_and_shared_token(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f"""
[[token]]
user = "ada"
sha256 = "{hash_token("ada-token-0123456789")}"

[[token]]
user = "ops"
token = "ops-token-0123456789"
scopes = ["session", "admin"]
"""
    )
    auth = Authenticator(token_file=tokens, shared_token="shared-secret-123", shared_user="kiosk")
    assert auth.authenticate("ada-token-0123456789") == Principal("ada", frozenset({"session"}), "token-file")
    assert auth.authenticate("ops-token-0123456789").allows("admin")
    assert auth.authenticate("shared-secret-123").user_id == "kiosk"
    assert auth.authenticate("ada-token-012345678") is None
    assert Authenticator().enabled is False and auth.enabled

    for body, message in [
        ('[[token]]\nuser = "a"\n', "exactly one of sha256"),
        ('[[token]]\nuser = "a"\nsha256 = "abc"\n', "64 hex digits"),
        ('[[token]]\nuser = "a"\ntoken = "short"\n', "16 to 256 characters of A-Z a-z 0-9"),
        ('[[token]]\nuser = "a"\ntoken = "abc def ghi jkl mno p"\n', "16 to 256 characters of A-Z a-z 0-9"),
        ('[[token]]\nuser = "a"\ntoken = "abcdefghijklmnop/+=="\n', "16 to 256 characters of A-Z a-z 0-9"),
        # one credential for two users: the first always won, the second's user and scopes were never used
        (
            '[[token]]\nuser = "ada"\ntoken = "abcdefghijklmnop1234"\n'
            '[[token]]\nuser = "bob"\ntoken = "abcdefghijklmnop1234"\nscopes = ["session", "admin"]\n',
            r"\[\[token\]\] #2: the same credential as \[\[token\]\] #1",
        ),
        (
            f'[[token]]\nuser = "ada"\nsha256 = "{hash_token("abcdefghijklmnop1234")}"\n'
            '[[token]]\nuser = "bob"\ntoken = "abcdefghijklmnop1234"\n',
            r"#2: the same credential as \[\[token\]\] #1",
        ),
        ('[[token]]\nuser = "a"\ntoken = "0123456789abcdefg"\nscopes = ["god"]\n', "unknown scope"),
        ('[[token]]\ntoken = "0123456789abcdefg"\n', "user"),
        # an entry an older release (e3b68c5) accepted: the fix names the id its user's rows are under since schema 5
        (
            '[[token]]\nuser = "carol "\ntoken = "0123456789abcdefg"\n',
            r"user must not start or end with white space, got 'carol '; write user = 'carol' \(the Context DB",
        ),
        ("[[token]\n", "not valid TOML"),
        # a misspelled table was ignored: every client refused, no word why
        ('[[tokens]]\nuser = "a"\ntoken = "abcdefghijklmnopq"\n', r"unknown table or key \[\[tokens\]\] at the top"),
        ('user = "a"\n[[token]]\nuser = "b"\ntoken = "abcdefghijklmnopq"\n', "unknown table or key 'user'"),
    ]:
        tokens.write_text(body)
        with pytest.raises(IdentityError, match=message) as info:
            Authenticator(token_file=tokens)
        assert str(tokens) in str(info.value)


@pytest.mark.parametrize("shared", [None, "shared-secret-123"])
def test_an_empty_token_file_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture, shared) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text("# no one yet\n")
    with caplog.at_level("WARNING", logger="cspan.backends.identity"):
        auth = Authenticator(token_file=tokens, shared_token=shared)
    assert auth.authenticate("abcdefghijklmnopq") is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and f"token file {tokens} has no [[token]] entry" in said[0]
    assert said[0].endswith("(every client is refused)") == (shared is None)


def _cspan(*args: str, db: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CSPAN_DB": str(db)}
    return subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        input=stdin,
    )


def test_a_user_id_is_one_user_however_its_accents_are_encoded(tmp_path: Path) -> None:
    """The id "jose\u0301" (e + combining acute, as a decomposing keyboard or file name gives it) and "jos\u00e9" look the
    same everywhere; they were two users: two memories, and revoking or exporting one missed the other's tokens."""
    nfd, nfc = "jose\u0301", "jos\u00e9"
    db_path = tmp_path / "ctx.sqlite"
    token = _cspan("users", "add", nfd, db=db_path).stdout.strip()
    with ContextDB(db_path) as db:
        assert Authenticator(db=db).authenticate(token).user_id == nfc
        assert [r.user_id for r in db.tokens(nfc)] == [nfc]
        memory = db.user(nfd)
        assert memory.user_id == nfc
        memory.start_conversation("c1")
        memory.add_turn("c1", "user", "hola")
    exported = json.loads(_cspan("db", "export", nfc, db=db_path).stdout)
    assert exported["user_id"] == nfc and exported["conversations"][0]["turns"][0]["text"] == "hola"
    assert len(exported["tokens"]) == 1
    revoked = _cspan("users", "revoke", "--user", nfd, db=db_path)
    assert revoked.returncode == 0 and "revoked 1" in revoked.stdout
    forgot = _cspan("db", "forget", nfd, "--yes", db=db_path)
    assert forgot.returncode == 0 and "1 turns" in forgot.stdout
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text(f'[[token]]\nuser = "{nfd}"\nsha256 = "{hash_token("k" * 20)}"\n')
    assert Authenticator(token_file=tokens_file).authenticate("k" * 20).user_id == nfc


def test_users_revoke_given_a_user_name_points_to_user(tmp_path: Path) -> None:
    """An operator who types `cspan users revoke ada` (a user, where the verb takes a token id) is told to give
    ``--user ada``, not only that there is no such token; ada's tokens stay valid."""
    db_path = tmp_path / "ctx.sqlite"
    token = _cspan("users", "add", "ada", db=db_path).stdout.strip()
    refused = _cspan("users", "revoke", "ada", db=db_path)
    assert refused.returncode == 1 and "no valid token ada" in refused.stderr
    assert "cspan users revoke --user ada" in refused.stderr
    with ContextDB(db_path) as db:
        assert Authenticator(db=db).authenticate(token).user_id == "ada"
    unknown = _cspan("users", "revoke", "0123456789ab", db=db_path)  # neither a token id nor a user: no hint
    assert unknown.returncode == 1 and "--user" not in unknown.stderr


def test_users_and_db_verbs(tmp_path: Path) -> None:
    db_path = tmp_path / "ctx.sqlite"
    added = _cspan("users", "add", "ada", "--label", "laptop", db=db_path)
    assert added.returncode == 0, added.stderr
    token = added.stdout.strip()
    assert token.startswith("cspan.") and "shown only now" in added.stderr
    listed = _cspan("users", "list", "--json", db=db_path)
    rows = json.loads(listed.stdout)
    assert [(r["user_id"], r["label"], r["scopes"]) for r in rows] == [("ada", "laptop", ["session"])]
    assert token not in listed.stdout

    with ContextDB(db_path) as db:
        assert Authenticator(db=db).authenticate(token).user_id == "ada"
        memory = db.user("ada")
        memory.start_conversation("c1")
        memory.add_turn("c1", "user", "my name is Ada")

    hashed = _cspan("users", "hash", db=db_path, stdin=token + "\n")
    assert hashed.stdout.strip() == hash_token(token)

    exported = _cspan("db", "export", "ada", db=db_path)
    data = json.loads(exported.stdout)
    assert data["conversations"][0]["turns"][0]["text"] == "my name is Ada"
    assert data["tokens"][0]["label"] == "laptop" and token not in exported.stdout
    out = tmp_path / "ada.json"
    assert _cspan("db", "export", "ada", "--out", str(out), db=db_path).returncode == 0
    assert json.loads(out.read_text())["user_id"] == "ada"
    missing = _cspan("db", "export", "nobody", db=db_path)
    assert missing.returncode == 1 and "nothing is stored" in missing.stderr

    refused = _cspan("db", "forget", "ada", db=db_path)
    assert refused.returncode == 2 and "--yes" in refused.stderr
    forgot = _cspan("db", "forget", "ada", "--yes", db=db_path)
    assert forgot.returncode == 0 and "1 turns" in forgot.stdout
    bad_days = _cspan("db", "prune", "--days", "inf", db=db_path)
    assert bad_days.returncode == 2 and "Traceback" not in bad_days.stderr
    assert _cspan("db", "prune", "--days", "30", db=db_path).returncode == 0

    revoked = _cspan("users", "revoke", rows[0]["id"], db=db_path)
    assert revoked.returncode == 0 and "revoked 1" in revoked.stdout
    again = _cspan("users", "revoke", rows[0]["id"], db=db_path)
    assert again.returncode == 1 and "no valid token" in again.stderr
    info = json.loads(_cspan("db", "info", db=db_path).stdout)
    assert info["schema_version"] == 5 and info["engine"] == "sqlite"
    broken = _cspan("db", "info", db=tmp_path)  # a folder is no database
    assert broken.returncode == 1 and "Traceback" not in broken.stderr


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_a_token_file_of_plain_tokens_is_warned_about_only_where_others_can_reach_it(
    open_tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Plain tokens in a file other users can read are warned about; the check read the file's own mode only, so a
    file in a folder that only its owner may enter (``~/.config`` of mode 700, a 750 home of a private group) was
    warned about though no one else can reach it. A user needs a read bit of the file and the x bit of every folder
    on the way; x for a folder's group counts where that group has other members."""
    import grp
    import pwd

    from cspan.backends.identity import load_token_file

    plain = '[[token]]\nuser = "kiosk"\ntoken = "kiosk-token-0123456789"\n'

    def warned(folder: Path, folder_mode: int, file_mode: int = 0o644) -> bool:
        folder.mkdir(exist_ok=True)
        folder.chmod(folder_mode)
        tokens = folder / "tokens.toml"
        tokens.write_text(plain)
        tokens.chmod(file_mode)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="cspan.backends.identity"):
            load_token_file(tokens)
        return any("can be read by other users" in r.getMessage() for r in caplog.records)

    me = os.getuid()
    mine = os.getgid()
    members = set(grp.getgrgid(mine).gr_mem) | {u.pw_name for u in pwd.getpwall() if u.pw_gid == mine}
    private = members <= {pwd.getpwuid(me).pw_name}

    assert warned(open_tmp_path / "open", 0o755)
    assert warned(open_tmp_path / "search-only", 0o711)  # x without r: the file's name is enough
    assert not warned(open_tmp_path / "shut", 0o700)
    assert not warned(open_tmp_path / "open", 0o755, 0o600)
    deep = open_tmp_path / "shut2"
    deep.mkdir(mode=0o700)
    assert not warned(deep / "inner", 0o755)  # a parent shuts others out
    assert warned(open_tmp_path / "group", 0o750) == (not private)  # the owner's group: private or not
    assert warned(open_tmp_path / "groupfile", 0o755, 0o640) == (not private)
    if me == 0:  # a folder of a group with other members (nobody's): they can enter
        shared = grp.getgrnam("nogroup").gr_gid if "nogroup" in {g.gr_name for g in grp.getgrall()} else None
        if shared is not None:
            group = open_tmp_path / "shared-group"
            group.mkdir()
            os.chown(group, -1, shared)
            assert warned(group, 0o750)
            tokens = group / "tokens.toml"
            os.chown(tokens, -1, shared)
            tokens.chmod(0o640)
            group.chmod(0o755)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="cspan.backends.identity"):
                load_token_file(tokens)
            assert any("can be read by other users (mode 640)" in r.getMessage() for r in caplog.records)


def _grant_acl(path: Path, uid: int, perm: int) -> None:
    """Give user ``uid`` the permissions ``perm`` (4 r, 1 x) on ``path`` by an access ACL (``setfacl -m
    u:UID:...``, written as the kernel's ``system.posix_acl_access`` attribute); the owner keeps its own bits, the
    group and others get nothing. The mode's group bits then show the ACL's mask. Skips where ACLs cannot be set."""
    import struct

    owner = (os.stat(path).st_mode >> 6) & 0o7
    undefined = 0xFFFFFFFF
    entries = [(0x01, owner, undefined), (0x02, perm, uid), (0x04, 0, undefined), (0x10, perm, undefined)]
    entries.append((0x20, 0, undefined))
    value = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)
    try:
        os.setxattr(path, "system.posix_acl_access", value)
    except (AttributeError, OSError) as exc:
        pytest.skip(f"cannot set an access ACL here: {exc}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX ACLs as Linux stores them")
def test_a_token_file_another_user_may_read_by_an_acl_is_warned_about(
    open_tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``setfacl -m u:nobody:r tokens.toml`` lets another user read plain tokens; the mode then shows the ACL's mask
    in its group bits (640). The warning read those bits as the owning group's and dropped them for a private group
    (Debian's user private groups: the owner's group here), so the file read as out of reach, though the old check
    (any group or other bit) warned. The same for a folder of mode 700 that an ACL lets another user enter. Where an
    access ACL is set, the group bits count as open to others."""
    from cspan.backends import identity

    monkeypatch.setattr(identity._PrivateGroups, "_look_up", lambda self, gid: True)  # the owner's private group
    nobody = 65534
    tokens = open_tmp_path / "tokens.toml"
    tokens.write_text('[[token]]\nuser = "kiosk"\ntoken = "kiosk-token-0123456789"\n')
    tokens.chmod(0o600)
    assert not identity.readable_by_others(tokens)
    _grant_acl(tokens, nobody, 0o4)
    assert tokens.stat().st_mode & 0o777 == 0o640  # the mask, shown as the group's bits
    if os.geteuid() == 0:  # the user named can read it indeed
        read = subprocess.run(["cat", str(tokens)], capture_output=True, user=nobody, group=nobody, timeout=30)
        assert read.returncode == 0 and b"kiosk-token" in read.stdout
    assert identity.readable_by_others(tokens)
    with caplog.at_level(logging.WARNING, logger="cspan.backends.identity"):
        identity.load_token_file(tokens)
    assert any("can be read by other users" in r.getMessage() for r in caplog.records)

    folder = open_tmp_path / "private"
    folder.mkdir(mode=0o700)
    inner = folder / "tokens.toml"
    inner.write_text(tokens.read_text())
    inner.chmod(0o644)
    assert not identity.readable_by_others(inner)  # only its owner enters the folder
    _grant_acl(folder, nobody, 0o1)  # but an ACL lets nobody in
    assert folder.stat().st_mode & 0o777 == 0o710
    assert identity.readable_by_others(inner)


@pytest.mark.skipif(os.name != "posix", reason="POSIX groups")
def test_a_group_without_the_files_owner_is_not_its_private_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group counts as its owner's private one (the token file warning's exception for a group's bits) only when
    the owner is its one member, as in Debian's user private groups. A group that lists no member and is no user's
    primary group (a service's group, whose members a service manager such as systemd's SupplementaryGroups= or a
    directory service that cannot be listed gives it) read as private too: a file of mode 640 in such a group was not
    warned about."""
    import grp
    import pwd

    from cspan.backends.identity import _PrivateGroups

    me = os.getuid()
    name = pwd.getpwuid(me).pw_name
    users = [u for u in pwd.getpwall() if u.pw_gid not in (4242, 4343)]
    groups = {
        4242: grp.struct_group(("svc", "x", 4242, [])),  # no member listed, nobody's primary group
        4343: grp.struct_group(("mine", "x", 4343, [name])),  # the owner only
    }
    monkeypatch.setattr(pwd, "getpwall", lambda: users)
    monkeypatch.setattr(grp, "getgrgid", lambda gid: groups[gid])
    private = _PrivateGroups(me)
    assert private(4343)
    assert not private(4242)


def test_the_id_a_refused_token_file_user_is_told_to_write_is_one_that_is_accepted(tmp_path: Path) -> None:
    """A user id with white space at an end is refused with the id to write instead (the one its Context DB rows are
    under since schema 5). That id was the given one stripped, whatever else was wrong with it, so the fix named an
    id that is refused too (a control character, too long): the id to write is named only where it is accepted."""
    tokens = tmp_path / "tokens.toml"
    for user in (" b\\u0007ob", "x" * 201 + " "):
        tokens.write_text(f'[[token]]\nuser = "{user}"\ntoken = "0123456789abcdefg"\n')
        with pytest.raises(IdentityError, match="must not start or end with white space") as info:
            Authenticator(token_file=tokens)
        assert "write user =" not in str(info.value), str(info.value)
    tokens.write_text('[[token]]\nuser = "carol\\t"\ntoken = "0123456789abcdefg"\n')
    with pytest.raises(IdentityError, match=r"write user = 'carol' \(the Context DB"):
        Authenticator(token_file=tokens)
