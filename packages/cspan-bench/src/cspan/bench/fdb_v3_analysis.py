"""Full-Duplex-Bench v3 analysis of the spoken response: filler sentence and the onset of the key information.

The benchmark's ``v3/analyze_tool_latency.py`` (arXiv 2604.04847, Table 2; read through a public copy, see
``docs/BENCH.md``) computes per result, from ``user_speech_end_rel``, the agent's word-timed ASR ``asr_chunks`` and
the ``actual_tool_calls``:

- ``turn_take_success`` = the agent said any word (``asr_chunks`` non-empty);
- ``first_response_latency_s`` = first word start - user speech end (rounded to 3);
- ``tool_call_latency_s`` = first tool call ``timestamp_start`` - user speech end (rounded to 3);
- with an LLM judge (``gpt-4o``, temperature 0), the **filler sentence** (speech that only acknowledges or stalls
  while the tool runs: "let me check that for you") and the **key-information sentence** (the words that answer
  the request or confirm the action), and ``task_completion_latency_s`` = key information start - user speech end.

A result without ``user_speech_end_rel`` is not analysed (the reference skips it too). The per-result record is
written next to the result as ``latency_tool_analysis_{provider}.json`` with the reference's field names, so
:func:`cspan.bench.fdb_v3.score_results` and the benchmark's own aggregation read the same files.

The agent's words are checked before anything is asked: every chunk needs a text and finite ``[start, end]`` with
``end >= start``; words are put in time order; a word that starts before ``audio_agent_speech_start`` (the
benchmark's first-word time) contradicts it. A result that fails a check is not analysed (a note names the file
and the chunk); the others go on.

Differences from the reference, on purpose:

- the prompt is this project's wording (:data:`PROMPT_VERSION` names it) and is sent to any OpenAI-compatible
  server (:class:`cspan.bench.judge.OpenAIJudge`); the judge model and prompt version are recorded per record;
- the judge marks the filler and the key information by **word index** in the numbered, timed word list instead of
  copying times, and the times are read from the word timestamps: a judge cannot invent a time, and a reply that
  names no valid words is asked again (up to the judge's ``max_attempts``) and then recorded as not analysed;
- each record keeps a hash of the inputs it was computed from (``result_key``), so a re-rendered result is
  analysed again instead of reusing a stale record. Records without it (the benchmark's own files) are reused;
- a record of ours that has no analysis although the agent spoke (the judge failed, or the word times were bad)
  is analysed again on the next run with a judge instead of being reused; an existing file that does not parse is
  kept as ``*.unreadable.json`` before a new record is written in its place.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cspan.bench.errors import BenchDataError, JudgeError
from cspan.bench.fdb_v3 import ResultEntry, V3Result, first_response_latency, tool_call_latency
from cspan.bench.seconds import Seconds, finite_or_none

log = logging.getLogger(__name__)

PROMPT_VERSION = "cspan-fdb-v3-key-info/1"
"""Names the wording of :data:`SYSTEM_PROMPT` and the reply format; recorded in every analysis."""
ANALYSIS_FILE = "latency_tool_analysis_{provider}.json"
"""The per-result record, next to ``result_{provider}.json`` (the reference's name)."""
REPORT_FILE = "key_info_analysis.json"
"""All records of one scoring, next to ``summary.json``."""
MAX_TOKENS = 300

SYSTEM_PROMPT = """You annotate the spoken reply of a voice assistant that can call tools.

The user asked for something and stopped talking at USER_SPEECH_END (seconds). The assistant may have called \
tools; each call is listed with the time it was made. The reply is given word by word as
  INDEX  START-END  WORD
with times in seconds on the same clock.

Replies to tool requests usually have two parts:
1. an optional filler: words that only acknowledge the request or fill the wait while the tool runs, such as \
"Sure, one second" or "Let me look that up for you";
2. the key information: the words the user is actually waiting for, the result of the request or the \
confirmation that the action was done, such as "The cheapest flight leaves at 9 a.m. for 420 dollars" or \
"Your autopay now draws from checking".

Mark both parts by word index. Reply with one JSON object and nothing else:
{"filler": {"first": INDEX, "last": INDEX} or null, "key_info": {"first": INDEX, "last": INDEX} or null}

- filler: the filler words spoken before the key information; null when the reply starts with the key \
information.
- key_info: from the first to the last word of the key information; null when the reply never gives it (for \
example it only asks a question, refuses, or stops early).
- Use the indices exactly as listed; the filler must end before the key information starts."""
"""System message of the key-information judge (:data:`PROMPT_VERSION`)."""


class JudgeRecord(BaseModel):
    """Which judge produced an analysis: server URL, model and :data:`PROMPT_VERSION`."""

    url: str
    model: str
    prompt_version: str


class LatencyAnalysis(BaseModel):
    """The analysis of one result (``latency_tool_analysis_{provider}.json``; the reference's field names).

    Times are seconds on the input's timeline (a non-finite time reads as missing). ``filler_sentence``: ``None`` =
    not analysed (no judge, no speech, the judge failed or the word times were bad), ``""`` = analysed and no filler,
    text = the filler words. ``task_completion_latency_s`` is ``None`` when the key information was not found.
    Only ``example_id`` is required, so that the benchmark's own records (which may lack fields this project
    writes) are read as they are.
    """

    model_config = ConfigDict(extra="allow")

    example_id: str
    provider: str | None = None
    user_speech_end_rel: Seconds = None
    turn_take_success: bool | None = None
    first_response_latency_s: Seconds = None
    agent_first_word_time: Seconds = None
    tool_call_latency_s: Seconds = None
    first_tool_call_time: Seconds = None
    first_tool_name: str | None = None
    filler_sentence: str | None = None
    filler_start_time: Seconds = None
    filler_end_time: Seconds = None
    key_info_sentence: str | None = None
    key_info_start_time: Seconds = None
    key_info_end_time: Seconds = None
    task_completion_latency_s: Seconds = None
    notes: list[str] = Field(default_factory=list)
    judge: JudgeRecord | None = None
    result_key: str | None = None

    @property
    def unfinished(self) -> bool:
        """The agent spoke but there is no filler / key-information analysis (the judge failed, or bad times)."""
        return bool(self.turn_take_success) and self.filler_sentence is None


# --- the judge's input and reply -----------------------------------------------------------------------------------


class _Word(BaseModel):
    text: str
    start: float
    end: float


def agent_words(result: V3Result) -> list[_Word]:
    """The agent's words of ``result`` (``asr_chunks``: ``[{text, timestamp: [start, end]}]``) in time order.

    Raises:
        BenchDataError: a chunk without text or finite ``[start, end]`` (``end >= start``), or a word that starts
            before ``audio_agent_speech_start``; the message names the chunk.
    """
    words = []
    for n, chunk in enumerate(result.asr_chunks):
        try:
            start, end = chunk["timestamp"]
            text = chunk["text"]
        except (KeyError, TypeError, ValueError) as exc:
            raise BenchDataError(f"asr_chunks[{n}] is not {{text, timestamp: [start, end]}}: {chunk!r:.120}") from exc
        start, end = finite_or_none(start), finite_or_none(end)
        if start is None or end is None or end < start:
            raise BenchDataError(f"asr_chunks[{n}] has no finite [start, end] with end >= start: {chunk!r:.120}")
        words.append(_Word(text=str(text).strip(), start=start, end=end))
    words.sort(key=lambda w: (w.start, w.end))  # stable: simultaneous words keep their order
    speech_start = result.audio_agent_speech_start
    if words and speech_start is not None and words[0].start < speech_start - 1e-6:
        raise BenchDataError(
            f"the word {words[0].text!r} starts at {words[0].start:.3f} s, before audio_agent_speech_start "
            f"{speech_start:.3f} s (the first word's start)"
        )
    return words


def user_message(user_end: float, words: Sequence[_Word], tool_calls: Sequence[Mapping[str, Any]]) -> str:
    """The judge's user message: user speech end, the tool calls with their times, the numbered timed words."""
    lines = [f"USER_SPEECH_END: {user_end:.3f}", "", "TOOL_CALLS:"]
    calls = [
        f"- {_time(c.get('timestamp_start'))} {c.get('function', '?')} {json.dumps(c.get('args', {}), ensure_ascii=False)}"
        for c in tool_calls
    ]
    lines += calls or ["(none)"]
    lines += ["", "REPLY_WORDS:"]
    lines += [f"{i}  {w.start:.2f}-{w.end:.2f}  {w.text}" for i, w in enumerate(words)]
    return "\n".join(lines)


def _time(value: Any) -> str:
    return f"{float(value):.3f}" if isinstance(value, int | float) and not isinstance(value, bool) else "?"


class Marks(BaseModel):
    """The judge's reply: ``(first, last)`` word indices of the filler and of the key information (or None)."""

    filler: tuple[int, int] | None
    key_info: tuple[int, int] | None


def _span(value: Any, n: int, name: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        value = (value.get("first"), value.get("last"))
    if not (isinstance(value, list | tuple) and len(value) == 2):
        raise ValueError(f"{name} is not {{first, last}}")
    first, last = value
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (first, last)):
        raise ValueError(f"{name} indices are not integers")
    if not 0 <= first <= last < n:
        raise ValueError(f"{name} indices {first}..{last} are outside 0..{n - 1}")
    return int(first), int(last)


def parse_marks(reply: str, n_words: int) -> Marks:
    """Parse the judge's JSON reply against a reply of ``n_words`` words.

    Raises:
        ValueError: not one JSON object with valid ``filler`` / ``key_info`` index ranges, or the filler does not end
            before the key information.
    """
    text = reply.strip()  # a fenced or prefixed reply is fine: the object is read between its braces
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError("no JSON object in the reply")
    try:
        data = json.loads(text[start : end + 1])
    except json.JSONDecodeError as exc:
        raise ValueError(f"reply is not JSON ({exc.msg})") from exc
    if not isinstance(data, Mapping) or "key_info" not in data:
        raise ValueError("reply has no 'key_info'")
    filler = _span(data.get("filler"), n_words, "filler")
    key = _span(data.get("key_info"), n_words, "key_info")
    if filler is not None and key is not None and filler[1] >= key[0]:
        raise ValueError(f"filler {filler} does not end before key_info {key}")
    return Marks(filler=filler, key_info=key)


def ask_marks(judge: Any, user_end: float, words: Sequence[_Word], tool_calls: Sequence[Mapping[str, Any]]) -> Marks:
    """Ask ``judge`` (an :class:`~cspan.bench.judge.OpenAIJudge`) to mark the filler and key information.

    Temperature 0; a reply that does not parse is asked again up to ``judge.max_attempts`` times.

    Raises:
        JudgeError: the request failed, or no reply parsed.
    """
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user_message(user_end, words, tool_calls)},
    ]
    from cspan.bench.judge import count_judgement

    attempts = max(1, int(getattr(judge, "max_attempts", 1)))
    last = ""
    for attempt in range(1, attempts + 1):
        reply = judge.chat(messages, temperature=0, max_tokens=MAX_TOKENS)
        try:
            marks = parse_marks(reply, len(words))
        except ValueError as exc:
            last = f"{exc}: {reply.strip()[:200]!r}"
            if attempt < attempts:
                log.warning("key-information judge: unusable reply (%s); asking again", last)
            continue
        count_judgement(judge, True)
        return marks
    count_judgement(judge, False)
    raise JudgeError(f"the key-information judge gave no usable reply in {attempts} tries: {last}")


