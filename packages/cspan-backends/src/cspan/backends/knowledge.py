"""Local knowledge: a full-text index of the sentences of a folder of notes (``.txt`` / ``.md``).

SQLite FTS5 with Porter stemming and BM25 ranking (https://www.sqlite.org/fts5.html), in memory. The query is a
question's content words (:func:`content_words`); a sentence must contain enough of them (one of one, two of two to
five, three of six or more) and the best one (by number of words matched, then BM25) wins; a short sentence takes
its paragraph's next one along. Used by :class:`~cspan.backends.router.LocalRouter` and by the ``search_notes`` tool
of the ``knowledge`` tool set (:mod:`cspan.backends.tools.catalog`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from cspan.backends.untrusted import require_str

log = logging.getLogger(__name__)

KNOWLEDGE_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text")

_STOPWORD_TEXT = """
a about above after again against all am an and any are aren't as at be because been before being below
between both but by can can't cannot could couldn't did didn't do does doesn't doing don't down during each
few for from further had hadn't has hasn't have haven't having he he'd he'll he's her here here's hers herself
him himself his how how's i i'd i'll i'm i've if in into is isn't it it's its itself let's me more most
mustn't my myself no nor not of off on once only or other ought our ours ourselves out over own same shan't she
she'd she'll she's should shouldn't so some such than that that's the their theirs them themselves then there
there's these they they'd they'll they're they've this those through to too under until up very was wasn't we
we'd we'll we're we've were weren't what what's when when's where where's which while who who's whom why why's
with won't would wouldn't you you'd you'll you're you've your yours yourself yourselves
um uh er erm ah oh hmm hey hi hello well like just really actually basically okay ok so yeah yes yep please
tell know think wonder wondering want wanna gonna going got get give let say said says maybe mean guess
anything something thing things kind sort lot bit quite also now right sure thanks thank again much many
whats thats dont im ive id youre
"""
STOPWORDS = frozenset(_STOPWORD_TEXT.split())
"""English function words, question words and speech fillers left out of note searches."""


def content_words(question: str) -> list[str]:
    """The question's content words, lower-case, in order, without repeats or stopwords (:data:`STOPWORDS`)."""
    words: list[str] = []
    for w in re.findall(r"[^\W_]+(?:'[^\W_]+)?", question.lower()):
        w = w.replace("'s", "") if w.endswith("'s") else w
        if len(w) < 2 or w in STOPWORDS or w in words:
            continue
        words.append(w)
    return words


def _required_matches(n_terms: int) -> int:
    return 1 if n_terms <= 1 else 2 if n_terms <= 5 else 3


_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")
_MD_MARKUP = re.compile(r"(\*\*|__|`|\[([^\]]*)\]\([^)]*\))")


def split_sentences(text: str) -> list[str]:
    """Sentences of a paragraph (split after . ! ? followed by a capital or a digit); whitespace collapsed."""
    text = " ".join(text.split())
    return [s.strip() for s in _SENTENCE_SPLIT.split(text) if s.strip()]


