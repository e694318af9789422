"""`cspan bench qa`: spoken questions through the full loop, per-item judgements, accuracy; loaders and matching."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import soundfile as sf

from cspan.bench.errors import BenchDataError
from cspan.bench.judge import OpenAIJudge
from cspan.bench.qa import (
    QAItem,
    QAItemResult,
    Verdict,
    alias_match,
    llm_judge,
    load_qa_items,
    normalize_answer,
    numbers_in,
    parse_judgement,
    summarize_qa,
    synthesize_espeak,
)

QUESTIONS = [
    ("q1", "What is the capital of France?", "Paris"),
    ("q2", "Who wrote Pride and Prejudice?", ["Jane Austen", "Austen"]),
    ("q3", "What is the largest planet in the solar system?", "Jupiter"),
]
KNOWLEDGE = "Paris is the capital of France.\n\nJane Austen wrote Pride and Prejudice.\n\n" + (
    "Jupiter is the largest planet in the solar system.\n"
)

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng")


def _espeak(text: str, path: Path) -> None:
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "170", "-w", str(path), text], check=True, capture_output=True)


@needs_espeak
@pytest.mark.slow
def test_qa_run_judges_reference_and_answer_per_item(tiny_checkpoint_dir, tmp_path, cli, capsys) -> None:
    data = tmp_path / "halu"
    (data / "audios").mkdir(parents=True)
    (data / "meta.json").write_text(json.dumps([{"id": i, "text": q, "answer": a} for i, q, a in QUESTIONS]))
    for i, q, _ in QUESTIONS:
        _espeak(q, data / "audios" / f"{i}.wav")
    knowledge = tmp_path / "knowledge"
    knowledge.mkdir()
    (knowledge / "facts.md").write_text(KNOWLEDGE)
    out = tmp_path / "out"
    rc = cli(
        "bench", "qa", "--set", "halueval", "--data", str(data), "--out", str(out),
        "--checkpoint", str(tiny_checkpoint_dir), "--router", "local", "--knowledge", str(knowledge),
        "--asr", "none", "--question-source", "text", "--force-ret", "input-end",
        "--tail-s", "2.5", "--span-delay-s", "0.4", "--quiet",
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| halueval | 3 | 100.0 |" in printed

    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmark"] == "qa" and summary["task"] == "halueval" and summary["n"] == 3
    m = summary["metrics"]
    # the local router finds each answer in the notes, so every injected reference is right
    assert m["ref_acc"] == 1.0 and m["span_rate"] == 1.0 and m["ret_rate"] == 1.0
    assert summary["counts"]["ref_judged"] == 3 and summary["counts"]["with_span"] == 3
    assert summary["config"]["judge"] == "normalised alias match"
    samples = json.loads((out / "samples.json").read_text())
    assert [s["id"] for s in samples] == ["q1", "q2", "q3"]
    for s, (_, question, answer) in zip(samples, QUESTIONS, strict=True):
        gold = answer if isinstance(answer, str) else answer[0]
        assert s["routed_question"] == question
        assert gold.split()[-1] in s["reference"]
        assert s["ref"] == {
            "correct": True,
            "method": "alias",
            "explanation": s["ref"]["explanation"],
            "judge_failed": False,
        }
        assert s["resp"]["method"] == "alias" and s["resp"]["correct"] in (True, False, None)
        assert s["inj_lat_s"] > 0 and s["n_spans"] >= 1
        # the resp. verdict is the alias match of the model's text stream
        assert s["resp"]["correct"] == alias_match(s["response"], s["answers"]).correct
        result = QAItemResult.model_validate_json((out / s["id"] / "result.json").read_text())
        assert result.complete and any(e["type"] == "span" for e in result.events)
        info = sf.info(out / s["id"] / "output.wav")
        assert info.samplerate == 24000
        assert info.duration == pytest.approx(result.question_end_s + 2.5, abs=0.09)
    # the delays: without a transcriber the word times are the model's text stream
    assert summary["config"]["timing"] == {"words": "text", "keyword": "earliest gold alias in the response words"}
    for s in samples:
        result = QAItemResult.model_validate_json((out / s["id"] / "result.json").read_text())
        t = s["timing"]
        assert t["words_source"] == "text" and t["question_end_s"] == result.question_end_s
        spoken = [w for w in result.agent_words if w.start >= result.question_end_s]
        assert t["onset_s"] == (spoken[0].start if spoken else None)
        if t["e2ekd_s"] is not None:
            assert t["e2ekd_s"] == pytest.approx(t["ttfat_s"] + t["keyword_delay_s"], abs=1e-3)
    timed = [s["timing"]["ttfat_s"] for s in samples if s["timing"]["ttfat_s"] is not None]
    assert m["ttfat_all_s"] == (pytest.approx(sum(timed) / len(timed), abs=1e-3) if timed else None)
    keyed = [s["timing"] for s in samples if s["timing"]["e2ekd_s"] is not None]
    assert m["ttfat_s"] == (pytest.approx(sum(t["ttfat_s"] for t in keyed) / len(keyed), abs=1e-3) if keyed else None)
    if keyed:
        assert m["e2ekd_s"] == pytest.approx(m["ttfat_s"] + m["keyword_delay_s"], abs=1e-3)
    resp = [s["resp"]["correct"] for s in samples if s["resp"]["correct"] is not None]
    assert m["resp_acc"] == (sum(resp) / len(resp) if resp else None)
    assert m["resp_acc_all"] == pytest.approx(sum(resp) / 3)


# --- loaders -----------------------------------------------------------------------------------------------------


def test_loads_the_public_formats(tmp_path: Path) -> None:
    # the original system's meta.json + audios/<id>.wav
    meta = tmp_path / "meta"
    (meta / "audios").mkdir(parents=True)
    (meta / "meta.json").write_text(json.dumps([{"id": 7, "text": "Q?", "answer": "A", "knowledge": "K."}]))
    (meta / "audios" / "7.wav").write_bytes(b"")
    (item,) = load_qa_items(meta, "halueval")
    assert (item.id, item.question, item.answers, item.knowledge) == ("7", "Q?", ["A"], "K.")
    assert item.audio == meta / "audios" / "7.wav"

    # OpenAudioBench: eval_datas/trivia_qa/trivia_qa.csv + audios/<audio_filename>
    oab = tmp_path / "eval_datas" / "trivia_qa"
    (oab / "audios").mkdir(parents=True)
    (oab / "trivia_qa.csv").write_text(
        "audio_filename,Question,answer,aliases\n0.wav,Who painted the Mona Lisa?,Leonardo da Vinci,\"['Leonardo', 'da Vinci']\"\n"
    )
    (oab / "audios" / "0.wav").write_bytes(b"")
    (item,) = load_qa_items(tmp_path, "triviaqa")
    assert item.id == "0" and item.question == "Who painted the Mona Lisa?"
    assert item.answers == ["Leonardo da Vinci", "Leonardo", "da Vinci"] and item.audio == oab / "audios" / "0.wav"

    # HaluEval qa_data.json (JSON lines), GSM8K test.jsonl, SVAMP.json, AddSub.json, TriviaQA records
    halu = tmp_path / "halu"
    halu.mkdir()
    (halu / "qa_data.json").write_text(
        json.dumps({"knowledge": "K", "question": "Q1?", "right_answer": "R", "hallucinated_answer": "H"})
        + "\n"
        + json.dumps({"knowledge": "K2", "question": "Q2?", "right_answer": "R2", "hallucinated_answer": "H2"})
        + "\n"
    )
    items = load_qa_items(halu, "halueval")
    assert [(i.id, i.answers) for i in items] == [("0", ["R"]), ("1", ["R2"])] and items[0].audio is None
    gsm = tmp_path / "gsm"
    gsm.mkdir()
    (gsm / "test.jsonl").write_text(json.dumps({"question": "How many?", "answer": "3 + 4 = 7\n#### 1,007"}) + "\n")
    assert load_qa_items(gsm, "gsm8k")[0].answers == ["1007"]
    svamp = tmp_path / "svamp"
    svamp.mkdir()
    (svamp / "SVAMP.json").write_text(
        json.dumps([{"ID": "chal-1", "Body": "Jack had 8 pens.", "Question": "How many now?", "Answer": 5.0}])
    )
    (item,) = load_qa_items(svamp, "svamp")
    assert (item.id, item.question, item.answers) == ("chal-1", "Jack had 8 pens. How many now?", ["5"])
    addsub = tmp_path / "addsub"
    addsub.mkdir()
    (addsub / "AddSub.json").write_text(json.dumps([{"iIndex": 3, "sQuestion": "Sum?", "lSolutions": [2.5]}]))
    assert load_qa_items(addsub, "addsub")[0].answers == ["2.5"]
    trivia = tmp_path / "trivia"
    trivia.mkdir()
    (trivia / "triviaqa.jsonl").write_text(
        json.dumps({"question_id": "tc_1", "question": "Q?", "answer": {"value": "Paris", "aliases": ["Paree"]}})
    )
    assert load_qa_items(trivia, "triviaqa")[0].answers == ["Paris", "Paree"]


def test_loader_errors(tmp_path: Path) -> None:
    with pytest.raises(BenchDataError, match="--set"):
        load_qa_items(tmp_path, "mmlu")
    with pytest.raises(BenchDataError, match="no question file"):
        load_qa_items(tmp_path, "webq")
    (tmp_path / "meta.json").write_text(json.dumps([{"id": 1, "text": "Q", "answer": "A"}, {"id": 1, "text": "Q"}]))
    with pytest.raises(BenchDataError) as err:
        load_qa_items(tmp_path, "halueval")
    assert str(err.value) == f"{tmp_path / 'meta.json'}: record 1 has no question or no answer (fields: ['id', 'text'])"
    (tmp_path / "set.csv").write_text("question,answer\nQ?,\n")
    with pytest.raises(BenchDataError, match=rf"^{tmp_path / 'set.csv'}: record 0 has no question or no answer"):
        load_qa_items(tmp_path / "set.csv", "llamaq")
    (tmp_path / "meta.json").write_text(json.dumps([{"id": 1, "text": "Q", "answer": "A"}] * 2))
    with pytest.raises(BenchDataError, match="duplicate"):
        load_qa_items(tmp_path, "halueval")


def test_ids_that_share_an_output_folder_are_refused(tmp_path: Path) -> None:
    """Ids "q 1" and "q_1" both write OUT/q_1/: the second item was given the first's result.json, counted twice."""
    records = [{"id": "q 1", "question": "Q1", "answer": "A"}, {"id": "q_1", "question": "Q2", "answer": "B"}]
    (tmp_path / "meta.json").write_text(json.dumps(records))
    with pytest.raises(BenchDataError, match=r"'q 1' and 'q_1' share the output folder 'q_1'"):
        load_qa_items(tmp_path, "llamaq")


