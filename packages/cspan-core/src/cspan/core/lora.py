"""Unmerged LoRA adapters for the linear layers of a loaded LM.

Low-rank adaptation (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021, section 4.1): a
frozen weight ``W`` [out, in] gets a trainable update ``(alpha / r) * B @ A`` with ``A`` [r, in] and ``B``
[out, r]. The original Context Spanning release (mindlogic-ai/Context-Spanning, ``contextspan/model/lora.py``)
stores such adapters next to their base weights under ``<name>.base.weight``, ``<name>.lora_A`` and
``<name>.lora_B`` and keeps them unmerged, because rounding a merged bf16 weight loses a large part of a delta
that is below 1 % of the weight. This module holds them the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Module):
    """A bias-optional linear layer plus an unmerged low-rank update.

    ``forward(x)`` = ``base(x) + ((x @ A^T) @ B^T) * alpha / r`` for ``x`` [..., in_features], giving
    [..., out_features]. The state-dict keys are ``base.weight`` [out, in] (and ``base.bias`` [out] when the
    adapted layer had one), ``lora_A`` [r, in] and ``lora_B`` [out, r].

    Code that reads ``module.weight`` directly (for example to hand it to a fused kernel) gets the merged weight
    ``base.weight + (B @ A) * alpha / r``, computed in float32 and returned in the base weight's dtype; that copy is
    made on every access and never stored.

    Args:
        in_features: input width.
        out_features: output width.
        r: adapter rank (>= 1).
        alpha: adapter scale numerator; the update is multiplied by ``alpha / r``.
        bias: whether the base layer has a bias.
        device, dtype: where and how to allocate (``"meta"`` allocates nothing).

    Raises:
        ValueError: ``r`` < 1.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        r: int,
        alpha: float,
        *,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {r}")
        self.r = int(r)
        self.alpha = float(alpha)
        self.scaling = self.alpha / self.r
        self.base = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.lora_A = nn.Parameter(torch.zeros(r, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r, device=device, dtype=dtype))

    @classmethod
    def from_linear(cls, linear: nn.Linear, r: int, alpha: float) -> LoRALinear:
        """Wrap ``linear``'s shape (and its bias flag) in a new adapter on the same device and dtype.

        The new module is freshly allocated (on ``"meta"`` when ``linear`` is on meta): its weights are meant to be
        assigned from a checkpoint afterwards. ``lora_B`` starts at zero, so an unloaded adapter is a no-op.
        """
        weight = linear.weight
        return cls(
            linear.in_features,
            linear.out_features,
            r,
            alpha,
            bias=linear.bias is not None,
            device=weight.device,
            dtype=weight.dtype,
        )

    @property
    def in_features(self) -> int:
        """Input width."""
        return self.base.in_features

    @property
    def out_features(self) -> int:
        """Output width."""
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The merged weight [out, in] = ``base.weight + (lora_B @ lora_A) * alpha / r`` in the base dtype."""
        base = self.base.weight
        delta = (self.lora_B.float() @ self.lora_A.float()) * self.scaling
        return (base.float() + delta).to(base.dtype)

    @property
    def bias(self) -> torch.Tensor | None:
        """The base layer's bias [out] (None when the layer has no bias)."""
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., in_features] -> [..., out_features]."""
        update = F.linear(F.linear(x, self.lora_A), self.lora_B)
        return self.base(x) + update * self.scaling

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, alpha={self.alpha}"


def apply_lora(module: nn.Module, names: list[str], r: int, alpha: float) -> list[str]:
    """Replace each ``nn.Linear`` named in ``names`` (dotted paths inside ``module``) by a :class:`LoRALinear`.

    The replacements are allocated like the layers they replace (so on ``"meta"`` for a model built on meta).
    Afterwards the state-dict keys ``<name>.weight`` become ``<name>.base.weight``, ``<name>.lora_A`` and
    ``<name>.lora_B``.

    Returns:
        The names that were replaced, in the order given.

    Raises:
        KeyError: a name does not exist in ``module``.
        TypeError: a name exists but is not an ``nn.Linear``.
    """
    replaced = []
    for name in names:
        parent_name, _, child = name.rpartition(".")
        try:
            parent = module.get_submodule(parent_name) if parent_name else module
            target = getattr(parent, child)
        except AttributeError as exc:
            raise KeyError(name) from exc
        if isinstance(target, LoRALinear):
            continue
        if not isinstance(target, nn.Linear):
            raise TypeError(f"{name} is a {type(target).__name__}, not an nn.Linear")
        lora = LoRALinear.from_linear(target, r, alpha)
        lora.train(target.training)
        setattr(parent, child, lora)
        replaced.append(name)
    return replaced
