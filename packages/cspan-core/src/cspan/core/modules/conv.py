"""Causal 1-d convolutions that run either on a whole sequence or frame by frame with explicit state.

Follows Kyutai's ``moshi/modules/conv.py`` (``StreamingConv1d``, ``StreamingConvTranspose1d``, causal variant,
weight norm folded away) so that the parameter names are upstream's: ``conv.conv.weight`` / ``conv.conv.bias`` and
``convtr.convtr.weight`` / ``convtr.convtr.bias``.

Streaming convention (identical results to the whole-sequence call):

* causal conv, kernel ``k``, dilation ``d``, stride ``s``: the input is left-padded by ``P = (k - 1) * d + 1 - s``
  samples. Zeros for ``pad_mode="constant"``; the first input sample repeated for ``"replicate"``. In streaming
  the padding is a state buffer holding the last ``P`` input samples of the previous call.
* transposed conv, kernel ``k``, stride ``s``: the full output is computed and its last ``k - s`` samples are
  dropped; in streaming those samples (minus the bias, which the next call adds again) are kept and added to the
  head of the next call's output. Where the fused GPU kernel runs (:mod:`cspan.core.modules.fused_conv`), the
  state instead keeps the last ``ceil(k / s) - 1`` input steps and the output is recomputed from them (same
  function; see :class:`ConvTrState`).

Unlike upstream, the state is an explicit object passed to ``forward`` rather than a module attribute, so one
module can serve many independent sessions, and ``reset(rows)`` restarts chosen batch rows only. No call made per
frame synchronises with the host, so the step can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from . import fused_conv

Rows = Tensor | Sequence[int] | None
"""Batch rows to reset: ``None`` (all rows), a LongTensor / list of row indices, or a bool mask ``[B]``."""


def reset_rows_(tensor: Tensor, rows: Rows, value: float | bool) -> None:
    """Fill the chosen batch rows (dim 0) of ``tensor`` with ``value`` in place, without a host synchronisation.

    Args:
        tensor: any tensor whose dim 0 is the batch.
        rows: ``None`` for all rows, a bool mask ``[B]``, or row indices (LongTensor or sequence of ints).
        value: the fill value.

    Raises:
        ValueError: a bool mask whose length is not the batch size.
    """
    if rows is None:
        tensor.fill_(value)
        return
    if isinstance(rows, Tensor) and rows.dtype == torch.bool:
        if rows.shape != (tensor.shape[0],):
            raise ValueError(f"row mask has shape {tuple(rows.shape)}, expected [{tensor.shape[0]}] (the batch size)")
        mask = rows.to(tensor.device).view(-1, *([1] * (tensor.dim() - 1)))
        tensor.masked_fill_(mask, value)
        return
    index = torch.as_tensor(rows, dtype=torch.long, device=tensor.device).reshape(-1)
    tensor.index_fill_(0, index, value)


class StreamingState(Protocol):
    """Anything with a per-row ``reset``: the states of the streaming modules of this package."""

    def reset(self, rows: Rows = None) -> None: ...


class StateGroup:
    """A named collection of streaming states that resets together (for container modules).

    Args:
        states: name -> state; each has ``reset(rows)``.
    """

    def __init__(self, states: dict[str, StreamingState]) -> None:
        self.states = states

    def __getitem__(self, name: str) -> StreamingState:
        return self.states[name]

    def __iter__(self) -> Iterator[StreamingState]:
        return iter(self.states.values())

    def reset(self, rows: Rows = None) -> None:
        """Restart the chosen batch rows (all rows when ``rows`` is None) of every member state."""
        for state in self.states.values():
            state.reset(rows)


@dataclass(eq=False)
class ConvState:
    """Streaming state of a :class:`StreamingConv1d`.

    Attributes:
        previous: ``[B, C_in, P]`` the last ``P = (k-1)*d + 1 - s`` input samples seen (zeros at the start).
        first: ``[B]`` bool, true until the row's first call (maintained and used by ``pad_mode="replicate"``
            only).
        counter: ``[1]`` int32 zeros, for the fused GPU kernel (:mod:`cspan.core.modules.fused_conv`), which
            updates ``previous`` from the program that finishes last; None for states created where that kernel
            cannot run (and for convs without history, P = 0, which need none). Zero between calls.
    """

    previous: Tensor
    first: Tensor
    counter: Tensor | None = None

    def reset(self, rows: Rows = None) -> None:
        """Restart the chosen rows: zero their buffer and mark them as not started yet."""
        reset_rows_(self.previous, rows, 0.0)
        reset_rows_(self.first, rows, True)
        if rows is None and self.counter is not None:
            self.counter.zero_()


@dataclass(eq=False)
class ConvTrState:
    """Streaming state of a :class:`StreamingConvTranspose1d`.

    Two forms. The eager one carries output sums; the fused GPU kernel
    (:mod:`cspan.core.modules.fused_conv`) computes a transposed convolution as phase convolutions over the input
    and carries input samples instead. A state is created in one form (``history`` None or not, chosen at
    :meth:`StreamingConvTranspose1d.new_state` by :func:`~cspan.core.modules.fused_conv.history_states`: device,
    dtype, batch size and ``CSPAN_FUSED``) and both code paths accept either.

    Attributes:
        partial: ``[B, C_out, k - s]`` the overlapping tail of the previous output, bias excluded (eager form).
        history: ``[B, C_in, ceil(k / s) - 1]`` the last (activated) input steps (fused form), or None.
        counter: ``[1]`` int32 zeros used by the fused kernel (with ``history``).
    """

    partial: Tensor
    history: Tensor | None = None
    counter: Tensor | None = None

    def reset(self, rows: Rows = None) -> None:
        """Restart the chosen rows (zero their pending tail or input history)."""
        reset_rows_(self.partial, rows, 0.0)
        if self.history is not None:
            reset_rows_(self.history, rows, 0.0)
        if rows is None and self.counter is not None:
            self.counter.zero_()


CUDNN_TIMED_ROWS = 64
"""cuDNN convolution calls on more than this many batch rows time their algorithms (``cudnn.benchmark`` for the
call) instead of taking cuDNN's heuristic choice. At 112 rows (FP8 KV cache, most of the memory free) the
heuristics picked FFT convolutions for two of the SEANet convolutions (float32, TF32 off, as Mimi runs): 40 ms of
the engine frame on an H200, where with the timed choice the whole frame took 39.5 ms (docs/PERFORMANCE.md,
C28–C33). Calls in chunks of 80 rows did not help (C32), although a bf16 80-row frame with 20 GiB free had no FFT:
the choice depends on the workspace that fits, so it is timed. At 64 rows and below (the bench's B = 32 / 64
frames, the exactness tests) the heuristics' choice is kept. The timing runs at a shape's first call, which the
engine's CUDA graphs make eagerly before they capture (:class:`cspan.core.graphs.GraphCache`)."""


