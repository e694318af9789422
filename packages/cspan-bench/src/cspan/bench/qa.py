"""``cspan bench qa``: spoken question answering and spoken math through the full loop, judged as MoshiRAG does.

Sets (``docs/reference/benchmarks.md`` sections 3.3 and 4; ``docs/reference/context-spanning-original.md`` 7.1):
LlamaQuestions (``llamaq``), WebQuestions (``webq``), TriviaQA (``triviaqa``), HaluEval QA (``halueval``) and the
math sets AddSub, MultiArith, SingleEq, SVAMP and GSM8K. Each spoken question (plus a tail of silence, 14 s in the
original) is played through the loop (:func:`cspan.bench.session.render`): the model hears the question, emits
``<ret>``, the retriever (transcriber + router) produces a reference that is injected as a Context Span, and the
model answers. Two things are judged per item against the gold answers:

- **ref.**: the reference the router produced (the text of the injected spans); items without a span have no ref.
  verdict and are left out of ``ref_acc`` (``ref_acc_all`` counts them as wrong; an item the judge failed to rate
  is left out of both);
- **resp.**: the model's spoken answer, read from its text stream with the special tokens removed (as MoshiRAG's
  released evaluator and the original system judge it); an empty answer is left out of ``resp_acc`` and counts
  as wrong in ``resp_acc_all``.

Delays (:mod:`cspan.bench.qa_timing`): MoshiRAG's time to first answer token (TTFAT), keyword delay (KD) and
end-to-end keyword delay (E2EKD) of each answer, from word timestamps of the agent channel (a transcription of
``output.wav`` when a transcriber is configured, else the model's text stream; ``--timing-words``).

Judges: an OpenAI-compatible chat model (:class:`cspan.bench.judge.OpenAIJudge`) with one prompt style per set,
after MoshiRAG's released judges: "[Correct] / [Incorrect]" for LlamaQ and HaluEval, a JSON ``judgment`` for
TriviaQA and WebQ, "Yes / No" with numerical equivalence for math. The prompt texts here are this project's
wording, not the released ones, so LLM-judged numbers are comparable in kind, not digit for digit. Without a judge,
:func:`alias_match` decides: normalised text (lower case, accents, punctuation and articles removed, spoken
numbers folded to digits) must contain one of the answer aliases as a whole-word sequence (or consecutive whole
words that spell it with the spaces removed, "newyork" for "new york"); for math, a number in the answer must equal
the gold number.

Data comes from local files in the public datasets' formats (:func:`load_qa_items`): the original system's
``meta.json`` + ``audios/<id>.wav`` (HaluEvalAudio, math), OpenAudioBench's ``<set>.csv`` + ``audios/``, and the
raw public files (HaluEval ``qa_data.json``, ``AddSub.json`` / ``MultiArith.json`` / SingleEq ``questions.json``,
``SVAMP.json``, GSM8K ``test.jsonl``, WebQuestions and TriviaQA JSON/JSONL) with the audio as
``audios/<id>.wav``; missing audio can be synthesised with espeak-ng (``--tts espeak-ng``).
"""

from __future__ import annotations

import ast
import csv
import json
import logging
import math
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from cspan.bench.answer_text import normalize_answer, numbers_in
from cspan.bench.errors import BenchDataError, BenchError, BenchSettingsError, JudgeError
from cspan.bench.qa_timing import PROMPT_VERSION as KEYWORD_PROMPT_VERSION
from cspan.bench.qa_timing import AnswerTiming, TimedWord, measure, text_stream_words
from cspan.bench.resume import RenderedAgain

log = logging.getLogger(__name__)

MATH_SETS = ("addsub", "multiarith", "singleeq", "svamp", "gsm8k")
KNOWLEDGE_SETS = ("llamaq", "webq", "triviaqa", "halueval")
QA_SETS = KNOWLEDGE_SETS + MATH_SETS
"""The ``--set`` names."""

OPENAUDIOBENCH_NAMES = {"llamaq": "llama_questions", "webq": "web_questions", "triviaqa": "trivia_qa"}
"""OpenAudioBench's folder names (``eval_datas/<name>/<name>.csv``)."""

JUDGE_STYLES = {
    "llamaq": "correct_incorrect",
    "halueval": "correct_incorrect",
    "triviaqa": "json",
    "webq": "json",
    **{name: "yes_no" for name in MATH_SETS},
}
"""Which judge prompt each set uses (after MoshiRAG's released evaluator, section 3.3)."""

QA_PROMPT = (
    "You are a wise and friendly teacher. Answer questions or provide advice in a clear and engaging way. "
    "The user speaks first. Listen to the whole question and answer it. Do not open with a greeting."
)
"""The persona of the spoken-QA runs (the original system's QA persona, without its capability sentence)."""
DEFAULT_TAIL_S = 14.0
"""Seconds of silence after each question (the original's ``TAIL_S``)."""

AUDIO_DIRS = ("audios", "audio", "wavs", "wav")
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")


# --- items -------------------------------------------------------------------------------------------------------


class QAItem(BaseModel):
    """One spoken question.

    Attributes:
        id: the dataset's id (or the row index).
        question: the question text.
        answers: the gold answer and its aliases (first = the gold answer).
        audio: the spoken question (any rate, mono or stereo), or None when not found.
        knowledge: HaluEval's knowledge passage, when given.
    """

    id: str
    question: str
    answers: list[str]
    audio: Path | None = None
    knowledge: str | None = None