# --- one result ----------------------------------------------------------------------------------------------------


def result_key(result: V3Result) -> str:
    """A short hash of what the analysis reads (user speech end, the agent's words, the tool calls)."""
    blob = json.dumps(
        [result.user_speech_end_rel, result.asr_chunks, [c.model_dump() for c in result.actual_tool_calls]],
        sort_keys=True,
        default=str,
    ).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


def judge_record(judge: Any) -> JudgeRecord:
    """The :class:`JudgeRecord` of ``judge`` (its ``describe()`` and :data:`PROMPT_VERSION`)."""
    described = judge.describe()
    return JudgeRecord(
        url=str(described.get("url", "")), model=str(described.get("model", "")), prompt_version=PROMPT_VERSION
    )


def analyze(
    result: V3Result, judge: Any | None, provider: str | None = None, source: str = ""
) -> LatencyAnalysis | None:
    """Analyse one result; ``None`` when it has no ``user_speech_end_rel`` (nothing to measure from).

    Without ``judge`` only the timing fields are filled. A failed judge, or word times that fail the checks of
    :func:`agent_words` (``source`` names the file in the note), leave the filler and key information unset with a
    note (the sample then counts in neither the filler rate nor the task-completion latency).
    """
    user_end = result.user_speech_end_rel
    if user_end is None:
        return None
    calls = [c.model_dump() for c in result.actual_tool_calls]
    first_tool = calls[0] if calls else None
    analysis = LatencyAnalysis(
        example_id=result.example_id,
        provider=provider,
        user_speech_end_rel=user_end,
        turn_take_success=bool(result.asr_chunks),
        first_response_latency_s=first_response_latency(result) if result.asr_chunks else None,
        tool_call_latency_s=tool_call_latency(result),
        first_tool_call_time=finite_or_none((first_tool or {}).get("timestamp_start")),
        first_tool_name=(first_tool or {}).get("function"),
        judge=judge_record(judge) if judge is not None else None,
        result_key=result_key(result),
    )
    try:
        words = agent_words(result)
    except BenchDataError as exc:
        where = f"{source or 'result'} ({result.example_id})"
        analysis.notes.append(f"bad word times in {where}: {exc}; not analysed")
        return analysis
    analysis.agent_first_word_time = words[0].start if words else None
    if not words:
        analysis.notes.append("no agent words: nothing to analyse")
        return analysis
    if judge is None:
        analysis.notes.append("no judge: filler and key information not analysed")
        return analysis
    try:
        marks = ask_marks(judge, user_end, words, calls)
    except JudgeError as exc:
        analysis.notes.append(f"judge failed: {exc}")
        return analysis
    if marks.filler is None:
        analysis.filler_sentence = ""
    else:
        first, last = marks.filler
        analysis.filler_sentence = " ".join(w.text for w in words[first : last + 1])
        analysis.filler_start_time, analysis.filler_end_time = words[first].start, words[last].end
    if marks.key_info is None:
        analysis.notes.append("the judge found no key information in the reply")
    else:
        first, last = marks.key_info
        analysis.key_info_sentence = " ".join(w.text for w in words[first : last + 1])
        analysis.key_info_start_time, analysis.key_info_end_time = words[first].start, words[last].end
        analysis.task_completion_latency_s = round(words[first].start - user_end, 3)
    return analysis


