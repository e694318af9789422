"""Temperature / top-k sampling with per-session noise and no host synchronisation.

Source: kyutai-labs/moshi ``moshi/utils/sampling.py`` (``sample_token``, ``_sample_top_k``, ``_multinomial``):
``probs = softmax(logits_fp32 / temperature)``, keep the ``top_k`` largest probabilities (not renormalised),
then draw with the "exponential race" ``argmax(probs / q)``, ``q ~ Exp(1)``, which is a multinomial draw that
needs no host synchronisation. Greedy (``temperature <= 0``) is the argmax of the float32 logits, first index on
ties.

Two forms of the noise:

- :func:`sample_token` draws it from one ``torch.Generator`` per batch row (upstream's function, per row);
- the duplex engine uses :func:`sample_race` with *counter-based* noise (:func:`cspan.core.modules.fused.race_noise`):
  entry v of stream s (0 text, 1 + k depformer codebook k) at a session's frame counter f is a pure function of
  (the session's seed, f, s, v). A session's tokens then depend only on its seed and its own history, never on its
  batch neighbours, its batch row, a CUDA graph's captured generators or which rows are live; and the GPU kernel
  (:func:`cspan.core.modules.fused.sample_top_k`) computes the same integers in-kernel, with no noise tensor.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .checks import as_index
from .constants import (
    DEFAULT_TEMP,
    DEFAULT_TEMP_TEXT,
    DEFAULT_TOP_K,
    DEFAULT_TOP_K_TEXT,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_TEMPERATURE,
    UNGENERATED,
)
from .modules import fused

if TYPE_CHECKING:
    from .plan import ExecutionPlan


def sample_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    generators: Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """Draw one token per row.

    Args:
        logits: [B, V] in any float dtype (upcast to float32 first, after the model's own rounding).
        temperature: softmax temperature; ``<= 0`` means greedy (argmax, first index on ties, no noise drawn).
        top_k: keep only the ``top_k`` most probable tokens (clamped to V); ``<= 0`` keeps all of them.
        generators: one generator per row, on the logits' device; row ``b``'s noise comes from
            ``generators[b]``. None uses the global generator.

    Returns:
        [B] long token ids in ``[0, V)``.

    Raises:
        ValueError: logits not 2-D, or ``len(generators) != B``.
    """
    if logits.dim() != 2:
        raise ValueError(f"sample_token expects logits [B, V], got shape {tuple(logits.shape)}")
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(dim=-1)
    batch, vocab = logits.shape
    if generators is not None and len(generators) != batch:
        raise ValueError(f"sample_token got {len(generators)} generators for {batch} rows; give one per row")
    probs = torch.softmax(logits / temperature, dim=-1)
    indices: torch.Tensor | None = None
    if 0 < top_k < vocab:
        probs, indices = torch.topk(probs, top_k, dim=-1)
    noise = torch.empty_like(probs)
    if generators is None:
        noise.exponential_(1.0)
    else:
        for b, gen in enumerate(generators):
            noise[b].exponential_(1.0, generator=gen)
    choice = torch.argmax(probs / noise, dim=-1)
    if indices is None:
        return choice
    return indices.gather(-1, choice[:, None])[:, 0]


def sample_race(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_k: int | torch.Tensor,
    noise: torch.Tensor | None,
    max_top_k: int = MAX_TOP_K,
) -> torch.Tensor:
    """Draw one token per row from given Exp(1) noise: ``argmax_{v in top-k} softmax(logits / T)_v / noise_v``.

    The rule of :func:`sample_token` with one noise entry per vocabulary entry (rather than per top-k rank), and
    every logit tied with the k-th largest kept in the race: the same distribution. The GPU kernel
    :func:`cspan.core.modules.fused.sample_top_k` applies this rule.

    Args:
        logits: [B, V] in any float dtype (upcast to float32).
        temperature: one for all rows, or [B] float32 per row; ``<= 0`` means greedy (argmax, first index on
            ties; the row's noise unused).
        top_k: keep the ``top_k`` largest; ``<= 0`` or ``>= V`` keeps all. One for all rows, or [B] long per row
            (static shapes: one top-k of ``min(V, max_top_k)`` entries, each row masked at its own k; a row's k
            above ``max_top_k`` counts as ``max_top_k``).
        noise: [B, V] float32 Exp(1) draws (:func:`cspan.core.modules.fused.race_noise`); None only with a scalar
            temperature ``<= 0``.
        max_top_k: see ``top_k``.

    Returns:
        [B] long.
    """
    x = logits.float()
    if isinstance(temperature, torch.Tensor) or isinstance(top_k, torch.Tensor):
        rows = (x.shape[0],)
        if not isinstance(temperature, torch.Tensor):
            temperature = torch.full(rows, float(temperature), device=x.device)
        if not isinstance(top_k, torch.Tensor):
            top_k = torch.full(rows, int(top_k), dtype=torch.long, device=x.device)
        return RowSampling(temperature, top_k).race(x, noise, max_top_k)
    if temperature <= 0:
        return x.argmax(dim=-1)
    assert noise is not None, "sample_race needs noise when the temperature is > 0"
    s = x / temperature
    weight = torch.exp(s - s.max(dim=-1, keepdim=True).values) / noise
    if 0 < top_k < s.shape[-1]:
        kth = torch.topk(s, top_k, dim=-1).values[:, -1:]
        weight = torch.where(s >= kth, weight, -1.0)
    return weight.argmax(dim=-1)


@dataclass(frozen=True)
class SamplingParams:
    """Temperature and top-k of one stream kind (text, or audio codebooks).

    Defaults: text 0.7 / 25 (:meth:`text`), audio 0.8 / 250 (:meth:`audio`), as upstream ``LMGen``.

    Attributes:
        temperature: 0 (or below) is greedy; the engine's sessions (:meth:`check`) take 0 or
            :data:`~cspan.core.constants.MIN_TEMPERATURE` .. :data:`~cspan.core.constants.MAX_TEMPERATURE`.
        top_k: keep the ``top_k`` most probable tokens; 0 (or below), or the vocabulary size or more, keeps all.
            The engine's sessions take 0 .. :data:`~cspan.core.constants.MAX_TOP_K`, or the vocabulary size or more.
    """

    temperature: float
    top_k: int

    @classmethod
    def text(cls, temperature: float = DEFAULT_TEMP_TEXT, top_k: int = DEFAULT_TOP_K_TEXT) -> SamplingParams:
        return cls(temperature, top_k)

    @classmethod
    def audio(cls, temperature: float = DEFAULT_TEMP, top_k: int = DEFAULT_TOP_K) -> SamplingParams:
        return cls(temperature, top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def check(self, what: str, vocab: int | None = None) -> SamplingParams:
        """These parameters with a temperature of 0 for a negative one, if a session of the engine can use them.

        Args:
            what: the name in error messages ("text", "audio").
            vocab: the stream's vocabulary size (a top-k at or above it keeps all), or None.

        Returns:
            The parameters as a Python float and int (numpy's numbers are read as theirs).

        Raises:
            ValueError: a temperature that is not a real number, infinite, between 0 and MIN_TEMPERATURE or above
                MAX_TEMPERATURE; a top-k that is not an integer, negative, or above MAX_TOP_K and below the
                vocabulary.
        """
        t, k = self.temperature, self.top_k
        real = isinstance(t, numbers.Real) and not isinstance(t, bool)  # numpy's floats and ints too
        if not real or not math.isfinite(t) or t > MAX_TEMPERATURE:  # type: ignore[arg-type, operator]
            raise ValueError(f"{what} temperature {t!r}: give 0 (greedy) or {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}")
        if 0 < t < MIN_TEMPERATURE:  # type: ignore[operator]
            raise ValueError(
                f"{what} temperature {t!r}: use 0 for greedy decoding or a temperature of at least {MIN_TEMPERATURE:g}"
            )
        top_k = as_index(k)  # numpy's and torch's integers too; not a bool or a float
        if top_k is None or top_k < 0:
            raise ValueError(f"{what} top_k {k!r}: give an integer of at least 1, or 0 to keep every token")
        if top_k > MAX_TOP_K and (vocab is None or top_k < vocab):
            raise ValueError(
                f"{what} top_k {top_k}: at most {MAX_TOP_K} (the engine's batched top-k), or 0 to keep every token"
            )
        return SamplingParams(max(0.0, float(t)), top_k)  # type: ignore[arg-type]

    def sample(self, logits: torch.Tensor, generators: Sequence[torch.Generator] | None = None) -> torch.Tensor:
        """:func:`sample_token` with these parameters: logits [B, V] -> [B] long."""
        return sample_token(logits, self.temperature, self.top_k, generators)


@dataclass(frozen=True)
class SessionSampling:
    """One session's sampling: text and audio :class:`SamplingParams` (defaults: upstream ``LMGen``'s)."""

    text: SamplingParams = field(default_factory=SamplingParams.text)
    audio: SamplingParams = field(default_factory=SamplingParams.audio)


@dataclass
class RowSampling:
    """Per-row sampling parameters of one stream kind, on the device (the duplex engine's step).

    Attributes:
        temperature: [b] float32 (``<= 0``: greedy).
        top_k: [b] long (``<= 0`` or ``>= V``: all).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    rules: dict[tuple[int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict, repr=False)
    """:meth:`rule`'s results by (vocab, top): filled on first use, or given (the engine keeps its text rules with
    the parameters, :class:`cspan.core.sessions.EngineState`)."""

    def rule(self, vocab: int, top: int) -> tuple[torch.Tensor, ...]:
        """(greedy [b], divisor [b, 1], index of the k-th largest among the top ``top`` [b, 1], keeps all [b, 1]):
        computed once per vocabulary size, shared by the calls of a step (the depformer's codebooks)."""
        key = (vocab, top)
        if key not in self.rules:
            greedy = self.temperature <= 0
            k = self.top_k.to(torch.long)[:, None]
            self.rules[key] = (
                greedy,
                torch.where(greedy, 1.0, self.temperature.float())[:, None],
                (k - 1).clamp(0, top - 1),
                (k <= 0) | (k >= vocab),
            )
        return self.rules[key]

    def race(self, logits: torch.Tensor, noise: torch.Tensor | None, max_top_k: int = MAX_TOP_K) -> torch.Tensor:
        """:func:`sample_race` with each row's own parameters: logits [b, V] -> [b] long (static shapes: one top-k
        of ``min(V, max_top_k)`` entries, each row masked at its own k; a greedy row takes its argmax)."""
        assert noise is not None, "a per-row race needs noise (greedy rows ignore theirs)"
        x = logits.float()
        V = x.shape[-1]
        top = min(V, max_top_k)
        greedy, divisor, index, keep_all = self.rule(V, top)
        s = x / divisor
        ranked = torch.topk(s, top, dim=-1).values  # [b, top], largest first: its first column is the row's max
        weight = torch.exp(s - ranked[:, :1]) / noise
        kth = ranked.gather(1, index).masked_fill_(keep_all, float("-inf"))
        choice = torch.where(s >= kth, weight, -1.0).argmax(dim=-1)
        return torch.where(greedy, x.argmax(dim=-1), choice)


TOP_K_BOUNDS: tuple[int, ...] = (64, MAX_TOP_K)
"""The static top-k sizes of the engine's batched text sampler (:meth:`RowSampling.race`): the smallest that covers
every stepped row's k is part of the step's graph key. A top-k of 500 over the 32000 text entries is a radix sort
(21.7 us on the H200, ``scripts/step_anatomy.py``), of 64 a bitonic one (about 5 us); the default text k is 25."""


def top_k_bound(top_ks: Sequence[int], vocab: int) -> int:
    """The smallest of :data:`TOP_K_BOUNDS` (capped at ``vocab``) covering each of ``top_ks`` that is below the
    vocabulary (a k ``<= 0`` or ``>= vocab`` keeps every token and needs no top-k): the ``max_top_k`` to pass to
    :meth:`RowSampling.race` for these rows."""
    need = max((k for k in top_ks if 0 < k < vocab), default=1)
    return min(vocab, next((b for b in TOP_K_BOUNDS if b >= need), MAX_TOP_K))


@torch.no_grad()
def sample_column(
    lm: Any,
    hidden: torch.Tensor,
    text_logits: torch.Tensor,
    target: torch.Tensor,
    dep_state: Any,
    *,
    text: RowSampling,
    audio: RowSampling,
    seed: torch.Tensor,
    counter: torch.Tensor,
    plan: ExecutionPlan,
    depformer_steps: int | None = None,
    text_top: int = MAX_TOP_K,
) -> torch.Tensor:
    """Sample one target column: the text token, then the depformer's dep_q codebooks in order.

    Where ``target`` already holds a token (forced, or user codes) that token is kept *and* is what conditions
    the next depformer step; the sampled value is discarded (NVIDIA/personaplex ``LMGen`` "provided" tokens). Source
    of the order: kyutai-labs/moshi ``LMGen._step`` (text first, then ``depformer_step`` over codebooks
    0..dep_q-1, each conditioned on the previous one). The noise of row b is the counter-based noise of
    ``(seed[b], counter[b])`` (module docstring); on the fused path each audio codebook is sampled, forced and
    stored by one kernel. Each row samples with its own temperature and top-k (its session's); a greedy row
    ignores its noise.

    Args:
        lm: the :class:`cspan.core.lm.LMModel` (``depformer_logits``, ``dep_q``).
        hidden: [B, D] temporal output of the fed position (after ``out_norm``).
        text_logits: [B, text_card] text logits of that position.
        target: [B, K] long, the known entries of the target column (-2 = sample).
        dep_state: a depformer state for B rows (``lm.new_depformer_state(B)``); reset here.
        text, audio: each row's sampling parameters ([B] tensors).
        seed, counter: [B] long, each row's session seed and frame counter.
        plan: the engine's kernel choices.
        depformer_steps: run only the first ``depformer_steps`` codebooks (default all dep_q). The depformer is
            causal over codebooks, so the earlier ones are sampled exactly as in a full run; the entries of the
            skipped codebooks keep ``target`` where it is known and are -1 (zero embedding) where it is not. For the
            duplex engine's user-stream predictions, which the user's real codes replace before they are ever fed.
        text_top: the text sampler's static top-k size, at least every row's text k below the vocabulary
            (:func:`top_k_bound`).

    Returns:
        [B, K] long: ``target`` with rows 0..dep_q filled (rows past dep_q are copied from ``target``).
    """
    column = target.clone()
    known = target != UNGENERATED
    steps = lm.dep_q if depformer_steps is None else max(0, min(int(depformer_steps), lm.dep_q))
    if steps < lm.dep_q:
        skipped = column[:, 1 + steps : 1 + lm.dep_q]
        skipped.masked_fill_(skipped == UNGENERATED, -1)

    def noise(stream: int, vocab: int) -> torch.Tensor:
        if plan.fused:
            return fused.race_noise_fused(seed, counter, stream, vocab, plan.pdl)
        return fused.race_noise(seed, counter, stream, vocab)

    token = text.race(text_logits, noise(0, text_logits.shape[-1]), text_top)
    token = torch.where(known[:, 0], target[:, 0], token)
    column[:, 0] = token
    dep_state.reset()
    in_kernel = plan.fused and lm.card <= fused.SAMPLE_MAX_VOCAB
    projected = lm.depformer_projections(hidden, steps) if plan.fused else None
    # eager: every codebook's noise in one call ([B, steps, card]); fused: one kernel per codebook, or in its sampler
    audio_noise = None if plan.fused or steps == 0 else fused.race_noise(seed, counter, range(1, 1 + steps), lm.card)
    for k in range(steps):
        logits = lm.depformer_logits(k, hidden, token, dep_state, projected, plan)
        if in_kernel:
            token = fused.sample_top_k(
                logits, audio.temperature, audio.top_k, seed, counter, 1 + k, target[:, 1 + k], column[:, 1 + k],
                plan.pdl,
            )  # fmt: skip
            continue
        token = audio.race(logits, noise(1 + k, logits.shape[-1]) if audio_noise is None else audio_noise[:, k])
        token = torch.where(known[:, 1 + k], target[:, 1 + k], token)
        column[:, 1 + k] = token
    return column


def make_generator(device: torch.device | str, seed: int | None = None) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (a fresh non-deterministic seed when None)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


__all__ = [
    "TOP_K_BOUNDS",
    "RowSampling",
    "SamplingParams",
    "SessionSampling",
    "make_generator",
    "sample_column",
    "sample_race",
    "sample_token",
    "top_k_bound",
]
