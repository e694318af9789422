"""The Context DB: what the system remembers about each user and their conversations.

It holds per-user **profiles** (name, city, timezone, lat/lon, notes, persona), **conversations**, their **turns**
(user / agent / tool, with wall-clock time and model frame), the **spans** that were asked for (reference text, tool
and arguments, when asked, when injected or why dropped, latency), per-user **facts** (from the profile and
regex-extracted from user turns such as "my name is Ada" or "I live in Leeds"), and the hashed **tokens** issued
with ``cspan users add``. Every row is keyed by its user.

- :class:`ContextDB` (:mod:`.store`): one database, SQLite by default (a file in the platform's data directory,
  WAL) or PostgreSQL for several replicas; migrations (:mod:`.schema`), retention, export and forget, tokens.
- :class:`UserMemory` (:mod:`.user`): ``db.user(principal)``, the only way to one user's rows.
  :meth:`UserMemory.working_text` renders the profile plus the recent turns as the compact text the router reads.

The original system (mindlogic-ai/Context-Spanning, ``duetaspan/runtime/backend/context_db.py``) kept all of this
in Python lists that vanished with the process.
"""

from cspan.backends.context_db.connection import sqlite_file
from cspan.backends.context_db.facts import extract_facts, fact_sentence
from cspan.backends.context_db.models import (
    ContextDBError,
    Conversation,
    DropReason,
    Fact,
    Profile,
    SpanRecord,
    TokenRecord,
    Turn,
    TurnRole,
    UserForgotten,
)
from cspan.backends.context_db.schema import MIGRATIONS, SCHEMA_VERSION
from cspan.backends.context_db.store import DB_ENV, ContextDB, default_db_path, resolve_target
from cspan.backends.context_db.user import UserMemory
from cspan.backends.context_db.waits import db_wait_s, db_waits_due_by

__all__ = [
    "DB_ENV",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "ContextDB",
    "ContextDBError",
    "Conversation",
    "DropReason",
    "Fact",
    "Profile",
    "SpanRecord",
    "TokenRecord",
    "Turn",
    "TurnRole",
    "UserForgotten",
    "UserMemory",
    "db_wait_s",
    "db_waits_due_by",
    "default_db_path",
    "extract_facts",
    "fact_sentence",
    "resolve_target",
    "sqlite_file",
]
