"""MoshiRAG's delays (TTFAT, keyword delay, end-to-end keyword delay) on word-timed answers worked out by hand."""

from __future__ import annotations

from typing import Any

import pytest

from cspan.bench.judge import OpenAIJudge
from cspan.bench.qa import QAItemResult, summarize_qa
from cspan.bench.qa_timing import (
    KEYWORD_SYSTEM,
    PROMPT_VERSION,
    TimedWord,
    locate,
    measure,
    parse_keyword,
    text_stream_words,
)


def words(*items: tuple[str, float, float]) -> list[TimedWord]:
    return [TimedWord(text=t, start=a, end=b) for t, a, b in items]


# The question ends at 2.00. "mhm" (1.20-1.40) is a backchannel during the question, not the response; the response
# starts at 2.40 -> TTFAT 0.40; "Paris." starts at 4.10 -> E2EKD 2.10, KD 4.10 - 2.40 = 1.70.
PARIS = words(
    ("mhm", 1.20, 1.40),
    ("Well", 2.40, 2.60),
    ("the", 2.65, 2.75),
    ("capital", 2.75, 3.20),
    ("of", 3.20, 3.30),
    ("France", 3.30, 3.80),
    ("is", 3.90, 4.05),
    ("Paris.", 4.10, 4.50),
)
# "So" is still being spoken when the question ends at 2.00: the response starts there -> TTFAT 0. The earliest alias
# is "Jane Austen" (word 2, 3.00), before "Austen" alone (3.20) -> E2EKD 1.00 = KD.
AUSTEN = words(("So", 1.90, 2.10), ("it's", 2.60, 2.80), ("Jane", 3.00, 3.20), ("Austen.", 3.20, 3.70))
# Math, the question ends at 2.50: "twenty five" folds to 25 starting at "twenty" (3.30) -> TTFAT 0.50, E2EKD 0.80,
# KD 0.30.
APPLES = words(("It's", 3.00, 3.20), ("twenty", 3.30, 3.60), ("five", 3.60, 3.90), ("apples.", 3.95, 4.40))
# No answer in the response: TTFAT 0.60, no keyword.
UNSURE = words(("I", 2.60, 2.70), ("don't", 2.70, 2.90), ("know.", 2.90, 3.30))


def timing(ws: list[TimedWord], q: float, answers: list[str], *, numeric: bool = False, judge: Any = None) -> Any:
    return measure(ws, q, question="Q?", answers=answers, numeric=numeric, judge=judge, words_source="asr")


def test_delays_with_the_alias_keyword() -> None:
    t = timing(PARIS, 2.0, ["Paris"])
    assert (t.onset_s, t.keyword, t.keyword_s) == (2.4, "Paris", 4.1)
    assert (t.ttfat_s, t.keyword_delay_s, t.e2ekd_s) == (0.4, 1.7, 2.1)
    assert t.keyword_method == "alias" and t.prompt_version is None
    t = timing(AUSTEN, 2.0, ["Austen", "Jane Austen"])
    assert (t.keyword, t.keyword_s, t.ttfat_s, t.keyword_delay_s, t.e2ekd_s) == ("Jane Austen", 3.0, 0.0, 1.0, 1.0)
    t = timing(APPLES, 2.5, ["25"], numeric=True)
    assert (t.keyword, t.keyword_s, t.ttfat_s, t.keyword_delay_s, t.e2ekd_s) == ("25", 3.3, 0.5, 0.3, 0.8)
    t = timing(UNSURE, 2.0, ["Paris"])
    assert (t.ttfat_s, t.keyword_s, t.e2ekd_s) == (0.6, None, None) and "no gold answer" in t.note
    t = timing(PARIS[:1], 2.0, ["Paris"])
    assert (t.onset_s, t.ttfat_s) == (None, None) and t.note == "no agent words after the question"


def test_locate_folds_numbers_and_joined_words() -> None:
    ws = words(("in", 0, 0.1), ("nineteen", 0.2, 0.5), ("sixty", 0.5, 0.8), ("nine", 0.8, 1.0), ("New", 1, 1.1))
    ws += words(("York.", 1.1, 1.4))
    assert locate(ws, "1969") == 1 and locate(ws, "nineteen sixty-nine") == 1
    assert locate(ws, "newyork") == 4 and locate(ws, "the New York") == 4
    assert locate(ws, "Boston") is None


