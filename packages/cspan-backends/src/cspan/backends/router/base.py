"""Router request/response models, the ``Router`` protocol, and the span-text helpers both routers share.

A router turns one question (the user's transcribed request, plus what is known around it) into the
**reference** the speech model will read as a Context Span. The span contract is the original system's
(mindlogic-ai/Context-Spanning ``runtime/backend/realtime.py``), with "nothing" made explicit:

=============  =============================================
case           reference
=============  =============================================
tool result    ``"(tool result) <spoken clause>"``
direct answer  ``"<one spoken factual sentence>"``
nothing        ``None`` (no span is injected)
=============  =============================================
"""

from __future__ import annotations

import re
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from cspan.backends.context_db import Profile

TOOL_RESULT_PREFIX = "(tool result)"
NO_INFO = "(no information found)"

__all__ = [
    "NO_INFO",
    "TOOL_RESULT_PREFIX",
    "Profile",
    "RouteRequest",
    "RouteResult",
    "Router",
    "ToolCall",
    "is_abstain",
    "tool_reference",
]


class ToolCall(BaseModel):
    """An earlier tool call of this conversation, with its result, as the router is shown it.

    ``result`` is the spoken clause the tool returned (or "" when it failed; ``error`` then says why).
    ``status`` is ``"done"`` for a call that ran, ``"awaiting_confirmation"`` for an action tool the router held
    back until the user confirms (see ``docs/OPERATORS.md``, "Actions need a confirmation").
    """

    question: str = ""
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    result: str = ""
    error: str | None = None
    status: Literal["done", "awaiting_confirmation"] = "done"


class RouteRequest(BaseModel):
    """One routing request.

    Attributes:
        question: the user's request as transcribed (ASR text, may carry disfluencies and typos).
        profile: who the user is (timezone and city fill missing tool arguments), or None.
        agent_said: what the agent has already said in its current answer (decoded text tokens).
        history: earlier tool calls of this conversation with their results, oldest first.
        conversation: the Context DB working text (profile line and recent turns).
        after_span: whether all of the speech ``question`` was transcribed from was heard after the last Context
            Span of the conversation was read (False: some of it came before, or no span was read); None when the
            caller does not know. An action held back for confirmation is confirmed only by a question heard
            after its span (True), or, when unknown, by the words that follow the request in the text.
    """

    question: str
    profile: Profile | None = None
    agent_said: str = ""
    history: list[ToolCall] = Field(default_factory=list)
    conversation: str = ""
    after_span: bool | None = None


class RouteResult(BaseModel):
    """What the router decided.

    Attributes:
        reference: the span text (see the module docstring), or None when there is nothing to inject.
        tool: the tool that ran, or None.
        arguments: the validated arguments it ran with ({} when no tool ran).
        source: ``"tool:<name>"``, ``"llm"`` (direct answer), ``"local:<kind>"`` (local knowledge), ``"none"``.
        latency_s: seconds spent in ``route`` (LLM requests and the tool call).
        error: why there is no reference when something failed (unknown tool, invalid arguments, tool error).
        calls: every tool call made for this request, in order (more than one only when the router may chain
            calls, ``max_tool_calls > 1``); ``tool``/``arguments`` are those of the last one. An action held back
            for confirmation is a call with ``status="awaiting_confirmation"`` (and ``source`` ``confirm:<name>``).
        llm_s: seconds spent waiting for the router LLM (0 for routers without one).
        tool_s: seconds spent in tool calls.
    """

    reference: str | None = None
    tool: str | None = None
    arguments: dict[str, Any] = Field(default_factory=dict)
    source: str = "none"
    latency_s: float = 0.0
    error: str | None = None
    calls: list[ToolCall] = Field(default_factory=list)
    llm_s: float = 0.0
    tool_s: float = 0.0


@runtime_checkable
class Router(Protocol):
    """Anything with ``async route(RouteRequest) -> RouteResult`` (``LLMRouter``, ``LocalRouter``)."""

    async def route(self, req: RouteRequest) -> RouteResult: ...


_ABSTAIN = re.compile(
    r"no information|no (?:data|results?|details) (?:found|available)"
    r"|\b(?:i|we)(?:'m| am| are|'re) (?:not (?:sure|able)|unable)\b"
    r"|\bunable to (?:find|locate|determine|access|retrieve|answer|provide|help)"
    r"|\b(?:i|we) (?:could|can|do|did)(?:n'?t| ?not) (?:find|tell|say|help|know|answer|access|check|provide|have)"
    r"|\b(?:i|we) have no (?:information|data|access|idea|way)"
    r"|^(?:sorry|i'?m sorry|i apologi[sz]e)\b|^(?:none|null|n/?a|unknown|nothing)\W*$",
    re.I,
)


def is_abstain(answer: str) -> bool:
    """True when a direct answer is an apology or abstention ("I couldn't find ...", "No information."), or empty.

    Source: the original's abstain regex in ``runtime/backend/realtime.py``, widened to common phrasings.
    """
    text = answer.strip()
    return not text or bool(_ABSTAIN.search(text))


def tool_reference(clause: str) -> str:
    """``"(tool result) <clause>"``; a tool that ran and returned nothing gives ``"(tool result) (no information
    found)"`` (the model was trained on that abstain span)."""
    clause = " ".join(clause.split())
    if clause.lower().startswith(TOOL_RESULT_PREFIX):
        clause = clause[len(TOOL_RESULT_PREFIX) :].strip()
    return f"{TOOL_RESULT_PREFIX} {clause or NO_INFO}"
