"""Deprecated: the Context DB's first API, where every call named its user or conversation itself.

``ContextDB.put_profile(profile)``, ``ContextDB.add_turn(conversation_id, ...)`` and the rest trusted whatever user
id the caller passed (in a server, the client's own message). They still work, each delegating to the
:class:`~cspan.backends.context_db.UserMemory` of the user the call names or the conversation or span belongs
to, and each warns with :class:`DeprecationWarning`. Use ``db.user(principal)`` and the same method names there.
They will be removed once ``cspan serve`` and ``cspan infer`` open memories by principal.
"""

from __future__ import annotations

import functools
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cspan.backends.context_db.models import ContextDBError, Profile
from cspan.backends.context_db.workers import run_in

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from cspan.backends.context_db.connection import Connection
    from cspan.backends.context_db.user import UserMemory


def _warn(name: str) -> None:
    warnings.warn(
        f"ContextDB.{name}() is deprecated: use ContextDB.user(principal).{name}() (memory keyed by the "
        "authenticated principal)",
        DeprecationWarning,
        stacklevel=3,
    )


def _by_user(name: str, *, default_user: bool = True) -> Callable[..., Any]:
    def shim(self: LegacyMethods, user_id: str = "default", *args: Any, **kwargs: Any) -> Any:
        _warn(name)
        return getattr(self.user(user_id), name)(*args, **kwargs)

    shim.__name__ = name
    shim.__doc__ = f"Deprecated: ``db.user(user_id).{name}(...)``."
    return shim


def _by_conversation(name: str) -> Callable[..., Any]:
    def shim(self: LegacyMethods, conversation_id: str, *args: Any, **kwargs: Any) -> Any:
        _warn(name)
        return getattr(self._memory_of_conversation(conversation_id), name)(conversation_id, *args, **kwargs)

    shim.__name__ = name
    shim.__doc__ = f"Deprecated: ``db.user(principal).{name}(conversation_id, ...)``."
    return shim


def _by_span(name: str) -> Callable[..., Any]:
    def shim(self: LegacyMethods, span_id: int, *args: Any, **kwargs: Any) -> Any:
        _warn(name)
        rows = self._conn.read("SELECT user_id FROM spans WHERE id = ?", (span_id,))
        if not rows:
            raise ContextDBError(f"span {span_id} is not in the Context DB {self._conn.where!r}")
        return getattr(self.user(rows[0]["user_id"]), name)(span_id, *args, **kwargs)

    shim.__name__ = name
    shim.__doc__ = f"Deprecated: ``db.user(principal).{name}(span_id, ...)``."
    return shim


def _in_thread(sync: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(sync)
    async def run(self: LegacyMethods, *args: Any, **kwargs: Any) -> Any:
        return await run_in(self.executor, sync, self, *args, **kwargs)

    run.__name__ = "a" + sync.__name__
    return run


class LegacyMethods(ABC):
    """The deprecated per-call-user methods of :class:`~cspan.backends.context_db.ContextDB` (see the module)."""

    _conn: Connection
    executor: Executor | None

    @abstractmethod
    def user(self, principal: Any) -> UserMemory:
        """One principal's memory (:meth:`ContextDB.user <cspan.backends.context_db.ContextDB.user>`)."""

    def _memory_of_conversation(self, conversation_id: str) -> UserMemory:
        """The memory of the user owning ``conversation_id`` (an unknown id reads as user "default"'s: empty)."""
        rows = self._conn.read("SELECT user_id FROM conversations WHERE id = ?", (conversation_id,))
        if len(rows) > 1:
            raise ContextDBError(
                f"conversation {conversation_id!r} is ambiguous (several users have it) in the Context DB "
                f"{self._conn.where!r}. Fix: use db.user(principal)."
            )
        return self.user(rows[0]["user_id"] if rows else "default")

    def put_profile(self, profile: Profile) -> None:
        """Deprecated: ``db.user(principal).put_profile(profile)``."""
        _warn("put_profile")
        self.user(profile.user_id).put_profile(profile)

    def set_fact(self, user_id: str, key: str, value: str, *, source: str = "user") -> None:
        """Deprecated: ``db.user(user_id).set_fact(key, value)``."""
        _warn("set_fact")
        self.user(user_id).set_fact(key, value, source=source)

    def start_conversation(self, user_id: str = "default", *, conversation_id: str | None = None, **kw: Any) -> str:
        """Deprecated: ``db.user(user_id).start_conversation(conversation_id, ...)``."""
        _warn("start_conversation")
        return self.user(user_id).start_conversation(conversation_id, **kw)

    def conversations(self, user_id: str | None = None) -> list[Any]:
        """Deprecated: ``db.user(user_id).conversations()`` (``None``: every user's, for operators)."""
        _warn("conversations")
        if user_id is not None:
            return self.user(user_id).conversations()
        return [c for uid in self.users() for c in self.user(uid).conversations()]  # type: ignore[attr-defined]

    def profile_line(self, user_id: str, profile: Profile | None = None) -> str:
        """Deprecated: ``db.user(user_id).profile_line(profile)``."""
        _warn("profile_line")
        return self.user(user_id).profile_line(profile)

    get_profile = _by_user("get_profile")
    facts = _by_user("facts")
    end_conversation = _by_conversation("end_conversation")
    get_conversation = _by_conversation("get_conversation")
    add_turn = _by_conversation("add_turn")
    turns = _by_conversation("turns")
    last_user_text = _by_conversation("last_user_text")
    add_span = _by_conversation("add_span")
    spans = _by_conversation("spans")
    working_text = _by_conversation("working_text")
    mark_span_injected = _by_span("mark_span_injected")
    mark_span_dropped = _by_span("mark_span_dropped")

    aput_profile = _in_thread(put_profile)
    aget_profile = _in_thread(get_profile)
    aset_fact = _in_thread(set_fact)
    afacts = _in_thread(facts)
    astart_conversation = _in_thread(start_conversation)
    aget_conversation = _in_thread(get_conversation)
    aadd_turn = _in_thread(add_turn)
    aturns = _in_thread(turns)
    aadd_span = _in_thread(add_span)
    amark_span_injected = _in_thread(mark_span_injected)
    amark_span_dropped = _in_thread(mark_span_dropped)
    aspans = _in_thread(spans)
    aworking_text = _in_thread(working_text)
