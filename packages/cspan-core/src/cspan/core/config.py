"""Configuration models (pydantic) read from the upstream ``config.json`` layouts.

``LMConfig`` mirrors the keyword arguments of Kyutai's ``LMModel`` (``moshi/models/loaders.py``,
``_lm_kwargs``); ``MimiConfig`` mirrors ``loaders._mimi_config``. Both accept the upstream dicts as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# ---------------------------------------------------------------------------------------------------------------
# Persona prefix layouts (the layout a checkpoint was trained with; the frames are built by cspan.core.prefix)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefixLayout:
    """How a checkpoint lays out its persona prefix (``cspan.core.prefix`` lays the frames out).

    Attributes:
        name: ``"context-spanning"`` or ``"personaplex"`` (the value of ``prefix_layout`` in ``config.json`` and
            ``export.json``).
        silence_frames: silence frames after the voice and after the text (1, or 6 = ``int(0.5 * 12.5)``).
        always_silence: the silences are there even without a voice / without text (PersonaPlex).
        drop_first_frame: the first frame of the table never reaches the model (PersonaPlex's offset-0 call).
    """

    name: str
    silence_frames: int
    always_silence: bool
    drop_first_frame: bool

    @staticmethod
    def named(name: str) -> PrefixLayout:
        """The layout called ``name``.

        Raises:
            ValueError: unknown name (lists the known ones).
        """
        for layout in PREFIX_LAYOUTS:
            if layout.name == name:
                return layout
        known = ", ".join(repr(x.name) for x in PREFIX_LAYOUTS)
        raise ValueError(f"unknown prefix layout {name!r}; known: {known}")


CONTEXT_SPANNING = PrefixLayout("context-spanning", silence_frames=1, always_silence=False, drop_first_frame=False)
"""The released Context Spanning model's layout (one silence frame after the voice and after the text)."""
PERSONAPLEX = PrefixLayout("personaplex", silence_frames=6, always_silence=True, drop_first_frame=True)
"""NVIDIA PersonaPlex's ``step_system_prompts`` (6 silence frames after the voice and after the text)."""
PREFIX_LAYOUTS = (CONTEXT_SPANNING, PERSONAPLEX)


# ---------------------------------------------------------------------------------------------------------------
# LM (owner: LM engineer)
# ---------------------------------------------------------------------------------------------------------------

_LM_NORMS = ("layer_norm", "layer_norm_f32", "rms_norm", "rms_norm_f32")
# Upper bounds far above any released model (the 7B: dim 4096, 32 layers, card 2048, text_card 32000): a config.json
# beyond them is corrupt, and refusing it up front keeps a model from being built with absurd sizes.
_MAX_WIDTH = 1 << 16
_MAX_VOCAB = 1 << 22
_MAX_STREAMS = 256
_MAX_HEADS = 4096
_MAX_LAYERS = 1024
_MAX_FFN = 1 << 20
_MAX_CONTEXT = 1 << 24
_MAX_DELAY = 1000
_LM_POS_EMBS = ("none", "sin", "rope", "sin_rope")
# Upstream config keys (kept as extras) naming features cspan's LMModel does not run: key -> feature.
_LM_UNSUPPORTED_EXTRAS: dict[str, str] = {
    "conditioners": "conditioning (LUT/text conditioners)",
    "fuser": "condition fuser",
    "cross_attention": "cross-attention",
    "lora": "LoRA adapters (merge them into the weights first)",
    "quantize": "int8 quantised linears",
    "kv_repeat": "grouped-query attention",
}


class LMConfig(BaseModel):
    """The Moshi-family LM configuration: the keyword arguments of Kyutai's ``LMModel`` (kyutai-labs/moshi
    ``moshi/models/lm.py``; the 7B values in ``moshi/models/loaders.py``, ``_lm_kwargs``).

    Field names and defaults are upstream's (``LMModel`` / ``StreamingTransformer`` defaults), so an upstream
    ``config.json`` or ``lm_config`` dict means the same model here. Unknown keys (``moshi_name``, ``mimi_name``,
    ``tokenizer_name``, ``model_type``, ``lm_gen_config``, ...) are kept in ``model_extra`` and written back by
    :meth:`to_upstream`.

    Derived: ``dim_feedforward`` = ``int(hidden_scale * dim)`` when absent. The depformer inherits ``num_layers``,
    ``gating``, ``max_period`` and ``layer_scale`` from the temporal transformer unless its ``depformer_*`` key is
    given, and always runs without an attention window (``depformer_context`` is kept but ignored: its KV capacity
    is ``dep_q``), as upstream.

    Raises:
        pydantic.ValidationError: inconsistent values (delays length, schedule length, unknown norm, ...).
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    dim: int = Field(128, ge=1, le=_MAX_WIDTH, description="temporal transformer width D")
    text_card: int = Field(
        32000, ge=1, le=_MAX_VOCAB, description="text vocabulary; id text_card is the initial text token"
    )
    text_card_out: int | None = Field(None, ge=1, le=_MAX_VOCAB, description="text head size (text_card when None)")
    existing_text_padding_id: int = Field(3, description="text PAD id")
    existing_text_end_padding_id: int = Field(0, description="text EPAD id")
    n_q: int = Field(8, ge=0, le=_MAX_STREAMS, description="audio input streams")
    dep_q: int = Field(8, ge=0, le=_MAX_STREAMS, description="audio streams predicted by the depformer")
    card: int = Field(1024, ge=1, le=_MAX_VOCAB, description="audio codebook size; id card is the initial audio token")
    num_heads: int = Field(8, ge=1, le=_MAX_HEADS)
    num_layers: int = Field(6, ge=0, le=_MAX_LAYERS)
    hidden_scale: float = Field(4.0, gt=0, le=64)
    dim_feedforward: int | None = Field(
        None, ge=1, le=_MAX_FFN, description="temporal FFN width; int(hidden_scale*dim) if absent"
    )
    causal: bool = True
    layer_scale: float | None = None
    context: int | None = Field(
        None, ge=1, le=_MAX_CONTEXT, description="temporal attention window and KV capacity, in frames"
    )
    max_period: float = Field(10000.0, gt=0)
    gating: str = "none"
    norm: str = "layer_norm"
    positional_embedding: str = "sin"
    bias_proj: bool = False
    depformer_dim: int = Field(256, ge=1, le=_MAX_WIDTH)
    depformer_dim_feedforward: int | list[int] | None = None
    depformer_num_heads: int = Field(8, ge=1, le=_MAX_HEADS)
    depformer_num_layers: int | None = Field(None, ge=0, le=_MAX_LAYERS)
    depformer_layer_scale: float | None = None
    depformer_multi_linear: bool = False
    depformer_context: int | None = Field(None, description="kept for round trips; the depformer has no window")
    depformer_max_period: float | None = Field(None, gt=0)
    depformer_gating: str | None = None
    depformer_norm: str | None = Field(None, description="optional norm before each depformer head")
    depformer_pos_emb: str = "sin"
    depformer_weights_per_step: bool = False
    depformer_weights_per_step_schedule: list[int] | None = None
    depformer_low_rank_embeddings: int | None = Field(None, ge=1, le=_MAX_WIDTH)
    demux_second_text_stream: bool = False
    norm_emb: bool = False
    extra_heads_num_heads: int = Field(0, ge=0, le=_MAX_HEADS)
    extra_heads_dim: int = Field(6, ge=1)
    delays: list[int] = Field(min_length=1, description="per stream (text, audio 1..n_q) delay in frames")

    @model_validator(mode="after")
    def _consistent(self) -> LMConfig:
        if self.dim_feedforward is None:
            self.dim_feedforward = int(self.hidden_scale * self.dim)
        dep_ff = self.depformer_dim_feedforward
        for value in dep_ff if isinstance(dep_ff, list) else [dep_ff]:
            if value is not None and not 1 <= value <= _MAX_FFN:
                raise ValueError(f"depformer_dim_feedforward must be in [1, {_MAX_FFN}], got {dep_ff}")
        if len(self.delays) != self.n_q + 1:
            raise ValueError(f"delays has {len(self.delays)} entries, expected n_q + 1 = {self.n_q + 1}")
        if any(d < 0 or d > _MAX_DELAY for d in self.delays):
            raise ValueError(f"delays must be in [0, {_MAX_DELAY}], got {self.delays}")
        if self.dep_q > self.n_q:
            raise ValueError(f"dep_q ({self.dep_q}) cannot exceed n_q ({self.n_q})")
        if self.dim % self.num_heads != 0:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.depformer_dim % self.depformer_num_heads != 0:
            raise ValueError(
                f"depformer_dim {self.depformer_dim} is not divisible by depformer_num_heads {self.depformer_num_heads}"
            )
        for key in ("norm", "depformer_norm"):
            value = getattr(self, key)
            if value is not None and value not in _LM_NORMS:
                raise ValueError(f"{key} {value!r} unknown; expected one of {_LM_NORMS}")
        for key in ("positional_embedding", "depformer_pos_emb"):
            if getattr(self, key) not in _LM_POS_EMBS:
                raise ValueError(f"{key} {getattr(self, key)!r} unknown; expected one of {_LM_POS_EMBS}")
        schedule = self.depformer_weights_per_step_schedule
        if schedule is not None:
            if len(schedule) != self.dep_q:
                raise ValueError(
                    f"depformer_weights_per_step_schedule has {len(schedule)} entries, dep_q is {self.dep_q}"
                )
            if min(schedule) < 0 or max(schedule) >= self.dep_q:
                raise ValueError(
                    f"depformer_weights_per_step_schedule entries must be in [0, dep_q = {self.dep_q}), got {schedule}"
                )
        return self

    # --- derived values -------------------------------------------------------------------------------------

    @property
    def num_codebooks(self) -> int:
        """K = n_q + 1 streams (text first)."""
        return self.n_q + 1

    @property
    def text_out_card(self) -> int:
        """Number of text logits (``text_card_out`` or ``text_card``)."""
        return self.text_card if self.text_card_out is None else self.text_card_out

    @property
    def depformer_weights_per_step_count(self) -> int:
        """Weights-per-step positions of the depformer (dep_q, or 0 without per-step weights); a schedule forces
        per-step weights, as upstream's ``LMModel``."""
        if self.depformer_weights_per_step or self.depformer_weights_per_step_schedule is not None:
            return self.dep_q
        return 0

    @property
    def depformer_in_count(self) -> int:
        """Number of ``depformer_in`` projections: 1, dep_q (multi-linear), or max(schedule) + 1."""
        if not self.depformer_multi_linear:
            return 1
        if self.depformer_weights_per_step_schedule:
            return max(self.depformer_weights_per_step_schedule) + 1
        return self.dep_q

    def depformer_transformer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the depformer's ``StreamingTransformer`` with upstream's inheritance rules."""
        dim_ff = self.depformer_dim_feedforward
        if dim_ff is None:
            dim_ff = int(self.hidden_scale * self.depformer_dim)
        layer_scale = self.layer_scale
        if "depformer_layer_scale" in self.model_fields_set:
            layer_scale = self.depformer_layer_scale
        return {
            "d_model": self.depformer_dim,
            "num_heads": self.depformer_num_heads,
            "num_layers": self.num_layers if self.depformer_num_layers is None else self.depformer_num_layers,
            "dim_feedforward": dim_ff,
            "causal": self.causal,
            "context": None,
            "positional_embedding": self.depformer_pos_emb,
            "max_period": self.max_period if self.depformer_max_period is None else self.depformer_max_period,
            "gating": self.gating if self.depformer_gating is None else self.depformer_gating,
            "norm": self.norm,
            "layer_scale": layer_scale,
            "weights_per_step": self.depformer_weights_per_step_count,
            "weights_per_step_schedule": self.depformer_weights_per_step_schedule,
        }

    def unsupported_features(self) -> list[str]:
        """Upstream features this config turns on that cspan's ``LMModel`` does not implement (empty for Moshi,
        PersonaPlex and Kyutai's test model)."""
        found = []
        if self.dep_q == 0:
            found.append("dep_q = 0 (a model without depformer, e.g. speech-to-text)")
        if self.demux_second_text_stream:
            found.append("demux_second_text_stream (two muxed text streams)")
        if self.norm_emb:
            found.append("norm_emb (LayerNorm after the embeddings)")
        if self.extra_heads_num_heads:
            found.append("extra_heads_num_heads (auxiliary heads)")
        extras = self.model_extra or {}
        for key, what in _LM_UNSUPPORTED_EXTRAS.items():
            value = extras.get(key)
            if key == "kv_repeat":
                if value not in (None, 1):
                    found.append(f"kv_repeat={value} ({what})")
            elif value:
                found.append(f"{key} ({what})")
        return found

    # --- upstream round trip ----------------------------------------------------------------------------------

    @classmethod
    def from_upstream(cls, d: dict[str, Any]) -> LMConfig:
        """Build from a Kyutai ``config.json`` / ``lm_config`` dict taken as is: the deprecated
        ``depformer_causal`` is dropped, ``demux_second_stream`` is renamed ``demux_second_text_stream`` (as
        upstream's ``loaders.get_moshi_lm``), other unknown keys are kept as extras.

        Raises:
            pydantic.ValidationError: inconsistent values (the message names the field).
        """
        data = dict(d)
        data.pop("depformer_causal", None)
        if "demux_second_stream" in data:
            data["demux_second_text_stream"] = data.pop("demux_second_stream")
        return cls.model_validate(data)

    def to_upstream(self) -> dict[str, Any]:
        """The dict in upstream's ``config.json`` layout (``LMModel(**d)`` accepts it): inherited depformer
        values left unset are omitted, ``dim_feedforward`` is written only when it differs from
        ``int(hidden_scale * dim)``, extras are kept."""
        out = self.model_dump(mode="json")
        if self.dim_feedforward == int(self.hidden_scale * self.dim):
            out.pop("dim_feedforward")
        for key in ("depformer_num_layers", "depformer_max_period", "depformer_gating", "depformer_norm"):
            if out.get(key) is None:
                out.pop(key, None)
        if "depformer_layer_scale" not in self.model_fields_set:
            out.pop("depformer_layer_scale")
        for key, default in (("text_card_out", None), ("demux_second_text_stream", False), ("norm_emb", False)):
            if out.get(key) == default:
                out.pop(key)
        if self.extra_heads_num_heads == 0:
            out.pop("extra_heads_num_heads")
            out.pop("extra_heads_dim")
        return out

    # --- presets ------------------------------------------------------------------------------------------------

    @classmethod
    def moshi_7b(cls) -> LMConfig:
        """Moshi 7B (``configs/moshi_7b_202409.json`` = ``loaders._lm_kwargs``): 32 layers of width 4096, RoPE,
        float32 RMSNorm, SiLU-GLU, context 3000, 16 audio streams, depformer of 6 layers x 1024 over dep_q = 8."""
        return cls(
            dim=4096,
            text_card=32000,
            existing_text_padding_id=3,
            n_q=16,
            dep_q=8,
            card=2048,
            num_heads=32,
            num_layers=32,
            hidden_scale=4.125,
            causal=True,
            layer_scale=None,
            context=3000,
            max_period=10000,
            gating="silu",
            norm="rms_norm_f32",
            positional_embedding="rope",
            depformer_dim=1024,
            depformer_dim_feedforward=4224,
            depformer_num_heads=16,
            depformer_num_layers=6,
            depformer_layer_scale=None,
            depformer_multi_linear=True,
            depformer_context=8,
            depformer_max_period=10000,
            depformer_gating="silu",
            depformer_pos_emb="none",
            depformer_weights_per_step=True,
            delays=[0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
        )

    @classmethod
    def personaplex_7b(cls) -> LMConfig:
        """PersonaPlex 7B (NVIDIA/personaplex): the Moshi 7B backbone with dep_q = 16 (its depformer also
        predicts the user's 8 codebooks)."""
        return cls.moshi_7b().model_copy(update={"dep_q": 16})


# ---------------------------------------------------------------------------------------------------------------
# Mimi codec (owner: Mimi engineer)
# ---------------------------------------------------------------------------------------------------------------


class MimiSEANetConfig(BaseModel):
    """SEANet encoder/decoder hyper-parameters, the ``seanet`` entry of ``loaders._mimi_config``.

    Field names are upstream's (``moshi/modules/seanet.py``, ``SEANetEncoder``/``SEANetDecoder``). Only the
    causal variant with convolution weight norm folded away (``norm: "none"``) exists here: Kyutai's released
    Mimi checkpoints store plain weights.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    channels: int = Field(1, ge=1, le=16, description="audio channels")
    dimension: int = Field(512, ge=1, le=_MAX_WIDTH, description="latent channels (encoder output / decoder input)")
    causal: bool = True
    n_filters: int = Field(
        64, ge=1, le=4096, description="channels after the first conv; doubled per downsampling stage"
    )
    n_residual_layers: int = Field(1, ge=0, le=16)
    activation: str = "ELU"
    activation_params: dict[str, Any] = Field(default_factory=lambda: {"alpha": 1.0})
    compress: int = Field(2, ge=1, description="residual-branch width divisor")
    dilation_base: int = Field(2, ge=1)
    disable_norm_outer_blocks: int = Field(0, ge=0)
    kernel_size: int = Field(7, ge=1, le=1024)
    residual_kernel_size: int = Field(3, ge=1, le=1024)
    last_kernel_size: int = Field(3, ge=1, le=1024)
    norm: str = "none"
    pad_mode: Literal["constant", "replicate"] = "constant"
    ratios: list[int] = Field(default_factory=lambda: [8, 6, 5, 4], min_length=1, max_length=16)
    true_skip: bool = True

    @field_validator("causal")
    @classmethod
    def _causal_only(cls, value: bool) -> bool:
        if not value:
            raise ValueError("seanet.causal is false: only the causal (streaming) SEANet is supported; set it true")
        return value

    @field_validator("norm")
    @classmethod
    def _folded_norm_only(cls, value: str) -> str:
        if value != "none":
            raise ValueError(
                f"seanet.norm is {value!r}: only 'none' is supported; fold the weight norm into plain conv weights "
                "(as Kyutai's released Mimi checkpoints are) and set norm to 'none'"
            )
        return value

    @field_validator("ratios")
    @classmethod
    def _positive_ratios(cls, value: list[int]) -> list[int]:
        if any(r < 1 or r > 64 for r in value):
            raise ValueError(f"seanet.ratios {value} must all be in [1, 64]")
        return value

    @property
    def hop_length(self) -> int:
        """Audio samples per SEANet latent step (product of the ratios; 960 for the real codec)."""
        return math.prod(self.ratios)


class MimiQuantizerConfig(BaseModel):
    """Split residual vector quantizer, the ``quantizer`` entry of ``loaders._mimi_config``.

    ``n_q`` counts all codebooks: ``n_q_semantic`` in ``rvq_first`` and ``n_q - n_q_semantic`` in ``rvq_rest``
    (``moshi/quantization/vq.py``, ``SplitResidualVectorQuantizer``).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    dimension: int = Field(256, ge=1, le=_MAX_WIDTH, description="codebook vector size")
    n_q: int = Field(32, ge=2, le=_MAX_STREAMS, description="total codebooks (semantic + acoustic)")
    bins: int = Field(2048, ge=1, le=_MAX_VOCAB, description="entries per codebook")
    input_dimension: int = Field(512, ge=1, le=_MAX_WIDTH)
    output_dimension: int = Field(512, ge=1, le=_MAX_WIDTH)
    n_q_semantic: int = Field(1, ge=1, description="codebooks of rvq_first")

    @model_validator(mode="after")
    def _split(self) -> MimiQuantizerConfig:
        if self.n_q <= self.n_q_semantic:
            raise ValueError(
                f"quantizer.n_q ({self.n_q}) must be larger than quantizer.n_q_semantic ({self.n_q_semantic})"
            )
        return self


class MimiTransformerConfig(BaseModel):
    """Encoder/decoder transformer, the ``transformer`` entry of ``loaders._mimi_config``.

    Upstream builds a ``ProjectedTransformer`` (``moshi/modules/transformer.py``) from it: ``conv_layout``
    transposes ``[B, C, T]`` to ``[B, T, C]`` and back; input/output projections exist only where
    ``input_dimension`` / ``output_dimensions[0]`` differ from ``d_model``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    d_model: int = Field(512, ge=1, le=_MAX_WIDTH)
    num_heads: int = Field(8, ge=1, le=_MAX_HEADS)
    num_layers: int = Field(8, ge=0, le=_MAX_LAYERS)
    causal: bool = True
    layer_scale: float | None = 0.01
    context: int | None = Field(250, ge=1, le=_MAX_CONTEXT, description="attention window in 25 Hz steps (10 s)")
    conv_layout: bool = True
    max_period: int | float = 10000
    gating: str = "none"
    norm: str = "layer_norm"
    positional_embedding: str = "rope"
    dim_feedforward: int = Field(2048, ge=1, le=_MAX_FFN)
    input_dimension: int = Field(512, ge=1, le=_MAX_WIDTH)
    output_dimensions: list[int] = Field(default_factory=lambda: [512])

    @model_validator(mode="after")
    def _shapes(self) -> MimiTransformerConfig:
        if self.d_model % self.num_heads:
            raise ValueError(f"transformer.d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if len(self.output_dimensions) != 1:
            raise ValueError(
                f"transformer.output_dimensions is {self.output_dimensions}: Mimi uses exactly one output; "
                "give a single-element list"
            )
        if not self.causal:
            raise ValueError("transformer.causal is false: the streaming Mimi transformer must be causal")
        return self


class MimiConfig(BaseModel):
    """The Mimi codec configuration in the shape of upstream ``loaders._mimi_config``.

    Derived sizes: ``hop_length`` (audio samples per encoder step, 960), ``encoder_frame_rate`` (25 Hz),
    ``downsample_stride`` (latent steps per codec frame, 2), ``frame_size`` (audio samples per codec frame,
    1920 at 24 kHz / 12.5 Hz). The defaults are the real 24 kHz codec used by Moshi and PersonaPlex.

    Raises:
        pydantic.ValidationError: unknown keys, inconsistent dimensions, or rates that do not divide evenly.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    sample_rate: int = Field(24000, ge=1, le=384000, description="Hz")
    channels: int = Field(1, ge=1, le=16)
    frame_rate: float = Field(12.5, gt=0, le=1000, description="codec frames per second")
    seanet: MimiSEANetConfig = Field(default_factory=MimiSEANetConfig)
    quantizer: MimiQuantizerConfig = Field(default_factory=MimiQuantizerConfig)
    transformer: MimiTransformerConfig = Field(default_factory=MimiTransformerConfig)

    @model_validator(mode="after")
    def _consistent(self) -> MimiConfig:
        dim = self.seanet.dimension
        if self.channels != self.seanet.channels:
            raise ValueError(f"channels ({self.channels}) differs from seanet.channels ({self.seanet.channels})")
        if self.quantizer.input_dimension != dim or self.quantizer.output_dimension != dim:
            raise ValueError(
                f"quantizer.input_dimension/output_dimension ({self.quantizer.input_dimension}, "
                f"{self.quantizer.output_dimension}) must equal seanet.dimension ({dim})"
            )
        if self.transformer.input_dimension != dim or self.transformer.output_dimensions[0] != dim:
            raise ValueError(
                f"transformer.input_dimension/output_dimensions ({self.transformer.input_dimension}, "
                f"{self.transformer.output_dimensions}) must equal seanet.dimension ({dim})"
            )
        enc_rate = self.sample_rate / self.seanet.hop_length
        stride = enc_rate / self.frame_rate
        if stride < 1 or stride != int(stride):
            raise ValueError(
                f"encoder frame rate {enc_rate} Hz (sample_rate / prod(seanet.ratios)) must be an integer multiple "
                f"of frame_rate {self.frame_rate} Hz"
            )
        if self.sample_rate / self.frame_rate != int(self.sample_rate / self.frame_rate):
            raise ValueError(f"sample_rate / frame_rate ({self.sample_rate} / {self.frame_rate}) must be an integer")
        return self

    @property
    def hop_length(self) -> int:
        """Audio samples per encoder (SEANet) step: 960 for the real codec."""
        return self.seanet.hop_length

    @property
    def encoder_frame_rate(self) -> float:
        """SEANet latent rate in Hz (25.0 for the real codec)."""
        return self.sample_rate / self.seanet.hop_length

    @property
    def downsample_stride(self) -> int:
        """Encoder steps per codec frame (2 for the real codec; 1 means no resampling convs)."""
        return int(self.encoder_frame_rate / self.frame_rate)

    @property
    def frame_size(self) -> int:
        """Audio samples per codec frame: 1920 for the real codec (80 ms at 24 kHz)."""
        return int(self.sample_rate / self.frame_rate)

    @classmethod
    def from_upstream(cls, d: dict[str, Any]) -> MimiConfig:
        """Build from an upstream ``loaders._mimi_config``-shaped dict (``sample_rate``, ``channels``,
        ``frame_rate``, ``seanet``, ``quantizer``, ``transformer``), taken as is.

        Raises:
            pydantic.ValidationError: on unknown keys or inconsistent values (the message names the field).
        """
        return cls.model_validate(d)

    def to_upstream(self) -> dict[str, Any]:
        """The dict in the shape of ``loaders._mimi_config``; optional keys that upstream's loader leaves at their
        defaults (``seanet.activation_params``, ``quantizer.n_q_semantic``) are written only when they differ."""
        out = self.model_dump(mode="json")
        if self.seanet.activation_params == {"alpha": 1.0}:
            out["seanet"].pop("activation_params")
        if self.quantizer.n_q_semantic == 1:
            out["quantizer"].pop("n_q_semantic")
        return out

    @classmethod
    def mimi_24khz(cls) -> MimiConfig:
        """The real Mimi codec of Moshi/PersonaPlex (``tokenizer-e351c8d8-checkpoint125.safetensors``): SEANet
        dimension 512, n_filters 64, ratios [8, 6, 5, 4]; split RVQ dimension 256, 32 codebooks of 2048; 8-layer
        transformers of width 512 (8 heads, FFN 2048, context 250, LayerNorm, LayerScale 0.01, RoPE)."""
        return cls(
            sample_rate=24000,
            channels=1,
            frame_rate=12.5,
            seanet=MimiSEANetConfig(
                channels=1,
                dimension=512,
                causal=True,
                n_filters=64,
                n_residual_layers=1,
                activation="ELU",
                compress=2,
                dilation_base=2,
                disable_norm_outer_blocks=0,
                kernel_size=7,
                residual_kernel_size=3,
                last_kernel_size=3,
                norm="none",
                pad_mode="constant",
                ratios=[8, 6, 5, 4],
                true_skip=True,
            ),
            quantizer=MimiQuantizerConfig(dimension=256, n_q=32, bins=2048, input_dimension=512, output_dimension=512),
            transformer=MimiTransformerConfig(
                d_model=512,
                num_heads=8,
                num_layers=8,
                causal=True,
                layer_scale=0.01,
                context=250,
                conv_layout=True,
                max_period=10000,
                gating="none",
                norm="layer_norm",
                positional_embedding="rope",
                dim_feedforward=2048,
                input_dimension=512,
                output_dimensions=[512],
            ),
        )