def test_a_record_without_an_answer_is_refused_naming_the_file(tmp_path: Path) -> None:
    """docs/BENCH.md: such records are "refused with the file and the record named"; the file was not named."""
    import os
    import sys

    (tmp_path / "myset").mkdir()
    (tmp_path / "myset" / "meta.json").write_text('[{"id":"q1","question":"a"}]')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CSPAN_")}
    done = subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", "bench", "qa", "--set", "halueval", "--data", "myset",
         "--checkpoint", "/nonexistent", "--out", "out"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        "cspan bench qa: error: myset/meta.json: record 'q1' has no question or no answer (fields: ['id', "
        "'question'])\n"
    )
    assert not (tmp_path / "out").exists()


@needs_espeak
def test_synthesize_espeak(tmp_path: Path) -> None:
    path = synthesize_espeak("What is two plus two?", tmp_path / "tts" / "x.wav")
    info = sf.info(path)
    assert info.channels == 1 and 0.5 < info.duration < 5


# --- matching ----------------------------------------------------------------------------------------------------


def test_normalize_folds_numbers_and_drops_articles() -> None:
    assert normalize_answer("The answer is Twenty-Five, not 1,000!") == ["answer", "is", "25", "not", "1000"]
    assert normalize_answer("one hundred and two point five") == ["102.5"]
    assert normalize_answer("one two") == ["1", "2"]
    assert normalize_answer("Café Müller & Sons") == ["cafe", "muller", "and", "sons"]
    assert numbers_in("about 3.5 apples and twelve pears") == [3.5, 12.0]