def apply(result: V3Result, analysis: LatencyAnalysis | None) -> V3Result:
    """``result`` with the analysis's filler and key-information fields (what the scorer reads)."""
    if analysis is None or analysis.filler_sentence is None:
        return result
    return result.model_copy(
        update={
            "filler_sentence": analysis.filler_sentence,
            "key_info_start_s": analysis.key_info_start_time,
            "task_completion_latency_s": analysis.task_completion_latency_s,
        }
    )


# --- files ---------------------------------------------------------------------------------------------------------


def analysis_path(result_path: Path) -> Path:
    """``.../result_{provider}.json`` -> ``.../latency_tool_analysis_{provider}.json``."""
    provider = _provider_of(result_path)
    return result_path.with_name(ANALYSIS_FILE.format(provider=provider))


def _provider_of(result_path: Path) -> str:
    stem = result_path.stem
    return stem[len("result_") :] if stem.startswith("result_") else stem


def _read_existing(path: Path) -> LatencyAnalysis | str:
    """The record in ``path``, or why it cannot be read."""
    try:
        return LatencyAnalysis.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, ValidationError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def _reusable(old: LatencyAnalysis, result: V3Result, judge: Any | None) -> bool:
    if old.result_key is not None and old.result_key != result_key(result):
        return False  # the result changed since (re-rendered)
    if judge is None or old.judge is None:
        return True  # nothing to compare with, or the benchmark's own record
    return old.judge == judge_record(judge) and not old.unfinished  # a failed analysis is asked again


