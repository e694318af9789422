"""Token embedding with an all-zero vector for id -1 and an optional low-rank factorisation.

Source: kyutai-labs/moshi ``moshi/models/lm_utils.py`` (``ScaledEmbedding``; despite the name nothing is scaled).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from . import fused

ZERO_TOKEN_ID = -1


class ScaledEmbedding(nn.Module):
    """Lookup table where the id -1 (the "zero token") maps to an exact zero vector.

    With ``low_rank = r`` the table is [num_embeddings, r] and a bias-free ``low_rank`` Linear r -> D follows;
    the zeroing happens *before* that projection (so -1 still gives zero).

    Parameters: ``weight`` [num_embeddings, r or D] (+ ``low_rank.weight`` [D, r]).
    Shapes: ids [...] long (values in [-1, num_embeddings)) -> [..., D].
    """

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        low_rank: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.dim = dim
        table_dim = low_rank if low_rank is not None else dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, table_dim, device=device, dtype=dtype))
        nn.init.normal_(self.weight)
        self.low_rank = None if low_rank is None else nn.Linear(low_rank, dim, bias=False, device=device, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        is_zero = (ids == ZERO_TOKEN_ID)[..., None]
        y = F.embedding(ids.clamp(min=0), self.weight)
        y = torch.where(is_zero, torch.zeros((), dtype=y.dtype, device=y.device), y)
        if self.low_rank is not None:
            y = self.low_rank(y)
        return y

    def add_to(self, x: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
        """``x + self(ids)`` (``self(ids)`` when x is None): one kernel on the GPU without low rank, the sum
        rounded as the eager addition is. Shapes: x [..., D] matching ids [...] (or None)."""
        if self.low_rank is None and ids.dim() in (1, 2) and fused.usable(self.weight):
            return fused.embed_add(x, self.weight, ids)
        e = self(ids)
        return e if x is None else x + e
