"""Fused streaming convolutions for Mimi's SEANet encoder and decoder (Triton, float32).

Why: one 80 ms Mimi frame runs 30 small causal convolutions. Through cuDNN (float32, TF32 off, default algorithm
heuristics on tiny time lengths) they took 667 µs of the frame on an H200, plus about 180 element-wise kernels
around them: the concatenation of the streaming history, the history update, the ELUs and the residual adds.
Here one launch does all of it for one convolution:

    y[b, o, t] = bias[o] + residual[b, o, t] + sum_{c, j} W[o, c, j] * z[b, c, t * stride + j * dilation]

with ``z = cat(history, act(x))`` the streaming input (``act`` an optional ELU applied to the new samples; the
history already holds activated samples, as the eager path's state does), and the history then replaced by the
last ``P`` samples of ``z``. The history update is done by the program that finishes last (an atomic counter per
state, incremented after a block-wide barrier), so no program can still be reading the old history: the result is
deterministic; the counter only orders the update.

A transposed convolution with stride ``s`` and kernel ``K`` is computed as ``s`` phase convolutions over an input
history (the last ``ceil(K / s) - 1`` input steps), their outputs interleaved: ``y[o, u * s + q] = sum_{c, r}
W[c, o, q + r * s] * z[c, u - r]`` (taps past ``K`` are zero). This carries input samples instead of the partial
output sums the eager module carries (:class:`cspan.core.modules.conv.ConvTrState` ``history`` vs ``partial``), so
a transposed convolution's state is created in one form or the other (:func:`history_states`). Depthwise
transposed convolutions (Mimi's learnt upsampling, ``groups = channels``) have their own branch.

Which calls run here is decided by shape alone (:func:`supported`, from the per-convolution measurements in
docs/PERFORMANCE.md): batch-1 outputs of a few steps (weight streaming: whole weight rows per program, every load
in flight at once), kernel-size-1 convolutions and those with at most 16 (input channel, tap) pairs (the first
encoder convolution); the long k > 1 convolutions stay on cuDNN, where these kernels lost.

Numerics: IEEE float32 products and float32 accumulation (no TF32), in another summation order than cuDNN or the
CPU: the same function within float32 rounding. Used for float32 CUDA tensors in inference when Triton imports and
``CSPAN_FUSED`` is not 0 (and on CPU tensors under ``TRITON_INTERPRET=1 CSPAN_FUSED=1``); launched with
programmatic dependent launch like :mod:`cspan.core.modules.fused`.
"""

from __future__ import annotations

import os

import torch