def test_alias_match() -> None:
    assert alias_match("I think it's Paris, the city of light", ["Paris"]).correct is True
    assert alias_match("parisian food", ["Paris"]).correct is False  # never a piece of a longer word
    assert alias_match("It's in newyork", ["New York"]).correct is True  # spaces removed, whole words
    assert alias_match("Jane wrote it", ["Jane Austen", "Austen"]).correct is False
    assert alias_match("", ["Paris"]).correct is None
    assert alias_match("the total is forty two dollars", ["42"], numeric=True).correct is True
    assert alias_match("she has 7.0 left", ["7"], numeric=True).correct is True
    assert alias_match("she has 8 left", ["7"], numeric=True).correct is False
    # a lone "one" before a word of waiting is no number
    assert alias_match("One moment. The answer is three.", ["1"], numeric=True).correct is False
    assert alias_match("One second... it is one.", ["1"], numeric=True).correct is True
    assert alias_match("one hundred", ["100"], numeric=True).correct is True
    assert numbers_in("one moment, one sec, one minute: one second makes one hundred") == [100.0]


def test_parse_judgement_styles() -> None:
    assert parse_judgement("correct_incorrect", "Analysis... the score is [Correct]") is True
    assert parse_judgement("correct_incorrect", "the score is [Incorrect]") is False
    assert parse_judgement("json", '```json\n{"analysis": "ok", "judgment": "correct"}\n```') is True
    assert parse_judgement("json", '{"analysis": "no", "judgment": "incorrect"}') is False
    assert parse_judgement("yes_no", "Yes. The answer 12 matches.") is True
    assert parse_judgement("yes_no", "No, it says 13.") is False
    assert parse_judgement("yes_no", "Maybe") is None


