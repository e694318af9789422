"""Data another party wrote (a backend's reply, a client's message, a dataset file), read the same way everywhere.

- :func:`loads`: JSON, refusing ``NaN`` / ``Infinity`` (not JSON, though Python's parser takes them), with a
  one-line reason in JSON's terms when the text cannot be used: a syntax error (line and column), a number with
  more than 4300 digits (Python's integer conversion limit), nesting deeper than the parser's recursion limit.
  Callers catch one exception, :class:`JSONInputError` (a ``ValueError``), and never see ``RecursionError``.
- :func:`json_kind`: a parsed value's type in JSON's words, for errors about data of the wrong shape.
- :func:`sanitize_text`: text that will be read aloud or put into a span (tool output, router answers,
  transcripts): one line, no control or format characters, capped in length.

``cspan.server`` uses both for client messages; this module imports nothing outside the standard library.
"""

from __future__ import annotations

import json
import math
import re
import sys
import unicodedata
from typing import Any

__all__ = ["JSONInputError", "is_seconds", "json_kind", "loads", "require_str", "sanitize_text"]

_DROP_CATEGORIES = {"Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp"}
_BIG_INT = re.compile(r"has (\d+) digits")
_KEEP = {
    "\u200c": "\u200c",  # ZERO WIDTH NON-JOINER: part of the word in Persian (می\u200cشود), Indic scripts
    "\u200d": "\u200d",  # ZERO WIDTH JOINER: Indic conjuncts, emoji sequences (woman + laptop)
    "\u00ad": "",  # SOFT HYPHEN: a possible break inside a word (German web text), no space
    "\u2060": "",  # WORD JOINER: no break, no space
    "\ufeff": "",  # ZERO WIDTH NO-BREAK SPACE (a byte order mark): no space
}
"""Format characters (Cf) that belong inside a word: kept, or removed without the space the others become."""
_STRAY_JOINER = re.compile("(?<!\\S)[\u200c\u200d]|[\u200c\u200d](?!\\S)")
_JOINER_RUN = re.compile("[\u200c\u200d]{2,}")


class JSONInputError(ValueError):
    """Text that is not usable JSON; ``str()`` is one line saying why (no Python internals)."""


def _not_a_number(name: str) -> Any:
    raise JSONInputError(f"{name} is not a JSON number")


def loads(text: str | bytes) -> Any:
    """Parse JSON text from another party.

    Args:
        text: the JSON text (bytes are decoded as UTF-8, as ``json.loads`` does).

    Returns:
        The parsed value (``dict``, ``list``, ``str``, ``int``, ``float``, ``bool`` or ``None``).

    Raises:
        JSONInputError: not valid JSON (with line and column), ``NaN`` / ``Infinity``, an integer of more than
            ``sys.get_int_max_str_digits()`` digits, nesting too deep for the parser, or bytes that are not UTF-8.
    """
    try:
        return json.loads(text, parse_constant=_not_a_number)
    except JSONInputError:
        raise
    except json.JSONDecodeError as exc:
        raise JSONInputError(f"{exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except RecursionError:
        raise JSONInputError("arrays or objects are nested too deeply to parse") from None
    except UnicodeDecodeError as exc:
        raise JSONInputError(f"the bytes are not UTF-8 text (byte {exc.start})") from None
    except ValueError as exc:  # Python's integer-string conversion limit (CVE-2020-10735)
        found = _BIG_INT.search(str(exc))
        size = f" ({found.group(1)} digits)" if found else ""
        limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300
        raise JSONInputError(f"a number is longer than {limit} digits{size}") from None


def json_kind(value: Any) -> str:
    """A parsed JSON value's type in JSON's words, with its article (``"null"``, ``"a boolean"``, ``"a number"``,
    ``"a string"``, ``"an array"``, ``"an object"``), for errors about data of the wrong shape."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), f"a {type(value).__name__}")


def sanitize_text(text: str, max_chars: int) -> str:
    """Make text from another party safe to read aloud or inject: one line, no control characters, capped.

    Control, format (zero-width space, bidi overrides such as U+202E), private-use, surrogate, unassigned and
    line/paragraph separator characters become spaces; the text is NFC-normalised and runs of whitespace collapse
    to one space. The format characters that belong inside a word are not spaces: the zero-width joiner and
    non-joiner (U+200D, U+200C: Persian ``می\u200cشود``, Indic conjuncts, emoji sequences) are kept between two
    other characters (one of a run, none at a word's edge), and the soft hyphen, the word joiner and U+FEFF are
    removed. Linear in ``len(text)`` with a per-character pass over at most ``2 * max_chars`` characters.
    Text longer than ``max_chars`` is cut at a word boundary (when one lies in the last 40 %) and
    ends in ``...``; the result is never longer than ``max_chars``.

    Raises:
        ValueError: ``max_chars`` < 8.
    """
    if max_chars < 8:
        raise ValueError(f"max_chars must be at least 8, got {max_chars}")
    text = " ".join(str(text).split())[: 2 * max_chars + 16]  # C-speed first: the per-character pass stays short
    text = unicodedata.normalize("NFC", text)
    text = "".join(_KEEP.get(ch, " ") if unicodedata.category(ch) in _DROP_CATEGORIES else ch for ch in text)
    if "\u200c" in text or "\u200d" in text:
        text = _STRAY_JOINER.sub("", _JOINER_RUN.sub(lambda m: m.group()[0], text))  # runs first: linear
    text = " ".join(text.split())
    if len(text) <= max_chars:
        return text
    cut = text[: max_chars - 3]
    space = cut.rfind(" ")
    if space >= int(0.6 * len(cut)):
        cut = cut[:space]
    return cut.rstrip(" ,;:-") + "..."


def require_str(argument: str, value: Any) -> str:
    """``value`` if it is a ``str`` (text a caller passes: a question, what the agent said).

    Raises:
        TypeError: naming ``argument`` and the type given; for ``bytes``, saying to decode them first (``str()`` of
            bytes is their repr, ``"b'...'"``, which would be read as the text).
    """
    if isinstance(value, str):
        return value
    hint = " (decode them first, e.g. value.decode('utf-8'))" if isinstance(value, bytes | bytearray) else ""
    raise TypeError(f"{argument} must be a str, not {type(value).__name__}{hint}")


def is_seconds(value: Any, *, infinite: bool = False) -> bool:
    """Whether a caller's ``value`` is a number of seconds: an int or a float (not a bool, a string or NaN), finite
    unless ``infinite`` (then ``inf`` passes too: "no deadline"). The sign is the caller's to check."""
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return False
    return infinite or math.isfinite(value)
