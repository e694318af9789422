"""Recognition engines behind ``cspan asr-serve``: blocking, thread-safe ``transcribe`` calls.

- ``sphinx``: pocketsphinx with its bundled US-English model (:mod:`cspan.backends.asr.sphinx`), a pool of
  decoders so several requests decode at once. Low accuracy; needs nothing but ``pip``.
- ``transformers``: any local Hugging Face speech-recognition model directory loaded with
  ``transformers.pipeline("automatic-speech-recognition", model=PATH)``; the released setup uses Qwen3-ASR-1.7B in
  transformers format. Needs the optional ``transformers`` extra (and torch); it is imported only when this engine
  is chosen, so ``cspan.backends`` stays torch-free.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cspan.backends.asr.audio import as_mono_float32, check_sample_rate, resample
from cspan.backends.asr.base import Transcript, Word, clean_asr_text
from cspan.backends.asr.sphinx import SphinxDecoderPool
from cspan.backends.errors import BackendError, TranscriberError

log = logging.getLogger(__name__)

ENGINES = ("sphinx", "transformers")

_LANGUAGE_NAMES = {
    "english": "en",
    "korean": "ko",
    "chinese": "zh",
    "japanese": "ja",
    "german": "de",
    "french": "fr",
    "spanish": "es",
    "italian": "it",
    "portuguese": "pt",
    "russian": "ru",
    "arabic": "ar",
    "hindi": "hi",
}


class EngineLoadError(BackendError):
    """An engine could not start: a missing package, a missing or unreadable model directory."""


class EngineInputError(BackendError, ValueError):
    """A request the engine cannot serve (for example a language its model does not know)."""


def normalize_language(language: str) -> str:
    """``"en"``, ``"en-US"``, ``"English"`` -> ``"en"``: a lower-case ISO-639-1-style code."""
    code = language.strip().lower().replace("_", "-").split("-")[0]
    return _LANGUAGE_NAMES.get(code, code)


class Engine(Protocol):
    """A loaded recogniser. ``transcribe`` blocks and may be called from several threads at once."""

    name: str
    model: str
    language: str | None  # the only language it serves, or None for any / auto-detected

    def transcribe(self, pcm: np.ndarray, sample_rate: int, *, language: str | None = None) -> Transcript:
        """``pcm`` ``[S]`` float32 mono at ``sample_rate`` Hz -> :class:`Transcript` (``words`` when available)."""
        ...


class SphinxEngine:
    """The ``sphinx`` engine: a pool of ``workers`` pocketsphinx decoders (see :class:`SphinxDecoderPool`).

    Raises :class:`EngineLoadError` at construction when pocketsphinx or the model is missing (one decoder is
    created up front), and :class:`EngineInputError` for a language other than the model's.
    """

    name = "sphinx"

    def __init__(self, *, model_dir: str | Path | None = None, workers: int = 2) -> None:
        try:
            self.pool = SphinxDecoderPool(workers, model_dir=model_dir)
            self.pool.warm()
        except TranscriberError as exc:
            raise EngineLoadError(f"{exc}; (engine sphinx)") from exc
        self.model = str(model_dir) if model_dir is not None else "pocketsphinx-en-us"
        self.language = self.pool.language

    def transcribe(self, pcm: np.ndarray, sample_rate: int, *, language: str | None = None) -> Transcript:
        """Decode ``pcm`` ``[S]`` (float32, ``sample_rate`` Hz); returns text and word timings."""
        if language and self.language and normalize_language(language) != self.language:
            raise EngineInputError(
                f"language {language!r} is not served: the sphinx engine's model is {self.language!r} only; "
                "omit 'language' or run `cspan asr-serve --engine transformers` with a multilingual model"
            )
        return self.pool.decode(pcm, sample_rate)


class TransformersEngine:
    """The ``transformers`` engine: a local speech-recognition model directory run by a transformers pipeline.

    Use :meth:`load`. Calls are serialised by a lock (one model, one device); the server bounds how many wait.
    ``language`` is passed to Whisper-type models (``generate_kwargs``) and otherwise left to the model's own
    detection. Word timings are returned for CTC and Whisper models (the pipeline's ``return_timestamps="word"``);
    other models give ``words=None``. Qwen3-ASR's ``language X<asr_text>`` prefix is stripped.
    """

    name = "transformers"

    def __init__(self, pipe: Any, model: str) -> None:
        self._pipe = pipe
        self.model = model
        self.language: str | None = None
        self._lock = threading.Lock()
        extractor = getattr(pipe, "feature_extractor", None)
        self.sample_rate = int(getattr(extractor, "sampling_rate", 0) or 16000)
        kind = str(getattr(pipe, "type", ""))
        self._word_timestamps = kind in ("ctc", "ctc_with_lm", "seq2seq_whisper")
        self._whisper = kind == "seq2seq_whisper"

    @classmethod
    def load(
        cls, model_dir: str | Path, *, device: str = "auto", trust_remote_code: bool = False
    ) -> TransformersEngine:
        """Load ``model_dir`` (a local folder with ``config.json``) on ``device`` (``auto``: ``cuda:0`` if present).

        Raises:
            EngineLoadError: the folder is missing or not a transformers model, transformers is not installed,
                or the pipeline could not be built; the message says how to fix it (including ``--engine sphinx``).
        """
        path = Path(model_dir).expanduser()
        fallback = "or run the embedded engine instead: `cspan asr-serve --engine sphinx`"
        if not path.is_dir():
            raise EngineLoadError(
                f"--model {path}: no such model directory. Download a transformers-format speech-recognition model "
                f"there (the released setup uses Qwen3-ASR-1.7B), {fallback}"
            )
        if not (path / "config.json").is_file():
            raise EngineLoadError(f"--model {path}: not a transformers model directory (no config.json); {fallback}")
        try:
            import transformers
            from transformers.utils import is_torch_cuda_available
        except ImportError as exc:
            raise EngineLoadError(
                f"the transformers engine needs the transformers package (and torch), which is not installed ({exc}): "
                f"pip install 'cspan-backends[transformers]' (or pip install transformers), {fallback}"
            ) from exc
        if device == "auto":
            device = "cuda:0" if is_torch_cuda_available() else "cpu"
        log.info("loading %s with transformers %s on %s", path, transformers.__version__, device)
        try:
            pipe = transformers.pipeline(
                "automatic-speech-recognition", model=str(path), device=device, trust_remote_code=trust_remote_code
            )
        except Exception as exc:  # transformers raises many types (OSError, ValueError, KeyError, ...)
            raise EngineLoadError(
                f"--model {path}: transformers could not build a speech-recognition pipeline: "
                f"{type(exc).__name__}: {exc}. Check that it is a complete speech-recognition checkpoint "
                f"(add --trust-remote-code if it ships its own code), {fallback}"
            ) from exc
        return cls(pipe, str(path))

    def transcribe(self, pcm: np.ndarray, sample_rate: int, *, language: str | None = None) -> Transcript:
        """Run the pipeline on ``pcm`` ``[S]`` float32 resampled (soxr) to the model's rate.

        Raises:
            AudioFormatError: unusable array or sample rate.
            TranscriberError: the model failed on this clip.
        """
        pcm = as_mono_float32(pcm)
        sample_rate = check_sample_rate(sample_rate)
        if pcm.size == 0:
            return Transcript(text="", words=[] if self._word_timestamps else None)
        audio = resample(pcm, sample_rate, self.sample_rate)
        duration_s = audio.size / self.sample_rate
        kwargs: dict[str, Any] = {}
        if self._word_timestamps:
            kwargs["return_timestamps"] = "word"
        if language and self._whisper:
            kwargs["generate_kwargs"] = {"language": normalize_language(language)}
        try:
            with self._lock:
                out = self._pipe(audio, **kwargs)
        except Exception as exc:  # a model failure on one clip must become a clear 500, not kill the worker
            raise TranscriberError(
                f"transformers model {self.model} failed on a {duration_s:.1f} s clip: {type(exc).__name__}: {exc}",
                endpoint=f"transformers:{self.model}",
            ) from exc
        text = clean_asr_text(str(out.get("text", "")))
        words: list[Word] | None = None
        if self._word_timestamps:
            words = []
            for chunk in out.get("chunks") or []:
                start, end = chunk.get("timestamp") or (None, None)
                word = str(chunk.get("text", "")).strip()
                if not word or start is None:
                    continue
                start = min(max(float(start), 0.0), duration_s)
                end = duration_s if end is None else min(max(float(end), start), duration_s)
                words.append(Word(text=word, start_s=start, end_s=end))
        return Transcript(text=text, words=words)


def load_engine(
    name: str,
    *,
    model: str | Path | None = None,
    workers: int = 2,
    device: str = "auto",
    trust_remote_code: bool = False,
) -> Engine:
    """Build the engine called ``name`` (``sphinx`` or ``transformers``); raises :class:`EngineLoadError`."""
    if name == "sphinx":
        return SphinxEngine(model_dir=model, workers=workers)
    if name == "transformers":
        if model is None:
            raise EngineLoadError(
                "--engine transformers needs --model PATH, a local speech-recognition model directory "
                "(the released setup uses Qwen3-ASR-1.7B); or use `cspan asr-serve --engine sphinx`"
            )
        return TransformersEngine.load(model, device=device, trust_remote_code=trust_remote_code)
    raise EngineLoadError(f"unknown ASR engine {name!r}; choose one of {', '.join(ENGINES)}")
