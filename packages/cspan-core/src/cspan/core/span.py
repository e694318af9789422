"""Context Spans: the block layout shared by inference and training, and what a session reads before a position.

A reference text becomes the text ids ``[SPAN_OPEN] + spm.encode(text.strip()) + [SPAN_CLOSE]`` (12 ... 13; the
text cleaned of control characters first: :mod:`cspan.core.text`), one id per column. The block is n constant
columns in DELAYED coordinates (see :mod:`cspan.core.streams`): text row = the ids, agent rows = ``SILENCE_TOKENS``,
user rows = ``SINE_TOKENS`` (:func:`span_block`). It is inserted into the delayed token sequence before a position
(:func:`splice_block`), and the block columns are no training target (:func:`splice_mask`).

At inference a block is one :class:`Block` queued for a session (``DuplexEngine.inject_span``, host only): the
engine's next step splices it before the session's pending position ``c`` and reads it in the step's one ragged
forward, together with the session's next position and every other session's (no depformer, no sampling, no
audio for the block columns), so the next call feeds the column it would have fed, n positions later. In
undelayed terms (7B delays) this is the MOVE convention of MindLogic's Context Spanning / MoshiRAG training
(``assemble_training_sequence``): the block goes before frame ``f = c - 1`` and the acoustic codes of frame
``f - 1`` are read right after the block. Nothing is lost: frame ``c - 1``'s text and audio, sampled before the
block, come out of the next call as usual. The training side calls the very same :func:`span_block` and
:func:`splice_block` on whole delayed sequences, so the two layouts cannot drift apart. ``docs/ENGINE.md`` has a
diagram.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .checks import check_unicode, int_ids
from .constants import RET, SILENCE_TOKENS, SINE_TOKENS, SPAN_CLOSE, SPAN_OPEN
from .errors import SpanError
from .text import clean_text, encode_text

_SPECIAL_IDS = frozenset((RET, SPAN_OPEN, SPAN_CLOSE))


@dataclass(frozen=True)
class ContextSpan:
    """A reference to write into the model's context, as-is, as text tokens.

    Args:
        text: the reference exactly as the backend returned it (it is stripped before tokenisation).
        token_ids: the reference already tokenised (without the 12/13 markers); when given, ``text`` is only a
            label and no tokenizer is needed (see :meth:`from_ids`).
        markers: add the 12 / 13 markers (True, the trained layout); False makes ``token_ids`` the whole block
            (for experiments and tests of other block contents).

    Raises:
        SpanError: ``text`` holding a lone surrogate (bytes that were not UTF-8); (from :meth:`encode`) an empty
            reference; with the markers, ``token_ids`` holding ``<ret>`` or a marker (4, 12, 13).
        TypeError: ``text`` that is no str, ``token_ids`` that are not integers (numpy's and torch's are read as
            ints; a float or a bool is refused, not rounded).
    """

    text: str
    token_ids: tuple[int, ...] | None = field(default=None)
    markers: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"ContextSpan: the reference text is a str, got {type(self.text).__name__}")
        check_unicode(self.text, "ContextSpan: the reference text", SpanError)
        if self.token_ids is not None:
            object.__setattr__(self, "token_ids", int_ids(self.token_ids))

    @classmethod
    def from_ids(cls, token_ids: Sequence[int], text: str = "", markers: bool = True) -> ContextSpan:
        """A span from reference token ids (the markers are added by :meth:`encode` unless ``markers`` is False)."""
        return cls(text=text, token_ids=token_ids, markers=markers)  # type: ignore[arg-type]  # __post_init__: ints

    def encode(self, tokenizer: Any | None = None, max_frames: int | None = None) -> tuple[list[int], bool]:
        """The block's text ids ``[12] + spm.encode(text.strip()) + [13]`` (:func:`cspan.core.text.encode_text`) and whether they
        were truncated.

        Args:
            tokenizer: a SentencePiece processor (anything with ``encode(str) -> list[int]``); unused with
                ``token_ids``.
            max_frames: the longest block allowed (>= 3). Longer ids are cut at a token boundary: the first
                ``max_frames - 1`` ids are kept and the closing 13 appended (without markers: the first
                ``max_frames`` ids).

        Returns:
            (ids, truncated).

        Raises:
            SpanError: empty reference, no tokenizer for a text span, or ``max_frames < 3``.
        """
        if self.token_ids is not None:
            body = list(self.token_ids)
            special = sorted(_SPECIAL_IDS.intersection(body)) if self.markers else []
            if special:
                raise SpanError(
                    f"ContextSpan: the reference ids hold {special} (<ret>, span open, span close); a reference is "
                    "data between the markers, which encode() adds"
                )
        else:
            text = clean_text(self.text).strip()  # a control character is a space
            if not text:
                raise SpanError(
                    "ContextSpan: the reference text is empty; give the backend's answer (or skip the injection)"
                )
            if tokenizer is None:
                raise SpanError(
                    "ContextSpan.encode: a text span needs the checkpoint's SentencePiece tokenizer; pass it or use "
                    "ContextSpan.from_ids"
                )
            body = encode_text(tokenizer, text)
        if not body:
            raise SpanError(
                f"ContextSpan: the reference {self.text!r} encodes to no tokens; give a non-empty reference"
            )
        ids = [SPAN_OPEN, *body, SPAN_CLOSE] if self.markers else body
        truncated = False
        if max_frames is not None:
            if max_frames < 3:
                raise SpanError(f"max_span_frames is {max_frames}; it must be at least 3 (12, one token, 13)")
            if len(ids) > max_frames:
                ids = [*ids[: max_frames - 1], SPAN_CLOSE] if self.markers else ids[:max_frames]
                truncated = True
        return ids, truncated


def span_block(
    ids: Sequence[int] | torch.Tensor,
    *,
    num_streams: int = 17,
    agent_placeholder: Sequence[int] = SILENCE_TOKENS,
    user_placeholder: Sequence[int] = SINE_TOKENS,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The Context Span block in delayed coordinates: n constant columns that differ only in the text row.

    Row 0 = ``ids``; rows ``1 .. C`` = ``agent_placeholder`` (SILENCE codes); rows ``C + 1 .. 2C`` =
    ``user_placeholder`` (SINE codes), with ``C = (num_streams - 1) // 2`` codebooks per speaker.

    Args:
        ids: n text ids (normally from :meth:`ContextSpan.encode`).
        num_streams: K (17 for the 7B).
        agent_placeholder, user_placeholder: C codes each.
        device: of the result.

    Returns:
        [K, n] long.

    Raises:
        SpanError: no ids. ValueError: placeholders of the wrong length.
    """
    if len(ids) == 0:
        raise SpanError("span_block: a Context Span block needs at least one column")
    try:  # a list of ints through a typed buffer: several times faster than torch.as_tensor (spans of 600)
        ids_t = torch.frombuffer(array.array("q", ids), dtype=torch.long)
    except TypeError:  # a tensor, or ids that are not Python ints
        ids_t = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()
    n = ids_t.shape[0]
    C = (num_streams - 1) // 2
    if num_streams != 2 * C + 1 or len(agent_placeholder) != C or len(user_placeholder) != C:
        raise ValueError(
            f"span_block: {num_streams} streams need 1 text row and two placeholders of {C} codes; got "
            f"{len(agent_placeholder)} and {len(user_placeholder)}"
        )
    block = torch.empty(num_streams, n, dtype=torch.long)
    block[0] = ids_t
    block[1:] = torch.tensor([*agent_placeholder, *user_placeholder], dtype=torch.long)[:, None]
    return block if device is None else block.to(device)


