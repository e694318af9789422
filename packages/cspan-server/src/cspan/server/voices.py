"""The voices of ``cspan serve``: the server's named voices, and voices a client sends as a recording.

**Named voices** (:class:`VoiceCatalog`): the checkpoint's ``voices/`` (``$CSPAN_VOICES_DIR`` over them), PersonaPlex's
``voices.tgz`` (``NATF2`` ...: input embeddings; never a default) and the ``--voice`` file when it is not one of
those (named by its stem). ``GET /info`` lists them; a client names one (``/ws`` ``start.voice``, ``/api/chat``
``voice_prompt``, ``/v1/realtime`` ``session.voice``). Each is loaded once, when first asked for, on the engine
thread (a recording among them is Mimi-encoded there); the default is loaded at start-up so that a broken file fails
then.

**A client's recording** (:meth:`cspan.server.session.Session.set_voice_audio`): 2 to 30 s of speech in any format
libsndfile reads (WAV, FLAC, OGG Vorbis/Opus, MP3), at most :data:`VOICE_AUDIO_MAX_BYTES`. It is read, resampled and
loudness-normalised on a worker thread (:func:`cspan.core.voice.prepare_voice_audio`, as ``cspan voice encode``),
then Mimi-encoded on the engine thread (one pass; tens of milliseconds for 30 s on a GPU, during which the frame
clock waits), and becomes the session's voice for its persona prefix. A recording that is too short, too long,
silent or not audio is refused (``bad_voice_audio``) and the session keeps the voice it had. Each protocol carries
the bytes its own way (``docs/PROTOCOL.md``); :class:`VoiceUpload` collects them when they come in pieces.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import io
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOICE_AUDIO_MAX_BYTES = 8 * 1024 * 1024
"""Largest recording a client may send as its voice (8 MiB: 30 s of 48 kHz stereo 16-bit WAV fits)."""

VOICE_RECORDINGS_PER_SESSION = 8
"""Recordings one connection may send: each is decoded on a worker thread and a good one Mimi-encoded on the engine
thread that every session's frame clock shares, so a client cannot keep it busy."""

VOICE_RECORDINGS_PER_USER = 16
"""Recordings one user (the principal of the credential) may send in :data:`VOICE_RECORDINGS_WINDOW_S`, over all its
connections: opening more connections does not buy more engine time (:class:`RecordingBudget`)."""

VOICE_RECORDINGS_WINDOW_S = 60.0
"""The window of :data:`VOICE_RECORDINGS_PER_USER`, in seconds."""


@dataclass(frozen=True)
class Voice:
    """A voice a session speaks with.

    Attributes:
        name: a named voice of the server, or ``recording-<12 hex digits of the recording's SHA-256>`` for a
            recording a client sent.
        prompt: the :class:`~cspan.core.voice.VoicePrompt` (Mimi codes, or PersonaPlex input embeddings).
    """

    name: str
    prompt: Any


def recording_name(data: bytes) -> str:
    """The name of a client's recording: ``recording-`` and the first 12 hex digits of its SHA-256."""
    return "recording-" + hashlib.sha256(data).hexdigest()[:12]


def prepare_recording(data: bytes) -> Any:
    """A client's recording read as a voice prompt (:func:`cspan.core.voice.prepare_voice_audio`; run it off the
    event loop: it decodes, resamples and measures up to 30 s of audio).

    Raises:
        AudioInputError: too large, not audio, a sample rate outside 1 kHz..768 kHz, shorter than 2 s, longer than
            30 s, or silent.
    """
    from cspan.core.errors import AudioInputError
    from cspan.core.voice import prepare_voice_audio

    if len(data) > VOICE_AUDIO_MAX_BYTES:
        raise AudioInputError(
            f"the voice recording: {len(data)} bytes, over the limit of {VOICE_AUDIO_MAX_BYTES} bytes; send 2 to 30 s "
            "of speech (a compressed format such as FLAC, OGG or MP3 is smaller)"
        )
    return prepare_voice_audio(io.BytesIO(data), name="the voice recording")


class RecordingBudget:
    """The voice recordings of each user over all its connections: at most ``per_window`` read in any ``window_s``
    seconds, and one at a time (the next one is decoded once the previous one is encoded, so the engine thread runs
    frames between them). Per connection, :data:`VOICE_RECORDINGS_PER_SESSION` applies as well.

    Args:
        per_window: recordings a user may send in ``window_s``.
        window_s: the window, in seconds.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        per_window: int = VOICE_RECORDINGS_PER_USER,
        window_s: float = VOICE_RECORDINGS_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_window = per_window
        self.window_s = window_s
        self.clock = clock
        self._times: dict[str, collections.deque[float]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def take(self, user_id: str) -> bool:
        """Count one recording of ``user_id``; False (nothing counted) when the user has sent ``per_window`` in the
        last ``window_s`` seconds."""
        now = self.clock()
        for user in [u for u, t in self._times.items() if t[-1] <= now - self.window_s]:  # users gone quiet
            del self._times[user]
            if user in self._locks and not self._locks[user].locked():
                del self._locks[user]
        times = self._times.setdefault(user_id, collections.deque())
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if len(times) >= self.per_window:
            return False
        times.append(now)
        return True

    def lock(self, user_id: str) -> asyncio.Lock:
        """The lock that makes ``user_id``'s recordings one at a time."""
        return self._locks.setdefault(user_id, asyncio.Lock())


