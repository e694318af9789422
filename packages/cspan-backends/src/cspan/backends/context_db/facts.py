"""Facts stated in user turns ("my name is Ada", "I live in Leeds") and their sentence form for prompts."""

from __future__ import annotations

import re

_FACT_TRIGGERS: list[tuple[str, re.Pattern[str]]] = [
    ("name", re.compile(r"\b(?:my name is|my name's|call me|i am called|i'm called)\s+(.*)", re.I)),
    (
        "city",
        re.compile(
            r"\b(?:i live in|i'm living in|i am living in|i'm based in|i am based in|i'm from|i am from)\s+(.*)", re.I
        ),
    ),
]
# words that end a name or a place in running speech ("my name is ada and ...", "i live in leeds now")
_FACT_STOP = frozenset(
    [
        "and",
        "but",
        "so",
        "because",
        "which",
        "who",
        "i",
        "i'm",
        "im",
        "me",
        "my",
        "you",
        "we",
        "they",
        "he",
        "she",
        "it",
        "is",
        "was",
        "am",
        "are",
        "now",
        "today",
        "currently",
        "right",
        "with",
        "near",
        "at",
        "for",
        "since",
        "by",
        "to",
        "of",
        "the",
        "a",
        "an",
        "um",
        "uh",
        "er",
        "like",
        "actually",
        "though",
        "too",
        "also",
    ]
)
_FACT_LABELS = {"name": "the user's name is", "city": "the user lives in"}


def extract_facts(text: str) -> dict[str, str]:
    """Facts stated in one user turn: ``{"name": "Ada Lovelace", "city": "Leeds"}`` (title-cased, may be empty).

    Only explicit first-person statements count ("my name is ...", "call me ...", "I live in ...", "I'm from
    ..."): the value is at most three words after the trigger, ending at punctuation or at a function word
    ("and", "now", "i" ...). Source: the regex facts of the original Context DB (mindlogic-ai/Context-Spanning
    ``duetaspan/runtime/backend/context_db.py``), narrowed so that "I'm in a meeting" is not a place.
    """
    found: dict[str, str] = {}
    for key, pattern in _FACT_TRIGGERS:
        m = pattern.search(text)
        if not m:
            continue
        clause = re.split(r"[,.;:!?\"()]", m.group(1), maxsplit=1)[0]
        words: list[str] = []
        for word in clause.split():
            if word.lower() in _FACT_STOP or not re.fullmatch(r"[^\W\d_][\w'\-]*", word):
                if words or word.lower() not in ("the",):
                    break
                continue
            words.append(word[:1].upper() + word[1:])
            if len(words) == 3:
                break
        if words:
            found[key] = " ".join(words)
    return found


def fact_sentence(key: str, value: str) -> str:
    """A fact as a short sentence for retrieval and prompts ("the user's name is Ada")."""
    label = _FACT_LABELS.get(key, f"the user's {key.replace('_', ' ')} is")
    return f"{label} {value}"


def normalised(text: str) -> str:
    """Lower-case words and digits only, for comparing two turns (case and punctuation aside)."""
    return " ".join(re.findall(r"[a-z0-9']+", text.lower()))
