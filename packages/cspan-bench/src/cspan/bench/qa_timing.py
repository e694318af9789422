"""MoshiRAG's delay metrics for spoken QA, from word timestamps of the agent channel.

Definitions (MoshiRAG, arXiv 2604.12928, section 3.1 and 5.2, Table 1; released evaluator
``moshi/evaluate/score.py`` and ``utils.py`` of ``kyutai-labs/moshi-rag``), with ``q`` the end of the user's
question and times in seconds on the question's timeline:

- **TTFAT** (time to first answer token): ``q`` -> the start of the response, the first agent word that ends after
  ``q`` (a word still being spoken at ``q`` starts the response at ``q``): ``TTFAT = max(0, onset - q)``;
- **KD** (keyword delay, the key-information delay): response onset -> the onset of the answer keyword;
- **E2EKD** (end-to-end keyword delay): ``q`` -> the keyword onset, clipped at 0; ``E2EKD = TTFAT + KD``.

The keyword is "the single word or short phrase of the response that gives the answer". MoshiRAG asks an LLM
(Gemma 3 27B, its Table 17 prompt) for it and finds its first word in Parakeet word timestamps of the response
audio. Here:

- with an OpenAI-compatible judge, the judge names the phrase (this project's prompt, :data:`PROMPT_VERSION`,
  recorded with every timing); without one, the earliest gold alias the response contains (for math sets, the
  first number equal to the gold number);
- the phrase is located in the response words after the same normalisation as the alias match of
  :mod:`cspan.bench.answer_text` (case, accents, punctuation, articles; spoken numbers folded to digits, "twenty five" =
  "25"), so a phrase the words do not contain gives no keyword time (with a note) rather than a guess;
- the words are either a transcription of the agent's audio (``output.wav``, as a listener hears it: one frame
  after the model produced it) or the model's own text stream (the time each word's first token was generated,
  MoshiRAG's token-step variant); :attr:`AnswerTiming.words_source` says which. They are put in time order, and a
  word without finite times (``end >= start``) is left out with a note;
- without a judge the keyword recorded is the response's own words that give the answer (for math: the number as
  spoken, "twenty five"), not the gold string;
- a failed keyword judge leaves the timing marked ``judge_failed``: it is measured again on the next run.

The summary means TTFAT, KD and E2EKD over the same answers (those whose keyword was found), so that
E2EKD = TTFAT + KD holds for the means too (up to rounding); ``ttfat_all_s`` is TTFAT over every answer.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel

from cspan.bench.answer_text import fold_number_spans, normalize_answer, number_spans, numbers_in, plain_tokens
from cspan.bench.errors import JudgeError
from cspan.bench.seconds import Seconds

log = logging.getLogger(__name__)

PROMPT_VERSION = "cspan-qa-keyword/1"
"""Names the keyword prompt (:data:`KEYWORD_PROMPT`); recorded with every judged timing."""

KEYWORD_SYSTEM = "You point at the words of a spoken answer that carry the answer itself."
KEYWORD_PROMPT = (
    "Question: {question}\nAccepted answers: {answers}\nSpoken response: {response}\n\n"
    "Copy from the spoken response the shortest word or phrase that states its answer to the question: the words "
    "that match an accepted answer if the response contains one, otherwise the words the response offers as its "
    "answer. Copy them exactly as they appear in the response. Reply with that phrase alone on one line, or NONE "
    "if the response gives no answer."
)
"""The keyword judge's user message (:data:`PROMPT_VERSION`)."""


class TimedWord(BaseModel):
    """A word of the agent channel: ``text``, ``start`` and ``end`` in seconds (``end == start`` for text-stream
    words, which have only the time their first token was generated; a non-finite time reads as None)."""

    text: str
    start: Seconds
    end: Seconds


def in_time_order(words: Sequence[TimedWord]) -> tuple[list[TimedWord], int]:
    """The words with finite times and ``end >= start``, sorted by (start, end) (stable), and how many were left
    out."""
    kept = [w for w in words if w.start is not None and w.end is not None and w.end >= w.start]
    return sorted(kept, key=lambda w: (w.start, w.end)), len(words) - len(kept)