def _keep_aside(path: Path) -> Path:
    """Rename an unreadable record to ``{stem}.unreadable.json`` (``.unreadable-2.json``, ... when taken)."""
    target = path.with_name(f"{path.stem}.unreadable.json")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.stem}.unreadable-{n}.json")
    path.rename(target)
    return target


class AnalysisRun(BaseModel):
    """What :func:`analyze_entries` did, per result: ``analysed`` (sent to the judge now), ``reused`` (an existing
    record), ``silent`` (the agent said nothing: analysed without asking the judge), ``skipped`` (no user speech
    end), ``unfinished`` (records, new or reused, without a filler / key-information analysis although the agent
    spoke: asked again on the next run), ``kept_aside`` (unreadable files renamed ``*.unreadable.json``)."""

    judge: JudgeRecord | None
    analysed: int = 0
    reused: int = 0
    silent: int = 0
    skipped: int = 0
    unfinished: int = 0
    kept_aside: list[str] = Field(default_factory=list)

    def line(self) -> str:
        """One line for the console."""
        parts = [f"{self.analysed} analysed", f"{self.reused} reused"]
        if self.silent:
            parts.append(f"{self.silent} silent (nothing to ask)")
        if self.skipped:
            parts.append(f"{self.skipped} without user_speech_end_rel")
        parts.append(f"{self.unfinished} without a usable analysis")
        text = ", ".join(parts)
        if self.kept_aside:
            text += f"; unreadable record(s) kept as {', '.join(self.kept_aside)}"
        return text


