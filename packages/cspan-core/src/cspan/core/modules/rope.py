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


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, max_period: float = 10_000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by their absolute positions (interleaved RoPE, float32 arithmetic).

    Channel pair (2i, 2i+1) of a head is the complex number ``x[2i] + j x[2i+1]``, multiplied by
    ``exp(j * pos * max_period ** (-2i / Dh))``.

    Args:
        q: queries [B, H, T, Dh] (Dh even).
        k: keys [B, H, T, Dh].
        positions: absolute positions [B, T] (long); row b, step t has position ``positions[b, t]``.
        max_period: base of the frequencies (10000 for Moshi and Mimi).

    Returns:
        (q, k) rotated, same shapes and dtype as the inputs.
    """
    B, H, T, D = q.shape
    half = D // 2
    ds = torch.arange(half, device=q.device, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / D))  # [Dh/2]
    ts = positions.to(torch.float32).view(positions.shape[0], 1, T, 1)  # [B, 1, T, 1]
    rot_r = torch.cos(freqs * ts)  # [B, 1, T, Dh/2]
    rot_i = torch.sin(freqs * ts)

    q_pairs = q.view(B, H, T, half, 2)
    k_pairs = k.view(k.shape[0], k.shape[1], T, half, 2)
    qr, qi = q_pairs[..., 0].float(), q_pairs[..., 1].float()
    kr, ki = k_pairs[..., 0].float(), k_pairs[..., 1].float()

    q_out_r = qr * rot_r - qi * rot_i
    q_out_i = qr * rot_i + qi * rot_r
    k_out_r = kr * rot_r - ki * rot_i
    k_out_i = kr * rot_i + ki * rot_r

    q_out = torch.stack([q_out_r.to(q.dtype), q_out_i.to(q.dtype)], dim=-1).view(q.shape)
    k_out = torch.stack([k_out_r.to(k.dtype), k_out_i.to(k.dtype)], dim=-1).view(k.shape)
    return q_out, k_out


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
