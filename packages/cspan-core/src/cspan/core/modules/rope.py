"""Position encodings: interleaved rotary embedding (RoPE) and the additive sinusoidal embedding.

Sources: RoPE from Su et al. 2021, "RoFormer" (arXiv:2104.09864), section 3.4, in the interleaved layout of
kyutai-labs/moshi ``moshi/modules/rope.py`` (pairs (2i, 2i+1) rotate together, computed in float32);
the sinusoidal embedding from kyutai-labs/moshi ``moshi/modules/transformer.py`` (``create_sin_embedding``:
``[cos | sin]`` halves, phase ``pos / max_period ** (i / (half - 1))``).

Positions are absolute per batch row ([B, T] long tensors), so rows of one batch may sit at different offsets.
"""

from __future__ import annotations

import math

import torch


def rope_tables(
    positions: torch.Tensor, head_dim: int, max_period: float = 10_000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the RoPE angles ``pos * max_period ** (-2i / Dh)``, float32 [..., Dh/2] for ``positions`` [...]
    (long). Computed once per forward and shared by every layer (the eager layers and the fused kernels)."""
    half = head_dim // 2
    ds = torch.arange(half, device=positions.device, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / head_dim))  # [Dh/2]
    angles = freqs * positions.to(torch.float32)[..., None]
    return torch.cos(angles).contiguous(), torch.sin(angles).contiguous()


def rotate(qk: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate stacked queries and keys by the angles of :func:`rope_tables` (interleaved RoPE, float32 arithmetic).

    Channel pair (2i, 2i+1) of a head is the complex number ``x[2i] + j x[2i+1]``, multiplied by
    ``cos + j sin`` of its position: one set of element-wise operations for queries and keys together.

    Args:
        qk: [..., B, H, T, Dh] (Dh even; the last dimension contiguous), e.g. [2, B, H, T, Dh] queries then keys.
        tables: (cos, sin), each [B, T, Dh/2] float32 (B may be 1: broadcast over the rows).

    Returns:
        The rotated tensor, same shape and dtype as ``qk`` (contiguous).
    """
    cos, sin = tables[0][:, None], tables[1][:, None]  # [B, 1, T, Dh/2], broadcast over the heads
    pairs = qk.unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    if qk.dtype != torch.float32:
        re, im = re.float(), im.float()
    out_re = re * cos - im * sin
    out_im = re * sin + im * cos
    return torch.stack([out_re.to(qk.dtype), out_im.to(qk.dtype)], dim=-1).flatten(-2)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, max_period: float = 10_000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by their absolute positions (:func:`rope_tables` then :func:`rotate`).

    Args:
        q: queries [B, H, T, Dh] (Dh even).
        k: keys [B, H, T, Dh].
        positions: absolute positions [B, T] (long); row b, step t has position ``positions[b, t]``.
        max_period: base of the frequencies (10000 for Moshi and Mimi).

    Returns:
        (q, k) rotated, same shapes and dtype as the inputs.
    """
    tables = rope_tables(positions, q.shape[-1], max_period)
    return rotate(q, tables), rotate(k, tables)


def sin_embedding(
    positions: torch.Tensor, dim: int, max_period: float = 10_000.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Sinusoidal position embedding ``[cos(phase) | sin(phase)]``, added to a transformer's input.

    ``phase[..., i] = pos / max_period ** (i / (half - 1))`` for ``i < half = dim // 2``, computed in ``dtype``
    (upstream computes it in the activation dtype).

    Args:
        positions: absolute positions [B, T] (long).
        dim: embedding width D (even).
        max_period: longest period.
        dtype: dtype of the computation and of the result.

    Returns:
        [B, T, D] embedding.

    Raises:
        ValueError: odd ``dim``.
    """
    if dim % 2 != 0:
        raise ValueError(f"sin_embedding needs an even width, got {dim}; use an even model dimension")
    half = dim // 2
    pos = positions.to(dtype).unsqueeze(-1)  # [B, T, 1]
    adim = torch.arange(half, device=positions.device, dtype=dtype).view(1, 1, -1)
    max_period_t = torch.full([], max_period, device=positions.device, dtype=dtype)
    phase = pos / (max_period_t ** (adim / (half - 1)))
    return torch.cat([torch.cos(phase), torch.sin(phase)], dim=-1)