class AnswerTiming(BaseModel):
    """MoshiRAG's delays for one answer (seconds; ``None`` when not measurable, see ``note``)."""

    words_source: str
    question_end_s: float
    onset_s: float | None = None
    keyword: str | None = None
    keyword_method: str | None = None
    prompt_version: str | None = None
    keyword_s: float | None = None
    ttfat_s: float | None = None
    keyword_delay_s: float | None = None
    e2ekd_s: float | None = None
    note: str = ""
    judge_failed: bool = False

    def model_post_init(self, context: Any, /) -> None:
        # records written before ``judge_failed`` existed say it in their note
        if self.note.startswith("keyword judge failed:") or "; keyword judge failed:" in self.note:
            self.judge_failed = True


def response_words(words: Sequence[TimedWord], question_end: float) -> list[TimedWord]:
    """The words of the response: those that end after ``question_end`` (a point word: that start at or after it).
    ``words`` must have times (see :func:`in_time_order`)."""
    return [w for w in words if w.end > question_end or w.start >= question_end]  # type: ignore[operator]


def _plain_tokens(words: Sequence[TimedWord]) -> tuple[list[str], list[int]]:
    """:func:`plain_tokens` of every word, flat, with the index of the word each token comes from."""
    flat: list[str] = []
    owner: list[int] = []
    for k, word in enumerate(words):
        for token in plain_tokens(word.text):
            flat.append(token)
            owner.append(k)
    return flat, owner


def _indexed_tokens(words: Sequence[TimedWord]) -> list[tuple[str, int]]:
    """Normalised tokens of ``words`` (numbers folded across words) with the index of the word each starts in."""
    flat, owner = _plain_tokens(words)
    return [(token, owner[pos]) for token, pos in fold_number_spans(flat)]


def locate(words: Sequence[TimedWord], phrase: str) -> int | None:
    """Index of the word where the first occurrence of ``phrase`` starts in ``words`` (normalised as the alias
    match, spoken numbers folded; also as consecutive tokens spelling it without spaces), or None."""
    needle = normalize_answer(phrase)
    if not needle:
        return None
    tokens = _indexed_tokens(words)
    texts = [t for t, _ in tokens]
    n = len(needle)
    for i in range(len(texts) - n + 1):
        if texts[i : i + n] == needle:
            return tokens[i][1]
    joined = "".join(needle)
    if len(joined) >= 4:
        for i in range(len(texts)):
            acc = ""
            for token in texts[i:]:
                acc += token
                if acc == joined:
                    return tokens[i][1]
                if not joined.startswith(acc):
                    break
    return None


_EDGE_PUNCTUATION = "\"'`*.,;:!?()[]"


def alias_keyword(words: Sequence[TimedWord], answers: Sequence[str], *, numeric: bool) -> tuple[str, int] | None:
    """The earliest gold answer in ``words`` as ``(phrase, word index)``; for ``numeric`` sets the first number
    equal to the gold number (relative 1e-4, or equal at 2 decimals; :func:`~cspan.bench.answer_text.number_spans`,
    so "one moment" is no 1), its phrase the response's words that say it. None when the response holds none."""
    if numeric:
        gold = numbers_in(answers[0]) if answers else []
        if gold:
            g = gold[-1]
            flat, owner = _plain_tokens(words)
            for x, first, last in number_spans(flat):
                if math.isclose(x, g, rel_tol=1e-4, abs_tol=1e-9) or round(x, 2) == round(g, 2):
                    said = " ".join(w.text for w in words[owner[first] : owner[last] + 1])
                    return said.strip(_EDGE_PUNCTUATION), owner[first]
            return None
    found = [(index, alias) for alias in answers if (index := locate(words, alias)) is not None]
    if not found:
        return None
    index, alias = min(found, key=lambda f: f[0])
    return alias, index


_LABEL = re.compile(
    r"^(?:the\s+)?(?:key\s*word|keyword|key\s+phrase|phrase|answer|answer\s+phrase|response|final\s+answer|output)"
    r"(?:\s+is)?\s*[:=\-]\s*",
    re.IGNORECASE,
)
"""A label a judge may put before the phrase ("Keyword: Paris", "Answer - Paris", "The answer is: Paris")."""


