"""``OpenAITranscriber``: the OpenAI audio API, ``POST {base}/v1/audio/transcriptions``.

Works with OpenAI itself, with vLLM's ``qwen-asr-serve`` / ``vllm serve`` for Qwen3-ASR (the released setup:
``--served-model-name qwen3-asr``), and with ``cspan asr-serve``. Request: multipart ``file`` (16-bit WAV at the
clip's own rate), ``model``, optional ``language``; with ``word_timestamps=True`` also
``response_format=verbose_json`` and ``timestamp_granularities[]=word``. Reference: the OpenAI API reference,
"Create transcription"; the original system's ``duetaspan/align/asr.py`` for the Qwen3-ASR prefix strip.
"""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from cspan.backends.asr.base import Transcript, clean_asr_text
from cspan.backends.asr.http import RemoteTranscriber
from cspan.backends.errors import TranscriberError
from cspan.backends.http_client import HTTPReply, off_loop
from cspan.backends.urls import redact_url

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://127.0.0.1:8990"
DEFAULT_MODEL = "qwen3-asr"
API_PATH = "/v1/audio/transcriptions"


def transcriptions_url(base_url: str) -> str:
    """``http://h:p`` / ``http://h:p/v1`` / the full endpoint -> ``http://h:p/v1/audio/transcriptions`` (a query
    stays at the end)."""
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    if not path.endswith(API_PATH):
        path += API_PATH[len("/v1") :] if path.endswith("/v1") else API_PATH
    return urlunsplit(parts._replace(path=path))


class OpenAITranscriber(RemoteTranscriber):
    """Transcribe through an OpenAI-compatible ``/v1/audio/transcriptions`` endpoint.

    Args:
        base_url: server root (``http://host:8990``), its ``/v1``, or the full endpoint URL.
        model: the form field ``model``; vLLM wants its ``--served-model-name`` (default ``qwen3-asr``).
        api_key: bearer key; ``None`` reads ``OPENAI_API_KEY``; no header is sent when neither is set (vLLM and
            ``cspan asr-serve`` need none).
        language: ISO-639-1 code sent as ``language`` (``"en"``); ``None`` lets the server detect it.
        word_timestamps: ask for word timings (``verbose_json`` + ``timestamp_granularities[]=word``). A server
            that rejects that format with HTTP 400/422 (older vLLM) is asked again with plain ``json`` once,
            and later calls go straight to ``json``; the transcript then has ``words=None``.
        timeout_s, connect_timeout_s, max_attempts, backoff_s, max_reply_bytes, client: see
            :class:`~cspan.backends.asr.http.RemoteTranscriber`.

    ``transcribe(pcm [S] float32, sample_rate Hz)`` returns a :class:`Transcript` with Qwen3-ASR's
    ``language X<asr_text>`` prefix stripped. Raises :class:`~cspan.backends.errors.TranscriberError`
    (``endpoint`` and ``status`` set).
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        model: str = DEFAULT_MODEL,
        api_key: str | None = None,
        language: str | None = None,
        word_timestamps: bool = False,
        **kwargs: Any,
    ) -> None:
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        super().__init__(transcriptions_url(base_url), headers=headers, **kwargs)
        if not urlsplit(self.endpoint).path.endswith(API_PATH):
            raise ValueError(f"not an OpenAI transcription endpoint: {redact_url(self.endpoint)!r}")
        self.model = model
        self.language = language
        self.word_timestamps = word_timestamps
        self._verbose_ok = word_timestamps

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> Transcript:
        """Send ``pcm`` ``[S]`` (float32, ``sample_rate`` Hz) as a 16-bit WAV; return its :class:`Transcript`."""
        pcm, wav = self._wav_upload(pcm, sample_rate)
        if wav is None:
            return Transcript(text="", words=[] if self._verbose_ok else None)
        files = {"file": ("audio.wav", wav, "audio/wav")}
        data: dict[str, Any] = {"model": self.model}
        if self.language:
            data["language"] = self.language
        refused: TranscriberError | None = None
        if self._verbose_ok:
            verbose = {**data, "response_format": "verbose_json", "timestamp_granularities[]": ["word"]}
            try:
                reply = await self._post(files=files, data=verbose)
            except TranscriberError as exc:
                if exc.status not in (400, 422):
                    raise
                refused = exc
            else:
                return await off_loop(len(reply.body), self._transcript, reply, True)
        reply = await self._post(files=files, data={**data, "response_format": "json"})
        transcript = await off_loop(len(reply.body), self._transcript, reply, False)
        if refused is not None:
            # Plain json worked where verbose_json did not: the server lacks word timestamps; stop asking.
            log.info("%s refused verbose_json (%s); using plain json from now on", redact_url(self.endpoint), refused)
            self._verbose_ok = False
        return transcript

    def _transcript(self, reply: HTTPReply, verbose: bool) -> Transcript:
        payload = self._json(reply)
        if not verbose:
            return Transcript(text=clean_asr_text(payload["text"]))
        words = self._words(payload.get("words"), reply.status, text_key="word", start_key="start", end_key="end")
        return Transcript(text=clean_asr_text(payload["text"]), words=words)
