"""Mirror a conversation's events into the Context DB (turns and span outcomes)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from cspan.core.events import CONVERSATION_ENDED, ConversationEvent, LateEvent, NoSpanEvent, SpanEvent, UserTextEvent

logger = logging.getLogger(__name__)


def db_recorder(
    db: Any, conversation_id: str, *, on_forgotten: Callable[[], None] | None = None
) -> Callable[[ConversationEvent], None]:
    """An ``on_event`` callback that writes final user transcripts as user turns and marks each retrieval's span
    row (created by the retriever) as injected, dropped late, or dropped ``cancelled`` when its reference was ready
    but the conversation ended before it was read (``no_span`` rows, and retrievals cut while running, are marked
    by the retriever itself). Database failures are logged, never raised; a write refused because the user was
    forgotten since (:class:`~cspan.backends.context_db.UserForgotten`) calls ``on_forgotten`` instead (``cspan
    serve`` ends the session); after the first refusal nothing more is recorded (every later write would be refused
    too)."""
    from cspan.backends.context_db import UserForgotten

    refused = False

    def record(event: ConversationEvent) -> None:
        nonlocal refused
        if refused:
            return
        try:
            if isinstance(event, UserTextEvent) and event.final and event.text:
                db.add_turn(conversation_id, "user", event.text, frame=event.frame, dedupe=True)
            elif isinstance(event, SpanEvent) and event.retrieval_id is not None:
                db.mark_span_injected(event.retrieval_id, frame=event.frame)
            elif isinstance(event, LateEvent) and event.retrieval_id is not None:
                db.mark_span_dropped(event.retrieval_id, "late")
            elif (
                isinstance(event, NoSpanEvent) and event.error == CONVERSATION_ENDED and event.retrieval_id is not None
            ):
                db.mark_span_dropped(event.retrieval_id, "cancelled", error=event.error)  # ready, never read
        except UserForgotten as exc:
            refused = True
            if on_forgotten is None:
                logger.warning("Context DB: %s; nothing more of this conversation is recorded", exc)
            else:
                on_forgotten()
        except Exception as exc:
            logger.warning("Context DB: could not record %s event: %s", event.type, exc)

    return record
