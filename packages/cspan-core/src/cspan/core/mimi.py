"""The Mimi neural audio codec: 24 kHz mono PCM <-> 12.5 Hz frames of RVQ codes, whole-sequence or streaming.

Source: Défossez et al., "Moshi: a speech-text foundation model for real-time dialogue" (2024), section 3.3, and
Kyutai's ``moshi/models/compression.py`` (``MimiModel``) with ``moshi/models/loaders.py`` (``get_mimi``). Module
and parameter names are upstream's, so the released ``tokenizer-e351c8d8-checkpoint125.safetensors`` (318 tensors)
loads with ``strict=True``.

Pipeline (real codec): encode ``[B, 1, S]`` -> SEANet encoder (hop 960: 25 Hz, 512 channels) -> encoder
transformer -> learnt causal conv downsample x2 (12.5 Hz) -> split RVQ -> codes ``[B, n_q, S / 1920]``. Decode is
the mirror: RVQ decode -> depthwise transposed-conv upsample x2 -> decoder transformer -> SEANet decoder ->
``[B, 1, 1920 * T]``.

Streaming: :meth:`Mimi.new_encoder_state` / :meth:`Mimi.encode_step` and :meth:`Mimi.new_decoder_state` /
:meth:`Mimi.decode_step` process whole 1920-sample frames with explicit per-session state (conv histories,
transposed-conv tails, transformer KV caches with per-row offsets). A frame-by-frame run gives the same codes as
:meth:`Mimi.encode` and the same PCM as :meth:`Mimi.decode` up to float rounding. ``state.reset(rows)`` restarts
chosen batch rows only. The per-frame path has static shapes and no host synchronisation.

Difference from upstream: upstream's streaming transformer keeps a ring of exactly ``context`` (250) keys and
writes a 2-step chunk before attending, so after 10 s of streaming the first query of each chunk misses its
oldest in-window key; here the window is exact in both modes (:mod:`cspan.core.kv_cache`), so streaming equals
upstream's non-streaming result at any length.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .config import MimiConfig, MimiTransformerConfig
from .modules.conv import ConvDownsample1d, ConvState, ConvTrState, ConvTrUpsample1d, Rows, StateGroup
from .modules.quantization import SplitResidualVectorQuantizer
from .modules.seanet import SEANetDecoder, SEANetEncoder
from .modules.transformer import StreamingTransformer, TransformerState


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """Turn TF32 off for cuDNN convolutions and cuBLAS matrix products inside the block (restored on exit).

    PyTorch lets cuDNN use TF32 (10-bit mantissa) for float32 convolutions by default, which moves Mimi's latents
    enough to change RVQ codes against the CPU; every :class:`Mimi` entry point runs inside this context, so the
    codec computes in true float32 on any device (and a CUDA graph captured inside it replays float32 kernels).
    """
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _fp32(method: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """Run a :class:`Mimi` entry point inside :func:`exact_float32`."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Tensor:
        with exact_float32():
            return method(*args, **kwargs)

    return wrapper


def _as_row_index(rows: Rows, device: torch.device) -> Tensor | None:
    """Normalise ``rows`` for the transformer state: None, a bool mask [B] or a LongTensor of row indices."""
    if rows is None or (isinstance(rows, Tensor) and rows.dtype == torch.bool):
        return None if rows is None else rows.to(device)
    return torch.as_tensor(rows, dtype=torch.long, device=device).reshape(-1)