def test_llm_judge_against_an_openai_compatible_server(fake_chat_server) -> None:
    server = fake_chat_server(
        [
            {"role": "assistant", "content": "I cannot tell."},  # unreadable: asked again
            {"role": "assistant", "content": "It names the same city. The score is [Correct]"},
        ]
    )
    item = QAItem(id="1", question="What is the capital of France?", answers=["Paris"])
    with OpenAIJudge(server.url, "judge-model", max_attempts=3, backoff_s=0.01) as judge:
        verdict = llm_judge(judge, "correct_incorrect", item.question, item.answers, "It is Paris.")
        assert verdict.correct is True and verdict.method == "judge"
        assert llm_judge(judge, "correct_incorrect", item.question, item.answers, "  ").correct is None
    assert len(server.requests) == 2
    body = server.requests[0]
    assert body["model"] == "judge-model" and body["temperature"] == 0 and body["seed"] == 0
    user = body["messages"][-1]["content"]
    assert "What is the capital of France?" in user and "Paris" in user and "It is Paris." in user


def test_summary_counts_missing_answers_as_wrong_in_the_all_variants() -> None:
    def result(i: str, ref: bool | None, resp: bool | None, spans: int) -> QAItemResult:
        return QAItemResult(
            id=i,
            question="q",
            answers=["a"],
            audio="x.wav",
            question_end_s=1.0,
            ref=None if ref is None else Verdict(correct=ref, method="alias"),
            resp=Verdict(correct=resp, method="alias"),
            n_spans=spans,
            n_rets=1,
            ret_lat_s=0.5,
            inj_lat_s=1.0,
        )

    summary = summarize_qa(
        "llamaq", [result("1", True, True, 1), result("2", False, True, 1), result("3", None, None, 0)]
    )
    m = summary.metrics
    assert m["ref_acc"] == 0.5 and m["ref_acc_all"] == pytest.approx(1 / 3)
    assert m["resp_acc"] == 1.0 and m["resp_acc_all"] == pytest.approx(2 / 3)
    assert m["resp_given_ref"] == 1.0 and m["span_rate"] == pytest.approx(2 / 3) and m["ret_rate"] == 1.0
    assert m["ret_lat_s"] == 0.5 and m["inj_lat_s"] == 1.0
    failed = result("4", True, True, 1)
    failed.ref = Verdict(correct=None, method="judge", explanation="judge failed: HTTP 500", judge_failed=True)
    m = summarize_qa("llamaq", [result("1", True, True, 1), result("3", None, None, 0), failed]).metrics
    assert m["ref_acc_all"] == 0.5 and m["resp_acc_all"] == pytest.approx(2 / 3)  # an unrated item is left out
