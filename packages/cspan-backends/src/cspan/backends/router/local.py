"""``LocalRouter``: the embedded router, no LLM and no network.

Three routes, tried in order:

1. **Clock.** "what time is it (in Tokyo)", "what's the date" -> the ``get_time`` tool, with the timezone of the
   named place (a small city table, then the IANA zone names themselves, else the name as said, for the tool to
   resolve) or else the profile's.
2. **Arithmetic.** "what is two plus three", "15 percent of 80", "twelve times seven" -> the spoken numbers and
   operators become an expression for the ``calculate`` tool.
3. **Notes.** Anything else is a full-text search (SQLite FTS5, Porter stemming, BM25 ranking; see
   https://www.sqlite.org/fts5.html) over the sentences of a local knowledge folder (``.txt`` / ``.md`` files),
   the profile's notes and the user's facts in the Context DB. The query is the question's content words; a
   sentence must contain enough of them (one of one, two of two to five, three of six or more) and the best one
   (by number of words matched, then BM25) is the reference. Nothing good enough -> ``None``.

Tool results become ``"(tool result) <clause>"``; notes are returned as plain sentences (<= 300 characters).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from cspan.backends.context_db import Fact, Profile, db_wait_s, fact_sentence
from cspan.backends.errors import ToolError
from cspan.backends.knowledge import (
    KNOWLEDGE_SUFFIXES,
    STOPWORDS,
    KnowledgeBase,
    NotesIndex,
    content_words,
    read_knowledge_file,
    split_sentences,
)
from cspan.backends.router.base import RouteRequest, RouteResult, ToolCall, tool_reference

if TYPE_CHECKING:
    from cspan.backends.context_db import ContextDB, UserMemory
    from cspan.backends.tools import ToolBank

__all__ = [
    "KNOWLEDGE_SUFFIXES",
    "STOPWORDS",
    "LocalRouter",
    "content_words",
    "read_knowledge_file",
    "spoken_arithmetic",
    "timezone_for_place",
]

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------- clock

_TIME_INTENT = re.compile(
    r"\b(?:what(?:'s| is| was)?\s+(?:the\s+)?(?:current\s+|local\s+)?time\b|time\s+is\s+it\b|"
    r"(?:tell|give)\s+me\s+the\s+time\b|(?:current|local)\s+time\b|the\s+time\s+(?:in|at|over\s+in)\b|"
    r"what(?:'s| is)?\s+(?:the\s+|today'?s\s+)?date\b|what\s+day\s+is\s+(?:it|today)\b|"
    r"what(?:'s| is)\s+today'?s\s+date\b|which\s+day\s+is\s+(?:it|today)\b)",
    re.I,
)
_PLACE = re.compile(r"\b(?:in|at|for)\s+([a-z][a-z .'\-]{1,40}?)\s*(?:right now|now|today|currently|please|$)", re.I)
_NOT_PLACES = {
    "the morning", "the evening", "the afternoon", "the world", "general", "total", "here", "there", "you", "me",
    "us", "it", "this", "that", "your place", "my place",
}  # fmt: skip

# Places whose name is not the leaf of their IANA zone (leaves such as Tokyo or New_York are found directly).
CITY_TIMEZONES: dict[str, str] = {
    "san francisco": "America/Los_Angeles",
    "seattle": "America/Los_Angeles",
    "san diego": "America/Los_Angeles",
    "las vegas": "America/Los_Angeles",
    "portland": "America/Los_Angeles",
    "california": "America/Los_Angeles",
    "washington": "America/New_York",
    "washington dc": "America/New_York",
    "boston": "America/New_York",
    "miami": "America/New_York",
    "atlanta": "America/New_York",
    "philadelphia": "America/New_York",
    "nyc": "America/New_York",
    "dallas": "America/Chicago",
    "houston": "America/Chicago",
    "austin": "America/Chicago",
    "denver": "America/Denver",
    "rio": "America/Sao_Paulo",
    "rio de janeiro": "America/Sao_Paulo",
    "beijing": "Asia/Shanghai",
    "shenzhen": "Asia/Shanghai",
    "china": "Asia/Shanghai",
    "delhi": "Asia/Kolkata",
    "new delhi": "Asia/Kolkata",
    "mumbai": "Asia/Kolkata",
    "bangalore": "Asia/Kolkata",
    "india": "Asia/Kolkata",
    "busan": "Asia/Seoul",
    "korea": "Asia/Seoul",
    "south korea": "Asia/Seoul",
    "osaka": "Asia/Tokyo",
    "kyoto": "Asia/Tokyo",
    "japan": "Asia/Tokyo",
    "munich": "Europe/Berlin",
    "hamburg": "Europe/Berlin",
    "frankfurt": "Europe/Berlin",
    "germany": "Europe/Berlin",
    "barcelona": "Europe/Madrid",
    "spain": "Europe/Madrid",
    "milan": "Europe/Rome",
    "italy": "Europe/Rome",
    "france": "Europe/Paris",
    "geneva": "Europe/Zurich",
    "edinburgh": "Europe/London",
    "manchester": "Europe/London",
    "england": "Europe/London",
    "uk": "Europe/London",
    "the uk": "Europe/London",
    "britain": "Europe/London",
    "melbourne": "Australia/Melbourne",
    "australia": "Australia/Sydney",
    "utc": "UTC",
    "gmt": "UTC",
}


@lru_cache(maxsize=1)
def _zone_leaves() -> dict[str, str]:
    import zoneinfo

    leaves: dict[str, str] = {}
    for zone in sorted(zoneinfo.available_timezones()):
        if "/" in zone and not zone.startswith(("Etc/", "SystemV/", "posix/", "right/")):
            leaves.setdefault(zone.rsplit("/", 1)[-1].replace("_", " ").lower(), zone)
    return leaves


def timezone_for_place(place: str) -> str | None:
    """IANA timezone of a spoken place name ("tokyo" -> "Asia/Tokyo", "san francisco" -> "America/Los_Angeles").

    Looks in :data:`CITY_TIMEZONES`, then in the leaves of the installed zone names. None when unknown.
    """
    key = " ".join(re.sub(r"[^a-z ]", " ", place.lower()).split())
    for candidate in (key, key.removeprefix("the ")):
        if candidate in CITY_TIMEZONES:
            return CITY_TIMEZONES[candidate]
        if candidate in _zone_leaves():
            return _zone_leaves()[candidate]
    return None


# --------------------------------------------------------------------------------------------- arithmetic

_UNITS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
    "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
    "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19,
}  # fmt: skip
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
_SCALES = {"hundred": 100, "thousand": 1_000, "million": 1_000_000, "billion": 1_000_000_000}
# (spoken phrase, role, text): role "bin" binary operator, "pre" prefix of the next number, "post" suffix.
_OPERATORS: list[tuple[tuple[str, ...], str, str]] = sorted(
    [
        (("plus",), "bin", "+"),
        (("+",), "bin", "+"),
        (("add",), "bin", "+"),
        (("minus",), "bin", "-"),
        (("-",), "bin", "-"),
        (("times",), "bin", "*"),
        (("multiplied", "by"), "bin", "*"),
        (("x",), "bin", "*"),
        (("*",), "bin", "*"),
        (("divided", "by"), "bin", "/"),
        (("over",), "bin", "/"),
        (("/",), "bin", "/"),
        (("to", "the", "power", "of"), "bin", "**"),
        (("raised", "to", "the", "power", "of"), "bin", "**"),
        (("raised", "to"), "bin", "**"),
        (("^",), "bin", "**"),
        (("mod",), "bin", "%"),
        (("modulo",), "bin", "%"),
        (("percent", "of"), "bin", "/ 100 *"),
        (("per", "cent", "of"), "bin", "/ 100 *"),
        (("%", "of"), "bin", "/ 100 *"),
        (("square", "root", "of"), "pre", "sqrt"),
        (("the", "square", "root", "of"), "pre", "sqrt"),
        (("half", "of"), "pre", "0.5 * "),
        (("double",), "pre", "2 * "),
        (("twice",), "pre", "2 * "),
        (("squared",), "post", " ** 2"),
        (("cubed",), "post", " ** 3"),
        (("percent",), "post", " / 100"),
        (("%",), "post", " / 100"),
    ],
    key=lambda op: -len(op[0]),
)
_NUMBER_TOKEN = re.compile(r"^\d+(?:\.\d+)?$")


def _read_number(words: list[str], i: int) -> tuple[str, int] | None:
    """A number starting at ``words[i]`` (digits or spoken) -> (text, next index), or None."""
    if _NUMBER_TOKEN.match(words[i]):
        return words[i], i + 1
    total, current, j, seen = 0, 0, i, False
    while j < len(words):
        w = words[j]
        if w in _UNITS:
            current += _UNITS[w]
        elif w in _TENS:
            current += _TENS[w]
        elif w in _SCALES:
            scale = _SCALES[w]
            if scale == 100:
                current = max(current, 1) * 100
            else:
                total += max(current, 1) * scale
                current = 0
        elif w == "a" and j + 1 < len(words) and words[j + 1] in _SCALES and not seen:
            current = 1
            j += 1
            seen = True
            continue
        elif w == "and" and seen and j + 1 < len(words) and (words[j + 1] in _UNITS or words[j + 1] in _TENS):
            j += 1
            continue
        else:
            break
        seen = True
        j += 1
    if not seen:
        return None
    value = str(total + current)
    if j + 1 < len(words) and words[j] == "point" and words[j + 1] in _UNITS and _UNITS[words[j + 1]] < 10:
        digits = ""
        j += 1
        while j < len(words) and words[j] in _UNITS and _UNITS[words[j]] < 10:
            digits += str(_UNITS[words[j]])
            j += 1
        value += "." + digits
    return value, j


def _match_operator(words: list[str], i: int) -> tuple[str, str, int] | None:
    for phrase, role, text in _OPERATORS:
        if tuple(words[i : i + len(phrase)]) == phrase:
            return role, text, i + len(phrase)
    return None


def spoken_arithmetic(text: str) -> str | None:
    """An arithmetic expression read out of a spoken question, or None when there is none.

    "what is two plus three" -> ``"2 + 3"``; "15 percent of 80" -> ``"15 / 100 * 80"``; "square root of
    sixteen" -> ``"(16) ** 0.5"``; "twelve point five times 4" -> ``"12.5 * 4"``. The longest run of numbers and operator
    words wins; it must be a well-formed expression with at least one operator (bare numbers are not maths).
    """
    cleaned = re.sub(r"(?<=[a-z])-(?=[a-z])", " ", text.lower())
    cleaned = re.sub(r"(\d),(\d{3})", r"\1\2", cleaned)
    cleaned = re.sub(r"([+*/^%()]|(?<=\d)-|-(?=\d)|(?<=\s)-(?=\s))", r" \1 ", cleaned)
    words = re.findall(r"\d+(?:\.\d+)?|[a-z]+|[+\-*/^%]", cleaned)
    # tokenise into ("n", value) / (role, text) / ("brk", "")
    items: list[tuple[str, str]] = []
    i = 0
    while i < len(words):
        op = _match_operator(words, i)
        num = _read_number(words, i)
        if num is not None:
            items.append(("n", num[0]))
            i = num[1]
        elif op is not None:
            items.append((op[0], op[1]))
            i = op[2]
        else:
            items.append(("brk", ""))
            i += 1
    best: str | None = None
    best_len = 0
    for start in range(len(items)):
        expr, n_ops, length = _parse_run(items, start)
        if expr is not None and n_ops > 0 and length > best_len:
            best, best_len = expr, length
    return best


def _parse_run(items: list[tuple[str, str]], start: int) -> tuple[str | None, int, int]:
    """Longest well-formed expression starting at ``items[start]`` -> (expression, operator count, item count)."""
    parts: list[str] = []
    n_ops = 0
    i = start
    best: tuple[str | None, int, int] = (None, 0, 0)
    while True:
        pre: list[str] = []
        while i < len(items) and items[i][0] == "pre":
            pre.append(items[i][1])
            i += 1
        if i >= len(items) or items[i][0] != "n":
            return best
        operand = items[i][1]
        i += 1
        while i < len(items) and items[i][0] == "post":
            operand = f"({operand}){items[i][1]}"
            n_ops += 1
            i += 1
        for p in reversed(pre):
            operand = f"({operand}) ** 0.5" if p == "sqrt" else f"{p}{operand}"
            n_ops += 1
        parts.append(operand)
        best = (" ".join(parts), n_ops, i - start)
        if i < len(items) and items[i][0] == "bin":
            parts.append(items[i][1])
            n_ops += 1
            i += 1
        else:
            return best


_ARITH_CUE = re.compile(
    r"\b(?:what(?:'s| is)|how much is|calculate|compute|work out|solve|equals?|plus|minus|times|divided|"
    r"multiplied|percent|squared|cubed|square root|power of)\b|[+*/^%=]",
    re.I,
)


def _cap(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    return cut.rsplit(" ", 1)[0] + "…"


class LocalRouter:
    """The embedded router: clock and arithmetic through the tools, everything else from local notes.

    Args:
        tools: a :class:`~cspan.backends.tools.ToolBank` with ``get_time`` and ``calculate`` (either may be
            missing; that route is then skipped). None disables both.
        db: the memory whose facts (and stored profile, when the request has none) are searched: a
            :class:`~cspan.backends.context_db.UserMemory` (one principal's), or, deprecated, a whole
            :class:`~cspan.backends.context_db.ContextDB` (then the request profile's ``user_id`` picks the user).
        knowledge_dir: a folder of ``.txt`` / ``.md`` files, read recursively and indexed once at first use.
        knowledge: an already built :class:`~cspan.backends.knowledge.KnowledgeBase` to share instead.
        db_timeout_s: longest wait for the memory's facts and profile, in seconds (None: no limit), or less where
            the caller's bound on its waits for the database ends first (a retrieval's: ``db_waits_due_by`` in
            :mod:`cspan.backends.context_db.waits`); past it, or when the database fails, the notes are searched
            without them (logged).

    Raises:
        ValueError: ``knowledge_dir`` is given but is not a folder; ``db_timeout_s`` is not a positive number.

    :meth:`with_bank` makes the per-session router of a server: another bank (the session's tools) and another
    memory (the session principal's), sharing the knowledge index.
    """

    TOOLS_CALLED: tuple[str, ...] = ("get_time", "calculate")
    """The only tools of a bank this router calls (any other, MCP tools included, needs an LLM router)."""

    def __init__(
        self,
        tools: ToolBank | None = None,
        db: UserMemory | ContextDB | None = None,
        knowledge_dir: str | Path | None = None,
        *,
        knowledge: KnowledgeBase | None = None,
        db_timeout_s: float | None = None,
    ) -> None:
        if db_timeout_s is not None and not 0 < db_timeout_s < float("inf"):
            raise ValueError(f"db_timeout_s must be a positive number of seconds or None, not {db_timeout_s!r}")
        self.tools = tools
        self.db = db
        self.db_timeout_s = db_timeout_s
        self.knowledge = knowledge if knowledge is not None else KnowledgeBase(knowledge_dir)
        self.knowledge_dir = self.knowledge.folder

    def with_bank(self, tools: ToolBank | None = None, *, memory: UserMemory | None = None) -> LocalRouter:
        """A router like this one with another tool bank and/or memory, sharing the knowledge index (cheap)."""
        return LocalRouter(
            tools if tools is not None else self.tools,
            memory if memory is not None else self.db,
            knowledge=self.knowledge,
            db_timeout_s=self.db_timeout_s,
        )

    def _has(self, name: str) -> bool:
        return self.tools is not None and name in self.tools.names()

    async def index(self) -> NotesIndex:
        """The notes index, built once (the knowledge folder is read in a worker thread)."""
        return await self.knowledge.index()

    async def route(self, req: RouteRequest) -> RouteResult:
        """Answer ``req`` from the clock, arithmetic or the notes; ``reference=None`` when none of them applies.

        Never raises for a failing tool (the result carries ``error``).
        """
        t0 = time.perf_counter()
        result = await self._route(req)
        result.latency_s = time.perf_counter() - t0
        return result

    async def _route(self, req: RouteRequest) -> RouteResult:
        question = " ".join(req.question.split())
        if not question:
            return RouteResult(source="none")
        if self._has("get_time") and _TIME_INTENT.search(question):
            return await self._clock(question, req.profile)
        if self._has("calculate") and _ARITH_CUE.search(question):
            expression = spoken_arithmetic(question)
            if expression is not None:
                return await self._call("calculate", {"expression": expression}, question)
        return await self._notes(question, req.profile)

    async def _clock(self, question: str, profile: Profile | None) -> RouteResult:
        timezone = profile.timezone if profile and profile.timezone else ""
        m = _PLACE.search(re.sub(r"[^\w\s'\-]", " ", question).strip())
        if m and m.group(1).strip().lower() not in _NOT_PLACES:
            place = m.group(1).strip()
            # unknown to the table: let get_time resolve the name itself (it fails cleanly when it cannot)
            timezone = timezone_for_place(place) or place
        return await self._call("get_time", {"timezone": timezone} if timezone else {}, question)

    async def _call(self, name: str, arguments: dict, question: str) -> RouteResult:
        assert self.tools is not None
        t0 = time.perf_counter()
        try:
            result = await self.tools.call(name, arguments)
        except ToolError as exc:
            return RouteResult(
                tool=name, arguments=arguments, source="none", error=str(exc), tool_s=time.perf_counter() - t0
            )
        call = ToolCall(question=question, name=name, arguments=result.arguments, result=result.text)
        return RouteResult(
            reference=tool_reference(result.text),
            tool=name,
            arguments=result.arguments,
            source=f"tool:{name}",
            calls=[call],
            tool_s=time.perf_counter() - t0,
        )

    def _memory(self, profile: Profile | None) -> UserMemory | None:
        from cspan.backends.context_db import ContextDB

        if isinstance(self.db, ContextDB):  # deprecated: the request names the user
            return self.db.user(profile.user_id if profile else "default")
        return self.db

    async def _notes(self, question: str, profile: Profile | None) -> RouteResult:
        if not content_words(question):
            return RouteResult(source="none")
        memory = self._memory(profile)
        facts: list[Fact] = []
        wait_s = db_wait_s(self.db_timeout_s)  # less where the caller's wait for the database is mostly spent
        if memory is not None and wait_s == 0:
            log.warning(
                "Context DB has not answered this retrieval in time: searching the notes without the user's facts"
            )
        elif memory is not None:
            try:
                async with asyncio.timeout(wait_s):
                    if profile is None:
                        profile = await memory.aget_profile()
                    facts = await memory.afacts()
            except Exception as exc:  # a database that fails or does not answer costs the facts, not the notes
                why = f"has not answered in {wait_s:.2g} s" if isinstance(exc, TimeoutError) else f"failed: {exc}"
                log.warning("Context DB %s: searching the notes without the user's facts", why)
        extra: list[tuple[str, str]] = []
        if profile is not None and profile.notes:
            extra.extend((s, "notes") for s in split_sentences(profile.notes))
        for fact in facts:
            sentence = fact_sentence(fact.key, fact.value)
            extra.append((sentence[:1].upper() + sentence[1:] + ".", "facts"))
        hit = await self.knowledge.search(question, extra)
        if hit is None:
            return RouteResult(source="none")
        return RouteResult(reference=_cap(hit.text), source=f"local:{hit.source}")
