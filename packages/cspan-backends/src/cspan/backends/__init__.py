"""cspan.backends: what the model calls when it emits ``<ret>``: transcribers, router, tool bank, Context DB,
and who is asking (identity).

This package never imports torch or ``cspan.core``; it satisfies the ``Transcriber`` and ``Retriever``
protocols of ``cspan.core`` structurally.
"""

__version__ = "0.1.0"

from cspan.backends.urls import redact_http_logs as _redact_http_logs

_redact_http_logs()  # the HTTP clients' request logs (-v) name backend URLs without their credentials

# Public names, imported on first use so that ``import cspan.backends`` stays cheap (and never pulls in httpx,
# sqlite or a tool bank until asked). Add a row per re-exported name: "name": "module".
_LAZY = {
    "Authenticator": "cspan.backends.identity",
    "ContextDB": "cspan.backends.context_db",
    "ContextDBError": "cspan.backends.context_db",
    "Principal": "cspan.backends.identity",
    "Profile": "cspan.backends.context_db",
    "ToolsSpec": "cspan.backends.tools.catalog",
    "UserMemory": "cspan.backends.context_db",
    "LLMRouter": "cspan.backends.router.llm",
    "LocalRouter": "cspan.backends.router.local",
    "RouteRequest": "cspan.backends.router.base",
    "RouteResult": "cspan.backends.router.base",
    "Router": "cspan.backends.router.base",
    "ToolCall": "cspan.backends.router.base",
    "Retriever": "cspan.backends.retriever",
    "SpanResult": "cspan.backends.retriever",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cspan.backends' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
