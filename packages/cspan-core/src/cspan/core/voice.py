"""Voice prompts: Mimi codes, PersonaPlex embedding voices, and voices made from a recording (``cspan voice``).

A voice prompt is one of:

- **codes**: ``{"codes": LongTensor[8, N]}``, the agent's Mimi codes of N frames (this project's format, the
  Context Spanning release's ``voices/*.pt``);
- **embeddings**: ``{"embeddings": [E, 1, 1, D], "cache": LongTensor[1, K, R]}``, what NVIDIA PersonaPlex saves from
  a voice recording (``LMGen._step_voice_prompt_core`` with ``save_voice_prompt_embeddings``, moshi/models/lm.py) and
  ships as ``voices.tgz`` (``NATF0.pt`` ...): the input embeddings the model read at positions ``0 .. E - 1``
  (E = N - 1: the voice's first frame never reaches the model) and ``LMGen``'s token ring after the voice, whose
  last columns hold the codes the model reads from position E on;
- **audio** (any file soundfile reads, 2 to 30 s): loudness-normalised to -24 LUFS and Mimi-encoded as PersonaPlex's
  ``LMGen.load_voice_prompt`` does (``normalize_audio``: pyloudnorm's integrated loudness, gain applied in float64),
  giving codes.

``cspan voice encode IN OUT`` (:mod:`cspan.core.commands`) writes a recording's voice as a ``.pt`` holding ``codes``, plus ``embeddings`` and
``cache`` when the checkpoint uses PersonaPlex's prefix layout, so the one file loads here and in PersonaPlex.

Only ``torch.load(weights_only=True)`` reads voice files (:func:`cspan.core.torch_files.load_torch_file`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from .constants import FRAME_SIZE, NUM_CODEBOOKS, PAD, SAMPLE_RATE, SINE_TOKENS
from .errors import AudioInputError, CheckpointError, CspanError, SettingsError
from .torch_files import load_torch_file

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

VOICE_MIN_SECONDS = 2.0
"""Shortest recording accepted as a voice."""
VOICE_MAX_SECONDS = 30.0
"""Longest recording accepted as a voice."""
VOICE_TARGET_LUFS = -24.0
"""Loudness a voice recording is normalised to (PersonaPlex's ``load_voice_prompt``)."""
READ_BLOCK_FRAMES = 1 << 16
"""Frames a recording is decoded in (all its channels at a time; channel 0 is kept)."""
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")
"""File suffixes taken as recordings when a voice is named by its stem."""
TORCH_SUFFIXES = (".pt", ".pth")
"""Names of voice files written with ``torch.save`` (never read as recordings)."""
ENV_VOICES = "CSPAN_VOICES_DIR"
"""A folder of voice files whose names select a voice as a checkpoint's own do (:func:`env_voices`)."""
DEFAULT_DELAYS = (0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1)
"""Per-stream delays of the 7B (text, agent cb0..7, user cb0..7), used when no checkpoint is given."""


@dataclass(frozen=True)
class VoicePrompt:
    """A loaded voice prompt: Mimi codes, or PersonaPlex input embeddings with the frames that follow them.

    Attributes:
        source: the file it was read from.
        codes: [C, N] long Mimi codes (codes and audio voices), else None.
        embeddings: [E, D] float input embeddings of positions ``0 .. E - 1`` (embedding voices), else None.
        frames: [K, E] long frames in the model's coordinates (embedding voices): frame j is read at position
            ``j + 1 + delay``; the entries that reach positions >= E come from the stored token ring, the others
            are PersonaPlex's dummy frame (text PAD, audio initial token) and are never read as tokens.
    """

    source: Path
    codes: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None
    frames: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        """``"codes"`` or ``"embeddings"``."""
        return "codes" if self.codes is not None else "embeddings"

    @property
    def num_frames(self) -> int:
        """N for codes, E for embeddings."""
        return int(self.codes.shape[-1]) if self.codes is not None else int(self.embeddings.shape[0])  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------------------------
# Finding and reading voice files
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointVoices:
    """What finding and loading a voice needs of a checkpoint, for the verbs that do not load its LM (``cspan
    prepare``): :func:`find_voice`, :func:`load_voice_prompt`, :func:`load_voice` and :func:`choose_voice` take it
    where they take a :class:`~cspan.core.checkpoint.Checkpoint` (:func:`cspan.core.checkpoint.checkpoint_voices`
    makes one).

    Attributes:
        voices: the checkpoint's own voices (``voices/``, with ``$CSPAN_VOICES_DIR`` over them), as
            ``Checkpoint.voices``.
        archive_voices: the voices of PersonaPlex's ``voices.tgz``, as ``Checkpoint.archive_voices``.
        lm_config: the LM's configuration (``card``, ``dim``, delays: what a voice file must fit).
        prefix_layout: the persona prefix layout.
        mimi: the codec that encodes a recording (None: a recording is refused).
    """

    voices: dict[str, Path]
    archive_voices: dict[str, Path]
    lm_config: Any
    prefix_layout: Any
    mimi: Any = None


class CheckpointLike(Protocol):
    """What the functions of this module read of a checkpoint: a loaded :class:`~cspan.core.checkpoint.Checkpoint`,
    or a :class:`CheckpointVoices` (attributes as there)."""

    @property
    def voices(self) -> dict[str, Path]: ...

    @property
    def archive_voices(self) -> dict[str, Path]: ...

    @property
    def lm_config(self) -> Any: ...

    @property
    def prefix_layout(self) -> Any: ...

    @property
    def mimi(self) -> Any: ...


def env_voices() -> dict[str, Path]:
    """The voices of ``$CSPAN_VOICES_DIR`` (:func:`scan_voices`; empty when it is unset).

    Raises:
        CheckpointError: the variable names no folder (a typo there would leave every voice name unknown with no
            word about why).
    """
    env_dir = os.environ.get(ENV_VOICES)
    if not env_dir:
        return {}
    folder = Path(env_dir).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"{ENV_VOICES}={env_dir}: not a folder; point it at a folder of voice files or unset it")
    return scan_voices(folder)


