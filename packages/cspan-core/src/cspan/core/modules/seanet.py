"""SEANet convolutional encoder and decoder of the Mimi codec (causal, streaming).

Architecture from Kyutai's ``moshi/modules/seanet.py`` (itself after Tagliasacchi et al., "SEANet: A Multi-modal
Speech Enhancement Network", 2020, and Défossez et al., "High Fidelity Neural Audio Compression" (EnCodec), 2022,
section 3.1). Layer indices inside ``model`` follow upstream so that checkpoint keys match
(``encoder.model.0.conv.conv.weight``, ``encoder.model.1.block.1.conv.conv.weight``, ...).

Encoder (ratios used in reverse, e.g. strides 4, 5, 6, 8):
``conv k7 (C -> F)``, then per stride ``s``: ``n_residual_layers`` residual blocks, ELU,
``conv k=2s stride s (W -> 2W)``; finally ELU and ``conv k3 (W -> dimension)``.

Decoder (ratios in order, e.g. 8, 6, 5, 4): ``conv k7 (dimension -> W)``, then per ratio ``s``: ELU,
``transposed conv k=2s stride s (W -> W/2)``, residual blocks; finally ELU and ``conv k3 (F -> C)``.

Residual block: ``x + [act, conv k_res (dilation base**j) W -> W/compress, act, conv k1 W/compress -> W](x)``.
"""

from __future__ import annotations

from torch import Tensor, nn

from .conv import StateGroup, StreamingConv1d, StreamingConvTranspose1d

_STREAMING = (StreamingConv1d, StreamingConvTranspose1d)


def _activation(name: str, params: dict) -> nn.Module:
    """``getattr(torch.nn, name)(**params)``; raises ValueError naming the activation if it does not exist."""
    act = getattr(nn, name, None)
    if act is None or not isinstance(act, type) or not issubclass(act, nn.Module):
        raise ValueError(f"seanet activation {name!r} is not a torch.nn module name (expected e.g. 'ELU')")
    return act(**params)


def _run_sequential(
    model: nn.Sequential, x: Tensor, state: StateGroup | None, residual: Tensor | None = None
) -> Tensor:
    """Run ``model`` (``+ residual`` at the end). In streaming, an ``nn.ELU`` right before a streaming conv and
    the residual add after a last conv are handed to that conv (``activation=`` / ``residual=``), which on the GPU
    does them inside its fused kernel; the arithmetic is the same."""
    if state is None:
        x = model(x)
        return x if residual is None else residual + x
    alpha: float | None = None
    for name, layer, fold_alpha, stateful, last_conv in _streaming_plan(model):
        if fold_alpha is not None:
            alpha = fold_alpha
            continue
        if not stateful:
            x = layer(x)
            continue
        kwargs: dict = {}
        if alpha is not None:
            kwargs["activation"] = alpha
            alpha = None
        if residual is not None and last_conv:
            kwargs["residual"] = residual
            residual = None
        x = layer(x, state[name], **kwargs)
    return x if residual is None else residual + x


def _streaming_plan(model: nn.Sequential) -> list[tuple[str, nn.Module, float | None, bool, bool]]:
    """Per layer of ``model``: (name, layer, the alpha of an ELU folded into the next conv or None, whether it
    takes a streaming state, whether it is a last conv that takes the residual); built on the first streaming
    call and kept (the layers of a SEANet do not change after construction)."""
    plan = model.__dict__.get("_cspan_streaming_plan")
    if plan is None:
        layers = list(model.named_children())
        plan = []
        for idx, (name, layer) in enumerate(layers):
            following = layers[idx + 1][1] if idx + 1 < len(layers) else None
            folds = type(layer) is nn.ELU and not layer.inplace and isinstance(following, _STREAMING)
            plan.append(
                (
                    name,
                    layer,
                    float(layer.alpha) if folds else None,
                    isinstance(layer, (*_STREAMING, SEANetResnetBlock)),
                    following is None and isinstance(layer, StreamingConv1d),
                )
            )
        model.__dict__["_cspan_streaming_plan"] = plan
    return plan