class ProjectedTransformer(nn.Module):
    """Mimi's transformer wrapper (upstream ``ProjectedTransformer``): ``[B, C, T] -> [B, C_out, T]``.

    With ``conv_layout`` the input is ``[B, C, T]`` and is transposed to ``[B, T, C]`` around the transformer
    (``transformer``, a :class:`~cspan.core.modules.transformer.StreamingTransformer`). A bias-free linear
    ``input_proj`` / ``output_projs.0`` exists only where ``input_dimension`` / ``output_dimensions[0]`` differ
    from ``d_model`` (never for the real codec).

    Args:
        cfg: a :class:`cspan.core.config.MimiTransformerConfig`.
        device, dtype: factory arguments.
    """

    def __init__(self, cfg: MimiTransformerConfig, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.conv_layout = cfg.conv_layout
        self.transformer = StreamingTransformer(
            d_model=cfg.d_model,
            num_heads=cfg.num_heads,
            num_layers=cfg.num_layers,
            dim_feedforward=cfg.dim_feedforward,
            causal=cfg.causal,
            context=cfg.context,
            positional_embedding=cfg.positional_embedding,
            max_period=cfg.max_period,
            gating=cfg.gating,
            norm=cfg.norm,
            layer_scale=cfg.layer_scale,
            **factory,
        )
        # streaming attention through the fused kernels on the GPU even in float32 (exact IEEE arithmetic, only
        # the summation order differs from the eager path): Mimi's frame step is launch-bound, not FLOP-bound
        self.transformer.fused = True
        self.input_proj: nn.Linear | None = None
        if cfg.input_dimension != cfg.d_model:
            self.input_proj = nn.Linear(cfg.input_dimension, cfg.d_model, bias=False, **factory)
        self.output_projs = nn.ModuleList(
            [
                nn.Identity() if dim == cfg.d_model else nn.Linear(cfg.d_model, dim, bias=False, **factory)
                for dim in cfg.output_dimensions
            ]
        )

    def new_state(self, batch_size: int, device=None, dtype=None) -> TransformerState:
        """Fresh streaming state (KV cache of ``context`` slots and offsets 0 for ``batch_size`` rows)."""
        return self.transformer.new_state(batch_size, device, dtype)

    def forward(self, x: Tensor, state: TransformerState | None = None) -> Tensor:
        """``[B, C, T] -> [B, C_out, T]`` (``[B, T, C]`` in and out without ``conv_layout``).

        With ``state`` the T positions continue each row's stream and the KV cache is appended.
        """
        if self.conv_layout:
            x = x.transpose(1, 2)
        if self.input_proj is not None:
            x = self.input_proj(x)
        y = self.output_projs[0](self.transformer(x, state))
        return y.transpose(1, 2) if self.conv_layout else y


@dataclass(eq=False)
class MimiEncoderState:
    """Streaming state of :meth:`Mimi.encode_step` for a batch of sessions (one per row).

    Attributes:
        seanet: SEANet encoder conv histories.
        transformer: encoder transformer KV cache and per-row offsets.
        downsample: history of the downsampling conv (None when the codec does not resample).
    """

    seanet: StateGroup
    transformer: TransformerState
    downsample: ConvState | None

    def reset(self, rows: Rows = None) -> None:
        """Restart the chosen rows (all when None) as fresh sessions; other rows are untouched.

        Args:
            rows: row indices (list of ints or LongTensor ``[B']``), a bool mask ``[B]``, or None.
        """
        self.seanet.reset(rows)
        self.transformer.reset(_as_row_index(rows, self.transformer.offset.device), clear=True)
        if self.downsample is not None:
            self.downsample.reset(rows)


@dataclass(eq=False)
class MimiDecoderState:
    """Streaming state of :meth:`Mimi.decode_step` for a batch of sessions (one per row).

    Attributes:
        upsample: pending tail of the upsampling transposed conv (None when the codec does not resample).
        transformer: decoder transformer KV cache and per-row offsets.
        seanet: SEANet decoder conv histories and transposed-conv tails.
    """

    upsample: ConvTrState | None
    transformer: TransformerState
    seanet: StateGroup

    def reset(self, rows: Rows = None) -> None:
        """Restart the chosen rows (all when None) as fresh sessions; other rows are untouched.

        Args:
            rows: row indices (list of ints or LongTensor ``[B']``), a bool mask ``[B]``, or None.
        """
        if self.upsample is not None:
            self.upsample.reset(rows)
        self.transformer.reset(_as_row_index(rows, self.transformer.offset.device), clear=True)
        self.seanet.reset(rows)


class Mimi(nn.Module):
    """The Mimi codec.

    Args:
        cfg: the codec configuration (:meth:`MimiConfig.mimi_24khz` for the real one).
        device: parameter device (``"meta"`` builds without allocating, e.g. before ``load_state_dict(assign=True)``).
        dtype: parameter dtype (Mimi runs in float32).

    All ``cfg.quantizer.n_q`` codebooks are active after construction, as upstream; the LM uses
    ``set_num_codebooks(8)``.
    """

    def __init__(self, cfg: MimiConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.cfg = cfg
        factory = {"device": device, "dtype": dtype}
        self.encoder = SEANetEncoder(cfg.seanet, **factory)
        self.decoder = SEANetDecoder(cfg.seanet, **factory)
        self.encoder_transformer = ProjectedTransformer(cfg.transformer, **factory)
        self.decoder_transformer = ProjectedTransformer(cfg.transformer, **factory)
        self.quantizer = SplitResidualVectorQuantizer(cfg.quantizer, **factory)
        self.downsample: ConvDownsample1d | None = None
        self.upsample: ConvTrUpsample1d | None = None
        if cfg.downsample_stride > 1:
            self.downsample = ConvDownsample1d(cfg.downsample_stride, cfg.seanet.dimension, **factory)
            self.upsample = ConvTrUpsample1d(cfg.downsample_stride, cfg.seanet.dimension, channel_wise=True, **factory)

    # -- properties -------------------------------------------------------------------------------------------

    @property
    def sample_rate(self) -> int:
        """Audio sample rate in Hz (24000)."""
        return self.cfg.sample_rate

    @property
    def frame_rate(self) -> float:
        """Codec frames per second (12.5)."""
        return self.cfg.frame_rate

    @property
    def frame_size(self) -> int:
        """Audio samples per codec frame (1920)."""
        return self.cfg.frame_size

    @property
    def channels(self) -> int:
        """Audio channels (1)."""
        return self.cfg.channels

    @property
    def cardinality(self) -> int:
        """Entries per codebook (2048)."""
        return self.quantizer.cardinality

    @property
    def num_codebooks(self) -> int:
        """Codebooks produced by :meth:`encode` / :meth:`encode_step`."""
        return self.quantizer.num_codebooks

    @property
    def total_codebooks(self) -> int:
        """Codebooks in the checkpoint (32 for the real codec)."""
        return self.quantizer.total_codebooks

    def set_num_codebooks(self, n: int) -> None:
        """Encode with ``n`` codebooks (1 semantic + ``n - 1`` acoustic).

        Raises:
            ValueError: ``n`` outside ``[n_q_semantic, total_codebooks]``.
        """
        self.quantizer.set_num_codebooks(n)

    # -- shape checks (python ints only: no host sync) --------------------------------------------------------

    def _check_pcm(self, pcm: Tensor, where: str) -> None:
        if pcm.dim() != 3 or pcm.shape[1] != self.channels:
            raise ValueError(
                f"Mimi.{where} expects PCM of shape [B, {self.channels}, samples], got {tuple(pcm.shape)}; "
                "add the channel axis with pcm[:, None] for mono [B, samples]"
            )
        if not pcm.is_floating_point():
            raise ValueError(f"Mimi.{where} expects float PCM in [-1, 1], got dtype {pcm.dtype}")

    def _check_codes(self, codes: Tensor, where: str) -> None:
        if codes.dim() != 3:
            raise ValueError(f"Mimi.{where} expects codes of shape [B, K, T], got {tuple(codes.shape)}")
        if codes.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"Mimi.{where} expects integer codes (int64), got dtype {codes.dtype}")

    # -- whole sequences --------------------------------------------------------------------------------------

    def _latent(self, pcm: Tensor, state: MimiEncoderState | None) -> Tensor:
        emb = self.encoder(pcm, None if state is None else state.seanet)
        emb = self.encoder_transformer(emb, None if state is None else state.transformer)
        if self.downsample is not None:
            emb = self.downsample(emb, None if state is None else state.downsample)
        return emb

    @_fp32
    def encode_to_latent(self, pcm: Tensor) -> Tensor:
        """Unquantized latent of ``pcm`` ``[B, C, S]`` -> ``[B, dimension, ceil(S / frame_size)]``.

        ``S`` is right-padded with zeros to a whole number of frames.

        Raises:
            ValueError: wrong shape or dtype.
        """
        self._check_pcm(pcm, "encode_to_latent")
        extra = -pcm.shape[-1] % self.frame_size
        if extra:
            pcm = F.pad(pcm, (0, extra))
        if pcm.shape[-1] == 0:
            return pcm.new_zeros(pcm.shape[0], self.cfg.seanet.dimension, 0)
        return self._latent(pcm, None)

    @_fp32
    def encode(self, pcm: Tensor) -> Tensor:
        """Encode ``pcm`` ``[B, C, S]`` (float, 24 kHz) -> codes ``[B, num_codebooks, ceil(S / 1920)]`` int64.

        ``S`` is right-padded with zeros to a multiple of the frame size (as upstream's non-streaming encode).

        Raises:
            ValueError: wrong shape or dtype.
        """
        return self.quantizer.encode(self.encode_to_latent(pcm))

    @_fp32
    def decode_latent(self, codes: Tensor) -> Tensor:
        """Codes ``[B, K, T]`` -> quantized latent ``[B, dimension, T]`` (semantic + acoustic reconstructions).

        Raises:
            ValueError: wrong shape/dtype or an unsupported number of codebooks.
        """
        self._check_codes(codes, "decode_latent")
        return self.quantizer.decode(codes)

    def _from_latent(self, emb: Tensor, state: MimiDecoderState | None) -> Tensor:
        if self.upsample is not None:
            emb = self.upsample(emb, None if state is None else state.upsample)
        emb = self.decoder_transformer(emb, None if state is None else state.transformer)
        return self.decoder(emb, None if state is None else state.seanet)

    @_fp32
    def decode(self, codes: Tensor) -> Tensor:
        """Decode codes ``[B, K, T]`` (``1 <= K <= total_codebooks``) -> PCM ``[B, C, T * 1920]`` float.

        Codes must lie in ``[0, cardinality)`` (not checked, to avoid a host synchronisation).

        Raises:
            ValueError: wrong shape/dtype, an unsupported number of codebooks, or ``T == 0``.
        """
        if codes.dim() == 3 and codes.shape[-1] == 0:
            raise ValueError("Mimi.decode got codes with 0 frames; give at least one frame")
        return self._from_latent(self.decode_latent(codes), None)

    # -- streaming --------------------------------------------------------------------------------------------

    def _state_device_dtype(self, device, dtype) -> tuple[torch.device, torch.dtype]:
        param = next(self.parameters())
        return (param.device if device is None else torch.device(device)), (param.dtype if dtype is None else dtype)

    def new_encoder_state(self, batch_size: int, device=None, dtype=None) -> MimiEncoderState:
        """Fresh state for :meth:`encode_step` with ``batch_size`` independent sessions (device/dtype default to
        the parameters')."""
        device, dtype = self._state_device_dtype(device, dtype)
        return MimiEncoderState(
            seanet=self.encoder.new_state(batch_size, device, dtype),
            transformer=self.encoder_transformer.new_state(batch_size, device, dtype),
            downsample=None if self.downsample is None else self.downsample.new_state(batch_size, device, dtype),
        )

    def new_decoder_state(self, batch_size: int, device=None, dtype=None) -> MimiDecoderState:
        """Fresh state for :meth:`decode_step` with ``batch_size`` independent sessions."""
        device, dtype = self._state_device_dtype(device, dtype)
        return MimiDecoderState(
            upsample=None if self.upsample is None else self.upsample.new_state(batch_size, device, dtype),
            transformer=self.decoder_transformer.new_state(batch_size, device, dtype),
            seanet=self.decoder.new_state(batch_size, device, dtype),
        )

    @_fp32
    def encode_step(self, pcm: Tensor, state: MimiEncoderState) -> Tensor:
        """Encode the next frame(s) of every session: ``pcm`` ``[B, C, n * 1920]`` -> codes ``[B, num_codebooks, n]``.

        Normally ``n = 1`` (one 80 ms frame per call; keep the shape fixed for CUDA graphs). The state is updated
        in place. The concatenated results equal :meth:`encode` of the concatenated audio.

        Raises:
            ValueError: wrong shape/dtype, a length that is not a positive multiple of the frame size, or a batch
                size that differs from the state's.
        """
        self._check_pcm(pcm, "encode_step")
        length = pcm.shape[-1]
        if length == 0 or length % self.frame_size:
            raise ValueError(
                f"Mimi.encode_step got {length} samples; streaming input must be a positive multiple of the frame "
                f"size {self.frame_size} (buffer the audio into whole frames)"
            )
        if pcm.shape[0] != state.transformer.batch_size:
            raise ValueError(
                f"Mimi.encode_step got a batch of {pcm.shape[0]} rows for a state of {state.transformer.batch_size}"
            )
        return self.quantizer.encode(self._latent(pcm, state))

    @_fp32
    def decode_step(self, codes: Tensor, state: MimiDecoderState) -> Tensor:
        """Decode the next frame(s) of every session: codes ``[B, K, n]`` -> PCM ``[B, C, n * 1920]``.

        Normally ``n = 1``. The state is updated in place; the concatenated results equal :meth:`decode` of the
        concatenated codes up to float rounding.

        Raises:
            ValueError: wrong shape/dtype, zero frames, or a batch size that differs from the state's.
        """
        self._check_codes(codes, "decode_step")
        if codes.shape[-1] == 0:
            raise ValueError("Mimi.decode_step got codes with 0 frames; give at least one frame")
        if codes.shape[0] != state.transformer.batch_size:
            raise ValueError(
                f"Mimi.decode_step got a batch of {codes.shape[0]} rows for a state of {state.transformer.batch_size}"
            )
        return self._from_latent(self.quantizer.decode(codes), state)