class VoiceUpload:
    """The bytes of a recording a client announced (``size`` bytes) and sends in pieces.

    Raises (from :meth:`add`):
        ValueError: more bytes than announced.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._data = bytearray()

    @property
    def received(self) -> int:
        return len(self._data)

    @property
    def complete(self) -> bool:
        return len(self._data) >= self.size

    def add(self, piece: bytes) -> bytes | None:
        """Add one piece; the whole recording once complete, else None."""
        if len(self._data) + len(piece) > self.size:
            raise ValueError(
                f"{len(self._data) + len(piece)} bytes of a voice recording announced as {self.size} bytes; announce "
                "its exact size"
            )
        self._data += piece
        return bytes(self._data) if self.complete else None


class VoiceCatalog:
    """The server's named voices (see the module docstring).

    Args:
        checkpoint: the loaded :class:`~cspan.core.checkpoint.Checkpoint` (``voices``, ``archive_voices``).
        default: ``--voice``: a name, a ``NAME.pt`` spelling of one, a voice file or a recording; None: the first of
            the checkpoint's ``voices/``; "": no voice prompt by default.

    Raises:
        SettingsError: ``--voice`` names no voice or file, its file cannot be read, or it is a recording that
            cannot be a voice (the message starts with ``--voice``; exit status 2, as for ``cspan infer``).
    """

    def __init__(self, checkpoint: Any, default: str | None) -> None:
        from cspan.core.errors import CheckpointError, CspanError, SettingsError
        from cspan.core.voice import default_voice_name, find_voice, load_voice_prompt

        self.checkpoint = checkpoint
        own = dict(getattr(checkpoint, "voices", {}) or {})
        self.files: dict[str, Path] = {**(getattr(checkpoint, "archive_voices", {}) or {}), **own}
        self._prompts: dict[str, Any] = {}
        name: str | None = default_voice_name(checkpoint)  # as cspan infer and cspan bench
        if default is not None:
            name = default or None
        if default:
            try:
                path = find_voice(os.path.expanduser(default), checkpoint).resolve()
            except CheckpointError as exc:
                raise SettingsError(f"--voice {default}: {exc}") from None
            name = next((n for n, f in self.files.items() if Path(f).resolve() == path), None)
            if name is None:
                name = path.stem if path.stem not in self.files else path.name
                self.files[name] = path
        self.default: str | None = name
        self._given = default  # as --voice spelled it, for messages
        if name is not None:
            try:
                self._prompts[name] = load_voice_prompt(self.files[name], checkpoint)
            except CspanError as exc:
                raise SettingsError(f"--voice {default or name}: {exc}") from None

    def check_default_persona(self, text_prompt: str) -> None:
        """Refuse a default persona (the default voice and ``--text-prompt``) that takes more than half of the
        model's attention window, as ``cspan infer`` does (:meth:`cspan.core.prefix.PersonaPrefix.too_long_for`):
        every conversation that keeps the server's defaults would fail to start.

        Raises:
            SettingsError: the message starts with ``--voice`` (the voice takes most of it) or ``--text-prompt``.
        """
        from cspan.core.errors import SettingsError
        from cspan.core.prefix import build_persona_prefix

        checkpoint = self.checkpoint
        window = getattr(getattr(checkpoint, "lm_config", None), "context", None)
        layout = getattr(checkpoint, "prefix_layout", None)
        if window is None or layout is None:
            return
        voice = self._prompts.get(self.default) if self.default else None
        prefix = build_persona_prefix(getattr(checkpoint, "tokenizer", None), text_prompt, voice, layout=layout)
        too_long = prefix.too_long_for(window, characters=len(text_prompt))
        if too_long is None:
            return
        if voice is not None and prefix.voice_frames >= len(prefix.text_ids):
            raise SettingsError(
                f"--voice {self._given or self.default}: {too_long}. Use a shorter voice prompt (2-30 s)"
            )
        raise SettingsError(f"--text-prompt: {too_long}. Shorten the text prompt")

    @property
    def names(self) -> list[str]:
        """Every named voice, sorted."""
        return sorted(self.files)

    async def get(self, requested: str | None, engine_thread: Any) -> Voice | None:
        """The voice ``requested`` (None: the default; "": none), loaded on ``engine_thread`` the first time.

        Raises:
            KeyError: not a voice of this server. CspanError: its file cannot be read.
        """
        name = self.default if requested is None else requested
        if not name:
            return None
        if name not in self.files:
            raise KeyError(name)
        if name not in self._prompts:
            self._prompts[name] = await engine_thread.load_voice(self.files[name], self.checkpoint)
        return Voice(name, self._prompts[name])


__all__ = [
    "VOICE_AUDIO_MAX_BYTES",
    "VOICE_RECORDINGS_PER_SESSION",
    "VOICE_RECORDINGS_PER_USER",
    "VOICE_RECORDINGS_WINDOW_S",
    "RecordingBudget",
    "Voice",
    "VoiceCatalog",
    "VoiceUpload",
    "prepare_recording",
    "recording_name",
]
