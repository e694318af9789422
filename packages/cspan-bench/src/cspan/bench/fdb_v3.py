"""Full-Duplex-Bench v3 scorers (tool use under disfluency), as pure functions over the benchmark's result format.

Definitions follow ``docs/reference/benchmarks.md`` section 2.2, which reads the v3 scorer code
(``v3/evaluate_tool_calls.py``, ``v3/evaluate_pass_rate.py`` of the Full-Duplex-Bench repository, and the paper's
Table 2 definitions, arXiv 2604.04847):

- **turn taken** = the transcript is non-empty or there are ASR chunks; take-turn rate = taken / all;
- **tool selection** = F1 over the multisets of function names (greedy multiset intersection; recall 1 when no call
  is expected, precision 1 when none was made; F1 0 when both are 0), rounded to 3 decimals per sample;
- **argument accuracy** = for each expected call in order, the first not-yet-used actual call with the same name
  (FIFO) is judged correct or not; a missing call scores 0; mean over expected calls (1.0 when none expected),
  rounded to 3;
- **pass** = the name multisets match exactly and every expected call's arguments are correct; pass rate over all
  samples, rounded to 3, with breakdowns by domain, difficulty, number of tools, disfluency feature and rollback;
- headline tool-selection / argument / response-quality means are over **turn-taken** samples (``*_all`` over all);
- **first-response latency** = ``audio_agent_speech_start - user_speech_end_rel`` (rounded to 3); negative =
  interruption; interruption rate = interrupted / turn-taken samples with timing; response latency = mean over
  turn-taken, non-interrupted samples;
- **tool-call latency** = ``actual_tool_calls[0].timestamp_start - user_speech_end_rel`` (rounded to 3), mean over
  turn-taken, non-interrupted samples that called a tool (``analyze_tool_latency.py``);
- **task-completion latency** = user speech end -> onset of the key information (per sample, given as
  ``task_completion_latency_s`` or ``key_info_start_s``; :mod:`cspan.bench.fdb_v3_analysis` produces them with an
  LLM judge), mean over turn-taken, non-interrupted samples;
- **filler rate** = turn-taken non-interrupted samples whose response opens with a filler sentence / turn-taken
  non-interrupted samples whose filler analysis is present (``filler_sentence`` not ``None``), as
  ``analyze_tool_latency.py`` prints it ("with filler / (with + without)").

Argument matching without a judge: every expected key must be present; ``$``-prefixed expected values (dynamic
references such as ``$RESULT_0.flights[0].flight_id``) match anything; strings compare after lower-casing,
stripping and ``_`` -> space (the reference's exact-match fallback); numbers (or numeric strings) match within a
relative tolerance (default 5 %, the judge prompt's rule; ``numeric_tolerance=0`` gives the reference's fallback).
With a judge (:class:`JudgeArgumentMatcher`), a failed judge call falls back to that rule, as in the reference.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cspan.bench.errors import BenchDataError, JudgeError
from cspan.bench.seconds import Seconds, finite_or_none

DEFAULT_NUMERIC_TOLERANCE = 0.05
"""Relative tolerance for numeric arguments (the judge prompt's "±5 %")."""

MOCK_TOOLS = (
    "search_flights",
    "book_flight",
    "update_identity_doc",
    "get_card_benefits",
    "get_exchange_rate",
    "modify_autopay",
    "search_apartments",
    "calculate_commute",
    "update_search_filter",
    "track_order",
    "search_products",
    "add_to_cart",
)
"""The 12 mock tools of v3 (travel, finance, housing, e-commerce; three each)."""


# --- input models --------------------------------------------------------------------------------------------------


class ToolCall(BaseModel):
    """One tool call: ``{"function": name, "args": {...}}`` (extra fields such as ``timestamp_start`` are kept)."""

    model_config = ConfigDict(extra="allow")

    function: str
    args: dict[str, Any] = Field(default_factory=dict)


class V3Scenario(BaseModel):
    """One scenario of ``benchmark_data_v2.json`` ``scenarios[]``."""

    model_config = ConfigDict(extra="allow")

    id: str
    domain: str = "unknown"
    difficulty: str | int = "unknown"
    title: str = ""
    dialogue: list[dict[str, Any]] = Field(default_factory=list)
    expected_tool_calls: list[ToolCall] = Field(default_factory=list)
    disfluency_features: list[str] = Field(default_factory=list)
    state_rollback_test: bool = False

    def expected_intent(self) -> str:
        """The last ``ai`` line of the dialogue: what the response-quality judge compares against."""
        return str(self.dialogue[-1].get("ai", "")) if self.dialogue else ""


class V3Result(BaseModel):
    """One ``result_{provider}.json`` of a v3 run.

    Times are seconds on the input's timeline (a NaN or infinite time reads as missing). ``first_response_latency_s``
    overrides the latency computed from ``audio_agent_speech_start - user_speech_end_rel``;
    ``task_completion_latency_s`` overrides ``key_info_start_s - user_speech_end_rel``. ``filler_sentence``: ``None``
    = not analysed, ``""`` = analysed and no filler, text = the filler sentence found before the key information.
    """

    model_config = ConfigDict(extra="allow")

    example_id: str
    actual_tool_calls: list[ToolCall] = Field(default_factory=list)
    transcript: str = ""
    asr_chunks: list[Any] = Field(default_factory=list)
    input_asr_chunks: list[Any] = Field(default_factory=list)
    user_speech_end_rel: Seconds = None
    audio_agent_speech_start: Seconds = None
    first_response_latency_s: Seconds = None
    key_info_start_s: Seconds = None
    task_completion_latency_s: Seconds = None
    filler_sentence: str | None = None


# --- per-sample metrics --------------------------------------------------------------------------------------------


class ToolSelection(BaseModel):
    """Tool-selection F1 of one sample and its parts (``score``, ``recall``, ``precision`` rounded to 3)."""

    score: float
    recall: float
    precision: float
    matched: int
    total_expected: int
    total_actual: int
    unmatched_expected: list[str]
    unexpected_calls: list[str]


def tool_selection(expected: Sequence[ToolCall], actual: Sequence[ToolCall]) -> ToolSelection:
    """F1 of recall and precision over the multisets of function names (greedy multiset intersection)."""
    remaining_actual = [c.function for c in actual]
    unmatched = []
    matched = 0
    for call in expected:
        if call.function in remaining_actual:
            remaining_actual.remove(call.function)
            matched += 1
        else:
            unmatched.append(call.function)
    recall = matched / len(expected) if expected else 1.0
    precision = matched / len(actual) if actual else 1.0
    f1 = 2 * recall * precision / (recall + precision) if recall + precision > 0 else 0.0
    return ToolSelection(
        score=round(f1, 3),
        recall=round(recall, 3),
        precision=round(precision, 3),
        matched=matched,
        total_expected=len(expected),
        total_actual=len(actual),
        unmatched_expected=unmatched,
        unexpected_calls=remaining_actual,
    )


class ArgumentVerdict(BaseModel):
    """Whether one call's arguments are right, how that was decided (``exact`` or ``judge``) and why."""

    correct: bool
    explanation: str = ""
    method: str = "exact"


ArgumentMatcher = Callable[[str, Mapping[str, Any], Mapping[str, Any]], ArgumentVerdict]
"""``(function, expected_args, actual_args) -> ArgumentVerdict``."""

_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def _as_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str):
        text = value.strip().replace(",", "")
        if _NUMBER.match(text):
            return float(text)
    return None


