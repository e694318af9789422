"""MoshiRAG's delays (TTFAT, keyword delay, end-to-end keyword delay) on word-timed answers worked out by hand."""

from __future__ import annotations

from typing import Any

import pytest

from cspan.bench.judge import OpenAIJudge
from cspan.bench.qa import QAItemResult, summarize_qa
from cspan.bench.qa_timing import (
    KEYWORD_SYSTEM,
    PROMPT_VERSION,
    AnswerTiming,
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
# KD 0.30; the keyword recorded is the words said, "twenty five".
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
    assert (t.keyword, t.keyword_s, t.ttfat_s, t.keyword_delay_s, t.e2ekd_s) == ("twenty five", 3.3, 0.5, 0.3, 0.8)
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
    summary = summarize_qa("halueval", results)
    m = summary.metrics
    # the three delays are means over the same answers (keyword found: paris, apples), so E2EKD = TTFAT + KD
    assert (m["ttfat_s"], m["keyword_delay_s"], m["e2ekd_s"]) == (0.45, 1.0, 1.45)  # (0.4+0.5)/2, (1.7+0.3)/2, ...
    assert m["ttfat_all_s"] == 0.5  # (0.4 + 0.5 + 0.6) / 3: every answer that spoke
    assert m["keyword_found_rate"] == pytest.approx(2 / 3)
    # what each rests on is said
    assert "1 of 5 item(s) have no word times: no delays" in summary.notes
    assert "1 of 4 item(s): no agent words after the question" in summary.notes
    assert any(n.startswith("TTFAT, KD and E2EKD over the 2 of 3 answer(s) whose keyword") for n in summary.notes)


@pytest.mark.parametrize(
    ("ws", "expected", "note"),
    [
        # out of order: sorted, "um" (3.30) starts the response -> TTFAT 0.152, KD 0.300, E2EKD 0.452
        (words(("Paris.", 3.6, 3.9), ("um", 3.3, 3.5)), (0.152, 0.3, 0.452), ""),
        # a NaN start, an open end, an end before the start: left out with a note, never a 0 delay
        (words(("um", float("nan"), 3.5), ("Paris.", 3.6, 3.9)), (0.452, 0.0, 0.452), "1 agent word(s)"),
        (
            [TimedWord(text="um", start=3.3, end=None), *words(("Paris", 3.6, 3.9), ("oh", 3.2, 3.1))],
            (0.452, 0.0, 0.452),
            "2 agent word(s) without finite times",
        ),
        (words(("Paris", float("inf"), 3.9)), (None, None, None), "1 agent word(s)"),
    ],
)
def test_word_times_are_ordered_and_checked(ws: list[TimedWord], expected: tuple, note: str) -> None:
    t = timing(ws, 3.148, ["Paris"])
    assert (t.ttfat_s, t.keyword_delay_s, t.e2ekd_s) == expected
    assert t.note.startswith(note)
    if t.e2ekd_s is not None:
        assert t.e2ekd_s == pytest.approx(t.ttfat_s + t.keyword_delay_s, abs=1e-9)
    assert TimedWord(text="x", start=float("nan"), end=1.0).model_dump_json() == '{"text":"x","start":null,"end":1.0}'


@pytest.mark.parametrize(
    ("ws", "answers", "keyword", "keyword_s"),
    [
        # "one moment" asks to wait; the answer comes later
        (words(("One", 2.6, 2.8), ("moment.", 2.8, 3.2), ("It's", 4.0, 4.2), ("one.", 4.2, 4.5)), ["1"], "one", 4.2),
        (words(("one", 2.6, 2.8), ("sec,", 2.8, 3.0), ("1", 4.0, 4.2)), ["1"], "1", 4.0),
        (words(("Hold", 2.6, 2.8), ("on", 2.8, 2.9), ("one", 2.9, 3.0), ("second.", 3.0, 3.3)), ["1"], None, None),
        # GSM8K: the keyword is what was said, not the gold string
        (words(("It's", 2.6, 2.8), ("1,234.", 2.8, 3.5)), ["1,234"], "1,234", 2.8),
        (
            words(("one", 2.6, 2.7), ("thousand", 2.7, 3.0), ("two", 3.0, 3.1), ("hundred", 3.1, 3.3)),
            ["1200"],
            "one thousand two hundred",
            2.6,
        ),
    ],
)
def test_math_keyword_is_the_number_said(ws: list[TimedWord], answers: list[str], keyword: Any, keyword_s: Any) -> None:
    t = timing(ws, 2.5, answers, numeric=True)
    assert (t.keyword, t.keyword_s) == (keyword, keyword_s)


def test_keyword_labels_are_stripped() -> None:
    for reply in (
        "Keyword: Paris",
        "keyword - Paris.",
        "**Keyword:** Paris",
        "The answer is: 'Paris'",
        "Answer: Paris",
    ):
        assert parse_keyword(reply) == "Paris", reply
    assert parse_keyword("Response: Jane Austen") == "Jane Austen"
    assert parse_keyword("Keyword: NONE") is None
    assert parse_keyword("Answers differ") == "Answers differ"  # a word, not a label


def test_failed_judgements_are_asked_again(fake_chat_server) -> None:
    from cspan.bench.qa import QAItem, judge_item

    state = {"up": False}

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        if not state["up"]:
            return {"role": "assistant", "content": None}  # not text: the request fails
        if body["messages"][0]["content"] == KEYWORD_SYSTEM:
            return {"role": "assistant", "content": "Keyword: Paris"}
        return {"role": "assistant", "content": "The score is [Correct]"}

    server = fake_chat_server(reply)
    items = [QAItem(id=str(k), question="Capital of France?", answers=["Paris"]) for k in range(3)]

    judged = [
        QAItemResult(
            id=item.id,
            question=item.question,
            answers=item.answers,
            audio="x.wav",
            question_end_s=2.0,
            reference="Paris is the capital of France.",
            response="Well the capital of France is Paris.",
            words_source="asr",
            agent_words=PARIS,
        )
        for item in items
    ]
    with OpenAIJudge(server.url, "j", max_attempts=1, backoff_s=0) as judge:
        key = "j"
        judged = [judge_item(r, i, "llamaq", judge, key) for r, i in zip(judged, items, strict=True)]
        assert judge.down is not None and len(server.requests) == 2  # taken as down after two failures
    assert all(r.ref.judge_failed and r.resp.judge_failed and r.timing.judge_failed for r in judged)
    summary = summarize_qa("llamaq", judged)
    assert summary.metrics["resp_acc"] is None and summary.metrics["e2ekd_s"] is None
    # nothing rated is nothing measured, not 0 %: a dead judge is not the model's miss
    assert summary.metrics["ref_acc_all"] is None and summary.metrics["resp_acc_all"] is None
    assert "the judge rated none of the 3 spoken answer(s) it was asked: resp. accuracy not measured" in summary.notes
    assert not any("did the model emit <ret>" in n for n in summary.notes)
    assert any(n.startswith("the judge failed for 6 ref./resp. verdict(s) and 3 keyword(s)") for n in summary.notes)
    # the next run (same judge): everything that failed is asked again
    state["up"] = True
    with OpenAIJudge(server.url, "j", max_attempts=1, backoff_s=0) as judge:
        judged = [judge_item(r, i, "llamaq", judge, key) for r, i in zip(judged, items, strict=True)]
        asked = len(server.requests)
        assert asked == 2 + 3 * 3
        judged = [judge_item(r, i, "llamaq", judge, key) for r, i in zip(judged, items, strict=True)]
        assert len(server.requests) == asked  # nothing failed: nothing asked again
    m = summarize_qa("llamaq", judged).metrics
    assert (m["ref_acc"], m["resp_acc"], m["e2ekd_s"]) == (1.0, 1.0, 2.1)
    assert all(r.timing.keyword == "Paris" and not r.timing.judge_failed for r in judged)


def test_failures_recorded_before_the_flag_are_asked_again_too() -> None:
    from cspan.bench.qa import Verdict

    assert Verdict(correct=None, method="judge", explanation="judge failed: HTTP 500").judge_failed
    assert Verdict(correct=None, method="judge", explanation="unreadable judge reply: 'hm'").judge_failed
    assert not Verdict(correct=None, method="judge", explanation="empty text").judge_failed
    old = {"words_source": "asr", "question_end_s": 2.0, "note": "keyword judge failed: judge down"}
    assert AnswerTiming.model_validate(old).judge_failed
    assert not AnswerTiming.model_validate({**old, "note": "the judge found no answer in the response"}).judge_failed