def _sequential_state(model: nn.Sequential, batch_size: int, device, dtype) -> StateGroup:
    return StateGroup(
        {
            name: layer.new_state(batch_size, device, dtype)
            for name, layer in model.named_children()
            if isinstance(layer, (*_STREAMING, SEANetResnetBlock))
        }
    )


class SEANetResnetBlock(nn.Module):
    """Residual block ``[B, W, T] -> [B, W, T]``: ``shortcut(x) + block(x)``.

    Args:
        dim: channels ``W``.
        kernel_sizes, dilations: per conv of the branch (upstream: ``[k_res, 1]`` and ``[base**j, 1]``).
        activation, activation_params: ``torch.nn`` activation name and its keyword arguments.
        pad_mode: padding of the causal convs.
        compress: the branch's hidden width is ``dim // compress``.
        true_skip: identity shortcut (else a k1 conv named ``shortcut``).
    """

    def __init__(
        self,
        dim: int,
        kernel_sizes: list[int],
        dilations: list[int],
        activation: str = "ELU",
        activation_params: dict | None = None,
        pad_mode: str = "constant",
        compress: int = 2,
        true_skip: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if len(kernel_sizes) != len(dilations):
            raise ValueError(f"kernel_sizes {kernel_sizes} and dilations {dilations} must have the same length")
        params = {"alpha": 1.0} if activation_params is None else activation_params
        hidden = dim // compress
        layers: list[nn.Module] = []
        for i, (kernel_size, dilation) in enumerate(zip(kernel_sizes, dilations, strict=True)):
            in_chs = dim if i == 0 else hidden
            out_chs = dim if i == len(kernel_sizes) - 1 else hidden
            layers += [
                _activation(activation, params),
                StreamingConv1d(
                    in_chs, out_chs, kernel_size, dilation=dilation, pad_mode=pad_mode, device=device, dtype=dtype
                ),
            ]
        self.block = nn.Sequential(*layers)
        self.shortcut: nn.Module = (
            nn.Identity() if true_skip else StreamingConv1d(dim, dim, 1, pad_mode=pad_mode, device=device, dtype=dtype)
        )

    def new_state(self, batch_size: int, device=None, dtype=None) -> StateGroup:
        """Streaming state of the branch convs (and of the shortcut conv when there is one)."""
        states = {"block": _sequential_state(self.block, batch_size, device, dtype)}
        if isinstance(self.shortcut, StreamingConv1d):
            states["shortcut"] = self.shortcut.new_state(batch_size, device, dtype)
        return StateGroup(states)

    def forward(self, x: Tensor, state: StateGroup | None = None) -> Tensor:
        """``[B, W, T] -> [B, W, T]`` (streaming when ``state`` is given)."""
        if isinstance(self.shortcut, nn.Identity):  # the skip is handed to the last conv (fused on the GPU)
            return _run_sequential(self.block, x, None if state is None else state["block"], residual=x)
        if isinstance(self.shortcut, StreamingConv1d):
            u = self.shortcut(x, None if state is None else state["shortcut"])
        else:
            u = self.shortcut(x)
        v = _run_sequential(self.block, x, None if state is None else state["block"])
        return u + v


class _SEANetBase(nn.Module):
    model: nn.Sequential

    def new_state(self, batch_size: int, device=None, dtype=None) -> StateGroup:
        """A fresh streaming state for ``batch_size`` rows; ``reset(rows)`` restarts chosen rows."""
        return _sequential_state(self.model, batch_size, device, dtype)


def _block_kwargs(cfg) -> dict:
    return {
        "activation": cfg.activation,
        "activation_params": cfg.activation_params,
        "pad_mode": cfg.pad_mode,
        "compress": cfg.compress,
        "true_skip": cfg.true_skip,
    }


class SEANetEncoder(_SEANetBase):
    """Audio ``[B, channels, S]`` -> latent ``[B, dimension, S / hop_length]`` (``S`` a multiple of the hop).

    Args:
        cfg: a :class:`cspan.core.config.MimiSEANetConfig`.
        device, dtype: factory arguments of the parameters.
    """

    def __init__(self, cfg, device=None, dtype=None) -> None:
        super().__init__()
        self.dimension = cfg.dimension
        self.hop_length = cfg.hop_length
        fk = {"device": device, "dtype": dtype}
        act = (cfg.activation, cfg.activation_params)
        mult = 1
        nf = cfg.n_filters
        layers: list[nn.Module] = [StreamingConv1d(cfg.channels, nf, cfg.kernel_size, pad_mode=cfg.pad_mode, **fk)]
        for ratio in reversed(cfg.ratios):
            for j in range(cfg.n_residual_layers):
                layers.append(
                    SEANetResnetBlock(
                        mult * nf,
                        kernel_sizes=[cfg.residual_kernel_size, 1],
                        dilations=[cfg.dilation_base**j, 1],
                        **_block_kwargs(cfg),
                        **fk,
                    )
                )
            layers += [
                _activation(*act),
                StreamingConv1d(
                    mult * nf, mult * nf * 2, kernel_size=2 * ratio, stride=ratio, pad_mode=cfg.pad_mode, **fk
                ),
            ]
            mult *= 2
        layers += [
            _activation(*act),
            StreamingConv1d(mult * nf, cfg.dimension, cfg.last_kernel_size, pad_mode=cfg.pad_mode, **fk),
        ]
        self.model = nn.Sequential(*layers)

    def forward(self, x: Tensor, state: StateGroup | None = None) -> Tensor:
        """``[B, channels, S] -> [B, dimension, S / hop_length]``; ``S`` must be a multiple of ``hop_length``.

        Raises:
            ValueError: from a conv when ``S`` is not a positive multiple of the hop length.
        """
        return _run_sequential(self.model, x, state)


class SEANetDecoder(_SEANetBase):
    """Latent ``[B, dimension, T]`` -> audio ``[B, channels, T * hop_length]``.

    Args:
        cfg: a :class:`cspan.core.config.MimiSEANetConfig`.
        device, dtype: factory arguments of the parameters.
    """

    def __init__(self, cfg, device=None, dtype=None) -> None:
        super().__init__()
        self.dimension = cfg.dimension
        self.hop_length = cfg.hop_length
        fk = {"device": device, "dtype": dtype}
        act = (cfg.activation, cfg.activation_params)
        nf = cfg.n_filters
        mult = 2 ** len(cfg.ratios)
        layers: list[nn.Module] = [
            StreamingConv1d(cfg.dimension, mult * nf, cfg.kernel_size, pad_mode=cfg.pad_mode, **fk)
        ]
        for ratio in cfg.ratios:
            layers += [
                _activation(*act),
                StreamingConvTranspose1d(mult * nf, mult * nf // 2, kernel_size=2 * ratio, stride=ratio, **fk),
            ]
            for j in range(cfg.n_residual_layers):
                layers.append(
                    SEANetResnetBlock(
                        mult * nf // 2,
                        kernel_sizes=[cfg.residual_kernel_size, 1],
                        dilations=[cfg.dilation_base**j, 1],
                        **_block_kwargs(cfg),
                        **fk,
                    )
                )
            mult //= 2
        layers += [
            _activation(*act),
            StreamingConv1d(nf, cfg.channels, cfg.last_kernel_size, pad_mode=cfg.pad_mode, **fk),
        ]
        self.model = nn.Sequential(*layers)

    def forward(self, z: Tensor, state: StateGroup | None = None) -> Tensor:
        """``[B, dimension, T] -> [B, channels, T * hop_length]`` (streaming when ``state`` is given)."""
        return _run_sequential(self.model, z, state)
