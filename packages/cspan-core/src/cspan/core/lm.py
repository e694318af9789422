"""The Moshi-family language model: embeddings, temporal transformer, depformer and heads.

Source: kyutai-labs/moshi ``moshi/models/lm.py`` (``LMModel``) and ``moshi/models/lm_utils.py`` (delay pattern),
re-written with explicit state. Parameter names are upstream's, so a Kyutai or PersonaPlex ``state_dict`` loads
with ``strict=True``.

Token layout: ``[B, K, T]`` with K = n_q + 1 streams, row 0 text, rows 1..n_q audio (for the 7B: 1..8 the
model's own codebooks, 9..16 the user's). Special ids: ``text_card`` / ``card`` are the initial text / audio
tokens, -1 is the zero token (zero embedding; excluded from the loss masks).

Two ways to run it:

- :meth:`LMModel.forward` — the teacher-forced training forward over whole sequences with the delay pattern.
- Streaming, driven by the engine one frame (or one span) at a time::

      state = model.new_state(B)                        # temporal KV cache, per-row offsets
      dep = model.new_depformer_state(B)                # depformer KV cache (capacity dep_q)
      hidden, text_logits = model.temporal(column, state)   # column [B, K, 1] -> [B, 1, D], [B, 1, text_card]
      text = text_logits[:, 0].float().argmax(-1)       # (or sample)
      dep.reset()
      prev = text
      for k in range(model.dep_q):
          logits = model.depformer_logits(k, hidden[:, 0], prev, dep)   # [B, card]
          prev = logits.float().argmax(-1)

  The engine builds ``column`` from its token grid (delays applied, initial tokens while ``t <= delay``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .config import LMConfig
from .errors import CheckpointError
from .modules import fused
from .modules.embedding import ZERO_TOKEN_ID, ScaledEmbedding
from .modules.norms import RMSNorm, make_norm
from .modules.transformer import StepLayout, StreamingTransformer, TransformerState

if TYPE_CHECKING:
    from .plan import ExecutionPlan

UNGENERATED_TOKEN_ID = -2


@dataclass
class LMOutput:
    """Teacher-forced outputs, re-aligned with the input codes (``logits[:, k, t]`` predicts ``codes[:, 1+k, t]``).

    Attributes:
        logits: [B, dep_q, T, card] audio logits, NaN where there is no prediction (last ``delay`` steps).
        mask: [B, dep_q, T] bool, valid positions (a prediction exists and the target is not -1).
        text_logits: [B, 1, T, text_card] text logits.
        text_mask: [B, 1, T] bool.
    """

    logits: torch.Tensor
    mask: torch.Tensor
    text_logits: torch.Tensor
    text_mask: torch.Tensor


@dataclass
class LMState:
    """Streaming state of the temporal transformer for B rows (sessions): KV cache and per-row offsets.

    Attributes:
        transformer: the :class:`~cspan.core.modules.transformer.TransformerState` (``.cache``, ``.step``).
    """

    transformer: TransformerState

    @property
    def offset(self) -> torch.Tensor:
        """[B] long: number of frames each row has consumed since its last reset (next position)."""
        return self.transformer.offset

    @property
    def batch_size(self) -> int:
        return self.transformer.batch_size

    def reset(self, rows: torch.Tensor | None = None) -> None:
        """Empty the chosen rows ([B'] long, all when None): offset 0, KV cache cleared."""
        self.transformer.reset(rows)


def delay_sequence(codes: torch.Tensor, delays: list[int], initial: torch.Tensor) -> torch.Tensor:
    """Apply the delay pattern: stream k is shifted right by ``delays[k]`` steps, the head filled with its initial
    token (kyutai-labs/moshi ``lm_utils._delay_sequence``).

    Args:
        codes: [B, K, T] long.
        delays: K non-negative ints.
        initial: [B or 1, K, 1] long initial tokens.

    Returns:
        [B, K, T] long.
    """
    out = []
    for k, delay in enumerate(delays):
        line = codes[:, k].roll(delay, dims=1)
        if delay > 0:
            line[:, :delay] = initial[:, k]
        out.append(line)
    return torch.stack(out, dim=1)


def undelay_sequence(
    x: torch.Tensor, delays: list[int], fill_value: float = float("nan")
) -> tuple[torch.Tensor, torch.Tensor]:
    """Undo the delay pattern on per-position outputs: stream k is shifted left by ``delays[k]``; the last
    ``delays[k]`` positions get ``fill_value`` and a False mask (kyutai-labs/moshi ``lm_utils._undelay_sequence``).

    Args:
        x: [B, K, T, ...].
        delays: K non-negative ints.

    Returns:
        (x' [B, K, T, ...], mask [B, K, T] bool).
    """
    B, K, T = x.shape[:3]
    mask = torch.ones(B, K, T, dtype=torch.bool, device=x.device)
    if all(d == 0 for d in delays):
        return x, mask
    out = []
    for k, delay in enumerate(delays):
        line = x[:, k].roll(-delay, dims=1)
        if delay > 0:
            line[:, -delay:] = fill_value
            mask[:, k, -delay:] = False
        out.append(line)
    return torch.stack(out, dim=1), mask


class LMModel(nn.Module):
    """Moshi-family LM (temporal transformer over K streams + depformer over the codebooks of one frame).

    Args:
        cfg: the configuration (see :class:`~cspan.core.config.LMConfig`).
        device: where to build the parameters; ``"meta"`` builds without memory (for ``load_state_dict(...,
            assign=True)``).
        dtype: parameter dtype (bfloat16 for the 7B on GPU, float32 for tests).

    Parameters (upstream names): ``emb.{k}.weight`` [card+1, D], ``text_emb.weight`` [text_card+1, D],
    ``text_linear.weight`` [text_card, D], ``out_norm.*``, ``transformer.layers.*``, ``depformer_in.{i}.weight``
    [Dd, D], ``depformer_text_emb.weight`` [text_card+1, Dd or r] (+ ``.low_rank.weight`` [Dd, r]),
    ``depformer_emb.{k}.weight`` [card+1, Dd or r] (k < dep_q - 1), ``depformer.layers.*``,
    ``linears.{k}.weight`` [card, Dd].

    Raises:
        CheckpointError: the config turns on an upstream feature this implementation does not run.
    """

    def __init__(
        self, cfg: LMConfig, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        unsupported = cfg.unsupported_features()
        if unsupported:
            raise CheckpointError(
                f"LM config uses {', '.join(unsupported)}, which cspan's LMModel does not implement; "
                "use a Moshi / PersonaPlex family config (see LMConfig.moshi_7b())"
            )
        self.cfg = cfg
        factory = {"device": device, "dtype": dtype}
        D, Dd = cfg.dim, cfg.depformer_dim
        r = cfg.depformer_low_rank_embeddings

        self.emb = nn.ModuleList([ScaledEmbedding(cfg.card + 1, D, **factory) for _ in range(cfg.n_q)])
        self.text_emb = ScaledEmbedding(cfg.text_card + 1, D, **factory)
        self.text_linear = nn.Linear(D, cfg.text_out_card, bias=cfg.bias_proj, **factory)
        assert cfg.dim_feedforward is not None
        self.transformer = StreamingTransformer(
            d_model=D,
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
        self.out_norm = make_norm(cfg.norm, D, **factory)

        self.depformer_in = nn.ModuleList(
            [nn.Linear(D, Dd, bias=False, **factory) for _ in range(cfg.depformer_in_count)]
        )
        self.depformer_emb = nn.ModuleList(
            [ScaledEmbedding(cfg.card + 1, Dd, low_rank=r, **factory) for _ in range(cfg.dep_q - 1)]
        )
        self.depformer_text_emb = ScaledEmbedding(cfg.text_card + 1, Dd, low_rank=r, **factory)
        self.depformer = StreamingTransformer(**cfg.depformer_transformer_kwargs(), **factory)
        self.depformer_norms: nn.ModuleList | None = None
        if cfg.depformer_norm is not None:
            self.depformer_norms = nn.ModuleList(
                [make_norm(cfg.depformer_norm, Dd, **factory) for _ in range(cfg.dep_q)]
            )
        self.linears = nn.ModuleList([nn.Linear(Dd, cfg.card, bias=cfg.bias_proj, **factory) for _ in range(cfg.dep_q)])

        self.delays: list[int] = list(cfg.delays)
        self.dep_q = cfg.dep_q
        self.n_q = cfg.n_q
        self.card = cfg.card
        self.text_card = cfg.text_card
        if torch.device(device or "cpu").type != "meta":
            self._init_weights()

    # --- ids and sizes ---------------------------------------------------------------------------------------

    @property
    def num_codebooks(self) -> int:
        """K = n_q + 1 streams."""
        return self.n_q + 1

    @property
    def max_delay(self) -> int:
        return max(self.delays)

    @property
    def initial_token_id(self) -> int:
        """Initial (start-of-stream) audio token: ``card``."""
        return self.card

    @property
    def text_initial_token_id(self) -> int:
        """Initial text token: ``text_card``."""
        return self.text_card

    @property
    def zero_token_id(self) -> int:
        """-1: zero input embedding, excluded from the loss."""
        return ZERO_TOKEN_ID

    @property
    def ungenerated_token_id(self) -> int:
        """-2: a position not generated yet (never fed to the model)."""
        return UNGENERATED_TOKEN_ID

    @property
    def device(self) -> torch.device:
        return self.text_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.text_emb.weight.dtype

    def initial_tokens(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[1, K, 1] long: the text initial token in row 0, the audio initial token in rows 1..n_q."""
        tokens = torch.full((1, self.num_codebooks, 1), self.initial_token_id, dtype=torch.long, device=device)
        tokens[:, 0] = self.text_initial_token_id
        return tokens

    # --- building blocks ---------------------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor, plan: ExecutionPlan | None = None) -> torch.Tensor:
        """Temporal transformer input: audio embeddings summed in codebook order, then the text embedding.

        Args:
            tokens: [B, K, T] long (-1 gives a zero contribution).
            plan: a duplex engine's kernel choices (every lookup in one fused kernel when ``plan.fused``).

        Returns:
            [B, T, D] in the model dtype.

        Raises:
            ValueError: K differs from n_q + 1.
        """
        if tokens.dim() != 3 or tokens.shape[1] != self.num_codebooks:
            raise ValueError(f"tokens must be [B, {self.num_codebooks}, T], got {list(tokens.shape)}")
        if plan is not None and plan.fused:  # one launch for every table
            return fused.embed_sum([table.weight for table in [*self.emb, self.text_emb]], tokens, plan.pdl)
        x: torch.Tensor | None = None
        for k in range(self.n_q):
            x = self.emb[k].add_to(x, tokens[:, k + 1])
        return self.text_emb.add_to(x, tokens[:, 0])

    def _depformer_in_index(self, k: int) -> int:
        if not self.cfg.depformer_multi_linear:
            return 0
        schedule = self.cfg.depformer_weights_per_step_schedule
        return schedule[k] if schedule else k

    def _depformer_head(self, k: int, y: torch.Tensor, plan: ExecutionPlan | None = None) -> torch.Tensor:
        norm = None if self.depformer_norms is None else self.depformer_norms[k]
        if self._head_gemv(k, y, norm, plan):  # one launch: the norm as the GEMV's prologue
            fused_norm = None if norm is None else (norm.alpha, norm.eps)
            return fused.gemv(y, self.linears[k].weight, norm=fused_norm, pdl=None if plan is None else plan.pdl)
        if norm is not None:
            y = norm(y)
        return self.linears[k](y)

    def _head_gemv(self, k: int, y: torch.Tensor, norm: nn.Module | None, plan: ExecutionPlan | None) -> bool:
        """Whether a depformer head runs as :func:`cspan.core.modules.fused.gemv` (streaming inference on the GPU,
        when the depformer's own layers do: see :attr:`StreamingTransformer.gemv`)."""
        if y.dim() != 2 or self.cfg.bias_proj or y.shape[0] > fused.GEMV_MAX_ROWS:
            return False
        if norm is not None and not (isinstance(norm, RMSNorm) and norm.compute_dtype == torch.float32):
            return False
        if plan is None and not fused.usable(y, self.linears[k].weight):
            return False
        return self.depformer.gemv_path(y[:, None], self.depformer.weight_sets(k, 1), plan)

    def depformer_projections(self, hidden: torch.Tensor, steps: int | None = None) -> torch.Tensor:
        """The depformer input projections of one frame in one matrix product (streaming inference).

        The projections ``depformer_in[k'](hidden)`` do not depend on the sampled tokens, so one product over
        the stacked weights replaces dep_q small ones inside the sequential depformer loop. The stack is a copy of
        the ``depformer_in`` weights (rebuilt when one of them is replaced or modified in place). A frame that runs
        only the first ``steps`` codebooks (the duplex engine's served step skips the user's) projects only the
        leading weight blocks those codebooks use (a view of the stack: half its bytes at dep_q = 16 and 8 steps).

        Args:
            hidden: [B, D] temporal output of the frame.
            steps: the codebooks the frame runs (None: all dep_q).

        Returns:
            [B, P, Dd] with P = ``len(depformer_in)``, or fewer for ``steps`` (pass to :meth:`depformer_logits` as
            ``projected``: codebook k reads entry ``k'`` of the schedule, present for every k < steps).
        """
        weights = [lin.weight for lin in self.depformer_in]
        key = tuple((w.data_ptr(), w._version, w.dtype) for w in weights)
        cached = getattr(self, "_dep_in_stack", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, torch.cat([w.detach() for w in weights]))
            self._dep_in_stack = cached
        used = len(weights)
        if steps is not None and steps < self.dep_q:
            used = max(self._depformer_in_index(k) for k in range(max(1, steps))) + 1
        rows = used * weights[0].shape[0]
        y = nn.functional.linear(hidden, cached[1][:rows])  # [B, used * Dd]
        return y.view(hidden.shape[0], used, -1)

    # --- training forward ------------------------------------------------------------------------------------

    def forward(self, codes: torch.Tensor) -> LMOutput:
        """Teacher-forced forward with the delay pattern (upstream ``LMModel.forward``).

        1. Delay each stream (roll right by its delay, head = initial token); prepend an all-initial frame.
        2. Temporal transformer on positions [:-1] (position p sees the delayed frame p - 1).
        3. Depformer teacher-forced with positions [1:]: step k gets the text token (k = 0) or audio token k - 1.
        4. Undelay the logits (roll left); NaN and mask False on the last ``delay`` steps and where target == -1.

        Args:
            codes: [B, K, T] long, K = n_q + 1.

        Returns:
            :class:`LMOutput` with logits [B, dep_q, T, card] and text logits [B, 1, T, text_card].

        Raises:
            ValueError: wrong K.
        """
        B, K = codes.shape[:2]
        if self.num_codebooks != K:
            raise ValueError(f"codes must be [B, {self.num_codebooks}, T], got {list(codes.shape)}")
        initial = self.initial_tokens(codes.device)
        delayed = delay_sequence(codes, self.delays, initial)
        delayed = torch.cat([initial.expand(B, -1, -1), delayed], dim=2)  # [B, K, T + 1]

        hidden = self.out_norm(self.transformer(self.embed(delayed[:, :, :-1])))  # [B, T, D]
        text_logits = self.text_linear(hidden)[:, None]  # [B, 1, T, text_card]
        logits = self.depformer_training(delayed[:, :, 1:], hidden)  # [B, dep_q, T, card]

        audio_rows = slice(1, 1 + self.dep_q)
        logits, mask = undelay_sequence(logits, self.delays[audio_rows])
        mask = mask & (codes[:, audio_rows] != self.zero_token_id)
        text_logits, text_mask = undelay_sequence(text_logits, self.delays[:1])
        text_mask = text_mask & (codes[:, :1] != self.zero_token_id)
        return LMOutput(logits=logits, mask=mask, text_logits=text_logits, text_mask=text_mask)

    def forward_delayed(
        self, delayed: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced forward over an ALREADY-DELAYED token sequence (training on spliced sequences).

        :meth:`forward` builds the delayed sequence itself; a sequence with persona prefix and Context Span blocks
        spliced in (``cspan train``, :func:`cspan.core.span.splice_block`) is already in delayed coordinates, so it
        goes here. Position ``i`` reads ``delayed[:, :, :i + 1]`` and predicts ``targets[:, :, i]`` (default
        ``delayed[:, :, i + 1]``): text from the temporal output, then the depformer teacher-forced with the target
        column (step k fed target row k: the text token for k = 0, audio row k otherwise), as in :meth:`forward`.
        Explicit ``targets`` let a caller predict, from the position just before a spliced block, the column that
        follows the block (what the streaming engine predicts there, since it reads the block only afterwards).

        ``forward(codes)`` equals this method on ``delay_tokens(codes, delays, initials, length=T + 1)`` up to the
        undelaying of the outputs (tests/train/test_train_forward_delayed.py).

        Args:
            delayed: [B, K, T] long delayed tokens (-1 = zero embedding), K = n_q + 1.
            targets: [B, K, T - 1] long depformer teacher tokens; default ``delayed[:, :, 1:]``.

        Returns:
            (text_logits [B, T - 1, text_card], audio_logits [B, dep_q, T - 1, card]) in the compute dtype; masks
            are the caller's.

        Raises:
            ValueError: wrong K, fewer than 2 positions, or ``targets`` of the wrong shape.
        """
        if delayed.dim() != 3 or delayed.shape[1] != self.num_codebooks or delayed.shape[2] < 2:
            raise ValueError(f"delayed must be [B, {self.num_codebooks}, T >= 2], got {list(delayed.shape)}")
        B, K, T = delayed.shape
        if targets is None:
            targets = delayed[:, :, 1:]
        elif tuple(targets.shape) != (B, K, T - 1):
            raise ValueError(f"targets must be [{B}, {K}, {T - 1}], got {list(targets.shape)}")
        hidden = self.out_norm(self.transformer(self.embed(delayed[:, :, :-1])))  # [B, T - 1, D]
        text_logits = self.text_linear(hidden)  # [B, T - 1, text_card]
        audio_logits = self.depformer_training(targets, hidden)  # [B, dep_q, T - 1, card]
        return text_logits, audio_logits

    def depformer_training(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Depformer over all frames at once, teacher-forced.

        Args:
            tokens: [B, K, T] long, the (delayed) tokens of each frame; step k is fed token row k (text for k = 0).
            hidden: [B, T, D] temporal output after ``out_norm``.

        Returns:
            [B, dep_q, T, card] logits.
        """
        B, T = tokens.shape[0], tokens.shape[2]
        steps = []
        for k in range(self.dep_q):
            from_hidden = self.depformer_in[self._depformer_in_index(k)](hidden)  # [B, T, Dd]
            emb = self.depformer_text_emb if k == 0 else self.depformer_emb[k - 1]
            from_token = emb(tokens[:, k])  # row 0 is the text token
            steps.append(from_token + from_hidden)
        x = torch.stack(steps, dim=2).view(B * T, self.dep_q, -1)  # one sequence of dep_q steps per frame
        y = self.depformer(x)  # [B * T, dep_q, Dd]
        logits = [self._depformer_head(k, y[:, k]).view(B, T, -1) for k in range(self.dep_q)]
        return torch.stack(logits, dim=1)

    # --- streaming -----------------------------------------------------------------------------------------------

    def new_state(
        self,
        batch_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> LMState:
        """Empty temporal streaming state for ``batch_size`` rows (KV capacity = ``context``; device and dtype
        default to the parameters'; ``kv_dtype`` is the cache's storage dtype, e.g. ``torch.float8_e4m3fn``)."""
        return LMState(self.transformer.new_state(batch_size, device, dtype, kv_dtype=kv_dtype))

    def temporal(
        self,
        tokens: torch.Tensor | None,
        state: LMState,
        rows: torch.Tensor | None = None,
        embeddings: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Streaming temporal forward over T new positions (1 per frame; n for a span or prompt prefill).

        The T positions of each row start at the row's offset; their keys/values are appended to the state and
        the offsets advance by T. A chunk of T positions gives the same result as T single steps.

        Args:
            tokens: [B', K, T] long model input columns (delays and initial tokens already applied), or None
                when ``embeddings`` is given.
            state: from :meth:`new_state`.
            rows: [B'] long rows of ``state`` to advance (None: all rows, B' = B).
            embeddings: [B', T, D] input embeddings fed directly instead of ``tokens`` (voice prompts).

        Returns:
            (hidden [B', T, D] after ``out_norm``, text_logits [B', T, text_card]), in the model dtype.

        Raises:
            ValueError: neither or both of ``tokens`` and ``embeddings``.
        """
        if (tokens is None) == (embeddings is None):
            raise ValueError("temporal() needs exactly one of tokens [B, K, T] or embeddings [B, T, D]")
        x = self.embed(tokens) if tokens is not None else embeddings
        assert x is not None
        hidden = self.out_norm(self.transformer(x, state.transformer, rows))
        return hidden, self.text_linear(hidden)

    def temporal_step(
        self,
        tokens: torch.Tensor,
        state: LMState,
        layout: StepLayout,
        plan: ExecutionPlan,
        embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The duplex engine's temporal step: every session's block and next position in ONE ragged forward.

        Args:
            tokens: [K, T] long input columns: the decode slots, then the ragged tokens (the rows' blocks and
                their next positions; :class:`cspan.core.modules.transformer.StepLayout` says where each goes).
            state: from :meth:`new_state`; the rows' offsets advance by ``block_len + 1``.
            layout: the step's layout.
            plan: the engine's kernel choices.
            embeddings: (values [N, D], use [N] bool) for the N ragged tokens: input embeddings that replace the
                token embeddings of the columns marked in ``use`` (a persona prefix's stored voice embeddings), or
                None.

        Returns:
            (hidden [b, D] after ``out_norm``, text_logits [b, text_card]) at the next positions.
        """
        x = self.embed(tokens[None], plan)[0]  # [T, D]
        if embeddings is not None:
            d = layout.slots
            x = torch.cat([x[:d], torch.where(embeddings[1][:, None], embeddings[0], x[d:])])
        hidden = self.out_norm(self.transformer.forward_step(x, state.transformer, layout, plan))
        return hidden, self.text_linear(hidden)

    def new_depformer_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> TransformerState:
        """Depformer streaming state (KV capacity ``dep_q``); call ``.reset()`` at the start of every frame. On the
        CPU its cache plans are reused from frame to frame (:attr:`~cspan.core.modules.transformer.TransformerState.plans`;
        on a GPU the step is a CUDA graph, or the fused kernels need none)."""
        on_cpu = torch.device(device if device is not None else next(self.depformer.parameters()).device).type == "cpu"
        return self.depformer.new_state(batch_size, device, dtype, capacity=self.dep_q, reuse_plans=on_cpu)

    def depformer_logits(
        self,
        k: int,
        hidden: torch.Tensor,
        prev_token: torch.Tensor,
        dep_state: TransformerState,
        projected: torch.Tensor | None = None,
        plan: ExecutionPlan | None = None,
    ) -> torch.Tensor:
        """Depformer step k of the current frame (upstream ``LMModel.forward_depformer``).

        Input of step k: ``depformer_in[k'](hidden) + emb(prev_token)`` with ``k'`` the schedule's projection
        index, ``emb`` the depformer text embedding for k = 0 and ``depformer_emb[k-1]`` otherwise. The step
        appends one position to ``dep_state`` (which must hold exactly the steps 0..k-1 of this frame: reset it
        before k = 0) and uses weight set ``schedule[k]``.

        Args:
            k: codebook index, 0 <= k < dep_q (a Python int).
            hidden: [B, D] temporal output of this frame (after ``out_norm``).
            prev_token: [B] long, the text token of this frame for k = 0, else the audio token of codebook k - 1.
            dep_state: from :meth:`new_depformer_state`.
            projected: this frame's :meth:`depformer_projections` (the same values, computed once per frame), or
                None to project here.
            plan: a duplex engine's kernel choices (None: the modules decide, see ``StreamingTransformer.fused``).

        Returns:
            [B, card] logits of codebook k, in the model dtype.

        Raises:
            ValueError: k out of range.
        """
        if not 0 <= k < self.dep_q:
            raise ValueError(f"depformer step {k} is outside 0..{self.dep_q - 1}")
        index = self._depformer_in_index(k)
        x = self.depformer_in[index](hidden) if projected is None else projected[:, index]  # [B, Dd]
        emb = self.depformer_text_emb if k == 0 else self.depformer_emb[k - 1]
        if plan is not None and plan.fused and emb.low_rank is None:
            x = fused.embed_add(x, emb.weight, prev_token, plan.pdl)
        else:
            x = emb.add_to(x, prev_token)
        y = self.depformer(x[:, None], dep_state, step=k, plan=plan)[:, 0]  # [B, Dd]
        return self._depformer_head(k, y, plan)

    # --- initialisation --------------------------------------------------------------------------------------

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Random initialisation for models not loaded from a checkpoint: truncated normal (std 1/sqrt(fan_in),
        cut at 3 std) for linears, fused projections and embedding tables (std 1/sqrt(width)), as upstream's
        ``_init_layer``; norms and LayerScale keep their constructor values."""
        for p in self.parameters():
            if p.dim() != 2:
                continue
            std = 1.0 / p.shape[1] ** 0.5
            w = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)
            p.copy_(w.to(p.dtype))