def _normalize(value: Any) -> Any:
    if isinstance(value, str):
        return value.lower().strip().replace("_", " ")
    if isinstance(value, list | tuple):
        return [_normalize(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalize(v) for k, v in value.items()}
    return value


def values_match(expected: Any, actual: Any, *, numeric_tolerance: float = DEFAULT_NUMERIC_TOLERANCE) -> bool:
    """One argument value: ``$``-references match anything; numbers within ``numeric_tolerance`` (relative to the
    expected value; exact when it is 0); otherwise equality after lower-case/strip/``_`` -> space."""
    if isinstance(expected, str) and expected.startswith("$"):
        return True
    if numeric_tolerance > 0:
        e, a = _as_number(expected), _as_number(actual)
        if e is not None and a is not None:
            return a == e if e == 0 else abs(a - e) <= numeric_tolerance * abs(e)
    return _normalize(expected) == _normalize(actual)


def exact_match_arguments(
    function: str,
    expected: Mapping[str, Any],
    actual: Mapping[str, Any],
    *,
    numeric_tolerance: float = DEFAULT_NUMERIC_TOLERANCE,
) -> ArgumentVerdict:
    """The judge-free argument rule (see the module docstring). ``function`` is unused but keeps the matcher shape."""
    del function
    for key, exp in expected.items():
        if key not in actual:
            return ArgumentVerdict(correct=False, explanation=f"missing argument: {key}")
        if not values_match(exp, actual[key], numeric_tolerance=numeric_tolerance):
            return ArgumentVerdict(
                correct=False, explanation=f"mismatch {key!r}: expected={exp!r}, got={actual[key]!r}"
            )
    return ArgumentVerdict(correct=True, explanation="all arguments match")


class ExactArgumentMatcher:
    """:func:`exact_match_arguments` with a fixed numeric tolerance, as an :data:`ArgumentMatcher`."""

    def __init__(self, numeric_tolerance: float = DEFAULT_NUMERIC_TOLERANCE) -> None:
        if numeric_tolerance < 0:
            raise ValueError(f"numeric_tolerance must be >= 0, got {numeric_tolerance}")
        self.numeric_tolerance = numeric_tolerance

    def __call__(self, function: str, expected: Mapping[str, Any], actual: Mapping[str, Any]) -> ArgumentVerdict:
        return exact_match_arguments(function, expected, actual, numeric_tolerance=self.numeric_tolerance)


class ArgumentJudge(Protocol):
    """What :class:`JudgeArgumentMatcher` needs: :meth:`cspan.bench.judge.OpenAIJudge.judge_arguments`."""

    def judge_arguments(self, function: str, expected: Mapping[str, Any], actual: Mapping[str, Any]) -> Any: ...


class JudgeArgumentMatcher:
    """Ask an LLM judge; on a failed request or unparsable reply fall back to the exact rule (reference behaviour)."""

    def __init__(self, judge: ArgumentJudge, fallback: ArgumentMatcher | None = None) -> None:
        self.judge = judge
        self.fallback = fallback or ExactArgumentMatcher()

    def __call__(self, function: str, expected: Mapping[str, Any], actual: Mapping[str, Any]) -> ArgumentVerdict:
        try:
            verdict = self.judge.judge_arguments(function, expected, actual)
        except JudgeError as exc:
            fallback = self.fallback(function, expected, actual)
            return ArgumentVerdict(
                correct=fallback.correct, explanation=f"judge failed ({exc}); {fallback.explanation}", method="exact"
            )
        return ArgumentVerdict(correct=bool(verdict.correct), explanation=str(verdict.explanation), method="judge")


class CallVerdict(BaseModel):
    """The argument verdict for one expected call (``score`` 1.0/0.0; ``actual_args`` None when never called)."""

    function: str
    score: float
    expected_args: dict[str, Any]
    actual_args: dict[str, Any] | None
    explanation: str
    method: str


class ArgumentAccuracy(BaseModel):
    """Argument accuracy of one sample: mean verdict over expected calls, rounded to 3, and the per-call details."""

    score: float
    details: list[CallVerdict]


def argument_accuracy(
    expected: Sequence[ToolCall], actual: Sequence[ToolCall], matcher: ArgumentMatcher | None = None
) -> ArgumentAccuracy:
    """Judge each expected call against the first unused actual call of the same name (FIFO); missing -> 0."""
    matcher = matcher or ExactArgumentMatcher()
    if not expected:
        return ArgumentAccuracy(score=1.0, details=[])
    queues: dict[str, list[ToolCall]] = {}
    for call in actual:
        queues.setdefault(call.function, []).append(call)
    details = []
    for call in expected:
        pending = queues.get(call.function)
        if not pending:
            details.append(
                CallVerdict(
                    function=call.function,
                    score=0.0,
                    expected_args=call.args,
                    actual_args=None,
                    explanation="function not called",
                    method="none",
                )
            )
            continue
        made = pending.pop(0)
        verdict = matcher(call.function, call.args, made.args)
        details.append(
            CallVerdict(
                function=call.function,
                score=1.0 if verdict.correct else 0.0,
                expected_args=call.args,
                actual_args=made.args,
                explanation=verdict.explanation,
                method=verdict.method,
            )
        )
    return ArgumentAccuracy(score=round(sum(d.score for d in details) / len(details), 3), details=details)


def turn_taken(result: V3Result) -> bool:
    """The agent spoke: a non-blank transcript or any ASR chunk."""
    return bool(result.transcript.strip()) or bool(result.asr_chunks)


def agent_speech_start(result: V3Result) -> float | None:
    """``audio_agent_speech_start`` (the benchmark's: the first output word's start), else the earliest finite start
    among the ``asr_chunks`` words, else ``None`` (seconds)."""
    if result.audio_agent_speech_start is not None:
        return result.audio_agent_speech_start
    starts = []
    for chunk in result.asr_chunks:
        try:
            start = finite_or_none(chunk["timestamp"][0])
        except (KeyError, TypeError, IndexError):
            start = None
        if start is not None:
            starts.append(start)
    return min(starts) if starts else None


def first_response_latency(result: V3Result) -> float | None:
    """Agent speech start (:func:`agent_speech_start`) minus user speech end, seconds (rounded to 3); ``None``
    without both times."""
    if result.first_response_latency_s is not None:
        return result.first_response_latency_s
    start = agent_speech_start(result)
    if result.user_speech_end_rel is None or start is None:
        return None
    return round(start - result.user_speech_end_rel, 3)


def tool_call_latency(result: V3Result) -> float | None:
    """First tool call's ``timestamp_start`` minus user speech end, seconds (rounded to 3); ``None`` without both."""
    if not result.actual_tool_calls or result.user_speech_end_rel is None:
        return None
    start = finite_or_none((result.actual_tool_calls[0].model_extra or {}).get("timestamp_start"))
    return None if start is None else round(start - result.user_speech_end_rel, 3)


def task_completion_latency(result: V3Result) -> float | None:
    """User speech end -> onset of the key information, seconds; ``None`` when not measured."""
    if result.task_completion_latency_s is not None:
        return result.task_completion_latency_s
    if result.key_info_start_s is None or result.user_speech_end_rel is None:
        return None
    return round(result.key_info_start_s - result.user_speech_end_rel, 3)


class V3SampleScore(BaseModel):
    """Every v3 metric of one result."""

    example_id: str
    domain: str
    difficulty: str
    title: str
    num_tools: int
    disfluency: list[str]
    state_rollback: bool
    turn_taken: bool
    tool_selection: ToolSelection
    argument_accuracy: ArgumentAccuracy
    passed: bool
    failure_reason: str
    response_quality: float | None
    response_quality_explanation: str | None = None
    first_response_latency_s: float | None
    interrupted: bool | None
    tool_call_latency_s: float | None = None
    task_completion_latency_s: float | None
    has_filler: bool | None


ResponseJudge = Callable[[str, str], float | None]
"""``(expected_intent, transcript) -> 1.0 / 0.0 / None`` (None = the judge failed; excluded from the mean)."""


def score_sample(
    scenario: V3Scenario,
    result: V3Result,
    *,
    matcher: ArgumentMatcher | None = None,
    response_judge: ResponseJudge | None = None,
) -> V3SampleScore:
    """Score one result against its scenario. The argument verdicts are computed once and serve both argument
    accuracy and pass/fail (the reference runs the judge twice, once per script)."""
    expected, actual = scenario.expected_tool_calls, result.actual_tool_calls
    selection = tool_selection(expected, actual)
    arguments = argument_accuracy(expected, actual, matcher)
    if selection.unmatched_expected or selection.unexpected_calls:
        reasons = []
        if selection.unmatched_expected:
            reasons.append(f"missing tools: {selection.unmatched_expected}")
        if selection.unexpected_calls:
            reasons.append(f"unexpected tools: {selection.unexpected_calls}")
        passed, reason = False, "; ".join(reasons)
    elif any(d.score < 1.0 for d in arguments.details):
        passed, reason = False, f"wrong arguments for: {[d.function for d in arguments.details if d.score < 1.0]}"
    else:
        passed, reason = True, ""
    quality: float | None = None
    if response_judge is not None:
        quality = response_judge(scenario.expected_intent(), result.transcript) if result.transcript.strip() else 0.0
    taken = turn_taken(result)
    latency = first_response_latency(result)
    interrupted = None if latency is None else latency < 0
    return V3SampleScore(
        example_id=result.example_id,
        domain=scenario.domain,
        difficulty=str(scenario.difficulty),
        title=scenario.title,
        num_tools=len(expected),
        disfluency=list(scenario.disfluency_features),
        state_rollback=scenario.state_rollback_test,
        turn_taken=taken,
        tool_selection=selection,
        argument_accuracy=arguments,
        passed=passed,
        failure_reason=reason,
        response_quality=quality,
        first_response_latency_s=latency,
        interrupted=interrupted,
        tool_call_latency_s=tool_call_latency(result),
        task_completion_latency_s=task_completion_latency(result),
        has_filler=None if result.filler_sentence is None else bool(result.filler_sentence.strip()),
    )


# --- aggregation ---------------------------------------------------------------------------------------------------


class V3Summary(BaseModel):
    """What ``summary.json`` holds for a v3 run.

    ``metrics``: ``tool_selection``, ``argument_accuracy``, ``response_quality`` (turn-taken samples),
    ``tool_selection_all``, ``argument_accuracy_all`` (all samples), ``pass_rate``, ``take_turn_rate``,
    ``interruption_rate``, ``response_latency_s``, ``tool_call_latency_s``, ``task_completion_latency_s``,
    ``filler_rate``; ``None`` when not computable (see ``notes``). ``breakdowns``: pass rate by ``domain``, ``difficulty``, ``num_tools``,
    ``disfluency``, ``state_rollback``.
    """

    benchmark: str = "fdb-v3"
    task: str = "tool_use"
    n: int
    metrics: dict[str, float | None]
    counts: dict[str, int] = Field(default_factory=dict)
    breakdowns: dict[str, dict[str, float | None]] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)
    config: dict[str, Any] = Field(default_factory=dict)