def _format_number(value: float) -> str:
    if math.isfinite(value) and float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


def _as_list(value: Any) -> list[str]:
    """Answer field -> list of strings: lists, Python-list strings ("['a', 'b']"), numbers, plain strings."""
    if value is None:
        return []
    if isinstance(value, bool):
        return [str(value)]
    if isinstance(value, int | float):
        return [_format_number(float(value))]
    if isinstance(value, list | tuple):
        out: list[str] = []
        for v in value:
            out.extend(_as_list(v))
        return out
    if isinstance(value, dict):
        out = _as_list(value.get("value") or value.get("answer") or value.get("text"))
        for key in ("aliases", "normalized_aliases", "normalized_value"):
            out.extend(_as_list(value.get(key)))
        return out
    text = str(value).strip()
    if text.startswith("[") and text.endswith("]"):
        try:
            return _as_list(ast.literal_eval(text))
        except (ValueError, SyntaxError):
            pass
    return [text] if text else []


def _gsm8k_answer(text: str) -> str:
    """GSM8K's answer field ends with ``#### <number>``; return the number (commas removed)."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    return text.strip()


def _dedupe(values: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for v in values:
        key = v.strip()
        if key and key.lower() not in seen:
            seen.add(key.lower())
            out.append(key)
    return out


_ID_KEYS = ("id", "ID", "iIndex", "question_id", "qid", "index", "uid")
_QUESTION_KEYS = ("question", "text", "sQuestion", "Question", "instruction", "prompt", "query")
_ANSWER_KEYS = ("answers", "answer", "right_answer", "lSolutions", "Answer", "gold", "gold_answer", "label")


def item_from_record(record: Mapping[str, Any], index: int, set_name: str, *, source: Path | None = None) -> QAItem:
    """Normalise one record of any supported format into a :class:`QAItem` (no audio yet).

    Args:
        source: the file the record comes from, named in the error.

    Raises:
        BenchDataError: no question or no answer in the record (``FILE: record 'ID' ...`` with ``source``).
    """
    rid = next((record[k] for k in _ID_KEYS if record.get(k) not in (None, "")), index)
    if "Body" in record and "Question" in record:  # SVAMP: the body sets the scene, the question asks
        question = f"{str(record['Body']).strip()} {str(record['Question']).strip()}"
    else:
        question = next((str(record[k]) for k in _QUESTION_KEYS if record.get(k)), "")
    answers: list[str] = []
    for key in _ANSWER_KEYS:
        if record.get(key) not in (None, ""):
            raw = record[key]
            if set_name == "gsm8k" and isinstance(raw, str):
                raw = _gsm8k_answer(raw)
            answers = _as_list(raw)
            break
    answers.extend(_as_list(record.get("aliases")))
    answers = _dedupe(answers)
    if not question.strip() or not answers:
        where = f"{source}: " if source is not None else ""
        raise BenchDataError(f"{where}record {rid!r} has no question or no answer (fields: {sorted(record)[:12]})")
    knowledge = record.get("knowledge")
    return QAItem(
        id=str(rid),
        question=" ".join(question.split()),
        answers=answers,
        knowledge=str(knowledge) if knowledge else None,
    )


def _read_records(path: Path) -> list[dict[str, Any]]:
    """JSON list / ``{"data"|"questions"|"items": [...]}`` / JSON lines / CSV -> list of dicts."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchDataError(f"{path} is not readable ({exc})") from exc
    if path.suffix.lower() == ".csv":
        return [dict(row) for row in csv.DictReader(text.splitlines())]
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise BenchDataError(f"{path}:{n} is neither JSON nor JSON lines ({exc.msg})") from exc
        return records
    if isinstance(data, dict):
        for key in ("data", "questions", "items", "examples", "test"):
            if isinstance(data.get(key), list):
                return data[key]
        return [data]
    if not isinstance(data, list):
        raise BenchDataError(f"{path}: expected a list of records")
    return data


def _csv_columns(header: Sequence[str]) -> tuple[str | None, str | None, list[str], str | None]:
    """(question, answer, alias columns, audio) of an OpenAudioBench-style CSV (the original's rule: the question
    column is the first starting with question/prompt/text/instruction/query, the answer the first containing
    answer or gold)."""
    lower = {h: h.lower().strip() for h in header}
    question = next(
        (h for h in header if lower[h].startswith(("question", "prompt", "text", "instruction", "query"))), None
    )
    answer = next((h for h in header if "answer" in lower[h] or "gold" in lower[h]), None)
    aliases = [h for h in header if "alias" in lower[h] and h != answer]
    audio = next((h for h in header if "audio" in lower[h] or "wav" in lower[h] or lower[h] in ("file", "path")), None)
    return question, answer, aliases, audio