def parse_keyword(reply: str) -> str | None:
    """The phrase in a keyword-judge reply: its first non-empty line without a label ("Keyword:", "Answer:",
    "Response:"...), quotes and end punctuation; None for ``NONE`` or an empty reply."""
    for line in reply.strip().splitlines():
        phrase = line.strip().strip("\"'`*").strip()
        phrase = _LABEL.sub("", phrase, count=1)
        phrase = phrase.strip().strip("\"'`*").strip().rstrip(".!?,;:").strip().strip("\"'`*").strip()
        if phrase:
            return None if phrase.upper() == "NONE" else phrase
    return None


def judge_keyword(judge: Any, question: str, answers: Sequence[str], response: str) -> str | None:
    """Ask ``judge`` (an :class:`~cspan.bench.judge.OpenAIJudge`) for the answer phrase of ``response``.

    Temperature 0, seed 0. Returns None when the judge finds no answer.

    Raises:
        JudgeError: the request failed.
    """
    prompt = KEYWORD_PROMPT.format(question=question, answers=" | ".join(answers), response=response)
    messages = [{"role": "system", "content": KEYWORD_SYSTEM}, {"role": "user", "content": prompt}]
    return parse_keyword(judge.chat(messages, seed=0, temperature=0, max_tokens=48))


def measure(
    words: Sequence[TimedWord],
    question_end: float,
    *,
    question: str,
    answers: Sequence[str],
    numeric: bool,
    judge: Any | None,
    words_source: str,
) -> AnswerTiming:
    """TTFAT, KD and E2EKD of one answer (see the module docstring).

    Args:
        words: the agent's words on the question's timeline (put in time order here; words without finite times
            are left out with a note).
        question_end: end of the question, seconds.
        question, answers: the item (answers: gold answer first, then aliases).
        numeric: a math set (the keyword without a judge is the gold number).
        judge: keyword judge, or None for the alias rule.
        words_source: ``"asr"`` or ``"text"`` (recorded).
    """
    timing = AnswerTiming(words_source=words_source, question_end_s=question_end)
    notes: list[str] = []
    ordered, dropped = in_time_order(words)
    if dropped:
        notes.append(f"{dropped} agent word(s) without finite times (end >= start) left out")
    _measure(timing, notes, response_words(ordered, question_end), question, answers, numeric, judge)
    timing.note = "; ".join(notes)
    return timing


def _measure(
    timing: AnswerTiming,
    notes: list[str],
    spoken: list[TimedWord],
    question: str,
    answers: Sequence[str],
    numeric: bool,
    judge: Any | None,
) -> None:
    """Fill ``timing`` from the response words ``spoken`` (in time order); why something is missing goes to
    ``notes``."""
    if not spoken:
        notes.append("no agent words after the question")
        return
    onset = float(spoken[0].start)  # type: ignore[arg-type]
    timing.onset_s = onset
    timing.ttfat_s = round(max(0.0, onset - timing.question_end_s), 3)
    if judge is not None:
        timing.keyword_method, timing.prompt_version = "judge", PROMPT_VERSION
        try:
            phrase = judge_keyword(judge, question, answers, " ".join(w.text for w in spoken))
        except JudgeError as exc:
            timing.judge_failed = True
            notes.append(f"keyword judge failed: {exc}")
            return
        if phrase is None:
            notes.append("the judge found no answer in the response")
            return
        timing.keyword = phrase
        index = locate(spoken, phrase)
        if index is None:
            notes.append(f"the judge's keyword {phrase!r} is not among the response words")
            return
    else:
        timing.keyword_method = "alias"
        found = alias_keyword(spoken, answers, numeric=numeric)
        if found is None:
            notes.append("the response contains no gold answer")
            return
        timing.keyword, index = found
    start = float(spoken[index].start)  # type: ignore[arg-type]
    timing.keyword_s = start
    timing.e2ekd_s = round(max(0.0, start - timing.question_end_s), 3)
    timing.keyword_delay_s = round(timing.e2ekd_s - timing.ttfat_s, 3)


def text_stream_words(events: Iterable[Any]) -> list[TimedWord]:
    """Words of the model's text stream from a rendering's events (objects or their JSON dicts), as point words at
    the time their first token was generated."""
    from types import SimpleNamespace

    from cspan.bench.session import agent_words

    evs = [SimpleNamespace(**e) if isinstance(e, dict) else e for e in events]
    return [TimedWord(text=w.text, start=w.start_s, end=w.start_s) for w in agent_words(evs)]
