"""LoRA for training: wrap chosen linear layers of a loaded LM in :class:`cspan.core.lora.LoRALinear`, freeze the rest.

The adapters are the core's ``LoRALinear`` (unmerged: ``base.weight`` + ``(alpha / r) * lora_B @ lora_A``), so a
trained model saves under exactly the keys :func:`cspan.core.checkpoint.load_checkpoint` reads back
(``<name>.base.weight``, ``<name>.lora_A`` [r, in], ``<name>.lora_B`` [out, r], and a top-level
``{"lora": {"r", "alpha"}}``). Initialisation as in Hu et al., "LoRA" (2021), section 4.1 (and the ``peft``
library): ``A`` Kaiming-uniform, ``B`` zero, so training starts from the loaded model exactly.
"""

from __future__ import annotations

import fnmatch
import math

import torch
from torch import nn

from cspan.core.lora import LoRALinear

from .errors import TrainError

ALL_LINEAR = "all"
"""``--lora-targets`` value that adapts every ``nn.Linear`` of the LM (327 layers on the 7B, as the release)."""


def linear_names(model: nn.Module) -> list[str]:
    """Dotted names of every plain ``nn.Linear`` in ``model`` (module order), not counting the frozen ``base`` of an
    existing :class:`LoRALinear`."""
    adapted = {name for name, mod in model.named_modules() if isinstance(mod, LoRALinear)}
    return [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and name and name.rpartition(".")[0] not in adapted
    ]


def resolve_targets(model: nn.Module, targets: str) -> list[str]:
    """The linear layers ``--lora-targets`` selects.

    Args:
        model: the LM.
        targets: ``"all"`` or comma-separated shell patterns over module names (``transformer.layers.*``,
            ``*.gating.*``, ``text_linear``); only ``nn.Linear`` modules are selected.

    Raises:
        TrainError: a pattern selects no linear layer (lists a few names that exist).
    """
    names = linear_names(model)
    spec = targets.strip()
    if spec == ALL_LINEAR:
        return names
    chosen: list[str] = []
    for pattern in (p.strip() for p in spec.split(",")):
        if not pattern:
            continue
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise TrainError(
                f"--lora-targets pattern {pattern!r} matches no linear layer of this model; names look like "
                f"{', '.join(names[:4])} (or use 'all')"
            )
        chosen.extend(h for h in hits if h not in chosen)
    if not chosen:
        raise TrainError("--lora-targets selects nothing; give 'all' or module-name patterns")
    return chosen


def add_lora(model: nn.Module, names: list[str], r: int, alpha: float, generator: torch.Generator) -> list[str]:
    """Wrap each named ``nn.Linear`` in a :class:`LoRALinear` that keeps the loaded layer as its ``base``.

    ``lora_A`` [r, in] is drawn Kaiming-uniform (bound ``1 / sqrt(in)``, from ``generator`` on the CPU, then moved),
    ``lora_B`` [out, r] is zero; both in the base weight's dtype and device.

    Returns:
        The names wrapped.

    Raises:
        TrainError: ``r < 1`` or a name that is not a linear layer.
    """
    if r < 1:
        raise TrainError(f"--lora-rank must be >= 1 (0 means full fine-tuning), got {r}")
    done = []
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if not isinstance(linear, nn.Linear):
            raise TrainError(f"LoRA target {name!r} is a {type(linear).__name__}, not a linear layer")
        w = linear.weight
        lora = LoRALinear(
            linear.in_features, linear.out_features, r, alpha, bias=linear.bias is not None, device="meta"
        )
        lora.base = linear
        bound = 1.0 / math.sqrt(linear.in_features)
        a = (torch.rand(r, linear.in_features, generator=generator) * 2 - 1) * bound
        lora.lora_A = nn.Parameter(a.to(device=w.device, dtype=w.dtype))
        lora.lora_B = nn.Parameter(torch.zeros(linear.out_features, r, device=w.device, dtype=w.dtype))
        lora.train(linear.training)
        setattr(parent, child, lora)
        done.append(name)
    return done


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Name -> :class:`LoRALinear` of every adapted layer."""
    return {name: mod for name, mod in model.named_modules() if isinstance(mod, LoRALinear)}


def lora_spec(model: nn.Module) -> dict[str, float | int] | None:
    """``{"r", "alpha"}`` of the model's adapters (None without adapters).

    Raises:
        TrainError: adapters of different ranks or scales (the file format stores one pair).
    """
    layers = lora_layers(model)
    if not layers:
        return None
    pairs = {(m.r, m.alpha) for m in layers.values()}
    if len(pairs) > 1:
        raise TrainError(f"the model mixes LoRA ranks/alphas {sorted(pairs)}; one (r, alpha) pair is supported")
    r, alpha = pairs.pop()
    return {"r": int(r), "alpha": float(alpha)}


def freeze_all_but_lora(model: nn.Module) -> int:
    """``requires_grad`` only on ``lora_A`` / ``lora_B``; returns the number of trainable values."""
    count = 0
    for name, p in model.named_parameters():
        train = name.endswith(".lora_A") or name.endswith(".lora_B")
        p.requires_grad_(train)
        count += p.numel() if train else 0
    return count


__all__ = [
    "ALL_LINEAR",
    "add_lora",
    "freeze_all_but_lora",
    "linear_names",
    "lora_layers",
    "lora_spec",
    "resolve_targets",
]