def _csv_items(path: Path, set_name: str) -> list[tuple[QAItem, str | None]]:
    rows = _read_records(path)
    if not rows:
        return []
    q_col, a_col, alias_cols, audio_col = _csv_columns(list(rows[0]))
    if q_col is None or a_col is None:
        raise BenchDataError(
            f"{path}: cannot find the question column (question/prompt/text/instruction/query...) and the answer "
            f"column (containing 'answer' or 'gold') among {list(rows[0])}"
        )
    out = []
    for index, row in enumerate(rows):
        record: dict[str, Any] = {"question": row.get(q_col), "answer": row.get(a_col)}
        record["aliases"] = [a for c in alias_cols for a in _as_list(row.get(c))]
        rid = next((row[k] for k in _ID_KEYS if row.get(k)), None)
        audio_name = row.get(audio_col) if audio_col else None
        record["id"] = rid if rid is not None else (Path(audio_name).stem if audio_name else index)
        out.append((item_from_record(record, index, set_name, source=path), audio_name))
    return out


def _find_data_file(data: Path, set_name: str) -> Path:
    if data.is_file():
        return data
    if not data.is_dir():
        raise BenchDataError(f"--data {data} does not exist")
    oab = OPENAUDIOBENCH_NAMES.get(set_name)
    candidates = [data / "meta.json"]
    if oab:
        candidates += [data / f"{oab}.csv", data / oab / f"{oab}.csv", data / "eval_datas" / oab / f"{oab}.csv"]
    candidates += [
        data / f"{set_name}.json",
        data / f"{set_name}.jsonl",
        data / f"{set_name}.csv",
        data / "qa_data.json",
        data / "test.jsonl",
        data / "questions.json",
    ]
    for name in ("AddSub", "MultiArith", "SingleEq", "SVAMP", "GSM8K"):
        if name.lower() == set_name:
            candidates += [data / f"{name}.json", data / name / f"{name}.json", data / name / "questions.json"]
    for c in candidates:
        if c.is_file():
            return c
    found = sorted(p for p in data.iterdir() if p.is_file() and p.suffix.lower() in (".json", ".jsonl", ".csv"))
    if len(found) == 1:
        return found[0]
    raise BenchDataError(
        f"--data {data}: no question file for set {set_name!r}; expected meta.json, an OpenAudioBench CSV, or the "
        f"public file (e.g. qa_data.json, AddSub.json, SVAMP.json, test.jsonl); found {[p.name for p in found]}"
    )


def _audio_for(folder: Path, item_id: str, audio_name: str | None = None) -> Path | None:
    names: list[str] = []
    if audio_name:
        names.append(audio_name)
    names += [f"{item_id}{suffix}" for suffix in AUDIO_SUFFIXES]
    for base in [folder, *(folder / d for d in AUDIO_DIRS)]:
        for name in names:
            p = base / name
            if p.is_file():
                return p
    return None


def load_qa_items(data: Path, set_name: str, *, limit: int | None = None) -> list[QAItem]:
    """Read the questions of ``set_name`` from ``data`` (a folder or a file), with their audio where found.

    Raises:
        BenchDataError: unknown set, no question file, malformed records, duplicate ids.
    """
    if set_name not in QA_SETS:
        raise BenchDataError(f"--set {set_name!r}: use one of {', '.join(QA_SETS)}")
    path = _find_data_file(data, set_name)
    folder = path.parent
    items: list[QAItem] = []
    if path.suffix.lower() == ".csv":
        for item, audio_name in _csv_items(path, set_name):
            item.audio = _audio_for(folder, item.id, audio_name)
            items.append(item)
    else:
        for index, record in enumerate(_read_records(path)):
            if not isinstance(record, Mapping):
                raise BenchDataError(f"{path}: record {index} is not an object")
            item = item_from_record(record, index, set_name, source=path)
            item.audio = _audio_for(folder, item.id, record.get("audio") or record.get("audio_filename"))
            items.append(item)
    ids = [i.id for i in items]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise BenchDataError(f"{path}: duplicate item ids {dup}")
    folders: dict[str, str] = {}
    for item_id in ids:  # OUT/{folder}/result.json of one item would be taken as another's
        other = folders.setdefault(_safe(item_id), item_id)
        if other != item_id:
            raise BenchDataError(
                f"{path}: item ids {other!r} and {item_id!r} share the output folder {_safe(item_id)!r} (characters "
                "other than letters, digits, '_', '.' and '-' become '_'); give them ids that differ there"
            )
    return items[:limit] if limit is not None else items


def check_qa_audio(items: Sequence[QAItem], tts: str | None) -> None:
    """Every item's question audio readable, or synthesisable with ``tts``, before the first item renders (a missing
    one found halfway used to stop a run after the items before it).

    Raises:
        BenchError: a ``tts`` other than espeak-ng. BenchDataError: items without audio (and no ``tts``), audio
            files that cannot be read (:func:`cspan.bench.session.check_audio_inputs`).
    """
    from cspan.bench.session import check_audio_inputs

    if tts and tts != "espeak-ng":
        raise BenchError(f"--tts {tts!r}: only espeak-ng is supported")
    unvoiced = [item.id for item in items if item.audio is None]
    if unvoiced and not tts:
        more = f" (and {len(unvoiced) - 5} more)" if len(unvoiced) > 5 else ""
        raise BenchDataError(
            f"{len(unvoiced)} of {len(items)} item(s) have no audio: {unvoiced[:5]}{more}; put audios/<id>.wav beside "
            "the question file, or pass --tts espeak-ng to synthesise them (nothing was rendered)"
        )
    check_audio_inputs([item.audio for item in items if item.audio is not None], "question audio")