def scan_voices(*dirs: Path | None) -> dict[str, Path]:
    """Voice name -> file for the voice files of ``dirs`` (``<name>.pt``, or a recording ``<name>.wav`` / ``.flac`` /
    ``.ogg`` / ``.mp3``); a ``.pt`` wins over a recording of the same name, an earlier folder over a later one."""
    voices: dict[str, Path] = {}
    for d in dirs:
        if d is None or not d.is_dir():
            continue
        for suffix in (".pt", *AUDIO_SUFFIXES):
            for p in sorted(d.glob(f"*{suffix}")):
                if p.is_file():
                    voices.setdefault(p.stem, p)
    return voices


def known_voices(checkpoint: CheckpointLike | None) -> dict[str, Path]:
    """Every voice a name can select, name -> file: the checkpoint's ``voices.tgz`` voices, its ``voices/`` over
    them, ``$CSPAN_VOICES_DIR`` over both.

    Raises:
        CheckpointError: ``$CSPAN_VOICES_DIR`` names no folder.
    """
    known = {}
    if checkpoint is not None:
        known = {**getattr(checkpoint, "archive_voices", {}), **checkpoint.voices}
    return {**known, **env_voices()}


def known_voice(name: str, checkpoint: CheckpointLike | None) -> Path | None:
    """The file of the voice called ``name`` (:func:`known_voices`), also spelled with its file suffix (``NATF2.pt``,
    as PersonaPlex's ``--voice-prompt`` takes it); None when no voice has that name."""
    known = known_voices(checkpoint)
    if name in known:
        return known[name]
    stem = Path(name).stem
    if Path(name).suffix in (".pt", *AUDIO_SUFFIXES) and stem in known and "/" not in name:
        return known[stem]
    return None


def default_voice_name(checkpoint: CheckpointLike | None) -> str | None:
    """The voice a run speaks with when none is named (``cspan infer``, ``cspan serve``, ``cspan bench``): the first
    by name of the checkpoint's own voices (``voices/``, ``$CSPAN_VOICES_DIR``); None when it has none. PersonaPlex's
    ``voices.tgz`` is never a default: it holds a choice of speakers, one is named (``--voice NATF2``)."""
    own = getattr(checkpoint, "voices", None) or {}
    return min(own) if own else None


