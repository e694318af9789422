"""The weighted, masked cross-entropy of ``cspan train``.

Source: the original Context Spanning ``finetune.loss_fn`` (mindlogic-ai/Context-Spanning, section 6.2 of the
project's digest), itself Moshi's text + audio cross-entropy (Défossez et al., "Moshi", arXiv 2410.00037,
section 4.4) with per-token weights:

- text: every target position of row 0 weighs ``text`` (1.0), times ``pad`` (0.5) where the target is PAD (3),
  times ``ret`` (5.0) where it is ``<ret>`` (4); EPAD (0) weighs 1.0 like a word token;
- audio: codebook row 1 (the agent's semantic codebook) weighs ``semantic`` (1.0); every other predicted row
  (agent acoustic codebooks, and the user's 8 codebooks when the depformer predicts them) weighs ``acoustic``
  (0.02);
- positions whose mask is False (persona prefix, Context Span blocks, padding) weigh 0.

Each part is normalised by its total weight over the whole optimizer step (every micro-batch of every rank, so the
loss does not depend on how a global batch is split): ``loss = sum(w * CE_text) / W_text + sum(w * CE_audio) /
W_audio``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cspan.core.constants import PAD, RET


@dataclass(frozen=True)
class LossWeights:
    """Per-token loss weights (defaults: the released recipe).

    Attributes:
        text: weight of a text target.
        pad: multiplier for a PAD (3) text target.
        ret: multiplier for a ``<ret>`` (4) text target.
        semantic: weight of the agent's semantic codebook (row 1).
        acoustic: weight of every other predicted audio row.
    """

    text: float = 1.0
    pad: float = 0.5
    ret: float = 5.0
    semantic: float = 1.0
    acoustic: float = 0.02


def token_weights(
    targets: torch.Tensor, mask: torch.Tensor, dep_q: int, weights: LossWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target weights.

    Args:
        targets: [B, K, L] long (row 0 text, rows 1..dep_q the predicted audio rows).
        mask: [B, K, L] bool, True where the entry is a target.
        dep_q: audio rows predicted by the depformer.
        weights: :class:`LossWeights`.

    Returns:
        (text_w [B, L] float32, audio_w [B, dep_q, L] float32), zero where masked.
    """
    text = targets[:, 0]
    text_w = torch.full(text.shape, weights.text, dtype=torch.float32, device=targets.device)
    text_w = torch.where(text == PAD, text_w * weights.pad, text_w)
    text_w = torch.where(text == RET, text_w * weights.ret, text_w)
    text_w = text_w * mask[:, 0]
    rows = torch.full((dep_q,), weights.acoustic, dtype=torch.float32, device=targets.device)
    rows[0] = weights.semantic
    audio_w = rows[None, :, None] * mask[:, 1 : 1 + dep_q]
    return text_w, audio_w


def weighted_cross_entropy(
    text_logits: torch.Tensor,
    audio_logits: torch.Tensor,
    targets: torch.Tensor,
    text_w: torch.Tensor,
    audio_w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums of weighted cross-entropies (not normalised).

    Args:
        text_logits: [B, L, text_card].
        audio_logits: [B, dep_q, L, card].
        targets: [B, K, L] long (-1 or other ids where the weight is 0 are ignored).
        text_w: [B, L]; audio_w: [B, dep_q, L] from :func:`token_weights`.

    Returns:
        (sum of text_w * CE, sum of audio_w * CE) as float32 scalars.
    """
    dep_q = audio_logits.shape[1]
    text_t = torch.where(text_w > 0, targets[:, 0], torch.zeros_like(targets[:, 0]))
    text_ce = F.cross_entropy(text_logits.float().flatten(0, 1), text_t.flatten(), reduction="none")
    audio_t = targets[:, 1 : 1 + dep_q]
    audio_t = torch.where(audio_w > 0, audio_t, torch.zeros_like(audio_t))
    audio_ce = F.cross_entropy(audio_logits.float().flatten(0, 2), audio_t.flatten(), reduction="none")
    return (text_ce * text_w.flatten()).sum(), (audio_ce * audio_w.flatten()).sum()


__all__ = ["LossWeights", "token_weights", "weighted_cross_entropy"]