def _display_name(name: str) -> str:
    """``name`` (a file name as Python decodes it: undecodable bytes as lone surrogates) as valid Unicode text, each
    byte that is not UTF-8 read as U+FFFD."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate no decoder made (not U+DC80..U+DCFF)
        return name.encode("utf-8", "replace").decode("utf-8")


def read_knowledge_file(path: Path) -> list[tuple[str, list[str]]]:
    """``[(title, sentences)]`` per paragraph of a text or Markdown file.

    Paragraphs are separated by blank lines; a Markdown heading sets the title of what follows (prefixed by the
    file's stem); list bullets, emphasis and link targets are removed. A name whose bytes are not UTF-8 (a Latin-1
    ``caf\xe9.md`` from an old archive) is read with U+FFFD in their place: its stem is a title, text for the
    index (SQLite stores no surrogate).
    """
    stem = re.sub(r"[_\-]+", " ", _display_name(path.stem)).strip()
    title = stem
    paragraphs: list[tuple[str, list[str]]] = []
    lines: list[str] = []

    def flush() -> None:
        if lines:
            text = _MD_MARKUP.sub(lambda m: m.group(2) or "", " ".join(lines))
            sentences = split_sentences(text)
            if sentences:
                paragraphs.append((title, sentences))
            lines.clear()

    for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = raw.strip()
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if heading:
            flush()
            title = f"{stem} {heading.group(1).strip('# ')}".strip()
        elif not line or re.fullmatch(r"[-=*_]{3,}", line):
            flush()
        else:
            item = re.match(r"^(?:[-*+]|\d+[.)])\s+(.*)$", line)
            if item:  # each list item is a paragraph of its own
                flush()
                lines.append(item.group(1))
                flush()
            else:
                lines.append(line)
    flush()
    return paragraphs


@dataclass
class NoteHit:
    rowid: int
    text: str
    source: str
    matched: int
    score: float


class NotesIndex:
    """An in-memory FTS5 index of knowledge sentences plus the per-request notes and facts (thread-safe).

    ``search`` replaces the per-request rows (``extra``) under the index lock, so one index may serve many sessions.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(":memory:", check_same_thread=False)
        self._conn.execute(
            "CREATE VIRTUAL TABLE notes USING fts5(text, title, source UNINDEXED, tokenize='porter unicode61')"
        )
        self._next: dict[int, int] = {}  # rowid -> rowid of the next sentence in the same paragraph
        self.files = 0
        self.sentences = 0

    def add_knowledge(self, folder: Path) -> None:
        paths = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in KNOWLEDGE_SUFFIXES)
        with self._lock:
            for path in paths:
                try:
                    paragraphs = read_knowledge_file(path)
                except OSError as exc:
                    log.warning("skipping knowledge file %s: %s", path, exc)
                    continue
                self.files += 1
                for title, sentences in paragraphs:
                    previous: int | None = None
                    for sentence in sentences:
                        cur = self._conn.execute(
                            "INSERT INTO notes (text, title, source) VALUES (?, ?, 'knowledge')", (sentence, title)
                        )
                        rowid = int(cur.lastrowid)
                        if previous is not None:
                            self._next[previous] = rowid
                        previous = rowid
                        self.sentences += 1

    def search(self, terms: list[str], extra: list[tuple[str, str]]) -> NoteHit | None:
        """Best sentence for ``terms`` among the knowledge and ``extra`` ``[(text, source)]`` rows."""
        if not terms:
            return None
        with self._lock:
            self._conn.execute("DELETE FROM notes WHERE source != 'knowledge'")
            for text, source in extra:
                self._conn.execute("INSERT INTO notes (text, title, source) VALUES (?, '', ?)", (text, source))
            matched: dict[int, int] = {}
            for term in terms:
                for (rowid,) in self._conn.execute("SELECT rowid FROM notes WHERE notes MATCH ?", (f'"{term}"',)):
                    matched[rowid] = matched.get(rowid, 0) + 1
            need = _required_matches(len(terms))
            good = {rowid for rowid, n in matched.items() if n >= need}
            if not good:
                return None
            query = " OR ".join(f'"{t}"' for t in terms)
            rows = self._conn.execute(
                "SELECT rowid, text, source, bm25(notes, 1.0, 0.5) FROM notes WHERE notes MATCH ? ORDER BY rank",
                (query,),
            ).fetchall()
            hits = [NoteHit(r[0], r[1], r[2], matched[r[0]], r[3]) for r in rows if r[0] in good]
            best = max(hits, key=lambda h: (h.matched, -h.score))
            if best.source == "knowledge" and len(best.text) < 80 and best.rowid in self._next:
                nxt = self._conn.execute("SELECT text FROM notes WHERE rowid = ?", (self._next[best.rowid],)).fetchone()
                if nxt and len(best.text) + 1 + len(nxt[0]) <= 300:
                    best.text = f"{best.text} {nxt[0]}"
            return best


class KnowledgeBase:
    """The notes of one folder, indexed once at first use (in a worker thread) and shared by whoever holds it.

    Args:
        folder: a folder of ``.txt`` / ``.md`` files, read recursively; None for an index of per-request rows only.

    Raises:
        ValueError: ``folder`` is given but is not a folder.
    """

    def __init__(self, folder: str | Path | None = None) -> None:
        self.folder = Path(folder).expanduser() if folder is not None else None
        if self.folder is not None and not self.folder.is_dir():
            raise ValueError(
                f"knowledge folder {str(self.folder)!r} does not exist or is not a folder. Fix: pass "
                "--knowledge DIR with .txt or .md files."
            )
        self._index: NotesIndex | None = None
        self._lock = threading.Lock()

    def _build(self) -> NotesIndex:
        with self._lock:
            if self._index is None:
                index = NotesIndex()
                if self.folder is not None:
                    index.add_knowledge(self.folder)
                    log.info("indexed %d sentences from %d files in %s", index.sentences, index.files, self.folder)
                self._index = index
            return self._index

    async def index(self) -> NotesIndex:
        """The index, built on first use in a worker thread."""
        return self._index if self._index is not None else await asyncio.to_thread(self._build)

    async def search(self, question: str, extra: list[tuple[str, str]] = ()) -> NoteHit | None:  # type: ignore[assignment]
        """Best sentence for ``question`` among the notes and ``extra`` ``[(text, source)]`` rows, or None.

        Raises:
            TypeError: ``question`` is not a ``str`` (bytes included: decode them first).
        """
        terms = content_words(require_str("question", question))
        if not terms:
            return None
        index = await self.index()
        return await asyncio.to_thread(index.search, terms, list(extra))
