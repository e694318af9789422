"""Normalisation layers of the Moshi-family transformers: RMSNorm and LayerNorm, optionally computed in float32.

Source: kyutai-labs/moshi, ``moshi/modules/transformer.py`` (``create_norm_fn``, ``RMSNorm``, ``LayerNormF32``).
The norm names are upstream's config values:

| name             | layer     | eps   | computed in  | parameters             |
|------------------|-----------|-------|--------------|------------------------|
| ``layer_norm``     | LayerNorm | 1e-5  | input dtype  | ``weight``, ``bias`` [D] |
| ``layer_norm_f32`` | LayerNorm | 1e-8  | float32      | ``weight``, ``bias`` [D] |
| ``rms_norm``       | RMSNorm   | 1e-5  | input dtype  | ``alpha`` [1, 1, D]      |
| ``rms_norm_f32``   | RMSNorm   | 1e-8  | float32      | ``alpha`` [1, 1, D]      |

The Moshi 7B uses ``rms_norm_f32``; Mimi and Kyutai's tiny test model use ``layer_norm``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from . import fused

NORM_NAMES = ("layer_norm", "layer_norm_f32", "rms_norm", "rms_norm_f32")


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learnt gain ``alpha`` of shape [1, 1, D].

    ``y = x * (alpha * rsqrt(mean(x^2, last dim) + eps))``, evaluated in ``compute_dtype`` (the input dtype when
    None) and cast back to the input dtype. The gain is stored in the parameter dtype and upcast for the product,
    so a bfloat16 model uses bfloat16-rounded gains in a float32 computation, as upstream does.

    Args:
        dim: normalised (last) dimension D.
        eps: added to the mean square (1e-8 for ``rms_norm_f32``, 1e-5 for ``rms_norm``).
        compute_dtype: dtype of the arithmetic, float32 for the ``_f32`` variant.

    Shapes: x [..., D] -> [..., D].
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-8,
        compute_dtype: torch.dtype | None = torch.float32,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.compute_dtype = compute_dtype
        self.alpha = nn.Parameter(torch.ones(1, 1, dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype == torch.float32 and fused.usable(x, self.alpha):
            return fused.rms_norm(x, self.alpha, self.eps)[1]  # one kernel on the GPU, same arithmetic
        x_dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        var = self.eps + torch.mean(x * x, dim=-1, keepdim=True)
        alpha = self.alpha.to(var.dtype)
        if x.dim() < 3:  # [1, 1, D] would broadcast over a leading dimension x lacks
            alpha = alpha.view(-1)
        y = x * (alpha * torch.rsqrt(var))
        return y.to(x_dtype)


class LayerNormF32(nn.LayerNorm):
    """``nn.LayerNorm`` evaluated in float32 whatever the input dtype; output cast back to the input dtype.

    Shapes: x [..., D] -> [..., D].
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        y = F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)
        return y.to(x.dtype)


def make_norm(
    name: str, dim: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """Build the normalisation layer called ``name`` (one of :data:`NORM_NAMES`) over a last dimension ``dim``.

    Raises:
        ValueError: unknown norm name.
    """
    if name == "layer_norm":
        return nn.LayerNorm(dim, eps=1e-5, device=device, dtype=dtype)
    if name == "layer_norm_f32":
        return LayerNormF32(dim, eps=1e-8, device=device, dtype=dtype)
    if name == "rms_norm":
        return RMSNorm(dim, eps=1e-5, compute_dtype=None, device=device, dtype=dtype)
    if name == "rms_norm_f32":
        return RMSNorm(dim, eps=1e-8, compute_dtype=torch.float32, device=device, dtype=dtype)
    raise ValueError(f"unknown norm {name!r}; expected one of {', '.join(NORM_NAMES)} (the config's 'norm' field)")