def cudnn_conv(conv: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``conv(x)`` for ``x`` ``[B, ...]``, with cuDNN timing its algorithms when B > :data:`CUDNN_TIMED_ROWS` on
    CUDA (the same function within float32 rounding)."""
    if x.shape[0] <= CUDNN_TIMED_ROWS or not x.is_cuda:
        return conv(x)
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        return conv(x)
    finally:
        torch.backends.cudnn.benchmark = saved


class NormConv1d(nn.Module):
    """Holder of a plain ``nn.Conv1d`` named ``conv`` (upstream's weight-norm wrapper, norm folded away)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()
        self.conv = nn.Conv1d(*args, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        """``[B, C_in, T] -> [B, C_out, T_out]``."""
        return cudnn_conv(self.conv, x)


class NormConvTranspose1d(nn.Module):
    """Holder of a plain ``nn.ConvTranspose1d`` named ``convtr`` (weight norm folded away)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()
        self.convtr = nn.ConvTranspose1d(*args, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        """``[B, C_in, T] -> [B, C_out, (T-1)*s + k]``."""
        return cudnn_conv(self.convtr, x)


def _param_device_dtype(module: nn.Module, device, dtype) -> tuple[torch.device, torch.dtype]:
    param = next(module.parameters())
    return (param.device if device is None else torch.device(device)), (param.dtype if dtype is None else dtype)


class StreamingConv1d(nn.Module):
    """Causal Conv1d: ``[B, C_in, T] -> [B, C_out, T / stride]``, whole-sequence or streaming.

    Args:
        in_channels, out_channels, kernel_size, stride, dilation, groups, bias: as ``nn.Conv1d``.
        pad_mode: ``"constant"`` (zero left padding) or ``"replicate"`` (repeat the first sample).
        device, dtype: factory arguments of the parameters.

    The input length must be a positive multiple of ``stride`` (as upstream, moshi >= 0.2.5).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        dilation: int = 1,
        groups: int = 1,
        bias: bool = True,
        pad_mode: str = "constant",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if pad_mode not in ("constant", "replicate"):
            raise ValueError(f"pad_mode {pad_mode!r} is not supported; use 'constant' or 'replicate'")
        self.pad_mode = pad_mode
        self.conv = NormConv1d(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            dilation=dilation,
            groups=groups,
            bias=bias,
            device=device,
            dtype=dtype,
        )

    @property
    def stride(self) -> int:
        """Convolution stride."""
        return self.conv.conv.stride[0]

    @property
    def padding_total(self) -> int:
        """Left padding ``(k - 1) * dilation + 1 - stride`` = samples of history kept in streaming."""
        conv = self.conv.conv
        return (conv.kernel_size[0] - 1) * conv.dilation[0] + 1 - conv.stride[0]

    def new_state(self, batch_size: int, device=None, dtype=None) -> ConvState:
        """A fresh streaming state for ``batch_size`` rows (device/dtype default to the parameters')."""
        device, dtype = _param_device_dtype(self, device, dtype)
        previous = torch.zeros(batch_size, self.conv.conv.in_channels, self.padding_total, device=device, dtype=dtype)
        first = torch.ones(batch_size, device=device, dtype=torch.bool)
        counter = None
        if self.padding_total > 0 and fused_conv.fused_states(device, dtype):
            counter = torch.zeros(1, device=device, dtype=torch.int32)
        return ConvState(previous, first, counter)

    def forward(
        self,
        x: Tensor,
        state: ConvState | None = None,
        *,
        activation: float | None = None,
        residual: Tensor | None = None,
    ) -> Tensor:
        """Convolve ``x`` ``[B, C_in, T]`` (``T`` a positive multiple of the stride) -> ``[B, C_out, T/stride]``.

        With ``state`` None the sequence starts here (left padding). With a state, ``x`` continues the rows'
        previous inputs and the state is updated in place. Streaming float32 CUDA calls of the shapes
        :func:`cspan.core.modules.fused_conv.supported` picks run as one fused kernel
        (:func:`cspan.core.modules.fused_conv.conv1d`), given a state created for it (with a ``counter``).

        Args:
            x: the input.
            state: the streaming state, or None.
            activation: apply ELU with this alpha to ``x`` first (what an ``nn.ELU`` before the conv does).
            residual: ``[B, C_out, T/stride]`` added to the output (``residual + y``; the eager path also
                broadcasts, the fused one takes exactly this shape).

        Raises:
            ValueError: ``T`` is not a positive multiple of the stride.
        """
        length = x.shape[-1]
        if length == 0 or length % self.stride:
            raise ValueError(
                f"StreamingConv1d got {length} steps; the input length must be a positive multiple of the stride "
                f"{self.stride} (pad the input, e.g. to whole 1920-sample Mimi frames)"
            )
        pad = self.padding_total
        conv = self.conv.conv
        if (
            state is not None
            and conv.groups == 1
            and (pad == 0 or state.counter is not None)
            and fused_conv.enabled(x, conv.weight)
            and self.fused_shape(x.shape[0], length)
            and fused_conv.fits(
                x,
                conv.in_channels,
                conv.weight,
                state.previous,
                state.first,
                residual,
                (x.shape[0], conv.out_channels, length // conv.stride[0]),
            )
        ):
            return fused_conv.conv1d(
                x,
                conv.weight,
                conv.bias,
                conv.stride[0],
                conv.dilation[0],
                state.previous if pad > 0 else None,
                state.counter if pad > 0 else None,
                first=state.first if pad > 0 and self.pad_mode == "replicate" else None,
                elu_alpha=activation,
                residual=residual,
            )
        if activation is not None:
            x = F.elu(x, activation)
        y = self._eager(x, state, pad)
        if residual is None:
            return y
        return y.add_(residual) if residual.shape == y.shape else residual + y  # y is this call's own tensor

    def fused_shape(self, batch: int, length: int) -> bool:
        """Whether a streaming call on ``batch`` rows of ``length`` input samples is one the fused kernel takes
        (:func:`cspan.core.modules.fused_conv.supported`; the state, dtype and layout are checked per call)."""
        conv = self.conv.conv
        return fused_conv.supported(batch, length // conv.stride[0], conv.in_channels, conv.kernel_size[0])

    def _eager(self, x: Tensor, state: ConvState | None, pad: int) -> Tensor:
        if state is None:
            if pad > 0:
                x = F.pad(x, (pad, 0), mode="replicate" if self.pad_mode == "replicate" else "constant")
            return self.conv(x)
        if pad > 0:
            previous = state.previous
            if self.pad_mode == "replicate":
                previous = torch.where(state.first.view(-1, 1, 1), x[..., :1], previous)
            x = torch.cat([previous, x], dim=-1)
        conv = self.conv.conv  # the kernel nn.Conv1d calls, without two module calls per frame
        y = cudnn_conv(lambda z: F.conv1d(z, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups), x)
        if pad > 0:
            state.previous.copy_(x[..., -pad:])
            if self.pad_mode == "replicate":
                state.first.fill_(False)
        return y


class StreamingConvTranspose1d(nn.Module):
    """Causal ConvTranspose1d: ``[B, C_in, T] -> [B, C_out, T * stride]``, whole-sequence or streaming.

    The right ``kernel_size - stride`` samples of the full transposed convolution are trimmed (upstream
    ``trim_right_ratio=1``); in streaming they are carried (bias excluded) into the next call, or, for a state in
    the input-history form (:class:`ConvTrState`), recomputed from the last input steps.

    Args:
        in_channels, out_channels, kernel_size, stride, groups, bias: as ``nn.ConvTranspose1d``.
        device, dtype: factory arguments of the parameters.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        groups: int = 1,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if kernel_size < stride:
            raise ValueError(f"StreamingConvTranspose1d needs kernel_size >= stride, got {kernel_size} < {stride}")
        self.convtr = NormConvTranspose1d(
            in_channels, out_channels, kernel_size, stride, groups=groups, bias=bias, device=device, dtype=dtype
        )

    @property
    def stride(self) -> int:
        """Transposed convolution stride (upsampling factor)."""
        return self.convtr.convtr.stride[0]

    @property
    def overlap(self) -> int:
        """``kernel_size - stride``: samples trimmed on the right / carried in streaming."""
        return self.convtr.convtr.kernel_size[0] - self.convtr.convtr.stride[0]

    def new_state(self, batch_size: int, device=None, dtype=None) -> ConvTrState:
        """A fresh streaming state for ``batch_size`` rows (device/dtype default to the parameters')."""
        device, dtype = _param_device_dtype(self, device, dtype)
        convtr = self.convtr.convtr
        partial = torch.zeros(batch_size, convtr.out_channels, self.overlap, device=device, dtype=dtype)
        if not fused_conv.history_states(device, dtype, batch_size):
            return ConvTrState(partial)
        steps = -(-convtr.kernel_size[0] // self.stride) - 1
        history = torch.zeros(batch_size, convtr.in_channels, steps, device=device, dtype=dtype)
        return ConvTrState(partial, history, torch.zeros(1, device=device, dtype=torch.int32))

    def _phase_weight(self) -> Tensor:
        """The weight as phase-convolution weights (:func:`~cspan.core.modules.fused_conv.phase_weight`), cached
        for this weight tensor (the cache holds it, so a replacement is always seen) and its version counter (an
        in-place change is seen, except for inference tensors, which have none). A CUDA graph captured before
        the weight changed keeps reading the old copy: capture again after reloading weights."""
        w = self.convtr.convtr.weight
        version = None if w.is_inference() else w._version
        cached = getattr(self, "_phase_cache", None)
        if cached is None or cached[0] is not w or cached[1] != version:
            depthwise = self.convtr.convtr.groups > 1
            with torch.no_grad():
                cached = (w, version, fused_conv.phase_weight(w.detach(), self.stride, depthwise))
            self._phase_cache = cached
        return cached[2]

    def forward(self, x: Tensor, state: ConvTrState | None = None, *, activation: float | None = None) -> Tensor:
        """Transposed-convolve ``x`` ``[B, C_in, T]`` -> ``[B, C_out, T * stride]``.

        Args:
            x: the input.
            state: the streaming state (either form, see :class:`ConvTrState`), or None.
            activation: apply ELU with this alpha to ``x`` first.

        Raises:
            ValueError: ``T`` is zero.
        """
        if x.shape[-1] == 0:
            raise ValueError("StreamingConvTranspose1d got an empty input (0 steps)")
        if state is not None and state.history is not None:
            return self._history_forward(x, state, activation)
        if activation is not None:
            x = F.elu(x, activation)
        y = self.convtr(x)
        overlap = self.overlap
        if overlap == 0:
            return y
        if state is None:
            return y[..., :-overlap]
        # Add the previous call's tail to the head, then keep this call's tail (without bias) for the next one.
        y[..., :overlap] += state.partial
        tail = y[..., -overlap:]
        bias = self.convtr.convtr.bias
        if bias is not None:
            tail = tail - bias[:, None]
        state.partial.copy_(tail)
        return y[..., :-overlap]

    def fused_shape(self, batch: int, length: int) -> bool:
        """Whether a streaming call on ``batch`` rows of ``length`` input steps is one the fused kernel takes (as
        ``stride`` phase convolutions of ``ceil(k / s)`` taps; an input-history state is also needed)."""
        convtr = self.convtr.convtr
        taps = -(-convtr.kernel_size[0] // self.stride)
        return fused_conv.supported(batch, length, convtr.in_channels, taps, convtr.groups > 1)

    def _history_forward(self, x: Tensor, state: ConvTrState, activation: float | None) -> Tensor:
        """Streaming step with an input-history state: the fused kernel, or the same function eagerly."""
        assert state.history is not None
        convtr = self.convtr.convtr
        steps = state.history.shape[-1]
        groups_ok = convtr.groups == 1 or convtr.groups == convtr.in_channels == convtr.out_channels
        if (
            groups_ok
            and state.counter is not None
            and self.fused_shape(x.shape[0], x.shape[-1])
            and fused_conv.enabled(x, convtr.weight)
            and fused_conv.fits(x, convtr.in_channels, None, state.history, None, None, None)
        ):
            return fused_conv.conv1d(
                x,
                self._phase_weight(),
                convtr.bias,
                1,
                1,
                state.history if steps > 0 else None,
                state.counter if steps > 0 else None,
                elu_alpha=activation,
                phases=self.stride,
                depthwise=convtr.groups > 1,
            )
        if activation is not None:
            x = F.elu(x, activation)
        full = torch.cat([state.history, x], dim=-1)
        y = self.convtr(full)
        s, T = self.stride, x.shape[-1]
        if steps > 0:
            state.history.copy_(full[..., -steps:])
        return y[..., steps * s : (steps + T) * s]


class ConvDownsample1d(nn.Module):
    """Learnt causal downsampling by an integer ``stride`` (upstream ``moshi/modules/resample.py``, learnt=True).

    A :class:`StreamingConv1d` named ``conv`` with kernel ``2 * stride``, no bias and *replicate* left padding:
    ``[B, C, T] -> [B, C, T / stride]``. Checkpoint key: ``conv.conv.conv.weight`` ``[C, C, 2 * stride]``.
    """

    def __init__(self, stride: int, dimension: int, device=None, dtype=None) -> None:
        super().__init__()
        self.conv = StreamingConv1d(
            dimension,
            dimension,
            kernel_size=2 * stride,
            stride=stride,
            bias=False,
            pad_mode="replicate",
            device=device,
            dtype=dtype,
        )

    def new_state(self, batch_size: int, device=None, dtype=None) -> ConvState:
        """Fresh streaming state (its history is the row's first input sample repeated, set on the first call)."""
        return self.conv.new_state(batch_size, device, dtype)

    def forward(self, x: Tensor, state: ConvState | None = None) -> Tensor:
        """``[B, C, T] -> [B, C, T / stride]`` (``T`` a positive multiple of the stride)."""
        return self.conv(x, state)


class ConvTrUpsample1d(nn.Module):
    """Learnt causal upsampling by an integer ``stride`` (upstream ``ConvTrUpsample1d``, learnt=True).

    A :class:`StreamingConvTranspose1d` named ``convtr`` with kernel ``2 * stride`` and no bias:
    ``[B, C, T] -> [B, C, T * stride]``. With ``channel_wise=True`` (Mimi's ``upsample_channel_wise_bug``
    setting, the released codec) it is depthwise: ``groups = C`` and the weight is ``[C, 1, 2 * stride]``.
    """

    def __init__(self, stride: int, dimension: int, channel_wise: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.convtr = StreamingConvTranspose1d(
            dimension,
            dimension,
            kernel_size=2 * stride,
            stride=stride,
            groups=dimension if channel_wise else 1,
            bias=False,
            device=device,
            dtype=dtype,
        )

    def new_state(self, batch_size: int, device=None, dtype=None) -> ConvTrState:
        """Fresh streaming state (zero pending tail, or zero input history: see :class:`ConvTrState`)."""
        return self.convtr.new_state(batch_size, device, dtype)

    def forward(self, x: Tensor, state: ConvTrState | None = None) -> Tensor:
        """``[B, C, T] -> [B, C, T * stride]``."""
        return self.convtr(x, state)