def find_voice(name_or_path: str | os.PathLike[str], checkpoint: CheckpointLike | None = None) -> Path:
    """The file of a voice: an existing file, a voice name of the checkpoint (or ``$CSPAN_VOICES_DIR``), or such a
    name with its file suffix (``NATF2.pt``, as PersonaPlex's ``--voice-prompt`` takes it).

    Raises:
        CheckpointError: an empty name, a directory, or neither a file nor a known voice (lists the known ones).
    """
    if not str(name_or_path).strip():  # Path("") is the working directory
        raise CheckpointError(
            f"voice {str(name_or_path)!r} is empty; pass a voice name, a .pt voice file or a 2-30 s recording"
        )
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.expanduser().is_file():  # ~/voices/me.pt from a settings file or --voice=~/...: as --checkpoint does
        return path.expanduser()
    name = str(name_or_path)
    found = known_voice(name, checkpoint)
    if found is not None:
        return found
    known = known_voices(checkpoint)
    if path.is_dir():  # a voice's name wins over a folder of that name in the working directory
        raise CheckpointError(
            f"voice {str(path)!r} is a directory; pass a voice name, a .pt voice file, or a 2-30 s recording (a folder "
            f"of voices is given with {ENV_VOICES}={path})"
        )
    names = ", ".join(sorted(known)) or "none"
    missing_archive = ""
    layout = getattr(checkpoint, "prefix_layout", None)
    if layout is not None and layout.name == "personaplex" and not getattr(checkpoint, "archive_voices", None):
        missing_archive = (
            "; this checkpoint has PersonaPlex's prefix layout but no voices.tgz came with it (with HF_HUB_OFFLINE, a "
            "Hugging Face cache that lacks it: fetch it once online, e.g. `hf download nvidia/personaplex-7b-v1 "
            "voices.tgz`)"
        )
    raise CheckpointError(
        f"voice {str(path)!r} is not a file and {name!r} is not a known voice (known voices: {names}); pass a voice "
        f"name, a .pt voice file, or a 2-30 s recording{missing_archive}"
    )


def is_torch_file(path: Path) -> bool:
    """A zip archive (``torch.save``) or a legacy pickle, by its first bytes."""
    with path.open("rb") as fh:
        head = fh.read(4)
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


def is_recording(path: Path) -> bool:
    """A voice file to encode as a recording: neither a torch file nor named as one (``.pt``, ``.pth``: a damaged one
    is refused as a damaged voice file, not as audio that cannot be decoded)."""
    return path.suffix.lower() not in TORCH_SUFFIXES and not is_torch_file(path)


def _not_a_torch_file(path: Path) -> CheckpointError:
    return CheckpointError(
        f"voice file {str(path)!r} is named as a torch file but is not one (torch.save writes a zip archive): it is "
        f"damaged or truncated, or not a voice; get it again, or give a recording by its audio name "
        f"({', '.join(AUDIO_SUFFIXES)})"
    )


def load_voice_prompt(name_or_path: str | os.PathLike[str], checkpoint: CheckpointLike | None = None) -> VoicePrompt:
    """Load a voice prompt in any of its forms (module docstring).

    Args:
        name_or_path: a voice name (``voices/<name>.pt`` of the checkpoint, of ``voices.tgz``, or of
            ``$CSPAN_VOICES_DIR``), a ``.pt`` voice file, or a recording.
        checkpoint: supplies the voice names, the LM sizes the file must match (``card``, ``dim``, delays) and the
            Mimi codec that encodes a recording (2048 / the 7B's layout without one; a recording then fails).

    Returns:
        A :class:`VoicePrompt` on the CPU; codes are preferred where a file holds both forms.

    Raises:
        CheckpointError: unknown name, unreadable file, keys or shapes or values that do not fit the model (each
            names the file and the key), a recording without a checkpoint to encode it.
        AudioInputError: a recording that is too short, too long, silent or not audio.
    """
    path = find_voice(name_or_path, checkpoint)
    if is_recording(path):
        if checkpoint is None or getattr(checkpoint, "mimi", None) is None:
            raise CheckpointError(
                f"voice file {str(path)!r} is not a torch file; a voice from a recording needs the checkpoint's "
                "Mimi codec to encode it (load it with a checkpoint, or run `cspan voice encode` first)"
            )
        codes, _ = encode_voice_audio(path, checkpoint.mimi)
        return VoicePrompt(source=path, codes=codes)
    if not is_torch_file(path):
        raise _not_a_torch_file(path)
    obj = load_torch_file(path, "voice")
    if not isinstance(obj, dict) or not ({"codes"} <= set(obj) or {"embeddings", "cache"} <= set(obj)):
        keys = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(
            f"voice file {str(path)!r}: key 'codes' missing (it holds {keys}); expected {{'codes': LongTensor[8, P]}} "
            "(this project's voices) or {'embeddings', 'cache'} (a PersonaPlex voice)"
        )
    cfg = checkpoint.lm_config if checkpoint is not None else None
    if "codes" in obj:
        card = cfg.card if cfg is not None else 2048
        return VoicePrompt(source=path, codes=_check_codes(obj["codes"], path, card))
    return _embedding_voice(path, obj["embeddings"], obj["cache"], cfg)


