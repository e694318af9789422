"""The persona prefix: voice frames and the ``<system> ... <system>`` text prompt, read in ONE temporal forward.

Two layouts, chosen by the checkpoint (:attr:`cspan.core.checkpoint.Checkpoint.prefix_layout`, once at load):

**Context Spanning** (:data:`CONTEXT_SPANNING`; MindLogic's ``sequence_convention.persona_prefix``, the layout the
released Context Spanning model was trained with). Undelayed frames, every row forced:

==================  =========  ===================  =========
frames              text       agent rows 1..8      user rows 9..16
==================  =========  ===================  =========
N voice frames      PAD (3)    voice codes [8, N]   SINE
1 silence frame     PAD        SILENCE              SINE        (only with a voice)
L text frames       t_1..t_L   SILENCE              SINE
1 silence frame     PAD        SILENCE              SINE        (only with text)
==================  =========  ===================  =========

**PersonaPlex** (:data:`PERSONAPLEX`; NVIDIA/personaplex ``LMGen.step_system_prompts``, moshi/models/lm.py): N voice
frames, ``int(0.5 * 12.5)`` = 6 silence frames, L text frames, 6 silence frames (the silences always, also without
voice or text), same rows as above. PersonaPlex feeds these frames through ``LMGen.step`` from offset 0, where its
first call runs no model and initial tokens overwrite its frame 0 (the first voice frame, or the first silence frame
without a voice): that frame never reaches the model, so this layout drops it and P = N - 1 + 12 + L (the fixture
``shared/fixtures/reference/personaplex-prefix`` checks every convention).

``t_1..t_L = spm.encode(persona_text(prompt, user_name, user_city))``, one token per frame, where
:func:`persona_text` gives ``"<system> {prompt} The user's name is X. The user is in Y. <system>"``.

**Voices** (:class:`cspan.core.voice.VoicePrompt`): Mimi codes [8, N] (laid out as above), or a PersonaPlex voice
recorded as input embeddings (``{"embeddings", "cache"}``, ``LMGen.load_voice_prompt_embeddings``): E embeddings of
the positions ``0 .. E - 1`` plus the frames [K, E] that the model reads from position E on (restored from the stored
token ring). Such a voice takes the first E columns of ``frames`` in both layouts, and :attr:`PersonaPrefix.embeddings`
holds the E input embeddings that replace those positions' token embeddings.

Reading it (see ``docs/ENGINE.md`` and :func:`prefix_block`): the prefix has P frames, so it covers calls
``0 .. P`` of the session. The engine reads positions ``0 .. P - 1`` of the delayed sequence
(:func:`cspan.core.streams.delay_tokens`) as a block in the session's next step, together with position P, whose
outputs are sampled (text and agent semantic codes of frame P; the acoustic codes of frame P - 1 are forced); that
step returns frame P - 1, the prefix's last frame. The session is then exactly where P + 1 calls forcing the same
columns would have left it (KV cache, token grid, next frames), and its next call feeds position P + 1 with user
frame P. In PersonaPlex's terms, the step covers the P prompt calls plus its first conversation call (which feeds
the last silence frame and returns it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .config import CONTEXT_SPANNING, PERSONAPLEX, PREFIX_LAYOUTS, PrefixLayout
from .constants import NUM_CODEBOOKS, PAD, SILENCE_TOKENS, SINE_TOKENS
from .errors import CheckpointError
from .span import Block
from .streams import delay_tokens
from .text import clean_text, encode_text

if TYPE_CHECKING:
    from .voice import VoicePrompt

SYSTEM_TAG = "<system>"


def persona_text(text_prompt: str | None, user_name: str | None = None, user_city: str | None = None) -> str:
    """The text of the prompt frames: ``"<system> {prompt}[ The user's name is X.][ The user is in Y.] <system>"``.

    A prompt already wrapped in ``<system> ... <system>`` is kept as it is (stripped) when there is no name or city,
    as PersonaPlex's ``wrap_with_system_tags`` (moshi/offline.py) does, and unwrapped first otherwise. Control
    characters are read as spaces (:func:`cspan.core.text.clean_text`), so the result is the text tokenised. Returns
    "" when there is no prompt, name or city (no text frames), also when they hold nothing but such characters.
    """
    body, name, city = (clean_text(value or "").strip() for value in (text_prompt, user_name, user_city))
    wrapped = len(body) >= 2 * len(SYSTEM_TAG) and body.startswith(SYSTEM_TAG) and body.endswith(SYSTEM_TAG)
    if wrapped and not name and not city:
        return body
    if wrapped:
        body = body[len(SYSTEM_TAG) : -len(SYSTEM_TAG)].strip()
    parts = [body] if body else []
    if name:
        parts.append(f"The user's name is {name}.")
    if city:
        parts.append(f"The user is in {city}.")
    if not parts:
        return ""
    return f"{SYSTEM_TAG} {' '.join(parts)} {SYSTEM_TAG}"


def prefix_frames(
    text_ids: Sequence[int],
    voice_codes: torch.Tensor | None = None,
    *,
    layout: PrefixLayout = CONTEXT_SPANNING,
    voice_frames: torch.Tensor | None = None,
    num_codebooks: int = NUM_CODEBOOKS,
    agent_placeholder: Sequence[int] = SILENCE_TOKENS,
    user_placeholder: Sequence[int] = SINE_TOKENS,
) -> torch.Tensor:
    """The undelayed prefix frames, as the model reads them (tables in the module docstring).

    Args:
        text_ids: the prompt's token ids (L; may be empty).
        voice_codes: [C, N] long Mimi codes of the voice prompt, or None.
        layout: :data:`CONTEXT_SPANNING` or :data:`PERSONAPLEX`.
        voice_frames: [1 + 2C, E] long, the frames of an embedding voice in read coordinates
            (:attr:`cspan.core.voice.VoicePrompt.frames`), instead of ``voice_codes``; they open the prefix as they
            are (their first frame already dropped where PersonaPlex drops it).
        num_codebooks: C (8).
        agent_placeholder, user_placeholder: SILENCE and SINE codes (C each).

    Returns:
        [1 + 2C, P] long (P = 0 for the Context Spanning layout when there is neither voice nor text).

    Raises:
        ValueError: voice codes not [C, N], voice frames not [1 + 2C, E], or both given.
    """
    C = num_codebooks
    K = 1 + 2 * C
    silence = torch.tensor([PAD, *agent_placeholder, *user_placeholder], dtype=torch.long)  # [K]
    if silence.numel() != K:
        raise ValueError(f"agent_placeholder and user_placeholder must hold {C} codes each")
    if voice_codes is not None and voice_frames is not None:
        raise ValueError("give voice_codes or voice_frames, not both")
    head: list[torch.Tensor] = []  # frames in the model's coordinates (never dropped)
    parts: list[torch.Tensor] = []  # the layout's table (its first frame dropped for PersonaPlex)
    has_voice = False
    if voice_frames is not None:
        block = torch.as_tensor(voice_frames).long().cpu()
        if block.dim() != 2 or block.shape[0] != K:
            raise ValueError(f"voice_frames must be [{K}, E] frames, got shape {tuple(block.shape)}")
        has_voice = block.shape[1] > 0
        head.append(block)
    elif voice_codes is not None:
        voice = torch.as_tensor(voice_codes).long().cpu()
        if voice.dim() != 2 or voice.shape[0] != C:
            raise ValueError(f"voice_codes must be [{C}, N] Mimi codes, got shape {tuple(voice.shape)}")
        if voice.shape[1]:
            has_voice = True
            frames = silence[:, None].repeat(1, voice.shape[1])
            frames[1 : 1 + C] = voice
            parts.append(frames)
    gap = silence[:, None].repeat(1, layout.silence_frames)
    if has_voice or layout.always_silence:
        parts.append(gap)
    if len(text_ids):
        frames = silence[:, None].repeat(1, len(text_ids))
        frames[0] = torch.tensor([int(t) for t in text_ids], dtype=torch.long)
        parts.append(frames)
    if len(text_ids) or layout.always_silence:
        parts.append(gap)
    table = torch.cat(parts, dim=1) if parts else torch.empty(K, 0, dtype=torch.long)
    if layout.drop_first_frame and not head and table.shape[1]:
        table = table[:, 1:]
    return torch.cat([*head, table], dim=1)


@dataclass(frozen=True)
class PersonaPrefix:
    """A built prefix: its text, token ids, frames and (for an embedding voice) input embeddings.

    Attributes:
        text: the prompt text as tokenised (:func:`persona_text`), "" without text frames.
        text_ids: its L token ids.
        voice_frames: the columns of ``frames`` that hold the voice (N for Mimi codes in the Context Spanning
            layout, N - 1 in PersonaPlex's, E for an embedding voice).
        frames: [K, P] long undelayed frames, as the model reads them.
        embeddings: [E, D] input embeddings of the positions ``0 .. E - 1`` (an embedding voice), fed to the temporal
            transformer instead of those positions' token embeddings; None for token-only prefixes.
        layout: the :class:`PrefixLayout` name.
    """

    text: str
    text_ids: tuple[int, ...]
    voice_frames: int
    frames: torch.Tensor
    embeddings: torch.Tensor | None = None
    layout: str = CONTEXT_SPANNING.name

    @property
    def num_frames(self) -> int:
        """P."""
        return int(self.frames.shape[-1])

    def too_long_for(self, window: int | None, *, characters: int | None = None) -> str | None:
        """None when the prefix takes at most half of a ``window``-position attention window (None: unbounded),
        so that at least as much remains for the conversation; else why not, in words (``"the persona takes 15017
        frames (...) of the model's 3000-position attention window; at most 1500 leave room to talk"``). The one
        rule of ``cspan infer``, ``serve`` and ``prepare``.

        Args:
            window: the model's context (``LMConfig.context``).
            characters: the length of the persona text, for the message.
        """
        if window is None or self.num_frames <= window // 2:
            return None
        chars = f" from {characters} characters" if characters is not None else ""
        return (
            f"the persona takes {self.num_frames} frames ({self.voice_frames} of voice prompt, {len(self.text_ids)} "
            f"text tokens{chars}) of the model's {window}-position attention window; at most {window // 2} leave "
            "room to talk"
        )


def build_persona_prefix(
    tokenizer: Any | None,
    text_prompt: str | None,
    voice: VoicePrompt | torch.Tensor | None = None,
    *,
    layout: PrefixLayout = CONTEXT_SPANNING,
    user_name: str | None = None,
    user_city: str | None = None,
    num_codebooks: int = NUM_CODEBOOKS,
    agent_placeholder: Sequence[int] = SILENCE_TOKENS,
    user_placeholder: Sequence[int] = SINE_TOKENS,
) -> PersonaPrefix:
    """Tokenise the prompt and lay out the prefix frames in ``layout``.

    Args:
        tokenizer: SentencePiece processor (``encode(str) -> list[int]``); may be None when there is no text.
        text_prompt, user_name, user_city: see :func:`persona_text`.
        voice: a :class:`cspan.core.voice.VoicePrompt` (codes or embeddings), [C, N] long Mimi codes, or None.
        layout: the checkpoint's :class:`PrefixLayout` (``Checkpoint.prefix_layout``).

    Raises:
        CheckpointError: text to tokenise but no tokenizer. ValueError: bad voice codes or frames.
    """
    text = persona_text(text_prompt, user_name, user_city)
    ids: list[int] = []
    if text:
        if tokenizer is None:
            raise CheckpointError(
                "set_persona: a text prompt needs the checkpoint's SentencePiece tokenizer, and this engine has none; "
                "load the engine from a checkpoint (load_checkpoint) or pass tokenizer="
            )
        ids = encode_text(tokenizer, text)
    codes = voice if isinstance(voice, torch.Tensor) or voice is None else voice.codes
    block = None if isinstance(voice, torch.Tensor) or voice is None else voice.frames
    embeddings = None if isinstance(voice, torch.Tensor) or voice is None else voice.embeddings
    frames = prefix_frames(
        ids,
        codes,
        layout=layout,
        voice_frames=block,
        num_codebooks=num_codebooks,
        agent_placeholder=agent_placeholder,
        user_placeholder=user_placeholder,
    )
    if block is not None:
        n_voice = int(block.shape[-1])
    elif codes is not None:
        n_voice = max(0, int(torch.as_tensor(codes).shape[-1]) - int(layout.drop_first_frame))
    else:
        n_voice = 0
    return PersonaPrefix(
        text=text,
        text_ids=tuple(ids),
        voice_frames=n_voice,
        frames=frames,
        embeddings=embeddings,
        layout=layout.name,
    )


@dataclass(frozen=True)
class PrefixReport:
    """What :meth:`cspan.core.engine.DuplexEngine.set_persona` did.

    Attributes:
        session: the batch row.
        num_frames: P, prefix frames (voice + silence + text + silence).
        voice_frames: the prefix frames that hold the voice (:attr:`PersonaPrefix.voice_frames`: N, N - 1 in
            PersonaPlex's layout, E for an embedding voice).
        text_frames: L.
        text: the prompt text as tokenised ("" without text).
        text_ids: its token ids.
        positions: P + 1 positions read in the single forward (0 .. P); 0 when there is no prefix.
        next_position: the position fed by the call after the one that reads the prefix (P + 1; that call feeds
            P, :attr:`DuplexEngine.positions`); 0 without a prefix.
        prefill_ms: host milliseconds of building the prefix (its forward is part of the session's next step).
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


def prefix_inputs(lm: Any, delayed: torch.Tensor, embeddings: torch.Tensor | None) -> torch.Tensor:
    """The temporal transformer's input embeddings of the delayed positions ``delayed`` [K, T]: the token embeddings
    (:meth:`cspan.core.lm.LMModel.embed`), with the first E replaced by ``embeddings`` [E, D] (an embedding voice).

    Returns:
        [1, T, D] in the model's dtype and device.

    Raises:
        ValueError: more embeddings than positions, or a width other than the model's.
    """
    x = lm.embed(delayed[None])
    if embeddings is not None:
        E = int(embeddings.shape[0])
        if embeddings.dim() != 2 or x.shape[1] < E or embeddings.shape[1] != x.shape[2]:
            raise ValueError(
                f"prefix embeddings must be [E <= {x.shape[1]}, {x.shape[2]}], got {list(embeddings.shape)}"
            )
        x = torch.cat([embeddings.to(device=x.device, dtype=x.dtype)[None], x[:, E:]], dim=1)
    return x


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
    if embeddings is not None and (embeddings.dim() != 2 or embeddings.shape[0] > P):
        raise ValueError(f"prefix_block: input embeddings must be [E <= {P}, D], got {list(embeddings.shape)}")
    # long ids: the initial tokens (text_card, card) do not fit a uint8 or int8 frame tensor
    delayed = delay_tokens(frames.cpu().long(), delays, torch.as_tensor(initial_tokens).cpu())  # [K, P + 1 + D]
    return PrefixBlock(block=Block(delayed[:, :P].contiguous(), embeddings), delayed=delayed, pending=P)


__all__ = [
    "CONTEXT_SPANNING",
    "PERSONAPLEX",
    "PREFIX_LAYOUTS",
    "PersonaPrefix",
    "PrefixBlock",
    "PrefixLayout",
    "PrefixReport",
    "build_persona_prefix",
    "persona_text",
    "prefix_block",
    "prefix_frames",
    "prefix_inputs",
]
