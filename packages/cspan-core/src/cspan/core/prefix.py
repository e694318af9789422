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

Reading it (see ``docs/ENGINE.md``): the prefix has P frames, so it covers calls ``0 .. P`` of the session: the
positions ``0 .. P`` of the delayed sequence (:func:`cspan.core.streams.delay_tokens`) go through the temporal
transformer in one forward, then the sampling tail runs once on the hidden state of position P (text and agent
semantic codes of frame P sampled, the acoustic codes of frame P - 1 forced). The session is then exactly where
P + 1 calls forcing the same columns would have left it (KV cache, token grid, next frames), and the first live
call feeds position P + 1 with user frame P.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .constants import NUM_CODEBOOKS, PAD, SILENCE_TOKENS, SINE_TOKENS
from .errors import CheckpointError
from .streams import TokenGrid, delay_tokens

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


TailSampler = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(hidden [1, D], text_logits [1, V], target [1, K]) -> column [1, K]``: the sampling tail of one call."""


@torch.no_grad()
def read_prefix(lm: Any, lm_state: Any, grid: TokenGrid, row: int, frames: torch.Tensor, tail: TailSampler) -> float:
    """Read prefix frames into session ``row`` (freshly reset) in one temporal forward plus one sampling tail.

    Args:
        lm: the :class:`cspan.core.lm.LMModel`.
        lm_state: the engine's temporal state; row ``row`` must be empty (offset 0).
        grid: the engine's token grid; row ``row`` is overwritten.
        row: the session.
        frames: [K, P] long undelayed prefix frames, P >= 1.
        tail: samples the target column (the engine's own sampler, with the session's generator).

    Returns:
        Wall-clock milliseconds (after device synchronisation).

    Raises:
        ValueError: P == 0.
    """
    P = frames.shape[-1]
    if P < 1:
        raise ValueError("read_prefix needs at least one frame")
    device = grid.device
    delayed = delay_tokens(frames.to(device), grid.delays, grid.initial_t)  # [K, P + 1 + D]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    grid.load(row, delayed, pending_position=P)
    rows = torch.tensor([row], dtype=torch.long, device=device)
    hidden, text_logits = lm.temporal(delayed[None, :, : P + 1], lm_state, rows=rows)  # positions 0..P
    target = grid.buffer[row, :, grid.target][None]  # position P + 1: acoustics of frame P - 1 known
    column = tail(hidden[:, -1], text_logits[:, -1], target)
    grid.commit_row(row, column[0])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1000.0


__all__ = [
    "PersonaPrefix",
    "PrefixReport",
    "build_persona_prefix",
    "persona_text",
    "prefix_frames",
    "read_prefix",
]