def synthesize_espeak(text: str, path: Path, *, voice: str = "en-us", wpm: int = 150) -> Path:
    """Speak ``text`` with espeak-ng into a WAV file (espeak-ng's 22.05 kHz mono) and return its path.

    Raises:
        BenchError: espeak-ng is not installed or failed.
    """
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise BenchError("--tts espeak-ng: espeak-ng is not installed (apt-get install espeak-ng)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part.wav")
    try:
        subprocess.run([exe, "-v", voice, "-s", str(wpm), "-w", str(tmp), text], check=True, capture_output=True)
    except subprocess.CalledProcessError as exc:
        raise BenchError(f"espeak-ng failed on {text[:60]!r}: {exc.stderr.decode(errors='replace')[:200]}") from exc
    tmp.replace(path)
    return path


# --- answer matching ---------------------------------------------------------------------------------------------


def _contains(hay: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return n > 0 and any(hay[i : i + n] == needle for i in range(len(hay) - n + 1))


class Verdict(BaseModel):
    """One judgement: ``correct`` (None = not judgeable: empty text or a failed judge), how, and why.
    ``judge_failed``: the judge could not be asked or gave no readable reply (asked again on the next run)."""

    correct: bool | None
    method: str
    explanation: str = ""
    judge_failed: bool = False

    def model_post_init(self, context: Any, /) -> None:
        # records written before ``judge_failed`` existed say it in their explanation
        if self.correct is None and self.explanation.startswith(("judge failed:", "unreadable judge reply:")):
            self.judge_failed = True


def alias_match(text: str, answers: Sequence[str], *, numeric: bool = False) -> Verdict:
    """Normalised alias match (see the module docstring). Empty ``text`` gives ``correct=None``.

    For ``numeric`` sets the first gold answer is read as a number and any number in ``text`` within a relative
    1e-4 (or equal after rounding both to 2 decimals) is correct; otherwise the aliases are matched as text.
    """
    tokens = normalize_answer(text)
    if not tokens:
        return Verdict(correct=None, method="alias", explanation="empty text")
    if numeric:
        gold = numbers_in(answers[0]) if answers else []
        if gold:
            g = gold[-1]
            for x in numbers_in(text):
                if math.isclose(x, g, rel_tol=1e-4, abs_tol=1e-9) or round(x, 2) == round(g, 2):
                    return Verdict(correct=True, method="numeric", explanation=f"found {_format_number(x)}")
            return Verdict(correct=False, method="numeric", explanation=f"no number equal to {_format_number(g)}")
    for alias in answers:
        want = normalize_answer(alias)
        if not want:
            continue
        if _contains(tokens, want):
            return Verdict(correct=True, method="alias", explanation=f"contains {alias!r}")
        joined = "".join(want)
        if len(joined) >= 4 and _joins_to(tokens, joined):
            return Verdict(correct=True, method="alias", explanation=f"contains {alias!r} (spaces removed)")
    return Verdict(correct=False, method="alias", explanation="no alias found")


def _joins_to(tokens: list[str], target: str) -> bool:
    """Whether consecutive whole tokens concatenate to ``target`` ("new york" ~ "newyork", never a piece of a
    longer word)."""
    for i in range(len(tokens)):
        acc = ""
        for tok in tokens[i:]:
            acc += tok
            if acc == target:
                return True
            if not target.startswith(acc):
                break
    return False


# --- LLM judges --------------------------------------------------------------------------------------------------

_JUDGE_SYSTEM = "You grade answers to quiz questions. Be strict about facts and lenient about wording."

_PROMPTS = {
    "correct_incorrect": (
        "Question: {question}\nGold answer(s): {answers}\nAnswer to grade: {response}\n\n"
        "Does the answer to grade state the same core fact as a gold answer? Ignore extra words, fillers and "
        "spoken-style phrasing; an answer that hedges between several options or contradicts the gold answer is "
        "incorrect. Finish with exactly one of: the score is [Correct] / the score is [Incorrect]."
    ),
    "json": (
        "Question: {question}\nGold answer(s): {answers}\nAnswer to grade: {response}\n\n"
        "Decide whether the answer to grade gives a gold answer (or an equivalent alias). Reply with ONLY a JSON "
        'object: {{"analysis": "<one sentence>", "judgment": "correct" or "incorrect"}}'
    ),
    "yes_no": (
        "Math question: {question}\nCorrect answer: {answers}\nModel's answer: {response}\n\n"
        "Does the model's answer contain the correct final answer? Numerically equivalent forms count (for example "
        "5, 5.0 and five). Reply with Yes or No first, then at most one sentence."
    ),
}


def parse_judgement(style: str, reply: str) -> bool | None:
    """The verdict in a judge reply of ``style`` (None when it cannot be read)."""
    from cspan.bench.judge import strip_code_fences

    text = reply.strip()
    if style == "correct_incorrect":
        found = re.findall(r"\[\s*(correct|incorrect)\s*\]", text, re.I)
        if found:
            return found[-1].lower() == "correct"
        words = re.findall(r"\b(correct|incorrect)\b", text, re.I)
        return words[-1].lower() == "correct" if words else None
    if style == "json":
        try:
            data = json.loads(strip_code_fences(text))
            value = str(data.get("judgment", data.get("judgement", ""))).strip().lower()
            if value in ("correct", "incorrect"):
                return value == "correct"
        except (json.JSONDecodeError, AttributeError):
            pass
        m = re.search(r'"?judge?ment"?\s*:\s*"?(correct|incorrect)', text, re.I)
        return m.group(1).lower() == "correct" if m else None
    m = re.match(r"\W*(yes|no)\b", text, re.I)
    return m.group(1).lower() == "yes" if m else None


def llm_judge(judge: Any, style: str, question: str, answers: Sequence[str], response: str) -> Verdict:
    """Ask ``judge`` (an :class:`~cspan.bench.judge.OpenAIJudge`) whether ``response`` answers ``question``.

    Temperature 0, seed 0; an unreadable reply is asked again up to ``judge.max_attempts`` times. Empty
    ``response`` -> ``correct=None`` without a request. A failed judge (or no readable reply) gives ``correct=None``
    with the error and ``judge_failed``.
    """
    if not response.strip():
        return Verdict(correct=None, method="judge", explanation="empty text")
    from cspan.bench.judge import count_judgement

    prompt = _PROMPTS[style].format(question=question, answers=" | ".join(answers), response=response.strip())
    messages = [{"role": "system", "content": _JUDGE_SYSTEM}, {"role": "user", "content": prompt}]
    reply = ""
    try:
        for _ in range(max(1, int(getattr(judge, "max_attempts", 1)))):
            reply = judge.chat(messages, seed=0, temperature=0, max_tokens=256)
            verdict = parse_judgement(style, reply)
            if verdict is not None:
                count_judgement(judge, True)
                return Verdict(correct=verdict, method="judge", explanation=reply.strip()[:300])
    except JudgeError as exc:
        return Verdict(correct=None, method="judge", explanation=f"judge failed: {exc}", judge_failed=True)
    count_judgement(judge, False)
    return Verdict(
        correct=None,
        method="judge",
        explanation=f"unreadable judge reply: {reply.strip()[:200]!r}",
        judge_failed=True,
    )


def judge_text(judge: Any, set_name: str, item: QAItem, text: str) -> Verdict:
    """``text`` against ``item``'s answers: the LLM judge when one is given, else :func:`alias_match`."""
    if judge is not None:
        return llm_judge(judge, JUDGE_STYLES[set_name], item.question, item.answers, text)
    return alias_match(text, item.answers, numeric=set_name in MATH_SETS)


# --- results -----------------------------------------------------------------------------------------------------


class QAItemResult(BaseModel):
    """Everything about one item (``OUT/{id}/result.json``)."""

    id: str
    question: str
    answers: list[str]
    audio: str
    question_end_s: float
    reference: str = Field(default="", description="text of the injected Context Span(s), joined by ' / '")
    response: str = Field(default="", description="the model's text stream, special tokens removed")
    routed_question: str | None = None
    ret_s: float | None = Field(default=None, description="first <ret> (emitted or forced), seconds")
    span_s: float | None = Field(default=None, description="first span injection, seconds")
    n_spans: int = 0
    n_rets: int = 0
    ret_lat_s: float | None = Field(default=None, description="first <ret> minus question end")
    inj_lat_s: float | None = Field(default=None, description="first span injection minus its <ret>")
    ref: Verdict | None = None
    resp: Verdict | None = None
    words_source: str | None = Field(default=None, description="'asr' (output.wav transcribed) or 'text' (stream)")
    agent_words: list[TimedWord] = Field(default_factory=list, description="the agent channel's timed words")
    timing: AnswerTiming | None = None
    seed: int = 0
    settings_key: str = ""
    judge_key: str = ""
    complete: bool = False
    events: list[dict[str, Any]] = Field(default_factory=list)


class QASummary(BaseModel):
    """``summary.json`` of one set (the report lists it as a generic benchmark summary).

    ``metrics``: ``ref_acc`` (over items with a span), ``resp_acc`` (over items that answered), ``ref_acc_all`` and
    ``resp_acc_all`` (over all items, missing = wrong), ``resp_given_ref`` (resp. over items whose ref. was
    correct), ``span_rate``, ``ret_rate``, ``ret_lat_s`` and ``inj_lat_s`` (means over items that have them);
    MoshiRAG's delays ``ttfat_s``, ``keyword_delay_s`` and ``e2ekd_s`` (means over the same items, those whose
    keyword was found in the words, so that E2EKD = TTFAT + KD up to rounding; seconds, 3 decimals),
    ``ttfat_all_s`` (TTFAT over every item whose agent spoke after the question), ``keyword_found_rate`` (of the
    items that spoke). ``notes`` say what a metric was computed from when items are missing.
    """

    benchmark: str = "qa"
    task: str
    n: int
    metrics: dict[str, float | None]
    counts: dict[str, int] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)
    config: dict[str, Any] = Field(default_factory=dict)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _mean3(values: Sequence[float | None]) -> float | None:
    """Mean of delays (seconds, already rounded to 3 decimals per item), rounded to 3."""
    mean = _mean([float(v) for v in values if v is not None])
    return None if mean is None else round(mean, 3)


