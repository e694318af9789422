"""Unmerged LoRA adapters for the linear layers of a loaded LM.

Low-rank adaptation (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021, section 4.1): a
frozen weight ``W`` [out, in] gets a trainable update ``(alpha / r) * B @ A`` with ``A`` [r, in] and ``B``
[out, r]. The original Context Spanning release (mindlogic-ai/Context-Spanning, ``contextspan/model/lora.py``)
stores such adapters next to their base weights under ``<name>.base.weight``, ``<name>.lora_A`` and
``<name>.lora_B`` and keeps them unmerged, because rounding a merged bf16 weight loses a large part of a delta
that is below 1 % of the weight. This module holds them the same way.

It also reads the adapters kyutai-labs/moshi-finetune saves (``lora.safetensors`` + ``config.json`` with ``"lora":
true, "lora_rank": r, "lora_scaling": s``; Kyutai's ``moshi/modules/lora.py``: every ``nn.Linear`` of upstream's
``LMModel`` becomes ``frozen_W`` plus ``lora_A`` [r, in] / ``lora_B`` [out, r] linears, output
``frozen_W(x) + s * lora_B(lora_A(x))``, keys ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``):
:func:`apply_moshi_lora`, and writes them back from this project's adapters: :func:`moshi_lora_state`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
        scaling: the update's factor given directly (moshi-finetune's ``lora_scaling``), instead of ``alpha / r``.

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
        scaling: float | None = None,
    ) -> None:
        super().__init__()
        if r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {r}")
        self.r = int(r)
        self.alpha = float(alpha)
        self.scaling = self.alpha / self.r if scaling is None else float(scaling)
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


# ---------------------------------------------------------------------------------------------------------------
# moshi-finetune's adapters
# ---------------------------------------------------------------------------------------------------------------

_MOSHI_ATTENTION = re.compile(r"^(?P<layer>.+\.self_attn)\.(?P<proj>in_proj|out_proj)(?:s\.(?P<set>\d+))?$")


@dataclass(frozen=True)
class MoshiTarget:
    """Where one of upstream's LoRA-wrapped linears lives in this project's ``LMModel``.

    Attributes:
        name: the dotted name of the module (``...self_attn.out_proj``, ``text_linear`` ...) or, for an attention
            input projection, of its parameter (``...self_attn.in_proj_weight``).
        block: the weight set (row block) the adapter covers, or None for the whole weight / all sets stacked.
        module: whether ``name`` is an ``nn.Linear`` (else a parameter).
    """

    name: str
    block: int | None
    module: bool


def moshi_target(name: str) -> MoshiTarget:
    """Map an upstream module name of a LoRA key to this project's layer.

    Upstream's attention holds one linear per weight set (``self_attn.in_projs.{i}`` / ``out_projs.{i}``; older files
    stack them as ``in_proj`` / ``out_proj``); here they are the row blocks of ``self_attn.in_proj_weight`` and
    ``self_attn.out_proj.weight``. Every other linear has the same name in both.
    """
    found = _MOSHI_ATTENTION.match(name)
    if found is None:
        return MoshiTarget(name=name, block=None, module=True)
    block = None if found["set"] is None else int(found["set"])
    if found["proj"] == "in_proj":
        return MoshiTarget(name=f"{found['layer']}.in_proj_weight", block=block, module=False)
    return MoshiTarget(name=f"{found['layer']}.out_proj", block=block, module=True)


def _weight_of(model: nn.Module, target: MoshiTarget) -> torch.Tensor:
    if target.module:
        module = model.get_submodule(target.name)
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{target.name} is a {type(module).__name__}, not an nn.Linear")
        return module.weight
    parent, _, attr = target.name.rpartition(".")
    weight = getattr(model.get_submodule(parent), attr)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{target.name} is not a weight")
    return weight


def _sets_of(model: nn.Module, target: MoshiTarget) -> int:
    """Weight sets (row blocks) of the target's weight: the attention's ``n_sets``, else 1."""
    if target.name.endswith(("self_attn.in_proj_weight", "self_attn.out_proj")):
        return int(getattr(model.get_submodule(target.name.rsplit(".", 1)[0]), "n_sets", 1))
    return 1


@dataclass(frozen=True)
class MoshiAdapter:
    """One upstream adapter: ``lora_A`` [r, in] and ``lora_B`` [out, r] (``key`` names it in messages)."""

    key: str
    lora_A: torch.Tensor
    lora_B: torch.Tensor


def apply_moshi_lora(
    model: nn.Module, adapters: dict[str, MoshiAdapter], r: int, scaling: float, *, fuse: bool = False
) -> tuple[list[str], list[str]]:
    """Apply moshi-finetune's adapters (upstream module name -> adapter) to a loaded model.

    Unmerged (``fuse=False``): an adapter that covers a whole ``nn.Linear`` of this model becomes a
    :class:`LoRALinear` (``base.weight``, ``lora_A``, ``lora_B``, ``scaling``), as upstream keeps it. An adapter of
    one weight set of a fused per-step projection (the attention input projections, the depformer's per-step output
    projections, which this model stores as row blocks of one matrix) is folded into that block:
    ``W[block] += scaling * B @ A``, in float32, rounded once to the weight's dtype. ``fuse=True`` folds every
    adapter (upstream's ``--fuse-lora``, ``replace_lora_with_linear``).

    Returns:
        (names kept unmerged, names folded into the weights).

    Raises:
        KeyError: no such layer. TypeError: not a linear layer. ValueError: a shape that does not fit (names the key).
    """
    grouped, targets = _moshi_lora_plan(model, adapters, r)
    kept, merged = [], []
    with torch.no_grad():
        for name, parts in grouped.items():
            target = targets[name]
            whole = len(parts) == 1 and (parts[0][0] is None or _sets_of(model, target) == 1)
            if whole and target.module and not fuse:
                parent, _, child = name.rpartition(".")
                owner = model.get_submodule(parent) if parent else model
                linear = getattr(owner, child)
                lora = LoRALinear.from_linear(linear, r, scaling * r)
                lora.scaling = float(scaling)
                lora.base.weight = linear.weight
                lora.lora_A.copy_(parts[0][1].lora_A)
                lora.lora_B.copy_(parts[0][1].lora_B)
                lora.train(linear.training)
                setattr(owner, child, lora)
                kept.append(name)
                continue
            weight = _weight_of(model, target)
            rows = weight.shape[0] // _sets_of(model, target)
            for block, part in parts:
                delta = (part.lora_B.float() @ part.lora_A.float()) * scaling
                span = slice(None) if block is None else slice(block * rows, (block + 1) * rows)
                weight[span] = (weight[span].float() + delta.to(weight.device)).to(weight.dtype)
            merged.append(name)
    return kept, merged


def check_moshi_lora(model: nn.Module, adapters: dict[str, MoshiAdapter], r: int) -> None:
    """Check that moshi-finetune's adapters fit ``model`` (layer names, rank, shapes) without applying them: what
    :func:`apply_moshi_lora` would refuse, on a model that may live on the ``meta`` device (``cspan model info``).

    Raises:
        As :func:`apply_moshi_lora`.
    """
    _moshi_lora_plan(model, adapters, r)


def _moshi_lora_plan(
    model: nn.Module, adapters: dict[str, MoshiAdapter], r: int
) -> tuple[dict[str, list[tuple[int | None, MoshiAdapter]]], dict[str, MoshiTarget]]:
    """The adapters checked and grouped by this project's weight: (name -> [(weight set or None, adapter)], name ->
    target); raises as :func:`apply_moshi_lora`."""
    grouped: dict[str, list[tuple[int | None, MoshiAdapter]]] = {}
    targets: dict[str, MoshiTarget] = {}
    for name, adapter in adapters.items():
        target = moshi_target(name)
        try:
            weight = _weight_of(model, target)
        except AttributeError as exc:
            raise KeyError(name) from exc
        sets = _sets_of(model, target)
        A, B = adapter.lora_A, adapter.lora_B
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] % r or B.shape[1] != r:
            raise ValueError(f"{adapter.key}: lora_A {list(A.shape)} / lora_B {list(B.shape)} are not rank {r}")
        rows = weight.shape[0] // sets
        blocks: list[tuple[int | None, MoshiAdapter]]
        if target.block is None and sets > 1 and A.shape[0] == sets * r:  # stacked per-set adapters
            blocks = [
                (i, MoshiAdapter(adapter.key, A[i * r : (i + 1) * r], B[i * rows : (i + 1) * rows]))
                for i in range(sets)
            ]
        else:
            blocks = [(target.block, adapter)]
        for block, part in blocks:
            want_out = weight.shape[0] if block is None else rows
            if block is not None and block >= sets:
                raise ValueError(f"{adapter.key}: weight set {block} does not exist ({sets} sets)")
            if part.lora_A.shape != (r, weight.shape[1]) or part.lora_B.shape != (want_out, r):
                raise ValueError(
                    f"{adapter.key}: lora_A {list(part.lora_A.shape)} / lora_B {list(part.lora_B.shape)}, expected "
                    f"[{r}, {weight.shape[1]}] / [{want_out}, {r}]"
                )
        grouped.setdefault(target.name, []).extend(blocks)
        targets[target.name] = target
    return grouped, targets


def moshi_lora_state(
    state: dict[str, torch.Tensor], model: nn.Module, *, r: int, scaling: float
) -> dict[str, torch.Tensor]:
    """This project's state dict in moshi-finetune's ``lora.safetensors`` layout.

    ``<name>.lora_A`` / ``<name>.lora_B`` become ``<name>.lora_A.weight`` / ``<name>.lora_B.weight``; a per-step
    output projection (the depformer's ``self_attn.out_proj`` with n weight sets, one adapter over all sets here)
    becomes n upstream adapters ``self_attn.out_projs.{i}``, each with the shared ``lora_A`` and its row block of
    ``lora_B`` (the same update); the single-set ``self_attn.out_proj`` is ``out_projs.0``. A LoRA layer's
    ``<name>.base.weight`` is written as ``<name>.weight`` (upstream's loader maps it to ``frozen_W``), and every other
    key is kept as it is (a full weight over the base).

    Upstream's loader (``get_lora_moshi``) wraps *every* linear of its ``LMModel`` in a LoRA layer built on the meta
    device and fills it from the file, so a layer whose adapter the file lacks stays a meta tensor and the load fails
    ("Cannot copy out of meta tensor"). Every upstream linear without a trained adapter here therefore gets a zero
    one (``lora_A`` and ``lora_B`` zero: no update): the attention input projections (``self_attn.in_projs.{i}``,
    one per weight set, which this project keeps as ``in_proj_weight`` and never adapts) and the layers that
    ``--lora-targets`` left out.

    Args:
        state: ``{key: tensor}`` with this project's names (e.g. a fine-tune's ``{"model": ...}``).
        model: the model the state belongs to (for the number of weight sets of each attention).
        r, scaling: the adapters' rank and factor (checked against the tensors).

    Raises:
        ValueError: an adapter of another rank, or an ``<name>.lora_A`` without its ``lora_B``.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(".lora_B"):
            continue
        if not key.endswith(".lora_A"):
            out[key.replace(".base.weight", ".weight").replace(".base.bias", ".bias")] = value
            continue
        name = key[: -len(".lora_A")]
        if name + ".lora_B" not in state:
            raise ValueError(f"{name}.lora_B is missing")
        A, B = value, state[name + ".lora_B"]
        if A.shape[0] != r or B.shape[1] != r:
            raise ValueError(f"{name}: lora_A {list(A.shape)} / lora_B {list(B.shape)} are not rank {r}")
        if name.endswith("self_attn.out_proj"):
            sets = int(getattr(model.get_submodule(name.rsplit(".", 1)[0]), "n_sets", 1))
            rows = B.shape[0] // sets
            for i in range(sets):
                out[f"{name}s.{i}.lora_A.weight"] = A.clone()
                out[f"{name}s.{i}.lora_B.weight"] = B[i * rows : (i + 1) * rows].clone()
        else:
            out[f"{name}.lora_A.weight"] = A
            out[f"{name}.lora_B.weight"] = B
    dtype = next((v.dtype for k, v in state.items() if k.endswith(".lora_A")), None)
    for name, (n_in, n_out, like) in _moshi_linears(model).items():
        if f"{name}.lora_A.weight" not in out:
            out[f"{name}.lora_A.weight"] = torch.zeros(r, n_in, dtype=dtype or like.dtype)
            out[f"{name}.lora_B.weight"] = torch.zeros(n_out, r, dtype=dtype or like.dtype)
    return {k: v.contiguous() for k, v in out.items()}


def _moshi_linears(model: nn.Module) -> dict[str, tuple[int, int, torch.Tensor]]:
    """Every linear layer of upstream's ``LMModel`` for ``model``, by upstream module name -> (in, out, a weight of
    ours for its dtype): each attention's ``self_attn.in_projs.{i}`` / ``out_projs.{i}`` (one per weight set of
    ``in_proj_weight`` / ``out_proj``) and every other ``nn.Linear`` (or :class:`LoRALinear`) under its own name."""
    found: dict[str, tuple[int, int, torch.Tensor]] = {}
    lora_bases = {f"{name}.base" for name, mod in model.named_modules() if isinstance(mod, LoRALinear)}
    attentions = {
        name for name, mod in model.named_modules() if isinstance(getattr(mod, "in_proj_weight", None), torch.Tensor)
    }
    for name in sorted(attentions):
        attn = model.get_submodule(name)
        sets = int(getattr(attn, "n_sets", 1))
        w_in, w_out = attn.in_proj_weight, attn.out_proj.weight
        for i in range(sets):
            found[f"{name}.in_projs.{i}"] = (w_in.shape[1], w_in.shape[0] // sets, w_in)
            found[f"{name}.out_projs.{i}"] = (w_out.shape[1], w_out.shape[0] // sets, w_out)
    for name, mod in model.named_modules():
        if name in lora_bases or (name.rpartition(".")[0] in attentions and name.endswith(".out_proj")):
            continue
        if isinstance(mod, (nn.Linear, LoRALinear)):
            weight = mod.weight
            found[name] = (weight.shape[1], weight.shape[0], weight)
    return found


def fuse_lora_layers(module: nn.Module) -> list[str]:
    """Replace every :class:`LoRALinear` inside ``module`` by a plain ``nn.Linear`` holding the merged weight
    (``base.weight + scaling * B @ A``, computed in float32, rounded once to the base dtype) and the base bias.

    Returns:
        The names of the replaced layers.
    """
    fused = []
    for name, child in list(module.named_modules()):
        if not isinstance(child, LoRALinear):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        weight = child.weight.detach()
        linear = nn.Linear(
            child.in_features, child.out_features, bias=child.bias is not None, device=weight.device, dtype=weight.dtype
        )
        with torch.no_grad():
            linear.weight.copy_(weight)
            if child.bias is not None:
                linear.bias.copy_(child.bias)
        linear.train(child.training)
        setattr(parent, attr, linear)
        fused.append(name)
    return fused