from . import fused
from .fused import HAVE_TRITON, _launch_opts

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .fused import _pdl_start, _pdl_wait

    @triton.jit
    def _act(v, ACT: tl.constexpr, alpha):
        if ACT:
            v = tl.where(v > 0, v, alpha * (tl.exp(v) - 1.0))
        return v

    @triton.jit
    def _stream_input(x_ptr, prev_ptr, b, c, pos, mask, first, x0, C_in, P, sxb, sxc, sxt, alpha,
                      ACT: tl.constexpr, REPLICATE: tl.constexpr, HAS_PREV: tl.constexpr):  # fmt: skip
        """z[b, c, pos] of ``cat(history, act(x))`` for a tile of (c, pos); 0 where ``mask`` is false."""
        in_x = pos >= P
        xv = tl.load(x_ptr + b * sxb + c * sxc + (pos - P) * sxt, mask=mask & in_x, other=0.0)
        z = _act(xv, ACT, alpha)
        if HAS_PREV:
            pv = tl.load(prev_ptr + (b * C_in + c) * P + pos, mask=mask & (pos < P), other=0.0)
            if REPLICATE:
                pv = tl.where(first, x0, pv)
            z = tl.where(in_x, z, pv)
        return z

    @triton.jit
    def _conv1d_kernel(
        x_ptr, prev_ptr, first_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, count_ptr,
        B, C_in, C_out, T, T_out, P, stride, dilation, total_programs,
        sxb, sxc, sxt, srb, src, srt, syb, syc,
        alpha,
        KSIZE: tl.constexpr, ACT: tl.constexpr, REPLICATE: tl.constexpr, HAS_PREV: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, DEPTHWISE: tl.constexpr, PHASES: tl.constexpr,
        USE_DOT: tl.constexpr, BO: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """One (output-channel block, column block) tile; column n is (row n // T_out, output step n % T_out).
        Output channel o' of a PHASES-phase (transposed) convolution is channel o' % C_out at time
        t * PHASES + o' // C_out."""
        _pdl_start(PDL)
        o = tl.program_id(0) * BO + tl.arange(0, BO)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        omask = o < C_out * PHASES
        nmask = n < B * T_out
        b = (n // T_out).to(tl.int64)
        t = n % T_out
        _pdl_wait(PDL)
        first = tl.zeros((1, BN), dtype=tl.int1)
        if REPLICATE:
            first = (tl.load(first_ptr + b, mask=nmask, other=0) != 0)[None, :]
        acc = tl.zeros((BO, BN), dtype=tl.float32)
        if DEPTHWISE:  # groups == channels: channel o reads input channel o % C_out only
            c = (o % C_out)[:, None]
            m2 = omask[:, None] & nmask[None, :]
            x0 = tl.zeros((BO, BN), dtype=tl.float32)
            if REPLICATE:
                x0 = _act(tl.load(x_ptr + b[None, :] * sxb + c * sxc, mask=m2, other=0.0), ACT, alpha)
            for j in tl.static_range(KSIZE):
                w = tl.load(w_ptr + o * KSIZE + j, mask=omask, other=0.0)
                pos = t[None, :] * stride + j * dilation
                z = _stream_input(x_ptr, prev_ptr, b[None, :], c, pos, m2, first, x0,
                                  C_in, P, sxb, sxc, sxt, alpha, ACT, REPLICATE, HAS_PREV)  # fmt: skip
                acc += w[:, None] * z
        else:
            R = C_in * KSIZE
            for r0 in range(0, R, BR):
                r = r0 + tl.arange(0, BR)
                rmask = r < R
                c = (r // KSIZE)[:, None]
                j = (r % KSIZE)[:, None]
                w = tl.load(w_ptr + o[:, None].to(tl.int64) * R + r[None, :], mask=omask[:, None] & rmask[None, :],
                            other=0.0)  # fmt: skip
                m2 = rmask[:, None] & nmask[None, :]
                x0 = tl.zeros((BR, BN), dtype=tl.float32)
                if REPLICATE:
                    x0 = _act(tl.load(x_ptr + b[None, :] * sxb + c * sxc, mask=m2, other=0.0), ACT, alpha)
                pos = t[None, :] * stride + j * dilation  # [BR, BN]
                z = _stream_input(x_ptr, prev_ptr, b[None, :], c, pos, m2, first, x0,
                                  C_in, P, sxb, sxc, sxt, alpha, ACT, REPLICATE, HAS_PREV)  # fmt: skip
                if USE_DOT:
                    acc += tl.dot(w, z, input_precision="ieee")
                else:
                    acc += tl.sum(w[:, :, None] * z[None, :, :], axis=1)
        oc = (o % C_out)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + oc, mask=omask[:, None], other=0.0)
        tt = t[None, :] * PHASES + (o // C_out)[:, None]
        mask = omask[:, None] & nmask[None, :]
        if HAS_RES:
            acc += tl.load(res_ptr + b[None, :] * srb + oc * src + tt * srt, mask=mask, other=0.0)
        tl.store(y_ptr + b[None, :] * syb + oc * syc + tt, acc, mask=mask)
        if HAS_PREV:
            # The last program to finish replaces the history by z[T : T + P]; every other program has read the
            # old history before it incremented the counter.
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr, 1)
            if done == total_programs - 1:
                i = tl.arange(0, BP)[None, :]
                for bb in range(0, B):
                    firstb = tl.zeros((1, BP), dtype=tl.int1)
                    if REPLICATE:
                        firstb = tl.zeros((1, BP), dtype=tl.int1) | (tl.load(first_ptr + bb) != 0)
                    for c0 in range(0, C_in, 32):
                        cc = (c0 + tl.arange(0, 32))[:, None]
                        m = (cc < C_in) & (i < P)
                        x0b = tl.zeros((32, BP), dtype=tl.float32)
                        if REPLICATE:
                            x0b = _act(tl.load(x_ptr + bb * sxb + cc * sxc + i * 0, mask=m, other=0.0), ACT, alpha)
                        zn = _stream_input(x_ptr, prev_ptr, bb, cc, T + i, m, firstb, x0b,
                                           C_in, P, sxb, sxc, sxt, alpha, ACT, REPLICATE, HAS_PREV)  # fmt: skip
                        tl.debug_barrier()  # (in-place shift when T < P: all loads of the block before its stores)
                        tl.store(prev_ptr + (bb * C_in + cc) * P + i, zn, mask=m)
                    if REPLICATE:
                        tl.store(first_ptr + bb, 0)
                tl.atomic_xchg(count_ptr, 0)


def enabled(*tensors: torch.Tensor) -> bool:
    """Whether the fused convolutions run on these tensors: :func:`cspan.core.modules.fused.usable` and float32."""
    return fused.usable(*tensors) and all(t.dtype == torch.float32 for t in tensors)


def fused_states(device: torch.device | str | None, dtype: torch.dtype | None) -> bool:
    """Whether streaming states created for ``dtype`` on ``device`` get what the fused kernels need (a history
    counter): float32 on CUDA with Triton and ``CSPAN_FUSED`` not 0, or under the interpreter on CPU."""
    if device is None or not HAVE_TRITON or os.environ.get("CSPAN_FUSED") == "0" or dtype != torch.float32:
        return False
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and fused._interpreting())


def history_states(device: torch.device | str | None, dtype: torch.dtype | None, batch_size: int) -> bool:
    """Whether a transposed convolution's streaming state for ``batch_size`` rows takes the input-history form:
    :func:`fused_states` and one row (the only transposed convolutions :func:`supported` sends here; other
    states keep upstream's partial sums, which the eager path computes without extra work)."""
    return batch_size == 1 and fused_states(device, dtype)


def fits(
    x: torch.Tensor,
    in_channels: int,
    weight: torch.Tensor | None,
    history: torch.Tensor | None,
    first: torch.Tensor | None,
    residual: torch.Tensor | None,
    out_shape: tuple[int, int, int] | None,
) -> bool:
    """Whether a call's tensors have the exact layout :func:`conv1d` indexes (else the eager path runs and raises
    its own error for a wrong shape): x [B, in_channels, T]; a contiguous weight; a contiguous history
    [B, in_channels, P] and first [B] of x's dtype / device; a residual of exactly ``out_shape``."""
    if x.dim() != 3 or x.shape[1] != in_channels or x.shape[0] == 0:
        return False
    B = x.shape[0]
    if weight is not None and not weight.is_contiguous():
        return False
    if history is not None and (
        history.shape[:2] != (B, in_channels)
        or not history.is_contiguous()
        or history.dtype != x.dtype
        or history.device != x.device
    ):
        return False
    if first is not None and (first.shape != (B,) or not first.is_contiguous() or first.device != x.device):
        return False
    return residual is None or (tuple(residual.shape) == out_shape and residual.dtype == x.dtype)


STREAM_MAX_COLUMNS = 8
"""Batch-1 outputs of at most this many steps (the codec's 12.5-25 Hz end) are weight-streaming products: each
program holds whole weight rows (up to :data:`STREAM_TILE` elements), so every load is in flight at once."""
STREAM_TILE = 8192
"""Weight elements per program of a weight-streaming convolution."""
DOT_MAX_TAPS_REDUCTION = 16
"""Longer outputs run as float32 dot tiles only for kernel-size-1 convolutions or reductions of at most this
many (input channel, tap) pairs (the first encoder convolution): measured on an H200, the gathered dot tiles
lose to cuDNN on the wider k > 1 convolutions (docs/PERFORMANCE.md), which therefore stay on cuDNN."""


def _tiles(rows_out: int, reduction: int, columns: int, depthwise: bool) -> tuple[int, int, int, bool, int]:
    """(BO, BR, BN, use_dot, num_warps) for an output of ``rows_out`` channels x ``columns`` columns."""
    if depthwise:
        return 32, 1, max(1, triton.next_power_of_2(columns)), False, 4
    if columns <= STREAM_MAX_COLUMNS:
        bn = triton.next_power_of_2(columns)
        br = min(triton.next_power_of_2(reduction), STREAM_TILE, 16384 // bn)
        return max(1, STREAM_TILE // br), br, bn, False, 8
    bn = 64 if columns >= 64 else max(16, triton.next_power_of_2(columns))
    return (32 if rows_out >= 32 else 16), 32, bn, True, 4


def supported(batch: int, steps_out: int, in_channels: int, kernel_size: int, depthwise: bool = False) -> bool:
    """Whether :func:`conv1d` is used for a step of ``batch`` rows with ``steps_out`` output steps per row (else
    the eager cuDNN path, which gives the same function): batch-1 outputs of at most
    :data:`STREAM_MAX_COLUMNS` steps (weight streaming, depthwise included), and kernel-size-1 or tiny
    (:data:`DOT_MAX_TAPS_REDUCTION`) convolutions of any length. The choice depends on shapes only, so it is the
    same in every process."""
    if batch < 1 or steps_out < 1:
        return False
    if batch == 1 and steps_out <= STREAM_MAX_COLUMNS:
        return True
    return not depthwise and (kernel_size == 1 or in_channels * kernel_size <= DOT_MAX_TAPS_REDUCTION)


def conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: int,
    dilation: int,
    previous: torch.Tensor | None,
    counter: torch.Tensor | None,
    *,
    first: torch.Tensor | None = None,
    elu_alpha: float | None = None,
    residual: torch.Tensor | None = None,
    phases: int = 1,
    depthwise: bool = False,
    tiles: tuple[int, int, int, bool, int] | None = None,
) -> torch.Tensor:
    """One streaming causal convolution step in one launch (see the module docstring).

    Args:
        x: [B, C_in, T] float32 new input samples (any strides).
        weight: [C_out * phases, C_in, K] contiguous (depthwise: [C_out * phases, 1, K], C_in == C_out).
        bias: [C_out] or None.
        stride, dilation: of the convolution (phase convolutions: 1, 1).
        previous: [B, C_in, P] contiguous history (P = (K - 1) * dilation + 1 - stride), updated in place; None
            when P = 0.
        counter: [1] int32 zeros, owned by the state (ordering of the history update); given exactly when
            ``previous`` is.
        first: [B] bool contiguous, for replicate padding: a row's first call pads with its first (activated) sample and
            clears the flag. None for zero padding.
        elu_alpha: apply ELU(alpha) to x first (None: no activation).
        residual: [B, C_out, T_out * phases] added to the output.
        phases: > 1 for a transposed convolution computed as interleaved phase convolutions.
        depthwise: one input channel per output channel.
        tiles: (BO, BR, BN, use_dot, num_warps) instead of the heuristic (tuning runs).

    Returns:
        [B, C_out, T_out * phases] float32, T_out = T / stride.

    Raises:
        ValueError: ``previous`` without ``counter`` or the other way round (callers check shapes with
            :func:`fits`).
    """
    if (previous is None) != (counter is None) or (counter is not None and counter.dtype != torch.int32):
        raise ValueError("fused_conv.conv1d: a history needs its int32 counter, and a counter needs a history")
    B, C_in, T = x.shape
    K = weight.shape[-1]
    C_out = weight.shape[0] // phases
    P = 0 if previous is None else previous.shape[-1]
    T_out = (P + T - (K - 1) * dilation - 1) // stride + 1
    y = torch.empty(B, C_out, T_out * phases, device=x.device, dtype=torch.float32)
    BO, BR, BN, use_dot, warps = tiles or _tiles(C_out * phases, C_in * K, B * T_out, depthwise)
    grid = (triton.cdiv(C_out * phases, BO), triton.cdiv(B * T_out, BN))
    res = residual if residual is not None else y
    _conv1d_kernel[grid](
        x, previous if previous is not None else x, first if first is not None else x, weight,
        bias if bias is not None else weight, res, y, counter if counter is not None else x,
        B, C_in, C_out, T, T_out, P, stride, dilation, grid[0] * grid[1],
        x.stride(0), x.stride(1), x.stride(2), res.stride(0), res.stride(1), res.stride(2), y.stride(0), y.stride(1),
        1.0 if elu_alpha is None else float(elu_alpha),
        **_launch_opts(x.device, KSIZE=K, ACT=elu_alpha is not None, REPLICATE=first is not None, HAS_PREV=P > 0,
                       HAS_BIAS=bias is not None, HAS_RES=residual is not None, DEPTHWISE=depthwise,
                       PHASES=phases, USE_DOT=use_dot, BO=BO, BR=BR, BN=BN,
                       BP=triton.next_power_of_2(max(P, 1)), num_warps=warps),
    )  # fmt: skip
    return y


def phase_weight(weight: torch.Tensor, stride: int, depthwise: bool) -> torch.Tensor:
    """A transposed convolution's weight as the weight of its ``stride`` phase convolutions.

    Args:
        weight: ``nn.ConvTranspose1d`` weight [C_in, C_out, K] (depthwise: [C, 1, K]).
        stride: the transposed convolution's stride s.

    Returns:
        [s * C_out, C_in, R] (depthwise [s * C, 1, R]) with R = ceil(K / s): phase q, output o, tap r' is
        ``W[c, o, q + (R - 1 - r') * s]`` (zero past K), so that phase q of output step u reads inputs
        u - R + 1 .. u in order.
    """
    C_in, C_o, K = weight.shape
    R = -(-K // stride)
    w = torch.zeros(C_in, C_o, R * stride, device=weight.device, dtype=weight.dtype)
    w[..., :K] = weight
    w = w.view(C_in, C_o, R, stride).flip(2)  # [C_in, C_o, r', q]
    if depthwise:
        return w.permute(3, 0, 1, 2).reshape(stride * C_in, 1, R).contiguous()
    return w.permute(3, 1, 0, 2).reshape(stride * C_o, C_in, R).contiguous()


__all__ = ["conv1d", "enabled", "fits", "fused_states", "history_states", "phase_weight", "supported"]