def summarize_qa(set_name: str, results: Sequence[QAItemResult]) -> QASummary:
    """Aggregate per-item results into :class:`QASummary` (accuracies in [0, 1])."""
    n = len(results)
    refs = [r.ref.correct for r in results if r.ref is not None and r.ref.correct is not None]
    resps = [r.resp.correct for r in results if r.resp is not None and r.resp.correct is not None]
    ref_ok = [r for r in results if r.ref is not None and r.ref.correct]
    given = [r.resp.correct for r in ref_ok if r.resp is not None and r.resp.correct is not None]
    timings = [r.timing for r in results if r.timing is not None]
    spoke = [t for t in timings if t.ttfat_s is not None]
    keyed = [t for t in spoke if t.e2ekd_s is not None and t.keyword_delay_s is not None]
    ref_failed = sum(r.ref is not None and r.ref.judge_failed for r in results)
    resp_failed = sum(r.resp is not None and r.resp.judge_failed for r in results)
    failed_verdicts = ref_failed + resp_failed
    failed_keywords = sum(t.judge_failed for t in timings)
    # "all": over every item, one without a reference (answer) counted wrong; one the judge could not rate is not
    # the model's miss: it is left out, and with none rated the accuracy is not measured (None), not 0
    ref_rated, resp_rated = n - ref_failed, n - resp_failed
    metrics: dict[str, float | None] = {
        "ref_acc": _mean([float(x) for x in refs]),
        "resp_acc": _mean([float(x) for x in resps]),
        "ref_acc_all": sum(refs) / ref_rated if ref_rated else None,
        "resp_acc_all": sum(resps) / resp_rated if resp_rated else None,
        "resp_given_ref": _mean([float(x) for x in given]),
        "span_rate": sum(r.n_spans > 0 for r in results) / n if n else None,
        "ret_rate": sum(r.n_rets > 0 for r in results) / n if n else None,
        "ret_lat_s": _mean([r.ret_lat_s for r in results if r.ret_lat_s is not None]),
        "inj_lat_s": _mean([r.inj_lat_s for r in results if r.inj_lat_s is not None]),
        "ttfat_s": _mean3([t.ttfat_s for t in keyed]),
        "keyword_delay_s": _mean3([t.keyword_delay_s for t in keyed]),
        "e2ekd_s": _mean3([t.e2ekd_s for t in keyed]),
        "ttfat_all_s": _mean3([t.ttfat_s for t in spoke]),
        "keyword_found_rate": len(keyed) / len(spoke) if spoke else None,
    }
    notes = []
    if n and not refs and ref_failed:
        notes.append(f"the judge rated none of the {ref_failed} reference(s) it was asked: ref. accuracy not measured")
    elif n and not refs:
        notes.append("no item got a judgeable reference: ref. accuracy undefined (did the model emit <ret>?)")
    if n and not resps and resp_failed:
        notes.append(
            f"the judge rated none of the {resp_failed} spoken answer(s) it was asked: resp. accuracy not measured"
        )
    elif n and not resps:
        notes.append("no item got a judgeable spoken answer: resp. accuracy undefined")
    if failed_verdicts or failed_keywords:
        notes.append(
            f"the judge failed for {failed_verdicts} ref./resp. verdict(s) and {failed_keywords} keyword(s): left out "
            "of the accuracies and delays, asked again on the next run"
        )
    if len(timings) < n:
        notes.append(f"{n - len(timings)} of {n} item(s) have no word times: no delays")
    if len(spoke) < len(timings):
        notes.append(f"{len(timings) - len(spoke)} of {len(timings)} item(s): no agent words after the question")
    if spoke and len(keyed) < len(spoke):
        notes.append(
            f"TTFAT, KD and E2EKD over the {len(keyed)} of {len(spoke)} answer(s) whose keyword was found in the "
            f"words (ttfat_all_s: TTFAT over all {len(spoke)})"
        )
    return QASummary(
        task=set_name,
        n=n,
        metrics=metrics,
        counts={
            "ref_judged": len(refs),
            "ref_correct": sum(refs),
            "resp_judged": len(resps),
            "resp_correct": sum(resps),
            "with_span": sum(r.n_spans > 0 for r in results),
            "with_ret": sum(r.n_rets > 0 for r in results),
            "spoke_after_question": len(spoke),
            "keyword_found": len(keyed),
        },
        notes=notes,
    )