def voice_codes(voice: VoicePrompt, checkpoint: CheckpointLike | None = None) -> torch.Tensor | None:
    """The Mimi codes [8, N] of a loaded voice: its own, or for a PersonaPlex embedding voice those of the recording
    of the same name beside its file (``NATF2.wav`` beside ``NATF2.pt``, encoded with the checkpoint's Mimi); None
    when it has none (:func:`load_voice` refuses it then)."""
    if voice.codes is not None:
        return voice.codes
    for suffix in AUDIO_SUFFIXES:
        audio = voice.source.with_suffix(suffix)
        if audio.is_file() and checkpoint is not None and getattr(checkpoint, "mimi", None) is not None:
            return encode_voice_audio(audio, checkpoint.mimi)[0]
    return None


def load_voice(
    name_or_path: str | os.PathLike[str],
    checkpoint: CheckpointLike | None = None,
    *,
    needed_by: str = "this",
) -> torch.Tensor:
    """The Mimi codes of a voice: ``{"codes": LongTensor[8, P]}``, or a recording encoded with the checkpoint's Mimi.

    A PersonaPlex embedding voice has no codes; when a recording of the same name lies next to it (``NATF2.wav``
    beside ``NATF2.pt``), that recording is encoded instead (PersonaPlex derived the ``.pt`` from it, and both give
    the same prefix from the voice's last frame on); otherwise it is refused (the engine takes it as it is:
    :func:`load_voice_prompt`).

    Args:
        name_or_path: see :func:`load_voice_prompt`.
        checkpoint: supplies the voice names, ``card`` and the Mimi codec (for recordings).
        needed_by: what needs the codes, for the refusal of an embedding voice ("training").

    Returns:
        LongTensor [8, P] on CPU.

    Raises:
        CheckpointError: as :func:`load_voice_prompt`; an embedding voice without a recording beside it.
        AudioInputError: a bad recording.
    """
    voice = load_voice_prompt(name_or_path, checkpoint)
    codes = voice_codes(voice, checkpoint)
    if codes is not None:
        return codes
    raise CheckpointError(
        f"voice file {str(voice.source)!r} is a PersonaPlex voice in embeddings form only (input embeddings and a "
        f"token cache), without the Mimi codes {needed_by} needs; make a codes voice from the recording it was made "
        "from with `cspan voice encode IN.wav OUT.pt` (or put that recording beside it, with the same name) and use "
        "that"
    )


@dataclass(frozen=True)
class ChosenVoice:
    """The voice a run speaks with (:func:`choose_voice`).

    Attributes:
        name: the voice as ``--voice`` named it (a name, a file, a recording), or the default voice's name.
        prompt: its :class:`VoicePrompt`.
        default: chosen because no voice was named (:func:`default_voice_name`).
    """

    name: str
    prompt: VoicePrompt
    default: bool = False

    @property
    def form(self) -> str:
        """``"codes"``, ``"embeddings"`` (PersonaPlex's) or ``"recording"`` (Mimi-encoded when it was loaded)."""
        return "recording" if is_recording(self.prompt.source) else self.prompt.kind

    def describe(self) -> dict[str, Any]:
        """What an output records of it: ``{"voice", "voice_file", "voice_sha256", "voice_form", "voice_default"}``
        (``voice_sha256``: the SHA-256 of the file's bytes, so that a voice file changed in place is another voice:
        a resumed benchmark renders again)."""
        return {
            "voice": self.name,
            "voice_file": str(self.prompt.source),
            "voice_sha256": _file_sha256(self.prompt.source),
            "voice_form": self.form,
            "voice_default": self.default,
        }


def _file_sha256(path: Path) -> str | None:
    """The SHA-256 of a file's bytes (hex), None when it cannot be read any more."""
    import hashlib

    digest = hashlib.sha256()
    try:
        with Path(path).open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


NO_VOICE: dict[str, Any] = {
    "voice": None,
    "voice_file": None,
    "voice_sha256": None,
    "voice_form": None,
    "voice_default": False,
}
""":meth:`ChosenVoice.describe` of a run without a voice prompt."""


def describe_voice(voice: ChosenVoice | None) -> dict[str, Any]:
    """:meth:`ChosenVoice.describe`, or :data:`NO_VOICE` for None."""
    return dict(NO_VOICE) if voice is None else voice.describe()


def voice_summary(voice: ChosenVoice | None, checkpoint: CheckpointLike | None = None) -> str:
    """Which voice speaks, in words for the console: ``voice NAME (FORM, FILE)`` (``, the default`` when none was
    named), or ``no voice prompt`` (naming the voices of ``voices.tgz`` when the checkpoint has only those)."""
    if voice is not None:
        default = ", the default" if voice.default else ""
        return f"voice {voice.name} ({voice.form}, {voice.prompt.source}{default})"
    archive = sorted(getattr(checkpoint, "archive_voices", None) or {})
    if archive and not getattr(checkpoint, "voices", None):
        listed = ", ".join(archive[:6]) + (" ..." if len(archive) > 6 else "")
        return f"no voice prompt (a voice of voices.tgz is never the default: name one with --voice: {listed})"
    return "no voice prompt"


