"""Answer text normalised for matching: case, accents, punctuation, articles, spoken numbers folded to digits.

Shared by the spoken-QA alias match (:mod:`cspan.bench.qa`) and the keyword timing (:mod:`cspan.bench.qa_timing`).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

_UNITS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
    "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16,
    "seventeen": 17, "eighteen": 18, "nineteen": 19,
}  # fmt: skip
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
_SCALES = {"hundred": 100, "thousand": 1_000, "million": 1_000_000, "billion": 1_000_000_000}
_ARTICLES = {"a", "an", "the"}


def fold_number_spans(tokens: Sequence[str]) -> list[tuple[str, int]]:
    """Replace runs of spoken number words by their digits ("twenty five" -> "25", "one hundred and two" ->
    "102", "three point five" -> "3.5"), keeping for every output token the index of the first input token it came
    from. A unit ends a number unless a scale word follows ("one two" stays two numbers), and "and" only continues a
    number after a scale word."""
    out: list[tuple[str, int]] = []
    i = 0
    while i < len(tokens):
        w = tokens[i]
        if w not in _UNITS and w not in _TENS and w not in _SCALES:
            out.append((w, i))
            i += 1
            continue
        total, current, j, last = 0, 0, i, ""
        while j < len(tokens):
            t = tokens[j]
            if t in _UNITS and last in ("", "tens", "scale", "and") and not (last == "tens" and _UNITS[t] >= 10):
                current += _UNITS[t]
                last = "unit"
            elif t in _TENS and last in ("", "scale", "and"):
                current += _TENS[t]
                last = "tens"
            elif t in _SCALES and last != "and":
                scale = _SCALES[t]
                if scale == 100:
                    current = max(current, 1) * 100
                else:
                    total += max(current, 1) * scale
                    current = 0
                last = "scale"
            elif t == "and" and last == "scale" and j + 1 < len(tokens) and tokens[j + 1] in {**_UNITS, **_TENS}:
                last = "and"
            else:
                break
            j += 1
        value = str(total + current)
        if j + 1 < len(tokens) and tokens[j] == "point" and tokens[j + 1] in _UNITS and _UNITS[tokens[j + 1]] < 10:
            digits = ""
            j += 1
            while j < len(tokens) and tokens[j] in _UNITS and _UNITS[tokens[j]] < 10:
                digits += str(_UNITS[tokens[j]])
                j += 1
            value += "." + digits
        out.append((value, i))
        i = j
    return out


def plain_tokens(text: str) -> list[str]:
    """:func:`normalize_answer` without the number folding: NFKD without accents, lower case, "&" -> "and",
    thousands separators and punctuation removed (a decimal point between digits kept), articles dropped."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch)).lower().replace("&", " and ")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    text = re.sub(r"(?<=\d)\.(?=\d)", "\u2024", text)  # protect decimal points from the punctuation pass
    text = re.sub(r"[^\w\s\u2024]|_", " ", text).replace("\u2024", ".")
    return [t for t in text.split() if t not in _ARTICLES]


def normalize_answer(text: str) -> list[str]:
    """Tokens of ``text`` for matching: :func:`plain_tokens`, then spoken numbers folded to digits
    (:func:`fold_number_spans`)."""
    return [token for token, _ in fold_number_spans(plain_tokens(text))]


_WAITING = {"moment", "moments", "sec", "secs", "second", "seconds", "minute", "minutes", "mo", "tick"}
"""Words that make a lone "one" a phrase of waiting ("one moment", "one sec"), not the number 1."""


def number_spans(tokens: Sequence[str]) -> list[tuple[float, int, int]]:
    """The numbers in :func:`plain_tokens` output (digits, and spoken numbers folded by :func:`fold_number_spans`),
    in order, as ``(value, first token, last token)``. A lone "one" followed by a word of waiting ("one moment",
    "one second") is not a number: it asks the listener to wait."""
    folded = fold_number_spans(tokens)
    out = []
    for k, (token, first) in enumerate(folded):
        if not re.fullmatch(r"-?\d+(?:\.\d+)?", token):
            continue
        last = (folded[k + 1][1] if k + 1 < len(folded) else len(tokens)) - 1
        if tokens[first] == "one" and last == first and first + 1 < len(tokens) and tokens[first + 1] in _WAITING:
            continue
        out.append((float(token), first, last))
    return out


def numbers_in(text: str) -> list[float]:
    """Every number in ``text`` (digits and spoken numbers, see :func:`number_spans`), in order."""
    return [value for value, _, _ in number_spans(plain_tokens(text))]