def splice_block(delayed_tokens: torch.Tensor, position: int, block: torch.Tensor) -> torch.Tensor:
    """Insert a block into a delayed token sequence before ``position``.

    ``out[..., :position] = tokens[..., :position]``, ``out[..., position:position+n] = block``,
    ``out[..., position+n:] = tokens[..., position:]``. This is the one definition of where a Context Span goes,
    used by the engine (:meth:`TokenGrid.splice` on the session's grid window) and by ``cspan train`` (on whole sequences). At
    inference ``position`` is the pending position (the position the next call feeds).

    Args:
        delayed_tokens: [..., K, T] long, delayed coordinates.
        position: 0 <= position <= T.
        block: [K, n] long (broadcast over the leading dims).

    Returns:
        [..., K, T + n] long.

    Raises:
        ValueError: position outside ``[0, T]`` or K mismatch.
    """
    T = delayed_tokens.shape[-1]
    if not 0 <= position <= T:
        raise ValueError(f"splice_block: position {position} is outside [0, {T}]")
    if block.shape[-2] != delayed_tokens.shape[-2]:
        raise ValueError(f"splice_block: block has {block.shape[-2]} rows, tokens have {delayed_tokens.shape[-2]}")
    block = block.to(delayed_tokens.device, delayed_tokens.dtype).expand(*delayed_tokens.shape[:-1], block.shape[-1])
    return torch.cat([delayed_tokens[..., :position], block, delayed_tokens[..., position:]], dim=-1)