def check_voice_path(voice: str | None, flag: str = "--voice") -> None:
    """Refuse, before the model loads, a ``--voice`` that is a path (it holds a ``/``: voice names do not) where no
    file is; a name is checked against the checkpoint's voices once it is loaded (:func:`choose_voice`).

    Raises:
        SettingsError: the message starts with ``flag`` (exit status 2).
    """
    if voice and "/" in voice:
        path = Path(voice).expanduser()
        if not path.exists():
            raise SettingsError(
                f"{flag} {voice}: no such file; pass a voice name, a .pt voice file, or a 2-30 s recording"
            )
        if path.is_dir():
            raise SettingsError(f"{flag} {voice}: is a directory; pass a .pt voice file or a 2-30 s recording")


def choose_voice(
    voice: str | os.PathLike[str] | None,
    checkpoint: CheckpointLike | None,
    flag: str = "--voice",
) -> ChosenVoice | None:
    """The voice of a run's ``--voice``, as every verb resolves and loads it (``cspan infer``, ``cspan serve``'s
    default, ``cspan bench``): a voice name of the checkpoint (its ``voices/``, PersonaPlex's ``voices.tgz``,
    ``$CSPAN_VOICES_DIR``; also ``NAME.pt``), a ``.pt`` voice file (codes or PersonaPlex embeddings) or a recording
    (encoded with the checkpoint's Mimi) (:func:`load_voice_prompt`); None: the default voice
    (:func:`default_voice_name`), and None when there is none.

    Raises:
        SettingsError: the voice cannot be found or read (the message starts with ``flag`` and the voice; exit
            status 2).
    """
    default = voice is None
    name = default_voice_name(checkpoint) if voice is None else str(voice)
    if name is None:
        return None
    try:
        return ChosenVoice(name=name, prompt=load_voice_prompt(name, checkpoint), default=default)
    except CspanError as exc:
        raise SettingsError(f"{flag} {name}: {exc}") from None


def _check_codes(codes: Any, path: Path, card: int) -> torch.Tensor:
    import torch

    where = f"voice file {str(path)!r}, key 'codes'"
    if not isinstance(codes, torch.Tensor):
        raise CheckpointError(f"{where}: expected a tensor, got {type(codes).__name__}")
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise CheckpointError(f"{where}: dtype {codes.dtype}, expected an integer dtype")
    if codes.dim() != 2 or codes.shape[0] != NUM_CODEBOOKS or codes.shape[1] < 1:
        raise CheckpointError(f"{where}: shape {list(codes.shape)}, expected [{NUM_CODEBOOKS}, P] with P >= 1 frames")
    codes = codes.to(torch.long).clone()
    lo, hi = int(codes.min()), int(codes.max())
    if lo < 0 or hi >= card:
        raise CheckpointError(f"{where}: values in [{lo}, {hi}], expected [0, {card}) (Mimi codes)")
    return codes


def _embedding_voice(path: Path, embeddings: Any, cache: Any, cfg: Any | None) -> VoicePrompt:
    """Validate a PersonaPlex ``{"embeddings", "cache"}`` voice and restore its frames from the token ring."""
    import torch

    where = f"voice file {str(path)!r}"
    if not isinstance(embeddings, torch.Tensor) or not embeddings.is_floating_point():
        raise CheckpointError(f"{where}, key 'embeddings': expected a floating tensor [E, 1, 1, D]")
    if embeddings.dim() < 2 or embeddings.shape[0] < 1 or math.prod(embeddings.shape[1:-1]) != 1:
        raise CheckpointError(f"{where}, key 'embeddings': shape {list(embeddings.shape)}, expected [E, 1, 1, D]")
    emb = embeddings.reshape(embeddings.shape[0], embeddings.shape[-1]).clone()
    if not bool(torch.isfinite(emb.float()).all()):
        raise CheckpointError(f"{where}, key 'embeddings': contains NaN or infinite values")
    if cfg is not None and emb.shape[1] != cfg.dim:
        raise CheckpointError(
            f"{where}, key 'embeddings': width {emb.shape[1]}, but the LM's dim is {cfg.dim}; the voice was made for "
            "another model"
        )
    delays = list(cfg.delays) if cfg is not None else list(DEFAULT_DELAYS)
    card = cfg.card if cfg is not None else 2048
    text_card = cfg.text_card if cfg is not None else 32000
    K = len(delays)
    if not isinstance(cache, torch.Tensor) or cache.is_floating_point() or cache.dtype == torch.bool:
        raise CheckpointError(f"{where}, key 'cache': expected an integer tensor [1, {K}, R]")
    ring = cache.reshape(cache.shape[-2], cache.shape[-1]) if cache.dim() == 3 and cache.shape[0] == 1 else cache
    if ring.dim() != 2 or ring.shape[0] != K or ring.shape[1] < max(delays) + 1:
        raise CheckpointError(
            f"{where}, key 'cache': shape {list(cache.shape)}, expected [1, {K}, R] with R > {max(delays)} (the "
            "token ring of the model's streams)"
        )
    ring = ring.to(torch.long)
    limits = torch.tensor([text_card] + [card] * (K - 1))[:, None]
    if bool((ring < 0).any()) or bool((ring > limits).any()):
        raise CheckpointError(
            f"{where}, key 'cache': token ids outside [0, text_card {text_card}] / [0, card {card}]; the voice was "
            "made for another model"
        )
    initial = [text_card] + [card] * (K - 1)
    frames = frames_from_ring(ring, emb.shape[0], delays, initial)
    return VoicePrompt(source=path, embeddings=emb, frames=frames)


