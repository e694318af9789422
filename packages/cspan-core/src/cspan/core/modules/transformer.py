"""The pre-norm streaming transformer shared by the LM temporal transformer, the depformer and Mimi.

Source: kyutai-labs/moshi ``moshi/modules/transformer.py`` and ``moshi/modules/gating.py`` (the numerics and
the parameter names, so that upstream checkpoints load with ``strict=True``); the streaming state is explicit here
(:class:`TransformerState`, a :class:`~cspan.core.kv_cache.KVCache` plus a host step counter) instead of being
stored inside the modules.

Per layer: ``x = x + ls1(attn(norm1(x)))``, then ``x = x + ls2(ffn(norm2(x)))``, where ``ls`` is LayerScale or the
identity and ``ffn`` is either a GELU MLP (``gating="none"``: ``linear1``/``linear2``) or a gated linear unit
(``gating="silu"`` etc.: ``gating.linear_in`` with 2H outputs, first half through the activation, times the
second half, then ``gating.linear_out``).

Parameter names (per layer ``layers.{i}.``):

- ``self_attn.in_proj_weight`` [n_sets * 3 * D, D]: fused projection; set s is the row block s, inside it the rows
  are [q; k; v], each head-major (head h = rows h*Dh .. (h+1)*Dh).
- ``self_attn.out_proj.weight`` [n_sets * D, D]: row block s is the output projection of set s.
- ``norm1.alpha``/``norm2.alpha`` [1, 1, D] (RMSNorm) or ``norm1.weight``/``norm1.bias`` [D] (LayerNorm).
- ``linear1.weight`` [F, D], ``linear2.weight`` [D, F] (gating "none"), or ``gating.linear_in.weight`` [2H, D],
  ``gating.linear_out.weight`` [D, H], or ``gating.{s}.linear_in.weight`` ... per weight set.
- ``layer_scale_1.scale``/``layer_scale_2.scale`` [D] when ``layer_scale`` is set.

Weights per step (the depformer): with ``weights_per_step = N`` the position at step index n (the offset within
the stream since the last reset, i.e. the codebook index inside a frame) uses weight set ``schedule[n]``
(``n`` without a schedule) for the attention projections and the gated FFN; the norms are shared.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from ..kv_cache import CacheStep, KVCache, attention_mask
from . import fused
from .norms import RMSNorm, make_norm
from .rope import rope_tables, rotate, sin_embedding

if TYPE_CHECKING:
    from ..plan import ExecutionPlan

POSITIONAL_EMBEDDINGS = ("none", "sin", "rope", "sin_rope")

# Attention-mask value meaning "plain causal attention of the T new positions over themselves" (no cache, window
# wider than T): lets ``scaled_dot_product_attention`` pick its fused causal kernels instead of a [T, T] mask.
CAUSAL = "causal"

EAGER_QUERY_ROWS = 1024
"""Most query positions of one block the eager step attends in one call (:meth:`StreamingTransformer._eager_step`):
its scores and mask are [heads, rows, keys], so a block of many queued spans read at once (no column budget) takes
memory in proportion to its length, not its square. A block of up to this many positions is one call, as before."""

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "leaky_relu": F.leaky_relu,
    "elu": F.elu,
    "mish": F.mish,
    "softsign": F.softsign,
    "identity": lambda x: x,
}


def gated_hidden_size(dim: int, dim_feedforward: int) -> int:
    """Hidden width H of a gated FFN: ``21 * dim // 8`` when ``dim_feedforward == 4 * dim``, else
    ``2 * dim_feedforward // 3`` (kyutai-labs/moshi ``ActivationGating``). 11264 for the 7B, 2816 for its depformer.
    """
    if dim_feedforward == 4 * dim:
        return (21 * dim) // 8
    return (2 * dim_feedforward) // 3


class LayerScale(nn.Module):
    """Per-channel scale of a residual branch (Touvron et al. 2021, "Going deeper with Image Transformers", §3).

    Parameter ``scale`` [D], initialised to ``init``. Shapes: x [..., D] -> [..., D].
    """

    def __init__(
        self, dim: int, init: float, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class ActivationGating(nn.Module):
    """Gated linear unit FFN (Shazeer 2020, "GLU Variants Improve Transformer"): ``out(act(a) * b)``.

    ``linear_in`` maps D -> 2H; its output viewed as [..., 2, H] gives ``a`` (first half, through the activation)
    and ``b`` (second half). ``linear_out`` maps H -> D. No biases. H from :func:`gated_hidden_size`.

    Shapes: x [B, T, D] -> [B, T, D].

    Raises:
        ValueError: unknown activation name.
    """

    def __init__(
        self,
        dim: int,
        dim_feedforward: int,
        activation: str = "silu",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"unknown gating activation {activation!r}; expected 'none' or one of {sorted(_ACTIVATIONS)}"
            )
        self.hidden = gated_hidden_size(dim, dim_feedforward)
        self.activation_name = activation
        self.activation = _ACTIVATIONS[activation]
        self.linear_in = nn.Linear(dim, 2 * self.hidden, bias=False, device=device, dtype=dtype)
        self.linear_out = nn.Linear(self.hidden, dim, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_in(x)
        if self.activation_name == "silu" and fused.usable(h, self.linear_in.weight):
            return self.linear_out(fused.silu_gate(h))  # one kernel on the GPU, same roundings
        h = h.view(*h.shape[:-1], 2, self.hidden)
        h = self.activation(h[..., 0, :]) * h[..., 1, :]
        return self.linear_out(h)


def _per_step_linear(x: torch.Tensor, weight: torch.Tensor, n_sets: int, sets: list[int] | None) -> torch.Tensor:
    """``F.linear`` with one weight block per position: position t of x [B, T, in] uses block ``sets[t]`` of
    ``weight`` [n_sets * out, in]; ``sets`` None means a single block for every position."""
    if sets is None:
        return F.linear(x, weight)
    blocks = weight.view(n_sets, -1, weight.shape[-1])
    if len(sets) == 1:
        return F.linear(x, blocks[sets[0]])
    return torch.cat([F.linear(x[:, t : t + 1], blocks[s]) for t, s in enumerate(sets)], dim=1)


class MultiheadAttention(nn.Module):
    """Multi-head self-attention with a fused, optionally per-step, bias-free projection, RoPE and a KV cache.

    Args:
        dim: model width D (``num_heads * Dh``).
        num_heads: H.
        n_sets: number of weight sets (1, or the depformer's distinct steps).

    Parameters: ``in_proj_weight`` [n_sets * 3 * D, D], ``out_proj.weight`` [n_sets * D, D].
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        n_sets: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"model width {dim} is not divisible by num_heads {num_heads}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.n_sets = n_sets
        self.in_proj_weight = nn.Parameter(torch.empty(n_sets * 3 * dim, dim, device=device, dtype=dtype))
        self.out_proj = nn.Linear(dim, n_sets * dim, bias=False, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(self.in_proj_weight, a=math.sqrt(5))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | str | None,
        sets: list[int] | None,
        cache: KVCache | None = None,
        cache_step: CacheStep | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """Attend the T positions of x to themselves and, with a cache, to the cached past.

        Args:
            x: [B, T, D] normalised input.
            rope: (cos, sin) [B or 1, T, Dh/2] of the positions' RoPE angles
                (:func:`~cspan.core.modules.rope.rope_tables`, once per forward), None without RoPE.
            mask: [B or 1, 1, T, S] bool (True = attend) or the same as an additive float mask (0 / -inf), None for
                no mask, or :data:`CAUSAL`.
            sets: weight set per position (length T) or None (single set).
            cache, cache_step, layer: the KV cache, the plan of this append, and this layer's index in it.

        Returns:
            [B, T, D].
        """
        B, T, D = x.shape
        H, Dh = self.num_heads, self.head_dim
        qkv = _per_step_linear(x, self.in_proj_weight, self.n_sets, sets)  # [B, T, 3D]
        qkv = qkv.view(B, T, 3, H, Dh).permute(2, 0, 3, 1, 4)  # [3, B, H, T, Dh]
        q, k, v = qkv[0], qkv[1], qkv[2]
        if rope is not None:
            q, k = rotate(qkv[:2], rope).unbind(0)
        if cache is not None and cache_step is not None:
            k, v = cache.update(layer, k, v, cache_step)
        if isinstance(mask, str):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, Dh]
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(B, T, D)
        return _per_step_linear(out, self.out_proj.weight, self.n_sets, sets)

    def weights(self, weight_set: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(in_proj [3D, D], out_proj [D, D]) weights of one weight set (None: the single set)."""
        w_in, w_out = self.in_proj_weight, self.out_proj.weight
        if weight_set is not None:
            w_in = w_in.view(self.n_sets, -1, self.dim)[weight_set]
            w_out = w_out.view(self.n_sets, -1, self.dim)[weight_set]
        return w_in, w_out

    def fused_forward(
        self,
        x: torch.Tensor,
        weight_set: int | None,
        cache: KVCache,
        layer: int,
        window: int,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        rows: torch.Tensor,
        where: torch.Tensor | fused.Ragged,
        pdl: bool | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` with a KV cache through the kernels of :mod:`cspan.core.modules.fused` (GPU).

        One position (a frame step): projection, one kernel for RoPE + cache write + attention, projection. T
        positions (a chunk): projection, RoPE split, attention over the ring and the new keys, cache write,
        projection. The cache offsets are not advanced here.

        Args:
            x: [B', T, D] normalised input.
            weight_set: the single weight set of these positions (None: one set).
            cache, layer: the KV cache and this layer's index in it.
            window: attention window in positions.
            rope: (cos, sin) [B', T, Dh/2] or None.
            rows: [B'] long cache rows.
            where: one position: [B'] long, each row's position (its cache offset); a chunk: the rows' T tokens
                as a :class:`cspan.core.modules.fused.Ragged` with positions (``Ragged.uniform(rows, T, C).at``).
                Built once per forward by the caller, not per layer.
            pdl: launch with programmatic dependent launch (None: the kernels' default).

        Returns:
            [B', T, D].
        """
        B, T, _ = x.shape
        w_in, w_out = self.weights(weight_set)
        qkv = F.linear(x, w_in)  # [B', T, 3D]
        keys, values = cache.keys[layer], cache.values[layer]
        scales = cache.layer_scales(layer)
        if isinstance(where, torch.Tensor):  # one position
            cos_sin = None if rope is None else (rope[0][:, 0], rope[1][:, 0])
            out = fused.decode_attention(qkv, keys, values, where, rows, window, cos_sin, scales, pdl=pdl)
        else:
            flat = None if rope is None else (rope[0].reshape(B * T, -1), rope[1].reshape(B * T, -1))
            q, k, v = fused.rope_split(qkv.reshape(B * T, -1), self.num_heads, flat, pdl=pdl)
            out = fused.prefill_attention(q, k, v, keys, values, where, window, scales, pdl=pdl).view(B, T, -1)
            fused.kv_write(k, v, keys, values, where.tok_row, where.store_pos, scales, pdl=pdl)
        return F.linear(out, w_out)


class StreamingTransformerLayer(nn.Module):
    """One pre-norm layer: self-attention block then feed-forward block, each with an optional LayerScale.

    See the module docstring for the parameter names. ``gating`` is "none" (GELU MLP with ``linear1``/``linear2``,
    exact erf GELU) or an activation name for :class:`ActivationGating` (one per weight set when ``n_sets > 1``).

    Raises:
        ValueError: ``gating="none"`` together with several weight sets (upstream has no such layer).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        dim_feedforward: int | list[int],
        norm: str = "layer_norm",
        gating: str = "none",
        layer_scale: float | None = None,
        n_sets: int = 1,
        per_step_ffn: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(dim, num_heads, n_sets, **factory)
        self.norm1 = make_norm(norm, dim, **factory)
        self.norm2 = make_norm(norm, dim, **factory)
        self.per_step_ffn = per_step_ffn
        self.linear1: nn.Linear | None = None
        self.linear2: nn.Linear | None = None
        self.gating: nn.Module | None = None
        if gating == "none":
            if per_step_ffn or isinstance(dim_feedforward, list):
                raise ValueError("gating 'none' cannot have per-step weights; use a gated FFN (e.g. 'silu')")
            self.linear1 = nn.Linear(dim, dim_feedforward, bias=False, **factory)
            self.linear2 = nn.Linear(dim_feedforward, dim, bias=False, **factory)
        elif per_step_ffn:
            widths = dim_feedforward if isinstance(dim_feedforward, list) else [dim_feedforward] * n_sets
            if len(widths) != n_sets:
                raise ValueError(f"dim_feedforward lists {len(widths)} widths for {n_sets} weight sets")
            self.gating = nn.ModuleList([ActivationGating(dim, w, gating, **factory) for w in widths])
        else:
            if isinstance(dim_feedforward, list):
                raise ValueError("a list dim_feedforward needs per-step weights (weights_per_step)")
            self.gating = ActivationGating(dim, dim_feedforward, gating, **factory)
        self.layer_scale_1: nn.Module = (
            nn.Identity() if layer_scale is None else LayerScale(dim, layer_scale, **factory)
        )
        self.layer_scale_2: nn.Module = (
            nn.Identity() if layer_scale is None else LayerScale(dim, layer_scale, **factory)
        )

    def feed_forward(self, x: torch.Tensor, sets: list[int] | None) -> torch.Tensor:
        """FFN of the normalised x [B, T, D] -> [B, T, D]; position t uses gating set ``sets[t]`` if per step."""
        if self.linear1 is not None and self.linear2 is not None:
            return self.linear2(F.gelu(self.linear1(x)))
        if isinstance(self.gating, nn.ModuleList):
            if sets is None:
                raise ValueError("per-step FFN called without weight sets")
            if len(sets) == 1:
                return self.gating[sets[0]](x)
            return torch.cat([self.gating[s](x[:, t : t + 1]) for t, s in enumerate(sets)], dim=1)
        assert self.gating is not None
        return self.gating(x)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | str | None,
        sets: list[int] | None,
        cache: KVCache | None = None,
        cache_step: CacheStep | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; arguments as in :meth:`MultiheadAttention.forward`."""
        update = self.self_attn(self.norm1(x), rope, mask, sets, cache, cache_step, layer)
        x = x + self.layer_scale_1(update)
        update = self.feed_forward(self.norm2(x), sets)
        x = x + self.layer_scale_2(update)
        return x


StepPlan = tuple[CacheStep, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]
"""(cache plan, attention mask, RoPE tables) of an eager streaming forward (see :attr:`TransformerState.plans`)."""


@dataclass
class TransformerState:
    """Streaming state of one :class:`StreamingTransformer` for a batch of rows.

    Attributes:
        cache: the KV cache of all layers, with the per-row offsets (``cache.offset`` [B] long).
        step: host-side count of positions appended to *all* rows since the last full reset; it selects the
            weight set of weights-per-step transformers when ``forward`` gets no explicit ``step``.
        plans: the eager forward's cache plan, attention mask and RoPE tables by (``step``, T), reused from frame to
            frame, or None (built every call). Only for a state whose rows always step together from a full reset
            (the depformer's on the CPU, where building them costs about 30 small operations a call): there every
            row's offset is ``step``, so the plan of a key never changes. Stepping a subset of rows, or resetting one,
            turns it off for good.
    """

    cache: KVCache
    step: int = 0
    plans: dict[tuple[int, int], StepPlan] | None = None

    @property
    def offset(self) -> torch.Tensor:
        """[B] long: next absolute position of each row."""
        return self.cache.offset

    @property
    def batch_size(self) -> int:
        return self.cache.batch_size

    def reset(self, rows: torch.Tensor | None = None, clear: bool = False) -> None:
        """Empty the chosen rows ([B'] long; all rows when None): offset 0, cache empty (its buffers zeroed with
        ``clear``: :meth:`cspan.core.kv_cache.KVCache.reset`)."""
        self.cache.reset(rows, clear)
        if rows is None:
            self.step = 0
        else:
            self.plans = None  # the rows' offsets differ from here on


class StreamingTransformer(nn.Module):
    """A stack of :class:`StreamingTransformerLayer` with optional sinusoidal input embedding and RoPE.

    Args:
        d_model: width D.
        num_heads: attention heads H (Dh = D / H).
        num_layers: L.
        dim_feedforward: FFN width F (per weight set when a list).
        causal: causal attention (the only streaming mode; non-causal attends to every valid key).
        context: attention window in positions (key visible iff ``0 <= pos_q - pos_k < context``), None = unbounded.
        positional_embedding: "none", "sin" (added to the input), "rope", or "sin_rope".
        max_period: period base of RoPE and of the sin embedding.
        gating: "none" (GELU MLP) or the activation of a gated FFN ("silu" for Moshi).
        norm: see :func:`cspan.core.modules.norms.make_norm`.
        layer_scale: initial LayerScale value, None for no LayerScale.
        weights_per_step: N > 0 gives position n (since reset) its own weight set ``schedule[n]`` (or n).
        weights_per_step_schedule: length-N map step -> weight set.

    Raises:
        ValueError: inconsistent arguments (unknown names, schedule length, width not divisible by heads).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_layers: int,
        dim_feedforward: int | list[int] = 2048,
        causal: bool = False,
        context: int | None = None,
        positional_embedding: str = "sin",
        max_period: float = 10_000.0,
        gating: str = "none",
        norm: str = "layer_norm",
        layer_scale: float | None = None,
        weights_per_step: int = 0,
        weights_per_step_schedule: list[int] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if positional_embedding not in POSITIONAL_EMBEDDINGS:
            raise ValueError(
                f"unknown positional_embedding {positional_embedding!r}; expected one of {POSITIONAL_EMBEDDINGS}"
            )
        if context is not None and context < 1:
            raise ValueError(f"context must be >= 1 or None, got {context}")
        self.d_model = d_model
        self.num_heads = num_heads
        self.causal = causal
        self.context = context
        self.positional_embedding = positional_embedding
        self.max_period = max_period
        self.rope = positional_embedding in ("rope", "sin_rope")
        """Whether attention rotates queries and keys (RoPE; the fused paths take only "rope" or "none")."""
        self.weights_per_step = weights_per_step
        self.weights_per_step_schedule = list(weights_per_step_schedule) if weights_per_step_schedule else None
        n_sets = 1
        if weights_per_step:
            n_sets = weights_per_step
            if self.weights_per_step_schedule is not None:
                if len(self.weights_per_step_schedule) != weights_per_step:
                    raise ValueError(
                        f"weights_per_step_schedule has {len(self.weights_per_step_schedule)} entries, "
                        f"expected weights_per_step = {weights_per_step}"
                    )
                n_sets = max(self.weights_per_step_schedule) + 1
        elif self.weights_per_step_schedule is not None:
            raise ValueError("weights_per_step_schedule given without weights_per_step")
        self.n_sets = n_sets
        self.layers = nn.ModuleList(
            [
                StreamingTransformerLayer(
                    d_model,
                    num_heads,
                    dim_feedforward,
                    norm=norm,
                    gating=gating,
                    layer_scale=layer_scale,
                    n_sets=n_sets,
                    per_step_ffn=bool(weights_per_step),
                    device=device,
                    dtype=dtype,
                )
                for _ in range(num_layers)
            ]
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def default_capacity(self) -> int:
        """KV slots per row: the context when set, else the number of weight-per-step positions.

        Raises:
            ValueError: neither is set (give ``capacity`` to :meth:`new_state`).
        """
        if self.context is not None:
            return self.context
        if self.weights_per_step:
            return self.weights_per_step
        raise ValueError("a transformer without context or weights_per_step needs an explicit KV capacity")

    def new_state(
        self,
        batch_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        capacity: int | None = None,
        kv_dtype: torch.dtype | None = None,
        reuse_plans: bool = False,
    ) -> TransformerState:
        """Fresh streaming state: empty KV cache of ``capacity`` slots per row (:meth:`default_capacity` when None).

        ``device``/``dtype`` default to those of the parameters; ``kv_dtype`` (default ``dtype``) is the cache's
        storage dtype (``torch.float8_e4m3fn``: FP8, see :class:`cspan.core.kv_cache.KVCache`); ``reuse_plans``:
        see :attr:`TransformerState.plans`.

        Raises:
            ValueError: capacity smaller than the context (the sliding window would lose keys).
        """
        if capacity is None:
            capacity = self.default_capacity()
        if self.context is not None and capacity < self.context:
            raise ValueError(f"KV capacity {capacity} is smaller than the attention context {self.context}")
        param = next(iter(self.parameters()), None)
        if device is None:
            device = param.device if param is not None else "cpu"
        if dtype is None:
            dtype = param.dtype if param is not None else torch.float32
        cache = KVCache(
            len(self.layers), batch_size, self.num_heads, self.head_dim, capacity, device, kv_dtype or dtype, dtype
        )
        return TransformerState(cache=cache, plans={} if reuse_plans else None)

    def weight_sets(self, first_step: int, num_positions: int) -> list[int] | None:
        """Weight set of each of ``num_positions`` positions starting at step ``first_step`` (None: single set).

        Raises:
            ValueError: a step beyond ``weights_per_step``.
        """
        if not self.weights_per_step:
            return None
        last = first_step + num_positions
        if first_step < 0 or last > self.weights_per_step:
            raise ValueError(
                f"steps {first_step}..{last - 1} are outside the {self.weights_per_step} weights-per-step positions; "
                "reset the state at the start of each frame"
            )
        steps = range(first_step, last)
        if self.weights_per_step_schedule is None:
            return list(steps)
        return [self.weights_per_step_schedule[s] for s in steps]

    fused: bool | None = None
    """Run streaming forwards given no execution plan (Mimi) through :mod:`cspan.core.modules.fused`: None
    (default) does so for bfloat16/float16 activations on CUDA when Triton is present; True also for float32; False
    never. With a plan (the duplex engine's LM) the plan decides."""

    gemv: bool | None = None
    """Given no execution plan, run one-position steps of at most ``fused.GEMV_MAX_ROWS`` rows as five launches per
    layer (:func:`cspan.core.modules.fused.gemv` with the norms, residuals and gate fused in, plus the attention
    kernel): None (default) for models of width <= 2048 unless ``CSPAN_GEMV=0``, True / False to force."""

    def fused_supported(self, sets: list[int] | None = None) -> bool:
        """Whether the fused kernels can run this transformer's streaming forward (its structure only): causal,
        RoPE or no positional embedding, a power-of-two head dimension of at least 16, one weight set per call."""
        if not self.causal or self.positional_embedding not in ("rope", "none"):
            return False
        if sets is not None and len(set(sets)) > 1:
            return False
        return self.head_dim >= 16 and not self.head_dim & (self.head_dim - 1)

    def _gemv_layers_ok(self, sets: list[int] | None) -> bool:
        """Whether every layer has the shape :func:`cspan.core.modules.fused.gemv` fuses: float32 RMSNorms, no
        LayerScale, a SiLU-gated FFN, widths up to ``fused.GEMV_MAX_K``."""
        for layer in self.layers:
            gating = layer.gating
            if isinstance(gating, nn.ModuleList):
                if sets is None:
                    return False
                gating = gating[sets[0]]
            if not isinstance(gating, ActivationGating) or gating.activation_name != "silu":
                return False
            if max(layer.self_attn.dim, gating.hidden) > fused.GEMV_MAX_K:
                return False
            norms = (layer.norm1, layer.norm2)
            if not all(isinstance(n, RMSNorm) and n.compute_dtype == torch.float32 for n in norms):
                return False
            if not isinstance(layer.layer_scale_1, nn.Identity) or not isinstance(layer.layer_scale_2, nn.Identity):
                return False
        return True

    def _paths(self, x: torch.Tensor, sets: list[int] | None, plan: ExecutionPlan | None) -> tuple[bool, bool]:
        """(fused, gemv) for a streaming forward of x [B, T, D]: from the plan when given (the duplex engine), else
        from :attr:`fused` / :attr:`gemv` and the kernels' defaults."""
        if not self.fused_supported(sets):
            return False, False
        one_row = x.shape[1] == 1 and x.shape[0] <= fused.GEMV_MAX_ROWS and self.d_model <= 2048
        if plan is not None:
            on = plan.fused
            gemv = on and plan.depformer_gemv and one_row
        else:
            use = self.fused if self.fused is not None else x.dtype in (torch.bfloat16, torch.float16)
            on = bool(use) and fused.usable(x, self.layers[0].self_attn.in_proj_weight)
            auto = fused.DEFAULT.gemv and self.d_model <= 2048
            gemv = on and x.shape[1] == 1 and x.shape[0] <= fused.GEMV_MAX_ROWS
            gemv = gemv and (self.gemv if self.gemv is not None else auto)
        return on, bool(gemv and self._gemv_layers_ok(sets))

    def gemv_path(self, x: torch.Tensor, sets: list[int] | None = None, plan: ExecutionPlan | None = None) -> bool:
        """Whether a streaming one-position forward of ``x`` [B, 1, D] runs as GEMV launches (see :attr:`gemv`)."""
        return self._paths(x, sets, plan)[1]

    def forward(
        self,
        x: torch.Tensor,
        state: TransformerState | None = None,
        rows: torch.Tensor | None = None,
        step: int | None = None,
        *,
        plan: ExecutionPlan | None = None,
    ) -> torch.Tensor:
        """Run the stack over T new positions.

        Args:
            x: [B, T, D] input.
            state: None for a plain forward over positions 0..T-1 (training, non-streaming); otherwise the T
                positions start at each row's offset, their keys/values are appended to ``state.cache`` and the
                offsets advance by T.
            rows: [B'] long rows of ``state`` that x belongs to (x has batch B'); the other rows are untouched.
                None means all rows.
            step: index of the first position for weights-per-step transformers (default 0 without a state,
                ``state.step`` with one).
            plan: the kernel choices of a duplex engine (:class:`cspan.core.plan.ExecutionPlan`); None decides as
                :attr:`fused` and :attr:`gemv` say.

        Returns:
            [B, T, D].

        Raises:
            ValueError: weights-per-step with ``rows`` and no explicit ``step``; steps beyond ``weights_per_step``.
        """
        T, D = x.shape[1], x.shape[2]
        cache: KVCache | None = None
        cache_step: CacheStep | None = None
        if state is None:
            positions = torch.arange(T, device=x.device, dtype=torch.long)[None]  # [1, T]
            mask: torch.Tensor | str | None = None
            if self.causal:
                window_bites = self.context is not None and self.context < T
                mask = attention_mask(positions, positions, self.context) if window_bites else CAUSAL
            first_step = 0 if step is None else step
        else:
            if step is None:
                if rows is not None and self.weights_per_step:
                    raise ValueError("weights-per-step transformer stepped on a subset of rows needs an explicit step")
                step = state.step
            first_step = step
        sets = self.weight_sets(first_step, T)

        if state is not None:
            on, gemv = self._paths(x, sets, plan)
            if on:
                out = self._fused_forward(x, state, rows, sets, gemv, None if plan is None else plan.pdl)
                if rows is None:
                    state.step += T
                return out
            cache = state.cache
            key = (state.step, T)
            if state.plans is not None and rows is None and key in state.plans:
                cache_step, mask, rope = state.plans[key]
            else:
                cache_step = cache.begin(T, rows)
                window = self.context if self.context is not None else cache.capacity
                mask = attention_mask(cache_step.positions, cache_step.key_positions, window, causal=self.causal)
                rope = rope_tables(cache_step.positions, self.head_dim, self.max_period) if self.rope else None
                if state.plans is not None:
                    if rows is None:
                        # as the additive mask attention makes of a boolean one (0 / -inf): not remade every call
                        mask = torch.zeros((), dtype=x.dtype, device=x.device).masked_fill(~mask, float("-inf"))
                        state.plans[key] = (cache_step, mask, rope)
                    else:
                        state.plans = None  # the rows' offsets differ from here on
            positions = cache_step.positions  # [B', T]
        else:
            rope = rope_tables(positions, self.head_dim, self.max_period) if self.rope else None

        if self.positional_embedding in ("sin", "sin_rope"):
            x = x + sin_embedding(positions, D, self.max_period, dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, mask, sets, cache, cache_step, i)

        if state is not None and cache_step is not None:
            state.cache.advance(cache_step)
            if rows is None:
                state.step += T
        return x

    def _fused_forward(
        self,
        x: torch.Tensor,
        state: TransformerState,
        rows: torch.Tensor | None,
        sets: list[int] | None,
        gemv: bool,
        pdl: bool | None,
    ) -> torch.Tensor:
        """The streaming forward through :mod:`cspan.core.modules.fused`: per layer, residual add + RMSNorm in one
        kernel, the attention block (:meth:`MultiheadAttention.fused_forward`), residual add + RMSNorm, the FFN;
        with ``gemv``, five launches per layer. Same function as the eager path up to rounding order."""
        cache = state.cache
        T = x.shape[1]
        window = self.context if self.context is not None else cache.capacity
        cache_rows = cache.rows if rows is None else rows
        # [B'] each row's first new position (all rows: the offsets themselves, read before advance_by below)
        start = cache.offset if rows is None else cache.offset.index_select(0, rows)
        rope = None
        if self.rope:
            positions = start[:, None] + torch.arange(T, device=x.device, dtype=torch.long)
            rope = rope_tables(positions, self.head_dim, self.max_period)
        weight_set = None if sets is None else sets[0]
        if gemv:
            h = x[:, 0].contiguous()  # [B', D]
            cos_sin = None if rope is None else (rope[0][:, 0], rope[1][:, 0])
            for i, layer in enumerate(self.layers):
                w_in, w_out = layer.self_attn.weights(weight_set)
                qkv = fused.gemv(h, w_in, norm=(layer.norm1.alpha, layer.norm1.eps), pdl=pdl)
                keys, values = cache.keys[i], cache.values[i]
                attn = fused.decode_attention(
                    qkv, keys, values, start, cache_rows, window, cos_sin, cache.layer_scales(i), pdl=pdl
                )
                h = fused.gemv(attn, w_out, residual=h, pdl=pdl)
                ffn = layer.gating[weight_set] if isinstance(layer.gating, nn.ModuleList) else layer.gating
                g = fused.gemv(h, ffn.linear_in.weight, norm=(layer.norm2.alpha, layer.norm2.eps), gate=True, pdl=pdl)
                h = fused.gemv(g, ffn.linear_out.weight, residual=h, pdl=pdl)
            cache.advance_by(1, rows)
            return h[:, None]
        where = start if T == 1 else fused.Ragged.uniform(cache_rows, T, cache.capacity).at(cache.offset)
        update: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            x, h = _add_norm(x, update, layer.norm1, pdl)
            attn = layer.self_attn.fused_forward(h, weight_set, cache, i, window, rope, cache_rows, where, pdl)
            x, h = _add_norm(x, layer.layer_scale_1(attn), layer.norm2, pdl)
            update = layer.layer_scale_2(_feed_forward(layer, h, sets, pdl))
        cache.advance_by(T, rows)
        assert update is not None
        return x + update

    def forward_step(
        self, x: torch.Tensor, state: TransformerState, layout: StepLayout, plan: ExecutionPlan
    ) -> torch.Tensor:
        """The duplex engine's step: every row's block (if any) and next position in ONE ragged forward.

        ``x`` holds T = d + N token inputs. The d decode slots come first (d = b, or 0 when every row reads a
        block): slot i is the next position of cache row ``layout.slot_rows[i]``. The N ragged tokens follow, one
        sequence per row with a block: its n block columns at ``offset, offset + 1, ...`` of its row, then its next
        position at ``offset + n`` (that row's decode slot is a dummy on the scratch row). Every matrix product
        runs once over all T tokens (the weights are read once: the mixed prefill/decode batches of vLLM and
        Sarathi-Serve, Agrawal et al. 2024). Per layer, each ragged sequence attends to its row's ring and causally
        to itself and is then written into the ring (exactly as a chunk of :meth:`forward`: a row's block and next
        position read as one sequence of n + 1 positions), and each decode slot attends to its row's ring with its
        own key written in (exactly as one step of :meth:`forward`). So a row's result is the result of reading its
        block and then stepping, whatever the other rows do. The last layer computes its attention output and
        feed-forward for the b next positions only (``layout.final``; the blocks only need their keys and values).
        Offsets advance by ``block_len + 1``.

        Args:
            x: [T, D] input embeddings.
            state: the temporal state (its cache holds every row).
            layout: where the tokens go (:class:`StepLayout`).
            plan: the engine's kernel choices.

        Returns:
            [b, D]: the outputs at the b rows' next positions, in the order of ``layout.rows``.
        """
        if not self.fused_supported():
            raise ValueError("the engine's step needs a causal transformer with RoPE or no positional embedding")
        cache = state.cache
        window = self.context if self.context is not None else cache.capacity
        if plan.fused:
            out = self._fused_step(x, cache, layout, window, plan)
        else:
            out = self._eager_step(x, cache, layout, window)
        cache.advance_by(layout.block_len + 1, layout.rows)
        return out

    def _eager_step(self, x: torch.Tensor, cache: KVCache, layout: StepLayout, window: int) -> torch.Tensor:
        """:meth:`forward_step` with the eager modules (each row's ragged sequence as its own chunk, the decode
        slots of the rows without a block as one step; CPU, tests). Dummy slots compute nothing."""
        rows = layout.rows
        b, T = rows.shape[0], x.shape[0]
        H, Dh = self.num_heads, self.head_dim
        d = layout.slots
        # the decode slots of the rows without a block: all b of them (no host tables: a CUDA graph may capture
        # this step), or a subset (a step with blocks, never graphed on the eager path)
        plain: slice | torch.Tensor = slice(0, d)
        decode = None
        if not layout.blocks:
            decode = cache.begin(1, slice(0, b) if layout.first_rows == b else rows)  # in order: rings as views
        elif d:
            block_rows = {i for i, _, _ in layout.blocks}
            plain = torch.tensor([i for i in range(d) if i not in block_rows], dtype=torch.long, device=x.device)
            decode = cache.begin(1, rows.index_select(0, plain)) if plain.numel() else None
        chunks = [(slice(d + s, d + s + n + 1), cache.begin(n + 1, rows[i : i + 1])) for i, s, n in layout.blocks]
        positions = torch.zeros(T, dtype=torch.long, device=x.device)
        if decode is not None:
            positions[plain] = decode.positions[:, 0]
        for sl, chunk in chunks:
            positions[sl] = chunk.positions[0]
        rope = rope_tables(positions[None], Dh, self.max_period) if self.rope else None
        final = slice(0, b) if layout.final is None else layout.final
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = layer.norm1(x)
            qkv = F.linear(h, layer.self_attn.in_proj_weight).view(T, 3, H, Dh).permute(1, 2, 0, 3)  # [3, H, T, Dh]
            q, k, v = qkv[0][None], qkv[1][None], qkv[2][None]  # [1, H, T, Dh]
            if rope is not None:
                q, k = rotate(qkv[:2, None], rope).unbind(0)
            out = torch.zeros(1, H, T, Dh, dtype=x.dtype, device=x.device)
            for sl, chunk in chunks:  # a block and its next position: the ring and themselves, then stored
                keys, values = cache.update(i, k[:, :, sl], v[:, :, sl], chunk)
                for a in range(0, sl.stop - sl.start, EAGER_QUERY_ROWS):
                    rows_a = slice(sl.start + a, min(sl.stop, sl.start + a + EAGER_QUERY_ROWS))
                    mask = attention_mask(chunk.positions[:, a : a + EAGER_QUERY_ROWS], chunk.key_positions, window)
                    out[:, :, rows_a] = F.scaled_dot_product_attention(q[:, :, rows_a], keys, values, attn_mask=mask)
            if decode is not None:  # one position per plain row
                k_next = k[0, :, plain, None].transpose(0, 1)  # [p, H, 1, Dh]
                keys, values = cache.update(i, k_next, v[0, :, plain, None].transpose(0, 1), decode)
                mask = attention_mask(decode.positions, decode.key_positions, window)
                q_next = q[0, :, plain, None].transpose(0, 1)
                o_next = F.scaled_dot_product_attention(q_next, keys, values, attn_mask=mask)  # [p, H, 1, Dh]
                out[0, :, plain] = o_next[:, :, 0].transpose(0, 1)
            attn = F.linear(out[0].transpose(0, 1).reshape(T, H * Dh), layer.self_attn.out_proj.weight)
            if i == last:  # only the next positions' outputs are used
                x, attn = x[final], attn[final]
            x = x + layer.layer_scale_1(attn)
            x = x + layer.layer_scale_2(layer.feed_forward(layer.norm2(x), None))
        return x

    def _fused_step(
        self, x: torch.Tensor, cache: KVCache, layout: StepLayout, window: int, plan: ExecutionPlan
    ) -> torch.Tensor:
        """:meth:`forward_step` through the kernels: per layer one product over all tokens, the decode slots'
        attention (which writes their keys), the ragged sequences' attention and cache write, one product.

        In a step with both decode slots and ragged tokens, the ragged sequences' attention runs on
        ``plan.attention_stream`` (when the plan has one) while the decode slots' attention runs on the current
        stream; the ragged keys and values are written after the join, on the current stream. The first attention
        is bound by the matrix units, the second by the memory (it streams every slot row's ring), and they touch
        different cache rows, so the GPU runs them at once (the idea of POD-Attention, Kamath et al. 2025, with two
        kernels on two streams instead of one fused kernel). Each kernel computes what it computes alone: the
        results are the same bit for bit."""
        pdl, d = plan.pdl, layout.slots
        slot_rows = layout.slot_rows
        slot_pos = None if slot_rows is None else cache.offset.index_select(0, slot_rows)  # [d]
        ragged = last_ragged = None
        if layout.ragged is not None:
            ragged = layout.ragged.at(cache.offset)
            assert layout.last_queries is not None
            last_qb = layout.last_queries[0]
            live = ragged.live_blocks and min(ragged.live_blocks, last_qb.shape[0])  # at most one per sequence
            last_ragged = dataclasses.replace(ragged, qb_seq=last_qb, qb_j=layout.last_queries[1], live_blocks=live)
        if ragged is None:
            assert slot_pos is not None, "a step has decode slots, ragged tokens, or both"
            positions = slot_pos
        else:
            positions = ragged.tok_pos if slot_pos is None else torch.cat([slot_pos, ragged.tok_pos])
        rope = None
        if self.rope:
            rope = rope_tables(positions, self.head_dim, self.max_period)
        last = len(self.layers) - 1
        update: torch.Tensor | None = None
        block_rope = None if rope is None else (rope[0][d:], rope[1][d:])
        side = plan.attention_stream if ragged is not None and slot_pos is not None else None
        # the block attention's grid (fused.prefill_grid): beside decode slots (as sized: an unpadded step whose
        # graph has a padding row's slot splits its keys as that graph does), running at the same time or not
        beside = (slot_pos is not None or layout.sized_slots, side is not None)
        main = None if side is None else torch.cuda.current_stream(x.device)
        for i, layer in enumerate(self.layers):
            x, h = _add_norm(x, update, layer.norm1, pdl)
            qkv = F.linear(h, layer.self_attn.in_proj_weight)  # [T, 3D]
            keys, values, scales = cache.keys[i], cache.values[i], cache.layer_scales(i)
            blocks = None
            if ragged is not None:
                queries = ragged if i < last else last_ragged  # the last layer: the next positions' blocks only
                block = (qkv[d:], self.num_heads, block_rope, queries, keys, values, scales, window, *beside, pdl)
                if side is not None:  # beside the decode slots' attention below
                    # the side stream waits for everything queued on the main one, so memory the allocator hands it
                    # again (its own tensors, last used on the main stream before this point) is free by then
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        blocks = _block_attention(*block)
            parts = []
            if slot_pos is not None:
                slot_rope = None if rope is None else (rope[0][:d], rope[1][:d])
                if layout.decode is not None:  # a library's decode (cspan.core.attention): write first, then read
                    q, k, v = fused.rope_split(qkv[:d], self.num_heads, slot_rope, pdl=pdl)
                    fused.kv_write(k, v, keys, values, slot_rows, slot_pos, scales, pdl=pdl)
                    parts.append(layout.decode.run(q, keys, values))
                else:
                    attn = fused.decode_attention(
                        qkv[:d], keys, values, slot_pos, slot_rows, window, slot_rope, scales,
                        plan.decode_config, pdl, layout.sized_rows,
                    )  # fmt: skip
                    parts.append(attn)
            if ragged is not None:
                if side is not None:
                    main.wait_stream(side)
                out, k, v = _block_attention(*block) if blocks is None else blocks
                # the block's keys and values into the ring after its attention (which reads the ring entries they
                # replace), on this stream: beside the decode it would wait for the decode's SMs
                fused.kv_write(k, v, keys, values, queries.tok_row, queries.store_pos, scales, pdl=pdl)
                parts.append(out)
            attn = torch.cat(parts) if len(parts) > 1 else parts[0]
            if i == last and layout.final is not None:  # only the next positions' outputs are used
                x, attn = x.index_select(0, layout.final), attn.index_select(0, layout.final)
            attn = F.linear(attn, layer.self_attn.out_proj.weight)
            x, h = _add_norm(x, layer.layer_scale_1(attn), layer.norm2, pdl)
            update = layer.layer_scale_2(_feed_forward(layer, h, None, pdl))
        assert update is not None
        return x + update


@dataclass
class StepLayout:
    """Where the tokens of one duplex-engine step go (:meth:`StreamingTransformer.forward_step`).

    Tokens ``0 .. d-1`` are decode slots (d = b, or 0 when every row reads a block); the ragged tokens follow:
    each row's block columns then its next position, one row after the other, then padding (CUDA graphs run at a
    few fixed sizes).

    Attributes:
        rows: [b] long cache rows (padding rows point at a scratch row).
        block_len: [b] long block columns each row reads before its next position (0: none).
        slot_rows: [d] long, the decode slots' cache rows (a block row's slot, and a padding row's, is a dummy on
            the scratch row), or None without decode slots.
        final: [b] long, each row's next position as a token index (its slot, or the last token of its ragged
            sequence), or None without ragged tokens (then token i is row i's next position).
        blocks: (i, start, n) on the host: row ``rows[i]``'s block is ragged tokens ``start .. start + n - 1`` and
            its next position ragged token ``start + n`` (the eager path reads them row by row).
        ragged: the ragged tokens for the kernels (:class:`cspan.core.modules.fused.Ragged`, without positions:
            the step adds them), None without ragged tokens.
        last_queries: (qb_seq, qb_j) of the last layer's prefill: the query block holding each sequence's last
            token (the next position), or None.
        first_rows: b when ``rows`` is ``0 .. b - 1`` in order (the eager path then reads the rings as views),
            else 0.
        sized_rows: the rows the decode slots' attention is sized for (:class:`cspan.core.sessions.StepShape`),
            or 0: the slots.
        sized_slots: size the ragged sequences' attention as beside decode slots even without slots here (the
            step's graph bucket has them, if only a padding row's dummy).
        decode: a library decode (:class:`cspan.core.attention.FlashInferDecode`, planned for this step) for the
            decode slots, or None for :func:`cspan.core.modules.fused.decode_attention`.
    """

    rows: torch.Tensor
    block_len: torch.Tensor
    slot_rows: torch.Tensor | None
    final: torch.Tensor | None = None
    blocks: list[tuple[int, int, int]] = field(default_factory=list)
    ragged: fused.Ragged | None = None
    last_queries: tuple[torch.Tensor, torch.Tensor] | None = None
    first_rows: int = 0
    sized_rows: int = 0
    sized_slots: bool = False
    decode: Any = None

    @property
    def slots(self) -> int:
        """d: the decode slots (b, or 0 when every row reads a block)."""
        return 0 if self.slot_rows is None else self.slot_rows.shape[0]


def _block_attention(
    qkv: torch.Tensor,
    heads: int,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    queries: fused.Ragged,
    keys: torch.Tensor,
    values: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    window: int,
    beside_decode: bool,
    concurrent: bool,
    pdl: bool | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ragged sequences' attention of one layer (their ``qkv`` [n, 3D]; ``beside_decode``: the step has decode
    slots too, whose attention runs at the same time if ``concurrent``): the output [n, H, Dh] and the rotated keys
    and the values [n, H, Dh] for the ring."""
    q, k, v = fused.rope_split(qkv, heads, rope, pdl=pdl)
    out = fused.prefill_attention(
        q, k, v, keys, values, queries, window, scales, pdl=pdl, beside_decode=beside_decode, concurrent=concurrent
    )
    return out, k, v


def _feed_forward(layer: StreamingTransformerLayer, h: torch.Tensor, sets: list[int] | None, pdl: bool | None):
    """The layer's FFN on the fused path: a SiLU gate through :func:`cspan.core.modules.fused.silu_gate`."""
    gating = layer.gating
    if isinstance(gating, nn.ModuleList):
        gating = gating[sets[0]] if sets is not None else None
    if isinstance(gating, ActivationGating) and gating.activation_name == "silu":
        return gating.linear_out(fused.silu_gate(gating.linear_in(h), pdl))
    return layer.feed_forward(h, sets)


def _add_norm(
    x: torch.Tensor, update: torch.Tensor | None, norm: nn.Module, pdl: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm(s)) with ``s = x + update`` (``x`` when update is None): one kernel for a float32 RMSNorm (callers
    are on the fused path)."""
    if isinstance(norm, RMSNorm) and norm.compute_dtype == torch.float32:
        return fused.rms_norm(x, norm.alpha, norm.eps, update, pdl)
    if update is not None:
        x = x + update
    return x, norm(x)
