"""Transcribers (clients) and the ASR server.

- :class:`OpenAITranscriber`: ``POST {base}/v1/audio/transcriptions`` (OpenAI, vLLM serving Qwen3-ASR,
  ``cspan asr-serve``).
- :class:`HTTPTranscriber`: plain ``POST /transcribe`` with a 16-bit WAV -> ``{"text"}``.
- :class:`PocketSphinxTranscriber`: embedded and offline, a low-accuracy fallback.
- :mod:`cspan.backends.asr.server`: the ``cspan asr-serve`` application (needs the ``server`` extra).

All transcribers: ``await t.transcribe(pcm [S] float32 mono, sample_rate Hz) -> Transcript(text, words | None)``,
raising :class:`~cspan.backends.errors.TranscriberError` on failure.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from cspan.backends.asr.base import Transcriber, Transcript, Word, clean_asr_text
from cspan.backends.asr.http import HTTPTranscriber
from cspan.backends.asr.openai import OpenAITranscriber
from cspan.backends.asr.sphinx import PocketSphinxTranscriber

__all__ = [
    "HTTPTranscriber",
    "OpenAITranscriber",
    "PocketSphinxTranscriber",
    "Transcriber",
    "Transcript",
    "Word",
    "clean_asr_text",
    "transcriber_from_url",
]


def transcriber_from_url(
    url: str, *, model: str | None = None, api_key: str | None = None, language: str | None = None, **kwargs: Any
) -> Transcriber:
    """Pick a transcriber from one setting, as a ``--asr`` flag would take it.

    - ``"sphinx"`` (or ``"pocketsphinx"``) -> :class:`PocketSphinxTranscriber`;
    - a URL with a ``v1`` segment anywhere in its path (``http://h:8000/v1``, ``http://gateway/asr/v1``,
      ``.../v1/audio/transcriptions``), or any URL prefixed with ``openai+`` (``openai+http://h:8990``) ->
      :class:`OpenAITranscriber` (``model`` default ``qwen3-asr``; ``api_key`` default ``OPENAI_API_KEY``;
      ``/audio/transcriptions`` appended after ``/v1`` unless the URL ends with it);
    - any other ``http(s)://`` URL -> :class:`HTTPTranscriber` (``/transcribe`` appended to a bare host).

    Extra keyword arguments go to the transcriber (timeouts, retries). Raises ``ValueError`` for anything else.
    """
    spec = url.strip()
    if spec.lower() in ("sphinx", "pocketsphinx"):
        return PocketSphinxTranscriber(**kwargs)
    if spec.lower().startswith("openai+"):
        spec = spec[len("openai+") :]
        return OpenAITranscriber(spec, model=model or "qwen3-asr", api_key=api_key, language=language, **kwargs)
    if spec.startswith(("http://", "https://")):
        if "v1" in urlsplit(spec).path.split("/"):
            return OpenAITranscriber(spec, model=model or "qwen3-asr", api_key=api_key, language=language, **kwargs)
        return HTTPTranscriber(spec, language=language, **kwargs)
    raise ValueError(
        f"transcriber {url!r}: use 'sphinx', an http(s) URL of a /transcribe server, or an OpenAI-style URL "
        "(http://host:port/v1 or openai+http://host:port)"
    )