def analyze_entries(
    entries: Sequence[ResultEntry], judge: Any | None, *, reanalyze: bool = False
) -> tuple[list[V3Result], list[LatencyAnalysis], AnalysisRun]:
    """Analyse every result (or reuse its ``latency_tool_analysis_*.json``) and return the results with the
    analysis applied, the analyses and counts.

    A record next to a result is reused unless ``reanalyze``, the result changed since, it was made by another
    judge or prompt version than ``judge``, or it is one of ours without an analysis although the agent spoke (the
    judge failed: asked again). The benchmark's own records (no ``judge`` stamp) are always reused. New records are
    written next to their result file (results read from a combined file have none: their analyses are only
    returned); an existing file that does not parse is renamed ``*.unreadable.json`` first. Without ``judge``
    existing records are still read and nothing is written.
    """
    from cspan.bench.session import write_json

    run = AnalysisRun(judge=judge_record(judge) if judge is not None else None)
    results: list[V3Result] = []
    analyses: list[LatencyAnalysis] = []
    for path, result in entries:
        target = analysis_path(path) if path is not None else None
        provider = _provider_of(path) if path is not None else None
        analysis = None
        unreadable = None
        if target is not None and target.is_file():
            old = _read_existing(target)
            if isinstance(old, str):
                unreadable = old
                log.warning("%s is not an analysis record (%s)", target, old)
            elif not reanalyze and _reusable(old, result, judge):
                analysis = old
                run.reused += 1
        if analysis is None and judge is not None:
            analysis = analyze(result, judge, provider, str(path) if path is not None else "")
            if analysis is None:
                run.skipped += 1
            else:
                if analysis.turn_take_success:
                    run.analysed += 1
                else:
                    run.silent += 1
                if target is not None:
                    if unreadable is not None:
                        run.kept_aside.append(str(_keep_aside(target)))
                    write_json(target, analysis.model_dump(mode="json"))
        if analysis is not None:
            run.unfinished += int(analysis.unfinished)
            analyses.append(analysis)
        results.append(apply(result, analysis))
    return results, analyses, run


def write_report(analyses: Sequence[LatencyAnalysis], run: AnalysisRun, out_dir: Path) -> Path:
    """Write ``{out_dir}/key_info_analysis.json``: the judge, the counts and every record."""
    from cspan.bench.session import write_json

    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"run": run.model_dump(mode="json"), "per_scenario": [a.model_dump(mode="json") for a in analyses]}
    return write_json(out_dir / REPORT_FILE, payload)