def frames_from_ring(
    ring: torch.Tensor, num_embeddings: int, delays: Sequence[int], initial: Sequence[int]
) -> torch.Tensor:
    """The frames [K, E] of an embedding voice in the model's coordinates, from PersonaPlex's token ring.

    PersonaPlex's frame f (0 .. N-1, N = E + 1 voice calls) row k sits in ring column ``(f + delays[k]) mod R`` and
    is read at position ``f + delays[k]``; our frame j is its frame j + 1 (its frame 0 never reaches the model).
    Entries read at positions >= E (after the embeddings) come from the ring; the others get PersonaPlex's dummy
    frame of ``step_embeddings``: text PAD, audio ``initial`` (they are read as embeddings, never as tokens).

    Args:
        ring: [K, R] long, ``LMGen``'s token cache after the voice calls.
        num_embeddings: E.
        delays: K per-stream delays.
        initial: K initial token ids (text_card, card ...), the dummy audio.

    Returns:
        [K, E] long.
    """
    import torch

    R = ring.shape[1]
    E = int(num_embeddings)
    frames = torch.tensor(initial, dtype=torch.long)[:, None].repeat(1, E)
    frames[0] = PAD
    for k, d in enumerate(delays):
        for j in range(E):
            position = j + 1 + d  # PersonaPlex frame f = j + 1 is read at position f + d
            if position >= E:
                frames[k, j] = ring[k, position % R]
    return frames


# ---------------------------------------------------------------------------------------------------------------
# A voice from a recording
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VoiceAudio:
    """A recording prepared as PersonaPlex prepares a voice prompt.

    Attributes:
        pcm: float32 [N * 1920] at 24 kHz, loudness-normalised and zero-padded to whole frames (what Mimi encodes).
        samples: samples before padding.
        loudness_lufs: integrated loudness of the read samples (ITU-R BS.1770-4, pyloudnorm).
        gain: linear gain applied (``10 ** ((-24 - loudness) / 20)``).
    """

    pcm: Any
    samples: int
    loudness_lufs: float
    gain: float

    @property
    def num_frames(self) -> int:
        """N."""
        return len(self.pcm) // FRAME_SIZE