def test_text_stream_words_from_events() -> None:
    events = [
        {"type": "ret", "t": 2.0},
        {"type": "text", "t": 2.4, "token": 1, "text": " Well"},
        {"type": "text", "t": 2.48, "token": 2, "text": " Par"},
        {"type": "text", "t": 2.56, "token": 3, "text": "is"},
    ]
    ws = text_stream_words(events)
    assert [(w.text, w.start, w.end) for w in ws] == [("Well", 2.4, 2.4), ("Paris", 2.48, 2.48)]
    t = measure(ws, 2.0, question="Q?", answers=["Paris"], numeric=False, judge=None, words_source="text")
    assert (t.ttfat_s, t.keyword_delay_s, t.e2ekd_s, t.words_source) == (0.4, 0.08, 0.48, "text")


def test_keyword_from_the_judge(fake_chat_server) -> None:
    replies = {"Well": "Paris", "So": '"Austen."', "I": "NONE", "It's": "Lyon"}

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        response = body["messages"][1]["content"].split("Spoken response: ", 1)[1]
        return {"role": "assistant", "content": replies[response.split()[0]]}

    server = fake_chat_server(reply)
    with OpenAIJudge(server.url, "keyword-judge", max_attempts=1) as judge:
        t = timing(PARIS, 2.0, ["Paris"], judge=judge)
        assert (t.keyword, t.keyword_s, t.e2ekd_s, t.keyword_method) == ("Paris", 4.1, 2.1, "judge")
        assert t.prompt_version == PROMPT_VERSION
        body = server.requests[0]
        assert body["model"] == "keyword-judge" and body["temperature"] == 0 and body["seed"] == 0
        assert body["messages"][0]["content"] == KEYWORD_SYSTEM
        user = body["messages"][1]["content"]
        assert "Accepted answers: Paris\n" in user and "Spoken response: Well the capital of France is Paris." in user
        assert "mhm" not in user  # only the response words are shown
        # the judge names "Austen." -> its first word (3.20), not the alias rule's "Jane Austen"
        t = timing(AUSTEN, 2.0, ["Jane Austen"], judge=judge)
        assert (t.keyword, t.keyword_s, t.e2ekd_s) == ("Austen", 3.2, 1.2)
        t = timing(UNSURE, 2.0, ["Paris"], judge=judge)
        assert t.keyword is None and t.note == "the judge found no answer in the response"
        t = timing(APPLES, 2.5, ["25"], judge=judge)  # a phrase the words do not contain: no time, a note
        assert (t.keyword, t.keyword_s, t.ttfat_s) == ("Lyon", None, 0.5) and "not among the response words" in t.note


def test_keyword_reply_parsing() -> None:
    assert parse_keyword("  \n**Paris**\nbecause it is the capital") == "Paris"
    assert parse_keyword("Response: 'Jane Austen'.") == "Jane Austen"
    assert parse_keyword("NONE") is None and parse_keyword("") is None


def test_summary_delays_are_means_over_measured_items() -> None:
    def result(i: str, t: Any) -> QAItemResult:
        return QAItemResult(id=i, question="Q?", answers=["a"], audio="x.wav", question_end_s=2.0, timing=t)

    results = [
        result("paris", timing(PARIS, 2.0, ["Paris"])),  # 0.40 / 1.70 / 2.10
        result("apples", timing(APPLES, 2.5, ["25"], numeric=True)),  # 0.50 / 0.30 / 0.80
        result("unsure", timing(UNSURE, 2.0, ["Paris"])),  # 0.60 / - / -
        result("silent", timing([], 2.0, ["Paris"])),  # nothing
        result("unrun", None),
    ]
    m = summarize_qa("halueval", results).metrics
    assert m["ttfat_s"] == pytest.approx(0.5)  # (0.4 + 0.5 + 0.6) / 3
    assert m["keyword_delay_s"] == pytest.approx(1.0)  # (1.7 + 0.3) / 2
    assert m["e2ekd_s"] == pytest.approx(1.45)  # (2.1 + 0.8) / 2
    assert m["keyword_found_rate"] == pytest.approx(2 / 3)
