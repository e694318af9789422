"""Mirror a conversation's events into the Context DB (turns and span outcomes)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from cspan.core.events import CONVERSATION_ENDED, ConversationEvent, LateEvent, NoSpanEvent, SpanEvent, UserTextEvent

logger = logging.getLogger(__name__)

Write = tuple[str, Callable[[], Any]]
"""A Context DB write not made yet: ``(what, call)``, ``what`` completing "could not ..." in a log line."""


def event_write(
    memory: Any, conversation_id: str, event: ConversationEvent, *, at: float | None = None
) -> Write | None:
    """The write that mirrors ``event`` in ``memory`` (a :class:`~cspan.backends.context_db.UserMemory`), or None
    for an event that writes nothing: a final user transcript becomes a user turn, and each retrieval's span row
    (created by the retriever) is marked injected, dropped late, or dropped ``cancelled`` when its reference was
    ready but the conversation ended before it was read (``no_span`` rows, and retrievals cut while running, are
    marked by the retriever itself).

    The times written are the event's, not the write's: ``at`` (epoch seconds; default: now, when this is called,
    which is when the event is published) becomes the turn's ``t`` and the span's ``injected_at``, so a write that
    waited for the database (``cspan serve`` queues them) still records when the event happened. A drop records no
    time. The call raises what the database raises (``UserForgotten`` when the user was forgotten since the memory
    was opened)."""
    now = time.time() if at is None else at
    if isinstance(event, UserTextEvent) and event.final and event.text:
        call = functools.partial(
            memory.add_turn, conversation_id, "user", event.text, t=now, frame=event.frame, dedupe=True
        )
    elif isinstance(event, SpanEvent) and event.retrieval_id is not None:
        call = functools.partial(memory.mark_span_injected, event.retrieval_id, injected_at=now, frame=event.frame)
    elif isinstance(event, LateEvent) and event.retrieval_id is not None:
        call = functools.partial(memory.mark_span_dropped, event.retrieval_id, "late")
    elif isinstance(event, NoSpanEvent) and event.error == CONVERSATION_ENDED and event.retrieval_id is not None:
        call = functools.partial(memory.mark_span_dropped, event.retrieval_id, "cancelled", error=event.error)
    else:
        return None
    return f"record {event.type} event", call


def db_recorder(memory: Any, conversation_id: str) -> Callable[[ConversationEvent], None]:
    """An ``on_event`` callback that makes each event's :func:`event_write` at once, on the calling thread
    (``cspan infer``, which has no frame clock to keep; ``cspan serve`` queues them per session:
    :mod:`cspan.server.db_calls`). Database failures are logged, never raised; after a write refused because the
    user was forgotten since (:class:`~cspan.backends.context_db.UserForgotten`) nothing more is recorded (every
    later write would be refused too)."""
    from cspan.backends.context_db import UserForgotten

    refused = False

    def record(event: ConversationEvent) -> None:
        nonlocal refused
        write = None if refused else event_write(memory, conversation_id, event)
        if write is None:
            return
        what, call = write
        try:
            call()
        except UserForgotten as exc:
            refused = True
            logger.warning("Context DB: %s; nothing more of this conversation is recorded", exc)
        except Exception as exc:
            logger.warning("Context DB: could not %s: %s", what, exc)

    return record