def splice_mask(mask: torch.Tensor, position: int, n: int, value: bool = False) -> torch.Tensor:
    """The loss mask that goes with :func:`splice_block`: the n block columns are no target (``value``).

    Args:
        mask: [..., T] bool, per delayed position (True = the token at that position is a training target).
        position: as given to :func:`splice_block`.
        n: block length.
        value: the mask value of the block columns.

    Returns:
        [..., T + n] bool.

    Raises:
        ValueError: position outside ``[0, T]``.
    """
    T = mask.shape[-1]
    if not 0 <= position <= T:
        raise ValueError(f"splice_mask: position {position} is outside [0, {T}]")
    fill = mask.new_full((*mask.shape[:-1], n), value)
    return torch.cat([mask[..., :position], fill, mask[..., position:]], dim=-1)


def splice_span_frames(
    frames: torch.Tensor,
    frame: int,
    block: torch.Tensor,
    delays: Sequence[int],
    initial_tokens: Sequence[int] | torch.Tensor,
) -> torch.Tensor:
    """:func:`splice_block` seen in undelayed (frame) coordinates, for training data kept as frames.

    Delays the frames (:func:`cspan.core.streams.delay_tokens`), splices the block before position ``frame + 1``
    (the position an engine call feeds when it is given user frame ``frame``) and undelays. For the 7B delays this
    is the MOVE convention: the block's text and semantic codes take frames ``frame .. frame + n - 1``, the
    acoustic codes of frame ``frame - 1`` become placeholders and reappear in the block's last frame, and the
    original frames ``frame ..`` follow the block.

    Args:
        frames: [..., K, T] long undelayed codes.
        frame: the frame the block goes before (0 <= frame <= T).
        block: [K, n] from :func:`span_block`.
        delays, initial_tokens: the model's K delays and initial ids.

    Returns:
        [..., K, T + n] long; the last ``max(delays)`` frames may be -2 where a delayed row runs past the data.
    """
    from .streams import delay_tokens, undelay_tokens

    T = frames.shape[-1]
    if not 0 <= frame <= T:
        raise ValueError(f"splice_span_frames: frame {frame} is outside [0, {T}]")
    delayed = delay_tokens(frames, delays, initial_tokens)
    spliced = splice_block(delayed, frame + 1, block)
    return undelay_tokens(spliced, delays, T + block.shape[-1])