def qa_table(summaries: Sequence[QASummary]) -> str:
    """Markdown: one row per set, ref. and resp. accuracy in percent (as MoshiRAG's and the original's tables) and
    MoshiRAG's delays in seconds."""

    def pct(v: float | None) -> str:
        return "–" if v is None else f"{100 * v:.1f}"

    def sec(v: float | None) -> str:
        return "–" if v is None else f"{v:.2f}"

    lines = [
        "| Set | n | ref. (%) | resp. (%) | resp. all (%) | P(resp. \\| ref.) (%) | span rate | <ret> rate | "
        "TTFAT (s) | KD (s) | E2EKD (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        m = s.metrics
        lines.append(
            f"| {s.task} | {s.n} | {pct(m.get('ref_acc'))} | {pct(m.get('resp_acc'))} | {pct(m.get('resp_acc_all'))} | "
            f"{pct(m.get('resp_given_ref'))} | {pct(m.get('span_rate'))} | {pct(m.get('ret_rate'))} | "
            f"{sec(m.get('ttfat_s'))} | {sec(m.get('keyword_delay_s'))} | {sec(m.get('e2ekd_s'))} |"
        )
    return "\n".join(lines)


# --- the run -----------------------------------------------------------------------------------------------------


@dataclass
class QARunOptions:
    """How to run a set.

    Attributes:
        set_name: one of :data:`QA_SETS`.
        text_prompt: persona (default :data:`QA_PROMPT`).
        seed: base seed (item seed = :func:`~cspan.bench.session.seed_for` of the id).
        tail_s: silence after each question.
        question_source: ``"asr"`` (what the loop heard) or ``"text"`` (the dataset's question is routed).
        force_ret: seconds after the question's end at which a ``<ret>`` is forced (empty: the model's own only).
        realtime: live clock.
        config: the :class:`~cspan.core.runtime.ConversationConfig`.
        tts: ``"espeak-ng"`` to synthesise missing question audio into ``OUT/tts/``; None: missing audio is an
            error.
        timing_words: where the delays' word times come from: ``"asr"`` (transcribe ``output.wav``), ``"text"``
            (the model's text stream) or ``"auto"`` (``asr`` when a transcriber is configured, else ``text``).
        overwrite, quiet: re-render everything; no progress bar.
        describe: settings recorded in each result and part of the resume key.
        rendered_again: the finished items this run renders again because their settings differ.
    """

    set_name: str
    text_prompt: str | None = None
    seed: int = 42424242
    tail_s: float = DEFAULT_TAIL_S
    question_source: str = "asr"
    force_ret: Sequence[float] = ()
    realtime: bool = False
    config: Any = None
    tts: str | None = None
    timing_words: str = "auto"
    overwrite: bool = False
    quiet: bool = False
    describe: dict[str, Any] = field(default_factory=dict)
    rendered_again: RenderedAgain = field(default_factory=lambda: RenderedAgain("qa"))


def _first(events: Iterable[Any], kind: str) -> Any:
    return next((e for e in events if getattr(e, "type", None) == kind), None)


async def run_item(
    session: Any,
    item: QAItem,
    out_dir: Path,
    options: QARunOptions,
    *,
    transcriber: Any = None,
    retriever: Any = None,
) -> QAItemResult:
    """Render one question (``out_dir/output.wav``, the agent at 24 kHz on the question's timeline) and return its
    unjudged result (resumed from ``out_dir/result.json`` when it finished with the same settings)."""
    from cspan.bench.session import FixedQuestionRetriever, read_pcm, render, seed_for, settings_key, write_wav
    from cspan.core.constants import SAMPLE_RATE

    settings = {
        "set": options.set_name,
        "prompt": options.text_prompt or QA_PROMPT,
        "seed": options.seed,
        "tail_s": options.tail_s,
        "question_source": options.question_source,
        "force_ret": list(options.force_ret),
        "realtime": options.realtime,
        **options.describe,
    }
    key = settings_key(settings)
    record = out_dir / "result.json"
    if not options.overwrite and record.is_file() and (out_dir / "output.wav").is_file():
        try:
            old = QAItemResult.model_validate_json(record.read_text(encoding="utf-8"))
            if old.complete and old.settings_key == key:
                return old
            if old.complete:  # its record keeps the key only: which settings differed is not known
                options.rendered_again.found(out_dir, None, settings)
        except ValueError:
            pass
    if item.audio is None:
        raise BenchDataError(f"item {item.id}: no audio found (audios/{item.id}.wav); pass --tts espeak-ng")
    pcm, _ = read_pcm(item.audio, SAMPLE_RATE)
    question_end = pcm.shape[0] / SAMPLE_RATE
    if options.question_source == "text" and retriever is not None:
        retriever = FixedQuestionRetriever(retriever, item.question)
    seed = seed_for(options.seed, f"{options.set_name}/{item.id}")
    rendered = await render(
        session,
        pcm,
        text_prompt=options.text_prompt or QA_PROMPT,
        seed=seed,
        tail_s=options.tail_s,
        transcriber=transcriber,
        retriever=retriever,
        config=options.config,
        conversation_id=f"qa/{options.set_name}/{item.id}",
        force_ret_s=[question_end + t for t in options.force_ret],
        realtime=options.realtime,
    )
    write_wav(out_dir / "output.wav", rendered.output_pcm(offset_frames=1), SAMPLE_RATE)
    spans = rendered.spans()
    rets = rendered.rets()
    ret = rets[0] if rets else None
    span = spans[0] if spans else None
    question_ev = _first(rendered.events, "question")
    inj_lat = None
    if span is not None and span.ret_frame is not None:
        inj_lat = span.injected_at - span.ret_frame * 0.08
    return QAItemResult(
        id=item.id,
        question=item.question,
        answers=item.answers,
        audio=str(item.audio),
        question_end_s=question_end,
        reference=" / ".join(s.text for s in spans),
        response=rendered.agent_text,
        routed_question=question_ev.text if question_ev is not None else None,
        ret_s=ret.t if ret is not None else None,
        span_s=span.injected_at if span is not None else None,
        n_spans=len(spans),
        n_rets=len(rets),
        ret_lat_s=(ret.t - question_end) if ret is not None else None,
        inj_lat_s=inj_lat,
        seed=seed,
        settings_key=key,
        complete=True,
        events=rendered.events_json(),
    )


def timing_source(setting: str, transcriber: Any) -> str:
    """``--timing-words`` -> ``"asr"`` or ``"text"`` (``auto``: ``asr`` when there is a transcriber).

    Raises:
        BenchSettingsError: ``asr`` without a transcriber, or an unknown setting (exit status 2).
    """
    if setting == "auto":
        return "asr" if transcriber is not None else "text"
    if setting == "asr" and transcriber is None:
        raise BenchSettingsError("--timing-words asr needs a transcriber (--asr sphinx or a server URL)")
    if setting not in ("asr", "text"):
        raise BenchSettingsError(f"--timing-words {setting!r}: use auto, asr or text")
    return setting


async def agent_channel_words(result: QAItemResult, out_dir: Path, source: str, transcriber: Any) -> list[TimedWord]:
    """The agent's timed words of one item: ``output.wav`` transcribed (``asr``, word times as heard) or the text
    stream of its events (``text``). A failed transcription gives no words (logged)."""
    if source == "text":
        return text_stream_words(result.events)
    from cspan.bench.session import read_pcm
    from cspan.bench.transcribe import transcribe_pcm

    try:
        pcm, rate = read_pcm(out_dir / "output.wav")
        output = await transcribe_pcm(transcriber, pcm, rate)
    except BenchError as exc:
        log.warning("item %s: transcribing output.wav failed: %s", result.id, exc)
        return []
    return [TimedWord(text=c.text, start=c.timestamp[0], end=c.timestamp[1]) for c in output.chunks]


def _unjudged(verdict: Verdict | None, text: str) -> bool:
    return bool(text.strip()) and (verdict is None or verdict.judge_failed)


def judge_item(result: QAItemResult, item: QAItem, set_name: str, judge: Any, judge_key: str) -> QAItemResult:
    """Fill ``ref``, ``resp`` and the delays ``timing``. Each is kept when already judged with the same
    ``judge_key``, and judged again when the judge changed, when it failed last time (``judge_failed``), or (the
    timing) when the agent's words changed (``timing`` was reset)."""
    same = result.judge_key == judge_key
    if not same or _unjudged(result.ref, result.reference):
        result.ref = judge_text(judge, set_name, item, result.reference) if result.reference.strip() else None
    if not same or result.resp is None or result.resp.judge_failed:
        result.resp = judge_text(judge, set_name, item, result.response)
    if result.words_source is not None and (result.timing is None or not same or result.timing.judge_failed):
        result.timing = measure(
            result.agent_words,
            result.question_end_s,
            question=item.question,
            answers=item.answers,
            numeric=set_name in MATH_SETS,
            judge=judge,
            words_source=result.words_source,
        )
    result.judge_key = judge_key
    return result


async def run_qa(
    session: Any,
    items: Sequence[QAItem],
    out: Path,
    options: QARunOptions,
    *,
    transcriber: Any = None,
    retriever: Any = None,
    judge: Any = None,
) -> tuple[QASummary, list[QAItemResult]]:
    """Render, judge and summarise every item; writes ``OUT/{id}/result.json`` + ``output.wav``,
    ``OUT/samples.json``, ``OUT/summary.json`` and ``OUT/summary.md``.

    Raises:
        BenchDataError: an item without audio (and no ``tts``).
        BenchError: the synthesiser failed.
    """
    from cspan.bench.session import Progress, write_json

    check_qa_audio(items, options.tts)
    judge_key = json.dumps(judge.describe(), sort_keys=True) if judge is not None else "alias"
    source = timing_source(options.timing_words, transcriber)
    results: list[QAItemResult] = []
    with Progress(len(items), f"qa {options.set_name}", quiet=options.quiet) as bar:
        for item in items:
            if item.audio is None and options.tts:
                item.audio = synthesize_espeak(item.question, out / "tts" / f"{_safe(item.id)}.wav")
            item_dir = out / _safe(item.id)
            result = await run_item(session, item, item_dir, options, transcriber=transcriber, retriever=retriever)
            if result.words_source != source:
                result.agent_words = await agent_channel_words(result, item_dir, source, transcriber)
                result.words_source, result.timing = source, None
            result = judge_item(result, item, options.set_name, judge, judge_key)
            write_json(item_dir / "result.json", result.model_dump(mode="json"))
            results.append(result)
            bar.update()
    summary = summarize_qa(options.set_name, results)
    summary.config = {
        "judge": judge.describe() if judge is not None else "normalised alias match",
        "judge_style": JUDGE_STYLES[options.set_name] if judge is not None else None,
        "timing": {
            "words": source,
            "keyword": (
                {**judge.describe(), "prompt_version": KEYWORD_PROMPT_VERSION}
                if judge is not None
                else "earliest gold alias in the response words"
            ),
        },
        **options.describe,
        "question_source": options.question_source,
        "tail_s": options.tail_s,
        "force_ret": list(options.force_ret),
    }
    trouble = judge.trouble() if judge is not None and hasattr(judge, "trouble") else None
    if trouble is not None:
        summary.notes.append(trouble)
    again = options.rendered_again.note()
    if again is not None:
        summary.notes.append(again)
    write_json(out / "summary.json", summary.model_dump(mode="json"))
    samples = [r.model_dump(mode="json", exclude={"events", "agent_words"}) for r in results]
    write_json(out / "samples.json", samples)
    (out / "summary.md").write_text(f"# Spoken QA: {options.set_name}\n\n{qa_table([summary])}\n", encoding="utf-8")
    return summary, results


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _safe(name: str) -> str:
    return _UNSAFE.sub("_", name) or "_"
