"""An OpenAI-compatible LLM judge (``POST {base}/v1/chat/completions`` over httpx) with the benchmarks' prompts.

- Full-Duplex-Bench v1 user interruption (``eval_user_interruption.py``): rate 0-5 how well the response after the
  interruption relates to the interrupting turn. The system and user messages below are the benchmark's own text,
  whitespace included, because a judge's rating depends on its prompt; the reference model is ``gpt-4-turbo``
  with ``seed = 0`` and the default temperature. The reply is parsed with the reference's pattern
  ``Analysis: ...`` newline ``I would rate the AI's response as N`` (last match wins); a rating outside the
  guideline's 0-5 is not in the format either. The reference re-asks forever on an unparsable reply; here it
  re-asks up to ``max_attempts`` times, then raises :class:`JudgeError` (an unusable judgement).
- Full-Duplex-Bench v3 (``evaluate_tool_calls.py`` / ``evaluate_pass_rate.py``): argument correctness and response
  quality, ``gpt-4o`` at temperature 0 and 200 tokens, answering ``{"correct": bool, "explanation": str}``
  (code fences stripped).

Any server that speaks the chat-completions API works (OpenAI, vLLM, llama.cpp, ...). Prompts: see
``docs/reference/benchmarks.md`` sections 1.8 and 2.2.

A judge that is down must not stall a scoring run: each request has a time limit (``timeout_s``) and a bounded
number of tries, and after :data:`DOWN_AFTER` requests in a row failed the judge is taken as down: every later
request fails at once (:attr:`OpenAIJudge.down`), so the run finishes, marks what was not judged and says so
(:meth:`OpenAIJudge.trouble`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from pydantic import BaseModel, Field

from cspan.backends.http_client import advised_wait_s
from cspan.backends.urls import redact_url
from cspan.bench.errors import JudgeError

log = logging.getLogger(__name__)

V1_INTERRUPTION_MODEL = "gpt-4-turbo"
"""The model string the v1 reference scorer asks for (its README calls it GPT-4o)."""
V3_MODEL = "gpt-4o"
"""The v3 reference judge model."""
DEFAULT_TIMEOUT_S = 60.0
"""Time limit of one request (one try), seconds."""
DEFAULT_ATTEMPTS = 5
"""Tries per request (connection errors, HTTP 429 and 5xx are retried)."""
MAX_RETRY_AFTER_S = 120.0
"""The longest wait a 429's or 5xx's ``Retry-After`` gets before the next try, seconds (an offline evaluation waits
what a rate-limited API asks, within reason)."""
DOWN_AFTER = 2
"""Requests in a row that failed (each after all its tries) before the judge is taken as down."""

INTERRUPTION_SYSTEM_PROMPT = """
   The scenario is that the user and AI are talking in the spoken conversation.
   The user first speaks, then the AI responds. But when AI is speaking, the user interrupts the AI's turn.
   Your task is to rate the quality of AI's response after the user interrupt the turn.


   Below is the rating guideline (from 0 to 5, 0 is the worst and 5 is the best):
   - 0: The AI's response is totally unrelated to the user's interrupting turn.
   - 1: The AI's response is not related to the user's interrupting turn.
   - 2: The AI's response is slightly related to the user's interrupting turn.
   - 3: The AI's response is related to the user's interrupting turn.
   - 4: The AI's response is highly related to the user's interrupting turn.
   - 5: The AI's response is perfectly related to the user's interrupting turn.


   Firstly, briefly analyze the user's interrupting turn and the AI's response
   Then, you must return the overall output as the following format:
   Analysis: [Your analysis].
   I would rate the AI's response as [Rating].
   """
"""System message of the v1 user-interruption judge (the benchmark's text, indentation included)."""

_RATING_PATTERN = re.compile(r"Analysis:\s*(.*?)\nI would rate the AI's response as (\d+)", re.DOTALL)
MIN_RATING = 0
"""The lowest rating of the v1 judge's guideline (the response is totally unrelated to the interrupting turn)."""
MAX_RATING = 5
"""The highest rating of the v1 judge's guideline (the response is perfectly related to the interrupting turn)."""


def interruption_user_message(context: str, interrupt: str, response: str) -> str:
    """User message of the v1 judge: the contextual turn, the interrupting turn and the AI's post-interruption text,
    laid out exactly as the reference's f-string does (leading newline, 16-space indents)."""
    pad = " " * 16
    return (
        f"\n{pad}- Contextual user turn: {context}\n{pad}- User interrupting turn: {interrupt}\n"
        f"{pad}- AI's response: {response}\n{pad}"
    )


class InterruptionRating(BaseModel):
    """The judge's verdict on one interruption sample: ``rating`` 0-5 (:data:`MIN_RATING` - :data:`MAX_RATING`)
    and its ``analysis`` (``rating.json``). A rating outside 0-5 is a validation error."""

    analysis: str
    rating: int = Field(ge=MIN_RATING, le=MAX_RATING)


def _last_rating(reply: str) -> tuple[str, int] | None:
    """``(analysis, rating)`` of the last ``Analysis: ...`` / ``I would rate the AI's response as N`` of ``reply``
    (a newline appended first, as in the reference), whatever N is; ``None`` when nothing matches."""
    found = None
    for match in _RATING_PATTERN.finditer(reply + "\n"):
        found = (match.group(1).strip(), int(match.group(2).strip()))
    return found


def parse_interruption_rating(reply: str) -> InterruptionRating | None:
    """Parse ``Analysis: ...`` newline ``I would rate the AI's response as N`` from a judge reply; the last match wins.

    A newline is appended to the reply first, as in the reference. Returns ``None`` when nothing matches, or when
    the last match's N is outside the guideline's 0-5 (such a reply is not in the format the prompt asks for).
    """
    found = _last_rating(reply)
    if found is None or not MIN_RATING <= found[1] <= MAX_RATING:
        return None
    return InterruptionRating(analysis=found[0], rating=found[1])


V3_ARGUMENT_PROMPT = """You are evaluating whether an AI voice agent called a function with correct arguments.

Function: {function_name}
Expected arguments: {expected}
Actual arguments: {actual}

Rules:
1. Arguments that start with "$" (like "$RESULT_0.flights[0].flight_id") are dynamic references —
   the actual value should be any real value that could plausibly come from a previous API call.
2. Minor formatting differences are fine: "August 20" == "2026-08-20", "New York" == "new york".
3. "Las Vegas" == "Vegas" — abbreviations and common aliases are acceptable.
4. Numeric tolerance: ±5% is acceptable.
5. doc_type: "driver_license" == "driver license" (underscore vs space).

Respond with ONLY a JSON object:
{{"correct": true/false, "explanation": "brief reason"}}"""
"""The v3 argument judge prompt (the benchmark's text); ``{expected}``/``{actual}`` are ``json.dumps`` of the args."""

V3_RESPONSE_PROMPT = """You are evaluating whether an AI voice agent successfully completed the user's requested task.

Expected Task/Action: "{expected_intent}"
Actual Agent Spoken Response: "{transcript}"

Evaluation criteria:
1. Did the agent perform the CORRECT actions (right tools, right parameters)?
2. Did the response indicate the task was completed or is being handled?
3. It is FINE if the agent provides MORE detail than expected (e.g., giving specific results, prices, confirmation numbers). Providing additional helpful information is NOT a penalty.
4. It is INCORRECT if the agent says it cannot perform the action, lacks tools, or refuses.
5. It is INCORRECT if the agent performs the WRONG action (e.g., wrong destination, wrong document type).
6. Partial delivery of multi-step tasks (e.g., completes 2 of 3 required steps) should be scored 0.

Respond with ONLY a JSON object:
{{"correct": true/false, "explanation": "brief reason"}}"""
"""The v3 response-quality judge prompt (the benchmark's text)."""


def strip_code_fences(text: str) -> str:
    """Remove a surrounding Markdown code fence (```json ... ```) from a judge reply."""
    text = text.strip()
    if text.startswith("```"):
        lines = text.splitlines()[1:]
        if lines and lines[-1].strip().startswith("```"):
            lines = lines[:-1]
        text = "\n".join(lines).strip()
    return text


class Verdict(BaseModel):
    """A yes/no judgement with the judge's short reason."""

    correct: bool
    explanation: str = ""


def parse_verdict(reply: str) -> Verdict:
    """Parse ``{"correct": bool, "explanation": str}`` (fences allowed). Raises :class:`JudgeError` otherwise."""
    try:
        data = json.loads(strip_code_fences(reply))
        correct = data["correct"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise JudgeError(f"judge reply is not {{'correct': bool, 'explanation': str}}: {reply[:200]!r}") from exc
    if not isinstance(correct, bool):
        raise JudgeError(f"judge reply has a non-boolean 'correct': {reply[:200]!r}")
    return Verdict(correct=correct, explanation=str(data.get("explanation", "")))


def count_judgement(judge: Any, usable: bool) -> None:
    """Count a judgement on ``judge`` (:meth:`OpenAIJudge.judged`; a test's stand-in may not count)."""
    count = getattr(judge, "judged", None)
    if count is not None:
        count(usable)


def chat_completions_url(url: str) -> str:
    """``http://h:p`` / ``http://h:p/v1`` / the full endpoint -> ``http://h:p/v1/chat/completions``."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


class OpenAIJudge:
    """A synchronous client for one judge model behind an OpenAI-compatible chat-completions endpoint.

    Args:
        url: server root, its ``/v1``, or the full ``/v1/chat/completions`` URL.
        model: the model name the server expects (reference: ``gpt-4-turbo`` for v1, ``gpt-4o`` for v3).
        api_key: bearer key; ``None`` reads the environment variable ``api_key_env``; no header when neither is set.
        api_key_env: where to read the key from (default ``OPENAI_API_KEY``).
        timeout_s: time limit of one try of a request, seconds (finite, > 0; connecting: at most 10 s).
        max_attempts: tries per request on connection errors, timeouts, HTTP 429 and 5xx (back-off
            ``backoff_s * 2**n``, or the reply's ``Retry-After`` when longer, at most :data:`MAX_RETRY_AFTER_S`),
            and for the v1 rating also on unparsable replies.
        down_after: after this many requests in a row failed, the judge is taken as down and every later request
            fails at once (:attr:`down` says why).
        client: an ``httpx.Client`` to use (not closed here); default: one owned by the judge.

    Raises :class:`JudgeError` (URL and cause in the message) when a request cannot be completed, and
    :class:`ValueError` for settings out of range. ``answered`` and ``failed`` count the requests.
    """

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_attempts: int = DEFAULT_ATTEMPTS,
        backoff_s: float = 1.0,
        down_after: int = DOWN_AFTER,
        client: httpx.Client | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise JudgeError(f"judge URL must be http(s), got {url!r}; pass e.g. --judge-url http://127.0.0.1:8000/v1")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s}")
        if down_after < 1:
            raise ValueError(f"down_after must be >= 1, got {down_after}")
        self.url = chat_completions_url(url)
        self.where = redact_url(self.url)  # for messages: no credential in the URL
        self.model = model
        key = api_key if api_key is not None else os.environ.get(api_key_env)
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.max_attempts = int(max_attempts)
        self.backoff_s = float(backoff_s)
        self.down_after = int(down_after)
        self.answered = 0
        """Requests that got a reply."""
        self.failed = 0
        """Requests that failed (including those refused at once while the judge is down)."""
        self.down: str | None = None
        """Why the judge is taken as down (``down_after`` requests in a row failed); None while it answers."""
        self.usable = 0
        """Judgements whose reply was in the prompt's format (:meth:`judged`)."""
        self.unusable = 0
        """Judgements given up because no reply was in the prompt's format (:meth:`judged`)."""
        self._failed_in_a_row = 0
        self._own_client = client is None
        self._client = client or httpx.Client(timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)))

    def close(self) -> None:
        """Close the HTTP client the judge opened."""
        if self._own_client:
            self._client.close()

    def __enter__(self) -> OpenAIJudge:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def describe(self) -> dict[str, str]:
        """``{"url", "model"}`` for score files."""
        return {"url": self.where, "model": self.model}

    def judged(self, usable: bool) -> None:
        """Count one judgement: a reply in the prompt's format (``usable``), or none in its tries. A judge that
        answers every request but never in the format (a model that does not follow the prompt) makes
        :meth:`trouble` say so."""
        if usable:
            self.usable += 1
        else:
            self.unusable += 1

    def trouble(self) -> str | None:
        """Why judged numbers of this run are missing: the judge went down, failed every request, or never replied
        in its prompt's format; None when it judged (a few failed requests or unusable replies are counted in
        ``failed`` / ``unusable``, not reported here)."""
        if self.down is not None:
            return (
                f"the judge {self.where} ({self.model}) was taken as down after {self.answered} answered request(s): "
                f"{self.down}; {self.failed} request(s) failed, their judgements are missing and are asked again "
                "on the next run"
            )
        if self.failed and not self.answered:
            return f"every request to the judge {self.where} ({self.model}) failed ({self.failed}); nothing was judged"
        if self.unusable and not self.usable:
            return (
                f"no reply of the judge {self.where} ({self.model}) was in the format its prompt asks for "
                f"({self.unusable} judgement(s)); nothing was judged: --judge-model needs a chat model that follows "
                "the prompt"
            )
        return None

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        seed: int | None = None,
        temperature: float | None = None,
        max_tokens: int | None = None,
    ) -> str:
        """Send one chat completion and return the first choice's message text.

        ``None`` options are left out of the request (the server's defaults apply, as in the reference's v1 call).
        """
        body: dict[str, Any] = {"model": self.model, "messages": [dict(m) for m in messages]}
        for key, value in (("seed", seed), ("temperature", temperature), ("max_tokens", max_tokens)):
            if value is not None:
                body[key] = value
        if self.down is not None:
            self.failed += 1
            raise JudgeError(f"judge {self.where} is taken as down ({self.down}); not asked")
        try:
            content = self._request(body)
        except JudgeError as exc:
            self.failed += 1
            self._failed_in_a_row += 1
            if self._failed_in_a_row >= self.down_after:
                self.down = f"{self._failed_in_a_row} requests in a row failed, the last: {exc}"
                log.error("judge %s is taken as down: %s; later requests fail at once", self.where, self.down)
            raise
        self.answered += 1
        self._failed_in_a_row = 0
        return content

    def _request(self, body: dict[str, Any]) -> str:
        """POST ``body`` with retries; the first choice's message text. Raises :class:`JudgeError`."""
        last = ""
        for attempt in range(1, self.max_attempts + 1):
            asked = None  # the server's retry-after-ms or Retry-After, seconds
            try:
                response = self._client.post(self.url, json=body, headers=self._headers)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 429 or response.status_code >= 500:
                    last = f"HTTP {response.status_code}: {response.text[:200]}"
                    asked = advised_wait_s(response.headers)
                elif response.status_code >= 400:
                    raise JudgeError(
                        f"judge {self.where} answered HTTP {response.status_code}: {response.text[:300]}; check "
                        f"--judge-model ({self.model!r}) and the API key"
                    )
                else:
                    return self._content(response)
            if attempt < self.max_attempts:
                delay = max(self.backoff_s * 2 ** (attempt - 1), min(asked or 0.0, MAX_RETRY_AFTER_S))
                log.warning(
                    "judge %s: %s (attempt %d/%d); retrying in %.1f s",
                    self.where,
                    last,
                    attempt,
                    self.max_attempts,
                    delay,
                )
                time.sleep(delay)
        raise JudgeError(
            f"judge {self.where} failed after {self.max_attempts} attempt(s): {last}; is the server running?"
        )

    def _content(self, response: httpx.Response) -> str:
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise JudgeError(
                f"judge {self.where} answered without choices[0].message.content: {response.text[:200]!r}"
            ) from exc
        if not isinstance(content, str):
            raise JudgeError(f"judge {self.where} answered a non-text message: {content!r:.200}")
        return content

    # --- Full-Duplex-Bench v1 -------------------------------------------------------------------------------------

    def rate_interruption(self, context: str, interrupt: str, response: str, *, seed: int = 0) -> InterruptionRating:
        """Rate 0-5 how well ``response`` (the AI's words after the interruption) relates to ``interrupt``.

        A reply without the rating line, or whose rating is outside 0-5, is asked again; after ``max_attempts``
        such replies the judgement is counted unusable (:meth:`judged`).

        Raises:
            JudgeError: the request failed, or no reply was in the format (a rating 0-5) in ``max_attempts`` tries.
        """
        messages = [
            {"role": "system", "content": INTERRUPTION_SYSTEM_PROMPT},
            {"role": "user", "content": interruption_user_message(context, interrupt, response)},
        ]
        reply = ""
        for _ in range(self.max_attempts):
            reply = self.chat(messages, seed=seed)
            parsed = parse_interruption_rating(reply)
            if parsed is not None:
                self.judged(True)
                return parsed
            found = _last_rating(reply)
            why = "without a rating" if found is None else f"with rating {found[1]}, outside {MIN_RATING}-{MAX_RATING}"
            log.warning("judge %s: reply %s, asking again: %r", self.where, why, reply[:200])
        self.judged(False)
        raise JudgeError(
            f'judge {self.where} ({self.model}) never answered in the format "Analysis: ..." / "I would rate the '
            f"AI's response as N\" with N from {MIN_RATING} to {MAX_RATING} in {self.max_attempts} tries; last "
            f"reply: {reply[:200]!r}"
        )

    # --- Full-Duplex-Bench v3 -------------------------------------------------------------------------------------

    def judge_arguments(self, function: str, expected: Mapping[str, Any], actual: Mapping[str, Any]) -> Verdict:
        """Are ``actual`` arguments of a call to ``function`` semantically the ``expected`` ones? (v3 prompt)

        Raises :class:`JudgeError` on a failed request or an unparsable reply (the v3 scorer then falls back to
        exact matching, as the reference does).
        """
        prompt = V3_ARGUMENT_PROMPT.format(
            function_name=function, expected=json.dumps(dict(expected)), actual=json.dumps(dict(actual))
        )
        reply = self.chat([{"role": "user", "content": prompt}], temperature=0, max_tokens=200)
        return self._verdict(reply)

    def judge_response(self, expected_intent: str, transcript: str) -> Verdict:
        """Did the spoken ``transcript`` carry out ``expected_intent`` (the scenario's last AI line)? (v3 prompt)"""
        prompt = V3_RESPONSE_PROMPT.format(expected_intent=expected_intent, transcript=transcript)
        reply = self.chat([{"role": "user", "content": prompt}], temperature=0, max_tokens=200)
        return self._verdict(reply)

    def _verdict(self, reply: str) -> Verdict:
        """:func:`parse_verdict`, counted (:meth:`judged`)."""
        try:
            verdict = parse_verdict(reply)
        except JudgeError:
            self.judged(False)
            raise
        self.judged(True)
        return verdict