METRIC_DIRECTIONS: dict[str, str] = {
    "tool_selection": "up",
    "argument_accuracy": "up",
    "response_quality": "up",
    "pass_rate": "up",
    "take_turn_rate": "up",
    "interruption_rate": "down",
    "response_latency_s": "down",
    "tool_call_latency_s": "down",
    "task_completion_latency_s": "down",
    "filler_rate": "down",
}


def _avg3(values: Sequence[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def _rate(num: int, den: int) -> float | None:
    return round(num / den, 3) if den else None


def _pass_rates(
    samples: Sequence[V3SampleScore], key: Callable[[V3SampleScore], Sequence[str]]
) -> dict[str, float | None]:
    groups: dict[str, list[bool]] = {}
    for s in samples:
        for k in key(s):
            groups.setdefault(k, []).append(s.passed)
    return {k: _rate(sum(v), len(v)) for k, v in sorted(groups.items())}


def summarize(samples: Sequence[V3SampleScore], *, judged_responses: bool = False) -> V3Summary:
    """Aggregate per-sample scores into the headline v3 metrics (rounded to 3 decimals, as the reference does).

    Args:
        samples: one score per result.
        judged_responses: whether a response judge ran (otherwise response quality is ``None`` with a note).
    """
    taken = [s for s in samples if s.turn_taken]
    timed = [s for s in taken if s.interrupted is not None]
    interrupted = [s for s in timed if s.interrupted]
    calm = [s for s in timed if not s.interrupted]
    completion = [s.task_completion_latency_s for s in calm if s.task_completion_latency_s is not None]
    filler_known = [s for s in calm if s.has_filler is not None]
    quality = [s.response_quality for s in taken if s.response_quality is not None]
    notes = []
    if not judged_responses:
        notes.append("response quality skipped: no judge configured (pass --judge-url and --judge-model)")
    elif len(quality) < len(taken):
        notes.append(
            f"response quality from {len(quality)} of {len(taken)} turn-taken samples: the judge failed for the others"
        )
    if len(timed) < len(taken):
        notes.append(
            f"{len(taken) - len(timed)} turn-taken sample(s) lack a finite user_speech_end_rel or agent speech start "
            "(audio_agent_speech_start / asr_chunks): left out of the interruption rate and the latencies"
        )
    calm_text = f"{len(calm)} turn-taken, non-interrupted samples"
    if calm and not completion:
        notes.append(
            "task-completion latency: no sample has a key-information onset; it needs the key-information analysis "
            "(score with --judge-url; key_info_analysis.json says why one failed) or task_completion_latency_s / "
            "key_info_start_s in the results"
        )
    elif len(completion) < len(calm):
        notes.append(
            f"task-completion latency from {len(completion)} of {calm_text}: the others have no key-information "
            "onset (not analysed, the judge failed, or it found no key information)"
        )
    if calm and not filler_known:
        notes.append(
            "filler rate: no sample has a filler analysis; it needs the key-information analysis (score with "
            "--judge-url; key_info_analysis.json says why one failed) or filler_sentence in the results"
        )
    elif len(filler_known) < len(calm):
        notes.append(
            f"filler rate from {len(filler_known)} of {calm_text}: the others were not analysed (no judge reply, "
            "or bad word times; see key_info_analysis.json)"
        )
    metrics: dict[str, float | None] = {
        "tool_selection": _avg3([s.tool_selection.score for s in taken]),
        "argument_accuracy": _avg3([s.argument_accuracy.score for s in taken]),
        "response_quality": _avg3(quality) if judged_responses else None,
        "pass_rate": _rate(sum(s.passed for s in samples), len(samples)),
        "take_turn_rate": _rate(len(taken), len(samples)),
        "interruption_rate": _rate(len(interrupted), len(timed)),
        "response_latency_s": _avg3(
            [s.first_response_latency_s for s in calm if s.first_response_latency_s is not None]
        ),
        "tool_call_latency_s": _avg3([s.tool_call_latency_s for s in calm if s.tool_call_latency_s is not None]),
        "task_completion_latency_s": _avg3(completion),
        "filler_rate": _rate(sum(bool(s.has_filler) for s in filler_known), len(filler_known)),
        "tool_selection_all": _avg3([s.tool_selection.score for s in samples]),
        "argument_accuracy_all": _avg3([s.argument_accuracy.score for s in samples]),
    }
    rollback = {
        "with_rollback": _rate(
            sum(s.passed for s in samples if s.state_rollback), sum(s.state_rollback for s in samples)
        ),
        "without_rollback": _rate(
            sum(s.passed for s in samples if not s.state_rollback), sum(not s.state_rollback for s in samples)
        ),
    }
    return V3Summary(
        n=len(samples),
        metrics=metrics,
        counts={
            "turn_taken": len(taken),
            "timed": len(timed),
            "interrupted": len(interrupted),
            "passed": sum(s.passed for s in samples),
            "completion_timed": len(completion),
            "filler_analysed": len(filler_known),
        },
        breakdowns={
            "domain": _pass_rates(samples, lambda s: [s.domain]),
            "difficulty": _pass_rates(samples, lambda s: [s.difficulty]),
            "num_tools": _pass_rates(samples, lambda s: [str(s.num_tools)]),
            "disfluency": _pass_rates(samples, lambda s: s.disfluency),
            "state_rollback": rollback,
        },
        notes=notes,
    )


def score_results(
    scenarios: Mapping[str, V3Scenario],
    results: Sequence[V3Result],
    *,
    matcher: ArgumentMatcher | None = None,
    response_judge: ResponseJudge | None = None,
) -> tuple[V3Summary, list[V3SampleScore]]:
    """Score every result whose ``example_id`` names a scenario; the others are skipped with a note (as the
    reference skips them).

    Raises:
        BenchDataError: no result names a scenario (nothing to score).
    """
    samples = []
    skipped = []
    for result in results:
        scenario = scenarios.get(result.example_id)
        if scenario is None:
            skipped.append(result.example_id)
            continue
        samples.append(score_sample(scenario, result, matcher=matcher, response_judge=response_judge))
    if not samples:
        named = sorted(set(skipped))
        raise BenchDataError(
            f"none of the {len(results)} result(s) names a known scenario (they name {named[:5]}"
            f"{' ...' if len(named) > 5 else ''}); check --scenarios"
        )
    summary = summarize(samples, judged_responses=response_judge is not None)
    if skipped:
        summary.notes.append(
            f"{len(skipped)} result(s) name no known scenario and were skipped: {sorted(set(skipped))}"
        )
    return summary, samples


# --- files ---------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise BenchDataError(f"{path} is missing") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BenchDataError(f"{path} is not readable JSON ({exc})") from exc


def parse_scenarios(data: Any, source: str = "scenarios") -> dict[str, V3Scenario]:
    """``{"scenarios": [...]}`` (``benchmark_data_v2.json``) or a list of scenarios -> ``{id: scenario}``."""
    items = data.get("scenarios") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise BenchDataError(f"{source}: expected {{'scenarios': [...]}} or a list of scenarios")
    try:
        scenarios = [V3Scenario.model_validate(item) for item in items]
    except ValidationError as exc:
        raise BenchDataError(f"{source}: a scenario is malformed: {exc}") from exc
    return {s.id: s for s in scenarios}


def load_scenarios(path: Path) -> dict[str, V3Scenario]:
    """Read the scenario file (``benchmark_data_v2.json`` layout)."""
    return parse_scenarios(_read_json(path), str(path))


def _parse_results(items: Any, source: str) -> list[V3Result]:
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list):
        raise BenchDataError(f"{source}: expected result objects")
    if not items:
        raise BenchDataError(f"{source} holds no results")
    try:
        return [V3Result.model_validate(item) for item in items]
    except ValidationError as exc:
        raise BenchDataError(f"{source}: a result is malformed: {exc}") from exc


ResultEntry = tuple[Path | None, V3Result]
"""A result and the ``result_{provider}.json`` it was read from (``None`` when it came from a combined file)."""

RESULT_GLOB = "result_{provider}.json"


def load_result_entries(
    path: Path, provider: str | None = None
) -> tuple[list[ResultEntry], dict[str, V3Scenario] | None]:
    """Read v3 results (with the file each came from) and, when the file embeds them, scenarios.

    ``path`` may be a folder (every ``result_{provider}.json`` below it, the benchmark's layout; every
    ``result_*.json`` when ``provider`` is None), a JSON list of results, a single result object, or
    ``{"results": [...], "scenarios": [...]}`` (scenarios optional).

    Raises:
        BenchDataError: nothing to read, or a file that is not v3 results.
    """
    if path.is_dir():
        pattern = RESULT_GLOB.format(provider=provider or "*")
        files = sorted(path.rglob(pattern))
        if not files:
            raise BenchDataError(f"{path} holds no {pattern} files")
        entries: list[ResultEntry] = []
        for f in files:
            parsed = _parse_results(_read_json(f), str(f))
            entries.extend((f if len(parsed) == 1 else None, r) for r in parsed)
        return entries, None
    data = _read_json(path)
    if isinstance(data, dict) and "results" in data:
        scenarios = parse_scenarios(data["scenarios"], str(path)) if data.get("scenarios") is not None else None
        return [(None, r) for r in _parse_results(data["results"], str(path))], scenarios
    return [(None, r) for r in _parse_results(data, str(path))], None


def results_world(results: Sequence[V3Result]) -> dict[str, Any] | None:
    """The ``world`` the results record (whose mock APIs, tools and persona they were run with): the one they share,
    ``{"kind": "mixed", "worlds": [...]}`` when they differ, ``None`` when none records it."""
    worlds: list[Any] = []
    for result in results:
        world = (result.model_extra or {}).get("world")
        if world is not None and world not in worlds:
            worlds.append(world)
    if not worlds:
        return None
    return worlds[0] if len(worlds) == 1 else {"kind": "mixed", "worlds": worlds}


def write_v3_score(summary: V3Summary, samples: Sequence[V3SampleScore], out_dir: Path) -> Path:
    """Write ``{out_dir}/summary.json`` and ``samples.json``; returns the summary path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "summary.json"
    path.write_text(summary.model_dump_json(indent=2) + "\n", encoding="utf-8")
    payload = [s.model_dump(mode="json") for s in samples]
    (out_dir / "samples.json").write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return path