@dataclass(frozen=True)
class SpanReport:
    """What one Context Span injection did.

    Attributes:
        session: the batch row.
        n: block length in positions (columns), markers included.
        truncated: the reference was cut to ``max_span_frames`` (at a token boundary, closing 13 kept).
        ids: the block's text ids.
        first_position, last_position: the KV positions the block occupies (``last = first + n - 1``).
        next_position: ``last_position + 1``, the position fed right after the block, by the step that reads it
            (the session's next step; the one after a persona prefix's step when the prefix is still queued), unless
            a copy of the persona prefix follows the span (the ``reprefix`` policy, :mod:`cspan.core.window`).
        prefill_ms: host milliseconds of the injection (building and queueing the block; its forward is part of
            the session's next step).
        context: the attention window in positions (None = unbounded).
        window_positions_left: positions that can still be fed before the first position of the persona prefix
            (of its latest copy; position 0 without a prefix) leaves the window of the next query
            (``max(0, context - 1 - (next - first))``; None when unbounded).
        prefix_in_window: whether the whole persona prefix is visible to the session's next query: its latest
            copy is inside the window, or its entries are pinned (:mod:`cspan.core.window`); False when there is
            no prefix.
        deferred: the block is read by the session's next step (always True: kept for readers of earlier
            reports).
        seq: the engine's number of this span (from 0, in injection order, over all sessions): the step that reads
            it reports it by this number (``DuplexEngine.take_span_reads``).
    """

    session: int
    n: int
    truncated: bool
    ids: tuple[int, ...]
    first_position: int
    last_position: int
    next_position: int
    prefill_ms: float
    context: int | None
    window_positions_left: int | None
    prefix_in_window: bool
    deferred: bool = True
    seq: int = -1

    @property
    def span_in_window(self) -> bool:
        """Whether the block's first column (its opening marker) is inside the window of the session's next query
        (a block as long as the window or longer is read, but its head is out of sight: shorten it or lower
        ``max_span_frames``)."""
        return self.context is None or self.next_position - self.first_position < self.context


@dataclass(frozen=True)
class Block:
    """Columns a session reads before its next position, in the engine's next step (delayed coordinates).

    Attributes:
        tokens: [K, n] long (on the host).
        embeddings: [E, D] input embeddings of the first E columns (E <= n; a persona prefix's stored voice
            embeddings, read instead of the token embeddings, whose columns are then only bookkeeping), or None.
        span_seq: the Context Span's number (:attr:`SpanReport.seq`), None for a persona prefix or its copy.
    """

    tokens: torch.Tensor
    embeddings: torch.Tensor | None = None
    span_seq: int | None = None

    @property
    def n(self) -> int:
        return int(self.tokens.shape[-1])


def encode_span(
    span: ContextSpan | str,
    *,
    tokenizer: Any | None,
    max_frames: int,
    text_card: int | None,
    num_streams: int,
    agent_placeholder: Sequence[int] = SILENCE_TOKENS,
    user_placeholder: Sequence[int] = SINE_TOKENS,
) -> tuple[Block, list[int], bool]:
    """(block, ids, truncated) of a span or a reference string (see :meth:`ContextSpan.encode`, :func:`span_block`).

    Raises:
        SpanError: empty reference, no tokenizer for text, ids outside ``[0, text_card)``.
    """
    if isinstance(span, str):
        span = ContextSpan(span)
    ids, truncated = span.encode(tokenizer, max_frames)
    if text_card is not None and (min(ids) < 0 or max(ids) >= text_card):
        raise SpanError(
            f"Context Span ids must be text ids in [0, {text_card}); got values in [{min(ids)}, {max(ids)}] "
            "(was the reference tokenised with another tokenizer?)"
        )
    tokens = span_block(
        ids, num_streams=num_streams, agent_placeholder=agent_placeholder, user_placeholder=user_placeholder
    )
    return Block(tokens), ids, truncated


__all__ = [
    "Block",
    "ContextSpan",
    "SpanReport",
    "encode_span",
    "span_block",
    "splice_block",
    "splice_mask",
    "splice_span_frames",
]