def prepare_voice_audio(
    source: str | os.PathLike[str] | BinaryIO, *, sample_rate: int = SAMPLE_RATE, name: str | None = None
) -> VoiceAudio:
    """Read a recording as a voice prompt: channel 0, resampled to 24 kHz (soxr), loudness-normalised to -24 LUFS
    with pyloudnorm (``Meter(24000).integrated_loudness``, then ``normalize.loudness``; the gain is applied in float64
    and the result rounded to float32, as PersonaPlex's ``normalize_audio`` with NumPy 2), zero-padded to whole
    1920-sample frames.

    Args:
        source: a file, or a binary file object holding one (bytes a client sent: ``io.BytesIO(data)``); any format
            libsndfile reads (WAV, FLAC, OGG Vorbis/Opus, MP3 ...).
        sample_rate: the codec's rate.
        name: what the error messages call the recording (default: the file's path, or "the voice recording").

    Raises:
        AudioInputError: not audio, a sample rate outside 1 kHz..768 kHz, shorter than 2 s, longer than 30 s, or
            silent. NaN or infinite samples are read as silence and counted in a warning
            (:func:`cspan.core.audio.sanitize_pcm`). At most 30 s of samples are ever decoded (a file whose header
            under-states its length is refused when the samples run past the limit).
    """
    import numpy as np
    import pyloudnorm
    import soundfile as sf

    from .audio import SILENCE_PEAK, _open, decode_error_cause, open_decoder, resample, sanitize_pcm

    if isinstance(source, (str, os.PathLike)):
        label = name or str(source)
        opened = _open(Path(source))
    else:
        label = name or "the voice recording"
        opened = open_decoder(source, label, "send a recording libsndfile reads")
    longest = f"{VOICE_MIN_SECONDS:.0f} to {VOICE_MAX_SECONDS:.0f} s of speech"
    with opened as f:
        rate, frames = int(f.samplerate), int(f.frames)
        limit = math.ceil(VOICE_MAX_SECONDS * rate)
        if frames > limit:
            raise AudioInputError(
                f"{label}: is {frames / rate:.1f} s long, over the limit of {VOICE_MAX_SECONDS:.0f} s for a voice; "
                f"use {longest}"
            )
        # channel 0 only, a block at a time: a small compressed file of many channels at a high rate (8 channels at
        # 655 kHz: 3 MB of FLAC) would otherwise decode to every channel at once (690 MB for 30 s)
        parts, got = [], 0
        try:
            while got <= limit:
                block = f.read(frames=min(READ_BLOCK_FRAMES, limit + 1 - got), dtype="float32", always_2d=True)
                if not len(block):
                    break
                parts.append(np.array(block[:, 0], dtype=np.float32))
                got += len(block)
        except (sf.LibsndfileError, RuntimeError) as exc:
            raise AudioInputError(
                f"{label}: decoding failed part-way ({decode_error_cause(exc)}); the file is damaged"
            ) from None
        data = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
    if len(data) > limit:
        raise AudioInputError(f"{label}: is over the limit of {VOICE_MAX_SECONDS:.0f} s for a voice; use {longest}")
    data, nonfinite = sanitize_pcm(data)
    if nonfinite:
        log.warning("%s: %d NaN or infinite samples read as silence", label, nonfinite)
    pcm = resample(np.ascontiguousarray(data), rate, sample_rate)
    if not len(pcm) or float(np.max(np.abs(pcm))) < SILENCE_PEAK:
        why = f"; its {nonfinite} NaN or infinite samples count as silence" if nonfinite else ""
        raise AudioInputError(f"{label}: is silent (peak below -80 dBFS{why}); record some speech")
    seconds = len(pcm) / sample_rate
    if seconds < VOICE_MIN_SECONDS:
        raise AudioInputError(f"{label}: is {seconds:.2f} s long; a voice needs {longest}")
    loudness = float(pyloudnorm.Meter(sample_rate).integrated_loudness(pcm))
    if not math.isfinite(loudness):
        raise AudioInputError(f"{label}: is silent (no loudness above the -70 LUFS gate); record some speech")
    import warnings

    with warnings.catch_warnings():  # pyloudnorm warns about clipping; the codec takes any float
        warnings.simplefilter("ignore")
        normalised = pyloudnorm.normalize.loudness(pcm.astype(np.float64), loudness, VOICE_TARGET_LUFS)
    gain = float(np.power(10.0, (VOICE_TARGET_LUFS - loudness) / 20.0))
    frames = -(-len(pcm) // FRAME_SIZE)
    out = np.zeros(frames * FRAME_SIZE, dtype=np.float32)
    out[: len(pcm)] = normalised.astype(np.float32)
    return VoiceAudio(pcm=out, samples=len(pcm), loudness_lufs=loudness, gain=gain)


def encode_voice_pcm(audio: VoiceAudio, mimi: Any) -> torch.Tensor:
    """The Mimi codes of a prepared recording (:func:`prepare_voice_audio`): one causal pass from a fresh state, the
    same codes as PersonaPlex's frame-by-frame streaming encode.

    Returns:
        LongTensor [8, N] on CPU.
    """
    import torch

    device = next(mimi.parameters()).device
    with torch.no_grad():
        codes = mimi.encode(torch.from_numpy(audio.pcm).to(device)[None, None])  # [1, C, N]
    return codes[0, :NUM_CODEBOOKS].to("cpu", torch.long).clone()


def encode_voice_audio(path: str | os.PathLike[str] | BinaryIO, mimi: Any) -> tuple[torch.Tensor, VoiceAudio]:
    """A recording's voice codes: :func:`prepare_voice_audio`, then :func:`encode_voice_pcm`.

    Returns:
        (LongTensor [8, N] on CPU, the prepared :class:`VoiceAudio`).

    Raises:
        AudioInputError: see :func:`prepare_voice_audio`.
    """
    audio = prepare_voice_audio(path, sample_rate=int(mimi.sample_rate))
    return encode_voice_pcm(audio, mimi), audio


def check_embeddings_card(card: int, user_placeholder: Sequence[int] = SINE_TOKENS) -> None:
    """Whether a model whose audio streams have ``card`` codes can hold PersonaPlex's embeddings form of a voice
    (:func:`voice_embeddings_form`): its frames carry ``user_placeholder`` (default PersonaPlex's 440 Hz sine frame,
    codes of the released 2048-code Mimi) as the user's audio, which must be codes of this model (0 .. card - 1).
    Checked from the configuration, before the LM loads (``cspan voice encode``); the embedding lookup of a code out
    of range was an IndexError traceback.

    Raises:
        CheckpointError: a placeholder code outside 0 .. ``card`` - 1; the message says to write the codes form only.
    """
    codes = [int(code) for code in user_placeholder]
    if min(codes) >= 0 and max(codes) < card:
        return
    what = (
        "PersonaPlex's 440 Hz sine frame, codes of the released 2048-code Mimi"
        if tuple(codes) == SINE_TOKENS
        else f"codes {codes}"
    )
    raise CheckpointError(
        f"this model's audio streams have {card} codes, but PersonaPlex's embeddings form of a voice holds the user's "
        f"placeholder frame ({what}, up to {max(codes)}); write the codes form only (cspan voice encode "
        "--no-embeddings)"
    )


def voice_embeddings_form(
    codes: torch.Tensor,
    lm: Any,
    *,
    user_placeholder: Sequence[int] = SINE_TOKENS,
) -> dict[str, torch.Tensor]:
    """PersonaPlex's ``{"embeddings", "cache"}`` of a voice given as codes, as ``LMGen`` saves it after
    ``load_voice_prompt`` with ``save_voice_prompt_embeddings``.

    ``embeddings`` [N - 1, 1, 1, D] (the LM's dtype) are the input embeddings of positions ``0 .. N - 2`` of the voice
    frames ``[PAD, codes, SINE]`` laid out as PersonaPlex feeds them; ``cache`` [1, K, R] (R = max delay + 3) is
    ``LMGen``'s token ring after the N voice calls.

    Raises:
        ValueError: fewer than 2 frames (PersonaPlex needs one call that runs the model).
        CheckpointError: ``user_placeholder`` is not codes of this model (:func:`check_embeddings_card`: PersonaPlex's
            sine frame on a codec of fewer than 2048 codes).
    """
    import torch

    from .streams import delay_tokens

    check_embeddings_card(int(lm.card), user_placeholder)
    codes = torch.as_tensor(codes).long().cpu()
    C, N = codes.shape
    if N < 2:
        raise ValueError(f"a voice needs at least 2 frames for the embeddings form, got {N}")
    delays = list(lm.delays)
    K = len(delays)
    initial = [lm.text_initial_token_id] + [lm.initial_token_id] * (K - 1)
    frames = torch.tensor([PAD] + [0] * C + list(user_placeholder), dtype=torch.long)[:, None].repeat(1, N)
    frames[1 : 1 + C] = codes
    positions = delay_tokens(frames[:, 1:], delays, initial)[:, : N - 1]  # PersonaPlex's positions 0 .. N-2
    with torch.no_grad():
        embeddings = lm.embed(positions[None].to(lm.device))[0]  # [N - 1, D]
    R = max(delays) + 3
    ring = torch.full((K, R), -2, dtype=torch.long)
    for offset in range(N):  # LMGen.prepare_step_input of each voice call
        for k, d in enumerate(delays):
            ring[k, (offset + d) % R] = frames[k, offset]
            if offset <= d:
                ring[k, offset % R] = initial[k]
    return {"embeddings": embeddings.detach().cpu()[:, None, None].clone(), "cache": ring[None].clone()}


__all__ = [
    "NO_VOICE",
    "VOICE_MAX_SECONDS",
    "VOICE_MIN_SECONDS",
    "VOICE_TARGET_LUFS",
    "CheckpointLike",
    "CheckpointVoices",
    "ChosenVoice",
    "VoiceAudio",
    "VoicePrompt",
    "check_embeddings_card",
    "check_voice_path",
    "choose_voice",
    "default_voice_name",
    "describe_voice",
    "encode_voice_audio",
    "encode_voice_pcm",
    "env_voices",
    "find_voice",
    "frames_from_ring",
    "is_recording",
    "is_torch_file",
    "known_voice",
    "known_voices",
    "load_voice",
    "load_voice_prompt",
    "prepare_voice_audio",
    "scan_voices",
    "voice_codes",
    "voice_embeddings_form",
    "voice_summary",
]
