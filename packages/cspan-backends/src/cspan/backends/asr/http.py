"""``HTTPTranscriber``: the plain ``POST /transcribe`` protocol, and the HTTP machinery both remote transcribers share.

Protocol (kept from the original system's ``duetaspan/align/asr.py`` and ``runtime/asr_server.py``): a multipart
POST with the field ``file`` = a 16-bit PCM WAV at the clip's own sample rate, optional form field ``language``;
the answer is JSON ``{"text": ...}`` (``cspan asr-serve`` adds ``words``). Unlike the original, failures raise
:class:`~cspan.backends.errors.TranscriberError` instead of returning empty text.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from cspan.backends.asr.audio import AudioFormatError, as_mono_float32, check_sample_rate, encode_wav
from cspan.backends.asr.base import Transcript, Word, clean_asr_text
from cspan.backends.errors import TranscriberError

log = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8990/transcribe"


class RemoteTranscriber:
    """Shared HTTP plumbing: one ``httpx.AsyncClient``, timeouts, retries, error mapping.

    Retries: only when the connection could not be made (``httpx.ConnectError``, ``httpx.ConnectTimeout``), at most
    ``max_attempts`` tries in all, sleeping ``backoff_s * 2**(n-1)`` seconds after the n-th failure. A request that
    reached the server is never repeated: read/write timeouts and HTTP error statuses raise at once.

    Use as ``async with`` or call :meth:`aclose` to release connections. A client passed in is used as is and
    never closed here.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 10.0,
        connect_timeout_s: float = 2.0,
        max_attempts: int = 3,
        backoff_s: float = 0.25,
        headers: Mapping[str, str] | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"transcriber endpoint must be an http(s) URL, got {endpoint!r}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.endpoint = endpoint
        self.timeout_s = float(timeout_s)
        self.max_attempts = int(max_attempts)
        self.backoff_s = float(backoff_s)
        self._timeout = httpx.Timeout(self.timeout_s, connect=float(connect_timeout_s))
        self._headers = dict(headers or {})
        self._external_client = client
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    def _get_client(self) -> httpx.AsyncClient:
        if self._external_client is not None:
            return self._external_client
        loop = asyncio.get_running_loop()
        # An AsyncClient's connections belong to the loop that opened them; a new loop gets a new client.
        if self._client is None or self._client_loop is not loop:
            self._client = httpx.AsyncClient(timeout=self._timeout)
            self._client_loop = loop
        return self._client

    async def aclose(self) -> None:
        """Close the client this transcriber opened (not one passed in)."""
        if self._client is not None and self._client_loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = None
        self._client_loop = None

    async def __aenter__(self) -> RemoteTranscriber:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _error(self, message: str, status: int | None = None) -> TranscriberError:
        return TranscriberError(f"{self.endpoint}: {message}", endpoint=self.endpoint, status=status)

    def _wav_upload(self, pcm: np.ndarray, sample_rate: int) -> tuple[np.ndarray, bytes | None]:
        """Validate the clip and encode it; returns ``(pcm [S], wav bytes)`` or ``(pcm, None)`` for an empty clip."""
        try:
            pcm = as_mono_float32(pcm)
            sample_rate = check_sample_rate(sample_rate)
        except AudioFormatError as exc:
            raise self._error(f"cannot send this clip: {exc}") from exc
        if pcm.size == 0:
            return pcm, None
        return pcm, encode_wav(pcm, sample_rate)

    async def _post(self, *, files: dict[str, Any], data: Mapping[str, Any]) -> httpx.Response:
        """POST multipart ``files`` + ``data`` with the retry policy; returns a 2xx response.

        Raises:
            TranscriberError: no connection after ``max_attempts`` tries, a timeout or transport failure after
                connecting (``status`` None), or an HTTP status >= 400 (``status`` set, the server's message quoted).
        """
        client = self._get_client()
        last_exc: Exception | None = None
        for attempt in range(1, self.max_attempts + 1):
            try:
                response = await client.post(
                    self.endpoint, files=files, data=dict(data), headers=self._headers, timeout=self._timeout
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                last_exc = exc
                if attempt < self.max_attempts:
                    delay = self.backoff_s * 2 ** (attempt - 1)
                    log.warning(
                        "transcriber %s: connection failed (%s), attempt %d/%d; retrying in %.2f s",
                        self.endpoint,
                        exc,
                        attempt,
                        self.max_attempts,
                        delay,
                    )
                    await asyncio.sleep(delay)
                continue
            except httpx.TimeoutException as exc:
                raise self._error(
                    f"no answer within {self.timeout_s:g} s ({type(exc).__name__}); the server is overloaded or "
                    "the clip is too long for it; raise the timeout or check the server"
                ) from exc
            except httpx.HTTPError as exc:
                raise self._error(f"request failed after connecting: {type(exc).__name__}: {exc}") from exc
            if response.status_code >= 400:
                raise self._error(
                    f"HTTP {response.status_code}: {_server_message(response)}", status=response.status_code
                )
            return response
        raise self._error(
            f"could not connect after {self.max_attempts} attempt(s) ({type(last_exc).__name__}: {last_exc}); "
            "is the ASR server running? Start one with `cspan asr-serve` or fix the URL"
        )

    def _json(self, response: httpx.Response) -> dict[str, Any]:
        try:
            payload = response.json()
        except ValueError as exc:
            raise self._error(
                f"HTTP {response.status_code} with a body that is not JSON: {response.text[:200]!r}",
                status=response.status_code,
            ) from exc
        if not isinstance(payload, dict) or not isinstance(payload.get("text"), str):
            raise self._error(f"answer has no string field 'text': {str(payload)[:200]}", status=response.status_code)
        return payload

    def _words(self, items: Any, status: int, *, text_key: str, start_key: str, end_key: str) -> list[Word] | None:
        """Parse a JSON list of word objects; ``None`` when the server sent none."""
        if items is None:
            return None
        try:
            return [Word(text=w[text_key].strip(), start_s=float(w[start_key]), end_s=float(w[end_key])) for w in items]
        except (TypeError, KeyError, ValueError) as exc:
            raise self._error(f"malformed 'words' in the answer ({exc}): {str(items)[:200]}", status=status) from exc


class HTTPTranscriber(RemoteTranscriber):
    """Transcribe through a plain ``POST /transcribe`` server such as ``cspan asr-serve``.

    Args:
        url: the endpoint; a bare ``http://host:port`` gets ``/transcribe`` appended.
        language: optional language code sent as the form field ``language`` (``"en"``); ``None`` sends nothing.
        timeout_s, connect_timeout_s, max_attempts, backoff_s, client: see :class:`RemoteTranscriber`.

    ``transcribe(pcm [S] float32, sample_rate Hz)`` returns the server's text (Qwen3-ASR's language prefix
    stripped) and its ``words`` (``text``, ``start_s``, ``end_s``) when it sends them. Raises
    :class:`~cspan.backends.errors.TranscriberError`.
    """

    def __init__(self, url: str = DEFAULT_URL, *, language: str | None = None, **kwargs: Any) -> None:
        parts = urlsplit(url)
        if parts.path in ("", "/"):
            url = url.rstrip("/") + "/transcribe"
        super().__init__(url, **kwargs)
        self.language = language

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> Transcript:
        """Send ``pcm`` ``[S]`` (float32, ``sample_rate`` Hz) as a 16-bit WAV; return its :class:`Transcript`."""
        pcm, wav = self._wav_upload(pcm, sample_rate)
        if wav is None:
            return Transcript(text="")
        data = {"language": self.language} if self.language else {}
        response = await self._post(files={"file": ("audio.wav", wav, "audio/wav")}, data=data)
        payload = self._json(response)
        words = self._words(
            payload.get("words"), response.status_code, text_key="text", start_key="start_s", end_key="end_s"
        )
        return Transcript(text=clean_asr_text(payload["text"]), words=words)


def _server_message(response: httpx.Response) -> str:
    """The error text of a failed response: OpenAI's ``error.message``, FastAPI's ``detail``, or the raw body."""
    try:
        payload = response.json()
    except ValueError:
        return response.text[:300] or response.reason_phrase
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        if payload.get("detail"):
            return str(payload["detail"])[:300]
        if payload.get("message"):
            return str(payload["message"])
    return str(payload)[:300]
