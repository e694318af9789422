"""The memory span (``--memory-span``, opt-in): what left the attention window, read back in as a short span.

The persona policy keeps the persona in the model's window (``docs/ENGINE.md``, "The persona past the window"), but
Context Spans slide out of it like any conversation position: four minutes after a reference was read on the 7B,
the model no longer sees it. With ``--memory-span`` a session's :class:`MemorySpan` follows its spans' positions
and, when one leaves the window, reads back a short summary from the Context DB (:func:`memory_summary`: the user's
profile and facts, and the last references of the conversation) as a Context Span of ``source`` ``memory``; at
most one per quarter of the window (spans that leave meanwhile are in the next one). The memory span leaves the
window too; it is then read again (at most once per window, and only when no newer one is still in the window)
while there is something to remember.

Everything kept is bounded over any duration: the spans still in the window (at most one per position of it), the
last :data:`MEMORY_REFERENCES` references that left, and a count.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cspan.core.events import ConversationEvent, SpanEvent

MEMORY_SPAN_CHARS = 480
"""Longest memory span text (characters: about 120 tokens, 10 s of positions)."""
MEMORY_REFERENCES = 3
"""References a memory span repeats (the latest ones)."""
REFERENCE_CHARS = 140
"""Characters kept of each reference repeated."""


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 1].rsplit(" ", 1)[0]
    return cut + "…"


def memory_summary(
    memory: Any,
    conversation_id: str,
    profile: Any = None,
    left: Sequence[str] = (),
    *,
    max_chars: int = MEMORY_SPAN_CHARS,
) -> str:
    """The text of a memory span: ``memory: <profile and facts>; earlier: <question> -> <reference>; ...``.

    Args:
        memory: the user's :class:`cspan.backends.context_db.UserMemory` (``profile_line``, ``spans``).
        conversation_id: the conversation whose references are repeated.
        profile: the live profile (None: the stored one).
        left: texts of references that left the window and are not in the Context DB (``--span``), oldest first.
        max_chars: the longest text returned.

    Returns:
        The summary, at most ``max_chars`` characters; "" when there is nothing to remember.
    """
    parts: list[str] = []
    facts = memory.profile_line(profile).removeprefix("profile: ")
    if facts:
        parts.append(facts)
    found = [
        (r.question, r.text)
        for r in memory.spans(conversation_id, last=4 * MEMORY_REFERENCES)
        if r.text and r.injected_at is not None and r.source != "memory"
    ]
    references = [f"{q} -> {t}" if q else t for q, t in found] + [t for t in left if t not in {t for _, t in found}]
    for ref in references[-MEMORY_REFERENCES:]:
        parts.append("earlier: " + _clip(ref, REFERENCE_CHARS))
    return _clip("memory: " + "; ".join(parts), max_chars) if parts else ""


@dataclass
class MemoryDue:
    """A memory span to read: ``spans_left`` references left the window since the last one (0: the last memory
    span itself left), ``left`` the latest of their texts (oldest first)."""

    spans_left: int
    left: list[str]


class MemorySpan:
    """Follows one session's Context Spans through the attention window (see the module docstring).

    Feed it the session's events (:meth:`on_event`, chained to the conversation's ``on_event``) and, after each
    step, the session's pending position (:meth:`after_step`); it says when a memory span is due.

    Args:
        window: the model's attention window in positions (None: unbounded, nothing ever leaves).
    """

    def __init__(self, window: int | None) -> None:
        self.window = window
        self._new: list[SpanEvent] = []
        self._in_window: collections.deque[tuple[int, str, str | None]] = collections.deque()
        self._left: collections.deque[str] = collections.deque(maxlen=MEMORY_REFERENCES)
        self._spans_left = 0
        self._memory_left = False
        self._last_due: int | None = None
        self.reading = False

    def on_event(self, event: ConversationEvent) -> None:
        """Note a ``span`` event (its position is known after the step)."""
        if isinstance(event, SpanEvent):
            self._new.append(event)

    def after_step(self, position: int) -> MemoryDue | None:
        """After a step: ``position`` is the session's pending position. A :class:`MemoryDue` when a span left the
        window since the last memory span was asked for, none is being read, and the last one was asked for at least
        a quarter of the window ago; else None."""
        for ev in self._new:  # read by this step: their last position is at most position - 2
            self._in_window.append((position - 2, ev.text, ev.source))
        self._new.clear()
        if self.window is None:
            return None
        while self._in_window and position - self._in_window[0][0] >= self.window:
            _, text, source = self._in_window.popleft()
            if source == "memory":  # read again only when no newer memory span is still in the window
                self._memory_left = not any(src == "memory" for _, _, src in self._in_window)
            else:
                self._left.append(text)
                self._spans_left += 1
        if self.reading or not (self._spans_left or self._memory_left):
            return None
        if self._last_due is not None and position - self._last_due < self.window // 4:
            return None
        self._last_due = position
        due = MemoryDue(self._spans_left, list(self._left))
        self._spans_left, self._memory_left = 0, False
        return due


__all__ = ["MEMORY_REFERENCES", "MEMORY_SPAN_CHARS", "MemoryDue", "MemorySpan", "memory_summary"]
