"""Text the model reads is data: a reference, a persona prompt or a training word never becomes a control token.

With SentencePiece's byte fallback a control character that the tokenizer's normaliser keeps becomes its byte
piece, and in the released vocabulary ``<0x00>``, ``<0x08>`` and ``<0x09>`` are ``<ret>`` and the span markers (ids
4, 12, 13; the tiny tokenizer turns a NUL into ``<ret>``): a tool's output could ask for a reference or close its
span. So every text the model reads is cleaned here first, its control characters read as spaces.
"""

from __future__ import annotations

from typing import Any

_CONTROLS = {c: " " for c in [*range(0x20), *range(0x7F, 0xA0)] if c != 0x0A}
"""Unicode's control characters (category Cc) but the newline, each read as a space."""


def clean_text(text: str) -> str:
    """``text`` with its control characters (NUL, backspace, tab, ...; not the newline) read as spaces."""
    return text.translate(_CONTROLS)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(clean_text(text))`` as Python ints (``tokenizer``: a SentencePiece processor, or anything
    with ``encode(str) -> list[int]``)."""
    return [int(i) for i in tokenizer.encode(clean_text(text))]


__all__ = ["clean_text", "encode_text"]
