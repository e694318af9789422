"""Routers: turn a question into the reference of a Context Span.

- :class:`LLMRouter` (:mod:`.llm`): any OpenAI-compatible chat endpoint with function calling (JSON-mode fallback).
- :class:`LocalRouter` (:mod:`.local`): embedded, no LLM: clock, arithmetic, full-text search over local notes.
- :mod:`.base`: :class:`RouteRequest`, :class:`RouteResult`, :class:`ToolCall`, the :class:`Router` protocol.
"""

from cspan.backends.router.base import (
    NO_INFO,
    TOOL_RESULT_PREFIX,
    Router,
    RouteRequest,
    RouteResult,
    ToolCall,
    is_abstain,
    tool_reference,
)
from cspan.backends.router.llm import LLMRouter
from cspan.backends.router.local import LocalRouter

__all__ = [
    "NO_INFO",
    "TOOL_RESULT_PREFIX",
    "LLMRouter",
    "LocalRouter",
    "RouteRequest",
    "RouteResult",
    "Router",
    "ToolCall",
    "is_abstain",
    "tool_reference",
]
