"""The persona prefix: voice frames and the ``<system> ... <system>`` text prompt, read in ONE temporal forward.

Layout (undelayed frames, every row forced; NVIDIA/personaplex ``LMGen.step_system_prompts`` and MindLogic's
Context Spanning ``sequence_convention.persona_prefix``, with one silence frame after each part as the released
Context Spanning model was trained):

==================  =========  ===================  =========
frames              text       agent rows 1..8      user rows 9..16
==================  =========  ===================  =========
N voice frames      PAD (3)    voice codes [8, N]   SINE
1 silence frame     PAD        SILENCE              SINE        (only with a voice)
L text frames       t_1..t_L   SILENCE              SINE
1 silence frame     PAD        SILENCE              SINE        (only with text)
==================  =========  ===================  =========

``t_1..t_L = spm.encode(persona_text(prompt, user_name, user_city))``, one token per frame, where
:func:`persona_text` gives ``"<system> {prompt} The user's name is X. The user is in Y. <system>"``.

Reading it (see ``docs/ENGINE.md`` and :func:`prefix_block`): the prefix has P frames, so it covers calls
``0 .. P`` of the session. The engine reads positions ``0 .. P - 1`` of the delayed sequence
(:func:`cspan.core.streams.delay_tokens`) as a block in the session's next step, together with position P, whose
outputs are sampled (text and agent semantic codes of frame P; the acoustic codes of frame P - 1 are forced). The
session is then exactly where P + 1 calls forcing the same columns would have left it (KV cache, token grid, next
frames), and its next call feeds position P + 1 with user frame P.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .constants import NUM_CODEBOOKS, PAD, SILENCE_TOKENS, SINE_TOKENS
from .errors import CheckpointError
from .span import Block
from .streams import delay_tokens

SYSTEM_TAG = "<system>"


def persona_text(text_prompt: str | None, user_name: str | None = None, user_city: str | None = None) -> str:
    """The text of the prompt frames: ``"<system> {prompt}[ The user's name is X.][ The user is in Y.] <system>"``.

    A prompt already wrapped in ``<system> ... <system>`` is unwrapped first (PersonaPlex's ``wrap_with_system_tags``
    leaves such prompts as they are). Returns "" when there is no prompt, name or city (no text frames).
    """
    body = (text_prompt or "").strip()
    if len(body) >= 2 * len(SYSTEM_TAG) and body.startswith(SYSTEM_TAG) and body.endswith(SYSTEM_TAG):
        body = body[len(SYSTEM_TAG) : -len(SYSTEM_TAG)].strip()
    parts = [body] if body else []
    if user_name and user_name.strip():
        parts.append(f"The user's name is {user_name.strip()}.")
    if user_city and user_city.strip():
        parts.append(f"The user is in {user_city.strip()}.")
    if not parts:
        return ""
    return f"{SYSTEM_TAG} {' '.join(parts)} {SYSTEM_TAG}"


def prefix_frames(
    text_ids: Sequence[int],
    voice_codes: torch.Tensor | None = None,
    *,
    num_codebooks: int = NUM_CODEBOOKS,
    agent_placeholder: Sequence[int] = SILENCE_TOKENS,
    user_placeholder: Sequence[int] = SINE_TOKENS,
) -> torch.Tensor:
    """The undelayed prefix frames (table in the module docstring).

    Args:
        text_ids: the prompt's token ids (L; may be empty).
        voice_codes: [C, N] long Mimi codes of the voice prompt, or None.
        num_codebooks: C (8).
        agent_placeholder, user_placeholder: SILENCE and SINE codes (C each).

    Returns:
        [1 + 2C, P] long (P = 0 when there is neither voice nor text).

    Raises:
        ValueError: voice codes not [C, N].
    """
    C = num_codebooks
    silence = torch.tensor([PAD, *agent_placeholder, *user_placeholder], dtype=torch.long)  # [K]
    parts: list[torch.Tensor] = []
    if voice_codes is not None:
        voice = torch.as_tensor(voice_codes).long().cpu()
        if voice.dim() != 2 or voice.shape[0] != C:
            raise ValueError(f"voice_codes must be [{C}, N] Mimi codes, got shape {tuple(voice.shape)}")
        N = voice.shape[1]
        if N:
            frames = silence[:, None].repeat(1, N)
            frames[1 : 1 + C] = voice
            parts.append(frames)
            parts.append(silence[:, None])
    if len(text_ids):
        L = len(text_ids)
        frames = silence[:, None].repeat(1, L)
        frames[0] = torch.tensor([int(t) for t in text_ids], dtype=torch.long)
        parts.append(frames)
        parts.append(silence[:, None])
    if not parts:
        return torch.empty(1 + 2 * C, 0, dtype=torch.long)
    return torch.cat(parts, dim=1)


@dataclass(frozen=True)
class PersonaPrefix:
    """A built prefix: its text, token ids and frames.

    Attributes:
        text: the prompt text as tokenised (:func:`persona_text`), "" without text frames.
        text_ids: its L token ids.
        voice_frames: N.
        frames: [K, P] long undelayed frames.
    """

    text: str
    text_ids: tuple[int, ...]
    voice_frames: int
    frames: torch.Tensor

    @property
    def num_frames(self) -> int:
        """P."""
        return int(self.frames.shape[-1])


def build_persona_prefix(
    tokenizer: Any | None,
    text_prompt: str | None,
    voice_codes: torch.Tensor | None = None,
    *,
    user_name: str | None = None,
    user_city: str | None = None,
    num_codebooks: int = NUM_CODEBOOKS,
    agent_placeholder: Sequence[int] = SILENCE_TOKENS,
    user_placeholder: Sequence[int] = SINE_TOKENS,
) -> PersonaPrefix:
    """Tokenise the prompt and lay out the prefix frames.

    Args:
        tokenizer: SentencePiece processor (``encode(str) -> list[int]``); may be None when there is no text.
        text_prompt, user_name, user_city: see :func:`persona_text`.
        voice_codes: [C, N] long, or None.

    Raises:
        CheckpointError: text to tokenise but no tokenizer. ValueError: bad voice codes.
    """
    text = persona_text(text_prompt, user_name, user_city)
    ids: list[int] = []
    if text:
        if tokenizer is None:
            raise CheckpointError(
                "set_persona: a text prompt needs the checkpoint's SentencePiece tokenizer, and this engine has none; "
                "load the engine from a checkpoint (load_checkpoint) or pass tokenizer="
            )
        ids = [int(i) for i in tokenizer.encode(text)]
    frames = prefix_frames(
        ids,
        voice_codes,
        num_codebooks=num_codebooks,
        agent_placeholder=agent_placeholder,
        user_placeholder=user_placeholder,
    )
    n_voice = 0 if voice_codes is None else int(torch.as_tensor(voice_codes).shape[-1])
    return PersonaPrefix(text=text, text_ids=tuple(ids), voice_frames=n_voice, frames=frames)


@dataclass(frozen=True)
class PrefixReport:
    """What :meth:`cspan.core.engine.DuplexEngine.set_persona` did.

    Attributes:
        session: the batch row.
        num_frames: P, prefix frames (voice + silence + text + silence).
        voice_frames: N.
        text_frames: L.
        text: the prompt text as tokenised ("" without text).
        text_ids: its token ids.
        positions: P + 1 positions read in the single forward (0 .. P); 0 when there is no prefix.
        next_position: the position the first live call feeds (P + 1; 0 without a prefix).
        prefill_ms: wall-clock milliseconds of the forward and the sampling tail (after device synchronisation).
    """

    session: int
    num_frames: int
    voice_frames: int
    text_frames: int
    text: str
    text_ids: tuple[int, ...]
    positions: int
    next_position: int
    prefill_ms: float


@dataclass(frozen=True)
class PrefixBlock:
    """A persona prefix as the engine reads it: the block before the session's first position (see
    :func:`prefix_block`).

    Attributes:
        block: positions ``0 .. P - 1`` of the delayed prefix (:class:`cspan.core.span.Block`, with the prefix's
            input embeddings of its first E positions when it has them).
        delayed: [K, P + 1 + D] long, the whole delayed prefix: the session's token grid is loaded from it with
            pending position P.
        pending: P, the position the step that reads the block feeds (the prefix's last column).
    """

    block: Block
    delayed: torch.Tensor
    pending: int


def prefix_block(
    frames: torch.Tensor,
    delays: Sequence[int],
    initial_tokens: Sequence[int] | torch.Tensor,
    embeddings: torch.Tensor | None = None,
) -> PrefixBlock:
    """How a freshly reset session reads a persona prefix: in ONE step of the engine.

    The prefix covers calls ``0 .. P`` of the session. The step that reads it (``DuplexEngine.set_prefix``, then
    the session's next step) restarts the session with its grid at pending position P, reads positions
    ``0 .. P - 1`` as a block together with position P in the step's forward (all forced), and samples the target
    column ``P + 1`` from position P's outputs (text and agent semantic code of frame P; the acoustic codes of frame
    ``P - 1`` are the prefix's). It returns frame ``P - 1`` (the prefix's last frame). The session is then exactly
    where P + 1 calls forcing the same columns leave it (KV cache, token grid, next frames; tested in float32), and
    its next call, given user frame P, is call P + 1.

    Args:
        frames: [K, P] long undelayed prefix frames, P >= 1.
        delays, initial_tokens: the model's K delays and initial ids.
        embeddings: [E, D] input embeddings of positions ``0 .. E - 1`` (E <= P; a PersonaPlex voice stored as
            embeddings, which the temporal transformer reads instead of the token embeddings), or None.

    Raises:
        ValueError: P == 0, or more embeddings than block positions.
    """
    P = frames.shape[-1]
    if P < 1:
        raise ValueError("prefix_block needs at least one frame")
    if embeddings is not None and embeddings.shape[0] > P:
        raise ValueError(f"prefix_block: {embeddings.shape[0]} input embeddings for a block of {P} positions")
    delayed = delay_tokens(frames.cpu(), delays, torch.as_tensor(initial_tokens).cpu())  # [K, P + 1 + D]
    return PrefixBlock(block=Block(delayed[:, :P].contiguous(), embeddings), delayed=delayed, pending=P)


__all__ = [
    "PersonaPrefix",
    "PrefixBlock",
    "PrefixReport",
    "build_persona_prefix",
    "persona_text",
    "prefix_block",
    "prefix_frames",
]
