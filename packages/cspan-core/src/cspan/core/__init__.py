"""cspan.core: the Moshi-family model and everything that runs it (no network, no backends).

Public names are imported lazily so that ``import cspan.core`` and ``cspan --help`` stay cheap; touching
``cspan.core.LMModel`` (for example) imports torch and the module that defines it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> defining module (relative to this package)
_LAZY: dict[str, str] = {
    "CspanError": "errors",
    "CheckpointError": "errors",
    "AudioInputError": "errors",
    "ProtocolError": "errors",
    "SpanError": "errors",
    "LMConfig": "config",
    "LMModel": "lm",
    "LMOutput": "lm",
    "MimiConfig": "config",
    "Mimi": "mimi",
    "DuplexEngine": "engine",
    "FrameOutput": "engine",
    "TokenStepOutput": "engine",
    "ContextSpan": "span",
    "Block": "span",
    "SpanReport": "span",
    "span_block": "span",
    "splice_block": "span",
    "splice_mask": "span",
    "PrefixReport": "prefix",
    "persona_text": "prefix",
    "TokenGrid": "streams",
    "delay_tokens": "streams",
    "undelay_tokens": "streams",
    "sample_token": "sampling",
    "SamplingParams": "sampling",
    "SessionSampling": "sampling",
    "Checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "load_lm": "checkpoint",
    "load_voice": "voice",
    "load_voice_prompt": "voice",
    "choose_voice": "voice",
    "VoicePrompt": "voice",
    "PrefixLayout": "config",
    "Conversation": "runtime",
    "ConversationConfig": "runtime",
    "run_conversation": "runtime",
    "Transcriber": "protocols",
    "Retriever": "protocols",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cspan.core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
